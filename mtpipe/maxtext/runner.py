"""Run a MaxText command in child processes (one, or several JAX processes as the hosts of a slice):
full logs to files, progress to the console.

The console shows one line per training step that MaxText reports (step, loss, tokens/s, ETA) and
the tail of the log if the command fails. SIGTERM (a Spot VM's preemption notice, about 30 s before
it stops) is passed on to the MaxText processes, which save a checkpoint at the step they reached
(mtpipe.maxtext.adapter.training, patch 9); those still running after ``MTPIPE_STOP_TIMEOUT_S``
seconds (default 25) are killed, and the stage fails, so DVC records nothing. The child never gets a Hub token (``HF_TOKEN``): only
hf_download needs one, and MaxText would write it into its tensorboard config dump
(docs/secrets.md). Values of the variables in ``REDACTED_ENV`` are masked in the log.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mtpipe.errors import ConfigError
from mtpipe.maxtext import progress
from mtpipe.maxtext.commands import MaxTextCommand
from mtpipe.pipeline.stage import HUB_TOKEN_ENV
from mtpipe.pipeline.trainers import BY_MODULE

STEP_LINE = re.compile(r"completed step: (?P<step>\d+), seconds: (?P<sec>[\d.]+)"
                       r"(?:.*?Tokens/s/device: (?P<tps>[\d.]+))?.*?loss: (?P<loss>[\d.naif-]+)")
# A rollout method (train_rl) logs no "completed step": its steps are tunix's trainer lines (GRPO's loss
# stays near 0 by construction; the rewards go to tensorboard), so its progress is the step and the ETA.
GRPO_STEP_LINE = re.compile(r"Train step (?P<step>\d+) training loss: (?P<loss>[\d.naif-]+)")
REDACTED_ENV = (*HUB_TOKEN_ENV, "GOOGLE_APPLICATION_CREDENTIALS")
COORDINATOR_PORT = 1234  # fixed in MaxText's initialize_jax_for_cpu
READER_GRACE_S = 10.0
STOP_TIMEOUT_ENV = "MTPIPE_STOP_TIMEOUT_S"
STOP_TIMEOUT_S = 25.0  # GCE gives a Spot VM about 30 s between the notice and the stop


class MaxTextFailed(RuntimeError):
    """MaxText exited with an error; the message holds the end of its log."""


class MaxTextStopped(MaxTextFailed):
    """SIGTERM stopped the run: its processes saved their checkpoint and exited, or were killed."""


def stop_timeout_s() -> float:
    """Seconds the MaxText processes get after SIGTERM (MTPIPE_STOP_TIMEOUT_S, default 25)."""
    value = os.environ.get(STOP_TIMEOUT_ENV, "").strip()
    try:
        timeout = float(value) if value else STOP_TIMEOUT_S
    except ValueError:
        timeout = -1.0
    if timeout <= 0:
        raise ConfigError(STOP_TIMEOUT_ENV, f"{value!r} is not a positive number of seconds",
                          f"export {STOP_TIMEOUT_ENV}=25 (a Spot VM stops about 30 s after its notice), or unset it")
    return timeout


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The parent's environment without Hub tokens, plus the command's (``@hostname`` becomes this
    host's name)."""
    env = {name: value for name, value in os.environ.items() if name not in HUB_TOKEN_ENV}
    for key, value in extra.items():
        env[key] = socket.gethostname() if value == "@hostname" else str(value)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def redact(text: str) -> str:
    """Replace in ``text`` the value this process's environment holds for each of ``REDACTED_ENV``."""
    for key in REDACTED_ENV:
        value = os.environ.get(key)
        if value and len(value) >= 4:
            text = text.replace(value, f"<{key}>")
    return text


def format_progress(step: int, total: int | None, loss: str, tps: str | None, elapsed: float,
                    first_step: int) -> str:
    """One console line per step: ``step 40/150 loss 2.103 tokens/s 5120 ETA 0:14``."""
    line = f"  step {step}" + (f"/{total}" if total else "") + f"  loss {loss}"
    if tps:
        line += f"  tokens/s/device {float(tps):.0f}"
    eta = progress.eta_s(step, total, elapsed, first_step)
    if eta is not None:
        line += f"  ETA {int(eta // 60)}:{int(eta % 60):02d}"
    return line


def process_env(index: int, count: int) -> dict[str, str]:
    """What a GKE JobSet gives host ``index`` of ``count``, as MaxText's ``hardware=cpu`` start-up reads
    it (``max_utils.initialize_jax_for_cpu``: coordinator on port 1234, process id = job completion index)."""
    return {"JAX_COORDINATOR_ADDRESS": "127.0.0.1", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": str(index),
            "PROCESSES_IN_JOB": str(count), "JAX_PROCESS_COUNT": str(count)}


def process_log(log_path: Path, index: int) -> Path:
    """Process 0 logs to ``log_path``, process i to ``<stem>.process<i>.log`` beside it."""
    return log_path if index == 0 else log_path.with_name(f"{log_path.stem}.process{index}{log_path.suffix}")


def check_coordinator_port() -> None:
    """Fail before starting anything if another run holds MaxText's fixed coordinator port."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: connections closing are no owner
        try:
            sock.bind(("127.0.0.1", COORDINATOR_PORT))
            sock.listen()
        except OSError as err:
            raise MaxTextFailed(f"port {COORDINATOR_PORT} on 127.0.0.1 is taken ({err.strerror}): MaxText's JAX "
                                "coordinator for CPU processes needs it. Fix: wait for the other multi-process "
                                "run on this machine to end, or stop it") from None


@dataclass
class _Child:
    """One MaxText process, its log and the last lines it wrote."""

    index: int
    proc: subprocess.Popen
    log_path: Path
    tail: list[str] = field(default_factory=list)


def run(cmd: MaxTextCommand, log_path: Path, total_steps: int | None = None, processes: int = 1) -> None:
    """Run ``cmd`` as ``processes`` JAX processes; raise :class:`MaxTextFailed` with the log's tail if
    one fails (the others are stopped: a multi-process run cannot go on without one of them).

    Console progress comes from process 0. A stage started with ``--print-command`` prints the
    child's command line (one per process) and exits instead (benchmarks/bench_dvc.py times it).
    """
    envs = [dict(cmd.env, **(process_env(i, processes) if processes > 1 else {})) for i in range(processes)]
    if "--print-command" in sys.argv:
        for env in envs:
            shown = [f"{k}={socket.gethostname() if v == '@hostname' else v}" for k, v in env.items()]
            print(shlex.join([*(["env", *shown] if shown else []), "python", *cmd.argv()[1:]]))
        sys.exit(0)
    stop_timeout = stop_timeout_s()
    if processes > 1:
        check_coordinator_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {redact(cmd.as_tutorial())}" + (f"   # x {processes} processes" if processes > 1 else ""), flush=True)
    start = time.monotonic()
    children = [_Child(i, subprocess.Popen(cmd.argv(), env=child_env(env), stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1),
                       process_log(log_path, i)) for i, env in enumerate(envs)]
    readers = [threading.Thread(target=_follow, args=(c, cmd, processes, total_steps, start), daemon=True)
               for c in children]
    for reader in readers:
        reader.start()
    sigterm = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: sigterm.set())
    try:
        failed = _wait_all(children, sigterm, stop_timeout)
    finally:
        signal.signal(signal.SIGTERM, previous)
    for child, reader in zip(children, readers):
        # after a failure, a killed process's orphans (multiprocessing's resource tracker) may hold its
        # pipe for minutes; after a success the whole log is read (train_rl parses it)
        reader.join(timeout=READER_GRACE_S if failed else None)
        with open(child.log_path, "a", encoding="utf8") as log:
            log.write(f"# exit {child.proc.returncode} after {time.monotonic() - start:.1f}s\n")
    if sigterm.is_set():
        codes = ", ".join(str(c.proc.returncode) for c in children)
        raise MaxTextStopped(f"{cmd.module} stopped by SIGTERM (exit status {codes}: {128 + signal.SIGTERM} "
                             f"= saved its checkpoint, -9 = killed after {stop_timeout:.0f} s); a rerun resumes "
                             f"from its last checkpoint. Full log: {log_path}")
    if failed is not None:
        sys.stderr.write("".join(failed.tail))
        which = f"process {failed.index} of {processes} " if processes > 1 else ""
        raise MaxTextFailed(f"{cmd.module} {which}exited with {failed.proc.returncode}; "
                            f"full log: {failed.log_path}")
    print(f"  done in {time.monotonic() - start:.1f}s (log: {log_path})", flush=True)


def _follow(child: _Child, cmd: MaxTextCommand, processes: int, total_steps: int | None, start: float) -> None:
    """Copy one process's output into its log (redacted); process 0's steps become console progress
    and the stage's progress file (mtpipe.maxtext.progress)."""
    first_step = None
    trainer = BY_MODULE.get(cmd.module)   # none for the converters
    step_line = GRPO_STEP_LINE if trainer and trainer.rollout else STEP_LINE  # SFT logs both kinds
    with open(child.log_path, "a", encoding="utf8", buffering=1) as log:
        log.write(f"$ {redact(cmd.as_tutorial())}\n# launched as: python -m {cmd.launcher} {cmd.module} ..."
                  + (f" (process {child.index} of {processes})" if processes > 1 else "") + "\n")
        assert child.proc.stdout is not None
        for raw in child.proc.stdout:
            line = redact(raw)
            log.write(line)
            child.tail = (child.tail + [line])[-40:]
            match = step_line.search(line) if child.index == 0 else None
            if match:
                step, tps = int(match["step"]), match.groupdict().get("tps")
                first_step = step if first_step is None else first_step
                elapsed = time.monotonic() - start
                print(format_progress(step, total_steps, match["loss"], tps, elapsed, first_step), flush=True)
                progress.write(child.log_path, step, total_steps, match["loss"], tps,
                               progress.eta_s(step, total_steps, elapsed, first_step))


def _wait_all(children: list[_Child], sigterm: threading.Event, stop_timeout: float,
              grace_s: float = 10.0) -> _Child | None:
    """Wait for every process; at the first failure stop the others. Return the first that failed.

    Once ``sigterm`` is set, each process gets SIGTERM and ``stop_timeout`` seconds to save and exit."""
    while True:
        if sigterm.is_set():
            for c in children:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            _wait_or_kill(children, stop_timeout)
            return next((c for c in children if c.proc.returncode != 0), None)
        codes = [c.proc.poll() for c in children]
        failed = next((c for c, code in zip(children, codes) if code not in (None, 0)), None)
        if failed is not None:
            for c in children:
                if c.proc.poll() is None:
                    c.proc.terminate()
            _wait_or_kill(children, grace_s)
            return failed
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)


def _wait_or_kill(children: list[_Child], timeout: float) -> None:
    """Wait up to ``timeout`` seconds in all for the processes to exit; kill those still running."""
    deadline = time.monotonic() + timeout
    for c in children:
        try:
            c.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
