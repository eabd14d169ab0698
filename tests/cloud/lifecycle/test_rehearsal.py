"""`doit vm_run --rehearse` against the fakes: the embedded default through every step of a real run on a
one-chip VM, which is then deleted (mtpipe/cloud/lifecycle/rehearsal.py, docs/vm-checks.md).

The loopback VM is the project's clone whose DVC remote holds the shared pipeline's outputs (the
`project_world` fixture, as tests/cloud/lifecycle/test_vm_cycle.py's full cycle), so the VM's `dvc exp run` pulls
rather than trains. Its JAX has only the CPU: the TPU runtime check meets a stand-in `python` first on
PATH in `run.tpu_check` (as test_vm_cycle's TPU tests do) that records its arguments and hands every
other command line to the real interpreter; the Hub is tests/fakes/hf_server.py.
"""

from __future__ import annotations

import json

import pytest
from fakes.hf_server import HubServer
from pipeline import ran_stages
from vm_world import ONE_CHIP, TARGET, Env, assert_deleted, experiments, hub_with_tutorial_repos, sh, tpu_stand_in

from mtpipe.cloud.lifecycle import rehearsal

pytestmark = pytest.mark.first_run

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
def test_the_rehearsal_runs_the_embedded_default_on_one_chip_and_deletes_its_vm(project_world: Env) -> None:
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
    # the embedded default came from the bucket: no stage trained, and the experiment is here
    assert not ran_stages(out) & {"train_sft@sft", "train_sft@rl", "train_rl"}, out
    head = sh(["git", "rev-parse", "HEAD"], w.repo, w.env).strip()
    refs = sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], w.repo, w.env).split()
    assert len(refs) == 1 and refs[0].startswith(f"refs/exps/{head[:2]}/{head[2:]}/"), refs
    assert list(experiments(w)) == [refs[0].rsplit("/", 1)[1]]
    assert_deleted(w)
    assert "mtpipe: this run's VMs: 1; " in out and " USD" in out.split("this run's VMs: 1; ")[1].splitlines()[0]


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
