"""The multi-host code path run for real: the SFT branch as 2 JAX processes on this CPU.

`sft.hardware=cpu-2proc` (conf/hardware/cpu-2proc.yaml) starts MaxText twice with the environment
a GKE JobSet gives two hosts (mtpipe/maxtext/runner.py): jax.distributed over gloo, one CPU device
per process, a 2-device mesh, each process reading its own file of the two-shard training data, and
both writing their halves of every sharded array into one checkpoint: in work/ (a shared
directory) or in the bucket MTPIPE_WORK_BUCKET names (the GCS emulator), as on GKE.

The resume runs from work/, not from the bucket: the emulator serves one request at a time, so the
two processes' restores from it finish far apart, and the first collective after them (Orbax's
barrier) fails when one process is 30 s behind the other (Gloo's fixed rendezvous timeout), which a
loaded CI machine reaches. The uninterrupted run (into the bucket) is the reference the resumed one
must equal: where a run directory lives changes no byte of its params.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import restore
from fakes.gcs_emulator import GcsEmulator
from pipeline import HOLD_LINE, csv_rows, dvc, env, export_logit_diff, md5_tree
from work_bucket import bucket_env, emulator_fs

from mtpipe.maxtext.checkpoints import COMMIT_MARKER

# one multi-process run per machine at a time (MaxText's coordinator port): with tests/maxtext/test_runner.py
pytestmark = [pytest.mark.multihost, pytest.mark.slow, pytest.mark.xdist_group("coordinator-port")]

STEPS, PERIOD = 12, 4


def two_processes(repo: Path, period: int = PERIOD) -> None:
    """params.yaml: the SFT branch as 2 JAX processes, STEPS steps, a checkpoint every ``period``."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["steps"] = STEPS
    params["sft"].update(hardware="cpu-2proc")
    params["sft"]["train_sft"].update(checkpoint_period=period)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def fresh_logs_and_runs(repo: Path) -> None:
    """No log lines or run directories of earlier runs (work/ is not versioned: restore keeps it)."""
    for log in (repo / "work" / "logs" / "sft").glob("train_sft*.log"):
        log.write_text("")
    shutil.rmtree(repo / "work" / "train_sft", ignore_errors=True)


def logs(repo: Path) -> tuple[str, str]:
    """The two processes' MaxText logs (process 0's is the stage's usual log)."""
    folder = repo / "work" / "logs" / "sft"
    return (folder / "train_sft.log").read_text(), (folder / "train_sft.process1.log").read_text()


def assert_two_hosts(log0: str, log1: str) -> None:
    """Both processes joined one 2-device JAX system and each read a data shard of its own."""
    for index, log in enumerate((log0, log1)):
        assert f"Jax process id is {index}" in log and "Jax distributed system initialized on CPUs!" in log
        assert "Num_devices: 2" in log
        assert "Inefficient dataloading" not in log, "a process had no data file of its own"


def jax_process(dvc_proc: subprocess.Popen, index: int, timeout: float = 600) -> psutil.Process:
    """The MaxText process with JOB_COMPLETION_INDEX=index among `dvc_proc`'s descendants."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and dvc_proc.poll() is None:
        for child in psutil.Process(dvc_proc.pid).children(recursive=True):
            try:
                if "mtpipe.maxtext.adapter.training" in child.cmdline() and \
                        child.environ().get("JOB_COMPLETION_INDEX") == str(index):
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.5)
    raise AssertionError(f"no JAX process {index} appeared")


@pytest.fixture(scope="module")
def uninterrupted(pipeline_repo: Path, gcs_emulator: GcsEmulator) -> dict:
    """The 2-process run without interruption, its run directory in the bucket (the emulator): what
    its processes logged, its params (md5 per file) and its loss curve. It checkpoints at its last step
    only (each save into the emulator costs the two processes seconds): the params are the same bytes
    for any checkpoint period."""
    bucket, fs = bucket_env(gcs_emulator, prefix="multihost"), emulator_fs(gcs_emulator)
    try:
        two_processes(pipeline_repo, period=STEPS)
        fresh_logs_and_runs(pipeline_repo)
        dvc(pipeline_repo, "repro", "--no-run-cache", "train_sft@sft", extra_env=bucket)
        trained = pipeline_repo / "artifacts" / "sft" / "trained"
        fs.invalidate_cache()
        return {"logs": logs(pipeline_repo), "params": md5_tree(trained, ["model_params"]),
                "stamp": json.loads((trained / "mtpipe.json").read_text()),
                "curve": csv_rows(pipeline_repo / "plots" / "sft" / "train_sft.csv"),
                "left_in_bucket": fs.find(f"{gcs_emulator.bucket}/multihost/train_sft")}
    finally:
        restore(pipeline_repo)


def test_two_processes_write_one_checkpoint_into_the_bucket(uninterrupted: dict, gcs_emulator: GcsEmulator) -> None:
    """With MTPIPE_WORK_BUCKET both processes write the checkpoint into gs:// (the emulator) and the
    stage takes the final params from there, as a multi-host run on GKE does."""
    log0, log1 = uninterrupted["logs"]
    assert_two_hosts(log0, log1)
    for index, log in enumerate((log0, log1)):
        saved = re.findall(rf"\[process={index}\] \[async\] Started save checkpoint @ (\S+)", log)
        assert saved and all(s.startswith(f"gs://{gcs_emulator.bucket}/multihost/") for s in saved), saved[:2]
    assert uninterrupted["stamp"]["step"] == STEPS
    assert uninterrupted["left_in_bucket"] == [], "the bucket run directory was kept"


@pytest.mark.resume_exact
def test_two_processes_survive_a_killed_process_resume_exactly_and_export(pipeline_repo: Path,
                                                                         uninterrupted: dict) -> None:
    """Both processes hold after the step-4 checkpoint (MTPIPE_HOLD_AFTER_STEP); SIGKILL of JAX
    process 1 fails the stage cleanly (process 0 stopped, no output); the rerun resumes from step 4
    in both processes, each skipping the batches of its own shard it trained, and ends as the
    uninterrupted run (from the bucket) ended: the same param bytes, the same loss curve. The export
    of the 2-process checkpoint matches MaxText's forward as tightly as the 1-process one
    (tests/pipeline/test_pipeline_sft.py)."""
    runs = pipeline_repo / "work" / "train_sft"
    folder = pipeline_repo / "work" / "logs" / "sft"
    try:
        two_processes(pipeline_repo)
        fresh_logs_and_runs(pipeline_repo)
        proc = subprocess.Popen(["dvc", "repro", "--no-run-cache", "train_sft@sft"], cwd=pipeline_repo,
                                env={**env(), "MTPIPE_HOLD_AFTER_STEP": str(PERIOD)}, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        host1 = jax_process(proc, 1)
        host0 = jax_process(proc, 0)
        deadline = time.monotonic() + 900
        while not all(HOLD_LINE.format(step=PERIOD) in (folder / name).read_text(errors="replace")
                      for name in ("train_sft.log", "train_sft.process1.log") if (folder / name).exists()) \
                or not (folder / "train_sft.process1.log").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the processes never held after step 4"
            time.sleep(0.5)
        host1.send_signal(signal.SIGKILL)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode != 0 and "process 1 of 2 exited with -9" in out, out[-3000:]
        assert not host0.is_running() or host0.status() == psutil.STATUS_ZOMBIE, "process 0 was left running"
        assert not (pipeline_repo / "artifacts" / "sft" / "trained").exists()
        status = dvc(pipeline_repo, "status", "--json").stdout.strip().splitlines()
        assert "train_sft@sft" in json.loads(status[-1]), "DVC does not see the killed training as to be run"
        # one checkpoint, written by both: a sharded array has one chunk from each process
        (run,) = {p.parents[2] for p in runs.glob(f"*/checkpoints/{PERIOD}/{COMMIT_MARKER}")}
        kernel = run / "checkpoints" / str(PERIOD) / "model_params" / "decoder.layers.layers_0.mlp.wo.kernel.value"
        assert sorted(p.name for p in kernel.iterdir() if not p.name.startswith(".")) == ["0.0.0", "0.0.1"]
        killed0, killed1 = logs(pipeline_repo)
        assert_two_hosts(killed0, killed1)

        out = dvc(pipeline_repo, "repro", "--no-run-cache", "to_huggingface@sft").stdout  # with the export
        assert f"checkpoint at step {PERIOD}" in out, out[-3000:]
        log0, log1 = (text[len(killed):] for text, killed in zip(logs(pipeline_repo), (killed0, killed1)))
        assert_two_hosts(log0, log1)
        for log in (log0, log1):
            assert re.search(rf"Restored params from step: {PERIOD}\b", log) or \
                re.search(rf"[Rr]estor\w+ .*step[: ]+{PERIOD}\b", log), "a process did not restore the checkpoint"
            assert f"mtpipe: resumed at step {PERIOD}: skipped the {PERIOD} batches it trained" in log
            steps = [int(n) for n in re.findall(r"completed step: (\d+),", log)]
            assert steps[0] == PERIOD + 1 and steps[-1] == STEPS, steps
        metrics = json.loads((pipeline_repo / "metrics" / "sft" / "train_sft.json").read_text())
        assert metrics["steps"] == STEPS and metrics["resumed_from_step"] == PERIOD
        trained = pipeline_repo / "artifacts" / "sft" / "trained"
        assert md5_tree(trained, ["model_params"]) == uninterrupted["params"], \
            "the resumed 2-process run's params differ from the uninterrupted run's"
        assert csv_rows(pipeline_repo / "plots" / "sft" / "train_sft.csv") == uninterrupted["curve"]
        diff = export_logit_diff(pipeline_repo, "sft", "gemma3-4b", "gemma3-tiny")
        print(f"\nmax |logit diff| 2-process SFT export vs MaxText: {diff:.2e}")
        assert diff < 2e-5
    finally:
        restore(pipeline_repo)
