"""A resumed training is the same run: after SIGTERM (a Spot VM's preemption notice) or SIGKILL it
ends with the bytes and the curve of the uninterrupted run, which is the shared pipeline's own.

The kill points do not depend on the machine's speed: MaxText holds after a chosen step
(MTPIPE_HOLD_AFTER_STEP, tests/pipeline.py::start_held), or SIGTERM lands at whatever step the run has
reached and the assertions follow that step. The SIGKILL from the bucket into a fresh clone is
tests/test_work_bucket.py's; the two-process run's is tests/test_multihost.py's; the Spot VM's is
tests/test_vm_recovery.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import restore
from fakes.gcs_emulator import GcsEmulator
from pipeline import ROOT, csv_rows, dvc, env, group_alive, kill_group, md5_tree, start_held
from work_bucket import bucket_env, committed, emulator_fs

pytestmark = pytest.mark.resume_exact

STOP_TIMEOUT_S = 20  # MTPIPE_STOP_TIMEOUT_S for the test: the run must save and exit within it
SIGTERM_AT = 60  # SIGTERM once the console shows this step: between checkpoints (50 steps apart)


def reference(repo: Path, out: str, plot: str) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The uninterrupted run's params (md5 per file) and curve: the shared pipeline's outputs."""
    return md5_tree(repo / "artifacts" / out, ["model_params"]), csv_rows(repo / "plots" / plot)


@pytest.mark.slow
def test_sigterm_saves_the_step_reached_and_the_resumed_run_is_the_uninterrupted_one(
        pipeline_repo: Path, gcs_emulator: GcsEmulator) -> None:
    """SIGTERM to the whole process group (as a VM's shutdown sends it) during train_sft@sft with a
    work bucket: MaxText finishes its step, saves a checkpoint at it and writes its loss row, the
    stage flushes the mirror and everything has exited within MTPIPE_STOP_TIMEOUT_S; the bucket holds
    that step, checkpoint and row. The rerun resumes there and ends byte-identical."""
    bucket, fs = bucket_env(gcs_emulator, prefix="sigterm"), emulator_fs(gcs_emulator)
    runs = f"{gcs_emulator.bucket}/sigterm/train_sft"
    params, curve = reference(pipeline_repo, "sft/trained", "sft/train_sft.csv")
    log = pipeline_repo / "work" / "logs" / "sft" / "train_sft.log"
    offset = log.stat().st_size if log.exists() else 0
    stage_env = {**env(), **bucket, "MTPIPE_STOP_TIMEOUT_S": str(STOP_TIMEOUT_S)}
    proc = subprocess.Popen(["dvc", "repro", "-f", "-s", "--no-run-cache", "train_sft@sft"], cwd=pipeline_repo,
                            env=stage_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reached = threading.Event()

    def read() -> None:  # the stage keeps writing to this pipe after DVC itself died of the SIGTERM
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if (m := re.match(r"\s+step (\d+)/", line)) and int(m[1]) >= SIGTERM_AT:
                reached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        try:
            assert reached.wait(900), "".join(lines[-40:])
            os.killpg(proc.pid, signal.SIGTERM)
            sent = time.monotonic()
            while group_alive(proc) and time.monotonic() - sent < STOP_TIMEOUT_S + 30:
                time.sleep(0.2)
            took = time.monotonic() - sent
        finally:
            kill_group(proc)
            reader.join(10)
        out = "".join(lines)
        print(f"\nSIGTERM to exit: {took:.1f} s")
        assert took <= STOP_TIMEOUT_S + 5, f"the stage took {took:.1f} s to exit after SIGTERM:\n{out[-3000:]}"
        assert f"stopped by SIGTERM (exit status {128 + signal.SIGTERM}" in out, out[-3000:]
        text = log.read_text(errors="replace")[offset:]
        stopped = int(re.search(r"mtpipe: SIGTERM: stopping after step (\d+)", text)[1])
        assert SIGTERM_AT <= stopped < len(curve), stopped
        saved = committed(fs, runs)
        assert max(saved) == stopped, f"the bucket's checkpoints: {sorted(saved)}, stopped after {stopped}"
        rows = [json.loads(line) for line in fs.cat(f"{saved[stopped]}/metrics.jsonl").splitlines()]
        assert max(row["step"] for row in rows) == stopped, "the stopped step's loss row did not reach the bucket"
        assert not (pipeline_repo / "artifacts" / "sft" / "trained").exists(), "a stopped run left an output"

        out = dvc(pipeline_repo, "repro", "-f", "-s", "--no-run-cache", "train_sft@sft", extra_env=bucket).stdout
        assert f"MaxText restores its checkpoint at step {stopped}" in out, out[-3000:]
        assert f"mtpipe: resumed at step {stopped}: skipped the {stopped} batches" in log.read_text()
        assert md5_tree(pipeline_repo / "artifacts" / "sft" / "trained", ["model_params"]) == params, \
            "the resumed run's params differ from the uninterrupted run's"
        assert csv_rows(pipeline_repo / "plots" / "sft" / "train_sft.csv") == curve
        assert "the loss curve has no rows" not in out
    finally:
        restore(pipeline_repo)


@pytest.mark.slow
def test_grpo_killed_after_a_checkpoint_resumes_as_the_uninterrupted_run(pipeline_repo: Path) -> None:
    """train_rl with an actor checkpoint every 4 steps, SIGKILLed while it holds after step 4, resumed
    and SIGKILLed again after step 8, then rerun: the final actor params are the uninterrupted run's
    (the pipeline's, whose only checkpoint is the last) byte for byte, and so is every reward row
    after step 8 and every eval metric, the one before GRPO included (the run's first eval, adapter
    patch 16, not the restored actor's). tunix's GRPO learner fast-forwards its data iterator by
    itself; this keeps it so."""
    params, curve = reference(pipeline_repo, "rl/trained", "rl/train_rl.csv")
    evals = {k: v for k, v in json.loads((pipeline_repo / "metrics/rl/train_rl.json").read_text()).items()
             if k.startswith("eval_")}
    path = pipeline_repo / "params.yaml"
    settings = yaml.safe_load(path.read_text())
    settings["rl"]["train_rl"]["extra_args"] = {"checkpoint_period": 4}
    log = pipeline_repo / "work" / "logs" / "rl" / "train_rl.log"
    try:
        path.write_text(yaml.safe_dump(settings, sort_keys=False))
        dvc(pipeline_repo, "repro", "-s", "configure")  # start_held runs train_rl alone (-s)
        assert "checkpoint_period: 4" in (pipeline_repo / "config" / "rl" / "train_rl.yaml").read_text()
        kill_group(start_held(pipeline_repo, "train_rl", 4, log))
        kill_group(start_held(pipeline_repo, "train_rl", 8, log))
        out = dvc(pipeline_repo, "repro", "-f", "-s", "--no-run-cache", "train_rl").stdout
        assert "an earlier run left actor checkpoints up to step 8" in out, out[-3000:]
        assert log.read_text().count("the eval before GRPO is this run's first") == 2
        resumed_metrics = json.loads((pipeline_repo / "metrics/rl/train_rl.json").read_text())
        assert {k: v for k, v in resumed_metrics.items() if k.startswith("eval_")} == evals
        assert md5_tree(pipeline_repo / "artifacts" / "rl" / "trained", ["model_params"]) == params, \
            "the resumed GRPO run's actor params differ from the uninterrupted run's"
        resumed = csv_rows(pipeline_repo / "plots" / "rl" / "train_rl.csv")
        after = [row for row in curve if int(row["step"]) > 8]
        assert [row for row in resumed if int(row["step"]) > 8] == after and len(after) == len(curve) - 8
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
    """mtpipe.cloud.exp_run (the VM's `dvc exp run`): stage `one` is pushed, with its run-cache entry
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
    exp_run = [sys.executable, "-m", "mtpipe.cloud.exp_run", "exp", "run", "--pull", "-S", "n=5", "--name", "e"]
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
