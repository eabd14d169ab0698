"""Child-process entry for GRPO with the cpu_jax rollout backend (`rollout_backend: cpu_jax`).

    python -m mtpipe.maxtext.launch_rl_cpu [maxtext.trainers.post_train.rl.train_rl] key=value ...

Applies the training patches (mtpipe.maxtext.adapter.training), installs the CPU rollout
(mtpipe.maxtext.rollout_cpu), runs train_rl's `main` through absl (argv[0] is train_rl's file, so
MaxText picks its rl.yml by itself) and ends the process with `os._exit(status)`: once the math-verify
pool has been used, a normal interpreter exit hangs in multiprocessing's pool shutdown. train_rl writes
its checkpoints synchronously and waits for orbax before `main` returns, and the streams are flushed first.

Nothing heavy is imported at module level, and train_rl is imported as a module, not run as
__main__: MaxText grades answers in a pool of *spawned* processes (math_verify_pool), each worker
first re-imports the parent's __main__ module, and a worker is replaced after 100 graded answers.
With the rollout backend as __main__ every worker imported JAX, flax and tunix (7.5x the CPU of a
worker start from here: benchmarks/grading_workers.py, docs/rl-rollout.md).
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
from typing import NoReturn, Sequence

TRAIN_RL_MODULE = "maxtext.trainers.post_train.rl.train_rl"


def run_train_rl(argv: Sequence[str]) -> NoReturn:
    """Run MaxText's train_rl with the cpu_jax backend on `argv` (key=value pairs, optionally after
    an rl.yml path) and exit the process with its status."""
    import importlib  # pylint: disable=import-outside-toplevel
    # math_verify_pool (imported with train_rl) annotates with `multiprocessing.pool.Pool` at import time
    import multiprocessing.pool  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    from absl import app  # pylint: disable=import-outside-toplevel

    from mtpipe.maxtext import rollout_cpu  # pylint: disable=import-outside-toplevel
    from mtpipe.maxtext.adapter.training import apply  # pylint: disable=import-outside-toplevel

    apply(TRAIN_RL_MODULE, list(argv))  # no token in argv; tunix saves with MaxText's storage flags
    rollout_cpu.install()
    train_rl = importlib.import_module(TRAIN_RL_MODULE)
    gc.freeze()  # the imports live as long as the process: the collector's full passes skip them (launch.main)
    code = 0
    try:
        app.run(train_rl.main, argv=[train_rl.__file__, *argv])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # pylint: disable=protected-access


if __name__ == "__main__":
    _args = sys.argv[1:]
    run_train_rl(_args[1:] if _args[:1] == [TRAIN_RL_MODULE] else _args)
