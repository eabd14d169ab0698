"""No-op `dvc repro` of two commits of this project, timed side by side: prints one table.

Usage: python benchmarks/noop_repro.py --base cb2f1f9 --head HEAD [--rounds 5] [--repo CHECKOUT]

Measures the wall time of `dvc repro` on a built pipeline where nothing changed (every stage
"didn't change, skipping"): what DVC's walk of the pipeline costs, which the commit's dvc.yaml and
dvc.lock decide (stages, dependencies, outputs and their files). Each commit gets a `git clone` in a
temporary directory (--workdir) whose DVC cache is --repo's own (`cache.dir` in its
.dvc/config.local, `cache.type` hardlink,symlink so nothing is copied); `dvc checkout` fills its
outputs from that cache. A commit whose outputs are not in the cache, or whose `dvc status` is not
clean, is skipped with DVC's words: this script never builds anything. After one untimed repro
each, the copies are timed in turn, A, B, A, B, ... (the machine's load drifts alike for both),
and the table gives the median and minimum per commit and their ratio head / base.

DVC is the one of the interpreter that runs this script (the project's venv), the same for both
commits. A no-op repro runs no stage command; should a stage run anyway, `python` on its PATH
is a stub that fails at once, so nothing trains, and the script stops.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from bench_dvc import markdown_table

SKIPPED = re.compile(r"Stage '[^']+' didn't change, skipping")
STUB_PYTHON = '#!/bin/sh\necho "noop_repro: a stage tried to run: python $*" >&2\nexit 97\n'


@dataclass
class Copy:
    """One commit's clone and its timings; `skipped` says why it was not timed."""

    commit: str
    subject: str
    path: Path
    stages: int = 0
    seconds: list[float] = field(default_factory=list)
    skipped: str = ""


def run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `cmd`, its output captured; the caller checks the return code."""
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def git(repo: Path, *args: str) -> str:
    proc = run(["git", *args], repo)
    if proc.returncode != 0:
        sys.exit(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def dvc(copy: Copy, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "dvc", *args], copy.path, env)


def default_repo() -> Path:
    """The main worktree of the repository this script is in (where the DVC cache is)."""
    common = git(Path(__file__).parent, "rev-parse", "--path-format=absolute", "--git-common-dir")
    return Path(common).parent


def dvc_env(scratch: Path) -> dict[str, str]:
    """The project's environment for DVC, its site cache in `scratch`, and a failing `python` stub."""
    stub = scratch / "stub-bin"
    stub.mkdir()
    for name in ("python", "python3"):
        (stub / name).write_text(STUB_PYTHON)
        (stub / name).chmod(0o755)
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_SITE_CACHE_DIR=str(scratch / "dvc-site-cache"),
               GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false", NO_GCE_CHECK="true")
    env["PATH"] = f"{stub}{os.pathsep}{env['PATH']}"
    return env


def clone(repo: Path, rev: str, role: str, scratch: Path) -> Copy:
    """A clone of `repo` at `rev` (sharing its git objects) in scratch/`role`, with no DVC outputs yet."""
    commit = git(repo, "rev-parse", "--short", f"{rev}^{{commit}}")
    path = scratch / role
    git(repo, "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(path))
    git(path, "checkout", "--quiet", "--detach", commit)
    return Copy(commit, git(path, "log", "-1", "--format=%s"), path)


def check_out_outputs(copy: Copy, cache: Path, env: dict[str, str]) -> None:
    """Point the copy at `cache` and link its dvc.lock's outputs from there; skip it if some are missing."""
    for args in (("cache", "dir", "--local", str(cache)), ("config", "--local", "cache.type", "hardlink,symlink")):
        proc = dvc(copy, env, *args)
        if proc.returncode != 0:
            sys.exit(f"dvc {' '.join(args)} failed in {copy.path}:\n{proc.stdout}{proc.stderr}")
    proc = dvc(copy, env, "checkout")
    if proc.returncode != 0:
        copy.skipped = f"outputs missing from {cache} (this script does not rebuild them)"
        print(f"[noop] {copy.commit}: `dvc checkout` failed:\n{proc.stdout}{proc.stderr}", file=sys.stderr)


def check_up_to_date(copy: Copy, env: dict[str, str]) -> None:
    """Skip the copy unless `dvc status` says that nothing would run."""
    proc = dvc(copy, env, "status")
    if proc.returncode != 0 or "Data and pipelines are up to date." not in proc.stdout:
        copy.skipped = "`dvc status` not clean (its dvc.lock is not this commit's code)"
        print(f"[noop] {copy.commit}: `dvc status` says:\n{proc.stdout}{proc.stderr}", file=sys.stderr)
        return
    copy.stages = len(yaml.safe_load((copy.path / "dvc.lock").read_text())["stages"])


def noop_repro(copy: Copy, env: dict[str, str]) -> float:
    """Wall time of one `dvc repro`; stops the script unless every stage was skipped."""
    start = time.perf_counter()
    proc = dvc(copy, env, "repro")
    seconds = time.perf_counter() - start
    skipped = len(SKIPPED.findall(proc.stdout))
    if proc.returncode != 0 or "Running stage" in proc.stdout or skipped != copy.stages:
        sys.exit(f"`dvc repro` in {copy.path} was not a no-op ({skipped} of {copy.stages} stages "
                 f"skipped, rc={proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return seconds


def time_in_turn(copies: list[Copy], rounds: int, env: dict[str, str]) -> None:
    """One untimed repro per copy, then `rounds` rounds of one timed repro per copy, in turn."""
    ready = [c for c in copies if not c.skipped]
    for copy in ready:
        noop_repro(copy, env)
    for number in range(1, rounds + 1):
        for copy in ready:
            copy.seconds.append(noop_repro(copy, env))
        print(f"[noop] round {number}/{rounds}: "
              + ", ".join(f"{c.commit} {c.seconds[-1]:.2f} s" for c in ready), file=sys.stderr, flush=True)


def print_table(base: Copy, head: Copy) -> None:
    cells = []
    for role, copy in (("base", base), ("head", head)):
        if copy.skipped:
            cells.append((role, copy.commit, copy.subject[:50], "", "skipped", "", ""))
        else:
            cells.append((role, copy.commit, copy.subject[:50], str(copy.stages), str(len(copy.seconds)),
                          f"{statistics.median(copy.seconds):.2f}", f"{min(copy.seconds):.2f}"))
    if base.seconds and head.seconds:
        cells.append(("head / base", "", "", "", "",
                      f"{statistics.median(head.seconds) / statistics.median(base.seconds):.2f}",
                      f"{min(head.seconds) / min(base.seconds):.2f}"))
    print(markdown_table(("", "commit", "subject", "stages", "runs", "median s", "min s"), cells))
    for copy in (base, head):
        if copy.skipped:
            print(f"{copy.commit} skipped: {copy.skipped}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against (A)")
    parser.add_argument("--head", default="HEAD", help="the commit measured (B)")
    parser.add_argument("--rounds", type=int, default=5, help="timed repros per commit")
    parser.add_argument("--repo", type=Path, default=None,
                        help="repository with the commits and the built pipeline's DVC cache "
                             "(default: the main worktree of this script's repository)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the copies go (default: temp dir)")
    args = parser.parse_args()
    repo = (args.repo or default_repo()).resolve()
    cache = repo / ".dvc" / "cache"
    with tempfile.TemporaryDirectory(prefix="noop-repro-", dir=args.workdir) as tmp:
        scratch = Path(tmp)
        env = dvc_env(scratch)
        copies = [clone(repo, args.base, "base", scratch), clone(repo, args.head, "head", scratch)]
        for copy in copies:
            check_out_outputs(copy, cache, env)
            if not copy.skipped:
                check_up_to_date(copy, env)
        time_in_turn(copies, args.rounds, env)
        print_table(*copies)


if __name__ == "__main__":
    main()
