"""No VM outlives its record, and Ctrl-C ends every phase of `doit vm_run` with the VM deleted.

doit runs as a terminal runs it: a process group of its own, signalled as a whole (`os.killpg`), as
Ctrl-C (SIGINT) or a kill of everything (SIGKILL) would. It is forked from a preloaded Python
(tests/doit_forks.py), so that a run reaches the phase under test in a second or two. The fakes hold
each phase open until the signal has landed in it: the fake Compute API keeps an answer back (the
checks' reservations.get, the instances.insert request) or an insert's operation PENDING, the
loopback sshd keeps a command from starting (setup, shipping the code, bringing the experiment back),
and the pipeline is a `sleep` that prints a line first.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from doit_forks import DoitForks, Run
from fakes.gcs_emulator import GCS_TEST_ENV
from vm_world import ROOT, Env, as_script, assert_deleted, sh

from mtpipe.cloud.providers import interrupts

# one group: the tests share one fork server (its imports take 15 s) on one worker
pytestmark = [pytest.mark.cloud_contract, pytest.mark.xdist_group("vm-interrupts")]
EXIT_BOUND_S = 30     # Ctrl-C to the end of doit, the VM deleted
RUNS = itertools.count()


@pytest.fixture(scope="module")
def forks() -> Iterator[DoitForks]:
    with DoitForks(dict(os.environ, **GCS_TEST_ENV)) as server:
        yield server


def start(forks: DoitForks, w: Env, *args: str, repo: Path | None = None,
          env: dict[str, str] | None = None) -> Run:
    """`doit ARGS` in ``repo`` (the world's by default), in a session of its own."""
    repo = repo or w.repo
    return forks.start(["-f", str(ROOT / "dodo.py"), "-d", str(repo), *as_script(args)], repo, env or w.env,
                       repo.parent / f"doit-{next(RUNS)}.log")


def until(run: Run, what: str, condition: Callable[[], object], timeout: float = 60) -> None:
    """Wait until ``condition()`` holds while doit still runs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert run.poll() is None, f"doit ended (exit {run.exit}) before {what}:\n{run.output()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout:.0f} s:\n{run.output()}"
        time.sleep(0.02)


def ended(run: Run, since: float) -> int:
    """doit's exit code, asserting it ended within EXIT_BOUND_S of ``since``."""
    code = run.wait(EXIT_BOUND_S - (time.monotonic() - since))
    assert code is not None, f"doit still runs {EXIT_BOUND_S} s after the signal:\n{run.output()}"
    return code


def finish(run: Run) -> str:
    """The output of a doit run that must succeed."""
    assert run.wait(120) == 0, run.output()
    return run.output()


def without_name(w: Env) -> dict[str, str]:
    """The world's environment without NAME: which VM is meant comes from the record or the labels."""
    return {k: v for k, v in w.env.items() if k != "NAME"}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
@pytest.mark.slow
def test_an_insert_interrupted_leaves_no_vm_unrecorded(world: Env, forks: DoitForks, tmp_path: Path,
                                                       sig: signal.Signals) -> None:
    """vm_up is interrupted while Compute creates the VM. The VM was recorded before the insert went
    out; on Ctrl-C vm_up waits for the insert to finish and deletes the VM; after a kill, the
    record (this directory) and the labels (a fresh clone, no record) find it, with its cost, and
    vm_down in the clone deletes it."""
    w = world
    recorded_at_insert: list[dict] = []
    w.fake.on_insert = lambda body: recorded_at_insert.append(json.loads((w.repo / ".vm_state.json").read_text()))
    w.fake.hold_inserts()
    run = start(forks, w, "vm_up")
    until(run, "the insert", lambda: recorded_at_insert)   # the request is recorded before on_insert runs
    labels = w.fake.inserts()[0].json()["labels"]
    (record,) = recorded_at_insert
    assert record["name"] == "mt-test" and record["zone"] == "us-east5-b" and record["insert_sent"]
    assert record["run_id"] == labels["mtpipe-run"] and labels["app"] == "mtpipe"
    rule = w.fake.firewalls[("proj-1", "mt-test-ssh")]
    assert f"mtpipe-run={record['run_id']}" in rule["description"] and "app=mtpipe" in rule["description"]
    run.killpg(sig)
    signalled = time.monotonic()
    if sig == signal.SIGINT:
        until(run, "the wait for the insert", lambda: "until Compute has finished the insert" in run.output())
        w.fake.release_inserts()
        assert ended(run, signalled) != 0
        assert "VM mt-test: deleted" in run.output()
        assert_deleted(w)
        return
    assert ended(run, signalled) == -signal.SIGKILL
    w.fake.release_inserts()     # Compute goes on creating the VM nobody waits for
    assert w.instance()["status"] == "RUNNING"

    here = finish(start(forks, w, "vm_status", env=without_name(w)))
    assert "VM mt-test in proj-1/us-east5-b: RUNNING" in here and "USD so far" in here, here

    clone = tmp_path / "clone"
    sh(["git", "clone", "-q", str(w.repo), str(clone)], tmp_path, w.env)
    assert not (clone / ".vm_state.json").exists()
    status = finish(start(forks, w, "vm_status", repo=clone, env=without_name(w)))
    assert "other VMs labelled app=mtpipe in proj-1/us-east5-b:" in status, status
    (line,) = [x for x in status.splitlines() if x.strip().startswith("mt-test:")]
    assert f"run {record['run_id']}" in line and "USD so far at 21.60 USD/h" in line, line
    down = finish(start(forks, w, "vm_down", repo=clone, env=without_name(w)))
    assert "VM mt-test: deleted" in down and "firewall rule mt-test-ssh: deleted" in down, down
    assert w.instance() is None and not w.fake.firewalls


@dataclasses.dataclass
class Phase:
    """Where vm_run is when the signal comes, and how the fakes hold it there."""

    name: str
    hold: Callable[[Env], None]
    holding: Callable[[Env, Run], object]   # true once vm_run waits inside the phase


def _pipeline_holds(w: Env) -> None:
    w.configure(run__command='echo "mtpipe-test: the pipeline runs"; sleep 60')


PHASES = [
    Phase("checks", lambda w: w.fake.hold_requests("GET", "/reservations/"), lambda w, _: w.fake.held_requests),
    Phase("insert", lambda w: (w.fake.hold_requests("POST", "/zones/us-east5-b/instances"), w.fake.hold_inserts()),
          lambda w, _: w.fake.held_requests),
    Phase("setup", lambda w: w.sshd.hold("setup.sha256"), lambda w, _: w.sshd.held),
    Phase("shipping", lambda w: w.sshd.hold("mtpipe.bundle"), lambda w, _: w.sshd.held),
    Phase("pipeline", _pipeline_holds, lambda _, run: "mtpipe-test: the pipeline runs" in run.output()),
    Phase("bringing the experiment back", lambda w: w.sshd.hold("mtpipe-exps.bundle"), lambda w, _: w.sshd.held),
]


@pytest.mark.slow
def test_ctrl_c_in_every_phase_of_vm_run_deletes_the_vm(world: Env, forks: DoitForks) -> None:
    """Three times per phase: Ctrl-C once vm_run waits inside it; doit ends within EXIT_BOUND_S, no
    instance is left, the state file records none (the record ends with the VM)."""
    w = world
    config = w.config.read_text()
    for phase, attempt in itertools.product(PHASES, range(3)):
        w.config.write_text(config)
        w.configure(run__command="true")
        phase.hold(w)
        run = start(forks, w, "vm_run")
        until(run, f"the {phase.name} phase", lambda: phase.holding(w, run))
        run.killpg(signal.SIGINT)
        signalled = time.monotonic()
        if phase.name == "insert":    # the request was answered after the signal; the insert goes on
            w.fake.release_requests()
            until(run, "the wait for the insert", lambda: "until Compute has finished the insert" in run.output())
            w.fake.release_inserts()
        code = ended(run, signalled)
        w.fake.release_requests()
        w.sshd.release()
        out = f"{phase.name} #{attempt + 1}:\n{run.output()}"
        assert code != 0, out
        assert w.instance() is None and not w.fake.firewalls, out
        assert not (w.repo / ".vm_state.json").exists(), out
        if phase.name == "checks":
            assert not w.fake.inserts(), out
        else:
            assert "VM mt-test: deleted" in run.output(), out
        w.fake.held_requests.clear()
        w.sshd.held.clear()
    assert len(w.fake.inserts()) == 3 * (len(PHASES) - 1)



def test_deferred_signals_come_after_the_block_and_ignored_ones_stay_ignored() -> None:
    """An insert request finishes before Ctrl-C acts; nohup's ignored SIGHUP stays ignored (the run
    survives its terminal), a SIGHUP with its default disposition stops the run like Ctrl-C."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP)}
    done = []
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                signal.raise_signal(signal.SIGINT)
                done.append("the request")
        assert done == ["the request"]
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        with interrupts.raising():
            signal.raise_signal(signal.SIGHUP)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        with pytest.raises(KeyboardInterrupt, match="SIGHUP"), interrupts.raising():
            signal.raise_signal(signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
