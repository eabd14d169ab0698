"""Whether a Cloud TPU API node may delete itself, read on it after the setup and said before training.

The node's idle watch (mtpipe/cloud/providers/gcp/idle_watch.py) tests at its start, with the node's own
token, whether its service account holds ``tpu.nodes.delete``, and writes ``granted``, ``refused`` or
``unknown (...)`` beside its lock file (``<lock>.may-delete``). Refused, nothing on the node can delete it
when idle: it powers off, and a stopped TPU node is not known to stop billing. vm_run then says so before
training: this laptop's run (which deletes the node when it ends, unless --keep) and ``doit vm_down`` are
what deletes it. vm_run has no detached mode (it always waits for the run), so there is none to refuse.
"""

from __future__ import annotations

import shlex

from mtpipe.cloud.on_vm.ssh import Remote, run
from mtpipe.cloud.providers.gcp.idle_watch import MAY_DELETE
from mtpipe.cloud.settings.vm_config import VmConfig

FIX = ("grant the node's service account a role holding tpu.nodes.delete (roles/tpu.admin), or set "
       "service_account: in conf/vm.yaml to one that holds it")


def verdict(remote: Remote, cfg: VmConfig) -> str:
    """The idle watch's answer on the VM (``granted``, ``refused``, ``unknown (...)``); '' when it wrote none."""
    rc, out = run(remote, f"cat {shlex.quote(cfg.idle.lock_file + MAY_DELETE)} 2>/dev/null || true", stream=False)
    return out.decode(errors="replace").strip() if rc == 0 else ""


def check(remote: Remote, cfg: VmConfig, keep: bool) -> str:
    """The line vm_run says before training about who deletes the node (``keep``: it outlives the run)."""
    if not cfg.idle.delete_after_s:
        return f"node {cfg.name} has no idle watch (idle.delete_after_s: 0): `doit vm_down` deletes it"
    found = verdict(remote, cfg)
    after = ("with --keep it stays after this run, and only `doit vm_down` deletes it" if keep else
             "this run deletes it when it ends; if this laptop stops first, only `doit vm_down` does")
    if found == "granted":
        return f"node {cfg.name} may delete itself once idle for {cfg.idle.delete_after_s:g} s (tpu.nodes.delete granted)"
    if found == "refused":
        return (f"WARNING: node {cfg.name}'s service account may not delete it (tpu.nodes.delete refused to its "
                "own token): idle, it powers off, and a stopped TPU node is not known to stop billing; "
                f"{after} ({FIX}; vm_run has no detached mode)")
    return (f"whether node {cfg.name} may delete itself is not known ({found or f'no {cfg.idle.lock_file}{MAY_DELETE}'} "
            f"from its idle watch): {after}")
