"""Where a training stage's MaxText command runs: on this machine (one JAX process or several), or
as an xpk workload on a GKE TPU slice (``hardware.backend``, docs/multihost.md).

The stage builds the same command either way; only the place it runs changes.
"""

from __future__ import annotations

from pathlib import Path

from mtpipe.maxtext import runner
from mtpipe.maxtext.commands import MaxTextCommand
from mtpipe.pipeline.view import View


def run_training(cfg: View, cmd: MaxTextCommand, log_path: Path, total_steps: int | None) -> None:
    """Run a training command where ``cfg.hardware`` says; raise if it fails."""
    hardware = cfg.hardware
    if hardware.backend == "xpk":
        from mtpipe.training import xpk

        xpk.run(cfg, cmd, log_path, total_steps)
        return
    runner.run(cmd, log_path, total_steps=total_steps, processes=hardware.processes)
