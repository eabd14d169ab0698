"""The Compute Engine side of the VM tasks, against the fake API on 127.0.0.1 (no SSH needed).

* golden test: the instances.insert / firewalls.insert bodies, as google-cloud-compute serialises
  them, against the tutorial's `gcloud compute instances create` flags;
* operations are waited on until DONE; 404 and 409 are "already gone" / "already there";
* bad input (missing keys, missing or expired credentials, an unknown reservation) fails with the
  key and the fix, before anything is created (more checks before spending: test_vm_checks.py);
* the provisioning modes (reservation, spot, on-demand): their scheduling fields and prices
  (conf/prices.yaml); each kind of reservation through vm_up: test_vm_reservations.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import urllib.parse
from pathlib import Path

import pytest
from doit.doit_cmd import DoitMain
from fakes.fake_compute import FakeCompute, Reservation
from google.cloud import compute_v1

from mtpipe.cloud.providers.gcp import bodies
from mtpipe.cloud.providers.gcp.bodies import firewall_body, instance_body
from mtpipe.cloud.providers.gcp.compute import Compute, external_ip
from mtpipe.cloud.providers.interface import CapacityError, ProviderError
from mtpipe.cloud.settings import prices, vm_config
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations
from vm_world import as_script

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.provisioning
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE2fTTNpubliconly mtpipe"

# gcloud compute instances create NAME --zone=us-east5-b --network=default --tags=NAME
#   --machine-type=ct6e-standard-8t --image-project=ubuntu-os-accelerator-images
#   --image-family=ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e --boot-disk-size=200GB
#   --maintenance-policy=TERMINATE --instance-termination-action=DELETE
#   --provisioning-model=RESERVATION_BOUND --reservation-affinity=specific --reservation=v6e-res
#   --threads-per-core=1
# (the tutorials' reservation is one a future reservation in calendar mode created; an 8-chip v6e VM
# takes one thread per core)
# plus (docs/tpu-vm.md): a Hyperdisk Balanced boot disk (v6e takes no other), maxRunDuration, labels, the cloud-platform scope, our SSH public key,
# and the idle watch's startup script (without_idle_watch).
GOLDEN_INSTANCE = {
    "name": "mt-test",
    "machineType": "zones/us-east5-b/machineTypes/ct6e-standard-8t",
    "disks": [{"boot": True, "autoDelete": True, "initializeParams": {
        "sourceImage": "projects/ubuntu-os-accelerator-images/global/images/family/"
                       "ubuntu-accel-2204-amd64-tpu-v5e-v5p-v6e",
        "diskSizeGb": "200", "diskType": "zones/us-east5-b/diskTypes/hyperdisk-balanced"}}],
    "networkInterfaces": [{"network": "global/networks/default",
                           "accessConfigs": [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]}],
    "tags": {"items": ["mt-test"]},
    "scheduling": {"provisioningModel": "RESERVATION_BOUND", "instanceTerminationAction": "DELETE",
                   "onHostMaintenance": "TERMINATE", "automaticRestart": False,
                   "maxRunDuration": {"seconds": "14400"}},
    "reservationAffinity": {"consumeReservationType": "SPECIFIC_RESERVATION",
                            "key": "compute.googleapis.com/reservation-name",
                            "values": ["v6e-res"]},
    "serviceAccounts": [{"email": "default",
                         "scopes": ["https://www.googleapis.com/auth/cloud-platform"]}],
    "labels": {"app": "mtpipe", "mtpipe-run": "1a2b3c4d"},
    "metadata": {"items": [{"key": "ssh-keys", "value": f"mtpipe:{KEY}"}]},
    "advancedMachineFeatures": {"threadsPerCore": 1},
}
GOLDEN_FIREWALL = {
    "name": "mt-test-ssh", "network": "global/networks/default", "direction": "INGRESS",
    "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}], "sourceRanges": ["35.235.240.0/20"],
    "targetTags": ["mt-test"],
    # firewall rules have no labels field (compute.v1.json's Firewall): the description carries them
    "description": "SSH to the mtpipe VM mt-test (labels: app=mtpipe mtpipe-run=1a2b3c4d)",
}


def without_idle_watch(body: dict) -> dict:
    """An insert body without its startup script, which must be the idle watch of conf/vm.yaml's
    idle.delete_after_s (tests/cloud/providers/test_vm_idle.py runs it)."""
    items = body["metadata"]["items"]
    (script,) = [i["value"] for i in items if i["key"] == "startup-script"]
    assert script.startswith("#!/bin/bash\n# mtpipe: delete this VM after 1800 s with nothing of vm_run running")
    return {**body, "metadata": {"items": [i for i in items if i["key"] != "startup-script"]}}


def drop_empty(value: object) -> object:
    """The client also sends empty lists/maps for unset repeated fields; they carry nothing."""
    if isinstance(value, dict):
        return {k: drop_empty(v) for k, v in value.items() if v not in ([], {})}
    if isinstance(value, list):
        return [drop_empty(v) for v in value]
    return value


def doit(repo: Path, *args: str) -> tuple[int, str]:
    """Run doit in process in `repo`; return its exit code and everything it printed."""
    out, cwd, report = io.StringIO(), os.getcwd(), repo / "doit-report.txt"
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            extra = [] if args[0] == "list" else ["--output-file", str(report)]
            rc = DoitMain().run(["-f", str(ROOT / "dodo.py"), "-d", str(repo), *extra, *as_script(args)])
        finally:
            os.chdir(cwd)
    return rc, out.getvalue() + (report.read_text() if report.exists() else "")


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty git repo to run doit in, with a vm config overlay using a temporary SSH key."""
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    overlay = tmp_path / "vm.yaml"
    overlay.write_text(f"ssh: {{key_file: {tmp_path / 'id'}, ready_timeout_s: 1}}\n"
                       "firewall: {source_ranges: [127.0.0.1/32]}\n")
    monkeypatch.setenv(vm_config.CONFIG_ENV, str(overlay))
    return repo


def test_insert_bodies_match_the_tutorial(fake: FakeCompute) -> None:
    fake.reservations["v6e-res"] = Reservation(delivered_by="CALENDAR")
    cfg = vm_config.load_config()
    vm_config.check_create(cfg)
    compute = Compute(cfg.project, cfg.zone)
    labels = {**cfg.labels, "mtpipe-run": "1a2b3c4d"}
    assert compute.create_firewall(firewall_body(cfg, cfg.name, cfg.firewall.name, labels))
    instance = compute.create_instance(instance_body(cfg, cfg.name, KEY, labels,
                                                         compute.provisioning_model(cfg)))

    (insert,) = fake.calls("POST", "/projects/proj-1/zones/us-east5-b/instances")
    assert without_idle_watch(drop_empty(insert.json())) == GOLDEN_INSTANCE
    (rule,) = fake.calls("POST", "/projects/proj-1/global/firewalls")
    assert drop_empty(rule.json()) == GOLDEN_FIREWALL
    # Each operation went PENDING -> RUNNING -> DONE through explicit `wait` calls.
    assert len(fake.calls("POST", "/wait")) == 4
    assert instance.status == "RUNNING" and external_ip(instance) == "127.0.0.1"
    assert {r.host for r in fake.requests} == {fake.url.removeprefix("http://")}


@pytest.mark.first_request
def test_an_8_chip_v6e_vm_is_single_threaded(fake: FakeCompute) -> None:
    """ct6e-standard-8t takes one thread per core: mtpipe's body says so and passes Google's discovery
    document; the same body without it is refused, as Compute refuses it, and nothing is created."""
    cfg = vm_config.load_config({"provisioning": "on-demand"})
    compute = Compute(cfg.project, cfg.zone)
    body = instance_body(cfg, cfg.name, KEY, {}, "STANDARD")
    assert compute.create_instance(body).status == "RUNNING"
    (insert,) = fake.inserts()
    assert insert.json()["advancedMachineFeatures"] == {"threadsPerCore": 1}
    assert insert.api_method == "compute.instances.insert" and not fake.contract.rejected
    compute.delete_instance(cfg.name)

    del body["advanced_machine_features"]
    with pytest.raises(ProviderError, match=r"creating VM mt-test: 400 .*'resource.advancedMachineFeatures"
                                           r".threadsPerCore': ''. Machine type ct6e-standard-8t requires 1 "
                                           r"thread per core"):
        compute.create_instance(body)
    assert len(fake.inserts()) == 2 and not fake.instances
    cfg = cfg.model_copy(update={"machine_type": "ct6e-standard-4t"})
    assert "advanced_machine_features" not in instance_body(cfg, cfg.name, KEY, {}, "STANDARD")


@pytest.mark.cloud_contract
def test_vms_are_listed_by_label(fake: FakeCompute) -> None:
    """instances.list with a label filter in Compute's syntax, through the real client: the zone's
    VMs that carry the labels and no others."""
    cfg = vm_config.load_config({"provisioning": "on-demand"})
    compute = Compute(cfg.project, cfg.zone)
    for name, labels in [("vm-a", {"app": "mtpipe", "mtpipe-run": "1"}),
                         ("vm-b", {"app": "mtpipe", "mtpipe-run": "2"}), ("vm-c", {"app": "other"})]:
        compute.create_instance(instance_body(cfg, name, KEY, labels, "STANDARD"))
    assert [i.name for i in compute.list_instances({"app": "mtpipe"})] == ["vm-a", "vm-b"]
    assert [i.name for i in compute.list_instances({"app": "mtpipe", "mtpipe-run": "2"})] == ["vm-b"]
    assert compute.list_instances({"app": "none"}) == []
    for written in ("labels.app=mtpipe", "labels.app = mtpipe", '(labels.app = "mtpipe") AND (name != vm-a)'):
        listed = compute.instances.list(request=compute_v1.ListInstancesRequest(
            project=cfg.project, zone=cfg.zone, filter=written))
        assert [i.name for i in listed] == (["vm-b"] if "vm-a" in written else ["vm-a", "vm-b"]), written
    (request,) = [r for r in fake.calls("GET", "/zones/us-east5-b/instances")
                  if "mtpipe-run" in r.path]
    assert '(labels.app = "mtpipe") (labels.mtpipe-run = "2")' in urllib.parse.unquote_plus(request.path)


def test_not_found_and_conflict_are_not_errors(fake: FakeCompute) -> None:
    cfg = vm_config.load_config()
    compute = Compute(cfg.project, cfg.zone)
    body = firewall_body(cfg, cfg.name, cfg.firewall.name, dict(cfg.labels))
    assert compute.create_firewall(body) and not compute.create_firewall(body)   # 409
    assert compute.delete_firewall(body["name"]) and not compute.delete_firewall(body["name"])
    assert compute.get_instance("mt-test") is None and not compute.delete_instance("mt-test")
    assert [r.method for r in fake.requests].count("DELETE") == 3


@pytest.mark.parametrize("unset, key", [("PROJECT", "vm.project"), ("ZONE", "vm.zone"),
                                        ("RESERVATION", "vm.reservation")])
def test_missing_key_fails_before_any_request(fake: FakeCompute, repo: Path, unset: str, key: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(unset)
    rc, out = doit(repo, "vm_up")
    assert rc != 0 and f"{key}: is not set. Fix: export {unset}=..." in out
    assert fake.requests == []


def test_params_override_env(fake: FakeCompute, repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROJECT")
    rc, out = doit(repo, "vm_up", "--project", "from-param", "--zone", "europe-west4-a",
                   "--reservation", "unknown-res")
    assert rc != 0
    (asked,) = fake.calls("GET", "/projects/from-param/zones/europe-west4-a/reservations/unknown-res")
    # The unknown reservation is found before anything is created: clear error, nothing left behind.
    assert "vm.reservation: no reservation 'unknown-res' in from-param/europe-west4-a" in out
    assert fake.inserts() == [] and not fake.firewalls
    assert not (repo / ".vm_state.json").exists()


@pytest.mark.vm_experiments
def test_missing_credentials(fake: FakeCompute, repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(repo / "no-such-key.json"))
    rc, out = doit(repo, "vm_up")
    assert rc != 0 and "no usable Google credentials" in out
    assert "gcloud auth application-default login" in out
    assert fake.requests == []


@pytest.mark.vm_experiments
def test_expired_credentials(fake: FakeCompute, repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An ADC file as `gcloud auth application-default login` writes for a workforce identity pool;
    # its token endpoint is the fake, which refuses the refresh token (invalid_grant).
    adc = repo.parent / "adc.json"
    adc.write_text(json.dumps({
        "type": "external_account_authorized_user",
        "audience": "//iam.googleapis.com/locations/global/workforcePools/p/providers/q",
        "client_id": "id", "client_secret": "secret", "refresh_token": "expired-refresh-token",
        "token_url": f"{fake.url}/token", "universe_domain": "googleapis.com"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    rc, out = doit(repo, "vm_up")
    assert rc != 0 and "Google credentials expired or revoked" in out and "invalid_grant" in out
    assert "gcloud auth application-default login" in out
    assert [r.path for r in fake.requests] == ["/token"]
    assert not fake.instances and not fake.firewalls


def test_vm_down_and_status_without_vm(fake: FakeCompute, repo: Path) -> None:
    rc, out = doit(repo, "vm_status")
    assert rc == 0 and "VM mt-test in proj-1/us-east5-b: none" in out
    rc, out = doit(repo, "vm_down")
    assert rc == 0 and "VM mt-test: already gone" in out and "mt-test-ssh: already gone" in out


def test_doit_list_documents_every_task(repo: Path) -> None:
    rc, out = doit(repo, "list")
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("vm_")}
    assert rc == 0 and sorted(lines) == ["vm_down", "vm_run", "vm_setup", "vm_shell", "vm_status",
                                         "vm_up"]
    assert all(len(line.split()) > 4 for line in lines.values())


# ---------------------------------------------------------------- provisioning modes

GOLDEN_SCHEDULING = {   # the scheduling fields and reservation affinity each mode sends
    # an ordinary reservation (the fake's default; calendar mode is the tutorial's, above)
    "reservation": ({**GOLDEN_INSTANCE["scheduling"], "provisioningModel": "STANDARD"},
                    GOLDEN_INSTANCE["reservationAffinity"]),
    # gcloud ... --provisioning-model=SPOT --instance-termination-action=DELETE
    #   --maintenance-policy=TERMINATE --no-restart-on-failure
    "spot": ({"provisioningModel": "SPOT", "instanceTerminationAction": "DELETE",
              "onHostMaintenance": "TERMINATE", "automaticRestart": False,
              "maxRunDuration": {"seconds": "14400"}}, None),
    "on-demand": ({"provisioningModel": "STANDARD", "instanceTerminationAction": "DELETE",
                   "onHostMaintenance": "TERMINATE", "automaticRestart": False,
                   "maxRunDuration": {"seconds": "14400"}}, None),
    # gcloud ... --provisioning-model=FLEX_START --reservation-affinity=none --max-run-duration=4h
    #   --instance-termination-action=DELETE --request-valid-for-duration=1h (params, checked below)
    "flex-start": ({"provisioningModel": "FLEX_START", "instanceTerminationAction": "DELETE",
                    "onHostMaintenance": "TERMINATE", "automaticRestart": False,
                    "maxRunDuration": {"seconds": "14400"}}, {"consumeReservationType": "NO_RESERVATION"}),
}


@pytest.mark.preemption
@pytest.mark.parametrize("mode", sorted(GOLDEN_SCHEDULING))
def test_scheduling_per_provisioning_mode(fake: FakeCompute, mode: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each mode's insert body, as sent; the fake accepts it (it refuses what Compute refuses)."""
    if mode != "reservation":
        monkeypatch.delenv("RESERVATION")      # only a reservation's VM needs one
    zone = "us-east5-a" if mode == "flex-start" else "us-east5-b"   # us-east5-a grants Flex-start v6e VMs
    monkeypatch.setenv("ZONE", zone)
    golden = json.loads(json.dumps(GOLDEN_INSTANCE).replace("us-east5-b", zone))
    cfg = vm_config.load_config({"provisioning": mode})
    vm_config.check_create(cfg)
    compute = Compute(cfg.project, cfg.zone)
    instance = compute.create_instance(
        instance_body(cfg, cfg.name, KEY, {"app": "mtpipe"}, compute.provisioning_model(cfg)))
    (insert,) = fake.inserts()
    body = without_idle_watch(drop_empty(insert.json()))
    scheduling, affinity = GOLDEN_SCHEDULING[mode]
    assert body["scheduling"] == scheduling and body.get("reservationAffinity") == affinity
    assert body.pop("params", None) == ({"requestValidForDuration": {"seconds": "3600"}}
                                        if mode == "flex-start" else None)
    assert {k: v for k, v in body.items() if k not in ("scheduling", "reservationAffinity", "labels")} \
        == {k: v for k, v in golden.items() if k not in ("scheduling", "reservationAffinity", "labels")}
    assert instance.status == "RUNNING" and instance.scheduling.provisioning_model == scheduling[
        "provisioningModel"]
    rate = prices.vm_rate(cfg)   # 8 chips at conf/prices.yaml's v6e price in us-east5; a reservation: on demand
    assert rate.usd_per_hour == pytest.approx({"reservation": 21.6, "spot": 9.72, "on-demand": 21.6,
                                               "flex-start": 10.16}[mode])
    assert rate.reservation == ("v6e-res" if mode == "reservation" else None)


@pytest.mark.preemption
def test_on_demand_without_time_limit_has_no_termination_action(fake: FakeCompute) -> None:
    cfg = vm_config.load_config({"provisioning": "on-demand", "max_run_duration_s": 0})
    fields, affinity = bodies.scheduling(cfg, "STANDARD")
    assert fields == {"provisioning_model": "STANDARD", "on_host_maintenance": "TERMINATE",
                      "automatic_restart": False} and affinity is None


@pytest.mark.preemption
@pytest.mark.parametrize("args, overlay, message", [
    (["--provisioning=spotty"], "",
     "vm.provisioning: 'spotty' is not one of reservation, spot, on-demand, flex-start (from --provisioning). Fix: pass "
     "--provisioning=spot"),
    (["--provisioning=flex-start"], "max_run_duration_s: 0\n",
     "vm.max_run_duration_s: is 0 with provisioning: flex-start, which Compute runs for a limited time only"),
    (["--provisioning=flex-start"], "max_run_duration_s: 604801\n",
     "Fix: set max_run_duration_s between 1 and 604800"),
    ([], "zones: [us-east5-b, europe-west4-a]\n",
     "vm.zones: lists 2 zones with provisioning: reservation, and a reservation is in one zone"),
    (["--provisioning=spot"], "zones: [us-east5-a, europe-west4-a]\n",
     "vm.zone: 'us-east5-b' (ZONE / --zone) is not one of zones: ['us-east5-a', 'europe-west4-a']"),
    (["--provisioning=spot"], "zones: [us-east5-b, us-east5-b]\n", "vm.zones: ['us-east5-b', 'us-east5-b'] names "
     "a zone twice"),
    (["--provisioning=spot"], "zones: [us-east5]\n", "vm.zones: 'us-east5' is not a zone name"),
    ([], "reservation_model: maybe\n",
     "vm.reservation_model: 'maybe' is not one of auto, bound, standard"),
    (["--reservation=other/v6e-res"], "",
     "vm.reservation: 'other/v6e-res' is neither a reservation name nor projects/PROJECT/reservations/NAME"),
    ([], "max_recoveries: -1\n", "vm.max_recoveries: is negative"),
    ([], "boot_disk_type: pd-balanced\n",
     "vm.boot_disk_type: 'pd-balanced' cannot be the boot disk of a ct6e-standard-8t VM"),
])
def test_bad_provisioning_settings_fail_before_any_request(
        fake: FakeCompute, repo: Path, args: list[str], overlay: str, message: str) -> None:
    config = Path(os.environ[vm_config.CONFIG_ENV])
    config.write_text(config.read_text() + overlay)
    rc, out = doit(repo, "vm_up", *args)
    assert rc != 0 and message in out, out
    assert fake.requests == []


@pytest.mark.cloud_contract
def test_the_price_table_is_checked_and_dated(tmp_path: Path) -> None:
    """conf/prices.yaml: per-chip prices by region with their date and source; a bad value names its key."""
    v6e = prices.load().tpu["v6e"]
    on_demand, spot, flex = v6e.per_chip_hour.on_demand, v6e.per_chip_hour.spot, v6e.per_chip_hour.flex_start
    assert (on_demand.usd["us-east1"], on_demand.usd["europe-west4"], on_demand.usd["asia-northeast1"]) == (2.70, 2.97, 3.24)
    assert (spot.usd["us-central1"], flex.usd["us-central1"]) == (0.544, 1.27)
    assert all(p.as_of and "https://cloud.google.com/" in p.source for p in (on_demand, spot, flex))
    assert flex.as_of.startswith("assumed") and "53%" in flex.as_of   # no Flex-start price found: a judgement, said so
    assert set(prices.load().tpu) == set(generations.load())   # every generation priced
    bad = tmp_path / "prices.yaml"
    bad.write_text(prices.PRICES.read_text().replace("us-central1: 0.544", "us-central1: cheap"))
    with pytest.raises(ConfigError, match=r"^prices.tpu.v6e.per_chip_hour.spot.usd: .*cheap"):
        prices.load(bad)
    bad.write_text(prices.PRICES.read_text().replace("      spot:", "      reservation:"))
    with pytest.raises(ConfigError, match=r"^prices.tpu.v6e.per_chip_hour.reservation: is not a key"):
        prices.load(bad)


@pytest.mark.price
@pytest.mark.cloud_contract
def test_a_vm_is_priced_in_its_zones_region_and_spot_v5e_is_priced() -> None:
    """The zone picks the region (no zone: the generation's default region, said so); the line names
    region and provisioning model; Spot v5e has a price; a region the table lacks is refused naming its key."""
    cfg = vm_config.load_config({"machine_type": "ct5lp-hightpu-8t", "boot_disk_type": "pd-balanced",
                                 "provisioning": "on-demand"})
    cfg = cfg.model_copy(update={"zone": None})
    rate = prices.vm_rate(cfg)
    assert (rate.tpu, rate.chips, rate.usd_per_hour) == ("v5e", 8, pytest.approx(9.60))
    assert "v5e on-demand in us-central1 (no zone set)" in rate.describe()
    cfg = cfg.model_copy(update={"provisioning": "spot", "zone": "europe-west4-b"})
    rate = prices.vm_rate(cfg)
    assert rate.price.usd == 0.445 and "v5e spot in europe-west4," in rate.describe()
    with pytest.raises(ConfigError) as err:
        prices.vm_rate(cfg.model_copy(update={"zone": "mars-central1-a"}))
    assert err.value.key == "prices.tpu.v5e.per_chip_hour.spot.usd.mars-central1" and "conf/prices.yaml" in err.value.fix
    with pytest.raises(ConfigError) as err:
        prices.vm_rate(cfg.model_copy(update={"provisioning": "flex-start"}))
    assert err.value.key == "prices.tpu.v5e.per_chip_hour.flex-start"


@pytest.mark.preemption
def test_spot_needs_no_reservation(fake: FakeCompute, repo: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without RESERVATION a Spot vm_up passes the Compute checks without asking for one (this
    repo has no params.yaml, so the project checks stop it, before anything is created)."""
    monkeypatch.delenv("RESERVATION")
    rc, out = doit(repo, "vm_up", "--provisioning=spot")
    assert rc != 0 and "params.yaml: is not committed" in out, out
    assert fake.calls("GET", "/machineTypes/ct6e-standard-8t")
    assert not [r for r in fake.requests if "/reservations/" in r.path]
    assert fake.inserts() == [] and not fake.firewalls


QUOTA_MESSAGE = "Quota 'TPUS_PER_TPU_FAMILY' exceeded.  Limit: 0.0 in region us-east5."


@pytest.mark.cloud_contract
@pytest.mark.parametrize("failure", [("http", 403, "quotaExceeded", QUOTA_MESSAGE),
                                     ("operation", "QUOTA_EXCEEDED", QUOTA_MESSAGE)], ids=["403", "operation"])
def test_quota_is_told_apart_from_permission(fake: FakeCompute, failure: tuple) -> None:
    """Compute answers quota exhaustion with 403 (or a QUOTA_EXCEEDED operation) as it answers a missing
    role: the error names the quota and where to raise it, not IAM roles."""
    cfg = vm_config.load_config()
    compute = Compute(cfg.project, cfg.zone)
    fake.insert_failures.append(failure)
    with pytest.raises(ProviderError) as err:
        compute.create_instance(instance_body(cfg, cfg.name, KEY, {}, "STANDARD"))
    assert "quota exceeded" in str(err.value) and "TPUS_PER_TPU_FAMILY" in str(err.value)
    assert "iam-admin/quotas?project=proj-1" in str(err.value) and "roles/" not in str(err.value)
    fake.insert_failures.append(("http", 403, "forbidden", "Required 'compute.instances.create' permission"))
    with pytest.raises(ProviderError, match="permission denied.*roles/compute.instanceAdmin.v1"):
        compute.create_instance(instance_body(cfg, cfg.name, KEY, {}, "STANDARD"))


STOCKOUT = ("operation", "ZONE_RESOURCE_POOL_EXHAUSTED",
            "The zone 'projects/proj-1/zones/us-east5-b' does not have enough resources available to fulfill "
            "the request. Try a different zone, or try again later.")


@pytest.mark.cloud_contract
def test_a_stockout_is_retried_then_the_vm_is_created(fake: FakeCompute, capsys: pytest.CaptureFixture) -> None:
    from mtpipe.cloud.lifecycle.run import VmLifecycle

    cfg = vm_config.load_config({"stockout.first_wait_s": 0.05})
    fake.insert_failures += [STOCKOUT, STOCKOUT]
    instance = VmLifecycle(cfg, Path(".")).creation.create_vm(KEY, {})
    assert instance.status == "RUNNING" and len(fake.inserts()) == 3
    assert capsys.readouterr().out.count("(stockout); trying again in") == 2


@pytest.mark.cloud_contract
def test_a_stockout_that_lasts_names_the_other_zones(fake: FakeCompute) -> None:
    """After stockout.retry_for_s the error says which zones offer the machine type (the API's
    machineTypes.aggregatedList), and no VM exists."""
    from mtpipe.cloud.lifecycle.run import VmLifecycle

    # a window of 1 s with waits from 0.05 s: a second insert even when a loaded machine makes the first slow
    cfg = vm_config.load_config({"stockout.retry_for_s": 1.0, "stockout.first_wait_s": 0.05})
    fake.insert_failures += [STOCKOUT] * 20
    with pytest.raises(CapacityError, match=r"no capacity in us-east5-b.*zones tried: us-east5-b, for 1 s. "
                                                 r"Other zones that offer ct6e-standard-8t: europe-west4-a \(add "
                                                 r"them to zones: in conf/vm.yaml"):
        VmLifecycle(cfg, Path(".")).creation.create_vm(KEY, {})
    assert len(fake.inserts()) >= 2 and not fake.instances
    (listing,) = fake.calls("GET", "/projects/proj-1/aggregated/machineTypes")
    assert "name+%3D+ct6e-standard-8t" in listing.path or "name%20%3D%20ct6e-standard-8t" in listing.path
