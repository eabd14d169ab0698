"""What Compute Engine is sent: the instances.insert body (the tutorial's `gcloud compute instances
create` flags + safety: scheduling, reservation affinity, network, SSH and idle-watch metadata), the SSH
firewall rule, a label filter."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mtpipe.cloud.providers.gcp import idle_watch, ssh_route
from mtpipe.cloud.providers.gcp.api_errors import ENDPOINT_ENV
from mtpipe.cloud.providers.interface import region
from mtpipe.cloud.settings.vm_config import SHARED_RESERVATION
from mtpipe.pipeline import generations

# reservation: decided per reservation (Compute.provisioning_model)
PROVISIONING_MODELS = {"spot": "SPOT", "on-demand": "STANDARD", "flex-start": "FLEX_START"}


def reservation_path(reservation: str, project: str) -> tuple[str, str]:
    """(owner project, name) of a reservation as ``reservationAffinity.values`` names it: NAME, in
    ``project``, or ``projects/OTHER/reservations/NAME``, a reservation OTHER shares with ``project``."""
    found = SHARED_RESERVATION.fullmatch(reservation)
    return (found["project"], found["name"]) if found else (project, reservation)


def scheduling(cfg: Any, model: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The `scheduling` and `reservation_affinity` fields of a VM whose provisioningModel is `model`
    (:meth:`Compute.provisioning_model`).

    reservation: the VM consumes the named reservation (SPECIFIC_RESERVATION; a shared one keeps the
    projects/OTHER/reservations/NAME form), as a RESERVATION_BOUND VM when the reservation is in
    calendar mode, else as a STANDARD one; spot: a Spot VM (`--provisioning-model=SPOT`), which Compute
    deletes when it preempts it (a preempted Spot VM cannot be restarted, only deleted and recreated);
    on-demand: a STANDARD VM; flex-start: a FLEX_START VM (Dynamic Workload Scheduler), which consumes
    no reservation and runs at most 7 days, up to its maxRunDuration. Every mode terminates on host
    maintenance and never restarts by itself; `maxRunDuration` deletes the VM (sent for RESERVATION_BOUND
    too, where Compute's docs do not say whether it is honoured: docs/tpu-vm.md).
    """
    fields: dict[str, Any] = {
        "provisioning_model": model,                     # --provisioning-model
        "on_host_maintenance": "TERMINATE",              # --maintenance-policy
        "automatic_restart": False,
    }
    if model != "STANDARD" or cfg.max_run_duration_s:
        fields["instance_termination_action"] = "DELETE"  # --instance-termination-action
    if cfg.max_run_duration_s:
        fields["max_run_duration"] = {"seconds": int(cfg.max_run_duration_s)}
    affinity = None
    if cfg.provisioning == "reservation":               # --reservation-affinity=specific
        affinity = {"consume_reservation_type": "SPECIFIC_RESERVATION",
                    "key": "compute.googleapis.com/reservation-name", "values": [cfg.reservation]}
    elif model == "FLEX_START":                         # --reservation-affinity=none
        affinity = {"consume_reservation_type": "NO_RESERVATION"}
    return fields, affinity


def network_interface(cfg: Any) -> dict:
    """The VM's network interface: ``network``, ``subnetwork`` (regional; null: the auto-mode
    network's subnetwork of the region), an external IP (``external_ip``) as gcloud adds by default."""
    nic: dict[str, Any] = {"network": f"global/networks/{cfg.network}"}
    if cfg.subnetwork:
        nic["subnetwork"] = f"regions/{region(cfg.zone)}/subnetworks/{cfg.subnetwork}"
    if cfg.external_ip:
        nic["access_configs"] = [{"name": "External NAT", "type_": "ONE_TO_ONE_NAT"}]
    return nic


def ssh_metadata(cfg: Any, ssh_public_key: str) -> list[dict[str, str]]:
    """The instance metadata that admits our key: with OS Login (``ssh.os_login`` true, as the checks
    before spending decide it) ``enable-oslogin=TRUE`` (the key is in the caller's OS Login profile,
    where the VM looks for it); else the key in ``ssh-keys`` for ``ssh.user``."""
    if cfg.ssh.os_login is True:
        return [{"key": "enable-oslogin", "value": "TRUE"}]
    return [{"key": "ssh-keys", "value": f"{cfg.ssh.user}:{ssh_public_key}"}]


def idle_metadata(cfg: Any) -> list[dict[str, str]]:
    """The startup script that deletes the VM once idle (mtpipe.cloud.providers.gcp.idle_watch; none with
    ``idle.delete_after_s: 0``)."""
    if not cfg.idle.delete_after_s:
        return []
    host = str(cfg.run.env.get("GCE_METADATA_HOST") or idle_watch.METADATA_HOST)
    compute = os.environ.get(ENDPOINT_ENV) or idle_watch.COMPUTE_URL
    return [{"key": "startup-script", "value": idle_watch.startup_script(
        cfg.idle, host, compute, resource_manager=os.environ.get(ENDPOINT_ENV) or idle_watch.RESOURCE_MANAGER_URL)}]


def instance_body(cfg: Any, name: str, ssh_public_key: str, labels: dict[str, str], model: str) -> dict:
    """The instances.insert body: the tutorial's `gcloud compute instances create` flags + safety;
    `model` is the VM's provisioningModel (:meth:`Compute.provisioning_model`)."""
    fields, affinity = scheduling(cfg, model)
    body = {
        "name": name,
        "machine_type": f"zones/{cfg.zone}/machineTypes/{cfg.machine_type}",
        "disks": [{
            "boot": True,
            "auto_delete": True,
            "initialize_params": {
                "source_image":
                    f"projects/{cfg.image_project}/global/images/family/{cfg.image_family}",
                "disk_size_gb": int(cfg.boot_disk_gb),
                "disk_type": f"zones/{cfg.zone}/diskTypes/{cfg.boot_disk_type}",
            },
        }],
        "network_interfaces": [network_interface(cfg)],
        "tags": {"items": [name]},                   # --tags=NAME (the firewall rule's target)
        "scheduling": fields,
        "service_accounts": [{"email": cfg.service_account, "scopes": list(cfg.scopes)}],
        "labels": labels,
        "metadata": {"items": ssh_metadata(cfg, ssh_public_key) + idle_metadata(cfg)},
    }
    if affinity:
        body["reservation_affinity"] = affinity
    if model == "FLEX_START":   # --request-valid-for-duration: how long the insert may wait for capacity
        body["params"] = {"request_valid_for_duration": {"seconds": int(cfg.flex_start.request_valid_for_s)}}
    gen, chips = generations.of_machine_type(cfg.machine_type)
    if chips in gen.compute.single_threaded_chips:   # Compute creates it with one thread per core only
        body["advanced_machine_features"] = {"threads_per_core": 1}
    return body


def firewall_body(cfg: Any, name: str, firewall: str, labels: dict[str, str],
                  sources: Sequence[str] = (ssh_route.IAP_RANGE,)) -> dict:
    """An SSH rule: tcp:22 from ``sources`` (the tutorials': the IAP range) to VMs tagged with the
    VM's name.

    Firewall rules have no labels in Compute's API: the description carries the VM's."""
    tags = " ".join(f"{key}={value}" for key, value in sorted(labels.items()))
    return {
        "name": firewall,
        "network": f"global/networks/{cfg.network}",
        "direction": "INGRESS",
        "allowed": [{"I_p_protocol": "tcp", "ports": ["22"]}],
        "source_ranges": list(sources),
        "target_tags": [name],
        "description": f"SSH to the mtpipe VM {name} (labels: {tags})",
    }


def label_filter(labels: dict[str, str]) -> str:
    """A list filter in Compute's syntax that keeps the resources carrying every one of ``labels``:
    `labels.app = "mtpipe"`, several as ANDed parenthesised expressions."""
    terms = [f'labels.{key} = "{value}"' for key, value in sorted(labels.items())]
    return terms[0] if len(terms) == 1 else " ".join(f"({term})" for term in terms)
