"""xpk workloads on GKE TPU slices (being written: docs/multihost.md)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from mtpipe.maxtext.commands import MaxTextCommand


def run(cfg: DictConfig, cmd: MaxTextCommand, log_path: Path, total_steps: int | None) -> None:
    """Not built yet."""
    raise NotImplementedError("the xpk backend is not built yet")
