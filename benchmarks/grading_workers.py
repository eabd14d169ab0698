"""What one of MaxText's answer-grading workers costs to start, per entry module of train_rl's process.

MaxText grades GRPO's answers in a pool of spawned processes (maxtext/.../rl/math_verify_pool.py): 2
on 2 cores, each replaced after 100 graded answers. A spawned process first re-imports the parent's
__main__ module by name, then the pool's initializer imports math_verify. This times exactly that,
in a fresh interpreter, for the entry the project launches (mtpipe.maxtext.launch_rl_cpu) and for the
rollout backend as __main__ (how train_rl was launched before), alternating, and prints CPU seconds
(user + system) per worker start.

Usage: python benchmarks/grading_workers.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys

ENTRIES = {"launch_rl_cpu (now)": "mtpipe.maxtext.launch_rl_cpu", "rollout_cpu (before)": "mtpipe.maxtext.rollout_cpu"}
WORKER = ("import multiprocessing.pool, multiprocessing.spawn\n"
          "multiprocessing.spawn._fixup_main_from_name({main!r})\n"
          "from maxtext.trainers.post_train.rl.math_verify_pool import silent_worker_init\n"
          "silent_worker_init()\n")


def worker_start_cpu_s(main: str) -> float:
    """CPU seconds a fresh interpreter spends becoming a grading worker with `main` as the parent's __main__."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", WORKER.format(main=main)], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in ENTRIES}
    for _ in range(args.rounds):
        for name, module in ENTRIES.items():
            times[name].append(worker_start_cpu_s(module))
    now = statistics.median(times["launch_rl_cpu (now)"])
    print(f"| train_rl's __main__ | CPU s per grading worker start, median of {args.rounds} | runs | x of now |")
    print("| --- | --- | --- | --- |")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.2f} | {', '.join(f'{v:.2f}' for v in values)} | {median / now:.1f} |")


if __name__ == "__main__":
    main()
