"""`doit vm_down` from a shell that knows nothing: no .vm_state.json, no NAME, no ZONE (a fresh clone,
another laptop). It searches every zone of the project on both routes (Compute Engine's
instances.aggregatedList by label; the Cloud TPU API's locations, then each one's nodes and queued
resources), deletes this user's VMs with their firewall rules, names another user's and leaves them,
and says what it searched (mtpipe/cloud/lifecycle/base.py, ``Vm.delete_labelled_everywhere``).

Against the fake Compute API and the fake TPU API (tests/fakes/fake_compute.py, fake_tpu.py), both held
to Google's discovery documents, in the `world` of tests/vm_world.py.
"""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from unittest import mock

import pytest
from fakes import fake_tpu
from fakes.fake_tpu import FakeTpu
from vm_world import Env

from mtpipe.cloud.lifecycle.base import USER_LABEL
from mtpipe.cloud.providers.gcp.bodies import firewall_body, instance_body
from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.gcp.tpu_api.client import TPU_ENDPOINT_ENV
from mtpipe.cloud.settings import vm_config

pytestmark = [pytest.mark.billing, pytest.mark.tpu_api]
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2fTTNpubliconly mtpipe"
COMPUTE_SEARCH = "searched Compute Engine's VMs in every zone (instances.aggregatedList) of proj-1 for VMs labelled app=mtpipe"
TPU_SEARCH = ("searched the Cloud TPU API's nodes and queued resources in each of its locations of proj-1 for VMs "
              "labelled app=mtpipe")


@pytest.fixture
def nowhere(world: Env) -> Iterator[tuple[Env, FakeTpu]]:
    """`world` beside the fake TPU API, from a shell with neither NAME nor ZONE (and no state file)."""
    with fake_tpu.running_fake() as tpu:
        world.env[TPU_ENDPOINT_ENV] = tpu.url
        for key in ("NAME", "ZONE"):
            world.env.pop(key)
        yield world, tpu


def me() -> str:
    return vm_config.label_value(getpass.getuser())


def compute_vm(w: Env, zone: str, name: str, who: str) -> None:
    """A VM labelled app=mtpipe and created-by ``who`` in ``zone``, with its SSH rule, made as vm_up makes them."""
    labels = {"app": "mtpipe", USER_LABEL: who}
    with mock.patch.dict(os.environ, w.env, clear=True):
        cfg = vm_config.load_config({"zone": zone, "provisioning": "on-demand", "name": name})
        compute = Compute(cfg.project, zone)
        compute.create_instance(instance_body(cfg, name, KEY, labels, "STANDARD"))
        compute.create_firewall(firewall_body(cfg, name, f"{name}-ssh", labels))


def tpu_vm(tpu: FakeTpu, zone: str, name: str, who: str) -> None:
    """A v5e node of ``who`` with its queued resource, ACTIVE, in ``zone`` (as queuedResources.create makes it)."""
    parent = f"/v2/projects/proj-1/locations/{zone}"
    body = {"tpu": {"nodeSpec": [{"parent": parent.removeprefix("/v2/"), "nodeId": name, "node": {
        "acceleratorType": "v5litepod-8", "runtimeVersion": "v2-alpha-tpuv5-lite",
        "labels": {"app": "mtpipe", USER_LABEL: who}}}]}}
    tpu.handle("POST", f"{parent}/queuedResources?queuedResourceId={name}", body)
    while ("proj-1", zone, name) not in tpu.nodes:
        tpu.handle("GET", f"{parent}/queuedResources/{name}", {})


def test_vm_down_finds_my_compute_vm_in_another_zone(nowhere: tuple[Env, FakeTpu]) -> None:
    """Compute route: this user's VM in europe-west4-a (conf/vm.yaml names no zone) is deleted with its
    rule; another user's in us-east5-b is named and left; the TPU API's locations were searched too."""
    w, tpu = nowhere
    compute_vm(w, "europe-west4-a", "mt-mine", me())
    compute_vm(w, "us-east5-b", "mt-theirs", "someone")
    out = w.doit("vm_down").stdout
    assert f"{COMPUTE_SEARCH}: found in europe-west4-a (1), us-east5-b (1)" in out, out
    assert f"{TPU_SEARCH}: none" in out
    assert "VM mt-mine: deleted" in out and "firewall rule mt-mine-ssh: deleted" in out
    assert "VM mt-theirs, created by someone, left alone: `doit vm_down --name mt-theirs` deletes it" in out
    assert set(w.fake.instances) == {("proj-1", "us-east5-b", "mt-theirs")}
    assert set(w.fake.firewalls) == {("proj-1", "mt-theirs-ssh")}
    assert w.fake.calls("GET", "/aggregated/instances") and len(tpu.calls("GET", "/nodes")) == len(tpu.zones)


def test_vm_down_finds_my_node_and_queued_resource_in_another_zone(nowhere: tuple[Env, FakeTpu]) -> None:
    """TPU API route (a v5e config): this user's node and its queued resource in us-west4-a are deleted;
    another user's in us-east5-b is named and left."""
    w, tpu = nowhere
    w.configure(machine_type="ct5lp-hightpu-8t", boot_disk_type="pd-balanced", provisioning="on-demand")
    tpu_vm(tpu, "us-west4-a", "mt-mine", me())
    tpu_vm(tpu, "us-east5-b", "mt-theirs", "someone")
    out = w.doit("vm_down").stdout
    assert f"{TPU_SEARCH}: found in us-east5-b (1), us-west4-a (1)" in out, out
    assert f"{COMPUTE_SEARCH}: none" in out
    assert "VM mt-mine: deleted" in out and "VM mt-theirs, created by someone, left alone" in out
    assert set(tpu.nodes) == set(tpu.queued) == {("proj-1", "us-east5-b", "mt-theirs")}
    assert tpu.calls("DELETE", "/locations/us-west4-a/queuedResources/mt-mine")


def test_vm_down_with_nothing_anywhere_says_so(nowhere: tuple[Env, FakeTpu]) -> None:
    """Nothing labelled anywhere: vm_down says what it searched and that nothing of this user's was found."""
    w, _ = nowhere
    out = w.doit("vm_down").stdout
    assert f"{COMPUTE_SEARCH}: none" in out and f"{TPU_SEARCH}: none" in out, out
    assert f"nothing of yours (label created-by={me()}) to delete in any zone of proj-1" in out
