"""A training's progress while it runs, for a second terminal (`doit vm_status` while `vm_run` runs).

The runner rewrites ``work/logs/<branch>/<stage>.progress.json``, beside the stage's log
(mtpipe.pipeline.stage.log_path), at each step MaxText reports: the stage, the step and the total,
the loss, tokens/s per device, the ETA and when it was written. mtpipe.cloud.on_vm.run_status reads the
newest one on the VM over SSH.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

SUFFIX = ".progress.json"


def progress_path(log_path: Path) -> Path:
    """``work/logs/sft/train_sft.log`` -> ``work/logs/sft/train_sft.progress.json``."""
    return log_path.with_name(log_path.stem + SUFFIX)


def eta_s(step: int, total: int | None, elapsed: float, first_step: int) -> float | None:
    """Seconds left at the pace of the steps since ``first_step`` (a resumed run starts later)."""
    done = step - first_step
    return elapsed / done * (total - step) if total and done > 0 else None


def write(log_path: Path, step: int, total: int | None, loss: str, tps: str | None, eta: float | None) -> None:
    """Replace the progress file of the stage that logs to ``log_path`` (atomically: a reader never
    sees half a file)."""
    record = {"stage": f"{log_path.stem}@{log_path.parent.name}", "step": step, "total": total,
              "loss": float(loss), "tokens_per_s_device": float(tps) if tps else None,
              "eta_s": round(eta, 1) if eta is not None else None, "at": round(time.time(), 1)}
    path = progress_path(log_path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def clock(seconds: float) -> str:
    """``1:05`` for 65 s; hours as ``2:03:00``."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def describe(record: dict, now: float) -> str:
    """``train_sft@sft: step 40/150, loss 2.103, ETA 0:55 (written 3 s ago)``."""
    total = f"/{record['total']}" if record.get("total") else ""
    eta = f", ETA {clock(record['eta_s'])}" if record.get("eta_s") is not None else ""
    return (f"{record['stage']}: step {record['step']}{total}, loss {record['loss']:.4g}{eta} "
            f"(written {max(0.0, now - record['at']):.0f} s ago)")
