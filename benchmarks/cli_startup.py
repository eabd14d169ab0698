"""How long doit takes to answer on the project's dodo.py: prints one table, measured side by side.

Rows: `doit list` and `doit help vm_run` on this project's dodo.py, each next to the same command on
a trivial dodo.py (one task, in a temporary directory): the median wall time of --runs runs of each,
alternating, and their ratio. The goal is a ratio <= 1.5: dodo.py imports only doit and the VM's
environment names, each task's action imports what it runs (docs/decisions/reporting.md).

Usage: python benchmarks/cli_startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
TRIVIAL = 'def task_hello():\n    """Say hello."""\n    return {"actions": ["echo hello"]}\n'
GOAL = 1.5
COMMANDS = {"doit list": (["list"], ["list"]), "doit help vm_run": (["help", "vm_run"], ["help", "hello"])}


def wall_s(dodo: Path, args: list[str], workdir: Path) -> float:
    """Seconds one `python -m doit -f DODO ARGS` takes, from process start to exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "doit", "-f", str(dodo), "-d", str(workdir), *args],
                   check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each command (median)")
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp:
        trivial = Path(tmp) / "dodo.py"
        trivial.write_text(TRIVIAL)
        rows = []
        for label, (project_args, trivial_args) in COMMANDS.items():
            wall_s(PROJECT / "dodo.py", project_args, PROJECT)   # warm the bytecode and the page cache
            wall_s(trivial, trivial_args, Path(tmp))
            ours, bare = [], []
            for _ in range(runs):   # alternating, so a change in the machine's load hits both
                ours.append(wall_s(PROJECT / "dodo.py", project_args, PROJECT))
                bare.append(wall_s(trivial, trivial_args, Path(tmp)))
            rows.append((label, statistics.median(ours), statistics.median(bare)))
    print("| command | project dodo.py (s) | trivial dodo.py (s) | ratio | goal | median of |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, ours_s, bare_s in rows:
        ratio = ours_s / bare_s
        verdict = "met" if ratio <= GOAL else "MISSED"
        print(f"| `{label}` | {ours_s:.3f} | {bare_s:.3f} | {ratio:.2f} | <= {GOAL} ({verdict}) | {runs} runs |")


if __name__ == "__main__":
    main()
