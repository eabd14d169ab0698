"""Ctrl-C, SIGTERM and SIGHUP around the VM's billable steps.

A terminal's Ctrl-C (SIGINT), a `kill` (SIGTERM) and a closed terminal (SIGHUP) all mean "stop and
clean up". :func:`raising` makes the last two raise KeyboardInterrupt like the first, so one
``except BaseException`` deletes the VM; :func:`deferred` holds them back while a request that
creates something is on the wire (its answer, the operation to follow, must not be lost half way);
:func:`ignored` keeps them from stopping a cleanup. Python runs signal handlers in the main thread
only, so these act there, where the lifecycle runs.

A signal the process was started with ignored stays ignored: `nohup doit vm_run` survives its
terminal closing (nohup ignores SIGHUP), and a command a non-interactive shell runs in the background
(`doit vm_run &` in a script) has SIGINT ignored, as POSIX shells do for background commands; such a
run is stopped, with the same cleanup, by SIGTERM (`kill PID`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

TERMINAL = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum} ({signal.Signals(signum).name})")


@contextlib.contextmanager
def _handlers(handler: object, signals: tuple[int, ...] = TERMINAL) -> Iterator[None]:
    """``handler`` for each of ``signals`` that is not ignored, the previous handlers afterwards;
    nothing in a thread other than the main one (signals never reach it, nor can it set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in signals}
    previous = {s: signal.signal(s, handler) for s, old in previous.items() if old != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextlib.contextmanager
def raising() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does (SIGINT keeps Python's handler)."""
    with _handlers(_interrupt, (signal.SIGTERM, signal.SIGHUP)):
        yield


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold the terminal signals back until the block ends, then deliver the first that came to the
    handler that was in force before (Ctrl-C during an insert request: the request completes, its
    operation is known, and the interrupt comes right after)."""
    came: list[int] = []
    try:
        with _handlers(lambda signum, _frame: came.append(signum)):
            yield
    finally:
        if came:
            signal.raise_signal(came[0])


@contextlib.contextmanager
def ignored() -> Iterator[None]:
    """Ignore the terminal signals while the block runs: a second Ctrl-C, or the terminal closing,
    must not stop the deletion of a VM half way. They are not delivered afterwards."""
    with _handlers(signal.SIG_IGN):
        yield
