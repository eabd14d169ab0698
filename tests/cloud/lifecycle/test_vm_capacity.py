"""Capacity: where and how the VM gets its TPU (mtpipe/cloud/lifecycle/creation.py's failover, checks/gcp/quota.py,
the flex-start provisioning). A stockout in the first of `zones` moves the insert to the next one,
leaving nothing in the zone it left; a quota short in a region skips that region's zones before the
insert, or stops the run naming the quota when no zone is left; a Flex-start VM is created as Compute
takes one and priced as conf/prices.yaml says (tests/cloud/providers/test_compute_refusals.py, with the
Flex-start queue).

`doit vm_up` runs in process against the loopback world (tests/vm_world.py): the fake Compute API
keeps each VM's boot disk as a disk of its zone and refuses an on-demand insert past the region's
quota; the quota's buckets are served by its Service Usage (tests/fakes/fake_org.py), every call
checked against its discovery document.
"""

from __future__ import annotations

import json

import pytest
from fakes.fake_org import bucket
from vm_world import Env

from mtpipe.cloud.checks.gcp import quota
from mtpipe.cloud.settings import vm_state
from mtpipe.pipeline import generations

pytestmark = [pytest.mark.provisioning, pytest.mark.first_request]
EAST, WEST = "us-east5-b", "europe-west4-a"   # zones of two regions that offer ct6e-standard-8t
STOCKOUT = ("operation", "ZONE_RESOURCE_POOL_EXHAUSTED",
            f"The zone 'projects/proj-1/zones/{EAST}' does not have enough resources available to fulfill the "
            "request. Try a different zone, or try again later.")
TPU_QUOTA = generations.load()["v6e"].compute.quota


def insert_zones(w: Env) -> list[str]:
    """The zone of each instances.insert, in order."""
    return [r.path.split("/zones/")[1].split("/")[0] for r in w.fake.inserts()]


def left_in(w: Env, zone: str) -> list[str]:
    """What of the VM's is in ``zone``: instances and disks."""
    return [f"{kind} {name}" for kind, found in (("VM", w.fake.instances), ("disk", w.fake.disks))
            for (_, z, name) in found if z == zone]


def down(w: Env) -> None:
    """vm_down; then nothing is left in any zone, and no firewall rule."""
    w.doit("vm_down")
    assert not w.fake.instances and not w.fake.disks and not w.fake.firewalls
    assert not (w.repo / vm_state.STATE_FILE).exists()


def test_a_stockout_in_the_first_zone_moves_to_the_second(world: Env) -> None:
    """zones: [us-east5-b, europe-west4-a]: us-east5-b is out of v6e (the insert's operation fails
    ZONE_RESOURCE_POOL_EXHAUSTED) and its failed insert left the boot disk; vm_up deletes that disk,
    says why it moves on and creates the VM in europe-west4-a at once, which the state file records
    and vm_status reads. Without the state file vm_down looks for it in each zone of the list."""
    w = world
    w.configure(provisioning="on-demand", zones=[EAST, WEST])
    w.fake.insert_failures.append(STOCKOUT)
    w.fake.failed_insert_leaves_disk = True
    out = w.doit("vm_up").stdout
    assert insert_zones(w) == [EAST, WEST]
    assert f"creating ct6e-standard-8t VM mt-test (on-demand) in {EAST}:" in out, out
    assert f"disk mt-test in {EAST}, left by the failed insert: deleted" in out
    assert f"leaving zone {EAST}: no ct6e-standard-8t free there now (stockout: creating VM mt-test: no capacity " \
           f"in {EAST} now (ZONE_RESOURCE_POOL_EXHAUSTED: " in out
    assert f"nothing of VM mt-test is left there" in out
    assert f"creating ct6e-standard-8t VM mt-test (on-demand) in {WEST}:" in out and "VM mt-test ready at" in out
    assert left_in(w, EAST) == [] and left_in(w, WEST) == ["VM mt-test", "disk mt-test"]
    assert json.loads((w.repo / vm_state.STATE_FILE).read_text())["zone"] == WEST
    assert f"VM mt-test in proj-1/{WEST}: RUNNING" in w.doit("vm_status").stdout
    (w.repo / vm_state.STATE_FILE).unlink()   # another checkout: NAME, ZONE and zones only
    assert "VM mt-test: deleted" in w.doit("vm_down").stdout
    assert not w.fake.instances and not w.fake.disks and not w.fake.firewalls


def test_a_quota_short_in_a_region_is_stopped_before_the_insert(world: Env) -> None:
    """TPUS_PER_TPU_FAMILY (tpu_family=CT6E) allows 0 chips in us-east5, 16 in europe-west4, as Service
    Usage reads it. An on-demand VM in us-east5-b stops before the insert, naming the quota and where to
    raise it; with zones listing europe-west4-a too, vm_up skips us-east5-b and creates it there. A
    limit with room that other VMs use up is the insert's QUOTA_EXCEEDED: vm_up moves to another
    region's zone. A Spot VM takes preemptible quota first: the short standard one is said only."""
    w = world
    w.configure(provisioning="on-demand")
    w.fake.org.quotas[TPU_QUOTA.metric] = [bucket(0), bucket(16, region="europe-west4", tpu_family="CT6E")]
    out = w.doit("vm_up", ok=False).stdout
    assert "quota TPUS_PER_TPU_FAMILY: Compute Engine's quota 'TPUs per TPU family' (compute.googleapis.com/" \
           "tpus_per_tpu_family, tpu_family=CT6E) allows 0 chips in us-east5, and a ct6e-standard-8t VM takes 8: " \
           "the insert would be refused (QUOTA_EXCEEDED). Fix: request at least 8 at https://console.cloud." \
           "google.com/iam-admin/quotas?project=proj-1 (filter: TPUS_PER_TPU_FAMILY, tpu_family=CT6E, the " \
           "region), or list a zone of a region with room in zones:" in out, out
    assert w.fake.inserts() == [] and not w.fake.firewalls and not (w.repo / vm_state.STATE_FILE).exists()
    (read,) = [r for r in w.fake.requests if r.api_method == "serviceusage.services.consumerQuotaMetrics.get"]
    assert "/consumerQuotaMetrics/compute.googleapis.com%2Ftpus_per_tpu_family?view=FULL" in read.path

    w.configure(zones=[EAST, WEST])
    out = w.doit("vm_up").stdout
    assert f"allows 0 chips in us-east5, and a ct6e-standard-8t takes 8: skipping {EAST}; trying {WEST}" in out, out
    assert insert_zones(w) == [WEST] and left_in(w, WEST) == ["VM mt-test", "disk mt-test"]
    down(w)

    w.fake.requests.clear()
    w.fake.org.quotas[TPU_QUOTA.metric] = [bucket(0), bucket(8, region="us-east5", tpu_family="CT6E"),
                                           bucket(16, region="europe-west4", tpu_family="CT6E")]
    w.fake.instances[("proj-1", "us-east5-a", "theirs")] = {   # another on-demand v6e-8 of the project
        "name": "theirs", "status": "RUNNING", "machineType": "zones/us-east5-a/machineTypes/ct6e-standard-8t",
        "scheduling": {"provisioningModel": "STANDARD"}}
    out = w.doit("vm_up").stdout
    assert f"leaving zone {EAST}: the quota of region us-east5 is spent (creating VM mt-test: quota exceeded " \
           "(QUOTA_EXCEEDED: Quota 'TPUS_PER_TPU_FAMILY' exceeded.  Limit: 8.0 in region us-east5.)" in out, out
    assert insert_zones(w) == [EAST, WEST] and left_in(w, EAST) == []
    del w.fake.instances[("proj-1", "us-east5-a", "theirs")]
    down(w)

    w.configure(provisioning="spot", zones=[EAST], spot_without_work_bucket=True)
    w.fake.org.quotas[TPU_QUOTA.metric] = [bucket(0)]
    out = w.doit("vm_up").stdout
    assert "quota TPUS_PER_TPU_FAMILY (tpu_family=CT6E) allows 0 chips in us-east5, and a ct6e-standard-8t " \
           "takes 8: a spot VM takes the preemptible TPU v6e quota first (not read here), so going on" in out, out
    down(w)
