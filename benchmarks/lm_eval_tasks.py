"""What lm-eval's task index costs an evaluation: its default TaskManager (every bundled task file
indexed, then the stage's own) against `mtpipe.evaluation.gsm8k.task_manager` (the stage's tasks only).

Writes both GSM8K tasks the evaluate stages run (`gsm8k.write_task`) over a generated test split,
builds each manager alternately, loads the task from it, and checks that both give the task the same
config. Prints per setup the median seconds to build the index and to load the task, and after/before.

Usage: python benchmarks/lm_eval_tasks.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from lm_eval.tasks import TaskManager

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtpipe.data import embedded  # noqa: E402  pylint: disable=wrong-import-position
from mtpipe.evaluation import gsm8k  # noqa: E402  pylint: disable=wrong-import-position

SETUPS: dict[str, Callable[[Path], TaskManager]] = {
    "before: lm-eval's default": lambda task_dir: TaskManager(include_path=str(task_dir)),
    "after: gsm8k.task_manager": gsm8k.task_manager,
}


def timed(build: Callable[[Path], TaskManager], task_dir: Path, names: list[str]) -> tuple[float, float, dict]:
    """(seconds to build the index, seconds to load the tasks, each task's config)."""
    start = time.perf_counter()
    manager = build(task_dir)
    built = time.perf_counter()
    loaded = manager.load(names)
    configs: dict[str, Any] = {name: manager.task_index[name].cfg for name in names}
    assert loaded, names
    return built - start, time.perf_counter() - built, configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        embedded.write_gsm8k_tiny(root / "gsm8k", n_train=4, n_test=8)
        files = sorted((root / "gsm8k" / "main").glob("test-*.parquet"))
        names = [gsm8k.write_task(task, files, root / "tasks") for task in gsm8k.TASKS]
        times: dict[str, list[tuple[float, float]]] = {setup: [] for setup in SETUPS}
        configs = {}
        for _ in range(args.rounds):
            for setup, build in SETUPS.items():
                index_s, load_s, configs[setup] = timed(build, root / "tasks", names)
                times[setup].append((index_s, load_s))
    same = len({repr(sorted(c.items())) for c in configs.values()}) == 1
    print(f"| setup (median of {args.rounds}) | index s | load s |\n| --- | --- | --- |")
    medians = {}
    for setup, rows in times.items():
        medians[setup] = [statistics.median(column) for column in zip(*rows)]
        print(f"| {setup} | {medians[setup][0]:.2f} | {medians[setup][1]:.2f} |")
    before, after = (sum(m) for m in medians.values())
    print(f"\nafter/before (index + load): {after / before:.3f}; the tasks' configs are "
          f"{'the same' if same else 'DIFFERENT'} in both setups")


if __name__ == "__main__":
    main()
