"""What Python's garbage collector costs a MaxText process of the embedded default, with and without
the heap frozen (`gc.freeze` in mtpipe.maxtext.launch.main: after the patches' imports and after the run).

Runs the MaxText commands two stages print with `--print-command` (needs the pipeline built: `make
demo`): the SFT branch's export (to_huggingface) and its training cut to a few steps, each into a
temporary directory, alternating the two setups:

* before: `gc.freeze` is a no-op in the child, so full collections walk every imported module during
  the run and the interpreter's exit collects the whole heap;
* after: the project as it is.

Prints per command and setup the median wall time and CPU time (user + system, the child and its
children), and after/before.

Usage: python benchmarks/process_gc.py [--rounds 3] [--steps 7]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
SETUPS = ("before", "after")
# the child: gc.freeze turned off (before) or left as it is (after), then the adapter as `python -m` runs it
CHILD = ("import gc, runpy, sys\n"
         "if sys.argv.pop(1) == 'before':\n"
         "    gc.freeze = lambda: None\n"
         "module = sys.argv.pop(1)\n"
         "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")


def printed_command(stage: str, branch: str) -> tuple[dict[str, str], list[str]]:
    """(environment, argv after `python`) of the MaxText command `stages.<stage> <branch>` runs."""
    out = subprocess.run([sys.executable, "-m", f"stages.{stage}", branch, "--print-command"], cwd=PROJECT,
                         capture_output=True, text=True, check=False)
    line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else ""
    if "python -m mtpipe.maxtext.adapter" not in line:
        sys.exit(f"`python -m stages.{stage} {branch} --print-command` printed no MaxText command "
                 f"(run `make demo` first): {(out.stdout + out.stderr).strip()[-300:]}")
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words[1:words.index("python")]) if words[0] == "env" else {}
    return env, words[words.index("python") + 1:]


def into(argv: list[str], scratch: Path, steps: int) -> list[str]:
    """`argv` writing under `scratch` (and training `steps` steps)."""
    out = []
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key in ("base_output_directory", "metrics_file"):
            arg = f"{key}={scratch / key}"
        elif key == "steps":
            arg = f"steps={steps}"
        out.append(arg)
    return out


def run_timed(setup: str, env: dict[str, str], argv: list[str]) -> tuple[float, float]:
    """(wall s, CPU s: user + system of the child and everything it started) of one run of `argv`."""
    assert argv[0] == "-m", argv
    cpu_before, start = cpu_of_children(), time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, setup, *argv[1:]], cwd=PROJECT, env={**os.environ, **env},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"{setup}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, cpu_of_children() - cpu_before


def cpu_of_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    commands = {"to_huggingface@sft": printed_command("to_huggingface", "sft"),
                f"train_sft@sft, {args.steps} steps": printed_command("train_sft", "sft")}
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="process_gc-") as tmp:
        for name, (env, argv) in commands.items():
            print(f"{name}: one untimed run (JAX's compile cache)", flush=True)
            scratch = Path(tmp) / "warm-up"
            run_timed("after", env, into(argv, scratch, args.steps))
            for round_ in range(args.rounds):
                for setup in SETUPS:
                    scratch = Path(tmp) / f"{re.sub(r'\W+', '-', name)}-{setup}-{round_}"
                    result = run_timed(setup, env, into(argv, scratch, args.steps))
                    times.setdefault((name, setup), []).append(result)
                    print(f"  round {round_ + 1}/{args.rounds} {setup}: {result[0]:.1f} s wall, {result[1]:.1f} s CPU",
                          flush=True)
    print(f"\n| command (median of {args.rounds}) | before wall s | after wall s | before CPU s | after CPU s "
          "| after/before CPU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in commands:
        (bw, bc), (aw, ac) = [[statistics.median(x[i] for x in times[(name, setup)]) for i in (0, 1)] for setup in SETUPS]
        print(f"| {name} | {bw:.1f} | {aw:.1f} | {bc:.1f} | {ac:.1f} | {ac / bc:.2f} |")


if __name__ == "__main__":
    main()
