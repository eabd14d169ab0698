"""Run a MaxText command in a child process: full log to a file, progress to the console.

The console shows one line per training step that MaxText reports (step, loss, tokens/s, ETA) and
the tail of the log if the command fails. The child never gets a Hub token (``HF_TOKEN``): only
hf_download needs one, and MaxText would write it into its tensorboard config dump
(docs/secrets.md). Values of the variables in ``REDACTED_ENV`` are masked in the log.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from mtpipe.maxtext.commands import MaxTextCommand
from mtpipe.pipeline.stage import HUB_TOKEN_ENV

STEP_LINE = re.compile(r"completed step: (?P<step>\d+), seconds: (?P<sec>[\d.]+)"
                       r"(?:.*?Tokens/s/device: (?P<tps>[\d.]+))?.*?loss: (?P<loss>[\d.naif-]+)")
REDACTED_ENV = (*HUB_TOKEN_ENV, "GOOGLE_APPLICATION_CREDENTIALS")


class MaxTextFailed(RuntimeError):
    """MaxText exited with an error; the message holds the end of its log."""


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
    done = step - first_step
    if total and done > 0:
        eta = elapsed / done * (total - step)
        line += f"  ETA {int(eta // 60)}:{int(eta % 60):02d}"
    return line


def run(cmd: MaxTextCommand, log_path: Path, total_steps: int | None = None) -> None:
    """Run ``cmd``; raise :class:`MaxTextFailed` with the log's tail if it fails.

    A stage started with ``--print-command`` prints the child's command line and exits instead
    (benchmarks/bench_dvc.py times that command against the stage).
    """
    if "--print-command" in sys.argv:
        env = [f"{k}={socket.gethostname() if v == '@hostname' else v}" for k, v in cmd.env.items()]
        print(shlex.join([*(["env", *env] if env else []), "python", *cmd.argv()[1:]]))
        sys.exit(0)
    env = child_env(cmd.env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"$ {redact(cmd.as_tutorial())}", flush=True)
    start, first_step = time.monotonic(), None
    tail: list[str] = []
    with open(log_path, "a", encoding="utf8") as log:
        log.write(f"$ {redact(cmd.as_tutorial())}\n# launched as: python -m {cmd.launcher} {cmd.module} ...\n")
        proc = subprocess.Popen(cmd.argv(), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = redact(raw)
            log.write(line)
            tail = (tail + [line])[-40:]
            match = STEP_LINE.search(line)
            if match:
                step = int(match["step"])
                first_step = step if first_step is None else first_step
                print(format_progress(step, total_steps, match["loss"], match["tps"],
                                      time.monotonic() - start, first_step), flush=True)
        code = proc.wait()
        log.write(f"# exit {code} after {time.monotonic() - start:.1f}s\n")
    if code != 0:
        sys.stderr.write("".join(tail))
        raise MaxTextFailed(f"{cmd.module} exited with {code}; full log: {log_path}")
    print(f"  done in {time.monotonic() - start:.1f}s (log: {log_path})", flush=True)
