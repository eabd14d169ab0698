"""Preflight: the TPU training step AOT-compiled on this CPU, its HBM, time and cost.

The embedded presets run on hardware cpu; `--set <branch>.hardware=v6e-8` points them at a v6e-8,
so the tiny models' training steps compile for the tutorials' TPU in about a minute each.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from mtpipe.cloud.settings import vm_config
from mtpipe.maxtext import commands, training_commands
from mtpipe.pipeline import generations
from mtpipe.planning import aot, preflight, step_model

from mtpipe.errors import ConfigError
from mtpipe.pipeline import overrides
from mtpipe.pipeline.config import ROOT, compose, stage_view
from mtpipe.pipeline.toolchain import lock_pins
from mtpipe.pipeline.view import View
import families

pytestmark = pytest.mark.preflight

ON_V6E = ["sft.hardware=v6e-8", "rl.hardware=v6e-8"]
MACHINE = vm_config.budget_machine(vm_config.load_config())  # conf/vm.yaml as shipped
REPORT_KEYS = {"hbm_gib_per_chip", "hbm_gib_available", "fits", "flops_per_step", "est_train_s", "est_total_usd"}


PARAMS = families.committed_params_text().encode()


def sft_view(params) -> View:
    """The sft branch's training view, what preflight compiles."""
    return stage_view(compose("sft", params), "train_sft")


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    """A directory holding this project's params.yaml; preflight writes its work/ there."""
    (tmp_path / "params.yaml").write_bytes(PARAMS)
    return tmp_path


def test_set_overrides_params_like_dvc_exp_run_s() -> None:
    params = overrides.apply_sets(PARAMS, ["sft.preset=gemma3-4b-ultrachat-v6e8", "steps=7",
                                                  "rl.train_rl.num_generations=4"])
    assert (params.sft.preset, params.steps, params.rl.train_rl.num_generations) == ("gemma3-4b-ultrachat-v6e8", 7, 4)
    with pytest.raises(ConfigError, match="--set"):
        overrides.apply_sets(PARAMS, ["steps"])


def test_an_xpk_preset_is_compiled_for_its_slice_and_priced_per_chip() -> None:
    """GKE presets name their TPU in hardware.xpk.tpu_type (no TPU_ACCELERATOR_TYPE: GKE sets it)."""
    cfg = sft_view(overrides.apply_sets(PARAMS, ["sft.preset=gemma3-4b-ultrachat-v6e32"]))
    assert preflight.topology(cfg) == "v6e-32"
    assert "compile_topology=v6e-32" in aot.compile_args(aot.stage_command(cfg), preflight.topology(cfg))
    assert preflight.chip_of("v6e-32", "sft", "v6e-32")[1] == 32
    chip_price = 2.70  # conf/prices.yaml: v6e on demand, per chip-hour
    assert preflight.usd_per_hour(8, chip_price) == pytest.approx(21.60)   # a v6e-8 VM
    assert preflight.usd_per_hour(32, chip_price) == pytest.approx(86.40)
    assert preflight.topology(sft_view(overrides.apply_sets(PARAMS, []))) is None  # the CPU default


def test_compile_args_are_the_stage_args_without_paths() -> None:
    cfg = sft_view(overrides.apply_sets(PARAMS, ["sft.preset=gemma3-4b-ultrachat-v6e8"]))
    cmd = aot.stage_command(cfg)
    args = aot.compile_args(cmd, preflight.topology(cfg))
    assert cmd.module == commands.TRAIN_SFT
    assert "per_device_batch_size=1" in args and "steps=1000" in args and "model_name=gemma3-4b" in args
    assert "compile_topology=v6e-8" in args and "compile_topology_num_slices=1" in args
    assert not any(training_commands.PLACEHOLDER in a or a.startswith(("load_parameters_path=", "tokenizer_path="))
                   for a in args)
    # a --set the stage would see changes the compile, so the cache digest changes too
    bigger = sft_view(overrides.apply_sets(PARAMS, ["sft.preset=gemma3-4b-ultrachat-v6e8",
                                                                  "sft.train_sft.per_device_batch_size=2"]))
    bigger_args = aot.compile_args(aot.stage_command(bigger), "v6e-8")
    assert "per_device_batch_size=2" in bigger_args
    assert aot.compile_digest(cmd.module, args) != aot.compile_digest(cmd.module, bigger_args)
    # a learning rate or step count shapes nothing: the same digest (tests below: no second compile)
    for sets in (["sft.train_sft.learning_rate=1e-5"], ["steps=300"]):
        swept = sft_view(overrides.apply_sets(PARAMS, ["sft.preset=gemma3-4b-ultrachat-v6e8", *sets]))
        swept_args = aot.compile_args(aot.stage_command(swept), "v6e-8")
        assert swept_args != args and aot.compile_digest(cmd.module, swept_args) == aot.compile_digest(
            cmd.module, args)


def test_cpu_presets_have_nothing_to_check(root: Path, capsys: pytest.CaptureFixture) -> None:
    assert preflight.run([], 2.70, MACHINE, root) == []
    assert "no TPU to check" in capsys.readouterr().out
    assert not (root / "work" / "preflight").exists()


def _compiled(argument_gib: float, temp_gib: float) -> dict:
    """A compile result of the shape the child writes (train_compile's memory analysis)."""
    return {"param_count": 4_300_000_000, "param_bytes": 8_600_000_000, "tflops_per_device": 100.0,
            "config": {"steps": 1000}, "memory": {"argument_size_in_bytes": int(argument_gib * 2**30),
                                                  "temp_size_in_bytes": int(temp_gib * 2**30),
                                                  "generated_code_size_in_bytes": 0}}


def test_a_step_too_large_for_hbm_names_the_keys_to_change() -> None:
    cfg = sft_view(overrides.apply_sets(PARAMS, ["sft.preset=gemma3-4b-ultrachat-v6e8"]))
    chip, chips = preflight.chip_of("v6e-8", "sft", "v6e-8")
    fits = preflight.report(cfg, "p", _compiled(5.4, 4.5), chip, chips, usd_per_hour=21.6, args=[])
    preflight.check_fits(fits)
    # the compiled step (5.4 + 4.5 GiB) and what tunix's SFT trainer holds beside it (3.7 B per parameter, sharded)
    extra = preflight.SFT_TRAINER_EXTRA_BYTES_PER_PARAM * 4_300_000_000 / 8 / 2**30
    assert extra == pytest.approx(1.85, abs=0.01) and fits["hbm_parts_gib"]["sft_trainer_extra"] == round(extra, 3)
    assert fits["fits"] and fits["hbm_gib_per_chip"] == pytest.approx(9.9 + extra, abs=0.01)
    # 1000 steps of 100 TFLOP per chip at v6e's fitted share of 918 TFLOP/s, plus the parameters' traffic at
    # 1640 GB/s (bf16 weights: 32 B gathered on every chip, the rest of the 83.2 B sharded over 8) and FSDP's
    # collectives at 400 GB/s (7/8 x (2 x 2 + 4) B), at the chip's wall-clock factor, plus start-up
    efficiency = generations.load()["v6e"].step.compute_efficiency
    step_s = (100 / (918 * efficiency) + (4.3e9 * 32 + 4.3e9 / 8 * (step_model.STEP_BYTES_PER_PARAM - 32)) / 1640e9
              + 7 / 8 * 4.3e9 * 8 / 400e9)
    assert fits["est_step_s"] == pytest.approx(step_s, rel=1e-9)
    assert fits["implied_mfu"] == pytest.approx(100 / (918 * step_s), abs=1e-4) and not fits["mfu_above_best_public"]
    train_s = 1000 * step_s * step_model.WALL_CLOCK_FACTOR[1] + preflight.TRAIN_STARTUP_S[1]
    assert fits["est_train_s"] == pytest.approx(train_s, abs=0.1)
    total_s = train_s + preflight.VM_SETUP_S + 2 * 70 * 4.3
    assert fits["est_total_usd"] == pytest.approx(total_s / 3600 * 21.6, abs=0.01)
    too_big = preflight.report(cfg, "p", _compiled(5.4, 30.0), chip, chips, usd_per_hour=21.6, args=[])
    assert not too_big["fits"] and too_big["hbm_headroom_gib"] < 0
    with pytest.raises(ConfigError) as err:
        preflight.check_fits(too_big)
    assert err.value.key == "sft.train_sft.per_device_batch_size"
    assert "max_target_length" in err.value.fix and "remat_policy" in err.value.fix


@pytest.mark.slow
@pytest.mark.environment
def test_tiny_presets_compile_for_v6e8_and_the_second_run_is_cached(root: Path, capsys: pytest.CaptureFixture) -> None:
    rows = preflight.run(ON_V6E, 2.70, MACHINE, root)
    assert [r["branch"] for r in rows] == ["sft", "rl"]
    out = capsys.readouterr().out
    assert "HBM GiB/chip" in out and "embedded-sft" in out and "embedded-rl" in out
    # compiled by the TPU VM's compiler (one toolchain: requirements.lock pins the VM's versions)
    vm = lock_pins((ROOT / "requirements-vm.lock").read_text())
    assert (f"compiled with maxtext {vm['maxtext']}, jax {vm['jax']}, jaxlib {vm['jaxlib']}, libtpu {vm['libtpu']}: "
            "the TPU VM's") in out
    assert all(r["versions"] == {n: vm[n] for n in ("maxtext", "jax", "jaxlib", "libtpu")} for r in rows)
    for row in rows:
        written = json.loads((root / "work" / "preflight" / f"{row['branch']}-{row['preset']}.json").read_text())
        assert REPORT_KEYS <= set(written) and written["fits"] is True and written["topology"] == "v6e-8"
        # the compiled train state holds at least the weights, sharded over 8 chips
        assert written["hbm_parts_gib"]["train_state"] * 2**30 >= written["param_count"] * 4 / 8
        # MaxText's FLOPs per step: at least 6 x params x tokens of the step
        shapes = written["maxtext_config"]
        tokens = shapes["global_batch_size_to_train_on"] * shapes["max_target_length"]
        assert written["flops_per_step"] >= 6 * written["param_count"] * tokens * 0.9
        assert written["compile_cached"] is False
    sft, rl = rows
    assert sft["maxtext_config"]["per_device_batch_size"] == 4  # the preset's value reached the compile
    assert rl["maxtext_config"]["global_batch_size_to_train_on"] == 8 * 8  # batch_size x num_generations
    assert set(rl["hbm_parts_gib"]) >= {"reference_weights", "rollout_kv_cache_min"}
    start = time.monotonic()
    again = preflight.run(ON_V6E, 2.70, MACHINE, root)
    assert time.monotonic() - start < 20 and all(r["compile_cached"] for r in again)
    assert [r["hbm_gib_per_chip"] for r in again] == [r["hbm_gib_per_chip"] for r in rows]

    # A sweep of three learning rates and two lengths of training compiles nothing more: the cache is
    # keyed by what shapes the compiled step (aot.SHAPE_FREE_ARGS are left out); each row's
    # steps, time and cost are the run's own.
    sweep = [[f"sft.train_sft.learning_rate={lr}", f"rl.train_rl.learning_rate={lr}"] for lr in (1e-5, 3e-5, 1e-4)]
    sweep += [["steps=300", "rl.train_rl.num_batches=50"]]
    swept = [preflight.run(ON_V6E + sets, 2.70, MACHINE, root) for sets in sweep]
    assert sum(not r["compile_cached"] for rows_ in swept for r in rows_) == 0, "a sweep value compiled again"
    assert [r["steps"] for r in swept[-1]] == [300, 50] and [r["steps"] for r in rows] == [sft["steps"], 100]
    # the training time is the run's own: start-up, its steps at the wall-clock step, its checkpoint saves
    row = swept[-1][0]
    assert row["est_train_s"] == pytest.approx(row["est_startup_s"][1] + 300 * row["est_step_s"]
                                               * row["wall_clock_factor"][1] + row["est_checkpoint_s"][1], abs=0.2)
    assert row["est_step_s"] == sft["est_step_s"] and row["est_train_s"] > sft["est_train_s"]
    assert swept[-1][0]["hbm_gib_per_chip"] == sft["hbm_gib_per_chip"]
