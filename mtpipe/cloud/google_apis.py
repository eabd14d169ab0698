"""The Google APIs besides Compute that the checks before spending read: OS Login (import our SSH
key, get the POSIX user), Organization Policy (the effective policy of a constraint) and Cloud
Resource Manager (which permissions the caller has on the project).

Their Python client libraries are not in the lock, so these are plain REST calls through
google-auth's AuthorizedSession with the credentials every Compute client uses
(gcp.client_kwargs); `MTPIPE_COMPUTE_ENDPOINT`, when set, takes them to that endpoint too (the
loopback fakes in tests). Google's error answers become google.api_core exceptions, so
gcp.explained words them as it words Compute's.
"""

from __future__ import annotations

import os
from urllib.parse import quote

import google.auth.transport.requests
from google.api_core import exceptions as gexc
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import AuthorizedSession

from mtpipe.cloud.gcp import ENDPOINT_ENV, client_kwargs, explained

ROOTS = {"oslogin": "https://oslogin.googleapis.com", "orgpolicy": "https://orgpolicy.googleapis.com",
         "cloudresourcemanager": "https://cloudresourcemanager.googleapis.com",
         "tokeninfo": "https://oauth2.googleapis.com"}
TIMEOUT_S = 60


class GoogleApis:
    """REST calls to the APIs in ROOTS with the Compute clients' credentials."""

    def __init__(self) -> None:
        self.credentials = client_kwargs()["credentials"]
        self.session = AuthorizedSession(self.credentials)
        self.endpoint = os.environ.get(ENDPOINT_ENV)

    def call(self, api: str, method: str, path: str, body: dict | None = None,
             params: dict[str, str] | None = None) -> dict:
        """One request (``path`` under the API's root, e.g. ``v1/users/X:importSshPublicKey``); its
        JSON answer; a google.api_core exception for an error answer."""
        url = f"{self.endpoint or ROOTS[api]}/{path}"
        answer = self.session.request(method, url, json=body, params=params, timeout=TIMEOUT_S)
        if answer.status_code >= 400:
            raise gexc.from_http_response(answer)
        return answer.json() if answer.content else {}

    def account(self) -> str | None:
        """The email of the credentials: a service account's from its key, a user's from Google's
        tokeninfo for the access token; None when neither tells (e.g. anonymous credentials)."""
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
