"""The fake Compute API judged by Google's discovery document (tests/fakes/discovery.py), not by this
project: what Compute would refuse gets Compute's 400 (unknown field, wrong enum, wrong type, unknown
query parameter, a name off the pattern), what mtpipe sends passes, what the fake answers is
Compute's response schema, and every request of every test goes through the check."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from fakes.discovery import compute
from fakes.fake_compute import FakeCompute, running_fake

from mtpipe.cloud.providers.gcp.bodies import firewall_body, instance_body
from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.interface import ProviderError
from mtpipe.cloud.settings import vm_config

pytestmark = pytest.mark.cloud_contract

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2fTTNpubliconly mtpipe"
INSTANCES = "/compute/v1/projects/proj-1/zones/us-east5-b/instances"


# Past the `fake` fixture's dead proxy, and not urlopen's global opener, which would keep that proxy
# for every later request of this worker (NO_PROXY is gone once the fixture ends).
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def send(fake: FakeCompute, method: str, path: str, body: Any = None) -> tuple[int, dict]:
    """One raw HTTP request to the fake (what a client that builds its own JSON would send)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(fake.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with DIRECT.open(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sent_body(fake: FakeCompute, mode: str = "reservation") -> dict:
    """The instances.insert body google-cloud-compute sends for mtpipe's VM (then deleted again)."""
    cfg = vm_config.load_config({"provisioning": mode})
    compute_api = Compute(cfg.project, cfg.zone)
    model = compute_api.provisioning_model(cfg)
    compute_api.create_instance(instance_body(cfg, cfg.name, KEY, {"app": "mtpipe"}, model))
    compute_api.delete_instance(cfg.name)
    return fake.inserts()[-1].json()


def refused(fake: FakeCompute, method: str, path: str, body: Any = None) -> str:
    """The message of Compute's 400 for this request; the fake itself never saw it."""
    before = len(fake.instances), len(fake.operations)
    status, answer = send(fake, method, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["code"] == 400 and error["status"] == "INVALID_ARGUMENT"
    assert error["errors"] == [{"message": error["message"], "domain": "global", "reason": "invalid"}]
    assert (len(fake.instances), len(fake.operations)) == before
    assert len(fake.contract.take_rejected()) == 1
    return error["message"]


@pytest.mark.parametrize("mode", ["reservation", "spot", "on-demand", "flex-start"])
def test_mtpipes_instance_body_passes_for_each_provisioning_mode(fake: FakeCompute, mode: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if mode != "reservation":
        monkeypatch.delenv("RESERVATION")
    body = sent_body(fake, mode)
    assert body["scheduling"]["provisioningModel"] == {"reservation": "STANDARD", "spot": "SPOT",
                                                       "on-demand": "STANDARD", "flex-start": "FLEX_START"}[mode]
    insert = fake.inserts()[-1]
    assert insert.api_method == "compute.instances.insert" and not fake.contract.rejected
    # int64 as a JSON number is what proto3 JSON accepts too (the client sends strings)
    body["disks"][0]["initializeParams"]["diskSizeGb"] = 200
    body["scheduling"]["maxRunDuration"]["seconds"] = 14400
    status, answer = send(fake, "POST", INSTANCES, body)
    assert status == 200 and answer["kind"] == "compute#operation", answer


def test_an_unknown_field_is_refused(fake: FakeCompute) -> None:
    body = sent_body(fake)
    assert refused(fake, "POST", INSTANCES, {**body, "colour": "red"}) == (
        "Invalid JSON payload received. Unknown name \"colour\" at 'instance_resource': Cannot find field.")
    nested = copy.deepcopy(body)
    nested["scheduling"]["cheap"] = True
    assert refused(fake, "POST", INSTANCES, nested) == (
        "Invalid JSON payload received. Unknown name \"cheap\" at 'instance_resource.scheduling': Cannot find field.")


def test_a_wrong_enum_value_is_refused_through_the_real_client(fake: FakeCompute) -> None:
    cfg = vm_config.load_config()
    body = instance_body(cfg, cfg.name, KEY, {}, "STANDARD")
    body["scheduling"]["provisioning_model"] = "CHEAP"
    with pytest.raises(ProviderError, match=r"creating VM mt-test: 400 POST \S+/instances: Invalid value for field "
                                           r"'resource.scheduling.provisioningModel': 'CHEAP'. Must be one of "
                                           r"\['FLEX_START', 'RESERVATION_BOUND', 'SPOT', 'STANDARD'\]"):
        Compute(cfg.project, cfg.zone).create_instance(body)
    assert not fake.instances and len(fake.contract.take_rejected()) == 1


@pytest.mark.parametrize("where, value, message", [
    (("scheduling", "automaticRestart"), "no",
     "Invalid value at 'instance_resource.scheduling.automatic_restart' (TYPE_BOOL), \"no\""),
    (("disks", 0, "initializeParams", "diskSizeGb"), "two hundred",
     "Invalid value at 'instance_resource.disks[0].initialize_params.disk_size_gb' (TYPE_INT64), \"two hundred\""),
    (("labels", "app"), 5, "Invalid value at 'instance_resource.labels[app]' (TYPE_STRING), 5"),
    (("tags",), ["mt-test"],
     "Invalid value at 'instance_resource.tags' (type.googleapis.com/google.cloud.compute.v1.Tags), [\"mt-test\"]"),
    (("name",), "MT_test",
     "Invalid value for field 'resource.name': 'MT_test'. Must be a match of regex "
     "'[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?'"),
], ids=["bool", "int64", "map-value", "message", "pattern"])
def test_a_wrong_type_or_value_is_refused(fake: FakeCompute, where: tuple, value: Any, message: str) -> None:
    body = sent_body(fake)
    target = body
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    assert refused(fake, "POST", INSTANCES, body) == message


def test_query_and_path_parameters_are_checked(fake: FakeCompute) -> None:
    assert refused(fake, "GET", f"{INSTANCES}/mt-test?colour=red") == (
        "Invalid JSON payload received. Unknown name \"colour\": Cannot bind query parameter. Field 'colour' "
        "could not be found in request message.")
    assert refused(fake, "GET", "/compute/v1/projects/proj-1/aggregated/machineTypes?maxResults=many") == (
        "Invalid value at 'maxResults' (TYPE_UINT32), \"many\"")
    assert refused(fake, "GET", f"{INSTANCES}/Bad_Name").startswith(
        "Invalid value for field 'instance': 'Bad_Name'. Must be a match of regex")
    status, answer = send(fake, "POST", INSTANCES)
    assert status == 400 and answer["error"]["message"] == "Required field 'resource' not specified"
    assert answer["error"]["errors"][0]["reason"] == "required"
    status, answer = send(fake, "GET", "/compute/v1/projects/proj-1/zones/us-east5-b/gadgets")
    assert status == 404 and answer["error"]["status"] == "NOT_FOUND"
    assert len(fake.contract.take_rejected()) == 2
    # known parameters pass: the client's own filter, a page size, a system parameter
    status, _ = send(fake, "GET", "/compute/v1/projects/proj-1/aggregated/machineTypes"
                                  "?filter=name+%3D+n2-standard-8&maxResults=10&prettyPrint=false")
    assert status == 200 and not fake.contract.rejected


def test_every_request_of_a_vm_lifecycle_is_checked(fake: FakeCompute) -> None:
    """Each request the client sent resolved to its discovery method (none was let through unchecked),
    and a fake left with a refusal nobody expected fails the test that used it."""
    cfg = vm_config.load_config()
    compute_api = Compute(cfg.project, cfg.zone)
    compute_api.get_machine_type(cfg.machine_type)
    compute_api.get_reservation(cfg.reservation)
    model = compute_api.provisioning_model(cfg)
    compute_api.create_firewall(firewall_body(cfg, cfg.name, cfg.firewall.name, dict(cfg.labels)))
    compute_api.create_instance(instance_body(cfg, cfg.name, KEY, {}, model))
    compute_api.delete_instance(cfg.name)
    compute_api.delete_firewall(cfg.firewall.name)
    compute_api.zones_offering(cfg.machine_type)
    assert [r.api_method for r in fake.requests] == [
        "compute.machineTypes.get", "compute.reservations.get", "compute.futureReservations.list",
        "compute.firewalls.insert", *["compute.globalOperations.wait"] * 2,
        "compute.instances.insert", *["compute.zoneOperations.wait"] * 2, "compute.instances.get",
        "compute.instances.delete", *["compute.zoneOperations.wait"] * 2,
        "compute.firewalls.delete", *["compute.globalOperations.wait"] * 2,
        "compute.machineTypes.aggregatedList"]
    with pytest.raises(AssertionError, match=r"(?s)refused by Compute's discovery document.*colour"):
        with running_fake() as other:
            send(other, "GET", f"{INSTANCES}/mt-test?colour=red")


def test_an_answer_compute_never_gives_fails_loudly(fake: FakeCompute) -> None:
    cfg = vm_config.load_config()
    compute_api = Compute(cfg.project, cfg.zone)
    compute_api.create_instance(instance_body(cfg, cfg.name, KEY, {}, "STANDARD"))
    fake.instances["proj-1", "us-east5-b", "mt-test"]["status"] = "SLEEPING"   # no such instance status
    with pytest.raises(ProviderError, match=r"reading VM mt-test: 500 GET \S+: the fake answered what Compute "
                                           r"never would \(compute.instances.get\): Invalid value for field "
                                           r"'Instance.status': 'SLEEPING'"):
        compute_api.get_instance(cfg.name)
    (fault,) = fake.contract.faults
    fake.contract.faults.clear()
    with pytest.raises(AssertionError, match="answered what Compute never would"):
        with running_fake() as other:
            other.contract.faults.append(fault)


def test_the_discovery_document_is_read_once() -> None:
    assert compute() is compute()
    assert len(compute().methods) > 900   # every Compute v1 method, not only those the fake serves
