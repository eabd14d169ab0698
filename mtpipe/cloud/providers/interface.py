"""What the lifecycle needs from a cloud, and the words it speaks: a provider (mtpipe.cloud.providers.gcp:
Compute Engine) implements :class:`Provider`, raises these errors and reports these statuses.

A second provider is a folder next to gcp/ that implements the same protocol with the same errors.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from mtpipe.cloud.settings.vm_config import VmConfig


class ProviderError(RuntimeError):
    """A cloud's failure, worded for the user (what failed and how to fix it); the errors below are its
    kinds, and a provider words its own detail as a subclass (Google's: gcp.api_errors.GcpError)."""


class MaxRunDurationRefused(ProviderError):
    """Compute refused ``scheduling.maxRunDuration`` for a reservation-bound VM."""


SETTLING = ("PROVISIONING", "STAGING")   # a VM's status while Compute still creates it
# A Flex-start VM's status while Dynamic Workload Scheduler looks for its capacity (compute.v1 Instance.status):
# the insert's operation is DONE, the VM exists, runs nothing and gets no external IP yet.
WAITING_FOR_CAPACITY = "PENDING"


class CapacityError(ProviderError):
    """The zone has no free machine of this type now (a stockout): the same request may work later.
    ``region_wide``: the whole region has none (Compute's REGION_STOCKOUT_CODES)."""

    def __init__(self, message: str, region_wide: bool = False) -> None:
        super().__init__(message)
        self.region_wide = region_wide


class TryAgain(CapacityError):
    """A transient refusal (Compute's RETRY_CODES): the same insert in the same zone may work after a short wait."""


class QuotaExceeded(ProviderError):
    """A quota of the project is spent (Compute's TPU quotas are regional: another region may have
    room); ``global_quota``: one of the ..._ALL_REGIONS quotas, which no other zone escapes;
    ``per_zone``: a quota of this zone only (the Cloud TPU API's), which the next zone of the same
    region may still have."""

    def __init__(self, message: str, global_quota: bool, per_zone: bool = False) -> None:
        super().__init__(message)
        self.global_quota, self.per_zone = global_quota, per_zone


class Everywhere(NamedTuple):
    """What a route found in every zone of a project (`doit vm_down` with nothing recorded and no zone):
    the VMs carrying the labels asked for, by zone, and each zone it could not read, with why."""

    vms: dict[str, list[Any]]
    unread: list[str]


def region(zone: str) -> str:
    """The region of a zone: us-east5-b -> us-east5."""
    return zone.rsplit("-", 1)[0]


class Provider(Protocol):
    """What the lifecycle needs from a cloud. Instances have ``status`` (``RUNNING`` while usable)
    and ``creation_timestamp`` (ISO 8601) and ``labels``; each call waits until the cloud has done it.
    ``create_vm`` raises :class:`CapacityError` when the zone has no such machine
    free now, :class:`QuotaExceeded` when the project's quota is spent, and may
    return a VM whose status is ``PENDING`` (a Flex-start VM waiting for capacity:
    :meth:`mtpipe.cloud.lifecycle.creation.Creation.await_capacity`); after it failed or was
    interrupted, ``settle`` waits until the cloud says whether the VM exists, and
    ``delete_orphan_disk`` deletes a boot disk the VM left; ``proxy_command`` is the command SSH runs to
    reach the VM (None: straight to its address). ``zone``: the zone it works in."""

    zone: str

    def get_instance(self, name: str) -> Any | None: ...
    def list_instances(self, labels: dict[str, str]) -> list[Any]: ...
    def create_vm(self, cfg: VmConfig, public_key: str, labels: dict[str, str]) -> Any: ...
    def provisioning_model(self, cfg: VmConfig) -> str: ...
    def settle(self, name: str, timeout_s: float) -> Any | None: ...
    def delete_instance(self, name: str) -> bool: ...
    def delete_orphan_disk(self, name: str) -> bool: ...
    def open_ssh(self, cfg: VmConfig, labels: dict[str, str]) -> bool: ...
    def proxy_command(self, cfg: VmConfig) -> str | None: ...
    def get_firewall(self, name: str) -> Any | None: ...
    def delete_firewall(self, name: str) -> bool: ...
    def address(self, instance: Any) -> str | None: ...
    def describe(self, instance: Any) -> tuple[str, str, int]: ...
    def zones_offering(self, machine_type: str) -> list[str]: ...
