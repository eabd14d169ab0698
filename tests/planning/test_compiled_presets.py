"""The committed compile results of the shipped tutorial presets (mtpipe/planning/compiled/): each one
holds for its preset as preflight composes it now, at the TPU VM's versions, and preflight reads it
instead of compiling; a result of other versions or another shape is not used, and says why.
(tests/project/test_control_plane.py runs `doit preflight` from one in the environment without JAX.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import families
import pytest

from mtpipe.cloud.settings import prices, vm_config
from mtpipe.pipeline import requirement_locks
from mtpipe.pipeline.config import ROOT
from mtpipe.pipeline.toolchain import lock_pins
from mtpipe.planning import aot, compiled_presets, preflight

pytestmark = pytest.mark.first_run

REFRESH = f"refresh them: `{compiled_presets.RECORD_COMMAND}` with the full environment (`make`)"


def step_of(preset: str, *sets: str) -> tuple[str, list[str]]:
    """(trainer module, compile arguments) of ``preset``'s training step, from HEAD's params.yaml."""
    branch = compiled_presets.SHIPPED[preset]
    _, _, views = aot.composed_views([f"{branch}.preset={preset}", *sets], ROOT, (branch,), committed=True)
    cmd = aot.stage_command(views[branch])
    return cmd.module, aot.compile_args(cmd, preflight.maxtext_topology(preflight.topology(views[branch])))


@pytest.mark.parametrize("preset", sorted(compiled_presets.SHIPPED))
def test_each_committed_result_holds_for_its_preset_now(preset: str) -> None:
    """Its digest is the one preflight computes for the preset now, of the key it records, at the TPU
    VM's versions (what the control environment computes): a version bump or a shape change fails here."""
    file = compiled_presets.path(compiled_presets.SHIPPED[preset], preset)
    assert file.is_file(), f"{file.relative_to(ROOT)} is missing: {REFRESH}"
    record = json.loads(file.read_text())
    module, args = step_of(preset)
    assert record["digest"] == hashlib.sha256(json.dumps(record["key"], sort_keys=True).encode()).hexdigest()
    vm = lock_pins(requirement_locks.VM_LOCK.read_text())
    assert record["key"]["versions"] == {name: vm[name] for name in record["key"]["versions"]}, \
        f"{file.relative_to(ROOT)} was compiled with other versions than requirements-vm.lock's: {REFRESH}"
    assert record["digest"] == aot.compile_digest(module, args), \
        f"{compiled_presets.mismatch(record['branch'], preset, aot.compile_key(module, args))}; {REFRESH}"
    assert record["result"]["memory"]["argument_size_in_bytes"] > 0 and record["result"]["tflops_per_device"] > 0


def test_preflight_reads_the_committed_result_and_prices_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """With an empty work/preflight/, the SFT tutorial's preflight compiles nothing and prints the fit,
    step time and price from the committed file."""
    (tmp_path / "params.yaml").write_text(families.committed_params_text())
    monkeypatch.setattr(aot, "child_env", lambda *a: pytest.fail("preflight started a compile"))
    cfg = vm_config.load_config()
    rate = prices.vm_rate(cfg)
    [row] = preflight.check(["sft.preset=gemma3-4b-ultrachat-v6e8"], rate.price.usd, vm_config.budget_machine(cfg),
                            root=tmp_path, branches=("sft",), price_basis=rate.per_chip())
    out = capsys.readouterr().out
    assert "compile result committed (mtpipe/planning/compiled/sft-gemma3-4b-ultrachat-v6e8.json)" in out, out
    assert row["fits"] and row["compile_cached"] and 0 < row["hbm_gib_per_chip"] < row["hbm_gib_available"]
    assert row["est_step_s"] > 0 and row["est_total_usd"] > 0
    assert preflight.table([row]).splitlines()[1] in out


def test_a_result_of_other_versions_or_another_shape_is_not_used_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    preset = "gemma3-4b-ultrachat-v6e8"
    module, args = step_of(preset)
    assert aot.stored_compile(module, args, ROOT / "no-such-work")["committed"].endswith(f"sft-{preset}.json")

    bigger = step_of(preset, "sft.train_sft.per_device_batch_size=2")
    assert aot.stored_compile(*bigger, ROOT / "no-such-work") is None
    assert compiled_presets.mismatch("sft", preset, aot.compile_key(*bigger)) == (
        f"the committed mtpipe/planning/compiled/sft-{preset}.json is of another shape, "
        "per_device_batch_size=1 there, 2 here")

    moved = aot.versions() | {"jax": "99.0"}
    monkeypatch.setattr(aot, "versions", lambda: moved)
    assert aot.stored_compile(module, args, ROOT / "no-such-work") is None
    why = compiled_presets.mismatch("sft", preset, aot.compile_key(module, args))
    assert "was compiled by another toolchain, jax " in why and "99.0 here" in why
    assert f"refresh it with `{compiled_presets.RECORD_COMMAND}`" in why
