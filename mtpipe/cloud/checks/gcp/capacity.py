"""Checks before spending of capacity: where Compute can create the VM.

The zone offers the machine type, and with `provisioning: reservation` the reservation
exists (another project's: shared with this one), is READY, reserves that machine type (or its TPU
chips) and has room for one VM, and how its VMs are provisioned is decided (RESERVATION_BOUND or
STANDARD); every other zone of ``zones`` as the first (it offers the machine type; its region has the
subnetwork and, without an external IP, a Cloud NAT), and the TPU quota of each zone's region
(mtpipe.cloud.checks.gcp.quota: a region without room is left out, none with room stops the run). Each
failure is a ConfigError naming the key and the fix.
"""
from __future__ import annotations

from collections.abc import Iterable

from google.cloud import compute_v1

from mtpipe.cloud.checks.gcp import access, quota
from mtpipe.cloud.providers.gcp.bodies import reservation_path
from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis
from mtpipe.cloud.providers.interface import region
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations


def check_compute(cfg: VmConfig, compute: Compute) -> None:
    """The zone offers the machine type, a reservation has room for one VM."""
    check_machine_type(cfg, compute)
    if cfg.provisioning == "reservation":
        check_reservation(cfg, compute)


def check_machine_type(cfg: VmConfig, compute: Compute) -> None:
    """The zone offers the machine type (an authenticated call: bad credentials fail here too)."""
    if compute.get_machine_type(cfg.machine_type) is None:
        tpu = generations.of_machine_type(cfg.machine_type)[0].title
        raise ConfigError("vm.zones" if cfg.zones else "vm.zone", f"zone {cfg.zone!r} does not offer "
                          f"{cfg.machine_type} ({tpu})", f"pick zones listed for {tpu} at "
                          "cloud.google.com/tpu/docs/regions-zones with ZONE / --zone or "
                          "zones: in conf/vm.yaml, where your reservation is")


def check_zones(cfg: VmConfig, compute: Compute, apis: GoogleApis) -> VmConfig:
    """Every other zone the VM may be created in as :func:`check_compute` and access checked the
    first (the regional part: access.check_region), then the quota of their regions
    (quota.usable_zones), which may leave fewer zones to try: returns ``cfg`` in those zones."""
    zones = vm_config.candidate_zones(cfg)
    regions = {region(cfg.zone)}
    for zone in zones[1:]:
        here, there = vm_config.in_zone(cfg, zone), compute.in_zone(zone)
        check_compute(here, there)
        if region(zone) not in regions:
            regions.add(region(zone))
            access.check_region(here, there)
    usable = quota.usable_zones(cfg, apis, zones)
    return vm_config.in_zone(cfg, usable[0], usable)


FULL_FIX = ("delete a VM that uses it (`gcloud compute instances list --filter=labels.app=mtpipe`), wait "
            "for one to end, or use another reservation")


def check_reservation(cfg: VmConfig, compute: Compute) -> None:
    """The reservation exists (another project's: shared with this one), is READY, reserves the
    machine type and has room for one VM: a free VM of a specific reservation, the VM's chips of an
    aggregate (TPU) one. Then the provisioning model of its VMs is decided, so that a lookup Compute
    refuses stops the run here (Compute.provisioning_model)."""
    owner, name = reservation_path(cfg.reservation, cfg.project)
    reservation = compute.get_reservation(cfg.reservation)
    if reservation is None:
        raise ConfigError("vm.reservation", f"no reservation {name!r} in {owner}/{cfg.zone}",
                          f"`gcloud compute reservations list --project {owner}` shows their "
                          "names and zones; pass the name as RESERVATION / --reservation (another "
                          "project's as projects/PROJECT/reservations/NAME)")
    if owner != cfg.project:
        share = reservation.share_settings
        if not (share.share_type == "ORGANIZATION"
                or (share.share_type == "SPECIFIC_PROJECTS" and cfg.project in share.project_map)):
            raise ConfigError("vm.reservation", f"{cfg.reservation} is not shared with {cfg.project} "
                              f"(shareSettings.shareType {share.share_type or 'LOCAL'})",
                              f"ask the owner of {owner} to share it: `gcloud compute reservations update "
                              f"{name} --project={owner} --zone={cfg.zone} --add-share-with={cfg.project}`")
    if reservation.status not in ("", "READY"):
        raise ConfigError("vm.reservation", f"{cfg.reservation} is {reservation.status}, not READY",
                          "wait until `gcloud compute reservations describe` says READY (a reservation "
                          "from a future reservation is usable from its start time), or use another one")
    if "aggregate_reservation" in reservation:
        _check_chips(cfg, reservation.aggregate_reservation)
    elif "specific_reservation" in reservation:
        _check_vms(cfg, reservation.specific_reservation)
    else:
        raise ConfigError("vm.reservation", f"{cfg.reservation} reserves neither VMs "
                          "(specificReservation) nor TPU chips (aggregateReservation)",
                          f"use a reservation of {cfg.machine_type} VMs or of {_chips_of(cfg)}")
    compute.provisioning_model(cfg)   # decided (and kept for the insert) before anything exists


def _chips_of(cfg: VmConfig) -> str:
    """The chips an aggregate reservation must hold for the VM, as the fixes name them."""
    gen = generations.of_machine_type(cfg.machine_type)[0]
    return f"{gen.title} chips ({gen.compute.reservation_family})"


def _check_vms(cfg: VmConfig, specific: compute_v1.AllocationSpecificSKUReservation) -> None:
    """A specific reservation: VMs of one machine type, ``count`` of them, ``inUseCount`` taken."""
    reserved = specific.instance_properties.machine_type.rsplit("/", 1)[-1]
    if reserved and reserved != cfg.machine_type:
        raise ConfigError("vm.reservation", f"{cfg.reservation} reserves {reserved}, not "
                          f"{cfg.machine_type}", f"use a reservation of {cfg.machine_type} VMs")
    if specific.count - specific.in_use_count < 1:
        raise ConfigError("vm.reservation", f"{cfg.reservation} has no free VM ({specific.in_use_count}"
                          f" of {specific.count} VMs in use)", FULL_FIX)


def _check_chips(cfg: VmConfig, aggregate: compute_v1.AllocationAggregateReservation) -> None:
    """An aggregate (TPU) reservation: chips of one VM family (the generation's ``reservation_family``,
    conf/generations.yaml), counted in ``reservedResources`` and ``inUseResources``; a VM takes its machine
    type's chips (8 for a v6e-8)."""
    gen, chips = generations.of_machine_type(cfg.machine_type)
    family = gen.machine.family
    if aggregate.vm_family != gen.compute.reservation_family:
        raise ConfigError("vm.reservation", f"{cfg.reservation} reserves {aggregate.vm_family} chips, "
                          f"not {family} ones ({cfg.machine_type})", f"use a reservation of {_chips_of(cfg)}")

    def count(resources: Iterable[compute_v1.AllocationAggregateReservationReservedResourceInfo]) -> int:
        return sum(r.accelerator.accelerator_count for r in resources
                   if r.accelerator.accelerator_type.rsplit("/", 1)[-1] == family)

    total, used = count(aggregate.reserved_resources), count(aggregate.in_use_resources)
    if total - used < chips:
        raise ConfigError("vm.reservation", f"{cfg.reservation} has no free VM ({used} of {total} chips "
                          f"in use; a {cfg.machine_type} takes {chips})", FULL_FIX)
