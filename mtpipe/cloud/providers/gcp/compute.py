"""Compute Engine VM + firewall lifecycle with google-cloud-compute: the lifecycle's provider
(mtpipe.cloud.providers.interface.Provider) and the reads the checks before spending make.

Every long-running call is waited on explicitly with Zone/GlobalOperationsClient.wait:
`ExtendedOperation.result()` polls through a client that ignores `client_options` (and so would
call the real Google endpoint from a test); every client is made with api_errors.client_kwargs.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import compute_v1

from mtpipe.cloud.providers import interrupts
from mtpipe.cloud.providers.gcp import ssh_route
from mtpipe.cloud.providers.gcp.api_errors import (QUOTA_REASONS, GcpError, PermissionDenied, client_kwargs, explained,
                                                   quota_problem)
from mtpipe.cloud.providers.gcp.bodies import (PROVISIONING_MODELS, firewall_body, instance_body, label_filter,
                                               reservation_path)
from mtpipe.cloud.providers.interface import (SETTLING, CapacityError, Everywhere, MaxRunDurationRefused, Provider,
                                              ProviderError, TryAgain, region)
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig

# Operation error codes that mean "no such machine free in this zone now: try another zone, or this one
# later": those for which SkyPilot's failover (FailoverCloudErrorHandlerV2._gcp_handler in
# sky/backends/cloud_vm_ray_backend.py, citing Compute's "Troubleshooting VM creation" page) blocks the
# zone; it has seen UNSUPPORTED_OPERATION when a Spot VM is preempted while it is created.
STOCKOUT_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                  "UNSUPPORTED_OPERATION", "insufficientCapacity",
                  "RESOURCE_POOL_EXHAUSTED"}   # treated as full by other public code, as SkyPilot treats the zone's
# The whole region has none free: its other zones are skipped too (public failover code treats it so).
REGION_STOCKOUT_CODES = {"REGION_RESOURCE_POOL_EXHAUSTED"}
# Transient answers worth the same request again in the same zone after a wait (SkyPilot handles both:
# RESOURCE_NOT_READY among its zone errors, RESOURCE_OPERATION_RATE_EXCEEDED apart).
RETRY_CODES = {"RESOURCE_NOT_READY", "RESOURCE_OPERATION_RATE_EXCEEDED"}


class ComputeZone:
    """A project's zone in Compute Engine: its clients, and what is read there before anything is created
    (machine types, reservations and their provisioning model, networks, firewall rules, Cloud Routers,
    the project's metadata: what the checks before spending ask, mtpipe.cloud.checks)."""

    def __init__(self, project: str, zone: str, timeout_s: float = 900) -> None:
        kw = client_kwargs()
        self.project, self.zone, self.timeout_s = project, zone, timeout_s
        self.inserting: dict[str, str] = {}   # VM name -> its insert operation, until DONE
        self.instances = compute_v1.InstancesClient(**kw)
        self.disks = compute_v1.DisksClient(**kw)
        self.firewalls = compute_v1.FirewallsClient(**kw)
        self.machine_types = compute_v1.MachineTypesClient(**kw)
        self.reservations = compute_v1.ReservationsClient(**kw)
        self.future_reservations = compute_v1.FutureReservationsClient(**kw)
        self.networks = compute_v1.NetworksClient(**kw)
        self.subnetworks = compute_v1.SubnetworksClient(**kw)
        self.routers = compute_v1.RoutersClient(**kw)
        self.projects = compute_v1.ProjectsClient(**kw)
        self.zone_ops = compute_v1.ZoneOperationsClient(**kw)
        self.global_ops = compute_v1.GlobalOperationsClient(**kw)
        self._calendar: dict[str, bool] = {}   # reservation -> in calendar mode (asked once)

    def get_machine_type(self, name: str) -> compute_v1.MachineType | None:
        """The machine type in this zone; None when the zone does not offer it."""
        with explained(f"reading machine type {name} in {self.zone}", self.project):
            try:
                return self.machine_types.get(project=self.project, zone=self.zone, machine_type=name)
            except gexc.NotFound:
                return None

    def zones_offering(self, name: str) -> list[str]:
        """Every zone of the project that offers machine type ``name`` (machineTypes.aggregatedList)."""
        with explained(f"listing the zones that offer {name}", self.project):
            pages = self.machine_types.aggregated_list(request=compute_v1.AggregatedListMachineTypesRequest(
                project=self.project, filter=f"name = {name}"))
            return sorted(scope.removeprefix("zones/") for scope, listed in pages
                          if any(t.name == name for t in listed.machine_types))

    def get_reservation(self, reservation: str) -> compute_v1.Reservation | None:
        """``reservation`` in this zone: NAME, or ``projects/OTHER/reservations/NAME`` (a shared one:
        the client's path template refuses that form, so it is read with project=OTHER); None when
        it does not exist."""
        project, name = reservation_path(reservation, self.project)
        with explained(f"reading reservation {name} of {project} in {self.zone}"):
            try:
                return self.reservations.get(project=project, zone=self.zone, reservation=name)
            except gexc.NotFound:
                return None

    def calendar_mode(self, reservation: str) -> bool:
        """Whether a future reservation in calendar mode delivered ``reservation``: one of its owner
        project's future reservations in this zone has reservationMode CALENDAR and names it
        (``reservationName``, or among ``status.autoCreatedReservations``). The Reservation resource
        does not say (compute v1 has reservationMode on FutureReservation only); asked once."""
        if reservation not in self._calendar:
            project, name = reservation_path(reservation, self.project)
            try:
                with explained(f"listing the future reservations of {project} in {self.zone} (to tell "
                               f"whether reservation {name} is in calendar mode)", project):
                    listed = list(self.future_reservations.list(project=project, zone=self.zone))
            except ProviderError as err:
                raise GcpError(f"{err}; or set reservation_model in conf/vm.yaml (bound: the reservation "
                               "came from a future reservation in calendar mode; standard: any other), "
                               "which needs no lookup") from err
            self._calendar[reservation] = any(
                future.reservation_mode == "CALENDAR"
                and (future.reservation_name == name
                     or any(url.rsplit("/", 1)[-1] == name for url in future.status.auto_created_reservations))
                for future in listed)
        return self._calendar[reservation]

    def provisioning_model(self, cfg: Any) -> str:
        """The provisioningModel of the VM ``cfg`` describes. A reservation's VMs are RESERVATION_BOUND
        when the reservation is in calendar mode (reservation_model ``bound``, or ``auto`` and
        :meth:`calendar_mode`), else STANDARD; Compute's docs name calendar-mode (and AI
        Hypercomputer) reservations as the ones reservation-bound VMs consume (docs/tpu-vm.md)."""
        if cfg.provisioning != "reservation":
            return PROVISIONING_MODELS[cfg.provisioning]
        bound = cfg.reservation_model == "bound" or (
            cfg.reservation_model == "auto" and self.calendar_mode(cfg.reservation))
        return "RESERVATION_BOUND" if bound else "STANDARD"

    def get_network(self, name: str) -> compute_v1.Network | None:
        with explained(f"reading network {name}", self.project):
            try:
                return self.networks.get(project=self.project, network=name)
            except gexc.NotFound:
                return None

    def network_names(self) -> list[str]:
        with explained("listing the networks", self.project):
            return sorted(n.name for n in self.networks.list(project=self.project))

    def get_subnetwork(self, name: str) -> compute_v1.Subnetwork | None:
        """Subnetwork ``name`` of the zone's region; None when there is none."""
        where = region(self.zone)
        with explained(f"reading subnetwork {name} in {where}", self.project):
            try:
                return self.subnetworks.get(project=self.project, region=where, subnetwork=name)
            except gexc.NotFound:
                return None

    def subnetwork_names(self, network: str) -> list[str]:
        """The subnetworks of ``network`` in the zone's region."""
        where = region(self.zone)
        with explained(f"listing the subnetworks of {where}", self.project):
            return sorted(s.name for s in self.subnetworks.list(project=self.project, region=where)
                          if s.network.rsplit("/", 1)[-1] == network)

    def list_firewalls(self, network: str) -> list[compute_v1.Firewall]:
        """The firewall rules of ``network`` (firewalls.list, the network picked out here)."""
        with explained(f"listing the firewall rules of network {network}", self.project):
            return [r for r in self.firewalls.list(project=self.project)
                    if r.network.rsplit("/", 1)[-1] == network]

    def list_routers(self) -> list[compute_v1.Router]:
        """The Cloud Routers of the zone's region (their Cloud NAT gateways)."""
        where = region(self.zone)
        with explained(f"listing the Cloud Routers of {where}", self.project):
            return list(self.routers.list(project=self.project, region=where))

    def project_metadata(self) -> dict[str, str]:
        """The project's metadata (projects.get commonInstanceMetadata): what every VM inherits."""
        with explained(f"reading the metadata of project {self.project}", self.project):
            project = self.projects.get(project=self.project)
        return {item.key: item.value for item in project.common_instance_metadata.items}

    def default_service_account(self) -> str:
        """The project's Compute default service account (projects.get's defaultServiceAccount): what a
        VM with conf/vm.yaml's ``service_account: default`` runs as."""
        with explained(f"reading project {self.project} (its Compute default service account)", self.project):
            return self.projects.get(project=self.project).default_service_account


class Compute(ComputeZone):
    """The few Compute Engine calls the VM lifecycle needs, each waited on until DONE."""

    def in_zone(self, zone: str) -> Compute:
        """The same calls for another zone of the project."""
        return Compute(self.project, zone, self.timeout_s)

    def get_instance(self, name: str) -> compute_v1.Instance | None:
        with explained(f"reading VM {name}", self.project):
            try:
                return self.instances.get(project=self.project, zone=self.zone, instance=name)
            except gexc.NotFound:
                return None

    def create_instance(self, body: dict, timeout_s: float | None = None) -> compute_v1.Instance:
        """Insert the VM and wait until the operation is DONE (at most ``timeout_s``, else
        operation_timeout_s); return the instance.

        Ctrl-C (or SIGTERM, SIGHUP) does not tear the insert request itself: it is delivered once
        Compute has answered, so the operation is known (``self.inserting``) and :meth:`settle` can
        follow it after an interrupted or timed-out wait."""
        name = body["name"]
        with explained(f"creating VM {name}", self.project):
            with interrupts.deferred():
                op = self.instances.insert(project=self.project, zone=self.zone,
                                           instance_resource=compute_v1.Instance(body))
                self.inserting[name] = op.name
            self._wait(op.name, f"creating VM {name}", zonal=True, timeout_s=timeout_s)
            del self.inserting[name]
        instance = self.get_instance(name)
        if instance is None:
            raise GcpError(f"VM {name} vanished right after it was created")
        return instance

    def settle(self, name: str, timeout_s: float) -> compute_v1.Instance | None:
        """After an insert that failed, timed out or was interrupted: wait (at most ``timeout_s``)
        until Compute has settled whether VM ``name`` exists: its insert operation DONE, when the
        request went out, and the VM past PROVISIONING / STAGING. Returns the VM, None when there
        is none (or it still is being created when the time is up)."""
        deadline = time.monotonic() + timeout_s
        operation = self.inserting.pop(name, None)
        if operation:
            with contextlib.suppress(ProviderError):   # a failed insert: what it left is looked at below
                self._wait(operation, f"creating VM {name}", zonal=True, timeout_s=timeout_s)
        while True:
            instance = self.get_instance(name)
            if instance is None or instance.status not in SETTLING or time.monotonic() > deadline:
                return instance
            time.sleep(1)

    def list_instances(self, labels: dict[str, str]) -> list[compute_v1.Instance]:
        """The VMs of this zone that carry every one of ``labels`` (instances.list, filtered)."""
        with explained(f"listing the VMs labelled {label_filter(labels)} in {self.zone}", self.project):
            return list(self.instances.list(request=compute_v1.ListInstancesRequest(
                project=self.project, zone=self.zone, filter=label_filter(labels))))

    def delete_instance(self, name: str) -> bool:
        """Delete the VM; False when it was already gone."""
        with explained(f"deleting VM {name}"):
            try:
                op = self.instances.delete(project=self.project, zone=self.zone, instance=name)
            except gexc.NotFound:
                return False
            self._wait(op.name, f"deleting VM {name}", zonal=True)
        return True

    def delete_orphan_disk(self, name: str) -> bool:
        """Delete disk ``name`` of this zone when no VM uses it (the boot disk of a VM whose insert
        failed is named like the VM); False when there is none, or a VM uses it."""
        with explained(f"deleting disk {name} in {self.zone}", self.project):
            try:
                disk = self.disks.get(project=self.project, zone=self.zone, disk=name)
            except gexc.NotFound:
                return False
            if disk.users:
                return False
            op = self.disks.delete(project=self.project, zone=self.zone, disk=name)
            self._wait(op.name, f"deleting disk {name}", zonal=True)
        return True

    def get_firewall(self, name: str) -> compute_v1.Firewall | None:
        with explained(f"reading firewall rule {name}"):
            try:
                return self.firewalls.get(project=self.project, firewall=name)
            except gexc.NotFound:
                return None

    def create_firewall(self, body: dict) -> bool:
        """Create the rule; False when it already existed."""
        with explained(f"creating firewall rule {body['name']}"):
            try:
                op = self.firewalls.insert(project=self.project,
                                           firewall_resource=compute_v1.Firewall(body))
            except gexc.Conflict:
                return False
            self._wait(op.name, f"creating firewall rule {body['name']}", zonal=False)
        return True

    def delete_firewall(self, name: str) -> bool:
        """Delete the rule; False when it was already gone."""
        with explained(f"deleting firewall rule {name}"):
            try:
                op = self.firewalls.delete(project=self.project, firewall=name)
            except gexc.NotFound:
                return False
            self._wait(op.name, f"deleting firewall rule {name}", zonal=False)
        return True

    # ---- the VM lifecycle's provider interface (mtpipe.cloud.providers.interface.Provider)

    def create_vm(self, cfg: Any, public_key: str, labels: dict[str, str]) -> compute_v1.Instance:
        """Create the VM ``cfg.name`` describes, admitting ``public_key`` over SSH. A reservation-bound
        VM whose ``maxRunDuration`` Compute refuses raises MaxRunDurationRefused (nothing created). A
        Flex-start insert's operation is given flex_start.request_valid_for_s more; it may end with the
        VM PENDING (WAITING_FOR_CAPACITY), which the caller waits on (mtpipe.cloud.lifecycle)."""
        model = self.provisioning_model(cfg)
        body = instance_body(cfg, cfg.name, public_key, labels, model)
        wait = float(cfg.flex_start.request_valid_for_s) if model == "FLEX_START" else 0
        try:
            return self.create_instance(body, self.timeout_s + wait)
        except ProviderError as err:
            if model == "RESERVATION_BOUND" and "max_run_duration" in body["scheduling"] \
                    and "maxRunDuration" in str(err):
                self.inserting.pop(cfg.name, None)
                raise MaxRunDurationRefused(str(err)) from err
            raise

    def open_ssh(self, cfg: Any, labels: dict[str, str]) -> bool:
        """Create the firewall rule that lets SSH reach the VM unless a rule of the network admits it
        already (ssh_route.admitting); False when none was created. Without known sources (SSH
        straight from this machine) the checks before spending found a rule open to 0.0.0.0/0."""
        sources = ssh_route.sources(cfg)
        if sources is None or ssh_route.admitting(self.list_firewalls(cfg.network), sources, [cfg.name],
                                                  cfg.service_account):
            return False
        try:
            return self.create_firewall(firewall_body(cfg, cfg.name, cfg.firewall.name, labels, sources))
        except PermissionDenied as err:
            raise GcpError(
                f"creating firewall rule {cfg.firewall.name}: permission denied. No firewall rule of network "
                f"{cfg.network} admits tcp:22 from {', '.join(sources)} to VM {cfg.name}, and you may not "
                "create one (compute.firewalls.create, in roles/compute.securityAdmin). Fix: ask for that "
                f"role, or for a rule: gcloud compute firewall-rules create ALLOW-SSH --project {self.project} "
                f"--network {cfg.network} --direction INGRESS --allow tcp:22 --source-ranges "
                f"{','.join(sources)} (all VMs, or --target-tags {cfg.name})") from err

    @staticmethod
    def proxy_command(cfg: Any) -> str | None:
        """SSH's way to the VM: ssh_route.proxy_command (an IAP tunnel without an external IP)."""
        return ssh_route.proxy_command(cfg)

    @staticmethod
    def address(instance: compute_v1.Instance) -> str | None:
        return external_ip(instance)

    @staticmethod
    def describe(instance: compute_v1.Instance) -> tuple[str, str, int]:
        """(machine type, provisioning model, time limit in s or 0) of a VM."""
        return (instance.machine_type.rsplit("/", 1)[-1], instance.scheduling.provisioning_model,
                instance.scheduling.max_run_duration.seconds)

    def _wait(self, operation: str, what: str, zonal: bool, timeout_s: float | None = None) -> None:
        """Call operations.wait until DONE (at most ``timeout_s``, else operation_timeout_s); raise
        GcpError with the operation's errors if any."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            if zonal:
                op = self.zone_ops.wait(project=self.project, zone=self.zone, operation=operation)
            else:
                op = self.global_ops.wait(project=self.project, operation=operation)
            if op.status == compute_v1.Operation.Status.DONE:
                break
            if time.monotonic() > deadline:
                raise GcpError(f"{what}: operation {operation} not DONE after {timeout_s:g} s; "
                               "check the Cloud console, then rerun")
        codes = {e.code for e in op.error.errors}
        errors = [f"{e.code}: {e.message}" for e in op.error.errors]
        if codes & RETRY_CODES:
            raise TryAgain(f"{what}: Compute is not ready for it in {self.zone} ({'; '.join(errors)})")
        if codes & REGION_STOCKOUT_CODES:
            raise CapacityError(f"{what}: no capacity in region {region(self.zone)} now ({'; '.join(errors)})",
                                region_wide=True)
        if codes & STOCKOUT_CODES:
            raise CapacityError(f"{what}: no capacity in {self.zone} now ({'; '.join(errors)})")
        if codes & QUOTA_REASONS:
            raise quota_problem(what, "; ".join(errors), self.project)
        if errors:
            raise GcpError(f"{what} failed: {'; '.join(errors)}")


def external_ip(instance: compute_v1.Instance) -> str | None:
    """The VM's external (NAT) address, if it has one yet."""
    for nic in instance.network_interfaces:
        for ac in nic.access_configs:
            if ac.nat_i_p:
                return ac.nat_i_p
    return None


def labelled_everywhere(project: str, labels: dict[str, str]) -> Everywhere:
    """The VMs of every zone of ``project`` that carry every one of ``labels``, by zone (one
    instances.aggregatedList, filtered as :meth:`Compute.list_instances` filters one zone's), and the
    zones its answer says were unreachable."""
    instances = compute_v1.InstancesClient(**client_kwargs())
    with explained(f"listing the VMs labelled {label_filter(labels)} in every zone", project):
        pages = list(instances.aggregated_list(request=compute_v1.AggregatedListInstancesRequest(
            project=project, filter=label_filter(labels))))
    return Everywhere({scope.removeprefix("zones/"): list(listed.instances) for scope, listed in pages
                       if listed.instances},
                      [f"{scope.removeprefix('zones/')} ({listed.warning.message})" for scope, listed in pages
                       if listed.warning.code == "UNREACHABLE"])


def compute_engine(cfg: VmConfig) -> Provider:
    """The Compute Engine zone ``cfg`` names."""
    vm_config.require(cfg, "project", "zone")
    return Compute(cfg.project, cfg.zone, float(cfg.operation_timeout_s))
