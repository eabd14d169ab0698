"""The model server an evaluation talks to: its command line, and the process while it serves.

One path on both machines: the evaluate stage starts an OpenAI-compatible completions server for the
model directory, waits for ``GET /health``, scores the model through it (lm-eval for GSM8K, echoed
log-probabilities for the held-out loss) and stops it. Only the server differs:

* ``cpu``: ``python -m mtpipe.evaluation.server`` (the numpy forward of the export; the laptop, CI);
* ``vllm``: vLLM's OpenAI server (``vllm.entrypoints.openai.api_server``), the one the TPU VM installs
  with MaxText's post-training extras, over the same Hugging Face directory.

The server runs in a session of its own (so that stopping it stops its workers too), which a signal to
the stage's process group does not reach. So the stage stops it when the scoring ends, fails, or is
interrupted (Ctrl-C, SIGTERM, SIGHUP); a stage killed outright (SIGKILL, a lost SSH session) cannot,
and the kernel then sends the server SIGTERM (``PR_SET_PDEATHSIG``, Linux): vLLM's server as ours,
which also watches its parent (``--parent-pid``) where there is no such signal.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

SERVED_NAME = "mtpipe"
# Requests to the server on 127.0.0.1 go direct, whatever proxy the environment names: urlopen's
# global opener keeps the proxies of the environment it was first used in, so one use while a
# proxy was set (without NO_PROXY later) sent every later loopback request to that proxy.
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def open_loopback(request: str | urllib.request.Request, timeout: float) -> Any:
    """``urlopen`` for a server on 127.0.0.1, never through a proxy."""
    return _LOOPBACK.open(request, timeout=timeout)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(backend: str, model_dir: Path, port: int, evaluate: Any) -> list[str]:
    """The server process for ``backend`` (cpu or vllm), serving ``model_dir`` on 127.0.0.1:``port``."""
    if backend == "cpu":
        return [sys.executable, "-m", "mtpipe.evaluation.server", str(model_dir), "--port", str(port),
                "--parent-pid", str(os.getpid())]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--tensor-parallel-size", str(evaluate.tensor_parallel_size), "--max-model-len", str(evaluate.max_length), "--seed", "0"]


@contextmanager
def serving(command: list[str], port: int, log: Path, timeout_s: float) -> Iterator[str]:
    """Run ``command`` until the block ends; yields the completions URL once ``/health`` answers 200.

    Fails, naming the log and quoting its end, when the server exits or is not up within ``timeout_s``
    (then also saying how much CPU time it got: a starved server and a stuck one read differently).
    The server gets no Hub token (the model is a local directory) and no stdin. SIGTERM and SIGHUP
    raise SystemExit meanwhile (their default would end the stage at once, the server left running)."""
    env = {k: v for k, v in os.environ.items() if k != "HF_TOKEN"}
    log.parent.mkdir(parents=True, exist_ok=True)
    with _signals_raise():
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, preexec_fn=_ended_with(os.getpid()))
        try:
            deadline = time.monotonic() + timeout_s
            while not _healthy(port):
                if proc.poll() is not None:
                    raise RuntimeError(f"the model server exited with {proc.returncode} before serving: "
                                       f"see {log}{_tail(log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the model server did not answer /health on port {port} within "
                                       f"{timeout_s:.0f} s ({_cpu_report(proc.pid)}): see {log}{_tail(log)}")
                time.sleep(0.5)
            yield f"http://127.0.0.1:{port}/v1/completions"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _ended_with(stage_pid: int) -> Callable[[], None] | None:
    """What the server's process runs before its command (Linux): the kernel sends it SIGTERM when the
    stage's process ends, however it ends (SIGKILL included), as vLLM's server gets no other word of it;
    a stage already gone by then ends it at once. None elsewhere (the CPU server watches its parent)."""
    if not sys.platform.startswith("linux"):
        return None

    def set_parent_death_signal() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != stage_pid:
            os._exit(1)

    return set_parent_death_signal


def _exit_on_signal(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)   # the exit status of a process the signal ended


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit while the block runs, where they are not ignored; only in the
    main thread (the one Python runs signal handlers in)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s, old in previous.items():
        if old != signal.SIG_IGN:
            signal.signal(s, _exit_on_signal)
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _tail(log: Path, lines: int = 15) -> str:
    text = log.read_text(errors="replace").strip().splitlines()[-lines:] if log.is_file() else []
    return "".join(f"\n  | {line}" for line in text)


def _cpu_report(pid: int) -> str:
    """The process's state and CPU seconds so far, from /proc (Linux), or what could not be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "its /proc entry is unreadable"
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return f"state {fields[0]}, {cpu_s:.1f} s of CPU used"


def _healthy(port: int) -> bool:
    try:
        with open_loopback(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
