"""A stand-in for `gcloud compute start-iap-tunnel NAME PORT --listen-on-stdin --zone Z --project P`,
the command mtpipe runs as SSH's proxy for a VM without an external IP: it relays stdin/stdout to
127.0.0.1:PORT (the loopback VM's sshd), as IAP relays them to the VM; and for `gcloud config
get-value account` (the account the tunnel runs as) it prints $FAKE_GCLOUD_ACCOUNT, or, as gcloud
does without one, nothing on stdout and `(unset)` on stderr. Each call's argv is appended to the file
named by $FAKE_GCLOUD_LOG. :func:`install` puts it on a PATH as `gcloud`; any other gcloud command
fails.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
