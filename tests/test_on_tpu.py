"""The TPU chip's records and what they calibrate (docs/tpu-chip.md, docs/preflight.md).

No TPU is needed here: the records in benchmarks/on_tpu/records/ were measured on a lent TPU v5e chip
by benchmarks/on_tpu/chip.sh; these tests check that the harness runs the stages' own commands, that
the TPU runtime check refuses what is not the expected TPU, and that preflight's forecast for every
measured slice stays within its stated tolerance of the chip's measurement (so a later change of
preflight is checked against the real chip).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from mtpipe.maxtext import commands, training_commands
from mtpipe.planning import preflight
from mtpipe.pipeline.toolchain import lock_pins

ROOT = Path(__file__).resolve().parents[1]
ON_TPU = ROOT / "benchmarks" / "on_tpu"
sys.path.insert(0, str(ON_TPU))

import calibrate  # noqa: E402  (benchmarks/on_tpu/calibrate.py)
import plan  # noqa: E402  (benchmarks/on_tpu/plan.py)

pytestmark = pytest.mark.on_tpu
RECORDS = sorted(p for p in (ON_TPU / "records").glob("*.json") if p.name != calibrate.COMPILED.name)


def test_the_chip_pins_name_every_difference_from_the_vm_lock():
    """requirements-chip.txt: a pin without `# lock X` is the VM lock's; each `lock X` is the VM lock's pin."""
    vm = lock_pins((ROOT / "requirements-vm.lock").read_text())
    wrong = {}
    for line in (ON_TPU / "requirements-chip.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        spec, _, mark = line.partition("#")
        name, version = spec.strip().split("==")
        said = re.search(r"lock (\S+)", mark)
        expected = said[1] if said else version
        if vm.get(canonicalize_name(name), "None") != expected:
            wrong[name] = (version, mark.strip(), vm.get(canonicalize_name(name)))
    assert wrong == {}


def stage_command(branch: str, stage: str) -> commands.MaxTextCommand:
    """The command training_commands.py builds for ``stage`` of ``branch`` (placeholder paths)."""
    cfg = plan.committed_view(branch, stage)
    if stage == "train_rl":
        return preflight.stage_command(cfg)
    p = Path(preflight.PLACEHOLDER)
    return training_commands.train_sft(cfg, ckpt=p, train_files=str(p), eval_files=str(p), columns=["messages"],
                                       tokenizer_dir=p, base_output=p, run_name="run", metrics_file=p, jax_cache_dir=p)


@pytest.mark.parametrize("branch,stage", [("sft", "train_sft"), ("rl", "train_sft"), ("rl", "train_rl")])
def test_the_chip_runs_the_stages_commands_changing_only_the_backend(branch: str, stage: str):
    """plan.on_chip keeps the stage's command and changes only what the chip needs: the TPU instead of
    the CPU, dot-product attention where the sequence length is no multiple of the splash kernel's block."""
    cmd = stage_command(branch, stage)
    run = plan.on_chip(cmd)
    assert (run["launcher"], run["module"]) == (cmd.launcher, cmd.module)
    assert run["env"] == {k: v for k, v in cmd.env.items() if k != "JAX_PLATFORMS"} and "JAX_PLATFORMS" in cmd.env
    length = next(int(a.split("=")[1]) for a in cmd.args if a.startswith("max_target_length="))
    kept = [a for a in cmd.args if a != "hardware=cpu"]
    assert run["args"] == kept + (["attention=dot_product"] if length % plan.SPLASH_BLOCK else [])


def test_the_tpu_check_refuses_a_machine_without_the_expected_chips():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "mtpipe.maxtext.tpu_check", "--chips", "8", "--generation", "v6e"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "expected 8 x 'TPU v6 lite' on backend tpu, found 1 x ['cpu'] on backend 'cpu'" in done.stderr
    assert "fix:" in done.stderr


@pytest.mark.parametrize("record", RECORDS, ids=[r.stem for r in RECORDS])
def test_each_record_says_what_it_ran_on(record: Path):
    """Every record carries the versions it ran with and the chip's own check; nothing in it is a rehearsal."""
    data = json.loads(record.read_text())
    assert data["smoke"] is False
    assert {"python", "jax", "jaxlib", "libtpu", "maxtext", "google-tunix"} <= data["versions"].keys()
    assert data["tpu_check"]["status"] == 0 and "1 x TPU v5 lite" in data["tpu_check"]["output"]
    assert all(run.get("device_kind") == "TPU v5 lite" for run in data["runs"].values() if run["status"] == 0)


@pytest.mark.parametrize("run", calibrate.slices(), ids=[s["name"] for s in calibrate.slices()])
def test_preflight_forecasts_what_the_chip_measured(run: dict):
    """preflight's HBM and step-time forecast for each measured slice (from its compile for topology
    v5e-1, stored under the digest preflight computes today) is within HBM_TOLERANCE and STEP_TOLERANCE
    of the chip's measurement."""
    row = calibrate.compare(run, calibrate.compiled_for(run))
    assert abs(row["hbm_ratio"] - 1) <= preflight.HBM_TOLERANCE, row
    assert abs(row["step_ratio"] - 1) <= preflight.STEP_TOLERANCE, row


def test_the_calibrated_error_bars_cover_every_slice():
    """The error bars preflight prints are those of its calibration: every slice's HBM forecast within
    HBM_ERROR, every measured MFU inside MFU_RANGE, and MFU inside that range."""
    rows = [calibrate.compare(run, calibrate.compiled_for(run)) for run in calibrate.slices()]
    assert len(rows) >= 4
    assert max(abs(r["hbm_ratio"] - 1) for r in rows) <= preflight.HBM_ERROR
    low, high = preflight.MFU_RANGE
    assert low <= preflight.MFU <= high
    assert all(low - 0.0005 <= r["mfu_measured"] <= high + 0.0005 for r in rows)
