"""DVC on a VM that can be lost at any moment: each stage's outputs reach the remote when it ends.

    python -m mtpipe.cloud.on_vm.exp_run exp run --pull [-S a=1 ...] [--name N] [TARGET]

runs DVC's own command line in this process with one addition: when a stage has run (or was
restored from the run-cache), its outputs and the run-cache entry go to the default DVC remote at
once (DVC's `push --run-cache`), before the next stage starts. Without it, nothing is pushed
before the `dvc push` after `dvc exp run`, so a Spot VM lost in the last stage loses every stage
before it. With `--pull`, DVC first fetches the remote's run-cache and restores each stage whose
inputs an earlier run (another VM) already saw from there, outputs pulled instead of recomputed
("Stage 'x' is cached - skipping run"). A failed push is reported and the run goes on: the
`dvc push` at the end of run.command tries again.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


def push_stage(stage: Any) -> None:
    """Push what a restore from this stage's run-cache entry pulls (its outputs, the `cache: false`
    metrics and plots too, which `dvc push` leaves out), then the run-cache itself: a remote never
    holds an entry without its data."""
    entry = stage.repo.stage_cache._load(stage)
    if entry:
        cached = stage.repo.stage_cache._create_stage(entry, wdir=stage.wdir)
        for objs in cached.get_used_objs().values():
            stage.repo.cloud.push(objs)
    stage.repo.stage_cache.push(None)


def push_after_each_stage() -> None:
    """Wrap DVC's per-stage step (``dvc.repo.reproduce._reproduce_stage``, which `dvc exp run`'s
    executor calls too) so that a stage it reproduced is pushed with its run-cache entry."""
    from dvc.repo import reproduce

    reproduce_stage: Callable[..., Any] = reproduce._reproduce_stage

    def reproduce_then_push(stage: Any, **kwargs: Any) -> Any:
        done = reproduce_stage(stage, **kwargs)
        if done is not None and not kwargs.get("dry"):
            try:  # the repo lock is this process's already: DVC's lock is re-entrant per Repo
                push_stage(stage)
                print(f"mtpipe: pushed the outputs of '{stage.addressing}' to the DVC remote", flush=True)
            except Exception as err:  # noqa: BLE001 (any transfer error): the final `dvc push` retries
                print(f"mtpipe: could not push '{stage.addressing}' yet ({type(err).__name__}: {err})", flush=True)
        return done

    reproduce._reproduce_stage = reproduce_then_push


def main(argv: list[str]) -> int:
    """Run ``dvc <argv>`` with :func:`push_after_each_stage` in place; return DVC's exit status."""
    from dvc.cli import main as dvc_main

    push_after_each_stage()
    return dvc_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
