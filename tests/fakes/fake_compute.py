"""A fake Compute Engine REST API on 127.0.0.1 for the VM lifecycle tests (stdlib http.server).

It behaves like the real one where mtpipe depends on it: instances and firewalls are created and
deleted by operations that go PENDING -> RUNNING -> DONE, one step per `get`/`wait` call; a missing
resource is a 404 and a duplicate a 409 with Google's error body; an insert naming an unknown
reservation ends in an operation error; a RUNNING instance has an external (NAT) IP that points at
127.0.0.1. Zones list their machine types. Reservations come in the kinds Compute documents (see
:class:`Reservation`): specific (VMs of one machine type, `count` / `inUseCount`), aggregate (TPU
chips of a VM family, `reservedResources` / `inUseResources`), auto-created by a future reservation
(calendar mode, listed by futureReservations.list), and shared: owned by another project, read as
projects/OWNER/zones/Z/reservations/NAME, consumed as projects/OWNER/reservations/NAME by the
projects its shareSettings list. A reservation counts what the VMs consuming it use until they are
deleted, by a DELETE or by :meth:`FakeCompute.expire` (maxRunDuration running out).
An insert is refused where Compute documents a refusal, and (400) an 8-chip v6e VM without one thread
per core, which SkyPilot's code says Compute requires (:data:`SINGLE_THREADED_TYPES`; the wording is
the fake's, in Compute's form). Documented: (400) a Spot VM that restarts itself or migrates, a
RESERVATION_BOUND VM without a specific reservation or consuming one that no future reservation in
calendar mode created, a FLEX_START VM without a maxRunDuration of at most 7 days or a termination
action, or consuming a reservation; (operation error) a reservation that does not exist or is not
shared with the project, whose VMs or chips do not match the VM, or that has no room left, and
QUOTA_EXCEEDED for an on-demand ct6e VM past its region's TPUS_PER_TPU_FAMILY limit (the buckets of
``org.quotas``, counting the chips of the region's other such VMs). A VM's boot disk is a disk of its
zone (disks.get / delete) until the VM goes; ``failed_insert_leaves_disk`` leaves one behind a failed
insert.
:meth:`FakeCompute.preempt` does what a Spot preemption does: the instance is TERMINATED, or deleted
(termination action DELETE).
Networks as organisations have them: `networks` (auto or custom mode), `subnetworks`, `routers`
(Cloud NAT), firewall rules listed by firewalls.list, the project's metadata (projects.get, e.g.
`enable-oslogin`); an insert on a network or subnetwork that does not exist, on a custom-mode network
without a subnetwork, with an external IP the organisation policy compute.vmExternalIpAccess denies,
or without Secure Boot where compute.requireShieldedVm is enforced is refused as Compute refuses it; `bound_max_run_duration` False refuses maxRunDuration on a
RESERVATION_BOUND VM, `firewall_insert_denied` answers firewalls.insert with 403. The same server
serves the OS Login, Organization Policy, Resource Manager, IAM and Service Usage calls, and at
`POST /token` OAuth's token endpoint (`org`, tests/fakes/fake_org.py); a service in `org.disabled`
(compute.googleapis.com too) answers Google's SERVICE_DISABLED 403. Every request is
recorded (method, path, Host header, headers, body) so tests can check what was sent and to whom.

Every request under /compute/v1/ is first checked against Google's discovery document and every
answer after (tests/fakes/discovery.py, ``FakeCompute.contract``): a request Compute would refuse
gets Compute's 400 (or 404) without reaching the fake, an answer Compute would never give becomes a
500, and :func:`running_fake` fails the test that left either behind.

instances.list answers with the zone's instances that match its `filter` (Compute's syntax, the
forms below in :func:`matches`), instances.aggregatedList with those of every zone.
:meth:`FakeCompute.hold_inserts` keeps the operation of every insert PENDING (its VM PROVISIONING)
until :meth:`FakeCompute.release_inserts`, which finishes them whether or not anyone polls, as Compute does; a `wait` on a held operation answers PENDING after a
short while (Compute's own `wait` answers after at most two minutes), so a test can interrupt a
client in the middle of an insert. ``flex_start_capacity`` makes Flex-start VMs wait for capacity as
Dynamic Workload Scheduler does: the insert's operation ends DONE with the VM PENDING (no external IP
yet), which then becomes RUNNING, or disappears when its request window expires, after a set time
whether or not anyone polls. :meth:`FakeCompute.hold_requests` keeps the answer to matching
requests back until :meth:`FakeCompute.release_requests` (a client blocked in a request);
``on_insert`` sees each insert's body before it is answered.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from fakes.discovery import Contract
from fakes.fake_org import FakeOrg, disabled
from fakes.loopback import send, serving

PREFIX = "/compute/v1/projects/"


@dataclass
class Recorded:
    method: str
    path: str
    host: str
    headers: dict[str, str]
    body: str
    api_method: str = ""   # the discovery method it resolved to, e.g. compute.instances.insert

    def json(self) -> dict:
        return json.loads(self.body)


# Compute's TPU machine types hold <N> chips of their family: ct6e-standard-8t, 8 chips of ct6e.
TPU_MACHINE = re.compile(r"(?P<family>[a-z][a-z0-9]*)-[a-z]+-(?P<chips>[0-9]+)t")
VM_FAMILIES = {"ct6e": "VM_FAMILY_CLOUD_TPU_LITE_POD_SLICE_CT6E", "ct5lp": "VM_FAMILY_CLOUD_TPU_LITE_POD_SLICE_CT5LP"}
FLEX_START_MAX_RUN_S = 7 * 24 * 3600   # "Flex-start VMs can run for up to seven days" (About Flex-start VMs)
# Compute Engine's quota of ct6e chips for VMs that are not Spot, Flex-start or a reservation's (a regional
# metric with dimension tpu_family; its buckets are in FakeOrg.quotas). The fake's own copy, not mtpipe's.
TPU_FAMILY_QUOTA = ("TPUS_PER_TPU_FAMILY", "compute.googleapis.com/tpus_per_tpu_family")
# Machine types Compute creates only with advancedMachineFeatures.threadsPerCore 1: the 8-chip v6e VM
# (SkyPilot, sky/clouds/gcp.py: "CT6e 8-chip VMs require single-threaded cores"). The fake's own
# copy of Google's rule, not mtpipe's, so that a body mtpipe gets wrong is refused.
SINGLE_THREADED_TYPES = {"ct6e-standard-8t"}


@dataclass
class Reservation:
    """A zonal reservation of `project` (the owner).

    specific (`accelerator` None): `count` VMs of `machine_type`, `in_use` of them taken;
    aggregate (`accelerator`, e.g. "ct6e"): `count` chips of that TPU family, `in_use` taken (a VM takes
    its machine type's chips); `delivered_by`: the reservationMode (CALENDAR or DEFAULT) of the future
    reservation that auto-created it, None for one created directly; `shared_with`: the consumer
    projects of its shareSettings (SPECIFIC_PROJECTS), empty for LOCAL; `status` as Compute reports it.
    """

    count: int = 1
    in_use: int = 0
    machine_type: str = "ct6e-standard-8t"
    accelerator: str | None = None
    delivered_by: str | None = None
    project: str = "proj-1"
    zone: str = "us-east5-b"
    shared_with: tuple[str, ...] = ()
    status: str = "READY"

    def takes(self, machine_type: str) -> int | None:
        """What one VM of `machine_type` takes from this reservation, None when it cannot consume it."""
        if self.accelerator is None:
            return 1 if machine_type == self.machine_type else None
        found = TPU_MACHINE.fullmatch(machine_type)
        return int(found["chips"]) if found and found["family"] == self.accelerator else None

    def resource(self, base: str, name: str) -> dict:
        """The reservations.get answer (compute.v1.json's Reservation)."""
        link = f"{base}{PREFIX}{self.project}/zones/{self.zone}/reservations/{name}"
        body = {"kind": "compute#reservation", "name": name, "selfLink": link, "status": self.status,
                "zone": f"{base}{PREFIX}{self.project}/zones/{self.zone}", "specificReservationRequired": True,
                "shareSettings": {"shareType": "SPECIFIC_PROJECTS", "projectMap": {
                    p: {"projectId": p} for p in self.shared_with}} if self.shared_with else {"shareType": "LOCAL"}}
        if self.accelerator is None:
            body["specificReservation"] = {"count": str(self.count), "inUseCount": str(self.in_use),
                                           "instanceProperties": {"machineType": self.machine_type}}
        else:
            accelerator_type = f"projects/{self.project}/zones/{self.zone}/acceleratorTypes/{self.accelerator}"
            body["aggregateReservation"] = {
                "vmFamily": VM_FAMILIES[self.accelerator], "workloadType": "BATCH",
                "reservedResources": [{"accelerator": {"acceleratorCount": self.count,
                                                       "acceleratorType": accelerator_type}}],
                "inUseResources": [{"accelerator": {"acceleratorCount": self.in_use,
                                                    "acceleratorType": accelerator_type}}] if self.in_use else []}
        return body


@dataclass
class FakeCompute:
    """State of the fake API; `url` is set once the server runs."""

    reservations: dict[str, Reservation] = field(default_factory=lambda: {"v6e-res": Reservation()})
    machine_types: dict[str, set[str]] = field(default_factory=lambda: {
        # the one-chip type of `doit vm_run --rehearse` is offered where the 8-chip one is
        zone: {"ct6e-standard-8t", "ct6e-standard-1t", "n2-standard-8"} for zone in ("us-east5-b", "europe-west4-a")})
    nat_ip: str = "127.0.0.1"
    # What the next inserts answer instead of creating the VM, first one first: ("http", status,
    # reason, message) for a refused request, ("operation", code, message) for an operation that fails.
    insert_failures: list[tuple] = field(default_factory=list)
    # What each FLEX_START insert's VM does once its operation is DONE, first one first: (outcome, seconds)
    # with outcome "RUNNING" (capacity found) or "gone" (the request window expired): PENDING for that
    # long, then that. None left: RUNNING at once.
    flex_start_capacity: list[tuple[str, float]] = field(default_factory=list)
    # True: an insert that fails as an operation leaves its boot disk (no VM uses it) in the zone, the
    # leftover mtpipe looks for in a zone it leaves; Compute's docs do not say it cannot happen
    failed_insert_leaves_disk: bool = False
    # Projects whose futureReservations.list answers 403 (the caller may not read them).
    unreadable_projects: set[str] = field(default_factory=set)
    # The project's VPC networks: name -> autoCreateSubnetworks (True: auto mode, a subnetwork named
    # like the network in every region); subnetworks of custom-mode ones: (region, name) -> network.
    networks: dict[str, bool] = field(default_factory=lambda: {"default": True})
    subnetworks: dict[tuple[str, str], str] = field(default_factory=dict)
    # Cloud Routers as routers.list answers them (name, region, network, nats).
    routers: list[dict] = field(default_factory=list)
    # projects.get commonInstanceMetadata (e.g. enable-oslogin: TRUE)
    project_metadata: dict[str, str] = field(default_factory=dict)
    # False: a RESERVATION_BOUND insert with maxRunDuration is refused (400)
    bound_max_run_duration: bool = True
    firewall_insert_denied: bool = False   # firewalls.insert answers 403 (no compute.firewalls.create)
    instance_delete_denied: bool = False   # instances.delete answers 403 (no compute.instances.delete)
    # OS Login, Organization Policy, Resource Manager (fakes.fake_org), on the same server; its
    # `disabled` services answer SERVICE_DISABLED, compute.googleapis.com included
    org: FakeOrg = field(default_factory=FakeOrg)
    # projects.get: each project's number, which names its Compute default service account
    project_numbers: dict[str, str] = field(default_factory=lambda: {"proj-1": "1234"})
    url: str = ""
    requests: list[Recorded] = field(default_factory=list)
    instances: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    disks: dict[tuple[str, str, str], dict] = field(default_factory=dict)   # a VM's boot disk, named as the VM
    firewalls: dict[tuple[str, str], dict] = field(default_factory=dict)
    operations: dict[str, dict] = field(default_factory=dict)
    contract: Contract = field(default_factory=Contract)
    lock: threading.Lock = field(default_factory=threading.Lock)
    holding_inserts: bool = False
    on_insert: Callable[[dict], None] | None = None
    held_requests: list[Recorded] = field(default_factory=list)
    # PENDING Flex-start VMs: key -> (monotonic time of their change, outcome)
    pending: dict[tuple[str, str, str], tuple[float, str]] = field(default_factory=dict)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1000))

    def __post_init__(self) -> None:
        self._released = threading.Condition(self.lock)
        self._holding: tuple[str, str] | None = None
        self._answer = threading.Event()

    def hold_requests(self, method: str, path_part: str) -> None:
        """Answer no request with this method whose path contains ``path_part`` until
        :meth:`release_requests`; each one waiting is in ``held_requests``."""
        self._answer.clear()
        self._holding = (method, path_part)

    def release_requests(self) -> None:
        self._holding = None
        self._answer.set()

    def _held(self, request: Recorded) -> None:
        """Wait (at most a minute) while ``request`` is one to hold back."""
        if self._holding and request.method == self._holding[0] and self._holding[1] in request.path:
            self.held_requests.append(request)
            self._answer.wait(60)

    def hold_inserts(self) -> None:
        """From now on an insert's operation stays PENDING (its VM PROVISIONING) until released."""
        with self.lock:
            self.holding_inserts = True

    def release_inserts(self) -> None:
        """Finish every held insert (its VM RUNNING), as Compute does whether or not anyone polls."""
        with self.lock:
            self.holding_inserts = False
            for entry in self.operations.values():
                if entry.pop("held", False):
                    entry["op"]["status"] = "DONE"
                    entry["done"]()
            self._released.notify_all()

    def finish_operations(self) -> None:
        """Finish every operation nobody polled to its end, as Compute does (a VM's delete of itself)."""
        with self.lock:
            for name in list(self.operations):
                while self.operations[name]["op"]["status"] != "DONE" and not self.operations[name].get("held"):
                    self._advance(name)

    def calls(self, method: str, suffix: str) -> list[Recorded]:
        """Recorded requests with this method whose path (without query) ends with suffix."""
        return [r for r in self.requests
                if r.method == method and urlsplit(r.path).path.endswith(suffix)]

    def inserts(self) -> list[Recorded]:
        """Every instances.insert request received (the call that starts billing)."""
        return [r for r in self.requests
                if r.method == "POST" and urlsplit(r.path).path.endswith("/instances")]

    def expire(self, project: str, zone: str, name: str) -> None:
        """Delete the VM the way maxRunDuration does: no request, the reservation freed."""
        with self.lock:
            self._release(self.instances.pop((project, zone, name)))

    def preempt(self, project: str, zone: str, name: str, delete: bool = False,
                then: Callable[[], None] | None = None) -> None:
        """Preempt the VM like Compute preempts a Spot VM: TERMINATED (termination action STOP),
        or gone (DELETE); either way it runs nothing any more and cannot be restarted.

        `then` runs before the API answers another request: what goes away with the VM (its SSH
        sessions, its disk), so that no client sees the instance gone while the VM still runs.
        """
        with self.lock:
            if delete:
                self._release(self.instances.pop((project, zone, name)))
            else:
                self.instances[(project, zone, name)].update(
                    status="TERMINATED",
                    lastStopTimestamp=datetime.now(timezone.utc).isoformat(timespec="milliseconds"))
            if then:
                then()

    # --------------------------------------------------------- request handling

    def handle(self, method: str, url: str, body: dict) -> tuple[int, dict]:
        path = urlsplit(url).path
        parts = path[len(PREFIX):].split("/") if path.startswith(PREFIX) else []
        with self.lock:
            self._end_pending()
            if "compute.googleapis.com" in self.org.disabled:
                return disabled("compute.googleapis.com")
            match parts:
                case [project] if method == "GET":
                    return 200, self._project(project)
                case [project, "global", "networks"] if method == "GET":
                    return 200, {"kind": "compute#networkList", "items": [
                        self._network(project, n) for n in sorted(self.networks)]}
                case [project, "global", "networks", name] if method == "GET":
                    if name not in self.networks:
                        return _error(404, f"The resource 'projects/{project}/global/networks/{name}' was not found")
                    return 200, self._network(project, name)
                case [project, "regions", region, "subnetworks"] if method == "GET":
                    return 200, {"kind": "compute#subnetworkList", "items": [
                        self._subnetwork(project, region, name) for name in self._subnetworks(region)]}
                case [project, "regions", region, "subnetworks", name] if method == "GET":
                    if name not in self._subnetworks(region):
                        return _error(404, f"The resource 'projects/{project}/regions/{region}/subnetworks/"
                                           f"{name}' was not found")
                    return 200, self._subnetwork(project, region, name)
                case [project, "regions", region, "routers"] if method == "GET":
                    return 200, {"kind": "compute#routerList", "items": [
                        {"kind": "compute#router", **r, "region": f"{self.url}{PREFIX}{project}/regions/{region}",
                         "network": f"{self.url}{PREFIX}{project}/global/networks/{r['network']}"}
                        for r in self.routers if r.get("region") == region]}
                case [project, "global", "firewalls"] if method == "GET":
                    return 200, {"kind": "compute#firewallList", "items": [
                        {"kind": "compute#firewall", **rule} for (p, _), rule in sorted(self.firewalls.items())
                        if p == project]}
                case [project, "zones", zone, "instances"] if method == "POST":
                    return self._insert_instance(project, zone, body)
                case [project, "zones", zone, "instances"] if method == "GET":
                    return self._list_instances(project, zone, url)
                case [project, "zones", zone, "instances", name]:
                    return self._instance(method, project, zone, name)
                case [project, "zones", zone, "disks", name] if method in ("GET", "DELETE"):
                    return self._disk(method, project, zone, name)
                case [project, "aggregated", "instances"] if method == "GET":
                    return self._aggregated_instances(project, url)
                case [project, "aggregated", "machineTypes"] if method == "GET":
                    return 200, self._aggregated_machine_types(url)
                case [project, "zones", zone, "machineTypes", name] if method == "GET":
                    if name not in self.machine_types.get(zone, set()):
                        return _error(404, f"The resource 'projects/{project}/zones/{zone}/"
                                           f"machineTypes/{name}' was not found")
                    return 200, {"kind": "compute#machineType", "name": name, "zone": zone}
                case [project, "zones", zone, "reservations", name] if method == "GET":
                    return self._reservation(project, zone, name)
                case [project, "zones", zone, "futureReservations"] if method == "GET":
                    return self._future_reservations(project, zone)
                case [project, "global", "firewalls"] if method == "POST":
                    return self._insert_firewall(project, body)
                case [project, "global", "firewalls", name]:
                    return self._firewall(method, project, name)
                case [_, "zones", _, "operations", op, *wait] | [_, "global", "operations", op, *wait]:
                    if op not in self.operations:
                        return _error(404, f"The resource 'operations/{op}' was not found")
                    if wait and self.operations[op].get("held"):
                        self._released.wait(0.5)   # lets go of the lock meanwhile
                    return 200, self._advance(op)
        return _error(404, f"unknown path {path}")

    def project_number(self, project: str) -> str:
        return self.project_numbers.get(project) or str(zlib.crc32(project.encode()))

    def default_service_account(self, project: str) -> str:
        """The project's Compute default service account (projects.get's defaultServiceAccount)."""
        return f"{self.project_number(project)}-compute@developer.gserviceaccount.com"

    def _project(self, project: str) -> dict:
        """projects.get, with what mtpipe reads: the metadata every VM inherits, the default service
        account."""
        return {"kind": "compute#project", "name": project, "id": self.project_number(project),
                "defaultServiceAccount": self.default_service_account(project),
                "commonInstanceMetadata": {"kind": "compute#metadata", "items": [
                    {"key": k, "value": v} for k, v in self.project_metadata.items()]}}

    def _network(self, project: str, name: str) -> dict:
        link = f"{self.url}{PREFIX}{project}/global/networks/{name}"
        return {"kind": "compute#network", "name": name, "selfLink": link,
                "autoCreateSubnetworks": self.networks[name]}

    def _subnetworks(self, region: str) -> list[str]:
        """The subnetworks of a region: each auto-mode network's (named like it) and those listed."""
        return sorted({n for n, auto in self.networks.items() if auto}
                      | {name for (r, name) in self.subnetworks if r == region})

    def _subnetwork(self, project: str, region: str, name: str) -> dict:
        network = self.subnetworks.get((region, name), name)
        return {"kind": "compute#subnetwork", "name": name, "ipCidrRange": "10.128.0.0/20",
                "region": f"{self.url}{PREFIX}{project}/regions/{region}",
                "network": f"{self.url}{PREFIX}{project}/global/networks/{network}"}

    def _network_refusal(self, project: str, zone: str, body: dict) -> tuple[int, dict] | None:
        """What Compute answers an insert whose network interface cannot be: an unknown network or
        subnetwork, a custom-mode network without a subnetwork, an external IP the organisation policy
        compute.vmExternalIpAccess forbids."""
        for nic in body.get("networkInterfaces", []):
            network = nic.get("network", "global/networks/default").rsplit("/", 1)[-1]
            if network not in self.networks:
                return _error(404, f"The resource 'projects/{project}/global/networks/{network}' was not found")
            if "subnetwork" in nic:
                region, name = zone.rsplit("-", 1)[0], nic["subnetwork"].rsplit("/", 1)[-1]
                if name not in self._subnetworks(region):
                    return _error(404, f"The resource 'projects/{project}/regions/{region}/subnetworks/{name}' "
                                       "was not found")
            elif not self.networks[network]:
                return _error(400, "Invalid value for field 'resource.networkInterfaces[0]': ''. Subnetwork "
                                   "should be specified for custom subnetmode network")
            rules = self.org.policies.get("compute.vmExternalIpAccess", [])
            if nic.get("accessConfigs") and any(r.get("denyAll") for r in rules):
                return _error(412, f"Constraint constraints/compute.vmExternalIpAccess violated for project "
                                   f"{project}. Add instance projects/{project}/zones/{zone}/instances/"
                                   f"{body['name']} to the constraint to use external IP with it.")
        return None

    def _shielded_refusal(self, project: str, body: dict) -> tuple[int, dict] | None:
        """Compute's answer to an insert without Secure Boot where the organisation policy
        compute.requireShieldedVm is enforced (new VMs need Secure Boot, vTPM, Integrity Monitoring)."""
        rules = self.org.policies.get("compute.requireShieldedVm", [])
        if any(r.get("enforce") for r in rules) and not body.get("shieldedInstanceConfig", {}).get("enableSecureBoot"):
            return _error(412, f"Constraint constraints/compute.requireShieldedVm violated for project {project}. "
                               "Secure Boot is not enabled in the 'shielded_instance_config' field.")
        return None

    def _aggregated_machine_types(self, url: str) -> dict:
        """machineTypes.aggregatedList with a ``name = X`` filter: the zones offering X."""
        wanted = parse_qs(urlsplit(url).query).get("filter", [""])[0].removeprefix("name = ").strip()
        return {"kind": "compute#machineTypeAggregatedList", "items": {
            f"zones/{zone}": {"machineTypes": [{"name": wanted, "zone": zone}]} if wanted in types else
            {"warning": {"code": "NO_RESULTS_ON_PAGE", "message": "no results"}}
            for zone, types in sorted(self.machine_types.items())}}

    def _aggregated_instances(self, project: str, url: str) -> tuple[int, dict]:
        """instances.aggregatedList: every zone (those with machine types or VMs), each with its instances
        that match the filter or Compute's NO_RESULTS_ON_PAGE warning, in one page."""
        wanted = parse_qs(urlsplit(url).query).get("filter", [""])[0]
        zones = sorted(set(self.machine_types) | {z for p, z, _ in self.instances if p == project})
        try:
            found = {zone: [i for (p, z, _), i in sorted(self.instances.items())
                            if (p, z) == (project, zone) and matches(wanted, i)] for zone in zones}
        except ValueError as e:
            return _error(400, f"Invalid value for field 'filter': {e}")
        empty = {"warning": {"code": "NO_RESULTS_ON_PAGE", "message": "There are no results for scope "
                             "'zones/ZONE' on this page.", "data": [{"key": "scope", "value": "zones/ZONE"}]}}
        return 200, {"kind": "compute#instanceAggregatedList", "id": f"projects/{project}/aggregated/instances",
                     "items": {f"zones/{zone}": {"instances": items} if items else
                               json.loads(json.dumps(empty).replace("ZONE", zone)) for zone, items in found.items()}}

    def _insert_instance(self, project: str, zone: str, body: dict) -> tuple[int, dict]:
        if self.on_insert:
            self.on_insert(body)
        if self.insert_failures:
            kind, *what = self.insert_failures.pop(0)
            if kind == "http":
                status, reason, message = what
                return status, {"error": {"code": status, "message": message,
                                          "errors": [{"message": message, "domain": "global", "reason": reason}]}}
            code, message = what
            if self.failed_insert_leaves_disk:
                self.disks[(project, zone, body["name"])] = self._boot_disk(project, zone, body["name"], users=[])
            return 200, self._operation(project, zone, error=message, code=code)
        key = (project, zone, body["name"])
        if key in self.instances:
            return _error(409, f"The resource 'projects/{project}/zones/{zone}/instances/"
                               f"{body['name']}' already exists")
        if refused := self._network_refusal(project, zone, body) or self._shielded_refusal(project, body):
            return refused
        machine_type = body.get("machineType", "").rsplit("/", 1)[-1]
        threads = (body.get("advancedMachineFeatures") or {}).get("threadsPerCore")
        if machine_type in SINGLE_THREADED_TYPES and threads != 1:
            return _error(400, "Invalid value for field 'resource.advancedMachineFeatures.threadsPerCore': "
                               f"'{threads if threads is not None else ''}'. Machine type {machine_type} "
                               "requires 1 thread per core.")
        scheduling, affinity = body.get("scheduling") or {}, body.get("reservationAffinity") or {}
        model = scheduling.get("provisioningModel", "STANDARD")
        if model == "RESERVATION_BOUND" and "maxRunDuration" in scheduling and not self.bound_max_run_duration:
            return _error(400, "Invalid value for field 'resource.scheduling.maxRunDuration': "
                               f"'{scheduling['maxRunDuration']}'. maxRunDuration is not supported for "
                               "instances with provisioningModel RESERVATION_BOUND.")
        # Spot VMs neither restart nor migrate (Compute Engine docs, "Create and use Spot VMs":
        # https://cloud.google.com/compute/docs/instances/create-use-spot)
        if model == "SPOT" and (scheduling.get("automaticRestart", True)
                                or scheduling.get("onHostMaintenance") != "TERMINATE"):
            return _error(400, "Invalid value for field 'resource.scheduling': Spot VMs require "
                               "automaticRestart false and onHostMaintenance TERMINATE")
        specific = affinity.get("consumeReservationType") == "SPECIFIC_RESERVATION"
        # A RESERVATION_BOUND VM runs in the specific reservation it names (Compute Engine docs, "About
        # reservation-bound VMs"); STANDARD may consume a specific reservation too
        if model == "RESERVATION_BOUND" and not specific:
            return _error(400, "Invalid value for field 'resource.scheduling.provisioningModel': "
                               f"RESERVATION_BOUND with reservation affinity {affinity or 'none'}")
        if model == "FLEX_START" and (refused := self._flex_start_refusal(scheduling, specific)):
            return refused
        if model == "STANDARD" and not specific and (refused := self._quota_refusal(project, zone, machine_type)):
            return refused
        if specific:
            refused = self._consume(project, zone, model, affinity.get("values", [""])[0],
                                    body.get("machineType", "").rsplit("/", 1)[-1])
            if refused:
                return refused
        now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        instance = {**body, "id": str(next(self._ids)), "status": "PROVISIONING",
                    "creationTimestamp": now, "zone": f"{self.url}{PREFIX}{project}/zones/{zone}"}
        instance.pop("params", None)   # input only: not part of the instance Compute keeps
        for nic in instance.get("networkInterfaces", []):
            nic["networkIP"] = "10.128.0.2"
            for ac in nic.get("accessConfigs", []):
                ac["natIP"] = self.nat_ip
        link = f"{self.url}{PREFIX}{project}/zones/{zone}/instances/{body['name']}"
        for disk in instance.get("disks", [])[:1]:   # the boot disk, made from initializeParams
            self.disks[key] = self._boot_disk(project, zone, body["name"], users=[link])
            disk["source"] = self.disks[key]["selfLink"]
        self.instances[key] = instance
        op = self._operation(project, zone, done=functools.partial(self._created, key, instance, model))
        self.operations[op["name"]]["held"] = self.holding_inserts
        return 200, op

    def _created(self, key: tuple[str, str, str], instance: dict, model: str) -> None:
        """The insert's operation is DONE: the VM RUNNING, or a Flex-start VM PENDING without an
        external IP while it waits for capacity (``flex_start_capacity``)."""
        if model != "FLEX_START" or not self.flex_start_capacity:
            instance.update(status="RUNNING")
            return
        outcome, seconds = self.flex_start_capacity.pop(0)
        instance.update(status="PENDING")
        for nic in instance.get("networkInterfaces", []):
            for ac in nic.get("accessConfigs", []):
                ac.pop("natIP", None)
        self.pending[key] = (time.monotonic() + seconds, outcome)

    def _end_pending(self) -> None:
        """The PENDING Flex-start VMs whose time has come: RUNNING with their external IP, or gone."""
        for key, (when, outcome) in list(self.pending.items()):
            instance = self.instances.get(key)
            if instance is None or instance["status"] != "PENDING":   # deleted meanwhile
                del self.pending[key]
            elif time.monotonic() >= when:
                del self.pending[key]
                if outcome == "RUNNING":
                    instance.update(status="RUNNING")
                    for nic in instance.get("networkInterfaces", []):
                        for ac in nic.get("accessConfigs", []):
                            ac["natIP"] = self.nat_ip
                else:
                    self._release(self.instances.pop(key))

    @staticmethod
    def _flex_start_refusal(scheduling: dict, specific: bool) -> tuple[int, dict] | None:
        """Compute's answer to a FLEX_START insert it cannot take (About Flex-start VMs: they run for
        up to seven days, then Compute stops or deletes them by their termination action; they take
        no reservation, as Google's cluster-toolkit notes). The wording is the fake's."""
        seconds = int((scheduling.get("maxRunDuration") or {}).get("seconds", 0))
        if not 0 < seconds <= FLEX_START_MAX_RUN_S:
            return _error(400, "Invalid value for field 'resource.scheduling.maxRunDuration': "
                               f"'{seconds}s'. Flex-start VMs need a maxRunDuration of at most 7 days.")
        if scheduling.get("instanceTerminationAction") not in ("STOP", "DELETE"):
            action = scheduling.get("instanceTerminationAction", "")
            return _error(400, "Invalid value for field 'resource.scheduling.instanceTerminationAction': "
                               f"'{action}'. Flex-start VMs need STOP or DELETE.")
        if specific:
            return _error(400, "Invalid value for field 'resource.reservationAffinity': Flex-start VMs cannot "
                               "consume a reservation.")
        return None

    def _quota_refusal(self, project: str, zone: str, machine_type: str) -> tuple[int, dict] | None:
        """QUOTA_EXCEEDED when a ct6e VM's chips and those the region's other such VMs hold pass the
        region's TPUS_PER_TPU_FAMILY limit (FakeOrg.quotas; none there: no limit)."""
        name, metric = TPU_FAMILY_QUOTA
        found = TPU_MACHINE.fullmatch(machine_type)
        region = zone.rsplit("-", 1)[0]
        if not found or found["family"] != "ct6e":
            return None
        limit = self.org.quota_limit(metric, {"region": region, "tpu_family": "CT6E"})
        in_use = sum(int(TPU_MACHINE.fullmatch(i["machineType"].rsplit("/", 1)[-1])["chips"])
                     for (p, z, _), i in self.instances.items()
                     if p == project and z.rsplit("-", 1)[0] == region
                     and i.get("scheduling", {}).get("provisioningModel", "STANDARD") == "STANDARD"
                     and not i.get("reservationAffinity")
                     and i["machineType"].rsplit("/", 1)[-1].startswith("ct6e-"))
        if limit is None or in_use + int(found["chips"]) <= limit:
            return None
        return 200, self._operation(project, zone, code="QUOTA_EXCEEDED", error=(
            f"Quota '{name}' exceeded.  Limit: {limit:.1f} in region {region}."))

    def _boot_disk(self, project: str, zone: str, name: str, users: list[str]) -> dict:
        """A disk as disks.get answers it (compute.v1.json's Disk)."""
        link = f"{self.url}{PREFIX}{project}/zones/{zone}/disks/{name}"
        return {"kind": "compute#disk", "name": name, "selfLink": link, "status": "READY", "sizeGb": "200",
                "zone": f"{self.url}{PREFIX}{project}/zones/{zone}", "users": users}

    def _disk(self, method: str, project: str, zone: str, name: str) -> tuple[int, dict]:
        key = (project, zone, name)
        if key not in self.disks:
            return _error(404, f"The resource 'projects/{project}/zones/{zone}/disks/{name}' was not found")
        if method == "DELETE":
            if self.disks[key]["users"]:
                return _error(400, f"The disk resource 'projects/{project}/zones/{zone}/disks/{name}' is "
                                   f"already being used by '{self.disks[key]['users'][0]}'")
            return 200, self._operation(project, zone, done=lambda: self.disks.pop(key, None))
        return 200, self.disks[key]

    def _list_instances(self, project: str, zone: str, url: str) -> tuple[int, dict]:
        """instances.list: the zone's instances that match the filter, in one page."""
        where = f"{self.url}{PREFIX}{project}/zones/{zone}/instances"
        query = parse_qs(urlsplit(url).query)
        try:
            items = [i for (p, z, _), i in sorted(self.instances.items())
                     if (p, z) == (project, zone) and matches(query.get("filter", [""])[0], i)]
        except ValueError as e:
            return _error(400, f"Invalid value for field 'filter': {e}")
        listed = {"kind": "compute#instanceList", "id": f"projects/{project}/zones/{zone}/instances",
                  "selfLink": where}
        return 200, {**listed, "items": items} if items else listed

    def _consume(self, project: str, zone: str, model: str, named: str,
                 machine_type: str) -> tuple[int, dict] | None:
        """Take what a VM of `machine_type` uses from the reservation `named`; Compute's refusal if any."""
        owner, name = self._owner(named, project)
        reservation = self.reservations.get(name)
        if reservation is None or (reservation.project, reservation.zone) != (owner, zone):
            msg = f"The resource 'projects/{owner}/zones/{zone}/reservations/{name}' was not found"
            return 200, self._operation(project, zone, error=msg)
        if owner != project and project not in reservation.shared_with:
            return 200, self._operation(project, zone, code="INVALID_USAGE", error=(
                f"Reservation '{named}' is not shared with project '{project}'"))
        if model == "RESERVATION_BOUND" and reservation.delivered_by != "CALENDAR":
            return _error(400, "Invalid value for field 'resource.scheduling.provisioningModel': "
                               "RESERVATION_BOUND VMs consume reservations of future reservations in "
                               f"calendar mode; '{named}' is not one")
        takes = reservation.takes(machine_type)
        if takes is None:
            return 200, self._operation(project, zone, code="INVALID_USAGE", error=(
                f"Reservation '{named}' does not match the instance's properties ({machine_type})"))
        if reservation.count - reservation.in_use < takes:
            return 200, self._operation(project, zone, code="INVALID_USAGE", error=(
                f"Reservation '{named}' does not have enough free resources for {machine_type}"))
        reservation.in_use += takes
        return None

    def _instance(self, method: str, project: str, zone: str, name: str) -> tuple[int, dict]:
        key = (project, zone, name)
        if key not in self.instances:
            return _error(404, f"The resource 'projects/{project}/zones/{zone}/instances/{name}' "
                               "was not found")
        if method == "DELETE" and self.instance_delete_denied:
            return _error(403, f"Required 'compute.instances.delete' permission for "
                               f"'projects/{project}/zones/{zone}/instances/{name}'")
        if method == "DELETE":
            self.instances[key]["status"] = "STOPPING"
            return 200, self._operation(project, zone,
                                        done=lambda: self._release(self.instances.pop(key, {})))
        return 200, self.instances[key]

    @staticmethod
    def _owner(named: str, project: str) -> tuple[str, str]:
        """(owner project, name) of a reservation as reservationAffinity.values names it."""
        parts = named.split("/")
        return (parts[1], parts[3]) if len(parts) == 4 and parts[0::2] == ["projects", "reservations"] \
            else (project, named)

    def _release(self, instance: dict) -> None:
        """The reservation a deleted instance used gets back what the instance took; its auto-delete
        disks go with it."""
        for disk in instance.get("disks", []):
            if disk.get("autoDelete") and "source" in disk:
                project, zone, name = urlsplit(disk["source"]).path[len(PREFIX):].split("/")[::2][:3]
                self.disks.pop((project, zone, name), None)
        for named in (instance.get("reservationAffinity") or {}).get("values", []):
            project = instance["zone"].rsplit("/projects/", 1)[-1].split("/")[0]
            reservation = self.reservations.get(self._owner(named, project)[1])
            if reservation is not None:
                reservation.in_use -= reservation.takes(instance["machineType"].rsplit("/", 1)[-1]) or 0

    def _reservation(self, project: str, zone: str, name: str) -> tuple[int, dict]:
        reservation = self.reservations.get(name)
        if reservation is None or (reservation.project, reservation.zone) != (project, zone):
            return _error(404, f"The resource 'projects/{project}/zones/{zone}/reservations/{name}' "
                               "was not found")
        return 200, reservation.resource(self.url, name)

    def _future_reservations(self, project: str, zone: str) -> tuple[int, dict]:
        """futureReservations.list: the future reservations that auto-created this project's reservations."""
        if project in self.unreadable_projects:
            return _error(403, f"Required 'compute.futureReservations.list' permission for 'projects/{project}'")
        items = [{"kind": "compute#futureReservation", "name": f"{name}-request", "namePrefix": name,
                  "zone": f"{self.url}{PREFIX}{project}/zones/{zone}", "reservationMode": r.delivered_by,
                  "status": {"procurementStatus": "FULFILLED", "autoCreatedReservations": [
                      f"{self.url}{PREFIX}{project}/zones/{zone}/reservations/{name}"]}}
                 for name, r in sorted(self.reservations.items())
                 if r.delivered_by and (r.project, r.zone) == (project, zone)]
        return 200, {"kind": "compute#futureReservationsListResponse", "items": items,
                     "selfLink": f"{self.url}{PREFIX}{project}/zones/{zone}/futureReservations"}

    def _insert_firewall(self, project: str, body: dict) -> tuple[int, dict]:
        if self.firewall_insert_denied:
            return _error(403, f"Required 'compute.firewalls.create' permission for 'projects/{project}/global/"
                               f"firewalls/{body['name']}'")
        network = body.get("network", "global/networks/default").rsplit("/", 1)[-1]
        if network not in self.networks:
            return _error(404, f"The resource 'projects/{project}/global/networks/{network}' was not found")
        body = {**body, "network": f"{self.url}{PREFIX}{project}/global/networks/{network}"}
        key = (project, body["name"])
        if key in self.firewalls:
            return _error(409, f"The resource 'projects/{project}/global/firewalls/"
                               f"{body['name']}' already exists")
        self.firewalls[key] = {**body, "id": str(next(self._ids))}
        return 200, self._operation(project, None)

    def _firewall(self, method: str, project: str, name: str) -> tuple[int, dict]:
        key = (project, name)
        if key not in self.firewalls:
            return _error(404, f"The resource 'projects/{project}/global/firewalls/{name}' "
                               "was not found")
        if method == "DELETE":
            return 200, self._operation(project, None, done=lambda: self.firewalls.pop(key, None))
        return 200, self.firewalls[key]

    def _operation(self, project: str, zone: str | None, done=None, error: str = "",
                   code: str = "RESOURCE_NOT_FOUND") -> dict:
        name = f"operation-{next(self._ids)}"
        where = f"zones/{zone}" if zone else "global"
        op = {"kind": "compute#operation", "name": name, "status": "PENDING",
              "selfLink": f"{self.url}{PREFIX}{project}/{where}/operations/{name}"}
        if zone:
            op["zone"] = zone
        self.operations[name] = {"op": op, "done": done, "error": error, "code": code}
        return dict(op)

    def _advance(self, name: str) -> dict:
        """One poll: PENDING -> RUNNING -> DONE; the effect happens when DONE is reached."""
        entry = self.operations[name]
        op = entry["op"]
        if entry.get("held"):
            return dict(op)
        if op["status"] == "PENDING":
            op["status"] = "RUNNING"
        elif op["status"] == "RUNNING":
            op["status"] = "DONE"
            if entry["error"]:
                op["error"] = {"errors": [{"code": entry["code"], "message": entry["error"]}]}
                op["httpErrorStatusCode"] = {"RESOURCE_NOT_FOUND": 404, "INVALID_USAGE": 400,
                                             "QUOTA_EXCEEDED": 403}.get(entry["code"], 503)
            elif entry["done"]:
                entry["done"]()
        return dict(op)


FILTER_TERM = re.compile(
    r"^\s*(?P<field>[A-Za-z][\w.-]*)\s*(?:(?P<op>!=|=)|\s(?P<regex>eq|ne)\s)\s*(?P<value>.*?)\s*$")


def matches(expression: str, resource: dict) -> bool:
    """Whether ``resource`` passes a list filter in Compute's syntax, as far as the fake reads it:
    one `FIELD = VALUE` / `FIELD != VALUE` comparison (a dotted field such as `labels.app`, the value
    bare or in double or single quotes, spaces around the operator optional), `FIELD eq REGEX` /
    `FIELD ne REGEX` (the value must match the whole field), or several of them each in parentheses,
    ANDed (side by side or with AND). An empty filter keeps everything; anything else is a
    ValueError (the API answers 400)."""
    if not expression.strip():
        return True
    if "(" in expression:
        terms = re.findall(r"\(([^()]*)\)", expression)
        if re.sub(r"\([^()]*\)|\bAND\b", "", expression).strip():
            raise ValueError(f"{expression!r}: only parenthesised expressions joined by AND are read here")
    else:
        terms = [expression]
    return all(_term_matches(term, resource) for term in terms)


def _term_matches(term: str, resource: dict) -> bool:
    found = FILTER_TERM.match(term)
    if not found:
        raise ValueError(f"{term!r} is not FIELD = VALUE, FIELD != VALUE, FIELD eq REGEX or FIELD ne REGEX")
    value = found["value"]
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        value = value[1:-1]
    actual: object = resource
    for part in found["field"].split("."):
        actual = actual.get(part) if isinstance(actual, dict) else None
    text = "" if actual is None else str(actual).lower() if isinstance(actual, bool) else str(actual)
    if found["regex"]:
        return (re.fullmatch(value, text) is not None) == (found["regex"] == "eq")
    return (actual is not None and text == value) == (found["op"] == "=")


def _error(code: int, message: str) -> tuple[int, dict]:
    reason = {403: "forbidden", 404: "notFound", 409: "alreadyExists"}.get(code, "invalid")
    return code, {"error": {"code": code, "message": message,
                            "errors": [{"message": message, "domain": "global", "reason": reason}]}}


def _handler(fake: FakeCompute) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            recorded = Recorded(self.command, self.path, self.headers.get("Host", ""), dict(self.headers), raw)
            fake.requests.append(recorded)
            fake._held(recorded)
            path = urlsplit(self.path).path
            document = fake.org.route(self.command, path)   # OS Login, Org Policy, Resource Manager, IAM...
            contract, serve = (fake.org.contracts[document], functools.partial(fake.org.handle, document)) \
                if document else (fake.contract, fake.handle)
            if path == "/token":   # OAuth's token endpoint (fakes.fake_org)
                code, out = fake.org.token(raw)
            else:
                method, refusal = contract.request(self.command, self.path, raw)
                if method is None:
                    code, out = refusal
                else:
                    recorded.api_method = method.id
                    code, out = contract.answer(method, *serve(self.command, self.path, json.loads(raw) if raw else {}))
            try:
                send(self, code, json.dumps(out).encode())
            except (BrokenPipeError, ConnectionResetError):   # the client gave up (interrupted)
                pass

        do_GET = do_POST = do_DELETE = do_PATCH = _serve

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def running_fake(fake: FakeCompute | None = None) -> Iterator[FakeCompute]:
    """Serve a FakeCompute on 127.0.0.1 (free port) in a thread."""
    fake = fake or FakeCompute()
    with serving(_handler(fake)) as host:
        fake.url = f"http://{host}"
        yield fake
        fake.contract.check()   # on leaving the with-block normally (a fixture's teardown included)
        fake.org.check()
