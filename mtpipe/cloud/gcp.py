"""Compute Engine VM + firewall lifecycle with google-cloud-compute.

Every long-running call is waited on explicitly with Zone/GlobalOperationsClient.wait:
`ExtendedOperation.result()` polls through a client that ignores `client_options` (and so would
call the real Google endpoint from a test). `MTPIPE_COMPUTE_ENDPOINT` points every client at another
endpoint (the loopback fake in tests); only then, and only without GOOGLE_APPLICATION_CREDENTIALS,
anonymous credentials are used.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any

import google.auth
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from mtpipe.cloud import idle_watch, interrupts, ssh_route

ENDPOINT_ENV = "MTPIPE_COMPUTE_ENDPOINT"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
CREDENTIALS_FIX = (
    "run `gcloud auth application-default login` (as a service account: add "
    "--impersonate-service-account=SA, which needs no key file) and retry"
)


class GcpError(RuntimeError):
    """A Compute Engine failure, worded for the user (what failed and how to fix it)."""


class PermissionDenied(GcpError):
    """Google answered 403 for a missing permission (not a quota, not a disabled API)."""


class MaxRunDurationRefused(GcpError):
    """Compute refused ``scheduling.maxRunDuration`` for a reservation-bound VM."""


QUOTA_NAME = re.compile(r"Quota '([^']+)' exceeded")
QUOTA_REASONS = {"quotaExceeded", "rateLimitExceeded", "QUOTA_EXCEEDED"}
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
SETTLING = ("PROVISIONING", "STAGING")   # a VM's status while Compute still creates it
# A Flex-start VM's status while Dynamic Workload Scheduler looks for its capacity (compute.v1 Instance.status):
# the insert's operation is DONE, the VM exists, runs nothing and gets no external IP yet.
WAITING_FOR_CAPACITY = "PENDING"


class CapacityError(GcpError):
    """The zone has no free machine of this type now (a stockout): the same request may work later.
    ``region_wide``: the whole region has none (REGION_STOCKOUT_CODES)."""

    def __init__(self, message: str, region_wide: bool = False) -> None:
        super().__init__(message)
        self.region_wide = region_wide


class TryAgain(CapacityError):
    """A transient refusal (RETRY_CODES): the same insert in the same zone may work after a short wait."""


class QuotaExceeded(GcpError):
    """A quota of the project is spent (Compute's TPU quotas are regional: another region may have
    room); ``global_quota``: one of the ..._ALL_REGIONS quotas, which no other zone escapes."""

    def __init__(self, message: str, global_quota: bool) -> None:
        super().__init__(message)
        self.global_quota = global_quota


def quota_page(project: str | None) -> str:
    """Where a project's quotas are raised."""
    return f"https://console.cloud.google.com/iam-admin/quotas?project={project}" if project else \
        "the Cloud console's IAM & Admin > Quotas page"


def quota_problem(action: str, message: str, project: str | None) -> QuotaExceeded:
    """A quota error that names the quota and where to raise it (Compute answers 403, or an operation
    error QUOTA_EXCEEDED, for quota as well as for permissions)."""
    found = QUOTA_NAME.search(message)
    name = found.group(1) if found else "the quota in the message"
    return QuotaExceeded(f"{action}: quota exceeded ({message}); request more {name} at {quota_page(project)} "
                         f"(filter by {name}), or use another region or a reservation",
                         global_quota=name.endswith("ALL_REGIONS"))


# What a disabled API's 403 names (google.rpc.ErrorInfo metadata.service), as `gcloud services list` does.
SERVICE_TITLES = {"compute.googleapis.com": "Compute Engine API", "oslogin.googleapis.com": "Cloud OS Login API",
                  "orgpolicy.googleapis.com": "Organization Policy API",
                  "cloudresourcemanager.googleapis.com": "Cloud Resource Manager API",
                  "iap.googleapis.com": "Cloud Identity-Aware Proxy API", "storage.googleapis.com": "Cloud Storage API",
                  "serviceusage.googleapis.com": "Service Usage API",
                  "iam.googleapis.com": "Identity and Access Management (IAM) API"}
DISABLED_URL = re.compile(r"apis/api/(?P<service>[a-z0-9.-]+)/")


def error_info(error: gexc.GoogleAPICallError) -> tuple[str | None, dict[str, str]]:
    """(reason, metadata) of the google.rpc.ErrorInfo among an error's details. Over REST they are
    JSON dicts, on which api_core's own ``error.reason`` raises AttributeError."""
    for detail in error.details or ():
        if isinstance(detail, dict) and detail.get("@type", "").endswith("google.rpc.ErrorInfo"):
            return detail.get("reason"), dict(detail.get("metadata") or {})
        if type(detail).__name__ == "ErrorInfo":
            return detail.reason, dict(detail.metadata)
    return None, {}


def disabled_service(error: gexc.GoogleAPICallError) -> str | None:
    """The API a 403 says is disabled (or was never enabled) in the project, or None: the details'
    ErrorInfo with reason SERVICE_DISABLED, or Compute's older errors[].reason accessNotConfigured."""
    reason, metadata = error_info(error)
    if reason == "SERVICE_DISABLED":
        return metadata.get("service") or "the API"
    if any(isinstance(e, dict) and e.get("reason") == "accessNotConfigured" for e in error.errors or []):
        found = DISABLED_URL.search(error.message or "")
        return found["service"] if found else "the API"
    return None


def service_disabled_problem(action: str, service: str, error: gexc.GoogleAPICallError,
                             project: str | None) -> GcpError:
    """The error for a disabled API: which one, where, and the command that enables it."""
    consumer = error_info(error)[1].get("consumer", "").removeprefix("projects/")
    where = project or consumer or "PROJECT"
    title = SERVICE_TITLES.get(service, service)
    return GcpError(f"{action}: the {title} is disabled in project {where}. Fix: gcloud services enable "
                    f"{service} --project {where} (needs roles/serviceusage.serviceUsageAdmin; allow a "
                    "minute before retrying)")


def _is_quota(error: gexc.GoogleAPICallError) -> bool:
    reasons = {e.get("reason") for e in error.errors or [] if isinstance(e, dict)} | {error_info(error)[0]}
    return bool(reasons & QUOTA_REASONS) or QUOTA_NAME.search(error.message or "") is not None


@contextlib.contextmanager
def explained(action: str, project: str | None = None) -> Iterator[None]:
    """Turn google.auth / google.api_core errors raised while doing `action` into GcpError."""
    try:
        yield
    except auth_exc.DefaultCredentialsError as e:
        raise GcpError(f"{action}: no usable Google credentials ({e}); {CREDENTIALS_FIX}") from e
    except (auth_exc.RefreshError, auth_exc.OAuthError) as e:
        raise GcpError(
            f"{action}: Google credentials expired or revoked ({e}); {CREDENTIALS_FIX}") from e
    except gexc.Unauthorized as e:
        raise GcpError(f"{action}: Google rejected the credentials ({e.message}); "
                       f"{CREDENTIALS_FIX}") from e
    except gexc.Forbidden as e:
        if _is_quota(e):
            raise quota_problem(action, e.message, project) from e
        if service := disabled_service(e):
            raise service_disabled_problem(action, service, e, project) from e
        raise PermissionDenied(
            f"{action}: permission denied ({e.message}); grant roles/compute.instanceAdmin.v1 (or "
            "roles/compute.admin) and roles/iam.serviceAccountUser on the project") from e
    except gexc.GoogleAPICallError as e:
        raise GcpError(f"{action}: {e.code} {e.message}") from e


def client_kwargs() -> dict[str, Any]:
    """Credentials and endpoint shared by every Compute client."""
    endpoint = os.environ.get(ENDPOINT_ENV)
    with explained("loading Google credentials"):
        if endpoint and not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
            credentials: Any = AnonymousCredentials()
        else:
            credentials, _ = google.auth.default(scopes=[SCOPE])
    kwargs: dict[str, Any] = {"credentials": credentials}
    if endpoint:
        kwargs["client_options"] = {"api_endpoint": endpoint}
    return kwargs


# reservation: decided per reservation (Compute.provisioning_model)
PROVISIONING_MODELS = {"spot": "SPOT", "on-demand": "STANDARD", "flex-start": "FLEX_START"}
# A reservation named as reservationAffinity.values names a shared one: another project's.
SHARED_RESERVATION = re.compile(r"projects/(?P<project>[^/]+)/reservations/(?P<name>[^/]+)")


def reservation_path(reservation: str, project: str) -> tuple[str, str]:
    """(owner project, name) of a reservation as ``reservationAffinity.values`` names it: NAME, in
    ``project``, or ``projects/OTHER/reservations/NAME``, a reservation OTHER shares with ``project``."""
    found = SHARED_RESERVATION.fullmatch(reservation)
    return (found["project"], found["name"]) if found else (project, reservation)


def scheduling(cfg: Any, model: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The `scheduling` and `reservation_affinity` fields of a VM whose provisioningModel is `model`
    (:meth:`Compute.provisioning_model`).

    reservation: the VM consumes the named reservation (SPECIFIC_RESERVATION; a shared one keeps the
    projects/OTHER/reservations/NAME form), as a RESERVATION_BOUND VM when the reservation is in
    calendar mode, else as a STANDARD one; spot: a Spot VM (`--provisioning-model=SPOT`), which Compute
    deletes when it preempts it (a preempted Spot VM cannot be restarted, only deleted and recreated);
    on-demand: a STANDARD VM; flex-start: a FLEX_START VM (Dynamic Workload Scheduler), which consumes
    no reservation and runs at most 7 days, up to its maxRunDuration. Every mode terminates on host
    maintenance and never restarts by itself; `maxRunDuration` deletes the VM (sent for RESERVATION_BOUND
    too, where Compute's docs do not say whether it is honoured: docs/tpu-vm.md).
    """
    fields: dict[str, Any] = {
        "provisioning_model": model,                     # --provisioning-model
        "on_host_maintenance": "TERMINATE",              # --maintenance-policy
        "automatic_restart": False,
    }
    if model != "STANDARD" or cfg.max_run_duration_s:
        fields["instance_termination_action"] = "DELETE"  # --instance-termination-action
    if cfg.max_run_duration_s:
        fields["max_run_duration"] = {"seconds": int(cfg.max_run_duration_s)}
    affinity = None
    if cfg.provisioning == "reservation":               # --reservation-affinity=specific
        affinity = {"consume_reservation_type": "SPECIFIC_RESERVATION",
                    "key": "compute.googleapis.com/reservation-name", "values": [cfg.reservation]}
    elif model == "FLEX_START":                         # --reservation-affinity=none
        affinity = {"consume_reservation_type": "NO_RESERVATION"}
    return fields, affinity


def region(zone: str) -> str:
    """The region of a zone: us-east5-b -> us-east5."""
    return zone.rsplit("-", 1)[0]


def network_interface(cfg: Any) -> dict:
    """The VM's network interface: ``network``, ``subnetwork`` (regional; null: the auto-mode
    network's subnetwork of the region), an external IP (``external_ip``) as gcloud adds by default."""
    nic: dict[str, Any] = {"network": f"global/networks/{cfg.network}"}
    if cfg.subnetwork:
        nic["subnetwork"] = f"regions/{region(cfg.zone)}/subnetworks/{cfg.subnetwork}"
    if cfg.external_ip:
        nic["access_configs"] = [{"name": "External NAT", "type_": "ONE_TO_ONE_NAT"}]
    return nic


def ssh_metadata(cfg: Any, ssh_public_key: str) -> list[dict[str, str]]:
    """The instance metadata that admits our key: with OS Login (``ssh.os_login`` true, as the checks
    before spending decide it) ``enable-oslogin=TRUE`` (the key is in the caller's OS Login profile,
    where the VM looks for it); else the key in ``ssh-keys`` for ``ssh.user``."""
    if cfg.ssh.os_login is True:
        return [{"key": "enable-oslogin", "value": "TRUE"}]
    return [{"key": "ssh-keys", "value": f"{cfg.ssh.user}:{ssh_public_key}"}]


# Machine types Compute creates only with one thread per physical core (`--threads-per-core=1`,
# advancedMachineFeatures.threadsPerCore): the 8-chip v6e VM. SkyPilot sends it for this type ("CT6e
# 8-chip VMs require single-threaded cores", sky/clouds/gcp.py); docs/tpu-vm.md, "Decisions".
SINGLE_THREADED = frozenset({"ct6e-standard-8t"})


def idle_metadata(cfg: Any) -> list[dict[str, str]]:
    """The startup script that deletes the VM once idle (mtpipe.cloud.idle_watch; none with
    ``idle.delete_after_s: 0``)."""
    if not cfg.idle.delete_after_s:
        return []
    host = str(cfg.run.env.get("GCE_METADATA_HOST") or idle_watch.METADATA_HOST)
    compute = os.environ.get(ENDPOINT_ENV) or idle_watch.COMPUTE_URL
    return [{"key": "startup-script", "value": idle_watch.startup_script(cfg.idle, host, compute)}]


def instance_body(cfg: Any, name: str, ssh_public_key: str, labels: dict[str, str], model: str) -> dict:
    """The instances.insert body: the tutorial's `gcloud compute instances create` flags + safety;
    `model` is the VM's provisioningModel (:meth:`Compute.provisioning_model`)."""
    fields, affinity = scheduling(cfg, model)
    body = {
        "name": name,
        "machine_type": f"zones/{cfg.zone}/machineTypes/{cfg.machine_type}",
        "disks": [{
            "boot": True,
            "auto_delete": True,
            "initialize_params": {
                "source_image":
                    f"projects/{cfg.image_project}/global/images/family/{cfg.image_family}",
                "disk_size_gb": int(cfg.boot_disk_gb),
                "disk_type": f"zones/{cfg.zone}/diskTypes/{cfg.boot_disk_type}",
            },
        }],
        "network_interfaces": [network_interface(cfg)],
        "tags": {"items": [name]},                   # --tags=NAME (the firewall rule's target)
        "scheduling": fields,
        "service_accounts": [{"email": cfg.service_account, "scopes": list(cfg.scopes)}],
        "labels": labels,
        "metadata": {"items": ssh_metadata(cfg, ssh_public_key) + idle_metadata(cfg)},
    }
    if affinity:
        body["reservation_affinity"] = affinity
    if model == "FLEX_START":   # --request-valid-for-duration: how long the insert may wait for capacity
        body["params"] = {"request_valid_for_duration": {"seconds": int(cfg.flex_start.request_valid_for_s)}}
    if cfg.machine_type in SINGLE_THREADED:
        body["advanced_machine_features"] = {"threads_per_core": 1}
    return body


def firewall_body(cfg: Any, name: str, firewall: str, labels: dict[str, str],
                  sources: Sequence[str] = (ssh_route.IAP_RANGE,)) -> dict:
    """An SSH rule: tcp:22 from ``sources`` (the tutorials': the IAP range) to VMs tagged with the
    VM's name.

    Firewall rules have no labels in Compute's API: the description carries the VM's."""
    tags = " ".join(f"{key}={value}" for key, value in sorted(labels.items()))
    return {
        "name": firewall,
        "network": f"global/networks/{cfg.network}",
        "direction": "INGRESS",
        "allowed": [{"I_p_protocol": "tcp", "ports": ["22"]}],
        "source_ranges": list(sources),
        "target_tags": [name],
        "description": f"SSH to the mtpipe VM {name} (labels: {tags})",
    }


def label_filter(labels: dict[str, str]) -> str:
    """A list filter in Compute's syntax that keeps the resources carrying every one of ``labels``:
    `labels.app = "mtpipe"`, several as ANDed parenthesised expressions."""
    terms = [f'labels.{key} = "{value}"' for key, value in sorted(labels.items())]
    return terms[0] if len(terms) == 1 else " ".join(f"({term})" for term in terms)


class Compute:
    """The few Compute Engine calls the VM lifecycle needs, each waited on until DONE."""

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

    def in_zone(self, zone: str) -> Compute:
        """The same calls for another zone of the project."""
        return Compute(self.project, zone, self.timeout_s)

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
            except GcpError as err:
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
            with contextlib.suppress(GcpError):   # a failed insert: what it left is looked at below
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

    # ---- networks, firewall rules and project metadata (mtpipe.cloud.vm_access)

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

    # ---- the VM lifecycle's provider interface (mtpipe.cloud.lifecycle.Provider)

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
        except GcpError as err:
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
