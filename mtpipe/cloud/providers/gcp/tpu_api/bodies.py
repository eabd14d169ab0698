"""What the Cloud TPU API is sent for a VM: the queued resource with one node spec (accelerator type,
runtime, network with an external IP, SSH metadata, the idle watch's startup script, labels, network tags for the SSH firewall rule,
the service account), its tier (Spot, reserved or on-demand) and how long it may queue; and how a node
or a queued resource reads as the VM the lifecycle knows (:class:`TpuVm`, its status mapped to Compute's)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from mtpipe.cloud.providers.gcp import idle_watch
from mtpipe.cloud.providers.gcp.api_errors import ENDPOINT_ENV
from mtpipe.cloud.providers.gcp.bodies import ssh_metadata
from mtpipe.cloud.providers.interface import WAITING_FOR_CAPACITY, region
from mtpipe.cloud.providers.gcp.tpu_api.client import endpoint
from mtpipe.cloud.settings import vm_config

# A node's state (tpu.v2 Node.state) as the status the lifecycle reads (Compute's Instance.status).
NODE_STATUS = {"READY": "RUNNING", "CREATING": "PROVISIONING", "STARTING": "STAGING", "RESTARTING": "STAGING",
               "REPAIRING": "STAGING", "REIMAGING": "STAGING", "PREEMPTED": "TERMINATED", "TERMINATED": "TERMINATED",
               "STOPPED": "TERMINATED", "STOPPING": "STOPPING", "DELETING": "STOPPING"}
# A queued resource still looking for, or setting up, its capacity: no node to reach yet.
QUEUED = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")
# gRPC codes of a FAILED queued resource that mean "no capacity": RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED
# (its validUntilDuration ran out), UNAVAILABLE.
CAPACITY_CODES = {8, 4, 14}
TIERS = {"spot": "SPOT", "reservation": "RESERVED", "on-demand": "STANDARD"}


@dataclass
class TpuVm:
    """A TPU VM as the lifecycle sees an instance: ``name``, ``status`` (Compute's words: NODE_STATUS;
    a queued resource without its node is PENDING, or its own state FAILED / SUSPENDED...),
    ``creation_timestamp`` (ISO 8601), ``labels``; the node and the queued resource behind it."""

    name: str
    status: str
    creation_timestamp: str
    labels: dict[str, str]
    node: dict[str, Any] | None = None
    queued: dict[str, Any] | None = field(default=None, repr=False)


def queued_state(queued: dict) -> str:
    return queued.get("state", {}).get("state", "STATE_UNSPECIFIED")


def as_vm(name: str, node: dict | None, queued: dict | None) -> TpuVm | None:
    """The VM ``name`` is: its node when there is one, else its queued resource (None: neither)."""
    if node is not None:
        return TpuVm(name, NODE_STATUS.get(node.get("state", ""), node.get("state", "UNKNOWN")),
                     node.get("createTime", ""), dict(node.get("labels", {})), node, queued)
    if queued is not None:
        state = queued_state(queued)
        spec = (queued.get("tpu", {}).get("nodeSpec") or [{}])[0].get("node", {})
        return TpuVm(name, WAITING_FOR_CAPACITY if state in QUEUED else state, queued.get("createTime", ""),
                     dict(spec.get("labels", {})), None, queued)
    return None


def queued_resource_body(cfg: Any, public_key: str, labels: dict[str, str], service_account: str) -> dict:
    """The queuedResources.create body: one node named ``cfg.name`` (`gcloud compute tpus queued-resources
    create NAME --node-id NAME --accelerator-type ... --runtime-version ...`), tagged with its name (the
    target of the SSH firewall rule, as on the Compute route), an external IP when ``external_ip``; Spot
    (``spot: {}``), the reservation ``reservationName`` names or
    on-demand; queueing at most ``tpu_api.valid_for_s``. The node runs as ``service_account`` (an email:
    ``service_account: default`` resolved to the project's Compute default account) with ``scopes``, as
    gcloud always sends one: the idle watch deletes the node with that account's token."""
    node: dict[str, Any] = {
        "acceleratorType": vm_config.accelerator_type(cfg),
        "runtimeVersion": vm_config.runtime_version(cfg),
        "networkConfig": {"network": f"projects/{cfg.project}/global/networks/{cfg.network}",
                          "enableExternalIps": bool(cfg.external_ip)},
        "tags": [cfg.name],
        "labels": dict(labels),
        "metadata": {item["key"]: item["value"] for item in ssh_metadata(cfg, public_key)} | idle_metadata(cfg),
        "serviceAccount": {"email": service_account, "scope": list(cfg.scopes)},
    }
    if cfg.subnetwork:
        node["networkConfig"]["subnetwork"] = f"projects/{cfg.project}/regions/{region(cfg.zone)}/subnetworks/" \
                                              f"{cfg.subnetwork}"
    body: dict[str, Any] = {
        "tpu": {"nodeSpec": [{"parent": f"projects/{cfg.project}/locations/{cfg.zone}", "nodeId": cfg.name,
                              "node": node}]},
        "queueingPolicy": {"validUntilDuration": f"{int(cfg.tpu_api.valid_for_s)}s"},
    }
    if cfg.provisioning == "spot":
        body["spot"] = {}
    elif cfg.provisioning == "reservation":
        body["reservationName"] = reservation_name(cfg)
    return body


def idle_metadata(cfg: Any) -> dict[str, str]:
    """The node's ``startup-script``: the idle watch (mtpipe.cloud.providers.gcp.idle_watch) that, idle for
    ``idle.delete_after_s``, deletes the queued resource ``cfg.name`` (force: its node with it) through the
    Cloud TPU API with the node's service account token, as the Compute route's VM deletes itself (none
    with ``idle.delete_after_s: 0``)."""
    if not cfg.idle.delete_after_s:
        return {}
    host = str(cfg.run.env.get("GCE_METADATA_HOST") or idle_watch.METADATA_HOST)
    resource_manager = os.environ.get(ENDPOINT_ENV) or idle_watch.RESOURCE_MANAGER_URL
    return {"startup-script": idle_watch.startup_script(cfg.idle, host, tpu=endpoint(), tpu_name=cfg.name,
                                                        resource_manager=resource_manager)}


def reservation_name(cfg: Any) -> str:
    """The queued resource's reservationName: ``projects/P/locations/Z/reservations/NAME`` (a shared
    reservation's projects/OTHER/reservations/NAME keeps its owner)."""
    found = vm_config.SHARED_RESERVATION.fullmatch(cfg.reservation or "")
    project, name = (found["project"], found["name"]) if found else (cfg.project, cfg.reservation)
    return f"projects/{project}/locations/{cfg.zone}/reservations/{name}"


def tier(node: dict | None, queued: dict | None) -> str:
    """How a node is paid for, in the lifecycle's words: SPOT, RESERVED or STANDARD."""
    scheduling = (node or {}).get("schedulingConfig", {})
    if scheduling.get("spot") or scheduling.get("preemptible") or (queued or {}).get("spot") is not None:
        return "SPOT"
    return "RESERVED" if scheduling.get("reserved") or (queued or {}).get("reservationName") else "STANDARD"
