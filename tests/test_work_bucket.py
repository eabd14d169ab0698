"""Training state in a work bucket (mtpipe/maxtext/run_dir.py): a killed training stage resumes on
another machine from the bucket's latest complete checkpoint.

The patched GCS emulator (tests/fakes/gcs_emulator.py) is the bucket for every client a stage has:
gcsfs and google-cloud-storage read STORAGE_EMULATOR_HOST, tensorstore (Orbax's storage)
TENSORSTORE_GCS_HTTP_URL with GOOGLE_AUTH_TOKEN_FOR_TESTING. A fresh `git clone` of the session's
pipeline repo is the new machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import restore
from mtpipe.pipeline import config
from mtpipe.maxtext import run_dir as rd
from mtpipe.errors import ConfigError
from pipeline import ROOT, csv_rows, dvc, env, git, kill_group, md5_tree, start_held
from work_bucket import PERIOD, bucket_env, checkpoint_to_resume, committed, emulator_fs

pytestmark = pytest.mark.preemption


# ------------------------------------------- what a preemption loses on the TPU presets

MAX_LOST_MINUTES = 5
GCS_WRITE_GB_S = 1.0  # assumed; Orbax logs each save's time ("Finished save (blocking + background) in N s")
STATE_BYTES_PER_PARAM = 12  # float32 params + Adam's two moments, what each checkpoint holds
# (branch, preset): seconds per step (the tutorials' ~10 min of training: 1000 SFT steps, 50 GRPO
# batches) and billions of trained parameters (Gemma 3 4B's language model, Llama 3.1 8B)
TPU_TRAINING = {
    ("sft", "gemma3-4b-ultrachat-v6e8"): (600 / 1000, 3.9),
    ("rl", "llama3.1-8b-gsm8k-v6e8"): (600 / 50, 8.0),
}
RL_YML = Path(importlib.util.find_spec("maxtext").origin).parent / "configs" / "post_train" / "rl.yml"


def checkpoint_period(branch: str, preset: str) -> int:
    """The preset's checkpoint_period (train_rl: its extra_args, else MaxText's rl.yml)."""
    presets = {"sft": "gemma3-4b-ultrachat-v6e8", "rl": "llama3.1-8b-gsm8k-v6e8", branch: preset}
    cfg = config.compose(branch, OmegaConf.create({"steps": None, **{b: {"preset": p} for b, p in presets.items()}}))
    if branch == "sft":
        return cfg.train_sft.checkpoint_period
    return cfg.train_rl.extra_args.get("checkpoint_period", yaml.safe_load(RL_YML.read_text())["checkpoint_period"])


@pytest.mark.parametrize(("branch", "preset"), sorted(TPU_TRAINING))
def test_a_preemption_loses_at_most_5_minutes_of_tpu_training(branch, preset):
    """Lost: the steps since the last complete checkpoint (checkpoint_period x step time) and those
    run while the next one was being written (its size at GCS_WRITE_GB_S)."""
    step_s, billions = TPU_TRAINING[(branch, preset)]
    period, save_s = checkpoint_period(branch, preset), billions * STATE_BYTES_PER_PARAM / GCS_WRITE_GB_S
    lost_min = (period * step_s + save_s) / 60
    assert lost_min <= MAX_LOST_MINUTES, (
        f"{preset}: checkpoint_period {period} loses up to {lost_min:.1f} min; set it to at most "
        f"{int((MAX_LOST_MINUTES * 60 - save_s) / step_s)}")
    assert save_s < period * step_s, f"{preset}: training would wait for each save; raise checkpoint_period"


# ------------------------------------------------------------------------ the setting itself


@pytest.mark.parametrize("value", ["my-bucket/work", "gs://", "gs://My_Bucket/work", "/tmp/work", "s3://b/work"])
def test_a_work_bucket_that_is_no_gs_url_is_named_with_the_fix(value, monkeypatch):
    monkeypatch.setenv(rd.WORK_BUCKET_ENV, value)
    with pytest.raises(ConfigError) as err:
        rd.run_dir("train_sft", "train_sft-sft-0123456789ab")
    assert err.value.key == rd.WORK_BUCKET_ENV and repr(value) in err.value.problem
    assert f"export {rd.WORK_BUCKET_ENV}=gs://" in err.value.fix and "unset it" in err.value.fix


def test_without_a_work_bucket_the_run_directory_stays_in_work(monkeypatch):
    monkeypatch.delenv(rd.WORK_BUCKET_ENV, raising=False)
    run = rd.run_dir("train_rl", "train_rl-0123456789ab")
    assert not run.in_bucket and run.url == str(ROOT / "work" / "train_rl" / "train_rl-0123456789ab")
    assert Path(run.url) == run.scratch


def test_an_unwritable_work_bucket_is_named_with_the_fix(gcs_emulator, monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    monkeypatch.setenv(rd.WORK_BUCKET_ENV, "gs://no-such-bucket/work")
    with pytest.raises(ConfigError, match=r"cannot write to gs://no-such-bucket/work/train_sft/r\b") as err:
        rd.run_dir("train_sft", "r")
    assert err.value.key == rd.WORK_BUCKET_ENV and "roles/storage.objectUser" in err.value.fix


@pytest.mark.slow
def test_a_bucket_run_directory_counts_committed_steps_mirrors_and_cleans_up(gcs_emulator, monkeypatch, tmp_path):
    """Only steps with Orbax's commit marker count; the mirrored file holds whole lines and comes
    back on a machine that has none; `take` downloads without the run directory's path in the
    commit markers; `remove` deletes unless told to keep."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    fs = emulator_fs(gcs_emulator)
    run = rd.RunDir(f"gs://{gcs_emulator.bucket}/unit/train_sft", "r", tmp_path / "scratch")
    for step in (10, 20):
        fs.pipe(f"{run.url}/checkpoints/{step}/model_params/w/0", b"w%d" % step)
        fs.pipe(f"{run.url}/checkpoints/{step}/model_params/{rd.COMMIT_MARKER}",
                f"Checkpoint commit was successful to {run.url}/checkpoints/{step}/model_params".encode())
    fs.pipe(f"{run.url}/checkpoints/10/{rd.COMMIT_MARKER}", b"")
    assert run.latest_checkpoint() == 10  # step 20 is still being written

    metrics = run.scratch / "metrics.jsonl"
    run.scratch.mkdir()
    with run.mirrored(metrics):
        metrics.write_text('{"step": 1}\n{"step": 2')  # MaxText is writing line 2
    assert fs.cat(f"{run.url}/metrics.jsonl") == b'{"step": 1}\n'
    metrics.unlink()
    with run.mirrored(metrics):
        assert metrics.read_text() == '{"step": 1}\n'

    run.take("checkpoints/10/model_params", tmp_path / "model_params")
    assert (tmp_path / "model_params" / "w" / "0").read_bytes() == b"w10"
    assert (tmp_path / "model_params" / rd.COMMIT_MARKER).read_text() == "Checkpoint commit was successful"
    monkeypatch.setenv(rd.KEEP_ENV, "1")
    run.remove()
    assert fs.exists(f"{run.url}/checkpoints/10/{rd.COMMIT_MARKER}") and not run.scratch.exists()
    monkeypatch.delenv(rd.KEEP_ENV)
    run.remove()
    assert fs.find(run.url) == []


def _lease(run: rd.RunDir, **fields) -> None:
    """A lease as another holder left it."""
    lease = {"holder": "ann@elsewhere", "host": "elsewhere", "pid": 1, "token": "t", "start": rd._now(),
             "renewed": rd._now()} | fields
    run._write(rd.LEASE, json.dumps(lease).encode())


@pytest.mark.address
@pytest.mark.parametrize("where", ["local", "bucket"])
def test_a_run_directory_has_one_holder(where, gcs_emulator, monkeypatch, tmp_path):
    """A live holder's run directory is refused, naming it; a holder whose process ended on this host,
    or whose lease was not renewed for STALE_S, is taken over; the lease goes when the holder ends."""
    monkeypatch.setattr(rd, "DYING_S", 1.0)   # how long a live holder here gets to end before the refusal
    if where == "bucket":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
        run = rd.RunDir(f"gs://{gcs_emulator.bucket}/lease-{tmp_path.name}/train_sft", "r", tmp_path / "scratch")
    else:
        run = rd.RunDir(str(tmp_path / "work" / "train_sft"), "r", tmp_path / "work" / "train_sft" / "r")
    with run.leased():
        with pytest.raises(ConfigError, match=rf"^{re.escape(run.url)}: is in use by \S+@\S+ \(pid {os.getpid()}\), "
                                              r"training the same recipe since .*Fix: wait for that run"):
            with run.leased():
                pass
    assert run._read(rd.LEASE) is None

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _lease(run, host=socket.gethostname(), pid=int(ended.stdout))
    with run.leased():   # its process ended here: a killed stage, resumed
        assert json.loads(run._read(rd.LEASE))["pid"] == os.getpid()
    _lease(run)   # another host, renewed just now
    with pytest.raises(ConfigError, match=r"is in use by ann@elsewhere \(pid 1\)"):
        with run.leased():
            pass
    stale = (datetime.now(timezone.utc) - timedelta(seconds=rd.STALE_S + 5)).isoformat(timespec="seconds")
    _lease(run, renewed=stale)   # another host gone silent: a preempted VM
    with run.leased():
        pass


@pytest.mark.slow
def test_a_bad_work_bucket_stops_the_stage_before_maxtext(pipeline_repo):
    proc = subprocess.run([sys.executable, "-m", "stages.train_sft", "sft"], cwd=pipeline_repo,
                          env={**env(), rd.WORK_BUCKET_ENV: "my-bucket/work"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0
    assert ("train_sft: MTPIPE_WORK_BUCKET: 'my-bucket/work' is not a gs://BUCKET[/PREFIX] URL. "
            f"Fix: export {rd.WORK_BUCKET_ENV}=gs://") in proc.stderr, proc.stderr[-3000:]
    assert "mtpipe.maxtext.adapter" not in proc.stdout, proc.stdout  # MaxText never started


# ------------------------------------------------------------- killed here, resumed elsewhere

def completed_steps(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"completed step: (\d+),", log)]


def wait_for(condition, what: str, timeout: float = 120.0):
    """Poll ``condition()`` until it returns something true; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return found


def fresh_clone(repo: Path, dest: Path) -> Path:
    """`git clone` of ``repo`` with its DVC outputs checked out: DVC's cache is shared, standing in
    for `dvc pull` from a remote; a warm XLA compile cache, as a set-up VM keeps."""
    git(dest.parent, "clone", "-q", str(repo), str(dest))
    dvc(dest, "cache", "dir", "--local", str(repo / ".dvc" / "cache"))
    dvc(dest, "checkout")
    (dest / "work").mkdir()
    (dest / "work" / "jax_cache").symlink_to(ROOT / "work" / "jax_cache")
    return dest


@pytest.mark.slow
@pytest.mark.resume_exact
def test_killed_training_resumes_from_the_bucket_in_a_fresh_clone(pipeline_repo, gcs_emulator, tmp_path):
    """train_sft@sft SIGKILLed after its step-50 checkpoint reached the bucket (MaxText holds there:
    MTPIPE_HOLD_AFTER_STEP) leaves its checkpoints in the bucket only; in a fresh clone the same stage
    restores that step, skips the 50 batches it trained and ends as the uninterrupted run (the shared
    pipeline's) ended: the same param bytes and the same loss curve, row for row. It writes the
    output as a local run does and empties the bucket. While the first still runs, the clone's same
    stage stops before MaxText, naming it (the run directory's lease), and leaves the bucket as it was."""
    bucket, fs = bucket_env(gcs_emulator), emulator_fs(gcs_emulator)
    runs, scratch = f"{gcs_emulator.bucket}/work/train_sft", pipeline_repo / "work" / "train_sft"
    reference = pipeline_repo / "artifacts" / "sft" / "trained"
    params, curve = md5_tree(reference, ["model_params"]), csv_rows(pipeline_repo / "plots" / "sft" / "train_sft.csv")
    before = set(scratch.iterdir()) if scratch.is_dir() else set()
    clone = fresh_clone(pipeline_repo, tmp_path / "clone")
    try:
        held = start_held(pipeline_repo, "train_sft@sft", PERIOD, pipeline_repo / "work/logs/sft/train_sft.log",
                          extra_env=bucket)
        try:  # the hold is endless: the mirror (every MIRROR_EVERY_S) brings the step's row up meanwhile
            run = wait_for(lambda: checkpoint_to_resume(fs, runs), "the step-50 loss row in the bucket")
            objects = sorted(fs.find(f"{runs}"))
            second = dvc(clone, "repro", "-f", "-s", "--no-run-cache", "train_sft@sft", extra_env=bucket, check=False)
            assert second.returncode != 0 and f"train_sft: gs://{run}: is in use by " in second.stdout, second.stdout
            assert "training the same recipe since" in second.stdout and "mtpipe.maxtext.adapter" not in second.stdout
            fs.invalidate_cache()
            assert sorted(fs.find(f"{runs}")) == objects, "the refused stage touched the holder's run directory"
        finally:
            kill_group(held)
        url, run_name = f"gs://{run}", run.rsplit("/", 1)[1]
        assert max(step for step, where in committed(fs, runs).items() if where == run) == PERIOD
        assert not (scratch / run_name / "checkpoints").exists(), "checkpoints went to work/, not the bucket"
    finally:
        for left in set(scratch.glob("train_sft-*")) - before:
            shutil.rmtree(left)
        restore(pipeline_repo)

    out = dvc(clone, "repro", "-f", "-s", "--no-run-cache", "train_sft@sft", extra_env=bucket).stdout
    assert f"taking over gs://{run} from " in out and "its process ended on" in out, out[-3000:]
    assert f"resuming {url}: MaxText restores its checkpoint at step {PERIOD}" in out, out[-3000:]
    log = (clone / "work" / "logs" / "sft" / "train_sft.log").read_text()
    assert re.search(rf"Restored params from step: {PERIOD}\b", log), "MaxText did not restore the bucket's step"
    assert f"mtpipe: resumed at step {PERIOD}: skipped the {PERIOD} batches it trained" in log
    steps = completed_steps(log)
    assert steps[0] == PERIOD + 1 and steps[-1] == len(curve), steps

    trained = clone / "artifacts" / "sft" / "trained"
    assert md5_tree(trained, ["model_params"]) == params, "the resumed run's params differ from the uninterrupted run's"
    assert csv_rows(clone / "plots" / "sft" / "train_sft.csv") == curve, "the loss curves differ"
    metrics = json.loads((clone / "metrics" / "sft" / "train_sft.json").read_text())
    assert metrics["resumed_from_step"] == PERIOD
    assert json.loads((trained / "mtpipe.json").read_text())["step"] == len(curve)
    fs.invalidate_cache()
    assert fs.find(f"{runs}/{run_name}") == [], "the bucket run directory was not deleted after success"


@pytest.mark.slow
@pytest.mark.address
def test_the_collector_lists_and_removes_what_no_recipe_names(pipeline_repo, gcs_emulator, tmp_path):
    """Run directories of recipes that changed (left by killed runs), here and in the work bucket, are
    listed with their sizes and removed; the current recipe's and one a live run holds are kept."""
    bucket, fs = bucket_env(gcs_emulator, prefix=f"collect-{tmp_path.name}"), emulator_fs(gcs_emulator)
    local = pipeline_repo / "work" / "train_sft"
    current = rd.RunDir(str(local), json.loads(subprocess.run(
        [sys.executable, "-c", "import json; from mtpipe.maxtext import run_dir as r; "
                               "print(json.dumps(r.run_name('train_sft', 'sft')))"],
        cwd=pipeline_repo, env=env(), capture_output=True, text=True, check=True).stdout), local / "x")
    made = [local / "train_sft-sft-000000000000", local / "train_sft-rl-000000000001", Path(current.url)]
    try:
        for path in made:
            (path / "checkpoints" / "5").mkdir(parents=True)
            (path / "checkpoints" / "5" / "w").write_bytes(b"w" * 1000)
        held = rd.RunDir(str(local), "train_sft-rl-000000000001", local / "x")
        _lease(held, host=socket.gethostname(), pid=os.getpid())   # this test process: alive
        orphan = f"{bucket[rd.WORK_BUCKET_ENV]}/train_rl/train_rl-000000000002"
        fs.pipe(f"{orphan.removeprefix('gs://')}/checkpoints/5/w", b"w" * 3000)

        def collect(*args: str) -> str:
            proc = subprocess.run([sys.executable, "-m", "mtpipe.maxtext.collect_runs", *args], cwd=pipeline_repo,
                                  env={**env(), **bucket}, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            return proc.stdout

        listed = collect()
        assert f"0.000 GB  {made[0]}\n" in listed and f"{orphan}\n" in listed
        assert f"{made[1]}  (held by " in listed and str(made[2]) not in listed, listed
        collect("--delete")
        fs.invalidate_cache()
        assert not made[0].exists() and not fs.exists(orphan.removeprefix("gs://"))
        assert made[1].exists() and made[2].exists()
    finally:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
