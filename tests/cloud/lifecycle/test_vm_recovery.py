"""Spot VMs with recovery: vm_run replaces a VM that is lost during the run.

The loopback world of tests/vm_world.py (fake Compute API, SSH server as the VM, GCS emulator as the
DVC remote) around a one-stage DVC repo. The run command is a cheap stand-in for a training that
resumes from a bucket: it counts steps 1..STEPS, keeping the last finished step in a directory named
by MTPIPE_WORK_BUCKET (passed with `run.env`, as a real run would pass its bucket), then runs the
experiment (`{dvc}`). A background thread preempts the VM when the count reaches a given step: the
fake Compute API marks the instance TERMINATED or deletes it, the SSH server drops the live sessions
(their commands die) and the VM's home is wiped (a new VM has a new disk), all before the API
answers another request. The recovery loop under test is vm_run's own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from fakes.gcs_emulator import GcsEmulator
from fakes.webhook import webhook
from pipeline import md5_tree
from vm_world import ROOT, Env, assert_deleted, experiments, loopback_world, make_repo, sh

from mtpipe.cloud.lifecycle import notify
from mtpipe.pipeline.stage import STAMP

if TYPE_CHECKING:
    import gcsfs

pytestmark = pytest.mark.preemption

STEPS = 6
SPOT = {"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
        "onHostMaintenance": "TERMINATE", "automaticRestart": False,
        "maxRunDuration": {"seconds": "14400"}}
# The stand-in training: resume at the bucket's last step, one step every 0.3 s, then the experiment.
RESUMABLE = (
    'B="$MTPIPE_WORK_BUCKET"; echo x >> "$B/attempts"; step=$(cat "$B/step" 2>/dev/null || echo 0); '
    'echo "training resumes at step $step"; '
    f'while [ "$step" -lt {STEPS} ]; do sleep 0.3; step=$((step + 1)); '
    'echo "$step" >> "$B/steps-run"; echo "$step" > "$B/step"; done; '
    'source "$HOME/venv/bin/activate" && dvc pull --allow-missing && {dvc} && dvc push')


@pytest.fixture
def spot(tmp_path: Path, gcs_emulator: GcsEmulator,
         local_env: dict[str, str]) -> Iterator[Env]:
    """A one-stage repo (`count` writes params.yaml's steps to count.json) on a Spot VM, admitted
    over SSH only while its instance is RUNNING, with the stand-in training as run.command."""
    repo = tmp_path / "repo"
    make_repo(repo, gcs_emulator, local_env)
    stage = ('python -c "import json, yaml; s = yaml.safe_load(open(\'params.yaml\'))[\'steps\']; '
             'json.dump({\'steps\': s}, open(\'count.json\', \'w\'))"')
    sh([sys.executable, "-m", "dvc", "stage", "add", "-q", "-n", "count", "-p", "steps",
         "-M", "count.json", stage], repo, local_env)
    sh(["git", "add", "-A"], repo, local_env)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "stage"], repo, local_env)
    with loopback_world(tmp_path, repo, local_env) as w:
        bucket(w).mkdir()
        admitted = w.sshd.authorized
        w.sshd.authorized = lambda: [key for key in admitted() if _running(w, key)]
        w.configure(provisioning="spot", run__command=RESUMABLE,
                    run__env__MTPIPE_WORK_BUCKET=str(bucket(w)))
        w.env.pop("RESERVATION")   # a Spot VM needs none
        yield w


def bucket(w: Env) -> Path:
    """Where the stand-in training keeps its progress: outlives every VM, like a GCS bucket."""
    return w.repo.parent / "bucket"


def _running(w: Env, key: str) -> bool:
    """The key is in the ssh-keys metadata of a RUNNING instance (a stopped VM runs no sshd)."""
    return any(inst.get("status") == "RUNNING" and any(
        item["value"] == key for item in inst.get("metadata", {}).get("items", []))
        for inst in w.fake.instances.values())


def _lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


class Preempter(threading.Thread):
    """Preempt the VM once per (attempt, step, delete): when attempt number `attempt` of the
    stand-in training has finished `step`, TERMINATE (or delete) the instance, with its sessions
    and its disk."""

    def __init__(self, w: Env, plan: list[tuple[int, int, bool]]) -> None:
        super().__init__(daemon=True)
        self.w, self.plan, self.done = w, plan, 0
        self.stop = threading.Event()

    def run(self) -> None:
        for attempt, step, delete in self.plan:
            while not self.stop.is_set():
                if (len(_lines(bucket(self.w) / "attempts")) == attempt
                        and int((_lines(bucket(self.w) / "step") or ["0"])[0]) >= step):
                    break
                time.sleep(0.02)
            else:
                return
            preempt(self.w, delete)
            self.done += 1


def preempt(w: Env, delete: bool) -> None:
    """Compute preempts the VM; with it go its SSH sessions (their commands die) and its disk."""

    def vm_gone() -> None:
        w.sshd.drop_sessions()
        for path in w.sshd.home.iterdir():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()

    w.fake.preempt("proj-1", "us-east5-b", "mt-test", delete=delete, then=vm_gone)


@pytest.mark.explains
@pytest.mark.slow
def test_spot_run_preempted_twice_completes(spot: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Preempted at step 2 (TERMINATED) and step 4 (deleted): two recoveries, three inserts of a
    Spot VM, each setting up again; the training resumes where the bucket says and the experiment
    comes back; vm_status adds up all three VMs; nothing is left after vm_down. The loopback webhook
    receives the notices: budget passed once, preempted and recovered twice, then finished."""
    w = spot
    monkeypatch.setattr(notify, "BUDGET_POLL_S", 0.2)
    w.configure(budget_usd=0.001)   # 0.37 s of a 9.72 USD/h Spot VM (us-east5)
    preempter = Preempter(w, [(1, 2, False), (2, 4, True)])
    preempter.start()
    with webhook() as (url, notices):
        w.env[notify.NOTIFY_URL_ENV] = url
        try:
            out = w.doit("vm_run", "--set=steps=7", "--exp-name=spot", "--keep").stdout
        finally:
            preempter.stop.set()
    assert preempter.done == 2
    titles = [n["title"].removeprefix("mtpipe vm_run on mt-test: ") for n in notices]
    assert titles.count("budget passed") == 1 and "past budget_usd 0.00" in out, titles
    assert [t for t in titles if t != "budget passed"] == ["preempted and recovered"] * 2 + ["finished"]
    assert [n["type"] for n in notices if n["title"].endswith("finished")] == ["success"]
    recovered = [n["message"] for n in notices if n["title"].endswith("recovered")]
    assert "recovery 1 of 3" in recovered[0] and "was preempted (status TERMINATED)" in recovered[0]
    assert "experiments spot are back" in notices[-1]["message"]
    assert "this run's VMs: 3, 2 of them replaced" in notices[-1]["message"]
    assert url.split("//")[1] not in out   # the URL (it may hold a token) is never printed
    assert "recovery 1 of 3: VM mt-test was preempted (status TERMINATED)" in out, out
    assert "recovery 2 of 3: VM mt-test was preempted and deleted by Compute" in out, out
    inserts = w.fake.inserts()
    assert len(inserts) == 3
    for insert in inserts:
        body = insert.json()
        assert body["scheduling"] == SPOT and "reservationAffinity" not in body
    assert "(spot) in us-east5-b: about 9.72 USD per hour" in out
    # Each VM set up from scratch; the steps ran once each, resuming at the bucket's last step.
    assert (w.sshd.home / "setup-count").read_text() == "ran\n"   # the third VM's disk
    assert out.count("mtpipe: VM set up") == 3
    assert _lines(bucket(w) / "attempts") == ["x"] * 3
    assert _lines(bucket(w) / "steps-run") == [str(i) for i in range(1, STEPS + 1)]
    resumed = [line for line in out.splitlines() if line.startswith("training resumes at step")]
    assert len(resumed) == 3 and resumed[0].endswith("step 0") and not resumed[1].endswith("step 0")
    assert experiments(w)["spot"]["metrics"] == {"count.json": {"steps": 7}}
    assert "this run's VMs: 3, 2 of them replaced after being lost" in out
    # The lost VMs were deleted before their replacement was inserted (the TERMINATED one by us).
    paths = [(r.method, r.path.split("?")[0]) for r in w.fake.requests]
    instance = "/compute/v1/projects/proj-1/zones/us-east5-b/instances"
    deletes = [i for i, p in enumerate(paths) if p == ("DELETE", instance + "/mt-test")]
    posts = [i for i, p in enumerate(paths) if p == ("POST", instance)]
    assert len(deletes) == 2 and posts[0] < deletes[0] < posts[1] < deletes[1] < posts[2]

    status = w.doit("vm_status").stdout
    assert "RUNNING, ct6e-standard-8t, SPOT" in status and "at 9.72 USD/h" in status
    assert status.count("  replaced: mt-test (spot)") == 2 and "this run's VMs: 3" in status
    down = w.doit("vm_down").stdout
    assert "this run's VMs: 3, 2 of them replaced" in down
    assert_deleted(w)


def test_max_recoveries_exceeded_deletes_the_vm(spot: Env) -> None:
    """max_recoveries 1, preempted twice: vm_run gives up with a clear message and deletes the VM
    and the firewall rule, even with --keep (a preempted Spot VM cannot be restarted)."""
    w = spot
    w.configure(max_recoveries=1)
    preempter = Preempter(w, [(1, 1, False), (2, 1, False)])
    preempter.start()
    try:
        proc = w.doit("vm_run", "--keep", ok=False)
    finally:
        preempter.stop.set()
    out = proc.stdout + proc.stderr
    assert "recovery 1 of 1: VM mt-test was preempted (status TERMINATED)" in out, out
    assert ("VmLost: VM mt-test was preempted (status TERMINATED) (lost the SSH session to "
            "127.0.0.1") in out
    assert "it was replaced 1 times already (max_recoveries: 1), so vm_run gives up" in out
    assert "deleting VM mt-test (a lost VM cannot be restarted)" in out
    assert len(w.fake.inserts()) == 2
    assert_deleted(w)


# The stand-in training through mtpipe's runner (tests/fakes/fake_maxtext.py: 4 steps, 0.2 s each),
# in a stage's log directory of the checkout on the VM, then a wait for the test's go-ahead.
TRAINING = (
    'echo /work/ >> .git/info/exclude; export PYTHONPATH="$PYTHONPATH:' + str(ROOT / "tests") + '"; '
    'source "$HOME/venv/bin/activate" && python -c "from pathlib import Path; from mtpipe.maxtext import runner; '
    'from mtpipe.maxtext.commands import MaxTextCommand; '
    "runner.run(MaxTextCommand('train', ['4', '0.2'], launcher='fakes.fake_maxtext'), "
    "Path('work/logs/sft/train_sft.log'), total_steps=10)\" && "
    'for i in $(seq 600); do [ -e "$MTPIPE_WORK_BUCKET/go-on" ] && break; sleep 0.1; done; ')


def vm_status_when(w: Env, ready: Callable[[], bool], result: list[str]) -> threading.Thread:
    """`doit vm_status` from another terminal (a process of its own) once ``ready()``, its output
    appended to ``result``; then the go-ahead for the stand-in training to end."""

    def read() -> None:
        deadline = time.monotonic() + 120
        try:
            while not ready():
                if time.monotonic() > deadline:
                    result.append("the stand-in training never reached the step")
                    return
                time.sleep(0.1)
            proc = subprocess.run([sys.executable, "-m", "doit", "-f", str(ROOT / "dodo.py"), "-d", str(w.repo),
                                   "vm_status"], env=w.env, capture_output=True, text=True, timeout=120)
            result.append(proc.stdout + proc.stderr)
        finally:
            (bucket(w) / "go-on").touch()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


@pytest.mark.explains
@pytest.mark.slow
def test_failure_on_a_running_spot_vm_is_not_retried(spot: Env) -> None:
    """A pipeline that fails on a VM that still runs is the pipeline's failure: no recovery, and
    one notice: failed. While it trains, `doit vm_status` from another terminal shows the stage,
    step, loss and ETA on the VM and the spend so far."""
    spot.configure(run__command='echo x >> "$MTPIPE_WORK_BUCKET/attempts"; ' + TRAINING + 'exit 3')
    progress_file = spot.sshd.home / "mtpipe" / "work" / "logs" / "sft" / "train_sft.progress.json"
    status: list[str] = []
    reader = vm_status_when(spot, lambda: progress_file.exists() and
                            json.loads(progress_file.read_text())["step"] >= 3, status)
    with webhook() as (url, notices):
        spot.env[notify.NOTIFY_URL_ENV] = url
        proc = spot.doit("vm_run", ok=False)
    reader.join()
    assert re.search(r"training: train_sft@sft: step 3/10, loss 2\.7, ETA 0:0\d \(written \d+ s ago\)",
                     status[0]), status[0]
    assert "VM mt-test in proj-1/us-east5-b: RUNNING" in status[0]
    assert "this run's VMs: 1; " in status[0] and "USD" in status[0]
    assert not re.search(r"Traceback|Warning|WARNING", status[0]), status[0]
    assert [(n["title"], n["type"]) for n in notices] == [("mtpipe vm_run on mt-test: failed", "failure")]
    assert "the pipeline failed on the VM (exit 3)" in notices[0]["message"]
    assert "the pipeline failed on the VM (exit 3)" in proc.stdout + proc.stderr
    assert "recovery" not in proc.stdout and len(spot.fake.inserts()) == 1
    assert _lines(bucket(spot) / "attempts") == ["x"]
    assert_deleted(spot)


def test_vm_past_max_run_duration_is_not_replaced(spot: Env) -> None:
    """Compute deleted the VM because its time limit ran out: that is the spending limit, not a
    preemption, so vm_run stops (and says which setting to raise) instead of paying for another."""
    w = spot
    w.configure(max_run_duration_s=1, run__command='echo x >> "$MTPIPE_WORK_BUCKET/attempts"; '
                                                  'sleep 1; echo 1 > "$MTPIPE_WORK_BUCKET/step"; '
                                                  'sleep 60')
    preempter = Preempter(w, [(1, 1, True)])   # from outside, maxRunDuration looks the same
    preempter.start()
    try:
        proc = w.doit("vm_run", ok=False)
    finally:
        preempter.stop.set()
    out = proc.stdout + proc.stderr
    assert "VM mt-test reached max_run_duration_s (1 s) and Compute deleted it" in out, out
    assert "recovery" not in proc.stdout and len(w.fake.inserts()) == 1
    assert_deleted(w)


@pytest.mark.explains
@pytest.mark.slow
def test_sweep_resumes_after_the_finished_experiments(spot: Env) -> None:
    """A three-experiment sweep preempted during the second: the replacement VM runs the second
    and the third only (the first came back before the VM was lost). The notice URL is dead: each
    notice is one line, and the run succeeds."""
    w = spot
    with webhook() as (url, _):   # a URL whose server is gone
        w.env[notify.NOTIFY_URL_ENV] = url
    w.configure(run__command='echo x >> "$MTPIPE_WORK_BUCKET/attempts"; '
                             'sleep 1; source "$HOME/venv/bin/activate" && '
                             'dvc pull --allow-missing && {dvc} && dvc push')
    preempter = Preempter(w, [(2, 0, True)])   # as soon as the second experiment starts
    preempter.start()
    try:
        out = w.doit("vm_run", "--queue", "--set=steps=1", "--set=steps=2", "--set=steps=3",
                     "--exp-name=sweep").stdout
    finally:
        preempter.stop.set()
    assert preempter.done == 1 and len(w.fake.inserts()) == 2
    assert "recovery 1 of 3: VM mt-test was preempted and deleted by Compute" in out, out
    for event in ("preempted and recovered", "finished"):
        assert f"mtpipe: notice '{event}' not sent to MTPIPE_NOTIFY_URL (the service refused it or was " \
               "unreachable); the run goes on" in out, out
    assert url.split("//")[1] not in out
    assert [line.rsplit(": ", 1)[1] for line in out.splitlines()
            if line.startswith("mtpipe: experiment ") and " of 3: " in line] == [
        "steps=1", "steps=2", "steps=2", "steps=3"]
    assert len(_lines(bucket(w) / "attempts")) == 4
    assert {name: data["metrics"] for name, data in experiments(w).items()} == {
        f"sweep-{n}": {"count.json": {"steps": n}} for n in (1, 2, 3)}
    assert_deleted(w)


def remote_manifest(fs: gcsfs.GCSFileSystem, remote: str, dir_md5: str) -> dict[str, str]:
    """relative path -> md5 of each file of a directory output, from its `.dir` entry in a DVC remote."""
    entries = json.loads(fs.cat(f"{remote}/files/md5/{dir_md5[:2]}/{dir_md5[2:]}"))
    return {entry["relpath"]: entry["md5"] for entry in entries}


@pytest.mark.slow
@pytest.mark.resume_exact
def test_real_training_on_spot_survives_two_preemptions(project_world: Env, gcs_emulator: GcsEmulator,
                                                       pipeline_repo: Path) -> None:
    """The embedded SFT branch (real MaxText) up to its evaluation on a loopback Spot VM, the training's
    run directory in the work bucket (the emulator), with checkpoints every 25 steps instead of 50 and
    16 test conversations instead of 32: train_sft, evaluate_base and evaluate rerun. MaxText holds
    after step 50 (MTPIPE_HOLD_AFTER_STEP, in run.env) and the first VM is preempted (TERMINATED) once
    the bucket has that checkpoint and its loss row; the second VM resumes there, finishes train_sft
    (pushed to the DVC remote as it ends: mtpipe.cloud.on_vm.exp_run) and is preempted (deleted) when
    evaluate has started; the third pulls train_sft's outputs from the run-cache instead of training
    again and evaluates. Nothing is converted or exported on a VM: the resumed run's params are the
    uninterrupted run's bytes (the pipeline's), stamp included, so the export is up to date. The loss
    curve and metrics are the uninterrupted run's too (the metrics record the resume); no VM or
    firewall rule is left."""
    # imported here: with work_bucket (gcsfs) imported at collection, the remote probes of the
    # other tests in this file time out when the file runs alone
    from work_bucket import bucket_env, checkpoint_to_resume, committed, emulator_fs

    w, hold = project_world, 50
    fs, runs = emulator_fs(gcs_emulator), f"{gcs_emulator.bucket}/spot-work/train_sft"
    admitted = w.sshd.authorized
    w.sshd.authorized = lambda: [key for key in admitted() if _running(w, key)]
    w.configure(provisioning="spot",
                run__env={**bucket_env(gcs_emulator, prefix="spot-work"), "MTPIPE_HOLD_AFTER_STEP": str(hold)},
                run__command='source "$HOME/venv/bin/activate" && dvc pull --allow-missing && {dvc} && dvc push')
    w.env.pop("RESERVATION")
    evaluate_log = w.sshd.home / "mtpipe" / "work" / "logs" / "sft" / "evaluate.log"
    done, stop = [], threading.Event()

    def preempt_when(ready: Callable[[], bool], delete: bool) -> None:
        """Preempt once ``ready()``; a failed poll (the emulator mid-write) is retried, and if the
        moment never comes the VM is deleted anyway, so the run ends and the test fails."""
        deadline = time.monotonic() + 1200
        while not stop.wait(0.3):
            try:
                if ready():
                    done.append("evaluate" if delete else max(committed(fs, runs)))
                    break
            except Exception as err:  # noqa: BLE001
                print(f"preempter: poll failed ({type(err).__name__}: {err}); retrying")
            if time.monotonic() > deadline:
                done.append("timed out")
                break
        else:
            return
        preempt(w, delete)

    def preempter() -> None:
        # MaxText holds after step 50: the step's row reaches the bucket meanwhile
        preempt_when(lambda: checkpoint_to_resume(fs, runs, at_least=hold) is not None, delete=False)
        preempt_when(lambda: evaluate_log.exists() and evaluate_log.stat().st_size > 0, delete=True)

    thread = threading.Thread(target=preempter, daemon=True)
    thread.start()
    try:
        out = w.doit("vm_run", "--set=sft.train_sft.checkpoint_period=25", "--set=+sft.evaluate.num_problems=16",
                     "--target=evaluate@sft",
                     "--exp-name=spot").stdout
    finally:
        stop.set()
        thread.join()
    assert done == [hold, "evaluate"], out[-3000:]
    assert "recovery 1 of 3: VM mt-test was preempted (status TERMINATED)" in out, out[-3000:]
    assert "recovery 2 of 3: VM mt-test was preempted and deleted by Compute" in out
    assert len(w.fake.inserts()) == 3 and all(i.json()["scheduling"] == SPOT for i in w.fake.inserts())
    ran = re.findall(r"Running stage '([^']+)'", out)
    assert ran.count("train_sft@sft") == 2 and ran.count("evaluate@sft") == 2, ran
    assert "to_maxtext@sft" not in ran and "to_huggingface@sft" not in ran, ran
    second_vm = out.split("recovery 1 of 3")[1].split("recovery 2 of 3")[0]
    assert "mtpipe: pushed the outputs of 'train_sft@sft'" in second_vm, "train_sft did not reach the remote"
    assert out.count("Stage 'train_sft@sft' is cached - skipping run") == 1, "the third VM trained again"
    resumed = re.findall(r"resuming gs://\S+: MaxText restores its checkpoint at step (\d+)", out)
    assert resumed == [str(hold)], resumed

    rev = experiments(w)["spot"]["rev"]
    metrics = experiments(w)["spot"]["metrics"]["metrics/sft/train_sft.json"]
    assert metrics["resumed_from_step"] == hold
    lock, head = (yaml.safe_load(sh(["git", "show", f"{r}:dvc.lock"], w.repo, w.env)) for r in (rev, "HEAD"))
    out = next(o for o in lock["stages"]["train_sft@sft"]["outs"] if o["path"] == "artifacts/sft/trained")
    files = remote_manifest(fs, f"{gcs_emulator.bucket}/{w.repo.parent.name}", out["md5"])
    assert STAMP in files and files == md5_tree(pipeline_repo / "artifacts/sft/trained", ["."]), "the params differ"
    assert lock["stages"]["to_huggingface@sft"] == head["stages"]["to_huggingface@sft"], "the export moved"
    reference = json.loads((pipeline_repo / "metrics" / "sft" / "train_sft.json").read_text())
    assert metrics == reference | {"resumed_from_step": hold}, "the metrics differ from the uninterrupted run's"
    curve, reference = (sh(["git", "show", f"{r}:plots/sft/train_sft.csv"], w.repo, w.env) for r in (rev, "HEAD"))
    assert curve == reference, "the loss curve differs from the uninterrupted run's"
    assert "the loss curve has no rows" not in out
    fs.invalidate_cache()
    assert fs.find(runs) == [], "the bucket run directory was not deleted after success"
    assert_deleted(w)
