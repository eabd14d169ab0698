"""Training state in a work bucket (mtpipe/maxtext/run_dir.py): the run directory's place, lease and
mirror, and the collector of run directories no recipe names. A stopped training resuming on another
machine from the bucket is tests/maxtext/test_resume_exact.py's (a fresh clone) and
tests/cloud/lifecycle/test_vm_recovery.py's (a new Spot VM).

The patched GCS emulator (tests/fakes/gcs_emulator.py) is the bucket for every client a stage has:
gcsfs and google-cloud-storage read STORAGE_EMULATOR_HOST, tensorstore (Orbax's storage)
TENSORSTORE_GCS_HTTP_URL with GOOGLE_AUTH_TOKEN_FOR_TESTING.
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
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from mtpipe.pipeline import config
from mtpipe.maxtext import run_dir as rd
from mtpipe.errors import ConfigError
from pipeline import ROOT, env
from work_bucket import bucket_env, emulator_fs

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
