"""The Google APIs besides Compute that the checks before spending call, as fakes served by the fake
Compute API's server, which routes a request here when one of these APIs' discovery documents has a
method for its path (:meth:`FakeOrg.route`; Google tells them apart by host): OS Login
(``v1/users/ACCOUNT:importSshPublicKey``), Organization Policy
(``v2/projects/P/policies/CONSTRAINT:getEffectivePolicy``), Cloud Resource Manager's
``v3/projects/P:testIamPermissions``, IAM's ``v1/projects/-/serviceAccounts/EMAIL:testIamPermissions``,
Service Usage (``v1/projects/P/services:batchGet``, ``:batchEnable`` and its ``v1/operations/X``;
v1beta1's ``projects/P/services/S/consumerQuotaMetrics/METRIC``, a quota's buckets), Cloud Quotas
(``v1/projects/P/locations/global/services/S/quotaInfos/ID``, a quota's limit per zone) and OAuth's token
endpoint (``POST /token``, named by an ADC file's ``token_uri``).

``policies`` holds each constraint's effective rules (what the organisation enforces), ``policies_readable``
False answers 403 as for a caller without orgpolicy.policies.get; an imported key lands in ``keys``
under its account, whose POSIX user name is ``posix_users[account]`` (default: the email with every
character but a-z and 0-9 turned into `_`, as OS Login names users of the organisation);
``refuse_import`` answers 403; ``permissions`` is what both testIamPermissions grant (None: everything
asked). A service in ``disabled`` answers SERVICE_DISABLED, and batchGet reports it DISABLED until a
batchEnable (its operation done on the first poll) enables it; ``enabled`` lists what was enabled.
``quotas`` holds each quota metric's buckets as consumerQuotaMetrics.get answers them (:func:`bucket`:
the effective limit where its dimensions say, e.g. region and tpu_family; a metric not there is a
404, as for a project without it); the fake Compute API refuses an insert beyond them. ``quota_infos``
holds Cloud Quotas' limits by quota id, zone by zone (key ``""``: the default of every other zone); an id
not there is a 404.
The token endpoint grants a service account's JWT-bearer assertion (a key file's credentials) and
refuses a refresh token as an expired one (invalid_grant). Every request and answer of the APIs is
checked against the discovery documents google-api-python-client ships (oslogin.v1, orgpolicy.v2,
cloudresourcemanager.v3, iam.v1, serviceusage.v1 and v1beta1), Cloud Quotas' against the contract
committed from Google's client package (tests/fixtures/gcp/cloudquotas.v1.json); the token endpoint has none.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from urllib.parse import parse_qs, quote, unquote, urlsplit

from fakes.discovery import Contract, api

# Each discovery document served here, with the service (host) it describes.
DOCUMENTS = {"oslogin.v1": "oslogin.googleapis.com", "orgpolicy.v2": "orgpolicy.googleapis.com",
             "cloudresourcemanager.v3": "cloudresourcemanager.googleapis.com", "iam.v1": "iam.googleapis.com",
             "serviceusage.v1": "serviceusage.googleapis.com", "serviceusage.v1beta1": "serviceusage.googleapis.com",
             "cloudquotas.v1": "cloudquotas.googleapis.com"}
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"


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
    enabled: list[str] = field(default_factory=list)  # services batchEnable enabled, in order
    operations: dict[str, list[str]] = field(default_factory=dict)   # batchEnable's, until polled
    quotas: dict[str, list[dict]] = field(default_factory=dict)      # metric -> its buckets (:func:`bucket`)
    quota_infos: dict[str, dict[str, int]] = field(default_factory=dict)   # Cloud Quotas id -> zone -> limit
    contracts: dict[str, Contract] = field(default_factory=lambda: {
        document: Contract(api(document)) for document in DOCUMENTS})
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def route(self, method: str, path: str) -> str | None:
        """The discovery document with a method for ``path``, patterns included; None for another
        API's path (Compute's)."""
        return next((document for document, contract in self.contracts.items()
                     if contract.api.serves(method, path)), None)

    def check(self) -> None:
        for contract in self.contracts.values():
            contract.check()

    def authorized(self) -> list[str]:
        """`user:key` lines for every imported key, as an OS Login VM admits them."""
        return [f"{self.posix_users.get(account, posix_name(account))}:{key}"
                for account, keys in self.keys.items() for key in keys]

    def quota_limit(self, metric: str, dimensions: dict[str, str]) -> int | None:
        """The effective limit of ``metric`` where ``dimensions`` say: its most specific bucket whose
        dimensions are among them; None when there is none or it is unlimited (-1)."""
        fitting = [b for b in self.quotas.get(metric, [])
                   if all(dimensions.get(k) == v for k, v in b.get("dimensions", {}).items())]
        best = max(fitting, key=lambda b: len(b.get("dimensions", {})), default=None)
        return None if best is None or int(best["effectiveLimit"]) < 0 else int(best["effectiveLimit"])

    def handle(self, document: str, method: str, url: str, body: dict) -> tuple[int, dict]:
        path = unquote(urlsplit(url).path).lstrip("/")
        if DOCUMENTS[document] in self.disabled:
            return disabled(DOCUMENTS[document])
        if found := re.fullmatch(r"v1beta1/projects/([^/]+)/services/([^/]+)/consumerQuotaMetrics/(.+)", path):
            return self._quota_metric(*found.groups())
        if found := re.fullmatch(r"v1/projects/([^/]+)/locations/global/services/([^/]+)/quotaInfos/([^/]+)", path):
            return self._quota_info(*found.groups())
        if found := re.fullmatch(r"v1/users/([^/]+):importSshPublicKey", path):
            return self._import(found[1], body, url)
        if found := re.fullmatch(r"v2/projects/([^/]+)/policies/([^/]+):getEffectivePolicy", path):
            if not self.policies_readable:
                return error(403, f"Permission 'orgpolicy.policy.get' denied on resource 'projects/{found[1]}' "
                                  "(or it may not exist).", "PERMISSION_DENIED")
            return 200, {"name": f"projects/{found[1]}/policies/{found[2]}",
                         "spec": {"rules": self.policies.get(found[2], [])}}
        if re.fullmatch(r"v3/projects/[^/]+:testIamPermissions|v1/projects/-/serviceAccounts/[^/]+:testIamPermissions",
                        path):
            asked = body.get("permissions", [])
            return 200, {"permissions": [p for p in asked if self.permissions is None or p in self.permissions]}
        if found := re.fullmatch(r"v1/projects/([^/]+)/services:batchGet", path):
            names = parse_qs(urlsplit(url).query).get("names", [])
            return 200, {"services": [self._service(found[1], name.rsplit("/", 1)[-1]) for name in names]}
        if found := re.fullmatch(r"v1/projects/([^/]+)/services:batchEnable", path):
            name = f"operations/acf.p2-{next(self._ids)}"
            self.operations[name] = list(body.get("serviceIds", []))
            return 200, {"name": name, "done": False}
        if path.removeprefix("v1/") in self.operations:   # done on the first poll: enabled then
            services = self.operations.pop(path.removeprefix("v1/"))
            self.disabled -= set(services)
            self.enabled += services
            return 200, {"name": path.removeprefix("v1/"), "done": True, "response": {
                "@type": "type.googleapis.com/google.api.serviceusage.v1.BatchEnableServicesResponse",
                "services": [{"name": f"projects/-/services/{s}", "state": "ENABLED"} for s in services]}}
        return error(404, f"The requested URL /{path} was not found on this server.", "NOT_FOUND")

    def _quota_metric(self, project: str, service: str, metric: str) -> tuple[int, dict]:
        """consumerQuotaMetrics.get (view FULL): the metric's one limit with its buckets
        (serviceusage.v1beta1's ConsumerQuotaMetric)."""
        if metric not in self.quotas:
            return error(404, f"Metric {metric} not found for service {service}.", "NOT_FOUND")
        name = f"projects/{project}/services/{service}/consumerQuotaMetrics/{quote(metric, safe='')}"
        dimensions = sorted({k for b in self.quotas[metric] for k in b.get("dimensions", {})})
        unit = "1/{project}" + "".join(f"/{{{k}}}" for k in dimensions)
        return 200, {"name": name, "displayName": metric, "metric": metric, "unit": unit, "consumerQuotaLimits": [
            {"name": f"{name}/limits/{quote('/project' + ''.join(f'/{k}' for k in dimensions), safe='')}",
             "metric": metric, "unit": unit, "isPrecise": True,
             "quotaBuckets": sorted(self.quotas[metric], key=lambda b: len(b.get("dimensions", {})))}]}

    def _quota_info(self, project: str, service: str, quota_id: str) -> tuple[int, dict]:
        """quotaInfos.get: a per-zone quota as Cloud Quotas answers it (cloudquotas.v1's QuotaInfo), a
        dimensionsInfos entry for each zone, then the default, most specific first."""
        if quota_id not in self.quota_infos:
            return error(404, f"QuotaInfo {quota_id} of service {service} not found.", "NOT_FOUND")
        limits = self.quota_infos[quota_id]
        infos = [{"dimensions": {"zone": zone}, "details": {"value": str(limit)}, "applicableLocations": [zone]}
                 for zone, limit in sorted(limits.items()) if zone]
        if "" in limits:
            infos.append({"details": {"value": str(limits[""])}})
        return 200, {"name": f"projects/{project}/locations/global/services/{service}/quotaInfos/{quota_id}",
                     "quotaId": quota_id, "service": service,
                     "isPrecise": True, "containerType": "PROJECT", "dimensions": ["zone"],
                     "metricUnit": "1/{project}/{zone}", "dimensionsInfos": infos}

    def _service(self, project: str, service: str) -> dict:
        """A service as batchGet answers it (serviceusage.v1's GoogleApiServiceusageV1Service)."""
        return {"name": f"projects/{project}/services/{service}", "parent": f"projects/{project}",
                "config": {"name": service}, "state": "DISABLED" if service in self.disabled else "ENABLED"}

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

    def token(self, form: str) -> tuple[int, dict]:
        """OAuth's token endpoint: a service account's signed JWT (grant type jwt-bearer; the signature
        is not checked) gets an access token; anything else (a refresh token) invalid_grant."""
        fields = {key: values[0] for key, values in parse_qs(form).items()}
        if fields.get("grant_type") != JWT_BEARER:
            return 400, {"error": "invalid_grant", "error_description": "Token has been expired or revoked."}
        return 200, {"access_token": f"ya29.fake-{next(self._ids)}", "expires_in": 3599, "token_type": "Bearer",
                     "scope": fields.get("scope", SCOPE)}


def bucket(limit: int, **dimensions: str) -> dict:
    """A quota bucket as Service Usage shows it: ``limit`` where ``dimensions`` say (none: the
    default everywhere else), with a default limit of 0."""
    found = {"effectiveLimit": str(limit), "defaultLimit": "0"}
    return {**found, "dimensions": dimensions} if dimensions else found


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
