"""`doit vm_run --rehearse` against the fakes: the embedded default through every step of a real run on a
one-chip VM, which is then deleted (mtpipe/cloud/lifecycle/rehearsal.py, docs/vm-checks.md).

The loopback VM is the project's clone whose DVC remote holds the shared pipeline's outputs (the
`project_world` fixture, as tests/cloud/lifecycle/test_vm_cycle.py's full cycle): the VM's `dvc exp run` pulls
what the rehearsal does not change (the conversions) and trains the rest with the one-chip preset's
commands. Its JAX has only the CPU, which runs those commands as they are (JAX finds no TPU and takes
the CPU; MaxText picks its attention by the device): the losses then equal the CPU record's. The TPU
runtime check meets a stand-in `python` first on PATH in `run.tpu_check` (as test_vm_cycle's TPU tests
do) that records its arguments and hands every other command line to the real interpreter; the Hub is
tests/fakes/hf_server.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fakes.hf_server import HubServer
from pipeline import ran_stages
from vm_world import ONE_CHIP, TARGET, TOKEN, Env, assert_deleted, experiments, hub_with_tutorial_repos, sh, tpu_stand_in

from mtpipe.cloud.lifecycle import rehearsal
from mtpipe.cloud.settings import vm_config
from mtpipe.pipeline import config, overrides

pytestmark = [pytest.mark.first_run, pytest.mark.rehearsal]
ROOT = Path(__file__).resolve().parents[3]
TRAINED = {"train_sft@sft", "train_sft@rl", "train_rl", "to_huggingface@sft", "to_huggingface@rl", "evaluate@sft",
           "evaluate@rl"}

# What the rehearsal's VM may differ in from the real run's: its machine type (with the one thread per
# core that only the 8-chip type takes, bodies.SINGLE_THREADED) and how it is paid for (scheduling, the
# reservation it is not in, the label that names the mode); and each creation's run id
MACHINE_AND_PROVISIONING = ("machineType", "advancedMachineFeatures", "scheduling", "reservationAffinity")
PER_VM_LABELS = ("mtpipe-provisioning", "mtpipe-run")


def comparable(body: dict) -> dict:
    """An insert's body without what the rehearsal changes on purpose."""
    labels = {k: v for k, v in body["labels"].items() if k not in PER_VM_LABELS}
    return {k: v for k, v in body.items() if k not in MACHINE_AND_PROVISIONING} | {"labels": labels}


@pytest.mark.slow
@pytest.mark.secrets
def test_the_rehearsal_trains_the_embedded_default_on_one_chip_and_deletes_its_vm(project_world: Env) -> None:
    w = project_world
    w.doit("vm_up")      # the real run's VM: its insert is the one the rehearsal's must match
    w.doit("vm_down")
    tpu_stand_in(w)
    with HubServer(w.repo.parent / "hub") as hub:
        hub_with_tutorial_repos(hub)
        w.env["HF_ENDPOINT"] = hub.url
        w.configure(run__env__HF_ENDPOINT=hub.url)
        out = w.doit("vm_run", "--rehearse").stdout

    real, rehearsed = (r.json() for r in w.fake.inserts())
    assert rehearsed["machineType"].endswith(f"/machineTypes/{ONE_CHIP}") and real["machineType"].endswith("-8t")
    assert "advancedMachineFeatures" not in rehearsed and real["advancedMachineFeatures"] == {"threadsPerCore": 1}
    assert rehearsed["scheduling"]["provisioningModel"] == "SPOT"
    assert rehearsed["scheduling"]["maxRunDuration"]["seconds"] == str(rehearsal.MAX_RUN_DURATION_S)
    assert rehearsed["labels"]["mtpipe-provisioning"] == "spot"
    assert comparable(rehearsed) == comparable(real)
    assert f"creating {ONE_CHIP} VM mt-test (spot) in us-east5-b: about 1.22 USD per hour" in out

    # the TPU runtime check asked for the one chip, with the one-chip preset's environment
    calls = (w.sshd.home / "tpu-check-calls").read_text().splitlines()
    assert calls == ["-m mtpipe.maxtext.tpu_check --devices 1 --device-kind TPU v6 lite|v6e-1"]
    assert "TPU runtime ok: 1 x 'TPU v6 lite' (a stand-in)" in out
    assert "Hub download ok: README.md of dataset HuggingFaceH4/ultrachat_200k at 8049631c405a" in out
    # the VM trained, exported and evaluated both branches with the one-chip preset's commands
    assert TRAINED <= ran_stages(out), out
    argv = (w.sshd.home / "argv.txt").read_text()   # every process of the remote sessions
    assert "maxtext.trainers.post_train.sft.train_sft" in argv and "maxtext.trainers.post_train.rl.train_rl" in argv
    head = sh(["git", "rev-parse", "HEAD"], w.repo, w.env).strip()
    refs = sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], w.repo, w.env).split()
    assert len(refs) == 1 and refs[0].startswith(f"refs/exps/{head[:2]}/{head[2:]}/"), refs
    assert list(experiments(w)) == [refs[0].rsplit("/", 1)[1]]
    view = yaml.safe_load(sh(["git", "show", f"{refs[0]}:views/rl/train_sft.yaml"], w.repo, w.env))
    assert view["hardware"]["env"]["TPU_ACCELERATOR_TYPE"] == "v6e-1" and "JAX_PLATFORMS" not in view["hardware"]["env"]
    assert view["train_sft"]["steps"] == rehearsal.TRAIN_STEPS
    full = yaml.safe_load(sh(["git", "show", "HEAD:views/rl/train_sft.yaml"], w.repo, w.env))["train_sft"]["steps"]
    assert view["train_sft"]["extra_args"]["learning_rate_schedule_steps"] == full
    rl = json.loads(sh(["git", "show", f"{refs[0]}:metrics/rl/train_rl.json"], w.repo, w.env))
    assert rl["steps"] == rehearsal.GRPO_STEPS
    steps = (rehearsal.TRAIN_STEPS, rehearsal.TRAIN_STEPS, rehearsal.GRPO_STEPS)
    assert (f"trained on the VM: train_sft@sft {steps[0]} steps on v6e-1, train_sft@rl {steps[1]} steps on "
            f"v6e-1, train_rl@rl {steps[2]} steps on v6e-1") in out
    # each loss beside the CPU record's at its step: the loopback VM's CPU computes the same
    for stage in ("train_sft@sft", "train_sft@rl"):
        assert (f"rehearsal: {stage}: steps 1-{rehearsal.TRAIN_STEPS} on the chip" in out
                and f"max |difference| 0.0000, within the tolerance {rehearsal.LOSS_TOLERANCE}" in out), out
    assert f"every loss within {rehearsal.LOSS_TOLERANCE} of the CPU record" in out
    assert f"vLLM is not rehearsed: the VM's setup does not run {rehearsal.VLLM_SETUP}" in out
    minutes = rehearsal.SETUP_MIN + rehearsal.EXPERIMENT_MIN
    assert f"rehearsal: about {minutes} minutes on the VM" in out and f"about {1.215 * minutes / 60:.2f} USD at" in out
    assert TOKEN not in argv and TOKEN not in out
    assert_deleted(w)
    assert "mtpipe: this run's VMs: 1; " in out and " USD" in out.split("this run's VMs: 1; ")[1].splitlines()[0]


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
    target = rehearsal.tpu_target(cfg, ROOT)
    assert target.accelerator_type == vm_config.accelerator_type(cfg) == "v5litepod-1"
    assert {"sft.hardware=v5e-1", "rl.hardware=v5e-1"} <= set(rehearsal.experiments(cfg, ROOT)[0])


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
