"""The runner: progress lines from MaxText's log, secrets redacted, failures loud."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtpipe.errors import ConfigError
from mtpipe.maxtext import commands, runner
from mtpipe.maxtext.commands import MaxTextCommand
from mtpipe.pipeline import trainers

LINE = ("I1129 completed step: 40, seconds: 0.131, TFLOP/s/device: 0.012, Tokens/s/device: 3907.5, "
        "total_weights: 512, loss: 2.103, lm_loss: 2.103, perplexity: 8.19")


def test_step_line_is_parsed_with_tokens_per_second():
    match = runner.STEP_LINE.search(LINE)
    assert (match["step"], match["loss"], match["tps"]) == ("40", "2.103", "3907.5")
    line = runner.format_progress(40, 150, match["loss"], match["tps"], elapsed=20.0, first_step=0)
    assert line == "  step 40/150  loss 2.103  tokens/s/device 3908  ETA 0:55"


def test_the_child_gets_no_token_and_the_log_masks_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijklmnop")
    script = tmp_path / "fake_maxtext.py"
    script.write_text("import os; print('child has', os.environ.get('HF_TOKEN')); print('echo hf_abcdefghijklmnop');"
                      " print(%r)" % LINE)
    cmd = MaxTextCommand("fake", [], launcher="fake")
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    runner.run(cmd, tmp_path / "log.txt", total_steps=150)
    log, out = (tmp_path / "log.txt").read_text(), capsys.readouterr().out
    assert "hf_abcdefghijklmnop" not in log + out
    assert "child has None" in log and "echo <HF_TOKEN>" in log
    assert "step 40/150  loss 2.103  tokens/s/device 3908" in out


def test_grpo_shows_its_steps_and_sft_each_step_once(tmp_path, monkeypatch, capsys):
    """train_rl logs tunix's trainer lines only; train_sft logs those and MaxText's, and counts once."""
    tunix = "I1205 12:06:02.068895 1 peft_trainer.py:488] Train step 69 training loss: 0.004167  - training perplexity: 1.0042"
    script = tmp_path / "fake_maxtext.py"
    script.write_text(f"print({tunix!r}); print({LINE!r})")
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    runner.run(MaxTextCommand(commands.TRAIN_RL, [], launcher="fake"), tmp_path / "rl" / "train_rl.log",
               total_steps=100)
    assert capsys.readouterr().out.count("  step ") == 1
    assert json.loads((tmp_path / "rl" / "train_rl.progress.json").read_text())["step"] == 69
    runner.run(MaxTextCommand(commands.TRAIN_SFT, [], launcher="fake"), tmp_path / "sft" / "train_sft.log",
               total_steps=150)
    out = capsys.readouterr().out
    assert out.count("  step ") == 1 and "step 40/150  loss 2.103" in out


def test_a_method_s_progress_lines_follow_its_record(tmp_path, monkeypatch, capsys):
    """The runner asks the method's record, not its module's name: a new rollout method's steps are
    tunix's lines, as GRPO's are."""
    tunix = "I1205 peft_trainer.py:488] Train step 7 training loss: 0.004167  - training perplexity: 1.0042"
    script = tmp_path / "fake_maxtext.py"
    script.write_text(f"print({tunix!r}); print({LINE!r})")
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    method = dataclasses.replace(trainers.GRPO, stage="train_x", module="maxtext.trainers.post_train.x")
    monkeypatch.setitem(runner.BY_MODULE, method.module, method)
    runner.run(MaxTextCommand(method.module, [], launcher="fake"), tmp_path / "x.log", total_steps=10)
    out = capsys.readouterr().out
    assert out.count("  step ") == 1 and "step 7/10" in out
    monkeypatch.setitem(runner.BY_MODULE, method.module, dataclasses.replace(method, rollout=False))
    runner.run(MaxTextCommand(method.module, [], launcher="fake"), tmp_path / "y.log", total_steps=50)
    out = capsys.readouterr().out
    assert out.count("  step ") == 1 and "step 40/50  loss 2.103" in out


def test_a_failing_tool_fails_the_stage(tmp_path, monkeypatch):
    script = tmp_path / "boom.py"
    script.write_text("import sys; print('Traceback: boom'); sys.exit(3)")
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    with pytest.raises(runner.MaxTextFailed, match="exited with 3"):
        runner.run(MaxTextCommand("fake", [], launcher="fake"), tmp_path / "log.txt")
    assert "# exit 3" in Path(tmp_path / "log.txt").read_text()


@pytest.mark.multihost
@pytest.mark.xdist_group("coordinator-port")  # with tests/training/test_multihost.py
@pytest.mark.slow
def test_processes_get_the_jobset_environment_and_one_failure_stops_all(tmp_path, monkeypatch):
    """Two processes: each gets its index as a GKE JobSet gives it; when process 1 dies, process 0
    (which would otherwise wait for it forever) is stopped and the run fails naming process 1, at
    once, although an orphan of process 1 still holds its output pipe."""
    script = tmp_path / "two.py"
    script.write_text("import os, sys, time\n"
                      "i = os.environ['JOB_COMPLETION_INDEX']\n"
                      "print('index', i, 'of', os.environ['JAX_PROCESS_COUNT'], os.environ['JAX_COORDINATOR_ADDRESS'])\n"
                      "sys.stdout.flush()\n"
                      "if i == '1':\n"  # dies, leaving an orphan that holds its stdout (as MaxText's resource tracker)
                      "    import subprocess; subprocess.Popen(['sleep', '300']); time.sleep(1); sys.exit(9)\n"
                      "time.sleep(600)\n")
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    start = time.monotonic()
    with pytest.raises(runner.MaxTextFailed, match=r"process 1 of 2 exited with 9; full log: .*train\.process1\.log"):
        runner.run(MaxTextCommand("fake", [], launcher="fake"), tmp_path / "train.log", processes=2)
    assert time.monotonic() - start < 60, "process 0 was not stopped"
    log0, log1 = (tmp_path / "train.log").read_text(), (tmp_path / "train.process1.log").read_text()
    assert "index 0 of 2 127.0.0.1" in log0 and "# exit -15" in log0
    assert "index 1 of 2 127.0.0.1" in log1 and "# exit 9" in log1


@pytest.mark.multihost
@pytest.mark.xdist_group("coordinator-port")
def test_a_taken_coordinator_port_fails_before_starting(tmp_path, monkeypatch):
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: pytest.fail("started a process"))
    with socket.socket() as sock:
        # as the coordinator itself (gRPC) binds: an earlier test's connections still in TIME_WAIT own no port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", runner.COORDINATOR_PORT))
        sock.listen()
        with pytest.raises(runner.MaxTextFailed, match="port 1234 on 127.0.0.1 is taken"):
            runner.run(MaxTextCommand("fake", [], launcher="fake"), tmp_path / "log.txt", processes=2)


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_a_stop_timeout_that_is_no_positive_number_is_named_with_the_fix(value, monkeypatch):
    monkeypatch.setenv(runner.STOP_TIMEOUT_ENV, value)
    with pytest.raises(ConfigError) as err:
        runner.stop_timeout_s()
    assert err.value.key == runner.STOP_TIMEOUT_ENV and repr(value) in err.value.problem
    assert f"export {runner.STOP_TIMEOUT_ENV}=25" in err.value.fix


@pytest.mark.parametrize(("handles_it", "status"), [(True, "143"), (False, "-9")])
def test_sigterm_reaches_the_tool_which_saves_or_is_killed_after_the_timeout(handles_it, status, tmp_path,
                                                                            monkeypatch):
    """SIGTERM to the stage (a VM's shutdown) goes on to the MaxText process; one that saves and
    exits in time ends with 143, one that ignores it is killed after MTPIPE_STOP_TIMEOUT_S."""
    import os
    import signal
    import threading

    script = tmp_path / "train.py"
    script.write_text("import signal, sys, time\n"
                      f"signal.signal(signal.SIGTERM, {'lambda *_: sys.exit(143)' if handles_it else 'signal.SIG_IGN'})\n"
                      "print('ready', flush=True)\ntime.sleep(60)\n")
    monkeypatch.setattr(MaxTextCommand, "argv", lambda self: [sys.executable, str(script)])
    monkeypatch.setenv(runner.STOP_TIMEOUT_ENV, "2")
    log = tmp_path / "log.txt"

    def send_sigterm_once_ready() -> None:
        while "ready" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=send_sigterm_once_ready, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(runner.MaxTextStopped, match=f"stopped by SIGTERM \\(exit status {status}"):
        runner.run(MaxTextCommand("fake", [], launcher="fake"), log)
    assert time.monotonic() - start < 20
    assert signal.getsignal(signal.SIGTERM) == before, "the stage's own SIGTERM handling was not restored"
    assert f"# exit {status}" in log.read_text()


@pytest.mark.slow
def test_maxtext_processes_load_vertex_ai_only_when_they_use_it() -> None:
    """Adapter patch 14, as `apply` sets it up for a trainer: importing MaxText's Vertex TensorBoard
    module leaves Vertex AI's SDK unexecuted (2.5 s of every MaxText process's start); its first use
    executes it."""
    code = """
import sys
from mtpipe.maxtext.adapter import training
training.apply(training.SFT.module, [])
import maxtext.common.vertex_tensorboard
print("google.cloud.aiplatform.initializer" in sys.modules)
from google.cloud import aiplatform
print(callable(aiplatform.init), "google.cloud.aiplatform.initializer" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "True", "True"], out


PROBE = ("import atexit, gc, decimal, json\n"  # the run creates objects of its own
         "print('run', gc.get_freeze_count(), len(gc.get_objects()))\n"
         "atexit.register(lambda: print('exit', gc.get_freeze_count(), len(gc.get_objects())))\n")


STOPPED_BY_SIGTERM = ("import sys; from mtpipe.maxtext import launch\n"  # a run SIGTERM stopped after its save
                      "sys.exit(launch.main(lambda module, args: lambda: None, ['probe_module'], lambda: 143))")


@pytest.mark.parametrize(("command", "status"), [
    (["-m", "mtpipe.maxtext.adapter.conversion", "probe_module"], 0),
    (["-c", STOPPED_BY_SIGTERM], 143),
    (["-c", "from mtpipe.pipeline.stage import run_stage; run_stage(lambda: __import__('probe_module'))"], 0),
], ids=["maxtext", "maxtext_stopped", "stage"])
def test_a_process_runs_and_exits_with_its_heap_frozen(tmp_path: Path, command: list[str], status: int) -> None:
    """A MaxText process (launch.main) freezes the heap after the patches' imports and again after the
    run, also when SIGTERM stopped it (a Spot VM's notice leaves seconds to exit); a stage (run_stage)
    after its work: the full collections during a run skip what was imported before it, and the
    interpreter's exit finds nothing left to walk (3-4 s of CPU per MaxText process on 2 cores,
    docs/testing.md)."""
    (tmp_path / "probe_module.py").write_text(PROBE)
    done = subprocess.run([sys.executable, *command], cwd=Path(__file__).parents[2],
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True, check=False)
    out = done.stdout
    assert done.returncode == status, done.stderr[-2000:]
    run, exit_ = ([int(n) for n in line.split()[1:]] for line in out.splitlines() if line.startswith(("run ", "exit ")))
    if "run_stage" not in command[-1]:  # a MaxText process: the adapter imported before the run
        assert run[0] > 10_000, out  # the interpreter's and the adapter's imports, frozen before the run
    assert exit_[0] >= run[0] + run[1] // 2, out  # what was there at the run's start, frozen at its end
    assert exit_[1] < 1_000, out


@pytest.mark.slow
def test_a_finished_trainer_closes_its_parquet_stream_before_exit(tmp_path: Path) -> None:
    """Adapter patch 15, as `apply` sets it up for a trainer: the streaming parquet input MaxText
    builds (one shuffle per epoch, concatenated; two files of more rows than the shuffle buffer), part
    read and left in a reference cycle as a finished run leaves it, is closed by the trainer's
    post-processing with a 0.5-s grace for Arrow's threads, not in the interpreter's final collection
    with datasets' 5 s."""
    code = f"""
import gc, time, weakref
import datasets, pyarrow as pa, pyarrow.parquet as pq
from mtpipe.maxtext.adapter import training
finish = training.apply(training.SFT.module, [])
for shard in range(2):
    pq.write_table(pa.table({{"text": [f"row {{i}}" for i in range(64)]}}), {str(tmp_path)!r} + f"/train-{{shard}}.parquet")
stream = datasets.load_dataset("parquet", data_files={str(tmp_path / "train-*.parquet")!r}, split="train",
                               streaming=True)
gc.disable()  # as a run ends: the cycle is still there when the post-processing starts
rows = iter(datasets.concatenate_datasets([stream.shuffle(seed=42 + epoch, buffer_size=16) for epoch in range(3)]))
next(rows)
alive, cycle = weakref.ref(rows), {{"rows": rows}}
cycle["cycle"] = cycle
del rows, cycle
sleeps = []
time.sleep = sleeps.append
print(alive() is not None, sleeps)
finish()
print(alive() is not None, sleeps, datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[2], capture_output=True,
                         text=True, check=True).stdout
    assert out.splitlines()[-2:] == ["True []", "False [0.5] 5"], out
