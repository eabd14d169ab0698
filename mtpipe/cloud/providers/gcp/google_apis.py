"""The Google APIs besides Compute that the checks before spending call: OS Login (import our SSH
key, get the POSIX user), Organization Policy (the effective policy of a constraint), Cloud
Resource Manager and IAM (which permissions the caller has on the project, on a service account),
Service Usage (which APIs the project has enabled; enabling them; a quota's limits), Cloud Quotas (a
quota's limit in each zone) and OAuth's tokeninfo (whose credentials these are).

Their Python client libraries are not in the lock, so these are plain REST calls through
google-auth's AuthorizedSession with the credentials every Compute client uses
(api_errors.client_kwargs); `MTPIPE_COMPUTE_ENDPOINT`, when set, takes them to that endpoint too (the
loopback fakes in tests). Google's error answers become google.api_core exceptions, so
api_errors.explained words them as it words Compute's.
"""

from __future__ import annotations

import functools
import os
import time
from urllib.parse import quote

import google.auth.transport.requests
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession

from mtpipe.cloud.providers.gcp.api_errors import ENDPOINT_ENV, GcpError, client_kwargs, explained



class Unknown(Exception):
    """A check that cannot tell (a policy it may not read, an API it may not ask): reported as unknown,
    never as fine (mtpipe.cloud.checks.prerequisites)."""


ROOTS = {"oslogin": "https://oslogin.googleapis.com", "orgpolicy": "https://orgpolicy.googleapis.com",
         "cloudresourcemanager": "https://cloudresourcemanager.googleapis.com",
         "iam": "https://iam.googleapis.com", "serviceusage": "https://serviceusage.googleapis.com",
         "cloudquotas": "https://cloudquotas.googleapis.com", "tokeninfo": "https://oauth2.googleapis.com"}
TIMEOUT_S = 60
ENABLE_TIMEOUT_S = 300   # Service Usage enables an API within a minute or two ("this may take a minute": sky check)


def rest_call(session: AuthorizedSession, method: str, url: str, body: dict | None = None,
              params: dict[str, str | list[str]] | None = None) -> dict:
    """One REST request to a Google API; its JSON answer; a google.api_core exception for an error answer."""
    answer = session.request(method, url, json=body, params=params, timeout=TIMEOUT_S)
    if answer.status_code >= 400:
        raise gexc.from_http_response(answer)
    return answer.json() if answer.content else {}


class GoogleApis:
    """REST calls to the APIs in ROOTS with the Compute clients' credentials."""

    def __init__(self) -> None:
        self.credentials = client_kwargs()["credentials"]
        self.session = AuthorizedSession(self.credentials)
        self.endpoint = os.environ.get(ENDPOINT_ENV)

    def call(self, api: str, method: str, path: str, body: dict | None = None,
             params: dict[str, str | list[str]] | None = None) -> dict:
        """One request (``path`` under the API's root, e.g. ``v1/users/X:importSshPublicKey``); its
        JSON answer; a google.api_core exception for an error answer."""
        return rest_call(self.session, method, f"{self.endpoint or ROOTS[api]}/{path}", body, params)

    def account(self) -> str | None:
        """The email of the credentials: a service account's from its key, a user's from Google's
        tokeninfo for the access token; None when neither tells (e.g. anonymous credentials). Asked
        once."""
        return self._email

    @functools.cached_property
    def _email(self) -> str | None:
        email = getattr(self.credentials, "service_account_email", None)
        if email and email != "default":
            return email
        if isinstance(self.credentials, AnonymousCredentials):
            return None
        with explained("reading the email of the Google credentials"):
            if not self.credentials.valid:
                self.credentials.refresh(google.auth.transport.requests.Request())
            info = self.call("tokeninfo", "GET", "tokeninfo", params={"access_token": self.credentials.token})
        return info.get("email")

    def effective_policy(self, project: str, constraint: str) -> dict:
        """orgpolicy.projects.policies.getEffectivePolicy: the rules of ``constraint`` that hold for
        ``project`` (what its organisation and folders set, merged)."""
        with explained(f"reading the organisation policy {constraint} of project {project}", project):
            return self.call("orgpolicy", "GET", f"v2/projects/{project}/policies/{constraint}:getEffectivePolicy")

    def import_ssh_key(self, account: str, project: str, public_key: str) -> dict:
        """oslogin.users.importSshPublicKey: ``public_key`` into ``account``'s OS Login profile (for
        ``project``); the login profile, with its POSIX accounts."""
        with explained(f"importing the SSH key into the OS Login profile of {account}", project):
            answer = self.call("oslogin", "POST", f"v1/users/{quote(account, safe='@')}:importSshPublicKey",
                               body={"key": public_key}, params={"projectId": project})
        return answer.get("loginProfile", {})

    def granted(self, project: str, permissions: list[str]) -> set[str]:
        """cloudresourcemanager.projects.testIamPermissions: which of ``permissions`` the caller has."""
        with explained(f"testing the caller's permissions on project {project}", project):
            answer = self.call("cloudresourcemanager", "POST", f"v3/projects/{project}:testIamPermissions",
                               body={"permissions": permissions})
        return set(answer.get("permissions", []))

    def granted_on_service_account(self, email: str, permissions: list[str]) -> set[str]:
        """iam.projects.serviceAccounts.testIamPermissions: which of ``permissions`` the caller has on
        service account ``email`` (granted there, or on its project and above)."""
        with explained(f"testing the caller's permissions on service account {email}"):
            answer = self.call("iam", "POST", f"v1/projects/-/serviceAccounts/{email}:testIamPermissions",
                               body={"permissions": permissions})
        return set(answer.get("permissions", []))

    def enabled_services(self, project: str, services: list[str]) -> set[str]:
        """serviceusage.services.batchGet: which of ``services`` (e.g. compute.googleapis.com) are
        ENABLED in ``project`` (at most 30 at a time, more than a run uses)."""
        with explained(f"reading which APIs project {project} has enabled", project):
            answer = self.call("serviceusage", "GET", f"v1/projects/{project}/services:batchGet",
                               params={"names": [f"projects/{project}/services/{s}" for s in services]})
        return {s["name"].rsplit("/", 1)[-1] for s in answer.get("services", []) if s.get("state") == "ENABLED"}

    def quota_buckets(self, project: str, service: str, metric: str) -> list[dict]:
        """serviceusage v1beta1 services.consumerQuotaMetrics.get, view FULL: the quota buckets (each
        with its ``dimensions`` and ``effectiveLimit``) of ``metric`` of ``service`` for ``project``,
        a bucket for every region or zone it applies to; [] when the project has no such metric. The
        metric is a segment of the resource name, its "/" written %2F (compute.googleapis.com%2Fcpus)."""
        name = f"projects/{project}/services/{service}/consumerQuotaMetrics/{quote(metric, safe='')}"
        with explained(f"reading the quota {metric} of project {project}", project):
            try:
                answer = self.call("serviceusage", "GET", f"v1beta1/{name}", params={"view": "FULL"})
            except gexc.NotFound:
                return []
        return [bucket for limit in answer.get("consumerQuotaLimits", []) for bucket in limit.get("quotaBuckets", [])]

    def quota_info(self, project: str, service: str, quota_id: str) -> dict | None:
        """Cloud Quotas v1 quotaInfos.get: the QuotaInfo of ``quota_id`` of ``service`` for ``project``, its
        ``dimensionsInfos`` holding the limit (``details.value``) where each one's ``dimensions`` say, the
        most specific first; None when Cloud Quotas has no such quota."""
        name = f"projects/{project}/locations/global/services/{service}/quotaInfos/{quota_id}"
        with explained(f"reading the quota {quota_id} of {service} in project {project}", project):
            try:
                return self.call("cloudquotas", "GET", f"v1/{name}")
            except gexc.NotFound:
                return None

    def enable_services(self, project: str, services: list[str]) -> None:
        """serviceusage.services.batchEnable, then its operation polled until done (at most
        ENABLE_TIMEOUT_S); a GcpError when Google refuses or the operation fails."""
        action = f"enabling {', '.join(services)} in project {project}"
        with explained(action, project):
            operation = self.call("serviceusage", "POST", f"v1/projects/{project}/services:batchEnable",
                                  body={"serviceIds": services})
            deadline = time.monotonic() + ENABLE_TIMEOUT_S
            while not operation.get("done"):
                if time.monotonic() > deadline:
                    raise GcpError(f"{action}: not done after {ENABLE_TIMEOUT_S} s (operation {operation['name']})")
                time.sleep(2)
                operation = self.call("serviceusage", "GET", f"v1/{operation['name']}")
        if "error" in operation:
            raise GcpError(f"{action}: {operation['error'].get('message', operation['error'])}")


def member(account: str) -> str:
    """An IAM principal for ``account``: serviceAccount:EMAIL for a service account, else user:EMAIL."""
    return ("serviceAccount:" if account.endswith(".gserviceaccount.com") else "user:") + account


def enforced(policy: dict) -> bool:
    """Whether a boolean constraint's effective policy is enforced (a rule with ``enforce: true``
    and no condition)."""
    return any(rule.get("enforce") and not rule.get("condition")
               for rule in policy.get("spec", {}).get("rules", []))


def denies(policy: dict, value: str) -> bool:
    """Whether a list constraint's effective policy refuses ``value`` (e.g. a VM's
    projects/P/zones/Z/instances/NAME for compute.vmExternalIpAccess): a rule denies all, lists it
    among ``deniedValues``, or lists ``allowedValues`` without it (with no rule allowing all)."""
    rules = [r for r in policy.get("spec", {}).get("rules", []) if not r.get("condition")]
    if any(r.get("allowAll") for r in rules):
        return False

    def listed(values: list[str]) -> bool:
        return any(v.removeprefix("is:") == value for v in values)

    allowed = [v for r in rules for v in r.get("values", {}).get("allowedValues", [])]
    denied = [v for r in rules for v in r.get("values", {}).get("deniedValues", [])]
    return any(r.get("denyAll") for r in rules) or listed(denied) or (bool(allowed) and not listed(allowed))
