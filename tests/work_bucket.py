"""Helpers for tests with a work bucket (mtpipe/maxtext/run_dir.py) on the GCS emulator: a stage's
environment for it, a gcsfs client, and the complete checkpoints it holds.

Plain functions, no fixtures: this module imports gcsfs, so a test file that needs it only in a
slow test (tests/cloud/lifecycle/test_vm_recovery.py) imports it there, not at collection.
"""

from __future__ import annotations

import json

import gcsfs
from fakes.gcs_emulator import GcsEmulator

from mtpipe.maxtext import run_dir as rd

PERIOD = 50  # the embedded preset's checkpoint_period: the pipeline's own run is the uninterrupted reference


def bucket_env(emulator: GcsEmulator, prefix: str = "work") -> dict[str, str]:
    """A stage's environment for a work bucket on the emulator."""
    return {rd.WORK_BUCKET_ENV: f"gs://{emulator.bucket}/{prefix}", "STORAGE_EMULATOR_HOST": emulator.endpoint,
            "TENSORSTORE_GCS_HTTP_URL": emulator.endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "anon"}


def emulator_fs(emulator: GcsEmulator) -> gcsfs.GCSFileSystem:
    return gcsfs.GCSFileSystem(endpoint_url=emulator.endpoint, token="anon", skip_instance_cache=True)


def committed(fs: gcsfs.GCSFileSystem, runs: str) -> dict[int, str]:
    """step -> run directory, for each complete checkpoint under ``runs``."""
    fs.invalidate_cache()
    markers = fs.glob(f"{runs}/*/checkpoints/*/{rd.COMMIT_MARKER}")
    return {int(m.split("/")[-2]): m.split("/checkpoints/")[0] for m in markers if m.split("/")[-2].isdigit()}


def checkpoint_to_resume(fs: gcsfs.GCSFileSystem, runs: str, at_least: int = PERIOD) -> str | None:
    """The run directory once it holds a complete checkpoint of step >= ``at_least`` and the mirrored
    metrics file has reached that step. Earlier, the bucket may lack the loss row of the checkpoint's
    step, which a resume from it never logs again."""
    steps = committed(fs, runs)
    step = max((s for s in steps if s >= at_least), default=None)
    metrics = f"{steps[step]}/metrics.jsonl" if step is not None else None
    if metrics and fs.exists(metrics):
        logged = [json.loads(line)["step"] for line in fs.cat(metrics).splitlines() if line.strip()]
        if logged and max(logged) >= step:
            return steps[step]
    return None
