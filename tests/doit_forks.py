"""`python -m doit` in its own session, started in a fraction of a second: a preloaded Python forks it.

A doit process spends about 10 s of CPU importing google-cloud-compute, DVC and MaxText's config
types (JAX) before it does anything; a test that interrupts doit a dozen times would spend minutes
on imports alone. This module run as a script is a server that imports them once and then, for each
request, forks a child that becomes doit: the child leads a new session (its own process group, as
a shell gives a command, so a test sends a terminal's Ctrl-C with ``os.killpg``), starts with the
signal dispositions of a terminal's foreground command (whatever the test session inherited), takes
the request's environment, working directory and output file, and runs doit's ``__main__`` as
``python -m doit`` does, interpreter exit included (atexit handlers, the wait for non-daemon
threads, death by SIGINT after an uncaught KeyboardInterrupt).

A helper module (imported by name, no fixtures): :class:`DoitForks` starts the server,
:meth:`DoitForks.start` one doit run at a time, :class:`Run` watches its output and its exit.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What `doit vm_*` imports before its first request (dodo.py's imports, then the checks before spending).
PRELOAD = ["doit.doit_cmd", "mtpipe.cloud.lifecycle.run", "mtpipe.data.publish", "mtpipe.planning.preflight",
           "maxtext.configs.types", "dvc.repo", "dvc_gs"]


class Run:
    """One forked doit: its output file and, once it ended, its exit code (negative: killed by that
    signal, as subprocess reports it)."""

    def __init__(self, server: DoitForks, pid: int, log: Path) -> None:
        self.server, self.pid, self.log = server, pid, log
        self.exit: int | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def killpg(self, sig: int) -> None:
        """Signal doit's whole process group, as a terminal does on Ctrl-C."""
        os.killpg(self.pid, sig)

    def poll(self) -> int | None:
        return self.wait(0)

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when doit still runs after ``timeout`` seconds."""
        if self.exit is None:
            reply = self.server.reply(timeout)
            if reply is not None:
                assert reply["pid"] == self.pid, reply
                self.exit = reply["exit"]
        return self.exit


class DoitForks:
    """The preloading server, started in ``env`` (what the modules may read when imported); one doit
    at a time. Use as a context manager."""

    def __init__(self, env: dict[str, str], preload: list[str] = PRELOAD) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, *preload], env=env, cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._buffer = ""
        self._current: Run | None = None
        ready = self.reply(300)
        assert ready == {"ready": True}, f"the doit fork server did not start: {ready}"

    def __enter__(self) -> DoitForks:
        return self

    def __exit__(self, *exc: object) -> None:
        self._end_current()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def start(self, args: list[str], cwd: Path, env: dict[str, str], log: Path) -> Run:
        """Fork `python -m doit ARGS` in ``cwd`` with exactly ``env``, its output (both streams) to ``log``."""
        self._end_current()
        assert self.proc.stdin is not None
        log.write_text("")
        self.proc.stdin.write(json.dumps({"args": args, "cwd": str(cwd), "env": env, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        started = self.reply(60)
        assert started is not None and "pid" in started, started
        self._current = Run(self, started["pid"], log)
        return self._current

    def _end_current(self) -> None:
        """Kill the previous doit's process group if a failed test left it running."""
        run, self._current = self._current, None
        if run is not None and run.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                run.killpg(signal.SIGKILL)
            run.wait(30)

    def reply(self, timeout: float) -> dict | None:
        """The server's next line, or None when none came within ``timeout`` seconds."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while "\n" not in self._buffer:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536).decode()
            assert chunk, f"the doit fork server exited (rc {self.proc.poll()})"
            self._buffer += chunk
        line, self._buffer = self._buffer.split("\n", 1)
        return json.loads(line)


# ---------------------------------------------------------------- the server (this file as a script)


def _become(request: dict) -> None:
    """In the forked child: a session of its own, the request's streams, directory and environment."""
    os.setsid()
    # what a terminal's foreground command starts with, whatever the test session inherited: a
    # session started in the background by a non-interactive shell ignores SIGINT and SIGQUIT,
    # and Python would keep them ignored (doit would then never see the test's Ctrl-C)
    for sig in (signal.SIGHUP, signal.SIGQUIT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    sys.stdout.reconfigure(line_buffering=True)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def serve() -> list[str] | None:
    """Fork a doit per request line, report its pid and then its exit code. Returns only in a
    child (the doit arguments it runs); the server returns None when its stdin closes."""
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _become(request)
            return request["args"]
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "exit": os.waitstatus_to_exitcode(status)}), flush=True)
    return None


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    for module in sys.argv[1:]:
        importlib.import_module(module)
    print(json.dumps({"ready": True}), flush=True)
    doit_args = serve()
    if doit_args is not None:
        sys.argv = ["doit", *doit_args]
        runpy.run_module("doit", run_name="__main__", alter_sys=True)
