"""Run one planned MaxText command through the project's launcher in this process, then record what
the chip held: ``memory_stats()`` (peak HBM) and the wall time. Runs on the chip's Python 3.11.

    python benchmarks/on_tpu/measure.py RECORD.json LAUNCHER MODULE key=value ...
    python benchmarks/on_tpu/measure.py --together RUNS.json     # several SFT runs in this one process

``--together``: each run of RUNS.json (``record``, ``module``, ``args``) after the other, the imports
and the chip's opening paid once (~40 s a process). ``memory_stats()`` keeps one peak per process,
so each record also holds the peaks before its run: a run's peaks are its own where both rose during
it (plan.py orders the runs so that they do; collect.py checks it).

Nothing heavy is imported at module level: MaxText's answer-grading pool re-imports ``__main__`` in
each worker (mtpipe/maxtext/launch_rl_cpu.py). train_rl's launcher ends the process with
``os._exit``, so the record is also written from there.
"""

from __future__ import annotations

import json
import os
import sys
import time

MEMORY_KEYS = ("peak_bytes_in_use", "bytes_in_use", "bytes_limit", "largest_alloc_size", "bytes_reserved",
               "peak_bytes_reserved")


def together(spec_path: str) -> None:
    """Every run of ``spec_path`` in this process, one record each; the process exits with the first
    failing status (0 if none failed)."""
    import gc  # pylint: disable=import-outside-toplevel

    import jax  # pylint: disable=import-outside-toplevel

    runs = json.loads(open(spec_path, encoding="utf8").read())
    start = time.time()
    device = jax.devices()[0]
    opened = round(time.time() - start, 2)
    from mtpipe.maxtext import launch  # pylint: disable=import-outside-toplevel
    from mtpipe.maxtext.adapter import training  # pylint: disable=import-outside-toplevel
    finish = training.apply(runs[0]["module"], runs[0]["args"])  # the same patches for every SFT run
    failed = 0
    for run in runs:
        before = {k: (device.memory_stats() or {}).get(k) for k in MEMORY_KEYS}
        began = time.time()
        status = launch.run_module(run["module"], run["args"])
        if status == 0:
            finish()
        stats = device.memory_stats() or {}
        record = {"backend": jax.default_backend(), "device_kind": device.device_kind, "devices": jax.device_count(),
                  "jax_open_s": opened, "status": status, "wall_s": round(time.time() - began, 2),
                  "memory": {k: stats.get(k) for k in MEMORY_KEYS}, "memory_before": before}
        with open(run["record"], "w", encoding="utf8") as f:
            json.dump(record, f, indent=1)
        failed = failed or status
        gc.collect()  # the finished run's arrays, before the next allocates its own
        jax.clear_caches()
    sys.exit(failed)


def main() -> None:
    if sys.argv[1] == "--together":
        together(sys.argv[2])
        return
    record_path, launcher, module, args = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    start = time.time()
    import jax  # pylint: disable=import-outside-toplevel

    device = jax.devices()[0]
    record = {"backend": jax.default_backend(), "device_kind": device.device_kind, "devices": jax.device_count(),
              "jax_open_s": round(time.time() - start, 2)}

    def write(status: int) -> None:
        stats = device.memory_stats() or {}
        record.update(status=status, wall_s=round(time.time() - start, 2),
                      memory={k: stats.get(k) for k in MEMORY_KEYS})
        with open(record_path, "w", encoding="utf8") as f:
            json.dump(record, f, indent=1)

    real_exit = os._exit

    def exit_recorded(code: int) -> None:
        write(code)
        real_exit(code)

    os._exit = exit_recorded  # train_rl's launcher leaves this way
    if launcher == "mtpipe.maxtext.launch_rl_cpu":
        from mtpipe.maxtext import launch_rl_cpu  # pylint: disable=import-outside-toplevel
        launch_rl_cpu.run_train_rl(args)
    from mtpipe.maxtext import launch  # pylint: disable=import-outside-toplevel
    from mtpipe.maxtext.adapter import training  # pylint: disable=import-outside-toplevel
    status = launch.main(training.apply, [module, *args], training.stopped_status)
    write(status)
    sys.exit(status)


if __name__ == "__main__":
    main()
