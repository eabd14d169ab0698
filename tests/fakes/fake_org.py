"""The Google APIs besides Compute that the checks before spending call, as fakes served by the fake
Compute API's server (fakes.fake_compute routes their paths here): OS Login
(``v1/users/ACCOUNT:importSshPublicKey``), Organization Policy
(``v2/projects/P/policies/CONSTRAINT:getEffectivePolicy``) and Cloud Resource Manager's
``v3/projects/P:testIamPermissions``.

``policies`` holds each constraint's effective rules (what the organisation enforces), ``policies_readable``
False answers 403 as for a caller without orgpolicy.policies.get (or with the API disabled when
``disabled`` names it); an imported key lands in ``keys`` under its account, whose POSIX user name is
``posix_users[account]`` (default: the email with every character but a-z and 0-9 turned into `_`, as
OS Login names users of the organisation); ``refuse_import`` answers 403; ``permissions`` is what
testIamPermissions grants (None: everything asked). Every request and answer is checked against the
discovery documents google-api-python-client ships (oslogin.v1, orgpolicy.v2, cloudresourcemanager.v3).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from fakes.discovery import Contract, api

SERVICES = {"v1": "oslogin.googleapis.com", "v2": "orgpolicy.googleapis.com",
            "v3": "cloudresourcemanager.googleapis.com"}
DOCUMENTS = {"v1": "oslogin.v1", "v2": "orgpolicy.v2", "v3": "cloudresourcemanager.v3"}


def posix_name(account: str) -> str:
    return re.sub(r"[^a-z0-9]", "_", account.lower())


@dataclass
class FakeOrg:
    policies: dict[str, list[dict]] = field(default_factory=dict)
    policies_readable: bool = True
    posix_users: dict[str, str] = field(default_factory=dict)
    keys: dict[str, list[str]] = field(default_factory=dict)
    refuse_import: bool = False
    permissions: set[str] | None = None
    disabled: set[str] = field(default_factory=set)   # services answering SERVICE_DISABLED
    contracts: dict[str, Contract] = field(default_factory=lambda: {
        version: Contract(api(document)) for version, document in DOCUMENTS.items()})

    def contract_for(self, path: str) -> Contract | None:
        """The contract of the API serving ``path`` (its first segment: v1, v2, v3), None for others."""
        return self.contracts.get(path.lstrip("/").split("/", 1)[0])

    def check(self) -> None:
        for contract in self.contracts.values():
            contract.check()

    def authorized(self) -> list[str]:
        """`user:key` lines for every imported key, as an OS Login VM admits them."""
        return [f"{self.posix_users.get(account, posix_name(account))}:{key}"
                for account, keys in self.keys.items() for key in keys]

    def handle(self, method: str, url: str, body: dict) -> tuple[int, dict]:
        path = unquote(urlsplit(url).path).lstrip("/")
        version = path.split("/", 1)[0]
        if SERVICES[version] in self.disabled:
            return disabled(SERVICES[version])
        if found := re.fullmatch(r"v1/users/([^/]+):importSshPublicKey", path):
            return self._import(found[1], body, url)
        if found := re.fullmatch(r"v2/projects/([^/]+)/policies/([^/]+):getEffectivePolicy", path):
            if not self.policies_readable:
                return error(403, f"Permission 'orgpolicy.policy.get' denied on resource 'projects/{found[1]}' "
                                  "(or it may not exist).", "PERMISSION_DENIED")
            return 200, {"name": f"projects/{found[1]}/policies/{found[2]}",
                         "spec": {"rules": self.policies.get(found[2], [])}}
        if re.fullmatch(r"v3/projects/([^/]+):testIamPermissions", path):
            asked = body.get("permissions", [])
            return 200, {"permissions": [p for p in asked if self.permissions is None or p in self.permissions]}
        return error(404, f"The requested URL /{path} was not found on this server.", "NOT_FOUND")

    def _import(self, account: str, body: dict, url: str) -> tuple[int, dict]:
        if self.refuse_import:
            return error(403, f"The caller does not have permission to import keys for users/{account}.",
                         "PERMISSION_DENIED")
        project = dict(p.split("=", 1) for p in urlsplit(url).query.split("&") if "=" in p).get("projectId", "")
        self.keys.setdefault(account, []).append(body["key"])
        user = self.posix_users.get(account, posix_name(account))
        fingerprint = hashlib.sha256(body["key"].encode()).hexdigest()
        return 200, {"loginProfile": {
            "name": account,
            "posixAccounts": [{"primary": True, "username": user, "uid": "1001", "gid": "1001",
                               "homeDirectory": f"/home/{user}", "operatingSystemType": "LINUX",
                               "accountId": project, "name": f"users/{account}/projects/{project}"}],
            "sshPublicKeys": {fingerprint: {"key": body["key"], "fingerprint": fingerprint,
                                            "name": f"users/{account}/sshPublicKeys/{fingerprint}"}}}}


def error(code: int, message: str, status: str) -> tuple[int, dict]:
    return code, {"error": {"code": code, "message": message, "status": status}}


def disabled(service: str, project: str = "123456") -> tuple[int, dict]:
    """Google's 403 for an API that is not enabled in the project (its ErrorInfo names the service)."""
    message = (f"{service.split('.')[0].title()} API has not been used in project {project} before or it "
               f"is disabled. Enable it by visiting https://console.developers.google.com/apis/api/{service}/"
               f"overview?project={project} then retry.")
    return 403, {"error": {"code": 403, "message": message, "status": "PERMISSION_DENIED",
                           "errors": [{"message": message, "domain": "usageLimits", "reason": "accessNotConfigured"}],
                           "details": [{"@type": "type.googleapis.com/google.rpc.ErrorInfo", "reason": "SERVICE_DISABLED",
                                        "domain": "googleapis.com",
                                        "metadata": {"service": service, "consumer": f"projects/{project}"}}]}}
