"""Notices about a VM run: finished, failed, preempted and recovered, budget passed.

Sent through Apprise (one library for Slack, e-mail, ntfy, webhooks and about a hundred other
services) to the URLs in ``MTPIPE_NOTIFY_URL`` (Apprise's URL syntax, several separated by spaces or
commas). No URL: no notice. A notice that cannot be sent prints one line and never fails the run.
The URL may hold a token, so it is read from the environment only and never printed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from enum import Enum

NOTIFY_URL_ENV = "MTPIPE_NOTIFY_URL"
BUDGET_POLL_S = 60.0   # how often a run's spend is compared with budget_usd


class Event(Enum):
    """What happened to the run: (the words of the notice's title, Apprise's notify type)."""

    FINISHED = ("finished", "success")
    FAILED = ("failed", "failure")
    RECOVERED = ("preempted and recovered", "warning")
    BUDGET_PASSED = ("budget passed", "warning")

    @property
    def title(self) -> str:
        return self.value[0]


def send(event: Event, vm: str, body: str, say: Callable[[str], None]) -> bool:
    """Send one notice to the configured URLs; True when every service took it. Without
    MTPIPE_NOTIFY_URL nothing is sent; a failure is one line through ``say`` (which prints a line),
    never an exception."""
    urls = os.environ.get(NOTIFY_URL_ENV, "").strip()
    if not urls:
        return False
    title = f"mtpipe vm_run on {vm}: {event.title}"
    apprise_log = logging.getLogger("apprise")
    level = apprise_log.level
    apprise_log.setLevel(logging.CRITICAL + 1)   # its messages may name the URL's host or token
    try:
        import apprise   # here: only vm_run sends notices, and `doit list` stays quick

        notices = apprise.Apprise()
        if not notices.add(urls):
            say(f"notice not sent: {NOTIFY_URL_ENV} holds no URL Apprise reads "
                "(docs/tpu-vm.md, \"Notices\")")
            return False
        sent = bool(notices.notify(body=body, title=title, notify_type=apprise.NotifyType(event.value[1])))
    except Exception as e:   # a notice never fails the run
        sent, why = False, type(e).__name__
    else:
        why = "the service refused it or was unreachable"
    finally:
        apprise_log.setLevel(level)
    if not sent:
        say(f"notice '{event.title}' not sent to {NOTIFY_URL_ENV} ({why}); the run goes on")
    return sent


class BudgetWatch(threading.Thread):
    """Sends one BUDGET_PASSED notice when ``spent()`` (USD) first exceeds ``budget_usd``, checking
    every BUDGET_POLL_S seconds until :meth:`stop`; a daemon, so it never holds the process."""

    def __init__(self, budget_usd: float, spent: Callable[[], float], vm: str, say: Callable[[str], None]) -> None:
        super().__init__(daemon=True, name="mtpipe-budget-watch")
        self.budget_usd, self.spent, self.vm, self.say = budget_usd, spent, vm, say
        self.passed, self._stop = False, threading.Event()

    def run(self) -> None:
        while not self._stop.wait(BUDGET_POLL_S):
            if self.check():
                return

    def check(self) -> bool:
        """Notify once when the spend is past the budget; True once it is."""
        if self.passed:
            return True
        usd = self.spent()
        if usd <= self.budget_usd:
            return False
        self.passed = True
        self.say(f"this run's VMs cost {usd:.2f} USD, past budget_usd {self.budget_usd:.2f}")
        send(Event.BUDGET_PASSED, self.vm, f"This run's VMs have cost {usd:.2f} USD, more than budget_usd "
             f"{self.budget_usd:.2f} USD (conf/vm.yaml). The run goes on: `doit vm_down` stops it.", self.say)
        return True

    def stop(self) -> None:
        self._stop.set()
