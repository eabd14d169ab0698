"""Google's answers worded for the user (:func:`explained`: credentials, quota, a disabled API, a missing
permission), and the credentials and endpoint every Google client is made with (:func:`client_kwargs`).

`MTPIPE_COMPUTE_ENDPOINT` points every client at another endpoint (the loopback fake in tests); only
then, and only without GOOGLE_APPLICATION_CREDENTIALS, anonymous credentials are used.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

import google.auth
from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials

from mtpipe.cloud.providers.interface import ProviderError, QuotaExceeded

ENDPOINT_ENV = "MTPIPE_COMPUTE_ENDPOINT"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"
CREDENTIALS_FIX = (
    "run `gcloud auth application-default login` (as a service account: add "
    "--impersonate-service-account=SA, which needs no key file) and retry"
)


class GcpError(ProviderError):
    """A Google Cloud failure, worded for the user: what Google answered and how to fix it."""


class PermissionDenied(GcpError):
    """Google answered 403 for a missing permission (not a quota, not a disabled API)."""


QUOTA_NAME = re.compile(r"Quota '([^']+)' exceeded")
QUOTA_REASONS = {"quotaExceeded", "rateLimitExceeded", "QUOTA_EXCEEDED"}


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
                  "iam.googleapis.com": "Identity and Access Management (IAM) API",
                  "tpu.googleapis.com": "Cloud TPU API"}
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
