"""What Google refuses on the Compute Engine route, handled before money is spent: a v5e machine type
(which Compute lists but answers 403 on insert) refused before any request; a Flex-start VM waited on
while it is PENDING (Dynamic Workload Scheduler looking for capacity), left when its request window
expires, deleted on Ctrl-C; the insert's capacity codes handled as SkyPilot's failover handles them.

Against the fake Compute API (tests/fakes/fake_compute.py): `doit vm_up` in process around a minimal
repo (`world`, tests/vm_world.py), or the lifecycle's insert alone (`fake`: no SSH, no checks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
from fakes.fake_compute import FakeCompute
from pydantic import ValidationError
from vm_world import Env

from mtpipe.cloud.lifecycle import creation
from mtpipe.cloud.lifecycle.creation import INSERT_RETRIES
from mtpipe.cloud.lifecycle.run import VmLifecycle
from mtpipe.cloud.on_vm import ssh
from mtpipe.cloud.providers.gcp.bodies import instance_body
from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.interface import CapacityError, ProviderError
from mtpipe.cloud.settings import prices, vm_config, vm_state
from mtpipe.errors import ConfigError

pytestmark = [pytest.mark.provisioning, pytest.mark.first_run]
EAST_B, EAST_A, WEST, TOKYO = "us-east5-b", "us-east5-a", "europe-west4-a", "asia-northeast1-b"
V6E = "ct6e-standard-8t"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2e7Q2Wn5mJ0o7P1E5c1kdP0b4o3FqXg0aWQkMGxS5f test"


def insert_zones(fake: FakeCompute) -> list[str]:
    """The zone of each instances.insert, in order."""
    return [r.path.split("/zones/")[1].split("/")[0] for r in fake.inserts()]


def offer_v6e(fake, *zones: str) -> None:
    """The fake's ``zones`` offer the v6e-8 machine type (by default only us-east5-b and europe-west4-a do)."""
    for zone in zones:
        fake.machine_types[zone] = {V6E}


def test_a_v5e_vm_is_refused_before_any_request(world: Env) -> None:
    """machine_type ct5lp-hightpu-8t (what conf/hardware/v5e-8.yaml asks of the VM) with route: compute: vm_up and vm_run stop
    naming vm.machine_type, Compute's 403 and the routes that create v5e, with no request sent at all
    (no insert, no firewall rule, not even a read); the same config still loads for preflight's v5e
    forecast (its machine budget)."""
    w = world
    w.configure(machine_type="ct5lp-hightpu-8t", boot_disk_type="pd-balanced", provisioning="on-demand",
                route="compute")   # by machine type it takes the Cloud TPU API (tests/cloud/providers/test_tpu_api.py)
    for task in ("vm_up", "vm_run"):
        out = w.doit(task, ok=False).stdout
        assert "ConfigError: vm.machine_type: ct5lp-hightpu-8t (v5e) cannot be created on Compute Engine" in out, out
        assert "set route: tpu_api (or null: by machine type) in conf/vm.yaml" in out
        assert 'instances.insert with 403 "This user agent is not allowed to use the machine type ' \
               '[ct5lp-hightpu-8t]", even for a project holding v5e quota' in out
        assert "gcloud compute tpus tpu-vm create NAME --zone ZONE --accelerator-type=v5litepod-8" in out
        assert "queued-resources" in out and "GKE through xpk" in out
    assert w.fake.requests == [] and not w.fake.instances and not w.fake.firewalls
    assert not (w.repo / vm_state.STATE_FILE).exists()
    out = w.doit("check", ok=False).stdout   # doit check names the route too, beside what it can still check
    assert "mtpipe check:       FAILS  route: vm.machine_type: ct5lp-hightpu-8t (v5e) cannot be created" in out, out
    assert "mtpipe check: not checked  machine type: needs route" in out, out
    assert not [r for r in w.fake.requests if r.method != "GET" and not r.api_method.endswith("testIamPermissions")]
    assert not w.fake.instances and not w.fake.firewalls
    with mock.patch.dict(os.environ, w.env, clear=True):
        cfg = vm_config.load_config()
    assert vm_config.budget_machine(cfg).tpu == "v5e-8"   # what `doit preflight` forecasts against
    with pytest.raises(ConfigError, match="vm.machine_type"):
        vm_config.check_route(cfg)


def test_the_loaded_config_is_frozen_and_a_zone_change_is_a_new_config() -> None:
    """load_config's VmConfig cannot be changed in place; vm_config.in_zone, the one place a zone
    changes, gives a new config and leaves the loaded one as it was."""
    cfg = vm_config.load_config({"provisioning": "on-demand", "zones": [EAST_B, WEST]})
    with pytest.raises(ValidationError, match="frozen"):
        cfg.zone = WEST
    moved = vm_config.in_zone(cfg, WEST)
    assert (moved.zone, moved.zones, cfg.zone) == (WEST, [EAST_B, WEST], EAST_B)
    assert vm_config.candidate_zones(moved) == [WEST, EAST_B]


def test_flex_start_window_and_zones_are_checked_before_any_request(fake: FakeCompute) -> None:
    """requestValidForDuration outside 90-7200 s is refused at config load, naming the key and what is
    allowed; a Flex-start v6e VM's zones outside those known to grant one are each warned of and kept
    (public runs got Flex-start VMs outside the list), in their order; other modes say nothing."""
    for seconds in (60, 7201):
        with pytest.raises(ConfigError) as err:
            vm_config.load_config({"flex_start.request_valid_for_s": seconds})
        assert err.value.key == "vm.flex_start.request_valid_for_s" and "90-7200 s" in err.value.problem
    cfg = vm_config.load_config({"provisioning": "flex-start", "zones": [EAST_B, EAST_A, WEST]})
    zoned, warned = vm_config.check_create(cfg)
    assert warned == [
        f"zone {z} is not among those known to grant Flex-start {V6E} VMs (asia-northeast1-b, us-east5-a, "
        "us-south1-ai1b: conf/generations.yaml); trying it all the same" for z in (EAST_B, WEST)]
    assert zoned is cfg and vm_config.candidate_zones(zoned) == [EAST_B, EAST_A, WEST]
    on_demand = vm_config.load_config({"provisioning": "on-demand", "zones": [EAST_B, WEST]})
    assert vm_config.check_create(on_demand) == (on_demand, [])
    assert fake.requests == []


@pytest.mark.first_request
def test_a_flex_start_run(world: Env) -> None:
    """--provisioning=flex-start: a FLEX_START VM that consumes no reservation, runs at most
    max_run_duration_s and is then deleted, and whose insert may wait flex_start.request_valid_for_s
    for capacity; priced from conf/prices.yaml's flex-start row (a relative figure, said so) in the
    creation line and in what preflight's forecast reads. A zone not known to grant Flex-start v6e VMs
    is said, and kept. The insert leaves the VM PENDING: vm_up waits, saying so each poll, and
    connects once it is RUNNING. A PENDING VM that disappears (its request window expired) is a
    stockout: vm_up leaves the zone with nothing there and creates the VM in the next Flex-start zone.
    The fake refuses a Flex-start body without maxRunDuration, as Compute does."""
    w = world
    offer_v6e(w.fake, EAST_A, TOKYO)
    w.env["ZONE"] = EAST_A
    w.configure(zones=[EAST_B, EAST_A], flex_start={"request_valid_for_s": 1800, "poll_s": 0.2})
    w.fake.flex_start_capacity.append(("RUNNING", 1.0))
    out = w.doit("vm_up", "--provisioning=flex-start").stdout
    assert f"zone {EAST_B} is not among those known to grant Flex-start {V6E} VMs" in out, out
    assert f"creating {V6E} VM mt-test (flex-start) in {EAST_A}: about 10.16 USD per hour (8 chips x " \
           "1.27 USD, v6e flex-start in us-east5, price as of assumed: on-demand less 53%, the largest DWS " \
           "discount (no Flex-start price found): conf/prices.yaml) while it exists; Compute looks for capacity for up to 1800 s " \
           "(flex_start.request_valid_for_s); Compute deletes it after 4 h (at most 40.64 USD)." in out, out
    pending = [line for line in out.splitlines() if f"VM mt-test is PENDING in {EAST_A}: Compute is looking" in line]
    assert len(pending) >= 3 and "at most 1800 s: flex_start.request_valid_for_s); Ctrl-C deletes it" in pending[0]
    assert out.index(pending[-1]) < out.index("VM mt-test ready at")
    (insert,) = w.fake.inserts()
    assert insert_zones(w.fake) == [EAST_A]
    body = insert.json()
    assert body["scheduling"] | {"maxRunDuration": body["scheduling"]["maxRunDuration"]["seconds"]} == {
        "provisioningModel": "FLEX_START", "instanceTerminationAction": "DELETE", "onHostMaintenance": "TERMINATE",
        "automaticRestart": False, "maxRunDuration": "14400"}
    assert body["reservationAffinity"] == {"consumeReservationType": "NO_RESERVATION"}
    assert body["params"] == {"requestValidForDuration": {"seconds": "1800"}}
    assert body["labels"]["mtpipe-provisioning"] == "flex-start"
    assert "ct6e-standard-8t, FLEX_START, external IP 127.0.0.1" in w.doit("vm_status").stdout
    w.doit("vm_down")
    assert not w.fake.instances and not w.fake.disks

    w.fake.requests.clear()
    w.configure(zones=[EAST_A, TOKYO], flex_start={"request_valid_for_s": 90, "poll_s": 0.2})
    w.fake.flex_start_capacity.append(("gone", 0.5))
    out = w.doit("vm_up", "--provisioning=flex-start").stdout
    assert f"leaving zone {EAST_A}: no {V6E} free there now (stockout: Flex-start VM mt-test got no capacity in " \
           f"{EAST_A} within its request window (90 s, flex_start.request_valid_for_s): Compute removed it)" in out, out
    assert insert_zones(w.fake) == [EAST_A, TOKYO] and list(w.fake.instances) == [("proj-1", TOKYO, "mt-test")]
    assert [k for k in w.fake.disks if k[1] == EAST_A] == []
    assert json.loads((w.repo / vm_state.STATE_FILE).read_text())["zone"] == TOKYO
    w.doit("vm_down")
    assert not w.fake.instances and not w.fake.disks and not w.fake.firewalls

    with mock.patch.dict(os.environ, w.env, clear=True):
        cfg = vm_config.load_config({"provisioning": "flex-start"})
        assert prices.vm_rate(cfg).per_chip().startswith("v6e flex-start in us-east5, price as of assumed: on-demand less 53%")  # preflight's
        body = instance_body(cfg, cfg.name, "ssh-ed25519 AAAA", {}, "FLEX_START")
        del body["scheduling"]["max_run_duration"]
        with pytest.raises(ProviderError, match="Flex-start VMs need a maxRunDuration of at most 7 days"):
            Compute(cfg.project, cfg.zone).create_instance(body)
    assert not w.fake.instances


def test_a_pending_vm_an_earlier_run_left_is_waited_on(world: Env) -> None:
    """A Flex-start VM still PENDING from a run that was killed (its insert sent, nothing recorded):
    the next vm_up waits for its capacity with it, then reuses it, instead of failing on its missing
    external IP or sending a second insert."""
    w = world
    offer_v6e(w.fake, EAST_A)
    w.env["ZONE"] = EAST_A
    w.configure(zones=[EAST_A], flex_start={"request_valid_for_s": 90, "poll_s": 0.2})
    w.fake.flex_start_capacity.append(("RUNNING", 1.0))
    with mock.patch.dict(os.environ, w.env, clear=True):
        cfg = vm_config.load_config({"provisioning": "flex-start"})
        Compute(cfg.project, cfg.zone).create_vm(cfg, ssh.ssh_public_key(cfg), {"app": "mtpipe"})
    assert w.fake.instances[("proj-1", EAST_A, "mt-test")]["status"] == "PENDING"
    out = w.doit("vm_up", "--provisioning=flex-start").stdout
    assert "VM mt-test is PENDING: an earlier run's Flex-start request; waiting for its capacity" in out, out
    assert "reusing VM mt-test (RUNNING)" in out and len(w.fake.inserts()) == 1
    w.doit("vm_down")
    assert not w.fake.instances


def test_ctrl_c_while_pending_deletes_the_vm(fake: FakeCompute, tmp_path: Path) -> None:
    """Ctrl-C while the Flex-start VM is PENDING: the VM is deleted and the state file forgotten."""
    offer_v6e(fake, EAST_A)
    cfg = vm_config.load_config({"provisioning": "flex-start", "zone": EAST_A, "flex_start.poll_s": 0.1,
                                 "ssh.key_file": str(tmp_path / "id")})
    fake.flex_start_capacity.append(("RUNNING", 60))
    said = []

    def say(line: str) -> None:
        said.append(line)
        if "is PENDING" in line:
            raise KeyboardInterrupt

    with mock.patch.object(creation, "_say", say), pytest.raises(KeyboardInterrupt):
        VmLifecycle(cfg, tmp_path, yes=True).creation.create({})
    assert "VM mt-test: deleted" in said and len(fake.inserts()) == 1
    assert not fake.instances and not fake.disks and not (tmp_path / vm_state.STATE_FILE).exists()


def test_a_new_vm_without_an_address_is_deleted(fake: FakeCompute, tmp_path: Path) -> None:
    """A new VM that comes up without the external IP SSH needs is deleted, not left billing."""
    fake.nat_ip = ""
    life = VmLifecycle(vm_config.load_config({"provisioning": "on-demand"}), tmp_path, yes=True)
    instance = life.creation.create_vm(KEY, {})
    assert list(fake.instances) == [("proj-1", EAST_B, "mt-test")]
    with pytest.raises(vm_config.VmError, match="VM mt-test has no external IP"):
        life.creation.connect({}, instance, created=True)
    assert not fake.instances and not (tmp_path / vm_state.STATE_FILE).exists()


RETRIES = INSERT_RETRIES


@pytest.mark.parametrize(("code", "failures", "zones"), [
    ("ZONE_RESOURCE_POOL_EXHAUSTED", 1, [EAST_B, EAST_A]),
    ("ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS", 1, [EAST_B, EAST_A]),
    ("RESOURCE_POOL_EXHAUSTED", 1, [EAST_B, EAST_A]),
    ("insufficientCapacity", 1, [EAST_B, EAST_A]),
    ("UNSUPPORTED_OPERATION", 1, [EAST_B, EAST_A]),
    ("REGION_RESOURCE_POOL_EXHAUSTED", 1, [EAST_B, WEST]),   # us-east5-a: the same region, skipped
    ("RESOURCE_NOT_READY", 1, [EAST_B, EAST_B]),             # once: the same zone again
    ("RESOURCE_OPERATION_RATE_EXCEEDED", 1, [EAST_B, EAST_B]),
    ("RESOURCE_NOT_READY", RETRIES + 1, [EAST_B] * (RETRIES + 1) + [EAST_A]),   # then the next zone
    ("RESOURCE_OPERATION_RATE_EXCEEDED", RETRIES + 1, [EAST_B] * (RETRIES + 1) + [EAST_A]),
])
def test_capacity_codes(fake: FakeCompute, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture,
                        code: str, failures: int, zones: list[str]) -> None:
    """The insert's operation fails with ``code`` in us-east5-b ``failures`` times: a stockout moves to
    the next zone, a region-wide one to the next region's zone, a transient code retries the same zone
    after doubling waits, at most INSERT_RETRIES times; each zone left holds nothing of the VM."""
    offer_v6e(fake, EAST_A)
    monkeypatch.setattr(creation, "INSERT_RETRY_FIRST_WAIT_S", 0.01)
    cfg = vm_config.load_config({"provisioning": "on-demand", "zones": [EAST_B, EAST_A, WEST],
                                 "stockout.retry_for_s": 0})
    fake.insert_failures += [("operation", code, f"{code} in projects/proj-1/zones/{EAST_B}")] * failures
    fake.failed_insert_leaves_disk = True
    instance = VmLifecycle(cfg, tmp_path, yes=True).creation.create_vm(KEY, {})
    assert insert_zones(fake) == zones and instance.status == "RUNNING"
    assert list(fake.instances) == [("proj-1", zones[-1], "mt-test")] and list(fake.disks) == list(fake.instances)
    out = capsys.readouterr().out
    if code in ("RESOURCE_NOT_READY", "RESOURCE_OPERATION_RATE_EXCEEDED"):
        assert f"the same insert again in 0.01 s (retry 1 of {RETRIES})" in out, out
        if failures > RETRIES:
            assert f"the same insert again in 0.04 s (retry 3 of {RETRIES})" in out
            assert f"leaving zone {EAST_B}: no {V6E} free there now (stockout: creating VM mt-test: Compute is not " \
                   f"ready for it in {EAST_B} ({code}: " in out and f"the same after {RETRIES} retries)" in out
    elif code.startswith("REGION_"):
        assert f"no capacity in region us-east5 now ({code}: " in out
        assert "; skipping the other zones of region us-east5 this round" in out


def test_every_zone_out_of_stock_names_the_zones(fake: FakeCompute, tmp_path: Path) -> None:
    """A region-wide stockout in the only region listed: the CapacityError names the zones tried."""
    offer_v6e(fake, EAST_A)
    cfg = vm_config.load_config({"provisioning": "spot", "zones": [EAST_B, EAST_A], "stockout.retry_for_s": 0})
    fake.insert_failures.append(("operation", "REGION_RESOURCE_POOL_EXHAUSTED", "no ct6e in us-east5"))
    with pytest.raises(CapacityError, match=f"zones tried: {EAST_B}, for 0 s"):
        VmLifecycle(cfg, tmp_path, yes=True).creation.create_vm(KEY, {})
    assert insert_zones(fake) == [EAST_B] and not fake.instances and not fake.disks
