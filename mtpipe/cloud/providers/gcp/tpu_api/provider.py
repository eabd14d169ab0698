"""The Cloud TPU API route (tpu.googleapis.com/v2) as the lifecycle's provider
(mtpipe.cloud.providers.interface.Provider): the VM is a queued resource's one node.

Creating the VM asks for capacity with a queued resource named like the VM (its node too) and waits,
saying so every ``tpu_api.poll_s``, while it is WAITING_FOR_RESOURCES / PROVISIONING, until ACTIVE (its
node READY, the external IP SSH's address) or FAILED / SUSPENDED: a CapacityError (no capacity: the
queue's time ran out) or a GcpError naming the reason; the lifecycle's cleanup then deletes the queued
resource (:meth:`TpuApi.delete_instance`: the queued resource with force, its node, each waited on).
A node's state reads as Compute's statuses (bodies.NODE_STATUS: READY -> RUNNING, PREEMPTED ->
TERMINATED), so a preempted Spot node is replaced as the Compute route replaces a preempted VM.

The TPU API has no firewall of its own: the node is on a VPC network whose firewall admits SSH, so the
SSH rule, when vm_up makes one, is Compute's (the node carries the VM's name as its network tag, the
rule's target); there is no boot disk left behind by a failed request (``delete_orphan_disk``: False).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.gcp.api_errors import GcpError, explained
from mtpipe.cloud.providers.interface import SETTLING, CapacityError, Everywhere, Provider, ProviderError
from mtpipe.cloud.providers.gcp.tpu_api.bodies import (CAPACITY_CODES, QUEUED, TIERS, TpuVm, as_vm, queued_resource_body,
                                                   queued_state, tier)
from mtpipe.cloud.providers.gcp.tpu_api.client import TpuClient
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig


def _say(line: str) -> None:
    print(f"mtpipe: {line}", flush=True)


class TpuApi:
    """The VM as a Cloud TPU API queued resource and node in one zone; firewall rules through Compute."""

    def __init__(self, project: str, zone: str, timeout_s: float = 900, poll_s: float = 30) -> None:
        self.project, self.zone, self.timeout_s, self.poll_s = project, zone, timeout_s, poll_s
        self.tpu = TpuClient(project, zone, timeout_s, min(poll_s, 2.0))
        self.compute = Compute(project, zone, timeout_s)   # the network's firewall rules

    def get_instance(self, name: str) -> TpuVm | None:
        """The node ``name``, else its queued resource still without one (PENDING, FAILED...), else None."""
        node = self.tpu.get_node(name)
        return as_vm(name, node, self.tpu.get_queued_resource(name) if node is None else None)

    def list_instances(self, labels: dict[str, str]) -> list[TpuVm]:
        """The nodes of this zone carrying every one of ``labels``, and the queued resources whose node spec
        carries them and that have no node yet (:func:`labelled`)."""
        return labelled(self.tpu, labels)

    def provisioning_model(self, cfg: VmConfig) -> str:
        return TIERS.get(cfg.provisioning, cfg.provisioning.upper())

    def create_vm(self, cfg: VmConfig, public_key: str, labels: dict[str, str]) -> TpuVm:
        """Queue the VM (queuedResources.create) and wait until its node runs (:meth:`_await_active`)."""
        account = cfg.service_account if cfg.service_account != "default" else self.compute.default_service_account()
        self.tpu.create_queued_resource(cfg.name, queued_resource_body(cfg, public_key, labels, account))
        return self._await_active(cfg)

    def _await_active(self, cfg: VmConfig) -> TpuVm:
        """Poll the queued resource every ``poll_s`` while it queues or provisions, saying so; its node once
        ACTIVE and READY. FAILED or SUSPENDED: a CapacityError for no capacity (CAPACITY_CODES, or the queue's
        time ran out), a GcpError otherwise; still queued a poll after ``tpu_api.valid_for_s``: a CapacityError."""
        window, start, name = float(cfg.tpu_api.valid_for_s), time.monotonic(), cfg.name
        while True:
            queued = self.tpu.get_queued_resource(name)
            if queued is None:
                raise GcpError(f"queued resource {name} vanished in {self.zone} before its node was created")
            state, waited = queued_state(queued), time.monotonic() - start
            if state == "ACTIVE":
                return self._await_node(name, queued)
            if state in ("FAILED", "SUSPENDED", "SUSPENDING"):
                raise failure(name, self.zone, state, queued)
            if state not in QUEUED and state != "STATE_UNSPECIFIED":
                raise GcpError(f"queued resource {name} in {self.zone} is {state}, not waiting for capacity")
            if waited > window + self.poll_s:
                raise CapacityError(f"queued resource {name} is still {state} in {self.zone} after its queueing "
                                    f"time ({window:g} s, tpu_api.valid_for_s)")
            _say(f"queued resource {name} is {state} in {self.zone}: the Cloud TPU API is "
                 f"{'setting up' if state == 'PROVISIONING' else 'looking for'} its capacity ({waited:.0f} s so far, "
                 f"at most {window:g} s: tpu_api.valid_for_s); Ctrl-C deletes it")
            time.sleep(self.poll_s)

    def _await_node(self, name: str, queued: dict) -> TpuVm:
        """The ACTIVE queued resource's node once it is past CREATING (at most timeout_s)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            vm = as_vm(name, self.tpu.get_node(name), queued)
            if vm is None or vm.node is None:
                raise GcpError(f"queued resource {name} is ACTIVE in {self.zone} but has no node {name}")
            if vm.status not in SETTLING or time.monotonic() > deadline:
                return vm
            time.sleep(self.tpu.poll_s)

    def settle(self, name: str, timeout_s: float) -> TpuVm | None:
        """What is left of VM ``name`` after a failed or interrupted request: its node or queued resource
        (waited on while the node is CREATING, at most ``timeout_s``), None when there is neither."""
        deadline = time.monotonic() + timeout_s
        while True:
            vm = self.get_instance(name)
            if vm is None or vm.status not in SETTLING or time.monotonic() > deadline:
                return vm
            time.sleep(self.tpu.poll_s)

    def delete_instance(self, name: str) -> bool:
        """Delete the queued resource ``name`` (force: its node with it) and the node if one is left
        (a node created without a queue); False when neither existed."""
        deleted = self.tpu.delete_queued_resource(name)
        return self.tpu.delete_node(name) or deleted

    def delete_orphan_disk(self, name: str) -> bool:
        """A TPU node has no boot disk of its own in Compute: nothing is left behind a failed request."""
        return False

    def open_ssh(self, cfg: VmConfig, labels: dict[str, str]) -> bool:
        """The network's SSH rule, as on the Compute route (Compute.open_ssh: none when one admits SSH)."""
        return self.compute.open_ssh(cfg, labels)

    def proxy_command(self, cfg: VmConfig) -> str | None:
        """SSH's way to the node, as on the Compute route (Compute.proxy_command)."""
        return self.compute.proxy_command(cfg)

    def get_firewall(self, name: str) -> Any | None:
        return self.compute.get_firewall(name)

    def delete_firewall(self, name: str) -> bool:
        return self.compute.delete_firewall(name)

    @staticmethod
    def address(instance: TpuVm) -> str | None:
        """networkEndpoints[0].accessConfig.externalIp of the node, once it has one."""
        endpoints = (instance.node or {}).get("networkEndpoints") or [{}]
        return endpoints[0].get("accessConfig", {}).get("externalIp") or None

    @staticmethod
    def describe(instance: TpuVm) -> tuple[str, str, int]:
        """(accelerator type, tier, 0): the TPU API deletes no node after a set time."""
        spec = (instance.node or (instance.queued or {}).get("tpu", {}).get("nodeSpec", [{}])[0].get("node", {}))
        return spec.get("acceleratorType", "?"), tier(instance.node, instance.queued), 0

    def zones_offering(self, machine_type: str) -> list[str]:
        """Every zone of the project where the Cloud TPU API offers ``machine_type``'s accelerator type
        (ct5lp-hightpu-8t: v5litepod-8): locations.list, then one acceleratorTypes.list per location."""
        try:
            accelerator = vm_config.accelerator_type(SimpleNamespace(machine_type=machine_type))
        except (KeyError, ValueError):   # not a TPU the route creates
            return []
        return self.tpu.zones_offering(accelerator)


def labelled(tpu: TpuClient, labels: dict[str, str]) -> list[TpuVm]:
    """The nodes of ``tpu``'s zone carrying every one of ``labels``, and the queued resources whose node
    spec carries them and that have no node yet (nodes.list and queuedResources.list have no filter)."""
    nodes = {n["name"].rsplit("/", 1)[-1]: n for n in tpu.list_nodes()}
    found = [as_vm(name, node, None) for name, node in nodes.items()]
    for queued in tpu.list_queued_resources():
        name = queued["name"].rsplit("/", 1)[-1]
        if name not in nodes:
            found.append(as_vm(name, None, queued))
    return [vm for vm in found if vm is not None and all(vm.labels.get(k) == v for k, v in labels.items())]


def labelled_everywhere(project: str, labels: dict[str, str]) -> Everywhere:
    """The nodes and queued resources carrying every one of ``labels`` in each of ``project``'s TPU API
    locations (locations.list, then :func:`labelled` in each, several at a time), by zone; a location
    whose lists are refused is named with the reason."""
    with explained("listing the Cloud TPU API's locations", project):
        locations = TpuClient(project, "-").locations()

    def search(zone: str) -> list[TpuVm] | str:
        try:
            return labelled(TpuClient(project, zone), labels)
        except ProviderError as err:
            return str(err)

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = dict(zip(locations, pool.map(search, locations)))
    return Everywhere({zone: vms for zone, vms in answers.items() if vms and not isinstance(vms, str)},
                      [f"{zone} ({why})" for zone, why in answers.items() if isinstance(why, str)])


def failure(name: str, zone: str, state: str, queued: dict) -> GcpError:
    """The error of a queued resource that FAILED or was SUSPENDED, with the API's reason."""
    data = queued.get("state", {}).get("failedData", {}).get("error", {})
    reason = data.get("message") or f"state {state}"
    if state != "FAILED" or data.get("code") in CAPACITY_CODES or not data:
        return CapacityError(f"queued resource {name} {state} in {zone}: no capacity ({reason})")
    return GcpError(f"queued resource {name} FAILED in {zone}: {reason}")


def tpu_api(cfg: VmConfig) -> Provider:
    """The Cloud TPU API zone ``cfg`` names."""
    vm_config.require(cfg, "project", "zone")
    return TpuApi(cfg.project, cfg.zone, float(cfg.operation_timeout_s), float(cfg.tpu_api.poll_s))
