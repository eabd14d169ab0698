"""Orbax checkpoints on disk: the latest saved step, and what makes two saves of the same tensors
the same bytes (docs/decisions/content-address.md)."""

from __future__ import annotations

import json
from pathlib import Path


def latest_checkpoint(checkpoints: Path) -> int | None:
    """Highest step with saved model params under a MaxText ``checkpoints`` directory, if any."""
    steps = [int(p.parent.name) for p in checkpoints.glob("*/model_params") if p.parent.name.isdigit()]
    return max(steps, default=None)


ORBAX_TIMESTAMPS = ("init_timestamp_nsecs", "commit_timestamp_nsecs")
COMMIT_MARKER = "commit_success.txt"  # Orbax's last write to a step (and item); on GCS it cannot rename


def normalise_orbax_metadata(checkpoint: Path) -> None:
    """Drop what Orbax writes about the save itself, not the tensors, under ``checkpoint``.

    * the wall-clock times in each ``_CHECKPOINT_METADATA`` (Orbax reads both fields as optional);
    * the path in each ``commit_success.txt`` ("Checkpoint commit was successful to <path>"): the
      checkout's directory, or the bucket's; only the file's existence matters to Orbax.

    They are the only bytes that differ between two saves of the same tensors in the ``plain``
    storage format, on two machines; without them a rerun gives the same DVC hash and nothing
    downstream reruns.
    """
    for meta in sorted(checkpoint.rglob("_CHECKPOINT_METADATA")):
        data = json.loads(meta.read_text())
        if any(key in data for key in ORBAX_TIMESTAMPS):
            meta.write_text(json.dumps({k: v for k, v in data.items() if k not in ORBAX_TIMESTAMPS}))
    for marker in sorted(checkpoint.rglob(COMMIT_MARKER)):
        marker.write_text(marker.read_text().split(" to ", 1)[0])
