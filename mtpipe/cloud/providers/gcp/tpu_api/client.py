"""The Cloud TPU API v2 over REST (tpu.googleapis.com/v2: projects.locations.nodes, queuedResources,
acceleratorTypes and operations) with google-auth's AuthorizedSession and the credentials every
Compute client uses (api_errors.client_kwargs): google-cloud-tpu is not in the locks
(docs/decisions/cloud-vm.md, "The Cloud TPU API over REST"). ``MTPIPE_TPU_ENDPOINT``, else
``MTPIPE_COMPUTE_ENDPOINT``, takes every call to another endpoint (the loopback fakes in tests).
Google's error answers become google.api_core exceptions, so api_errors.explained words them as it
words Compute's; each long-running call is waited on through operations.get. A create refused with
HTTP 429 RESOURCE_EXHAUSTED and a google.rpc.QuotaFailure detail is the zone's quota
(:func:`quota_refusal`): a per-zone QuotaExceeded, which moves the VM to the next zone.
"""

from __future__ import annotations

import os
import time
from typing import Any

from google.api_core import exceptions as gexc
from google.auth.transport.requests import AuthorizedSession

from mtpipe.cloud.providers import interrupts
from mtpipe.cloud.providers.gcp.api_errors import ENDPOINT_ENV, GcpError, client_kwargs, explained, quota_page
from mtpipe.cloud.providers.interface import QuotaExceeded
from mtpipe.cloud.providers.gcp.google_apis import rest_call

TPU_ENDPOINT_ENV = "MTPIPE_TPU_ENDPOINT"
ROOT = "https://tpu.googleapis.com"
OPERATION_POLL_S = 2.0


def endpoint() -> str:
    """Where the Cloud TPU API is: ``MTPIPE_TPU_ENDPOINT``, else ``MTPIPE_COMPUTE_ENDPOINT``, else Google's."""
    return os.environ.get(TPU_ENDPOINT_ENV) or os.environ.get(ENDPOINT_ENV) or ROOT


def quota_refusal(error: gexc.GoogleAPICallError) -> str | None:
    """The quota a refusal names in its google.rpc.QuotaFailure detail (a violation's quotaId, else its
    quotaMetric, subject or description), or None when it has no such detail (a rate limit, say)."""
    for detail in error.details or ():
        if isinstance(detail, dict) and detail.get("@type", "").endswith("google.rpc.QuotaFailure"):
            violation = (detail.get("violations") or [{}])[0]
            return next((str(violation[k]) for k in ("quotaId", "quotaMetric", "subject", "description")
                         if violation.get(k)), "a quota")
    return None


class TpuClient:
    """The calls of one project's zone (a TPU API location) that the provider and the checks make."""

    def __init__(self, project: str, zone: str, timeout_s: float = 900, poll_s: float = OPERATION_POLL_S) -> None:
        self.project, self.zone, self.timeout_s, self.poll_s = project, zone, timeout_s, poll_s
        self.session = AuthorizedSession(client_kwargs()["credentials"])
        self.root = endpoint()
        self.parent = f"projects/{project}/locations/{zone}"

    def call(self, method: str, path: str, body: dict | None = None, params: dict[str, str] | None = None) -> dict:
        """One request (``path`` under v2/); its JSON answer; a google.api_core exception for an error."""
        return rest_call(self.session, method, f"{self.root}/v2/{path}", body, params)

    def _get(self, kind: str, name: str) -> dict | None:
        with explained(f"reading {kind} {name} in {self.zone}", self.project):
            try:
                return self.call("GET", f"{self.parent}/{kind}/{name}")
            except gexc.NotFound:
                return None

    def _pages(self, path: str, kind: str) -> list[dict]:
        """Every item of a list call (``kind``: its answer's list field), page after page."""
        found, token = [], None
        while True:
            answer = self.call("GET", path, params={"pageToken": token} if token else None)
            found += answer.get(kind, [])
            token = answer.get("nextPageToken")
            if not token:
                return found

    def _list(self, kind: str) -> list[dict]:
        with explained(f"listing the {kind} of {self.zone}", self.project):
            return self._pages(f"{self.parent}/{kind}", kind)

    def get_node(self, name: str) -> dict | None:
        return self._get("nodes", name)

    def get_queued_resource(self, name: str) -> dict | None:
        return self._get("queuedResources", name)

    def list_nodes(self) -> list[dict]:
        return self._list("nodes")

    def list_queued_resources(self) -> list[dict]:
        return self._list("queuedResources")

    def accelerator_type(self, name: str) -> dict | None:
        """acceleratorTypes.get: the zone offers ``name`` (e.g. v5litepod-8); None when it does not."""
        return self._get("acceleratorTypes", name)

    def locations(self) -> list[str]:
        """The project's TPU API locations (locations.list): its zones."""
        return [location.get("locationId") or location["name"].rsplit("/", 1)[-1]
                for location in self._pages(f"projects/{self.project}/locations", "locations")]

    def zones_offering(self, accelerator: str) -> list[str]:
        """The project's TPU API locations (locations.list) whose acceleratorTypes.list holds ``accelerator``
        (e.g. v5litepod-8), one list per location; a location that refuses the list (not enabled there,
        not a zone) is left out."""
        with explained(f"listing the zones that offer {accelerator}", self.project):
            locations = self.locations()
        zones = []
        for zone in locations:
            try:
                types = self._pages(f"projects/{self.project}/locations/{zone}/acceleratorTypes", "acceleratorTypes")
            except gexc.GoogleAPICallError:
                continue
            if any(t.get("type") == accelerator or t.get("name", "").endswith(f"/{accelerator}") for t in types):
                zones.append(zone)
        return sorted(zones)

    def create_queued_resource(self, name: str, body: dict) -> None:
        """queuedResources.create, its operation waited on (the queued resource accepted, not its capacity).
        Ctrl-C does not tear the request: it is delivered once the API has answered, so the queued
        resource is known and deleted by the caller's cleanup."""
        action = f"creating queued resource {name} in {self.zone}"
        with explained(action, self.project):
            with interrupts.deferred():
                try:
                    op = self.call("POST", f"{self.parent}/queuedResources", body, {"queuedResourceId": name})
                except gexc.TooManyRequests as err:
                    if (quota := quota_refusal(err)) is None:
                        raise
                    raise QuotaExceeded(
                        f"{action}: the Cloud TPU API's quota {quota} has no room in {self.zone} ({err.message}); "
                        f"request more at {quota_page(self.project)} (filter: {quota}, zone {self.zone}), or list "
                        "another zone in zones: (conf/vm.yaml)", global_quota=False, per_zone=True) from err
            self.wait(op, f"creating queued resource {name}")

    def delete_queued_resource(self, name: str) -> bool:
        """queuedResources.delete with force (its node goes with it), waited on; False when gone already."""
        with explained(f"deleting queued resource {name} in {self.zone}", self.project):
            try:
                op = self.call("DELETE", f"{self.parent}/queuedResources/{name}", params={"force": "true"})
            except gexc.NotFound:
                return False
            self.wait(op, f"deleting queued resource {name}")
        return True

    def delete_node(self, name: str) -> bool:
        """nodes.delete, waited on; False when it was gone already."""
        with explained(f"deleting TPU node {name} in {self.zone}", self.project):
            try:
                op = self.call("DELETE", f"{self.parent}/nodes/{name}")
            except gexc.NotFound:
                return False
            self.wait(op, f"deleting TPU node {name}")
        return True

    def wait(self, op: dict[str, Any], what: str) -> dict:
        """operations.get until ``done`` (at most timeout_s); GcpError with the operation's error."""
        deadline = time.monotonic() + self.timeout_s
        while not op.get("done"):
            if time.monotonic() > deadline:
                raise GcpError(f"{what}: operation {op.get('name')} not done after {self.timeout_s:g} s; check "
                               "the Cloud console (Compute Engine > TPUs), then rerun")
            time.sleep(self.poll_s)
            op = self.call("GET", op["name"])
        if op.get("error"):
            raise GcpError(f"{what} failed: {op['error'].get('message', op['error'])}")
        return op
