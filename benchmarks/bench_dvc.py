"""How much DVC costs around the pipeline: prints one table, every ratio measured in this run.

Rows:
* no-op `dvc repro` of a pipeline repo vs bare DVC on as many trivial stages (median of --runs),
  vs the same trivial stages written with foreach as the project's branches are, and vs trivial
  stages with the pipeline's own dependency and output trees (what DVC's walk of the data costs);
* `dvc add` of a synthetic orbax-like checkpoint (--size): first (hash + cache) vs second (state db);
* disk used by workspace + cache for that checkpoint, per cache type, as a multiple of its size;
* each stage's wall time vs the MaxText command it wraps (needs the stage's `--print-command`;
  runs training, so only with --stage-overhead).

Everything is created under a temporary directory (--workdir) and deleted at the end.
Usage: python benchmarks/bench_dvc.py [REPO] [--size 3GiB] [--runs 5] [--stage-overhead]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
DEFAULT_CACHE_TYPE = "reflink,copy"  # what DVC uses when cache.type is unset
CHOSEN_CACHE_TYPE = "hardlink,copy"  # docs/remote-and-cache.md
CACHE_TYPES = [DEFAULT_CACHE_TYPE, CHOSEN_CACHE_TYPE, "symlink", "reflink,hardlink"]
MiB = 2**20
GiB = 2**30


@dataclass
class Row:
    """One line of the table: a measurement, its side-by-side baseline, and their ratio."""

    what: str
    measured: str
    baseline: str
    ratio: float | None
    goal: str = ""


# ----------------------------------------------------------------------------- running things


def dvc_env(scratch: Path | None) -> dict[str, str]:
    """DVC without analytics; `scratch` isolates the state db of repos this script creates."""
    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    if scratch is not None:
        env["DVC_SITE_CACHE_DIR"] = str(scratch / "dvc-site-cache")
    return env


def run(cmd: list[str] | str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run (a list, or a shell line), raising with the output if it fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, shell=isinstance(cmd, str))
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed in {cwd} (rc={proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return proc


def timed(cmd: list[str] | str, cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    run(cmd, cwd, env)
    return time.perf_counter() - start


def dvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "dvc", *args]


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- no-op dvc repro


def synthetic_pipeline(repo: Path, stages: int, realistic: bool) -> None:
    """A chain of `stages` stages. Realistic: script + module + params deps and a 40-file output
    directory per stage, like the project's stages; otherwise one `echo` into one file."""
    lines = ["stages:"]
    if realistic:
        (repo / "lib").mkdir()
        for i in range(5):
            (repo / "lib" / f"mod{i}.py").write_text(f"VALUE = {i}\n" * 200)
        (repo / "params.yaml").write_text("".join(f"s{i}:\n  steps: {i}\n  lr: 0.001\n" for i in range(stages)))
        (repo / "stage.py").write_text(textwrap.dedent("""\
            import sys
            from pathlib import Path
            i = int(sys.argv[1])
            out = Path(f"out{i}")
            out.mkdir()
            for j in range(40):
                (out / f"part{j}.bin").write_bytes(bytes([i, j]) * 5000)
        """))
    for i in range(stages):
        if realistic:
            deps = ["stage.py", *[f"lib/mod{k}.py" for k in range(5)]] + ([f"out{i - 1}"] if i else [])
            lines += [f"  s{i}:", f"    cmd: python stage.py {i}", f"    deps: {deps}",
                      f"    params: [s{i}]", f"    outs: [out{i}]"]
        else:
            deps = [f"out{i - 1}.txt"] if i else []
            lines += [f"  s{i}:", f"    cmd: echo {i} > out{i}.txt", f"    deps: {deps}", f"    outs: [out{i}.txt]"]
    (repo / "dvc.yaml").write_text("\n".join(lines) + "\n")


def foreach_pipeline(repo: Path, stages: int) -> None:
    """`stages` trivial stages like :func:`synthetic_pipeline`'s, written as the project writes its
    branches: one stage, then chains of `foreach: [x, y]` stages (DVC's templating has a cost of its
    own, an import of its parser, that a pipeline without `${...}` does not pay)."""
    lines = ["stages:", "  s0:", "    cmd: echo 0 > out0.txt", "    outs: [out0.txt]"]
    previous = "out0.txt"
    for i in range((stages - 1) // 2):
        out = f"t{i}-${{item}}.txt"
        lines += [f"  t{i}:", "    foreach: [x, y]", "    do:", f"      cmd: echo ${{item}} > {out}",
                  f'      deps: ["{previous}"]', f'      outs: ["{out}"]']
        previous = out
    (repo / "dvc.yaml").write_text("\n".join(lines) + "\n")


def path_shape(path: Path) -> list[str] | None:
    """The relative paths of the files DVC counts under a directory (not __pycache__, *.pyc, as the
    project's .dvcignore says); None for a file."""
    if not path.is_dir():
        return None
    return sorted(str(f.relative_to(path)) for f in path.rglob("*")
                  if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc")


def same_data_pipeline(repo: Path, target: Path, env: dict[str, str]) -> None:
    """Trivial stages with the target's data: one stage per stage of the target's dvc.lock, with the
    same dependency and output paths, each a file or a directory of as many files at the same
    relative paths (16 bytes each). Against it, a no-op repro of the target shows what the project's
    stages cost beyond DVC walking their data. The deps no stage makes are written here, by the
    script the stages run."""
    import yaml

    lock = yaml.safe_load((target / "dvc.lock").read_text())["stages"]
    produced = {out["path"] for stage in lock.values() for out in stage.get("outs", [])}
    manifest: dict[str, dict[str, list[str] | None]] = {"sources": {}}
    lines = ["stages:"]
    for i, stage in enumerate(lock.values()):
        deps = [dep["path"] for dep in stage.get("deps", [])]
        manifest["sources"].update({dep: path_shape(target / dep) for dep in deps if dep not in produced})
        outs = [out["path"] for out in stage.get("outs", [])]
        manifest[f"s{i}"] = {out: path_shape(target / out) for out in outs}
        lines += [f"  s{i}:", f"    cmd: python make_paths.py s{i}", f"    deps: {json.dumps(deps)}",
                  f"    outs: {json.dumps(outs)}"]
    (repo / "paths.json").write_text(json.dumps(manifest))
    (repo / "make_paths.py").write_text(textwrap.dedent("""\
        import json, sys
        from pathlib import Path
        for top, files in json.loads(Path("paths.json").read_text())[sys.argv[1]].items():
            for rel in (files if files is not None else [""]):
                path = Path(top, rel)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{top}/{rel}"[-16:].rjust(16))
    """))
    run([sys.executable, "make_paths.py", "sources"], repo, env)
    shutil.copy(target / ".dvcignore", repo / ".dvcignore")
    (repo / "dvc.yaml").write_text("\n".join(lines) + "\n")


def make_repo(repo: Path, env: dict[str, str], cache_type: str | None = None) -> None:
    repo.mkdir(parents=True)
    run(dvc("init", "-q", "--no-scm"), repo, env)
    if cache_type:
        run(dvc("config", "cache.type", cache_type), repo, env)


def noop_row(repo: Path, fall_back: bool, scratch: Path, runs: int) -> list[Row]:
    """The no-op repro row for `repo`; the synthetic pipeline if the default repo is not ready."""
    ready = (repo / "dvc.yaml").exists() and subprocess.run(
        dvc("status", "--quiet"), cwd=repo, env=dvc_env(None), capture_output=True).returncode == 0
    if ready:
        return noop_repro_row(repo, scratch, runs)
    if fall_back:
        return noop_repro_row(None, scratch, runs, f", {repo} not reproduced yet")
    return [Row(f"no-op dvc repro ({repo})", "skipped: pipeline not up to date, run `dvc repro` first",
                "", None, "<= 1.2")]


def noop_repro_seconds(repo: Path, env: dict[str, str]) -> float:
    """Time one `dvc repro` that must run no stage."""
    start = time.perf_counter()
    output = run(dvc("repro"), repo, env).stdout
    seconds = time.perf_counter() - start
    if "Running stage" in output:
        raise RuntimeError(f"`dvc repro` in {repo} ran a stage, so it is not a no-op:\n{output}")
    return seconds


def stage_count(repo: Path, env: dict[str, str]) -> int:
    return len(run(dvc("stage", "list", "--name-only"), repo, env).stdout.split())


def noop_repro_row(target: Path | None, scratch: Path, runs: int, why_synthetic: str = "") -> list[Row]:
    """Median no-op `dvc repro` of `target` (None: a synthetic 9-stage pipeline) vs as many trivial
    stages, plain and written with foreach; the three are timed in turn, run after run."""
    env = dvc_env(scratch)
    if target is None:
        target = scratch / "synthetic"
        make_repo(target, env)
        synthetic_pipeline(target, 9, realistic=True)
        run(dvc("repro", "-q"), target, env)
        target_env, label = env, f"synthetic{why_synthetic}"
    else:
        target_env, label = dvc_env(None), str(target)  # the repo's own state db
    stages = stage_count(target, target_env)
    bare = scratch / "bare"
    make_repo(bare, env)
    synthetic_pipeline(bare, stages, realistic=False)
    run(dvc("repro", "-q"), bare, env)
    templated = scratch / "bare-foreach"
    make_repo(templated, env)
    foreach_pipeline(templated, stages)
    run(dvc("repro", "-q"), templated, env)
    same_data = scratch / "bare-same-data"
    make_repo(same_data, env)
    same_data_pipeline(same_data, target, env)
    run(dvc("repro", "-q"), same_data, env)
    progress(f"no-op repro: {label} ({stages} stages) vs {stages} trivial stages, {runs} runs each")
    ours, plain, foreach, with_data = [], [], [], []
    for _ in range(runs):
        ours.append(noop_repro_seconds(target, target_env))
        plain.append(noop_repro_seconds(bare, env))
        foreach.append(noop_repro_seconds(templated, env))
        with_data.append(noop_repro_seconds(same_data, env))
    a, b, c, d = (statistics.median(times) for times in (ours, plain, foreach, with_data))
    return [Row(f"no-op dvc repro, {stages} stages ({label}) vs {stages} trivial", f"{a:.2f} s",
                f"{b:.2f} s", a / b, "<= 1.2"),
            Row(f"no-op dvc repro, {stages} stages ({label}) vs {stages} trivial with foreach", f"{a:.2f} s",
                f"{c:.2f} s", a / c),
            Row(f"no-op dvc repro, {stages} stages ({label}) vs {stages} trivial with its data's files",
                f"{a:.2f} s", f"{d:.2f} s", a / d)]


# --------------------------------------------------------------------- checkpoint hashing / disk


def write_checkpoint(root: Path, size: int) -> None:
    """An orbax/OCDBT-like checkpoint: 4 large data files (96 %) and 400 small files (4 %)."""
    items = root / "0" / "items"
    (items / "d").mkdir(parents=True)
    (items / "ocdbt.process_0" / "d").mkdir(parents=True)
    for name in ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "manifest.ocdbt"):
        (items / name).write_text(f'{{"file": "{name}"}}\n')
    block = bytearray(os.urandom(16 * MiB))
    large = int(size * 0.96) // 4
    for i in range(4):
        with open(items / "d" / f"{i:032x}", "wb") as f:
            for offset in range(0, large, len(block)):
                block[:16] = f"{i:08d}{offset:08x}".encode()[:16]
                f.write(block[: min(len(block), large - offset)])
    small = max(4096, (size - 4 * large) // 400)
    for i in range(400):
        (items / "ocdbt.process_0" / "d" / f"{i:032x}").write_bytes(i.to_bytes(4, "big") + block[4:small])


def disk_used(*roots: Path) -> int:
    """Bytes allocated under `roots`, counting each inode once (hardlinks) and not following links."""
    seen, total = set(), 0
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def checkpoint_rows(scratch: Path, size: int, cache_types: list[str]) -> list[Row]:
    """Per cache type: first vs second `dvc add` of the checkpoint, then disk used / size."""
    need = int(2.1 * size) + 256 * MiB
    free = shutil.disk_usage(scratch).free
    if free < need:
        raise SystemExit(f"--size {size / GiB:.2f} GiB needs {need / GiB:.1f} GiB free in {scratch}, "
                         f"only {free / GiB:.1f} GiB: pass a smaller --size or another --workdir")
    env = dvc_env(scratch)
    rows, disk = [], {}
    for cache_type in cache_types:
        repo = scratch / f"ckpt-{re.sub(r'[^a-z]+', '-', cache_type)}"
        make_repo(repo, env, cache_type)
        progress(f"checkpoint {size / GiB:.2f} GiB, cache.type {cache_type}: writing, then dvc add twice")
        write_checkpoint(repo / "ckpt", size)
        actual = disk_used(repo / "ckpt")
        first = timed(dvc("add", "-q", "ckpt"), repo, env)
        second = timed(dvc("add", "-q", "ckpt"), repo, env)
        disk[cache_type] = disk_used(repo / "ckpt", repo / ".dvc" / "cache") / actual
        mb = actual / 1e6
        rows.append(Row(f"dvc add {size / GiB:.2f} GiB checkpoint, first vs second (state db), {cache_type}",
                        f"{first:.1f} s ({mb / first:.0f} MB/s)", f"{second:.1f} s ({mb / second:.0f} MB/s)",
                        first / second))
        shutil.rmtree(repo)
    for cache_type, multiple in disk.items():
        if cache_type != DEFAULT_CACHE_TYPE:
            baseline = disk.get(DEFAULT_CACHE_TYPE)
            rows.append(Row(f"disk (workspace + cache) / checkpoint size, {cache_type} vs default",
                            f"{multiple:.2f}x", f"{baseline:.2f}x" if baseline else "not measured",
                            multiple / baseline if baseline else None, "<= 1.05" if cache_type == CHOSEN_CACHE_TYPE else ""))
    return rows


# ------------------------------------------------------------------- stage vs direct MaxText


@dataclass
class StageInfo:
    """What the benchmark needs to know about one (foreach-expanded) stage."""

    cmd: str
    outs: list[str]
    uncached_outs: list[str]


def stage_infos(repo: Path, env: dict[str, str]) -> dict[str, StageInfo]:
    """Stage name -> StageInfo, for the stages whose `cmd` runs a module in stages/."""
    code = ("import json, sys; from dvc.repo import Repo\n"
            "print(json.dumps({s.addressing: [s.cmd, [str(o) for o in s.outs],"
            " [str(o) for o in s.outs if not o.use_cache]] for s in Repo(sys.argv[1]).index.stages if s.cmd}))")
    found = json.loads(run([sys.executable, "-c", code, str(repo)], repo, env).stdout)
    return {name: StageInfo(*info) for name, info in found.items() if stage_script(info[0])}


def command_argv(cmd: str) -> list[str]:
    """A dvc.yaml `cmd` as argv, without the `exec` the project's commands start with."""
    argv = shlex.split(cmd)
    return argv[1:] if argv[:1] == ["exec"] else argv


def stage_script(cmd: str) -> str | None:
    """`stages/<stage>.py` for `python stages/<stage>.py ...` or `python -m stages.<stage> ...`."""
    argv = command_argv(cmd)
    if argv[:2] == ["python", "-m"] and len(argv) > 2 and argv[2].startswith("stages."):
        return argv[2].replace(".", "/") + ".py"
    if len(argv) > 1 and argv[0] == "python" and argv[1].startswith("stages/"):
        return argv[1]
    return None


def remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def printed_command(repo: Path, cmd: str, env: dict[str, str]) -> tuple[str | None, str]:
    """(`[env K=V ...] python -m mtpipe.maxtext.adapter.<kind> ...` that the stage would run, or None; why not).

    The flag is MaxText's runner's (mtpipe.maxtext.runner.run): a stage that runs no MaxText command
    would ignore it and run whole, so it is passed only to a script that imports mtpipe.maxtext or
    mtpipe.training.
    """
    argv, script = command_argv(cmd), stage_script(cmd)
    source = (repo / script).read_text() if script and (repo / script).is_file() else ""
    if not re.search(r"^from mtpipe\.(maxtext|training)\b", source, re.M):
        return None, f"{script} runs no MaxText command"
    try:
        proc = subprocess.run([*argv, "--print-command"], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None, f"`{cmd} --print-command` ran over 120 s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines and re.match(r"(env (\S+=\S+ )+)?python -m mtpipe\.maxtext\.(adapter\.\w+|launch_rl_cpu) ", lines[-1]):
        return lines[-1], ""
    said = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["nothing"]
    return None, f"`{cmd} --print-command` gave rc={proc.returncode}: {said[0][:80]}"


def stage_overhead_rows(repo: Path, scratch: Path, enabled: bool, only: list[str] | None = None) -> list[Row]:
    """Each stage's wall time vs its MaxText command run directly, in a clone sharing repo's cache.

    The clone (git clone + `cache.dir` = repo's cache + `dvc checkout`) keeps repo's workspace and
    cache untouched: stage scripts run outside DVC, so nothing is committed.
    """
    what = "stage wall time vs direct MaxText command"
    if not enabled:
        return [Row(what, "skipped: runs training, pass --stage-overhead", "", None)]
    if not (repo / "dvc.yaml").exists() or not (repo / ".git").exists():
        return [Row(what, f"skipped: {repo} is not a git repo with dvc.yaml", "", None)]
    env = dvc_env(None)
    clone = scratch / "clone"
    run(["git", "clone", "-q", str(repo), str(clone)], scratch, env)
    run(dvc("cache", "dir", "--local", str(repo / ".dvc" / "cache")), clone, env)
    run(dvc("checkout", "--allow-missing"), clone, env)
    stages = stage_infos(clone, env)
    for info in stages.values():  # outputs DVC does not cache (resolved configs): take repo's
        for out in info.uncached_outs:
            if (repo / out).is_file() and not (clone / out).exists():
                (clone / out).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(repo / out, clone / out)
    rows = []
    for name, info in stages.items():
        if only and name not in only:
            continue
        launch, why = printed_command(clone, info.cmd, env)
        if launch is None:
            rows.append(Row(f"{what}: {name}", f"skipped: {why}", "", None))
            continue
        progress(f"stage {name}: warm-up of the direct command, then both timed")
        outs = [clone / out for out in info.outs if out not in info.uncached_outs]
        times = {}
        for label, cmd in (("warm-up", launch), ("direct", launch), ("stage", info.cmd)):
            remove(outs)  # DVC deletes a stage's outputs before running it: start alike
            times[label] = timed(cmd, clone, env)
        rows.append(Row(f"{what}: {name}", f"{times['stage']:.1f} s", f"{times['direct']:.1f} s",
                        times["stage"] / times["direct"]))
    return rows


# ----------------------------------------------------------------------------------- output


def markdown_table(header: tuple[str, ...], cells: list[tuple[str, ...]]) -> str:
    """A Markdown table with padded columns."""
    lines = [header, *cells]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in lines]
    text.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(text)


def print_table(rows: list[Row]) -> None:
    header = ("what", "measured", "baseline", "ratio", "goal")
    print(markdown_table(header, [(r.what, r.measured, r.baseline, f"{r.ratio:.2f}" if r.ratio else "", r.goal)
                                  for r in rows]))


def parse_size(text: str) -> int:
    match = re.fullmatch(r"([\d.]+)\s*(GiB|MiB|G|M)?", text)
    if not match:
        raise argparse.ArgumentTypeError(f"--size {text!r}: use e.g. 3GiB or 512MiB")
    return int(float(match.group(1)) * (MiB if (match.group(2) or "G").startswith("M") else GiB))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("repo", nargs="?", type=Path, default=PROJECT,
                        help="pipeline repo (default: this project; a synthetic 9-stage one if it has no dvc.yaml)")
    parser.add_argument("--size", type=parse_size, default=3 * GiB, help="checkpoint size (default 3GiB)")
    parser.add_argument("--runs", type=int, default=5, help="no-op repro runs per side (median)")
    parser.add_argument("--cache-types", default=";".join(CACHE_TYPES), help="';'-separated cache.type values")
    parser.add_argument("--stage-overhead", action="store_true", help="also time stages vs MaxText (trains)")
    parser.add_argument("--stages", help="comma-separated stages for --stage-overhead (default: all)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    repo = args.repo.resolve()
    with tempfile.TemporaryDirectory(prefix="bench_dvc_", dir=args.workdir) as tmp:
        scratch = Path(tmp)
        rows = noop_row(repo, repo == PROJECT, scratch, args.runs)
        rows += checkpoint_rows(scratch, args.size, args.cache_types.split(";"))
        rows += stage_overhead_rows(repo, scratch, args.stage_overhead,
                                    args.stages.split(",") if args.stages else None)
    print_table(rows)


if __name__ == "__main__":
    main()
