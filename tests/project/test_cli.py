"""The doit command line: `doit list` / `doit help` import no heavy library, and a successful
`doit preflight` prints no traceback and no warning (benchmarks/cli_startup.py times them)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.explains
# What takes seconds to import; an action imports it when it runs, dodo.py never does.
HEAVY = ("google.cloud.compute_v1", "google.auth", "google.api_core", "asyncssh", "dvc", "jax", "maxtext",
         "absl", "omegaconf", "pydantic", "huggingface_hub", "apprise")
NOISE = re.compile(r"Traceback|Exception ignored|\w*Warning\b|WARNING")


def user_env() -> dict[str, str]:
    """The environment a user runs doit in: no warning filter of the test run's."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}


@pytest.mark.parametrize("args", [["list"], ["help", "vm_run"], ["help", "preflight"]])
def test_listing_and_help_import_no_heavy_library(args: list[str], tmp_path: Path) -> None:
    probe = ("import json, sys; from doit.doit_cmd import DoitMain; "
             f"rc = DoitMain().run(['-f', {str(ROOT / 'dodo.py')!r}, *{args!r}]); "
             "print(json.dumps({'rc': rc, 'modules': sorted(sys.modules)}), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=user_env(), capture_output=True,
                          text=True, timeout=120)
    result = json.loads(proc.stderr.strip().splitlines()[-1])
    assert result["rc"] == 0, proc.stdout + proc.stderr
    loaded = [m for m in result["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert loaded == [], f"`doit {' '.join(args)}` imported {loaded[:10]}"
    assert "vm_run" in proc.stdout or "preflight" in proc.stdout


@pytest.mark.slow
def test_a_successful_preflight_prints_no_traceback_and_no_warning(tmp_path: Path) -> None:
    """The embedded default (CPU presets: nothing to compile). Its actions import DVC, MaxText and
    absl, which bind to the streams of that moment: inside doit's output capture that ended in
    "Exception ignored in atexit callback ... 'Writer' object has no attribute 'close'"."""
    proc = subprocess.run([sys.executable, "-m", "doit", "--db-file", str(tmp_path / "doit.db"), "preflight"],
                          cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "sft (embedded-sft) runs on hardware cpu: no TPU to check" in out
    assert not NOISE.findall(out), out
