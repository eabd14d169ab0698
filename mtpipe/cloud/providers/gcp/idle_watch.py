"""The VM deletes itself when nothing of vm_run has run on it for ``idle.delete_after_s`` (conf/vm.yaml).

The watch runs on the VM, from its startup script (instance metadata ``startup-script``, run as root
at boot by the guest agent), so it holds when the laptop is gone, before any setup, and for
reservation-bound VMs, whose maxRunDuration is not known to hold. What vm_run runs over SSH (setup,
shipping, the pipeline) holds a shared lock on ``idle.lock_file`` (``flock -s``, mtpipe.cloud.on_vm.ssh);
the watch counts the VM busy while anyone holds it. Idle that long, it asks the metadata server who
it is and sends Compute's ``instances.delete`` for itself with the VM's service account token; where
that account may not delete it (401/403), it runs ``idle.poweroff_command``: a stopped Compute VM bills
its disk only. It stops once the metadata server no longer answers (not a VM any more).

At its start the watch proves whether it may delete the VM at all: Resource Manager's
``projects.testIamPermissions`` with that same token for the permission the delete takes
(``compute.instances.delete``, ``tpu.nodes.delete`` for a TPU API node), its answer written to
``<lock>.may-delete`` (``granted``, ``refused``, or ``unknown ...``), which vm_run reads after the setup.

On the Cloud TPU API route (``--tpu URL --tpu-name NAME``: the node's ``startup-script`` metadata,
mtpipe.cloud.providers.gcp.tpu_api.bodies) the VM is a node of a queued resource, both named NAME: idle,
it sends ``queuedResources.delete`` with ``force=true`` for NAME (its node goes with it) in the zone
the metadata server names, or, when there is no such queued resource (404), ``nodes.delete`` for NAME.
A node that may not delete itself is powered off all the same, but a stopped TPU node is not known
to stop its billing: the watch's log and vm_run say so, and `doit vm_down` deletes it.

This file runs on the VM as a script with the standard library only: :func:`startup_script` sends it.
    python3 idle_watch.py --idle-s 1800 --poll-s 60 --lock /tmp/mtpipe-busy --metadata HOST \
        --compute https://compute.googleapis.com --poweroff 'shutdown -h now'
    python3 idle_watch.py ... --tpu https://tpu.googleapis.com --tpu-name mt-test   (a TPU API node)
(the startup script writes it beside the lock file, <lock>.watch.py, and its log, <lock>.log).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

COMPUTE_URL = "https://compute.googleapis.com"
TPU_URL = "https://tpu.googleapis.com"
RESOURCE_MANAGER_URL = "https://cloudresourcemanager.googleapis.com"
MAY_DELETE = ".may-delete"   # beside the lock file: whether the VM's account may delete it
METADATA_HOST = "metadata.google.internal"   # the VM's metadata server (GCE_METADATA_HOST elsewhere)
LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def busy(lock: str) -> bool:
    """Whether a vm_run command holds ``lock`` (a missing file: nobody ever did)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def metadata(host: str, path: str) -> str:
    """One value of the VM's metadata server (``instance/name``, ``project/project-id``, ...)."""
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/{path}", headers={"Metadata-Flavor": "Google"})
    with LOOPBACK.open(request, timeout=10) as answer:
        return answer.read().decode()


def send_delete(url: str, token: str) -> int:
    """One DELETE with the bearer ``token``; the HTTP status."""
    request = urllib.request.Request(url, method="DELETE", headers={"Authorization": f"Bearer {token}"})
    try:
        with LOOPBACK.open(request, timeout=60) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


def delete_self(host: str, compute: str, tpu: str = "", tpu_name: str = "") -> tuple[int, str]:
    """Delete this VM with its service account's token: Compute's instances.delete, or with ``tpu`` (the
    Cloud TPU API's root) queuedResources.delete (force) of ``tpu_name``, else nodes.delete of it when
    there is no such queued resource; (the HTTP status, the call made)."""
    project = metadata(host, "project/project-id")
    zone = metadata(host, "instance/zone").rsplit("/", 1)[-1]
    token = json.loads(metadata(host, "instance/service-accounts/default/token"))["access_token"]
    if not tpu:
        name = metadata(host, "instance/name")
        url = f"{compute}/compute/v1/projects/{project}/zones/{zone}/instances/{name}"
        return send_delete(url, token), "instances.delete"
    location = f"{tpu}/v2/projects/{project}/locations/{zone}"
    status = send_delete(f"{location}/queuedResources/{tpu_name}?force=true", token)
    if status != 404:
        return status, "queuedResources.delete"
    return send_delete(f"{location}/nodes/{tpu_name}", token), "nodes.delete"


def may_delete(host: str, resource_manager: str, tpu: str = "") -> str:
    """Whether the VM's service account holds the permission its delete takes (``tpu.nodes.delete`` with
    ``tpu``, else ``compute.instances.delete``), by projects.testIamPermissions with its own token:
    ``granted``, ``refused``, or ``unknown (...)`` when the test itself failed."""
    permission = "tpu.nodes.delete" if tpu else "compute.instances.delete"
    try:
        project = metadata(host, "project/project-id")
        token = json.loads(metadata(host, "instance/service-accounts/default/token"))["access_token"]
        request = urllib.request.Request(
            f"{resource_manager}/v3/projects/{project}:testIamPermissions", method="POST",
            data=json.dumps({"permissions": [permission]}).encode(),
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
        with LOOPBACK.open(request, timeout=30) as answer:
            granted = json.loads(answer.read() or b"{}").get("permissions", [])
    except urllib.error.HTTPError as err:
        return f"unknown (testIamPermissions for {permission}: HTTP {err.code})"
    except (OSError, ValueError, KeyError) as err:
        return f"unknown (testIamPermissions for {permission}: {err})"
    return "granted" if permission in granted else "refused"


def watch(idle_s: float, poll_s: float, lock: str, host: str, compute: str, poweroff: str, tpu: str = "",
          tpu_name: str = "") -> str:
    """Poll until the VM has been idle for ``idle_s``, then delete it (:func:`delete_self`) or power it
    off; what was done."""
    last_busy = time.monotonic()
    while True:
        try:
            metadata(host, "instance/name")
        except OSError:
            return "stopped: no metadata server answers (not on a VM)"
        now = time.monotonic()
        if busy(lock):
            last_busy = now
        elif now - last_busy >= idle_s:
            status, call = delete_self(host, compute, tpu, tpu_name)
            if status < 300:
                return f"idle for {idle_s:g} s: deleting this VM ({call}: HTTP {status})"
            if status in (401, 403):
                subprocess.run(shlex.split(poweroff), check=False)
                still = ("; a stopped TPU node is not known to stop billing: delete it with `doit vm_down`"
                         if tpu else "")
                return f"idle for {idle_s:g} s: not allowed to delete this VM (HTTP {status}): powered off{still}"
            print(f"mtpipe idle watch: {call} answered HTTP {status}; trying again", flush=True)
        time.sleep(poll_s)


def startup_script(idle: Any, metadata_host: str, compute: str = COMPUTE_URL, tpu: str = "",
                   tpu_name: str = "", resource_manager: str = RESOURCE_MANAGER_URL) -> str:
    """The VM's startup script: write this file and start the watch, detached (``idle``: conf/vm.yaml's);
    with ``tpu`` (the Cloud TPU API's root) the watch deletes the queued resource or node ``tpu_name``."""
    args = ["--idle-s", str(idle.delete_after_s), "--poll-s", str(idle.poll_s), "--lock", idle.lock_file,
            "--metadata", metadata_host, "--compute", compute, "--poweroff", idle.poweroff_command,
            "--resource-manager", resource_manager]
    if tpu:
        args += ["--tpu", tpu, "--tpu-name", tpu_name]
    watch_file, log = (shlex.quote(f"{idle.lock_file}{suffix}") for suffix in (".watch.py", ".log"))
    return "\n".join([
        "#!/bin/bash",
        f"# mtpipe: delete this VM after {idle.delete_after_s} s with nothing of vm_run running (conf/vm.yaml idle:)",
        f"cat > {watch_file} <<'END_OF_IDLE_WATCH'",
        Path(__file__).read_text().rstrip("\n"),
        "END_OF_IDLE_WATCH",
        # owned by root, /tmp's owner, and writable by all: every SSH user's `flock -s` may open it (a file
        # another user made in a sticky directory refuses their O_CREAT under fs.protected_regular)
        f"touch {shlex.quote(idle.lock_file)} && chmod 666 {shlex.quote(idle.lock_file)}",
        f"nohup setsid python3 {watch_file} {shlex.join(args)} >> {log} 2>&1 < /dev/null &",
        "",
    ])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, required=True)
    parser.add_argument("--poll-s", type=float, required=True)
    parser.add_argument("--lock", required=True)
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--compute", required=True)
    parser.add_argument("--poweroff", required=True)
    parser.add_argument("--tpu", default="", help="the Cloud TPU API's root: the VM is a TPU API node")
    parser.add_argument("--tpu-name", default="", help="its queued resource's and node's name")
    parser.add_argument("--resource-manager", default=RESOURCE_MANAGER_URL, help="where testIamPermissions is asked")
    a = parser.parse_args(argv)
    if a.tpu and not a.tpu_name:
        parser.error("--tpu needs --tpu-name")
    found = may_delete(a.metadata, a.resource_manager, a.tpu)
    Path(a.lock + MAY_DELETE).write_text(found + "\n")
    print(f"mtpipe idle watch: may this VM's service account delete it? {found}", flush=True)
    done = watch(a.idle_s, a.poll_s, a.lock, a.metadata, a.compute, a.poweroff, a.tpu, a.tpu_name)
    print(f"mtpipe idle watch: {done}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
