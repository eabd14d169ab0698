"""Each kind of reservation through `doit vm_up` (its checks before spending, then the insert)
against the fake Compute API and the loopback VM of tests/vm_world.py.

The kinds, as Compute documents them (tests/fakes/fake_compute.py models each): one a future
reservation in calendar mode created (its VMs RESERVATION_BOUND), an ordinary specific one (VMs of one
machine type, STANDARD), a TPU aggregate one (chips of a VM family: a v6e-8 takes 8), and one that
another project shares (named projects/OWNER/reservations/NAME). For each: the check's message while
it is full (nothing is created), then, with room for one VM, the insert's provisioningModel and
reservationAffinity, the cost line (the reservation's commitment pays), and the capacity the VM took
until vm_down gave it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from fakes.fake_compute import Reservation
from vm_world import Env, assert_deleted

pytestmark = [pytest.mark.provisioning, pytest.mark.cloud_contract]

AFFINITY = {"consumeReservationType": "SPECIFIC_RESERVATION", "key": "compute.googleapis.com/reservation-name"}
SHARED = "projects/owner-proj/reservations/shared-res"


@dataclass
class Kind:
    name: str                # as RESERVATION names it
    reservation: Reservation  # full: no room for one more VM
    takes: int               # what one ct6e-standard-8t VM takes from it
    model: str               # the provisioningModel its VMs get (reservation_model: auto)
    full: str                # the check's message while it is full


KINDS = {
    "calendar": Kind("cal-res", Reservation(count=2, in_use=2, delivered_by="CALENDAR"), 1,
                     "RESERVATION_BOUND", "cal-res has no free VM (2 of 2 VMs in use)"),
    "specific": Kind("v6e-res", Reservation(count=1, in_use=1), 1,
                     "STANDARD", "v6e-res has no free VM (1 of 1 VMs in use)"),
    # chips of TPU v6e; delivered by a future reservation in DEFAULT mode, which is not calendar mode
    "aggregate": Kind("tpu-res", Reservation(count=16, in_use=12, accelerator="ct6e", delivered_by="DEFAULT"), 8,
                      "STANDARD", "tpu-res has no free VM (12 of 16 chips in use; a ct6e-standard-8t takes 8)"),
    "shared": Kind(SHARED, Reservation(count=1, in_use=1, delivered_by="CALENDAR", project="owner-proj",
                                       shared_with=("proj-1",)), 1,
                   "RESERVATION_BOUND", f"{SHARED} has no free VM (1 of 1 VMs in use)"),
}


def nothing_created(w: Env) -> None:
    assert w.fake.inserts() == [] and not w.fake.firewalls and not (w.repo / ".vm_state.json").exists()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_of_reservation(world: Env, kind: str) -> None:
    w, k = world, KINDS[kind]
    short = k.name.rsplit("/", 1)[-1]
    reservation = w.fake.reservations[short] = k.reservation
    w.env["RESERVATION"] = k.name
    out = w.doit("vm_up", ok=False).stdout
    assert f"vm.reservation: {k.full}" in out, out
    nothing_created(w)
    owner = reservation.project   # a shared one is read in its owner's project
    assert w.fake.calls("GET", f"/projects/{owner}/zones/us-east5-b/reservations/{short}")

    reservation.in_use = reservation.count - k.takes   # room for exactly one VM
    out = w.doit("vm_up").stdout
    (insert,) = w.fake.inserts()
    body = insert.json()
    assert body["scheduling"]["provisioningModel"] == k.model
    assert body["reservationAffinity"] == {**AFFINITY, "values": [k.name]}
    assert f"paid for by the commitment of reservation {k.name}, instead of 21.60 USD/h on demand" in out, out
    if k.model == "RESERVATION_BOUND":
        assert "not known to be honoured for reservation-bound VMs: delete the VM with `doit vm_down`" in out
    else:
        assert "Compute deletes it after 4 h." in out
    # auto: the owner's future reservations told whether it is in calendar mode
    assert w.fake.calls("GET", f"/projects/{owner}/zones/us-east5-b/futureReservations")
    assert reservation.in_use == reservation.count
    out = w.doit("vm_down").stdout
    assert f"paid for by the commitment of reservation {k.name}, instead of" in out
    assert reservation.in_use == reservation.count - k.takes
    assert_deleted(w)


def test_a_shared_reservation_must_be_shared_and_its_mode_known(world: Env) -> None:
    """Another project's reservation must list this project in its shareSettings; when the owner's
    future reservations cannot be read, `reservation_model` decides instead of the lookup."""
    w = world
    reservation = w.fake.reservations["shared-res"] = Reservation(project="owner-proj")   # shareType LOCAL
    w.env["RESERVATION"] = SHARED
    out = w.doit("vm_up", ok=False).stdout
    assert f"vm.reservation: {SHARED} is not shared with proj-1 (shareSettings.shareType LOCAL)" in out, out
    assert "--add-share-with=proj-1" in out
    reservation.shared_with = ("proj-1",)
    w.fake.unreadable_projects.add("owner-proj")
    out = w.doit("vm_up", ok=False).stdout
    assert "listing the future reservations of owner-proj in us-east5-b" in out and "permission denied" in out
    assert "or set reservation_model in conf/vm.yaml" in out, out
    nothing_created(w)
    w.configure(reservation_model="standard")
    w.doit("vm_up")
    (insert,) = w.fake.inserts()
    assert insert.json()["scheduling"]["provisioningModel"] == "STANDARD" and reservation.in_use == 1
    w.doit("vm_down")
    assert_deleted(w)


def test_reservation_bound_needs_a_calendar_mode_reservation(world: Env) -> None:
    """`reservation_model: bound` on an ordinary reservation: Compute refuses the insert (reservation-bound
    VMs consume reservations of future reservations in calendar mode), and nothing is left."""
    w = world
    w.configure(reservation_model="bound")
    proc = w.doit("vm_up", ok=False)
    assert "RESERVATION_BOUND VMs consume reservations of future reservations in calendar mode" in proc.stdout
    assert w.instance() is None and not w.fake.firewalls and w.fake.reservations["v6e-res"].in_use == 0
    assert not w.fake.calls("GET", "/futureReservations")   # bound: no lookup


@pytest.mark.parametrize("reservation, message", [
    (Reservation(count=8, accelerator="ct5lp"),
     "v6e-res reserves VM_FAMILY_CLOUD_TPU_LITE_POD_SLICE_CT5LP chips, not ct6e ones (ct6e-standard-8t)"),
    (Reservation(status="CREATING"), "v6e-res is CREATING, not READY"),
], ids=["other-tpu-family", "not-ready"])
def test_a_reservation_that_cannot_take_the_vm(world: Env, reservation: Reservation, message: str) -> None:
    world.fake.reservations["v6e-res"] = reservation
    assert f"vm.reservation: {message}" in world.doit("vm_up", ok=False).stdout
    nothing_created(world)
