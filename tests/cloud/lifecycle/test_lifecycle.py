"""The VM lifecycle (mtpipe/cloud/lifecycle/) driven directly, without doit: the fake Compute API
and the loopback SSH server of tests/vm_world.py stand in for Google Cloud and the VM.

The doit tasks (tests/cloud/lifecycle/test_vm_cycle.py, test_vm_recovery.py) check the same rules end to end."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from unittest import mock

import pytest
from vm_world import Env

from mtpipe.cloud.lifecycle.lines import spend_line
from mtpipe.cloud.lifecycle.run import VmLifecycle
from mtpipe.cloud.on_vm import ssh
from mtpipe.cloud.settings import vm_config, vm_state

pytestmark = pytest.mark.architecture
KEY = ("proj-1", "us-east5-b", "mt-test")


@pytest.fixture
def here(world: Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    """The world's environment in this process, in its repo."""
    monkeypatch.chdir(world.repo)
    with mock.patch.dict(os.environ, world.env, clear=True):
        yield world


def lifecycle(w: Env, keep: bool = False) -> VmLifecycle:
    return VmLifecycle(vm_config.load_config({}, vm_state.read_state(w.repo)), w.repo, keep, yes=True)


class Terminal(io.StringIO):
    """A stdin that is a terminal, holding what the user types."""

    def isatty(self) -> bool:
        return True


@pytest.mark.first_hour
def test_the_price_is_confirmed_before_the_first_insert(world: Env) -> None:
    """vm_up and vm_run say what they would create, its price and the run's forecast, after every check
    and before any insert, and ask: no creates nothing; without a terminal nothing is created unless
    --yes; a VM that exists is reused without a question."""
    w = world
    w.configure(run__command='echo run >> "$HOME/runs"')
    with mock.patch("sys.stdin", Terminal("n\n")):
        out = w.doit("vm_up", yes=False, ok=False).stdout
    assert "about to create ct6e-standard-8t VM mt-test (reservation v6e-res" in out
    assert "no forecast of the run's length" in out and "create it? [y/N]" in out
    assert "VM mt-test not created (answered 'n'); nothing was spent" in out
    assert out.index("checks before spending") < out.index("about to create")
    assert w.fake.inserts() == [] and not w.fake.firewalls

    with mock.patch("sys.stdin", io.StringIO("")):   # a script, a pipe, CI
        out = w.doit("vm_run", yes=False, ok=False).stdout
    assert "ConfigError: --yes: is needed to create a VM when there is no terminal to ask on" in out
    assert w.fake.inserts() == []

    with mock.patch("sys.stdin", Terminal("y\n")):
        w.doit("vm_up", yes=False)
    assert len(w.fake.inserts()) == 1 and w.instance() is not None
    with mock.patch("sys.stdin", io.StringIO("")):
        out = w.doit("vm_run", "--keep", yes=False).stdout   # reused: nothing to confirm
    assert "create it?" not in out and "keeps running (--keep)" in out and w.instance() is not None
    out = w.doit("vm_run").stdout   # --yes (tests/vm_world.py as_script); deleted after the run
    assert "create it?" not in out and "VM mt-test: deleted" in out
    assert w.instance() is None and not (w.repo / vm_state.STATE_FILE).exists()
    assert (w.sshd.home / "runs").read_text() == "run\nrun\n"


def test_one_vm_is_created_reused_reported_and_deleted(here: Env) -> None:
    w = here
    remote = lifecycle(w).ensure([[]], may_create=True)
    assert remote.port == w.sshd.port and len(w.fake.inserts()) == 1
    assert w.fake.firewalls and vm_state.read_state(w.repo)["name"] == "mt-test"
    assert lifecycle(w).ensure([[]], may_create=False).host_key == remote.host_key
    assert len(w.fake.inserts()) == 1, "an existing VM was not reused"
    status = "\n".join(lifecycle(w).status())
    assert "VM mt-test in proj-1/us-east5-b: RUNNING" in status and "USD so far" in status, status
    lifecycle(w).delete()
    assert w.instance() is None and not w.fake.firewalls and not (w.repo / vm_state.STATE_FILE).exists()


def test_a_lost_vm_is_replaced_and_only_the_attempt_repeats(here: Env) -> None:
    """The VM is preempted during the attempt: the lifecycle records why, replaces the VM and runs
    the attempt again on the new one; the ledger holds both VMs."""
    w = here
    w.configure(provisioning="spot", spot_without_work_bucket=True)   # the attempt keeps no training state
    w.env.pop("RESERVATION")
    os.environ.pop("RESERVATION")
    life = lifecycle(w)
    hosts: list[str | None] = []

    def attempt(remote: ssh.Remote) -> None:
        hosts.append(remote.host_key)
        if len(hosts) == 1:
            w.fake.preempt(*KEY)
            raise vm_config.SessionLost("lost the SSH session")

    life.recovery.run(life.ensure([[]], may_create=True), attempt)
    assert len(hosts) == 2 and len(w.fake.inserts()) == 2
    ledger = vm_state.read_state(w.repo)["vms"]
    assert [entry.get("why") for entry in ledger] == ["was preempted (status TERMINATED)", None]
    life.delete()


def test_a_failure_on_a_running_vm_is_the_attempts_and_the_guard_deletes_the_vm(here: Env) -> None:
    w = here
    life = lifecycle(w)
    remote = life.ensure([[]], may_create=True)

    def attempt(_remote: ssh.Remote) -> None:
        raise vm_config.VmError("the pipeline failed on the VM (exit 3)")

    with pytest.raises(vm_config.VmError, match="exit 3"):
        life.guarded(lambda: life.recovery.run(remote, attempt))
    assert len(w.fake.inserts()) == 1, "a running VM was replaced"
    assert w.instance() is None and not w.fake.firewalls


def test_a_kept_vm_survives_a_failure(here: Env) -> None:
    w = here
    life = lifecycle(w, keep=True)
    life.ensure([[]], may_create=True)
    def fail() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        life.guarded(fail)
    assert w.instance() is not None and vm_state.read_state(w.repo)["name"] == "mt-test"
    life.delete()


def test_the_spend_counts_what_a_reservation_pays_apart() -> None:
    def entry(provisioning: str, usd: float, reservation: str | None, start: int, end: int) -> dict:
        return {"name": "mt-test", "provisioning": provisioning, "usd_per_hour": usd, "reservation": reservation,
                "created": f"2026-12-01T0{start}:00:00+00:00", "ended": f"2026-12-01T0{end}:00:00+00:00",
                "why": "deleted"}

    reserved = entry("reservation", 21.6, "v6e-res", 0, 1)
    assert spend_line({"vms": [reserved]}) == (
        "this run's VMs: 1; 1.00 h in all, paid for by the commitment of reservation v6e-res, instead of "
        "21.60 USD on demand")
    assert spend_line({"vms": [reserved, entry("spot", 4.32, None, 1, 3)]}) == (
        "this run's VMs: 2, 1 of them replaced after being lost; 3.00 h in all: about 8.64 USD, and 1.00 h "
        "paid for by the commitment of reservation v6e-res, instead of 21.60 USD on demand")
