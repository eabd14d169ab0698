"""A fake of the IAM reads mtpipe makes before spending, on 127.0.0.1 (stdlib http.server):
Cloud Resource Manager v3 (projects, folders and organizations: ``get`` and ``getIamPolicy``) and
IAM v1 (``roles.get``, ``projects.roles.get``, ``organizations.roles.get``), one server for both
(their paths start with ``/v3/`` and ``/v1/``).

The resource hierarchy is ``parents`` (``projects/1234`` -> ``organizations/1``), each resource's
allow policy ``policies`` (bindings), the roles the fake knows ``roles`` (name -> permissions).
A resource in ``unreadable`` answers getIamPolicy with 403, as for a caller without
``resourcemanager.projects.getIamPolicy``. Every request is checked against the discovery
documents google-api-python-client ships (cloudresourcemanager.v3, iam.v1) and every answer after,
as the Compute fake is (fakes.discovery.Contract); :func:`running_fake_iam` fails the test that
left a refusal or an answer off contract behind.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from fakes.discovery import Contract, api
from fakes.loopback import send, serving


@dataclass
class FakeIam:
    """State of the fake; ``url`` is set once the server runs."""

    parents: dict[str, str] = field(default_factory=lambda: {"projects/1234": "organizations/1"})
    project_ids: dict[str, str] = field(default_factory=lambda: {"projects/1234": "proj-1"})
    policies: dict[str, list[dict]] = field(default_factory=dict)
    unreadable: set[str] = field(default_factory=set)
    roles: dict[str, list[str]] = field(default_factory=dict)
    url: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)   # (method, path)
    crm: Contract = field(default_factory=lambda: Contract(api("cloudresourcemanager.v3")))
    iam: Contract = field(default_factory=lambda: Contract(api("iam.v1")))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def grant(self, resource: str, role: str, member: str) -> None:
        """Add ``member`` to ``role`` in the allow policy of ``resource`` (projects/N, folders/N, ...)."""
        self.policies.setdefault(resource, []).append({"role": role, "members": [member]})

    def _canonical(self, name: str) -> str:
        """projects/PROJECT_ID as projects/NUMBER (both name a project in v3)."""
        by_id = {f"projects/{pid}": number for number, pid in self.project_ids.items()}
        return by_id.get(name, name)

    def handle(self, method: str, path: str) -> tuple[int, dict]:
        with self.lock:
            if path.startswith("/v3/") and path.endswith(":getIamPolicy") and method == "POST":
                resource = self._canonical(path[len("/v3/"):-len(":getIamPolicy")])
                if resource in self.unreadable:
                    return _error(403, "The caller does not have permission", "PERMISSION_DENIED")
                if resource not in self.parents and not resource.startswith("organizations/"):
                    return _error(403, "The caller does not have permission", "PERMISSION_DENIED")
                return 200, {"version": 3, "etag": "BwYAAAA=", "bindings": self.policies.get(resource, [])}
            if path.startswith("/v3/") and method == "GET":
                name = self._canonical(path[len("/v3/"):])
                if name not in self.parents and not name.startswith("organizations/"):
                    return _error(403, "The caller does not have permission", "PERMISSION_DENIED")
                body = {"name": name, "state": "ACTIVE"}
                if name in self.parents:
                    body["parent"] = self.parents[name]
                if name in self.project_ids:
                    body["projectId"] = self.project_ids[name]
                if name.startswith("organizations/"):
                    body = {"name": name, "state": "ACTIVE", "displayName": "example.com"}
                return 200, body
            if path.startswith("/v1/") and method == "GET":
                name = path[len("/v1/"):]
                if name not in self.roles:
                    return _error(404, f"The role named {name} was not found.", "NOT_FOUND")
                return 200, {"name": name, "includedPermissions": self.roles[name], "stage": "GA"}
        return _error(404, f"unknown path {path}", "NOT_FOUND")


def _error(code: int, message: str, status: str) -> tuple[int, dict]:
    reason = {403: "forbidden", 404: "notFound"}.get(code, "invalid")
    return code, {"error": {"code": code, "message": message, "status": status,
                            "errors": [{"message": message, "domain": "global", "reason": reason}]}}


def _handler(fake: FakeIam) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length).decode() if length else ""
            fake.requests.append((self.command, self.path))
            contract = fake.crm if self.path.startswith("/v3/") else fake.iam
            method, refusal = contract.request(self.command, self.path, raw)
            if method is None:
                code, out = refusal
            else:
                code, out = contract.answer(method, *fake.handle(self.command, urlsplit(self.path).path))
            send(self, code, json.dumps(out).encode())

        do_GET = do_POST = _serve

        def log_message(self, *args: object) -> None:
            pass

    return Handler


@contextmanager
def running_fake_iam(fake: FakeIam | None = None) -> Iterator[FakeIam]:
    """Serve a FakeIam on 127.0.0.1 (free port) in a thread."""
    fake = fake or FakeIam()
    with serving(_handler(fake)) as host:
        fake.url = f"http://{host}"
        yield fake
        fake.crm.check()
        fake.iam.check()
