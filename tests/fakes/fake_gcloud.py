"""A stand-in for `gcloud compute start-iap-tunnel NAME PORT --listen-on-stdin --zone Z --project P`,
the command mtpipe runs as SSH's proxy for a VM without an external IP: it relays stdin/stdout to
127.0.0.1:PORT (the loopback VM's sshd), as IAP relays them to the VM; for `gcloud config get-value
KEY` it prints the variable CONFIG names for KEY ($FAKE_GCLOUD_ACCOUNT: the account the tunnel runs
as; $FAKE_GCLOUD_IMPERSONATE: the service account it impersonates; $FAKE_GCLOUD_PROJECT) or the
sign-ins' value, or, as gcloud does for an unset key, nothing on stdout and `(unset)` on stderr; `gcloud storage buckets create gs://B
[--project=P] [--location=L]` and `gcloud storage buckets add-iam-policy-binding gs://B --member=M
--role=R` against the GCS emulator at $FAKE_GCS_ENDPOINT (buckets.insert, which fails as gcloud does
for a bucket that exists; getIamPolicy, then setIamPolicy with the member added to the role's binding);
`gcloud services enable S... [--project=P]` against the fake Service Usage at $MTPIPE_COMPUTE_ENDPOINT
(batchEnable, then its operation polled until done).

A new user's sign-ins, kept in $CLOUDSDK_CONFIG/fake-gcloud.json (gcloud's own configuration
directory variable; without it they are not served): `gcloud auth login` (the browser's account:
$FAKE_GCLOUD_LOGIN, else newcomer@example.com, becomes gcloud's account), `gcloud config set project
P`, `gcloud auth application-default login` (the Application Default Credentials, recorded only:
the other fakes take anonymous ones) and `gcloud auth application-default set-quota-project P`,
which fails, as gcloud does, before that login. Each call's argv is appended to the file named by
$FAKE_GCLOUD_LOG. :func:`install` puts it on a PATH as `gcloud`; any other gcloud command fails.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path


# gcloud's configuration keys this fake answers, and the environment variable holding each one's value
CONFIG = {"account": "FAKE_GCLOUD_ACCOUNT", "auth/impersonate_service_account": "FAKE_GCLOUD_IMPERSONATE",
          "project": "FAKE_GCLOUD_PROJECT"}


def install(directory: Path) -> Path:
    """Write an executable `gcloud` into ``directory`` that runs this file; return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "gcloud"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {Path(__file__).resolve()} \"$@\"\n")
    script.chmod(0o755)
    return directory


def main(argv: list[str]) -> int:
    if os.environ.get("FAKE_GCLOUD_LOG"):
        with open(os.environ["FAKE_GCLOUD_LOG"], "a") as log:
            log.write(" ".join(argv) + "\n")
    if argv[:2] == ["config", "get-value"] and len(argv) == 3 and argv[2] in CONFIG:
        value = os.environ.get(CONFIG[argv[2]]) or signed_in().get(argv[2])
        print(value or "(unset)", file=sys.stdout if value else sys.stderr)
        return 0
    if argv[:1] == ["auth"] or argv[:2] == ["config", "set"]:
        return sign_in(argv)
    if argv[:2] == ["storage", "buckets"] and argv[2] in ("create", "add-iam-policy-binding"):
        return storage_buckets(argv[2], argv[3].removeprefix("gs://"),
                               dict(a.removeprefix("--").split("=", 1) for a in argv[4:]))
    if argv[:2] == ["services", "enable"]:
        flags = dict(a.removeprefix("--").split("=", 1) for a in argv[2:] if a.startswith("--"))
        return services_enable([a for a in argv[2:] if not a.startswith("--")],
                               flags.get("project") or signed_in().get("project", "proj-1"))
    if argv[:2] != ["compute", "start-iap-tunnel"] or "--listen-on-stdin" not in argv:
        print(f"fake gcloud: {' '.join(argv)}: not served", file=sys.stderr)
        return 2
    conn = socket.create_connection(("127.0.0.1", int(argv[3])))

    def upstream() -> None:
        while data := os.read(0, 65536):
            conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    while data := conn.recv(65536):
        os.write(1, data)
    return 0


def storage_buckets(command: str, bucket: str, flags: dict[str, str]) -> int:
    """`gcloud storage buckets create` / `add-iam-policy-binding` against the emulator's JSON API."""
    def call(method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(f"{os.environ['FAKE_GCS_ENDPOINT']}/storage/v1/{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as answer:
            return json.loads(answer.read() or b"{}")

    if command == "create":
        project = flags.get("project") or signed_in().get("project", "proj-1")
        try:
            call("POST", f"b?project={project}",
                 {"name": bucket, **({"location": flags["location"]} if "location" in flags else {})})
        except urllib.error.HTTPError as err:
            print(f"ERROR: (gcloud.storage.buckets.create) HTTPError {err.code}: {err.read().decode()[:200]}",
                  file=sys.stderr)
            return 1
        print(f"Creating gs://{bucket}/...", file=sys.stderr)
        return 0
    bindings = call("GET", f"b/{bucket}/iam").get("bindings", [])
    same_role = [b for b in bindings if b["role"] == flags["role"] and "condition" not in b]
    if same_role:
        same_role[0]["members"] = sorted({*same_role[0]["members"], flags["member"]})
    else:
        bindings.append({"role": flags["role"], "members": [flags["member"]]})
    print(json.dumps(call("PUT", f"b/{bucket}/iam", {"bindings": bindings}), indent=2))
    return 0


def services_enable(services: list[str], project: str) -> int:
    """`gcloud services enable`: serviceusage's batchEnable, then its operation until done."""
    def call(method: str, path: str, body: dict | None = None) -> dict:
        request = urllib.request.Request(f"{os.environ['MTPIPE_COMPUTE_ENDPOINT']}/v1/{path}", method=method,
                                         data=json.dumps(body).encode() if body is not None else None,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10) as answer:
            return json.loads(answer.read())

    operation = call("POST", f"projects/{project}/services:batchEnable", {"serviceIds": services})
    while not operation.get("done"):
        operation = call("GET", operation["name"])
    print(f"Operation \"{operation['name']}\" finished successfully.", file=sys.stderr)
    return 0


def state_file() -> Path | None:
    """Where the sign-ins are kept: beside gcloud's configuration ($CLOUDSDK_CONFIG), None without it."""
    return Path(os.environ["CLOUDSDK_CONFIG"]) / "fake-gcloud.json" if os.environ.get("CLOUDSDK_CONFIG") else None


def signed_in() -> dict[str, str]:
    """The sign-ins so far: account, project, adc_account, adc_quota_project."""
    path = state_file()
    return json.loads(path.read_text()) if path and path.is_file() else {}


def sign_in(argv: list[str]) -> int:
    """`auth login`, `config set project P`, `auth application-default login|set-quota-project P`."""
    path, state = state_file(), signed_in()
    account = os.environ.get("FAKE_GCLOUD_LOGIN", "newcomer@example.com")
    if path is None:
        print(f"fake gcloud: {' '.join(argv)}: not served without CLOUDSDK_CONFIG", file=sys.stderr)
        return 2
    if argv == ["auth", "login"]:
        state["account"] = account
        print(f"You are now logged in as [{account}].", file=sys.stderr)
    elif argv[:3] == ["config", "set", "project"] and len(argv) == 4:
        state["project"] = argv[3]
        print("Updated property [core/project].", file=sys.stderr)
    elif argv == ["auth", "application-default", "login"]:
        state["adc_account"] = account
        print(f"Credentials saved to file: [{path.parent / 'application_default_credentials.json'}]",
              file=sys.stderr)
    elif argv[:3] == ["auth", "application-default", "set-quota-project"] and len(argv) == 4:
        if "adc_account" not in state:
            print("ERROR: (gcloud.auth.application-default.set-quota-project) Application default credentials "
                  "have not been set up. Run $ gcloud auth application-default login to set it up first.",
                  file=sys.stderr)
            return 1
        state["adc_quota_project"] = argv[3]
        print(f"Quota project \"{argv[3]}\" was added to ADC which can be used by Google client libraries "
              "for billing and quota.", file=sys.stderr)
    else:
        print(f"fake gcloud: {' '.join(argv)}: not served", file=sys.stderr)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(state))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
