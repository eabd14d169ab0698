"""A fake Cloud TPU API v2 (tpu.googleapis.com/v2) on 127.0.0.1 for the TPU API route's tests (stdlib
http.server): queued resources, their nodes, accelerator types and operations, as the provider
(mtpipe/cloud/providers/gcp/tpu_api/) calls them over REST.

Every request is first checked against Google's tpu.v2 discovery document
(tests/fixtures/gcp/tpu.v2.json, revision 20260127, copied from google-api-python-client 2.200.0's
``discovery_cache/documents``) and every answer after (tests/fakes/discovery.py's ``Contract``): a
request the API would refuse gets its 400 (or 404) without reaching the fake, an answer the API would
never give becomes a 500, and :func:`running_fake` fails the test that left either behind.

States, scripted by tests through :attr:`FakeTpu.outcomes` (first queued resource first):

- a queued resource is WAITING_FOR_RESOURCES for ``waits`` reads of it, then PROVISIONING for one,
  then ACTIVE with its node READY (``networkEndpoints[0].accessConfig.externalIp``: ``nat_ip``), or
  FAILED (``failedData.error`` with a gRPC code and message) or SUSPENDED;
- :meth:`FakeTpu.preempt` preempts a Spot node: node PREEMPTED, its queued resource SUSPENDED;
- queuedResources.delete refuses a queued resource whose node exists unless ``force=true`` (then the
  node goes too); a delete is an operation, done on its first read, whose node is DELETING until then;
  with :attr:`FakeTpu.delete_denied` every delete is refused (403, as to a caller without
  tpu.nodes.delete, the permission Google checks for a queued resource's node);
- a create in a zone of :attr:`FakeTpu.quota_refused` is answered HTTP 429 RESOURCE_EXHAUSTED with a
  google.rpc.QuotaFailure detail naming that zone's quota (as the API refuses a node beyond its
  per-zone quota: "Quota 'TPUV5sLitepodServingPerProjectPerZoneForTPUAPI' exhausted. Limit 4 in zone ...");
- locations.list names the zones of :attr:`FakeTpu.zones` (one a page: the caller must follow
  nextPageToken), acceleratorTypes.list and .get the accelerator types each offers.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from fakes.discovery import Contract, Discovery
from fakes.loopback import send, serving

DOCUMENT = Path(__file__).resolve().parents[1] / "fixtures" / "gcp" / "tpu.v2.json"
ACCELERATORS = {"v5litepod-8", "v5litepod-1", "v6e-8", "v6e-1"}


def tpu_v2() -> Discovery:
    """The committed tpu.v2 discovery document."""
    return Discovery(json.loads(DOCUMENT.read_text()))


@dataclass
class Outcome:
    """What one queued resource does: WAITING_FOR_RESOURCES for ``waits`` reads, then ``state`` (ACTIVE,
    FAILED, SUSPENDED); a FAILED one's ``code`` (gRPC) and ``message``."""

    state: str = "ACTIVE"
    waits: int = 0
    code: int = 8
    message: str = "There is no more capacity in the zone \"us-east5-b\"; you will be notified when capacity is available"


@dataclass
class FakeTpu:
    url: str = ""
    nat_ip: str = "127.0.0.1"
    zones: dict[str, set[str]] = field(default_factory=lambda: {z: set(ACCELERATORS) for z in ("us-east5-b", "us-west4-a")})
    outcomes: list[Outcome] = field(default_factory=list)   # none left: ACTIVE at once
    nodes: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    queued: dict[tuple[str, str, str], dict] = field(default_factory=dict)
    scripts: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)   # the states still to come
    operations: dict[str, dict] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)   # (method, path with query, body)
    tokens: list[str] = field(default_factory=list)   # the Authorization header of each request
    delete_denied: bool = False
    quota_refused: dict[str, str] = field(default_factory=dict)   # zone -> the quota id its creates exceed
    contract: Contract = field(default_factory=lambda: Contract(tpu_v2()))
    lock: threading.Lock = field(default_factory=threading.Lock)
    on_poll: Callable[[str, str], None] | None = None   # sees (name, state) of each read of a queued resource
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def calls(self, method: str, part: str) -> list[tuple[str, str, str]]:
        return [r for r in self.requests if r[0] == method and part in r[1]]

    def preempt(self, project: str, zone: str, name: str, then: Callable[[], None] | None = None) -> None:
        """Preempt a Spot node as the TPU API does: the node PREEMPTED, its queued resource SUSPENDED."""
        with self.lock:
            self.nodes[(project, zone, name)]["state"] = "PREEMPTED"
            if (project, zone, name) in self.queued:
                self.queued[(project, zone, name)]["state"] = {"state": "SUSPENDED", "suspendedData": {}}
            if then:
                then()

    # ---------------------------------------------------------------- requests

    def handle(self, method: str, url: str, body: dict) -> tuple[int, dict]:
        split = urlsplit(url)
        query = parse_qs(split.query)
        if method == "DELETE" and self.delete_denied:
            return _error(403, "Permission 'tpu.nodes.delete' denied on resource (or it may not exist).")
        match split.path.removeprefix("/v2/").split("/"):
            case ["projects", project, "locations"]:
                zones = sorted(self.zones)
                at = int(query.get("pageToken", ["0"])[0])
                page: dict = {"locations": [{"name": f"projects/{project}/locations/{zones[at]}",
                                             "locationId": zones[at]}] if at < len(zones) else []}
                if at + 1 < len(zones):
                    page["nextPageToken"] = str(at + 1)
                return 200, page
            case ["projects", project, "locations", zone, "acceleratorTypes"]:
                return 200, {"acceleratorTypes": [
                    {"name": f"projects/{project}/locations/{zone}/acceleratorTypes/{name}", "type": name}
                    for name in sorted(self.zones.get(zone, set()))]}
            case ["projects", project, "locations", zone, "queuedResources"] if method == "POST" and zone in self.quota_refused:
                return _quota_error(project, zone, self.quota_refused[zone])
            case ["projects", project, "locations", zone, "queuedResources"] if method == "POST":
                return self._create(project, zone, query["queuedResourceId"][0], body)
            case ["projects", project, "locations", zone, "queuedResources"]:
                return 200, {"queuedResources": [self._read_queued(k) for k in sorted(self.queued)
                                                 if k[:2] == (project, zone)]}
            case ["projects", project, "locations", zone, "queuedResources", name] if method == "GET":
                if (project, zone, name) not in self.queued:
                    return _error(404, f"Resource 'projects/{project}/locations/{zone}/queuedResources/{name}' was not found")
                return 200, self._read_queued((project, zone, name), advance=True)
            case ["projects", project, "locations", zone, "queuedResources", name]:
                return self._delete_queued(project, zone, name, query.get("force") == ["true"])
            case ["projects", project, "locations", zone, "nodes"]:
                return 200, {"nodes": [dict(n) for k, n in sorted(self.nodes.items()) if k[:2] == (project, zone)]}
            case ["projects", project, "locations", zone, "nodes", name]:
                if (project, zone, name) not in self.nodes:
                    return _error(404, f"Resource 'projects/{project}/locations/{zone}/nodes/{name}' was not found")
                if method == "DELETE":
                    self.nodes[(project, zone, name)]["state"] = "DELETING"
                    return 200, self._operation(project, zone, lambda: self.nodes.pop((project, zone, name), None))
                return 200, dict(self.nodes[(project, zone, name)])
            case ["projects", project, "locations", zone, "acceleratorTypes", name]:
                if name not in self.zones.get(zone, set()):
                    return _error(404, f"Resource 'projects/{project}/locations/{zone}/acceleratorTypes/{name}' was not found")
                return 200, {"name": f"projects/{project}/locations/{zone}/acceleratorTypes/{name}", "type": name}
            case ["projects", _, "locations", _, "operations", op] if op in self.operations:
                entry = self.operations[op]
                if not entry["op"]["done"]:
                    entry["op"]["done"] = True
                    entry["done"]()
                return 200, dict(entry["op"])
        return _error(404, f"The requested URL {split.path} was not found on this server.")

    def _create(self, project: str, zone: str, name: str, body: dict) -> tuple[int, dict]:
        key = (project, zone, name)
        if key in self.queued:
            return _error(409, f"Resource 'projects/{project}/locations/{zone}/queuedResources/{name}' already exists")
        outcome = self.outcomes.pop(0) if self.outcomes else Outcome()
        self.scripts[key] = ["WAITING_FOR_RESOURCES"] * outcome.waits + ["PROVISIONING", outcome.state]
        state: dict = {"state": "ACCEPTED"}
        if outcome.state == "FAILED":
            state["failedData"] = {"error": {"code": outcome.code, "message": outcome.message}}
        self.queued[key] = dict(body, name=f"projects/{project}/locations/{zone}/queuedResources/{name}",
                                createTime=_now(), state={"state": "ACCEPTED"}, _final=state)
        return 200, self._operation(project, zone, lambda: None)

    def _read_queued(self, key: tuple[str, str, str], advance: bool = False) -> dict:
        """The queued resource as the API answers it; ``advance``: one read of its script."""
        queued = self.queued[key]
        script = self.scripts.get(key, [])
        if advance and script and queued["state"]["state"] not in ("SUSPENDED", "ACTIVE", "FAILED"):
            state = script.pop(0)
            queued["state"] = {**queued["_final"], "state": state} if state == "FAILED" else {"state": state}
            if state == "ACTIVE":
                self._node(key, queued)
            if self.on_poll:
                self.on_poll(key[2], state)
        return {k: v for k, v in queued.items() if not k.startswith("_")}

    def _node(self, key: tuple[str, str, str], queued: dict) -> None:
        """The ACTIVE queued resource's node, READY, with the spec's fields."""
        project, zone, name = key
        spec = queued["tpu"]["nodeSpec"][0]["node"]
        scheduling = {"spot": True} if "spot" in queued else {"reserved": True} if "reservationName" in queued else {}
        self.nodes[key] = dict(
            spec, name=f"projects/{project}/locations/{zone}/nodes/{name}", state="READY", createTime=_now(),
            queuedResource=queued["name"], schedulingConfig=scheduling, apiVersion="V2",
            networkEndpoints=[{"ipAddress": "10.0.0.2", "port": 8470,
                               "accessConfig": {"externalIp": self.nat_ip}}] if self.nat_ip else [])

    def _delete_queued(self, project: str, zone: str, name: str, force: bool) -> tuple[int, dict]:
        key = (project, zone, name)
        if key not in self.queued:
            return _error(404, f"Resource 'projects/{project}/locations/{zone}/queuedResources/{name}' was not found")
        if key in self.nodes and not force:
            return _error(400, f"Queued resource {name} has a node: delete it first, or pass force", "FAILED_PRECONDITION")
        self.queued[key]["state"] = {"state": "DELETING"}

        def gone() -> None:
            self.queued.pop(key, None)
            self.nodes.pop(key, None)
        return 200, self._operation(project, zone, gone)

    def _operation(self, project: str, zone: str, done: Callable[[], None]) -> dict:
        name = f"operation-{next(self._ids)}"
        op = {"name": f"projects/{project}/locations/{zone}/operations/{name}", "done": False,
              "metadata": {"@type": "type.googleapis.com/google.cloud.tpu.v2.OperationMetadata", "createTime": _now()}}
        self.operations[name] = {"op": op, "done": done}
        return dict(op)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def _error(code: int, message: str, status: str = "") -> tuple[int, dict]:
    status = status or {404: "NOT_FOUND", 409: "ALREADY_EXISTS", 403: "PERMISSION_DENIED"}.get(code, "INVALID_ARGUMENT")
    return code, {"error": {"code": code, "message": message, "status": status}}


def _quota_error(project: str, zone: str, quota: str) -> tuple[int, dict]:
    """HTTP 429 RESOURCE_EXHAUSTED with the google.rpc.QuotaFailure and ErrorInfo details Google's quota
    refusals carry (cloud.google.com/apis/design/errors; the public report's message)."""
    message = f"Quota '{quota}' exhausted. Limit 4 in zone {zone}"
    return 429, {"error": {"code": 429, "message": message, "status": "RESOURCE_EXHAUSTED", "details": [
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [
            {"subject": f"project:{project}", "description": message, "quotaId": quota,
             "quotaDimensions": {"zone": zone}}]},
        {"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "RATE_LIMIT_EXCEEDED",
         "domain": "googleapis.com", "metadata": {"quota_limit": quota, "service": "tpu.googleapis.com",
                                                  "consumer": f"projects/{project}"}}]}}


def _handler(fake: FakeTpu) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            fake.requests.append((self.command, self.path, raw))
            fake.tokens.append(self.headers.get("Authorization") or "")
            method, refusal = fake.contract.request(self.command, self.path, raw)
            if method is None:
                code, out = refusal
            else:
                with fake.lock:
                    code, out = fake.contract.answer(method, *fake.handle(self.command, self.path,
                                                                          json.loads(raw) if raw else {}))
            try:
                send(self, code, json.dumps(out).encode())
            except (BrokenPipeError, ConnectionResetError):
                pass

        do_GET = do_POST = do_DELETE = do_PATCH = _serve

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def running_fake(fake: FakeTpu | None = None) -> Iterator[FakeTpu]:
    """Serve a FakeTpu on 127.0.0.1 (free port) in a thread; fail the test it leaves off contract."""
    fake = fake or FakeTpu()
    with serving(_handler(fake)) as host:
        fake.url = f"http://{host}"
        yield fake
        fake.contract.check()
