"""How well each stage's address (what DVC hashes for it) fits what it computes, replayed over the
project's own history: no stage is run, only git is read.

For each commit of HEAD's first-parent history that changed dvc.lock, a stage whose recorded
dependencies moved against the previous dvc.lock was rerun there (the committed lock comes from
running the committed code). When its outputs' hashes did not move, the rerun was **waste**: time
spent to write the same bytes. Each waste is put down to what moved in its dependencies:

* code: only the fingerprints of its modules (`code:` of its view, views/<branch>/<stage>.yaml); the
  modules whose fingerprints moved in such reruns of the training stages are listed after the table;
* tools: the versions of its tools (`tools:`) and maybe code;
* values: the configuration values it reads (and maybe code or tools);
* inputs: only its input data (another stage's outputs, or embedded/ for a download).

What the replay cannot see: a change of behaviour that no dependency recorded (a **miss**, an
output left stale). The suite looks for those at HEAD: tests/pipeline/test_reproducible.py reruns the SFT
branch with --force and requires the same bytes, and tests/pipeline/test_toolchain.py fails while the
committed record is not what the committed code makes.

Usage: python benchmarks/address_replay.py [--since REV]   (REV: count only commits after it)
"""

from __future__ import annotations

import argparse
import subprocess
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ("train_sft@sft", "train_sft@rl", "train_rl")


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def at(rev: str, path: str) -> Any:
    """A YAML file as committed at ``rev`` (None where it did not exist)."""
    proc = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return yaml.safe_load(proc.stdout) if proc.returncode == 0 else None


def hashes(entries: list[dict] | None) -> dict[str, str]:
    return {e["path"]: e.get("md5") or e.get("hash") or "" for e in entries or []}


def cause(moved: set[str], old_rev: str, new_rev: str) -> tuple[str, set[str]]:
    """What moved in a rerun stage's dependencies (code, tools, values or inputs), and the modules
    whose fingerprints moved."""
    views = sorted(p for p in moved if p.startswith("views/"))
    if not views:
        return "inputs", set()
    kinds, modules = set(), set()
    for path in views:
        before, after = at(old_rev, path) or {}, at(new_rev, path) or {}
        for key in set(before) | set(after):
            if before.get(key) != after.get(key):
                kinds.add(key if key in ("code", "tools") else "values")
        code_before, code_after = before.get("code") or {}, after.get("code") or {}
        modules |= {m for m in set(code_before) | set(code_after) if code_before.get(m) != code_after.get(m)}
    return ("values" if "values" in kinds else "tools" if "tools" in kinds else "code"), modules


def replay(since: str | None) -> tuple[dict[str, Counter], Counter, int]:
    revs = git("log", "--first-parent", "--reverse", "--format=%H", "HEAD", "--", "dvc.lock").split()
    if since:
        after = set(git("rev-list", f"{since}..HEAD").split())
        first = next((i for i, rev in enumerate(revs) if rev in after), len(revs))
        revs = revs[max(first - 1, 0):]   # the lock before the first counted commit is the baseline
    counts: dict[str, Counter] = defaultdict(Counter)
    culprits: Counter = Counter()   # module -> training-stage reruns to the same bytes its fingerprint caused
    previous = None
    for rev in revs:
        lock = at(rev, "dvc.lock") or {}
        stages = lock.get("stages", {})
        if previous is not None:
            old_rev, old = previous
            for name, entry in stages.items():
                if name == "configure" or name not in old:
                    continue
                before, now = old[name], entry
                deps_before, deps_now = hashes(before.get("deps")), hashes(now.get("deps"))
                moved = {p for p in deps_now if deps_now[p] != deps_before.get(p)}
                if not moved:
                    continue
                counts[name]["reruns"] += 1
                if hashes(before.get("outs")) == hashes(now.get("outs")):
                    counts[name]["waste"] += 1
                    kind, modules = cause(moved, old_rev, rev)
                    counts[name][kind] += 1
                    if name in TRAINING and kind == "code":
                        culprits.update(modules)
        previous = (rev, stages)
    return counts, culprits, len(revs) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--since", help="count only the commits after this revision")
    args = parser.parse_args()
    counts, culprits, commits = replay(args.since)
    print(f"{commits} commits changed dvc.lock" + (f" after {args.since}" if args.since else ""))
    head = ("stage", "reruns", "same bytes (waste)", "code", "tools", "values", "inputs")
    rows = [(name, *(str(c[k]) for k in ("reruns", "waste", "code", "tools", "values", "inputs")))
            for name, c in sorted(counts.items(), key=lambda item: (item[0] not in TRAINING, item[0]))]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    waste = sum(counts[name]["waste"] for name in TRAINING)
    print(f"training stages: {waste} reruns to the same bytes; the modules whose fingerprints moved in "
          "those caused by code alone, most often first:")
    for module, n in culprits.most_common(10):
        print(f"  {n:3d}  {module}")


if __name__ == "__main__":
    main()
