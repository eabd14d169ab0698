"""`doit vm_run --rehearse`: the embedded default through every step of a real run on a one-chip VM,
which is then deleted (mtpipe/cloud/lifecycle/rehearsal.py, docs/vm-checks.md).

The whole rehearsal against the fakes runs once in the suite, where the SFT quickstart types it
(tests/project/test_quickstart.py, which checks it with tests/vm_world.py's :func:`assert_rehearsed`);
this file holds what it is made of and what it refuses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from vm_world import TARGET, Env

from mtpipe.cloud.checks import tpu
from mtpipe.cloud.lifecycle import rehearsal
from mtpipe.cloud.settings import vm_config
from mtpipe.pipeline import config, overrides

pytestmark = [pytest.mark.first_run, pytest.mark.rehearsal]
ROOT = Path(__file__).resolve().parents[3]


def test_the_rehearsals_training_is_the_embedded_defaults_first_steps_on_the_one_chip_preset() -> None:
    """Both branches on the preset, each SFT run cut to TRAIN_STEPS on its full run's schedule (HEAD's
    views), GRPO cut to GRPO_STEPS, the evaluation to EVAL_PROBLEMS problems."""
    sets = rehearsal.training_sets(ROOT, "v6e-1")
    full = {b: yaml.safe_load((ROOT / "views" / b / "train_sft.yaml").read_text())["train_sft"]["steps"]
            for b in ("sft", "rl")}
    assert sets[:2] == rehearsal.EMBEDDED
    assert {"sft.hardware=v6e-1", "rl.hardware=v6e-1", f"steps={rehearsal.TRAIN_STEPS}",
            f"rl.train_sft.steps={rehearsal.TRAIN_STEPS}", f"rl.train_rl.num_batches={rehearsal.GRPO_STEPS}",
            f"rl.evaluate.num_problems={rehearsal.EVAL_PROBLEMS}",
            f"++sft.train_sft.extra_args.learning_rate_schedule_steps={full['sft']}",
            f"++rl.train_sft.extra_args.learning_rate_schedule_steps={full['rl']}"} <= set(sets)


def test_vllm_is_rehearsed_where_the_vms_setup_installs_it() -> None:
    """conf/vm.yaml's setup runs MaxText's install_tpu_post_train_extra_deps: a second experiment with
    vLLM's rollout and server; a setup without it gets the JAX rollout's alone."""
    cfg = vm_config.load_config({}).model_copy(update={"run": vm_config.load_config({}).run.model_copy(
        update={"hardware": "v6e-1"})})
    assert any(rehearsal.VLLM_SETUP in c for c in cfg.setup.commands)
    jax_run, vllm_run = rehearsal.experiments(cfg, ROOT)
    assert vllm_run == jax_run + rehearsal.VLLM
    views = {}
    for name, sets in (("jax", jax_run), ("vllm", vllm_run)):   # each applies as `dvc exp run -S` and composes
        branch = config.compose("rl", overrides.apply_sets(overrides.committed_params(ROOT), sets))
        views[name] = (config.stage_view(branch, "train_rl").train_rl, config.stage_view(branch, "evaluate").evaluate)
    assert (views["jax"][0].rollout_backend, views["jax"][1].backend) == ("cpu_jax", "cpu")
    assert (views["vllm"][0].rollout_backend, views["vllm"][1].backend) == ("vllm", "vllm")
    bare = cfg.model_copy(update={"setup": cfg.setup.model_copy(update={"commands": ["true"]})})
    assert rehearsal.experiments(bare, ROOT) == [jax_run]


def test_a_v5e_run_rehearses_on_one_v5e_chip_through_the_tpu_api() -> None:
    """ct5lp-hightpu-8t (Compute refuses it: the TPU API route) -> one v5litepod-1 node trained with
    conf/hardware/v5e-1.yaml, whose accelerator is the node's."""
    cfg = rehearsal.load_config({"machine_type": "ct5lp-hightpu-8t", "boot_disk_type": "pd-balanced"}, ROOT)
    assert (cfg.machine_type, cfg.run.hardware, vm_config.route(cfg)) == ("ct5lp-hightpu-1t", "v5e-1", "tpu_api")
    runs = rehearsal.experiments(cfg, ROOT)
    assert {"sft.hardware=v5e-1", "rl.hardware=v5e-1"} <= set(runs[0])
    (target,) = tpu.targets(ROOT, runs)   # what vm_run's TPU runtime check asks the node for
    assert target.accelerator_type == vm_config.accelerator_type(cfg) == "v5litepod-1"
    assert target.env["TPU_ACCELERATOR_TYPE"] == "v5litepod-1" and target.branches == ["sft", "rl"]


@pytest.mark.price
@pytest.mark.parametrize("zone", ["us-central1-b", "us-east5-b", "europe-west4-a"])
def test_the_rehearsal_with_vllm_costs_under_1_usd_on_spot(zone: str) -> None:
    cfg = rehearsal.load_config({"zone": zone}, ROOT)
    line = rehearsal.price_line(cfg, len(rehearsal.experiments(cfg, ROOT)))
    usd = float(line.split(" USD at ")[0].rsplit("about ", 1)[1])
    assert cfg.provisioning == "spot" and 0 < usd < 1, line


def test_a_loss_off_the_cpu_record_or_missing_fails_the_rehearsal() -> None:
    record = [6.5, 6.4, 6.2]
    assert rehearsal.Curve("train_sft@sft", [6.52, 6.38, 6.21], record).ok
    off = rehearsal.Curve("train_sft@sft", [6.5, 6.4, 6.2 + 2 * rehearsal.LOSS_TOLERANCE], record)
    assert not off.ok and "OUTSIDE the tolerance" in off.line()
    assert not rehearsal.Curve("train_sft@rl", [], record).ok
    assert not rehearsal.Curve("train_sft@rl", [6.5] * 4, record).ok     # more steps than the record holds
    with pytest.raises(vm_config.VmError, match="does not match the CPU record: train_sft@sft"):
        rehearsal.conclude([rehearsal.Curve("train_sft@rl", record, record), off])
    with pytest.raises(vm_config.VmError, match="no experiment came back"):
        rehearsal.conclude([])
    rehearsal.conclude([rehearsal.Curve("train_sft@rl", record, record)])
    assert rehearsal.losses("step,loss,eval_loss\n1,6.46932,\n2,6.51038,2.7\n") == [6.46932, 6.51038]


def test_the_rehearsal_refuses_what_it_would_not_rehearse_before_any_request(world: Env) -> None:
    """--set/--queue/--target (it runs the embedded default whole) and a VM the state file records (it
    makes its own): each stops with the flag and the fix before Compute is asked anything."""
    w = world
    for flag in ("--set=steps=3", "--queue", "--target=train_sft@sft"):
        out = w.doit("vm_run", "--rehearse", flag, ok=False).stdout
        assert f"ConfigError: {flag.split('=')[0]}: is not taken with --rehearse" in out and "drop " in out
    (w.repo / ".vm_state.json").write_text(json.dumps({key.lower(): value for key, value in TARGET.items()}))
    out = w.doit("vm_run", "--rehearse", ok=False).stdout
    assert "ConfigError: --rehearse: .vm_state.json records VM mt-test in proj-1/us-east5-b" in out
    assert "`doit vm_down`" in out and not w.fake.requests
