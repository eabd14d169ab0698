"""A VM that nothing uses deletes itself, from the VM (mtpipe/cloud/providers/gcp/idle_watch.py).

vm_up creates the VM with a startup script in its metadata; the test runs that script as the VM's
guest agent would at boot (the loopback VM is this machine), with the fake metadata server saying
who the VM is and the fake Compute API receiving the VM's own delete. The laptop takes no part: it
could be gone.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.fake_metadata import FakeMetadata, running_metadata
from vm_world import Env, idle_limit

pytestmark = pytest.mark.first_hour

MODES = {   # provisioning -> what its world needs besides the reservation of the default one
    "reservation": {},
    "spot": {"provisioning": "spot", "spot_without_work_bucket": True},
    "on-demand": {"provisioning": "on-demand"},
    "flex-start": {"provisioning": "flex-start"},
}


@pytest.fixture
def idle_world(world: Env, tmp_path: Path) -> Iterator[tuple[Env, FakeMetadata, Path]]:
    """The world with a 1-s idle limit, its metadata server, and where the VM's lock file is."""
    with running_metadata(FakeMetadata(lambda: "vm-sa@proj-1.iam.gserviceaccount.com")) as metadata:
        yield world, metadata, idle_limit(world, tmp_path, metadata.host)


def boot(w: Env) -> None:
    """Run the VM's startup script, as its guest agent does at boot (it starts the watch, detached)."""
    items = {i["key"]: i["value"] for i in w.instance()["metadata"]["items"]}
    subprocess.run(["bash", "-c", items["startup-script"]], check=True, timeout=30)


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.parametrize("mode", MODES)
def test_an_idle_vm_deletes_itself_in_every_provisioning_mode(idle_world, mode: str) -> None:
    """Idle past the limit, the VM sends its own instances.delete; while a vm_run command holds the
    lock (`flock -s`, as every command vm_run sends does) it is busy and kept."""
    w, metadata, lock = idle_world
    if mode != "reservation":
        w.env.pop("RESERVATION")
    if mode == "flex-start":   # a zone that grants Flex-start v6e VMs (vm_config.FLEX_START_ZONES)
        w.env["ZONE"] = "us-east5-a"
        w.fake.machine_types["us-east5-a"] = {"ct6e-standard-8t"}
        metadata.vm = ("proj-1", "us-east5-a", "mt-test")
    w.configure(**MODES[mode])
    w.doit("vm_up", "--keep")
    assert w.instance()["status"] == "RUNNING"
    holder = subprocess.Popen(["flock", "-s", str(lock), "sleep", "2.5"])   # a pipeline running
    try:
        time.sleep(0.3)
        boot(w)
        time.sleep(1.8)   # past the limit, but busy
        assert w.fake.calls("DELETE", "/instances/mt-test") == [] and w.instance()["status"] == "RUNNING"
    finally:
        holder.wait(10)
    wait_for(lambda: w.fake.calls("DELETE", "/instances/mt-test"))
    log = Path(f"{lock}.log")
    wait_for(lambda: log.is_file() and "deleting this VM" in log.read_text())   # and the watch ended
    w.fake.finish_operations()
    assert w.instance() is None
    assert "already gone" in w.doit("vm_down").stdout


def test_a_vm_that_may_not_delete_itself_powers_off(idle_world, tmp_path: Path) -> None:
    """Its service account lacks compute.instances.delete: it runs idle.poweroff_command (a stopped
    VM bills its disk only); the laptop's vm_down deletes it later."""
    w, _, lock = idle_world
    w.doit("vm_up", "--keep")
    w.fake.instance_delete_denied = True
    boot(w)
    wait_for(lambda: (tmp_path / "powered-off").exists())
    assert "not allowed to delete this VM (HTTP 403): powered off" in Path(f"{lock}.log").read_text()
    assert w.instance() is not None
    w.fake.instance_delete_denied = False
    w.doit("vm_down")
    assert w.instance() is None
