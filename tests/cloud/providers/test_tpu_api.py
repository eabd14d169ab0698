"""The Cloud TPU API route (mtpipe/cloud/providers/gcp/tpu_api/): a v5e VM (machine type ct5lp-hightpu-8t,
what conf/hardware/v5e-8.yaml asks of it), which Compute Engine refuses, created as a queued resource.

Against the fake TPU API (tests/fakes/fake_tpu.py: every request and answer judged by Google's tpu.v2
discovery document) beside the fake Compute API (the network, its firewall, the checks' reads) and the
loopback VM of tests/vm_world.py: `doit vm_run` in process around a one-stage repo (the `world`
fixture: no MaxText, the embedded pipeline is test_vm_cycle.py's), or the lifecycle's creation alone.
"""

from __future__ import annotations

import getpass
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
from fakes import discovery, fake_tpu
from fakes.fake_compute import FakeCompute
from fakes.fake_metadata import FakeMetadata, running_metadata
from fakes.fake_tpu import FakeTpu, Outcome
from fakes.gcs_emulator import SA_TOKEN_PREFIX
from vm_world import Env, add_count_stage, admitted_by_nodes, experiments, idle_limit

from mtpipe.cloud.checks.gcp import caller, quota
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis, Unknown
from mtpipe.cloud.providers.gcp import idle_watch
from mtpipe.cloud.lifecycle.run import VmLifecycle
from mtpipe.cloud.providers.gcp.tpu_api import provider
from mtpipe.cloud.providers.gcp.tpu_api.client import TPU_ENDPOINT_ENV
from mtpipe.cloud.settings import vm_config, vm_state
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations

pytestmark = [pytest.mark.provisioning, pytest.mark.tpu_api]
V5E = {"machine_type": "ct5lp-hightpu-8t", "boot_disk_type": "pd-balanced", "provisioning": "on-demand"}
KEY = ("proj-1", "us-east5-b", "mt-test")
V5E_QUOTA = generations.load()["v5e"].tpu_api.quota


@pytest.fixture
def tpu_world(world: Env) -> Iterator[tuple[Env, FakeTpu]]:
    """`world` with a v5e VM config: the fake TPU API beside the fake Compute API, the loopback VM
    admitting the keys of the READY nodes; a one-stage repo (`count` writes params.yaml's steps)."""
    w = world
    with fake_tpu.running_fake() as tpu:
        w.env[TPU_ENDPOINT_ENV] = tpu.url
        w.env.pop("RESERVATION")
        w.configure(**V5E, tpu_api__poll_s=0.05, stockout__retry_for_s=0)
        w.sshd.authorized = lambda: admitted_by_nodes(tpu)
        add_count_stage(w)
        yield w, tpu


def assert_nothing_left(w: Env, tpu: FakeTpu) -> None:
    assert not tpu.nodes and not tpu.queued and not w.fake.firewalls and not w.fake.instances
    assert not (w.repo / vm_state.STATE_FILE).exists()
    assert w.fake.inserts() == []   # never Compute Engine's instances.insert


def test_the_route_is_chosen_in_one_place() -> None:
    """v5e takes the TPU API by machine type, v6e Compute Engine unless route: tpu_api; ct5lp on the Compute
    route is refused naming route: tpu_api; Flex-start on the TPU API route is refused naming the API
    version that has it (v2alpha1: FLEX_START is in its discovery document, not in v2's)."""
    v5e = vm_config.load_config(V5E)
    assert vm_config.route(v5e) == "tpu_api" and vm_config.accelerator_type(v5e) == "v5litepod-8"
    assert vm_config.runtime_version(v5e) == "v2-alpha-tpuv5-lite"
    assert "the Cloud TPU API creates v5litepod-8" in vm_config.check_route(v5e)
    v6e = vm_config.load_config({"provisioning": "on-demand"})
    assert vm_config.route(v6e) == "compute" and vm_config.check_route(v6e) == "Compute Engine creates ct6e-standard-8t"
    v6e_tpu = vm_config.load_config({"provisioning": "spot", "route": "tpu_api"})
    assert vm_config.route(v6e_tpu) == "tpu_api" and vm_config.accelerator_type(v6e_tpu) == "v6e-8"
    with pytest.raises(ConfigError, match="route: tpu_api"):
        vm_config.check_route(vm_config.load_config({**V5E, "route": "compute"}))
    with pytest.raises(ConfigError, match="the Cloud TPU API offers it in v2alpha1 only"):
        vm_config.check_route(vm_config.load_config({"provisioning": "flex-start", "route": "tpu_api",
                                                     "zone": "us-east5-a"}))
    with pytest.raises(ConfigError, match="vm.route"):
        vm_config.load_config({"route": "gke"})
    assert "FLEX_START" not in fake_tpu.DOCUMENT.read_text()
    assert '"FLEX_START"' in (discovery.DOCUMENTS / "tpu.v2alpha1.json").read_text()


@pytest.mark.slow
@pytest.mark.billing
def test_vm_run_creates_a_queued_resource_and_deletes_it(tpu_world: tuple[Env, FakeTpu], tmp_path: Path) -> None:
    """vm_run on v5e: a queued resource waits for capacity (said while WAITING_FOR_RESOURCES), its node
    runs the experiment, which comes back; the node and the queued resource are deleted, the firewall
    rule too; every request passed tpu.v2's discovery document. The node runs as the project's Compute
    default service account, sent explicitly with its scope; its idle watch found that account may not
    delete it (<lock>.may-delete, as test_a_node_that_may_not_delete_itself_powers_off shows it written),
    and vm_run says so after the setup, before training."""
    w, tpu = tpu_world
    lock = tmp_path / "vm-busy"
    w.configure(idle__lock_file=str(lock))
    Path(f"{lock}{idle_watch.MAY_DELETE}").write_text("refused\n")   # the loopback VM's watch verdict
    tpu.outcomes.append(Outcome("ACTIVE", waits=3))
    out = w.doit("vm_run", "--set=steps=5", "--exp-name=five", "--no-preflight").stdout
    assert "queued resource mt-test is WAITING_FOR_RESOURCES in us-east5-b" in out, out
    assert "the Cloud TPU API creates v5litepod-8" in out and "experiment five" in out
    warning = "WARNING: node mt-test's service account may not delete it (tpu.nodes.delete refused to its own token)"
    assert warning in out and "a stopped TPU node is not known to stop billing" in out, out
    assert "if this laptop stops first, only `doit vm_down` does" in out and "vm_run has no detached mode" in out
    assert out.index("setting up VM mt-test") < out.index(warning) < out.index("running the pipeline on mt-test")
    account = {"email": w.fake.default_service_account("proj-1"), "scope": ["https://www.googleapis.com/auth/cloud-platform"]}
    assert json.loads(tpu.calls("POST", "/queuedResources")[0][2])["tpu"]["nodeSpec"][0]["node"]["serviceAccount"] == account
    assert experiments(w)["five"]["metrics"] == {"count.json": {"steps": 5}}
    (create,) = tpu.calls("POST", "/queuedResources")
    assert "queuedResourceId=mt-test" in create[1]
    assert '"acceleratorType": "v5litepod-8"' in create[2] and '"runtimeVersion": "v2-alpha-tpuv5-lite"' in create[2]
    assert '"validUntilDuration": "3600s"' in create[2] and '"enableExternalIps": true' in create[2]
    assert tpu.calls("DELETE", "/queuedResources/mt-test?force=true")
    assert_nothing_left(w, tpu)


def test_a_failed_queued_resource_leaves_nothing(tpu_world: tuple[Env, FakeTpu]) -> None:
    """A queued resource that FAILS (no capacity before its time ran out): a clear error, nothing left."""
    w, tpu = tpu_world
    tpu.outcomes.append(Outcome("FAILED", waits=1))
    out = w.doit("vm_up", ok=False).stdout
    assert "queued resource mt-test FAILED in us-east5-b: no capacity (There is no more capacity" in out, out
    # the other zones the Cloud TPU API offers v5litepod-8 in (locations.list, each one's acceleratorTypes.list)
    assert "Other zones that offer ct5lp-hightpu-8t: us-west4-a (add them to zones:" in out, out
    assert tpu.calls("DELETE", "/queuedResources/mt-test")
    assert_nothing_left(w, tpu)


def test_a_queued_resource_failing_for_another_reason_names_it(tpu_world: tuple[Env, FakeTpu]) -> None:
    w, tpu = tpu_world
    tpu.outcomes.append(Outcome("FAILED", code=3, message="Invalid runtime version"))
    out = w.doit("vm_up", ok=False).stdout
    assert "GcpError: queued resource mt-test FAILED in us-east5-b: Invalid runtime version" in out, out
    assert_nothing_left(w, tpu)


def test_ctrl_c_while_waiting_leaves_nothing(fake: FakeCompute, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the queued resource is WAITING_FOR_RESOURCES: it is deleted, the state file forgotten."""
    with fake_tpu.running_fake() as tpu:
        monkeypatch.setenv(TPU_ENDPOINT_ENV, tpu.url)
        tpu.outcomes.append(Outcome("ACTIVE", waits=50))
        cfg = vm_config.load_config({**V5E, "tpu_api.poll_s": 0.05, "ssh.key_file": str(tmp_path / "id"),
                                     "firewall.source_ranges": ["127.0.0.1/32"]})
        said = []

        def say(line: str) -> None:
            said.append(line)
            if "WAITING_FOR_RESOURCES" in line:
                raise KeyboardInterrupt

        with mock.patch.object(provider, "_say", say), pytest.raises(KeyboardInterrupt):
            VmLifecycle(cfg, tmp_path, yes=True).creation.create({})
        assert len(tpu.calls("POST", "/queuedResources")) == 1 and tpu.calls("DELETE", "/queuedResources/mt-test")
        assert not tpu.queued and not tpu.nodes and not fake.firewalls
        assert not (tmp_path / vm_state.STATE_FILE).exists()


def test_vm_down_finds_what_the_state_file_lost(tpu_world: tuple[Env, FakeTpu]) -> None:
    """No state file: vm_down deletes this user's labelled node (with its queued resource) and a queued
    resource still waiting, and names another user's."""
    w, tpu = tpu_world
    user = vm_config.label_value(getpass.getuser())
    for name, who, waits in (("mt-test", user, 0), ("mt-queued", user, 99), ("mt-other", "someone", 0)):
        body = {"tpu": {"nodeSpec": [{"parent": "projects/proj-1/locations/us-east5-b", "nodeId": name, "node": {
            "acceleratorType": "v5litepod-8", "runtimeVersion": "v2-alpha-tpuv5-lite",
            "labels": {"app": "mtpipe", "created-by": who}}}]}}
        tpu.outcomes.append(Outcome("ACTIVE", waits=waits))
        tpu.handle("POST", f"/v2/projects/proj-1/locations/us-east5-b/queuedResources?queuedResourceId={name}", body)
        if not waits:
            while ("proj-1", "us-east5-b", name) not in tpu.nodes:
                tpu.handle("GET", f"/v2/projects/proj-1/locations/us-east5-b/queuedResources/{name}", {})
    w.env.pop("NAME")   # no VM named: vm_down looks for this user's labelled ones
    out = w.doit("vm_down").stdout
    assert "VM mt-test: deleted" in out and "VM mt-queued: deleted" in out, out
    assert "VM mt-other, created by someone, left alone" in out
    assert set(tpu.queued) == {("proj-1", "us-east5-b", "mt-other")}
    assert set(tpu.nodes) == {("proj-1", "us-east5-b", "mt-other")}


@pytest.mark.billing
def test_doit_check_covers_the_tpu_api_route(tpu_world: tuple[Env, FakeTpu]) -> None:
    """doit check on v5e: the route, the accelerator type the TPU API offers, the Cloud TPU API among the
    APIs and roles/tpu.admin's and roles/compute.networkViewer's permissions among those tested; a missing
    one is named with its role. The TPU API's per-zone quota is read from Cloud Quotas: a quota id it does
    not know is unknown; a zone whose limit is below the node's cores is said and skipped."""
    w, tpu = tpu_world
    w.fake.org.permissions = (set(caller.TPU_PERMISSIONS) | set(caller.NETWORK_PERMISSIONS)
                              | set(caller.FIREWALL_PERMISSIONS) | {caller.ACT_AS}) - {"tpu.nodes.create", "compute.firewalls.list"}
    out = w.doit("check", ok=False).stdout
    assert "ok  route: the Cloud TPU API creates v5litepod-8 (ct5lp-hightpu-8t) as a queued resource" in out, out
    assert "ok  machine type: the Cloud TPU API offers v5litepod-8 in us-east5-b" in out
    assert "tpu.googleapis.com" in out.split("APIs: ")[1].splitlines()[0]
    assert "FAILS  permissions:" in out and "tpu.nodes.create (in roles/tpu.admin)" in out
    assert "compute.firewalls.list (in roles/compute.networkViewer)" in out
    assert "unknown  zones and quota: Cloud Quotas knows no quota TPUV5sLitepodPerProjectPerZoneForTPUAPI" in out
    assert "unknown  node's self-delete: the IAM policy of project proj-1 could not be read here" in out
    assert not tpu.queued and not tpu.calls("POST", "/queuedResources")
    w.fake.org.permissions = None
    w.configure(zones=["us-east5-b", "us-west4-a"])
    w.fake.org.quota_infos[V5E_QUOTA.on_demand] = {"us-east5-b": 4, "": 8}   # in cores, read from Cloud Quotas
    out = w.doit("check").stdout
    assert "0 FAILS" in out, out
    assert (f"ok  zones and quota: quota {V5E_QUOTA.on_demand} allows 4 cores in us-east5-b: skipping us-east5-b; "
            f"quota {V5E_QUOTA.on_demand} has room for a v5litepod-8 node (8 cores) in us-west4-a") in out, out


@pytest.mark.billing
def test_the_tpu_api_quota_is_read_from_cloud_quotas(fake: FakeCompute) -> None:
    """quota.tpu_api_zones on its own: a Spot node reads the generation's preemptible quota id, an
    on-demand one its on_demand id; no zone with room stops before spending, naming the quota, its limits
    and where to raise it; a reservation's node takes no quota; Cloud Quotas not enabled is unknown. Every
    request and answer is held to the contract committed from Google's client package (cloudquotas.v1)."""
    apis, zones = GoogleApis(), ["us-east5-b", "us-west4-a"]
    assert discovery.api("cloudquotas.v1").methods[0].id.startswith("cloudquotas.projects.locations.services.quotaInfos")
    fake.org.quota_infos[V5E_QUOTA.preemptible] = {"us-west4-a": 0, "": 16}
    found, cfg = quota.tpu_api_zones(vm_config.load_config({**V5E, "provisioning": "spot", "zones": zones}), apis)
    assert cfg.zone == "us-east5-b" and cfg.zones == ["us-east5-b"], found
    assert f"quota {V5E_QUOTA.preemptible} allows 0 cores in us-west4-a: skipping us-west4-a" in found
    fake.org.quota_infos[V5E_QUOTA.on_demand] = {"": 4}
    on_demand = vm_config.load_config({**V5E, "zones": zones})
    with pytest.raises(ConfigError, match=f"quota {V5E_QUOTA.on_demand} allows 4 cores in us-east5-b; 4 cores in "
                       "us-west4-a, and a v5litepod-8 node takes 8: the queued resource would be refused .HTTP 429."
                       ".*request at least 8 at https://console.cloud.google.com/iam-admin/quotas.project=proj-1"):
        quota.tpu_api_zones(on_demand, apis)
    reserved = vm_config.load_config({**V5E, "provisioning": "reservation", "reservation": "r1"})
    assert quota.tpu_api_zones(reserved, apis)[0] == "a reservation's nodes use what it holds, no quota"
    fake.org.disabled.add("cloudquotas.googleapis.com")
    with pytest.raises(Unknown, match=f"could not read the quota {V5E_QUOTA.on_demand} from Cloud Quotas"):
        quota.tpu_api_zones(on_demand, apis)
    fake.org.check()


@pytest.mark.slow
def test_a_preempted_spot_node_is_replaced(tpu_world: tuple[Env, FakeTpu]) -> None:
    """A Spot v6e node on the TPU API route PREEMPTED mid-run: vm_run deletes it with its queued resource,
    queues a new one and runs the experiment again there, as the Compute route recovers a Spot VM."""
    w, tpu = tpu_world
    w.configure(machine_type="ct6e-standard-8t", boot_disk_type="hyperdisk-balanced", provisioning="spot",
                route="tpu_api", spot_without_work_bucket=True,
                run__command='if [ ! -e "$HOME/preempt-me" ]; then touch "$HOME/preempt-me"; sleep 60; fi; '
                             'source "$HOME/venv/bin/activate" && dvc pull --allow-missing && {dvc} && dvc push')
    marker = w.sshd.home / "preempt-me"

    def preempter() -> None:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        tpu.preempt(*KEY, then=w.sshd.drop_sessions)

    thread = threading.Thread(target=preempter, daemon=True)
    thread.start()
    out = w.doit("vm_run", "--set=steps=3", "--exp-name=three", "--no-preflight").stdout
    thread.join(5)
    assert "recovery 1 of 3: VM mt-test was preempted (status TERMINATED)" in out, out
    assert len(tpu.calls("POST", "/queuedResources")) == 2 and '"spot": {}' in tpu.calls("POST", "/queuedResources")[0][2]
    assert experiments(w)["three"]["metrics"] == {"count.json": {"steps": 3}}
    assert_nothing_left(w, tpu)


def test_zones_offering_lists_the_locations_that_offer_the_accelerator(fake: FakeCompute,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """zones_offering on the TPU API route: every location (locations.list, followed page by page) whose
    acceleratorTypes.list holds the machine type's accelerator type; none for a machine type the route
    does not create."""
    with fake_tpu.running_fake() as tpu:
        monkeypatch.setenv(TPU_ENDPOINT_ENV, tpu.url)
        tpu.zones["europe-west4-a"] = {"v6e-8"}
        tpu.zones["us-central1-a"] = set()
        api = provider.TpuApi("proj-1", "us-east5-b")
        assert api.zones_offering("ct5lp-hightpu-8t") == ["us-east5-b", "us-west4-a"]
        assert len(tpu.calls("GET", "/locations?pageToken=")) == 3   # 4 locations, one a page
        assert len(tpu.calls("GET", "/acceleratorTypes")) == 4
        assert api.zones_offering("ct6e-standard-8t") == ["europe-west4-a", "us-east5-b", "us-west4-a"]
        assert api.zones_offering("n2-standard-8") == []


# ---------------------------------------------------------------- the idle watch on a node

@pytest.fixture
def idle_node(tpu_world: tuple[Env, FakeTpu], tmp_path: Path) -> Iterator[tuple[Env, FakeTpu, Path]]:
    """tpu_world with a 1-s idle limit and the node's metadata server; where the node's lock file is."""
    w, tpu = tpu_world
    with running_metadata(FakeMetadata(lambda: "vm-sa@proj-1.iam.gserviceaccount.com")) as metadata:
        yield w, tpu, idle_limit(w, tmp_path, metadata.host)


def boot_node(tpu: FakeTpu) -> None:
    """Run the node's startup script (its metadata, from the queued resource's node spec) as the TPU VM
    does at boot: it starts the idle watch, detached."""
    subprocess.run(["bash", "-c", tpu.nodes[KEY]["metadata"]["startup-script"]], check=True, timeout=30)


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_an_idle_node_deletes_its_queued_resource(idle_node: tuple[Env, FakeTpu, Path]) -> None:
    """Idle past the limit, the node sends queuedResources.delete (force) for its queued resource to the
    Cloud TPU API with its service account's token; while a vm_run command holds the lock it is kept."""
    w, tpu, lock = idle_node
    w.doit("vm_up", "--keep")
    assert tpu.nodes[KEY]["state"] == "READY"
    holder = subprocess.Popen(["flock", "-s", str(lock), "sleep", "2.5"])   # a pipeline running
    try:
        time.sleep(0.3)
        boot_node(tpu)
        time.sleep(1.8)   # past the limit, but busy
        assert tpu.calls("DELETE", "/mt-test") == [] and tpu.nodes[KEY]["state"] == "READY"
    finally:
        holder.wait(10)
    wait_for(lambda: tpu.calls("DELETE", "/queuedResources/mt-test?force=true"))
    assert Path(f"{lock}{idle_watch.MAY_DELETE}").read_text() == "granted\n"   # proven at the watch's start
    log = Path(f"{lock}.log")
    wait_for(lambda: log.is_file() and "deleting this VM (queuedResources.delete: HTTP 200)" in log.read_text())
    assert tpu.tokens[-1] == f"Bearer {SA_TOKEN_PREFIX}vm-sa@proj-1.iam.gserviceaccount.com"   # the node's token
    for op in [o for o in tpu.operations.values() if not o["op"]["done"]]:   # the API finishes the delete
        op["op"]["done"] = True
        op["done"]()
    assert not tpu.queued and not tpu.nodes
    assert "already gone" in w.doit("vm_down").stdout


@pytest.mark.billing
def test_a_node_that_may_not_delete_itself_powers_off(idle_node: tuple[Env, FakeTpu, Path], tmp_path: Path) -> None:
    """Its service account lacks tpu.nodes.delete: the watch finds so at its start (testIamPermissions
    with the node's token, written beside the lock), and idle, refused (403), it runs
    idle.poweroff_command saying a stopped node is not known to stop billing; vm_down deletes it."""
    w, tpu, lock = idle_node
    w.doit("vm_up", "--keep")
    tpu.delete_denied = True
    w.fake.org.permissions = {"compute.instances.delete"}   # not tpu.nodes.delete
    boot_node(tpu)
    wait_for(lambda: (tmp_path / "powered-off").exists())
    assert Path(f"{lock}{idle_watch.MAY_DELETE}").read_text() == "refused\n"   # its token's testIamPermissions
    log = Path(f"{lock}.log")   # its last line comes once the power-off command returned
    wait_for(lambda: "powered off; a stopped TPU node is not known to stop billing" in log.read_text())
    assert "may this VM's service account delete it? refused" in log.read_text()
    assert "not allowed to delete this VM (HTTP 403): powered off" in log.read_text()
    assert KEY in tpu.queued and KEY in tpu.nodes
    tpu.delete_denied = False
    w.doit("vm_down")
    assert not tpu.queued and not tpu.nodes


def test_a_node_without_a_queued_resource_deletes_the_node(fake: FakeCompute) -> None:
    """A node the watch finds no queued resource of (queuedResources.delete: 404) is deleted itself."""
    with fake_tpu.running_fake() as tpu, running_metadata(FakeMetadata(lambda: "sa@proj-1.iam")) as metadata:
        tpu.nodes[KEY] = {"name": "projects/proj-1/locations/us-east5-b/nodes/mt-test", "state": "READY"}
        assert idle_watch.delete_self(metadata.host, "", tpu.url, "mt-test") == (200, "nodes.delete")
        assert [r[1] for r in tpu.requests] == [
            "/v2/projects/proj-1/locations/us-east5-b/queuedResources/mt-test?force=true",
            "/v2/projects/proj-1/locations/us-east5-b/nodes/mt-test"]
        assert tpu.nodes[KEY]["state"] == "DELETING"


def test_a_stockout_moves_to_the_next_zone(tpu_world: tuple[Env, FakeTpu]) -> None:
    """No capacity in the first zone of `zones:` (the queued resource FAILED): it is deleted there and the
    VM queued in the next zone, as on the Compute route."""
    w, tpu = tpu_world
    w.configure(zones=["us-east5-b", "us-west4-a"])
    tpu.outcomes += [Outcome("FAILED", waits=0), Outcome("ACTIVE")]
    w.doit("vm_up", "--keep")
    assert [r[1].split("/queuedResources")[0] for r in tpu.calls("POST", "/queuedResources")] == [
        "/v2/projects/proj-1/locations/us-east5-b", "/v2/projects/proj-1/locations/us-west4-a"]
    assert set(tpu.nodes) == {("proj-1", "us-west4-a", "mt-test")}
    assert set(tpu.queued) == {("proj-1", "us-west4-a", "mt-test")}
    w.doit("vm_down")
    assert_nothing_left(w, tpu)


@pytest.mark.billing
def test_a_quota_refusal_moves_to_the_next_zone(tpu_world: tuple[Env, FakeTpu]) -> None:
    """The Cloud TPU API refuses the queued resource for quota (HTTP 429 RESOURCE_EXHAUSTED, a QuotaFailure
    naming the zone's quota): the quota error names it and the VM is queued in the next zone, of the same
    region too (the TPU API's quotas are per zone, not Compute's regional ones)."""
    w, tpu = tpu_world
    tpu.zones["us-east5-a"] = set(fake_tpu.ACCELERATORS)
    tpu.quota_refused["us-east5-b"] = "TPUV5sLitepodServingPerProjectPerZoneForTPUAPI"
    w.configure(zones=["us-east5-b", "us-east5-a"])
    out = w.doit("vm_up", "--keep").stdout
    assert "the quota of zone us-east5-b is spent" in out and "TPUV5sLitepodServingPerProjectPerZoneForTPUAPI" in out, out
    assert set(tpu.nodes) == {("proj-1", "us-east5-a", "mt-test")}
    tpu.quota_refused["us-east5-a"] = "TPUV5sLitepodServingPerProjectPerZoneForTPUAPI"
    w.doit("vm_down")
    out = w.doit("vm_up", ok=False).stdout
    assert "QuotaExceeded" in out and "zones tried: us-east5-b, us-east5-a" in out, out
    assert_nothing_left(w, tpu)
