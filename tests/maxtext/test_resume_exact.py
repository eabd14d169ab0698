"""A resumed training is the same run: after SIGTERM (a Spot VM's preemption notice) or SIGKILL it
ends with the bytes and the curve of the uninterrupted run, which is the shared pipeline's own.

The kill points do not depend on the machine's speed: MaxText holds after a chosen step
(MTPIPE_HOLD_AFTER_STEP, tests/pipeline.py::start_held) until the signal comes. The two-process run's
kill (its run directory in work/) is tests/training/test_multihost.py's; the Spot VM's (SIGKILL, resumed from
the bucket on a new VM) is tests/cloud/lifecycle/test_vm_recovery.py's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import restore
from fakes.gcs_emulator import GcsEmulator
from pipeline import ROOT, csv_rows, dvc, env, fresh_clone, group_alive, kill_group, md5_tree, start_held
from work_bucket import bucket_env, committed, emulator_fs

from mtpipe.maxtext.run_dir import LEASE

pytestmark = pytest.mark.resume_exact

STOP_TIMEOUT_S = 20  # MTPIPE_STOP_TIMEOUT_S for the test: the run must save and exit within it
SIGTERM_AT = 60  # held after this step, then SIGTERM: between checkpoints (50 steps apart)


def reference(repo: Path, out: str, plot: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The uninterrupted run's params (md5 per file) and curve: the shared pipeline's outputs."""
    return md5_tree(repo / "artifacts" / out, ["model_params"]), csv_rows(repo / "plots" / plot)


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_a_fresh_clone_resumes_it_from_the_bucket(
        pipeline_repo: Path, gcs_emulator: GcsEmulator, tmp_path: Path) -> None:
    """train_sft@sft with a work bucket holds after step SIGTERM_AT, between checkpoints. Meanwhile the
    same stage in a fresh clone stops before MaxText, naming the holder (the run directory's lease),
    and leaves the bucket as it was. Then SIGTERM to the whole process group (as a VM's shutdown sends
    it): MaxText saves a checkpoint at the step reached and writes its loss row, the stage flushes the
    mirror, releases the lease and everything has exited within MTPIPE_STOP_TIMEOUT_S, leaving no
    output; the bucket holds that step, checkpoint and row, and work/ holds no checkpoint. The clone
    then restores that step from the bucket, skips the batches it trained and ends as the
    uninterrupted run (the shared pipeline's) ended: the same param bytes, loss curve and stamp. It
    empties the bucket."""
    bucket, fs = bucket_env(gcs_emulator, prefix="sigterm"), emulator_fs(gcs_emulator)
    runs, scratch = f"{gcs_emulator.bucket}/sigterm/train_sft", pipeline_repo / "work" / "train_sft"
    params, curve = reference(pipeline_repo, "sft/trained", "sft/train_sft.csv")
    before = set(scratch.iterdir()) if scratch.is_dir() else set()
    clone = fresh_clone(pipeline_repo, tmp_path / "clone")
    log = pipeline_repo / "work" / "logs" / "sft" / "train_sft.log"
    offset = log.stat().st_size if log.exists() else 0
    printed = tmp_path / "stopped.out"
    try:
        with printed.open("w") as sink:  # the stage keeps writing here after DVC itself died of the SIGTERM
            held = start_held(pipeline_repo, "train_sft@sft", SIGTERM_AT, log, stdout=sink,
                              extra_env={**bucket, "MTPIPE_STOP_TIMEOUT_S": str(STOP_TIMEOUT_S)})
            try:
                (run,) = set(committed(fs, runs).values())
                objects = sorted(fs.find(runs))
                second = dvc(clone, "repro", "-f", "-s", "--no-run-cache", "train_sft@sft", extra_env=bucket,
                             check=False)
                assert second.returncode != 0 and f"train_sft: gs://{run}: is in use by " in second.stdout, \
                    second.stdout
                assert "training the same recipe since" in second.stdout
                assert "mtpipe.maxtext.adapter" not in second.stdout
                fs.invalidate_cache()
                assert sorted(fs.find(runs)) == objects, "the refused stage touched the holder's run directory"
                os.killpg(held.pid, signal.SIGTERM)
                sent = time.monotonic()
                while group_alive(held) and time.monotonic() - sent < STOP_TIMEOUT_S + 30:
                    time.sleep(0.2)
                took = time.monotonic() - sent
            finally:
                kill_group(held)
        out = printed.read_text()
        print(f"\nSIGTERM to exit: {took:.1f} s")
        assert took <= STOP_TIMEOUT_S + 5, f"the stage took {took:.1f} s to exit after SIGTERM:\n{out[-3000:]}"
        assert f"stopped by SIGTERM (exit status {128 + signal.SIGTERM}" in out, out[-3000:]
        text = log.read_text(errors="replace")[offset:]
        assert f"mtpipe: SIGTERM: stopping after step {SIGTERM_AT}" in text, text[-3000:]
        saved = committed(fs, runs)
        assert max(saved) == SIGTERM_AT, f"the bucket's checkpoints: {sorted(saved)}"
        rows = [json.loads(line) for line in fs.cat(f"{saved[SIGTERM_AT]}/metrics.jsonl").splitlines()]
        assert max(row["step"] for row in rows) == SIGTERM_AT, "the stopped step's loss row did not reach the bucket"
        assert not fs.exists(f"{run}/{LEASE}"), "the stopped run kept its lease"
        assert not (pipeline_repo / "artifacts" / "sft" / "trained").exists(), "a stopped run left an output"
        assert not list(scratch.glob("*/checkpoints")), "checkpoints went to work/, not the bucket"
    finally:
        for left in set(scratch.glob("train_sft-*")) - before:
            shutil.rmtree(left)
        restore(pipeline_repo)

    out = dvc(clone, "repro", "-f", "-s", "--no-run-cache", "train_sft@sft", extra_env=bucket).stdout
    assert f"resuming gs://{run}: MaxText restores its checkpoint at step {SIGTERM_AT}" in out, out[-3000:]
    resumed = (clone / "work" / "logs" / "sft" / "train_sft.log").read_text()
    assert re.search(rf"Restored params from step: {SIGTERM_AT}\b", resumed), "MaxText did not restore the step"
    assert f"mtpipe: resumed at step {SIGTERM_AT}: skipped the {SIGTERM_AT} batches it trained" in resumed
    steps = [int(n) for n in re.findall(r"completed step: (\d+),", resumed)]
    assert steps[0] == SIGTERM_AT + 1 and steps[-1] == len(curve), steps
    trained = clone / "artifacts" / "sft" / "trained"
    assert md5_tree(trained, ["model_params"]) == params, "the resumed run's params differ from the uninterrupted run's"
    assert csv_rows(clone / "plots" / "sft" / "train_sft.csv") == curve, "the loss curves differ"
    assert "the loss curve has no rows" not in out
    metrics = json.loads((clone / "metrics" / "sft" / "train_sft.json").read_text())
    assert metrics["resumed_from_step"] == SIGTERM_AT
    assert json.loads((trained / "mtpipe.json").read_text())["step"] == len(curve)
    fs.invalidate_cache()
    assert fs.find(run) == [], "the bucket run directory was not deleted after success"


@pytest.mark.slow
def test_grpo_killed_after_a_checkpoint_resumes_as_the_uninterrupted_run(pipeline_repo: Path) -> None:
    """train_rl (the test copies' 8 steps) with an actor checkpoint every 2 steps, SIGKILLed while it
    holds after step 2, resumed and SIGKILLed again after step 4, then rerun: the final actor params
    are the uninterrupted run's (the pipeline's, whose only checkpoint is the last) byte for byte, and
    so is every reward row after step 4 and every eval metric, the one before GRPO included (the run's
    first eval, adapter patch 16, not the restored actor's). tunix's GRPO learner fast-forwards its
    data iterator by itself; this keeps it so."""
    params, curve = reference(pipeline_repo, "rl/trained", "rl/train_rl.csv")
    evals = {k: v for k, v in json.loads((pipeline_repo / "metrics/rl/train_rl.json").read_text()).items()
             if k.startswith("eval_")}
    path = pipeline_repo / "params.yaml"
    settings = yaml.safe_load(path.read_text())
    settings["rl"]["train_rl"]["extra_args"] = {"checkpoint_period": 2}
    log = pipeline_repo / "work" / "logs" / "rl" / "train_rl.log"
    try:
        path.write_text(yaml.safe_dump(settings, sort_keys=False))
        dvc(pipeline_repo, "repro", "-s", "configure")  # start_held runs train_rl alone (-s)
        assert "checkpoint_period: 2" in (pipeline_repo / "views" / "rl" / "train_rl.yaml").read_text()
        kill_group(start_held(pipeline_repo, "train_rl", 2, log))
        kill_group(start_held(pipeline_repo, "train_rl", 4, log))
        out = dvc(pipeline_repo, "repro", "-f", "-s", "--no-run-cache", "train_rl").stdout
        assert "an earlier run left actor checkpoints up to step 4" in out, out[-3000:]
        assert log.read_text().count("the eval before GRPO is this run's first") == 2
        resumed_metrics = json.loads((pipeline_repo / "metrics/rl/train_rl.json").read_text())
        assert {k: v for k, v in resumed_metrics.items() if k.startswith("eval_")} == evals
        assert md5_tree(pipeline_repo / "artifacts" / "rl" / "trained", ["model_params"]) == params, \
            "the resumed GRPO run's actor params differ from the uninterrupted run's"
        resumed = csv_rows(pipeline_repo / "plots" / "rl" / "train_rl.csv")
        after = [row for row in curve if int(row["step"]) > 4]
        assert [row for row in resumed if int(row["step"]) > 4] == after and len(after) == len(curve) - 4 > 0
    finally:
        restore(pipeline_repo)


ONE = """import json, yaml
n = yaml.safe_load(open("params.yaml"))["n"]
open("one.txt", "w").write(str(n))
json.dump({"n": n}, open("one.json", "w"))
"""
TWO_STAGES = """stages:
  one:
    cmd: python one.py
    params: [n]
    outs: [one.txt]
    metrics: [one.json: {cache: false}]
  two:
    cmd: test -z "$FAIL" && cp one.txt two.txt
    deps: [one.txt]
    outs: [two.txt]
"""


@pytest.mark.slow
def test_each_stage_reaches_the_remote_when_it_ends_and_another_machine_pulls_it(tmp_path: Path) -> None:
    """mtpipe.cloud.on_vm.exp_run (the VM's `dvc exp run`): stage `one` is pushed, with its run-cache entry
    and its `cache: false` metric, before `two` fails (a VM lost in the last stage); a fresh clone
    pulls `one` instead of running it."""
    repo, remote = tmp_path / "vm1", tmp_path / "remote"
    git_env = {**env(), "DVC_GLOBAL_CONFIG_DIR": str(tmp_path / "g"), "DVC_SITE_CACHE_DIR": str(tmp_path / "s"),
               "PYTHONPATH": str(ROOT)}  # a stand-in repo, not the project: mtpipe comes from this checkout

    def run(cwd: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), cwd=cwd, env={**git_env, **extra}, capture_output=True, text=True)

    repo.mkdir()
    (repo / "dvc.yaml").write_text(TWO_STAGES)
    (repo / "params.yaml").write_text("n: 1\n")
    (repo / "one.py").write_text(ONE)
    for args in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "remote", "add", "-d", "r", str(remote)],
                 ["git", "add", "-A"], ["git", "commit", "-qm", "init"]):
        assert run(repo, *args).returncode == 0
    exp_run = [sys.executable, "-m", "mtpipe.cloud.on_vm.exp_run", "exp", "run", "--pull", "-S", "n=5", "--name", "e"]
    lost = run(repo, *exp_run, FAIL="1")
    assert lost.returncode != 0 and "mtpipe: pushed the outputs of 'one'" in lost.stdout, lost.stdout + lost.stderr
    assert list((remote / "runs").rglob("*")), "no run-cache entry reached the remote"

    clone = tmp_path / "vm2"
    assert run(tmp_path, "git", "clone", "-q", str(repo), str(clone)).returncode == 0
    again = run(clone, *exp_run)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Stage 'one' is cached - skipping run" in again.stdout and "Running stage 'one'" not in again.stdout
    assert "Running stage 'two'" in again.stdout and (clone / "two.txt").read_text() == "5"
    assert json.loads((clone / "one.json").read_text()) == {"n": 5}
