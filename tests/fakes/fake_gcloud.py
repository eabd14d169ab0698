"""A stand-in for `gcloud compute start-iap-tunnel NAME PORT --listen-on-stdin --zone Z --project P`,
the command mtpipe runs as SSH's proxy for a VM without an external IP: it relays stdin/stdout to
127.0.0.1:PORT (the loopback VM's sshd), as IAP relays them to the VM; and for `gcloud config
get-value account` (the account the tunnel runs as) it prints $FAKE_GCLOUD_ACCOUNT, or, as gcloud
does without one, nothing on stdout and `(unset)` on stderr; `gcloud storage buckets create gs://B
[--project=P] [--location=L]` and `gcloud storage buckets add-iam-policy-binding gs://B --member=M
--role=R` against the GCS emulator at $FAKE_GCS_ENDPOINT (buckets.insert; getIamPolicy, then
setIamPolicy with the binding added). Each call's argv is appended to the file named by
$FAKE_GCLOUD_LOG. :func:`install` puts it on a PATH as `gcloud`; any other gcloud command fails.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import urllib.request
from pathlib import Path


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
    if argv == ["config", "get-value", "account"]:
        account = os.environ.get("FAKE_GCLOUD_ACCOUNT")
        print(account or "(unset)", file=sys.stdout if account else sys.stderr)
        return 0
    if argv[:2] == ["storage", "buckets"] and argv[2] in ("create", "add-iam-policy-binding"):
        return storage_buckets(argv[2], argv[3].removeprefix("gs://"),
                               dict(a.removeprefix("--").split("=", 1) for a in argv[4:]))
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
        call("POST", f"b?project={flags.get('project', 'proj-1')}",
             {"name": bucket, **({"location": flags["location"]} if "location" in flags else {})})
        print(f"Creating gs://{bucket}/...", file=sys.stderr)
        return 0
    policy = call("GET", f"b/{bucket}/iam")
    bindings = policy.get("bindings", []) + [{"role": flags["role"], "members": [flags["member"]]}]
    print(json.dumps(call("PUT", f"b/{bucket}/iam", {"bindings": bindings}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
