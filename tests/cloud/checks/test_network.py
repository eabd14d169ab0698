"""First contact with networks and SSH as organisations have them (mtpipe/cloud/checks/gcp/access.py,
ssh_route.py): every way the first paid run could die of the network, OS Login or a refused request
is met before the insert, with a message that names the fix and nothing left behind; where the
fix is to go on differently (OS Login, IAP, an existing firewall rule, a refused maxRunDuration),
vm_up goes on and the loopback VM accepts SSH.

The fake Compute API (tests/fakes/fake_compute.py) holds the networks, subnetworks, firewall rules,
Cloud Routers and project metadata, and serves the OS Login, Organization Policy and Resource
Manager calls (tests/fakes/fake_org.py), each request checked against its discovery document. The
loopback sshd admits, like a VM, the keys of its `ssh-keys` metadata, or with `enable-oslogin=TRUE`
those of the OS Login profiles for their POSIX users.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fakes import fake_gcloud
from fakes.fake_compute import Reservation
from google.cloud import compute_v1
from vm_world import Env

from mtpipe.cloud.providers.gcp import ssh_route
from mtpipe.cloud.settings import vm_state

pytestmark = [pytest.mark.checks, pytest.mark.first_contact]
NAT_ROUTER = {"name": "nat-router", "region": "us-east5", "network": "default",
              "nats": [{"name": "nat", "sourceSubnetworkIpRangesToNat": "ALL_SUBNETWORKS_ALL_IP_RANGES"}]}


def rule(name: str, ranges: list[str], **fields: object) -> dict:
    """A firewall rule as Compute stores it, on the default network, admitting tcp:22."""
    return {"name": name, "network": "global/networks/default", "direction": "INGRESS", "priority": 1000,
            "sourceRanges": ranges, "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}], **fields}


def nothing_created(w: Env) -> None:
    """No insert reached Compute: no VM, no firewall rule of ours, no state file."""
    assert w.fake.inserts() == [] and not w.fake.calls("POST", "/global/firewalls")
    assert ("proj-1", "mt-test-ssh") not in w.fake.firewalls and not (w.repo / vm_state.STATE_FILE).exists()


def up_and_down(w: Env) -> str:
    """vm_up (which must succeed), then vm_down; what vm_up printed. Nothing of ours is left."""
    out = w.doit("vm_up").stdout
    w.doit("vm_down")
    assert w.instance() is None and ("proj-1", "mt-test-ssh") not in w.fake.firewalls
    return out


def insert_body(w: Env) -> dict:
    return w.fake.inserts()[-1].json()


# ---------------------------------------------------------------- OS Login


def test_os_login_from_project_metadata_uses_the_os_login_user(world: Env) -> None:
    """enable-oslogin=TRUE: the key goes into the caller's OS Login profile, the VM gets no ssh-keys
    (it would ignore them) and SSH logs in as the profile's POSIX user; the loopback VM admits only that."""
    w = world
    w.fake.project_metadata["enable-oslogin"] = "TRUE"
    w.configure(ssh__os_login_account="ci-runner@example.com")
    out = w.doit("vm_up").stdout
    assert "OS Login (project metadata enable-oslogin=TRUE): the SSH key is in the OS Login profile of " \
           "ci-runner@example.com; SSH as ci_runner_example_com" in out, out
    assert [i for i in insert_body(w)["metadata"]["items"] if i["key"] != "startup-script"] == [
        {"key": "enable-oslogin", "value": "TRUE"}]   # and the idle watch (tests/cloud/providers/test_vm_idle.py)
    state = vm_state.read_state(w.repo)
    assert state["os_login"] is True and state["ssh_user"] == "ci_runner_example_com"
    assert "oslogin.users.importSshPublicKey" in {r.api_method for r in w.fake.requests}
    # later processes log in as the OS Login user the state file records
    assert "reusing VM mt-test" in w.doit("vm_up").stdout and len(w.fake.inserts()) == 1
    w.doit("vm_setup")
    assert w.sshd.commands
    w.doit("vm_down")
    assert w.instance() is None and not w.fake.firewalls


def test_os_login_required_by_the_organisation_without_login_rights(world: Env) -> None:
    w = world
    w.fake.org.policies["compute.requireOsLogin"] = [{"enforce": True}]
    w.fake.org.permissions = set()
    w.configure(ssh__os_login_account="ci-runner@example.com")
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.ssh.os_login: OS Login is on (organisation policy constraints/compute.requireOsLogin) and " \
           "ci-runner@example.com lacks compute.instances.osAdminLogin on project proj-1" in out, out
    assert "gcloud projects add-iam-policy-binding proj-1 --member user:ci-runner@example.com --role " \
           "roles/compute.osAdminLogin" in out
    nothing_created(w)
    w.fake.org.permissions = None
    w.fake.org.refuse_import = True
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.ssh.os_login: OS Login is on (organisation policy constraints/compute.requireOsLogin) and Google " \
           "refused to import the SSH key into the OS Login profile of ci-runner@example.com" in out, out
    nothing_created(w)


def test_os_login_without_an_account(world: Env) -> None:
    """The loopback credentials are anonymous: no email says whose profile gets the key."""
    w = world
    w.fake.project_metadata["enable-oslogin"] = "true"
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.ssh.os_login_account: OS Login is on (project metadata enable-oslogin=true), and the Google " \
           "credentials do not say whose OS Login profile gets the SSH key" in out, out
    nothing_created(w)


def test_an_unreadable_org_policy_is_said_and_passed_over(world: Env) -> None:
    """The Organization Policy API disabled (common in projects without an organisation): vm_up says
    it could not read the policies and goes on with the project metadata (ssh-keys)."""
    w = world
    w.fake.org.disabled.add("orgpolicy.googleapis.com")
    out = up_and_down(w)
    assert "could not read the organisation policy compute.requireOsLogin (reading the organisation policy " \
           "compute.requireOsLogin of project proj-1: the Organization Policy API is disabled in project " \
           "proj-1. Fix: gcloud services enable orgpolicy.googleapis.com --project proj-1" in out, out
    assert "could not read the organisation policy compute.vmExternalIpAccess" in out
    assert w.fake.inserts()[-1].json()["metadata"]["items"][0]["key"] == "ssh-keys"


# ---------------------------------------------------------------- networks


def test_no_default_network(world: Env) -> None:
    w = world
    w.fake.networks = {"prod-vpc": True}
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.network: network 'default' does not exist in project proj-1 (its networks: prod-vpc). Fix: set " \
           "network: to one of them in conf/vm.yaml, or create it: gcloud compute networks create default " \
           "--subnet-mode=auto --project proj-1" in out, out
    nothing_created(w)


def test_custom_mode_vpc_needs_a_subnetwork(world: Env) -> None:
    w = world
    w.fake.networks = {"corp": False}
    w.fake.subnetworks = {("us-east5", "corp-east5"): "corp", ("europe-west4", "corp-eu"): "corp"}
    w.fake.firewalls[("proj-1", "corp-ssh")] = {**rule("corp-ssh", ["127.0.0.0/8"]), "network": "global/networks/corp"}
    w.configure(network="corp")
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.subnetwork: network corp is a custom-mode VPC: a VM in it needs a subnetwork of region us-east5, " \
           "and subnetwork is null. Fix: set subnetwork: to one of them (corp-east5) in conf/vm.yaml" in out, out
    nothing_created(w)
    w.configure(subnetwork="corp-eu")
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.subnetwork: subnetwork 'corp-eu' of region us-east5 does not exist (network corp has there: " \
           "corp-east5)" in out, out
    nothing_created(w)
    w.configure(subnetwork="corp-east5")
    out = up_and_down(w)
    assert "firewall rule corp-ssh of network corp admits it" in out, out
    nic = insert_body(w)["networkInterfaces"][0]
    assert nic["network"] == "global/networks/corp" and nic["subnetwork"] == "regions/us-east5/subnetworks/corp-east5"
    assert not w.fake.calls("POST", "/global/firewalls")


def test_external_ip_forbidden_then_iap(world: Env, tmp_path: Path) -> None:
    """compute.vmExternalIpAccess denies every VM an external IP: refused before the insert, naming
    external_ip: false. With it, a Cloud NAT must serve the VM, gcloud must be on PATH, and SSH goes
    through `gcloud compute start-iap-tunnel` (a relay here) from IAP's range, admitted by the rule
    vm_up creates."""
    w = world
    w.fake.org.policies["compute.vmExternalIpAccess"] = [{"denyAll": True}]
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.external_ip: the organisation policy constraints/compute.vmExternalIpAccess forbids an external " \
           "IP for VM mt-test in project proj-1. Fix: set external_ip: false in conf/vm.yaml" in out, out
    nothing_created(w)
    w.configure(external_ip=False, firewall__source_ranges=None)
    no_gcloud = tmp_path / "no-gcloud"   # this machine may have a gcloud: a PATH with git only
    no_gcloud.mkdir()
    (no_gcloud / "git").symlink_to(shutil.which("git"))
    w.env["PATH"] = str(no_gcloud)
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.ssh.proxy_command: gcloud is not on PATH, and SSH to a VM without an external IP runs `gcloud " \
           f"compute start-iap-tunnel mt-test {w.sshd.port} --listen-on-stdin --zone us-east5-b --project proj-1`" \
           in out, out
    nothing_created(w)
    w.env["PATH"] = f"{fake_gcloud.install(tmp_path / 'bin')}:/usr/bin:/bin"
    w.env["FAKE_GCLOUD_LOG"] = str(tmp_path / "gcloud.log")
    w.env["FAKE_GCLOUD_ACCOUNT"] = "ci-runner@example.com"
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.external_ip: with external_ip: false the VM reaches the internet (apt, PyPI, the Hub) only " \
           "through a Cloud NAT, and network default has none for subnetwork default in us-east5. Fix: create " \
           "one: gcloud compute routers create mtpipe-nat" in out, out
    nothing_created(w)
    w.fake.routers.append(NAT_ROUTER)
    out = w.doit("vm_up").stdout
    assert "SSH from 35.235.240.0/20: no firewall rule of network default admits it; vm_up creates mt-test-ssh" in out
    assert "accessConfigs" not in insert_body(w)["networkInterfaces"][0]
    assert w.fake.firewalls[("proj-1", "mt-test-ssh")]["sourceRanges"] == [ssh_route.IAP_RANGE]
    assert "VM mt-test ready at mt-test:" in out, out
    assert "compute start-iap-tunnel mt-test" in (tmp_path / "gcloud.log").read_text()
    # every request resolved to a method of its API's discovery document (and passed its checks)
    methods = {r.api_method for r in w.fake.requests}
    assert "" not in methods and {
        "compute.networks.get", "compute.routers.list", "compute.firewalls.list", "compute.projects.get",
        "orgpolicy.projects.policies.getEffectivePolicy", "compute.firewalls.insert"} <= methods, methods
    w.doit("vm_down")
    assert w.instance() is None and not w.fake.firewalls


# ---------------------------------------------------------------- firewall rules


def test_no_rule_admits_ssh_from_this_machine(world: Env) -> None:
    """Straight to the external IP with no known source address: only a rule open to 0.0.0.0/0
    admits this machine. Without one vm_up stops; with the default network's default-allow-ssh it
    goes on and creates no rule (so a user without compute.firewalls.create gets there too)."""
    w = world
    w.configure(firewall__source_ranges=None)
    w.fake.firewalls[("proj-1", "allow-iap")] = rule("allow-iap", [ssh_route.IAP_RANGE])
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.firewall.source_ranges: no firewall rule of network default admits tcp:22 from anywhere " \
           "(0.0.0.0/0) to VM mt-test" in out and "set external_ip: false" in out, out
    nothing_created(w)
    w.fake.firewalls[("proj-1", "default-allow-ssh")] = rule("default-allow-ssh", ["0.0.0.0/0"], priority=65534)
    w.fake.firewall_insert_denied = True
    out = up_and_down(w)
    assert "SSH from 0.0.0.0/0: firewall rule default-allow-ssh of network default admits it" in out, out
    assert not w.fake.calls("POST", "/global/firewalls")


def test_a_refused_firewall_insert(world: Env) -> None:
    """SSH from a known range (firewall.source_ranges) and no rule admitting it: vm_up creates one;
    when Compute refuses that (no compute.firewalls.create), vm_up stops before the VM's insert naming
    the permission and the rule an admin can make; with an admin's rule it goes on without inserting."""
    w = world
    w.fake.firewall_insert_denied = True
    w.fake.firewalls[("proj-1", "web")] = rule("web", ["0.0.0.0/0"], targetTags=["web"])
    w.fake.firewalls[("proj-1", "deny-ssh")] = {**rule("deny-ssh", ["127.0.0.0/8"], priority=900),
                                                "allowed": [], "denied": [{"IPProtocol": "tcp"}]}
    w.fake.firewalls[("proj-1", "corp-ssh")] = rule("corp-ssh", ["127.0.0.0/8"], priority=1000)
    out = w.doit("vm_up", ok=False).stdout
    assert "creating firewall rule mt-test-ssh: permission denied. No firewall rule of network default admits " \
           "tcp:22 from 127.0.0.1/32 to VM mt-test, and you may not create one (compute.firewalls.create" in out, out
    assert "gcloud compute firewall-rules create ALLOW-SSH --project proj-1 --network default --direction " \
           "INGRESS --allow tcp:22 --source-ranges 127.0.0.1/32" in out
    assert w.fake.inserts() == [] and ("proj-1", "mt-test-ssh") not in w.fake.firewalls
    assert not (w.repo / vm_state.STATE_FILE).exists()
    del w.fake.firewalls[("proj-1", "deny-ssh")]
    out = up_and_down(w)
    assert "firewall rule corp-ssh of network default admits it" in out, out


@pytest.mark.parametrize("rules, admitted", [
    ([rule("a", ["127.0.0.0/8"])], ["a"]),
    ([rule("a", ["127.0.0.0/8"], disabled=True)], None),
    ([rule("a", ["127.0.0.0/8"], direction="EGRESS")], None),
    ([rule("a", ["127.0.0.0/8"], allowed=[{"IPProtocol": "tcp", "ports": ["20-30"]}])], ["a"]),
    ([rule("a", ["127.0.0.0/8"], allowed=[{"IPProtocol": "udp"}])], None),
    ([rule("a", ["127.0.0.0/8"], allowed=[{"IPProtocol": "all"}])], ["a"]),
    ([rule("a", ["127.0.0.0/8"], targetTags=["other"])], None),
    ([rule("a", ["127.0.0.0/8"], targetTags=["mt-test"])], ["a"]),
    ([rule("a", ["127.0.0.0/8"], targetServiceAccounts=["sa@p.iam.gserviceaccount.com"])], None),
    ([rule("a", ["10.0.0.0/8"]), rule("b", ["127.0.0.1/32"])], ["b"]),
    ([rule("a", ["127.0.0.0/8"]), {**rule("d", ["0.0.0.0/0"]), "allowed": [], "denied": [{"IPProtocol": "tcp"}]}],
     None),
    ([rule("a", ["127.0.0.0/8"], priority=10), {**rule("d", ["0.0.0.0/0"], priority=20), "allowed": [],
                                                "denied": [{"IPProtocol": "tcp"}]}], ["a"]),
], ids=["plain", "disabled", "egress", "port-range", "udp", "all", "other-tag", "our-tag", "service-account",
        "narrow", "denied", "allowed-first"])
def test_which_rules_admit_ssh(rules: list[dict], admitted: list[str] | None) -> None:
    firewalls = [compute_v1.Firewall.from_json(json.dumps(r)) for r in rules]
    assert ssh_route.admitting(firewalls, ["127.0.0.1/32"], ["mt-test"], "default") == admitted


# ---------------------------------------------------------------- errors that name the fix


def test_compute_api_disabled(world: Env) -> None:
    w = world
    w.fake.org.disabled.add("compute.googleapis.com")
    out = w.doit("vm_up", ok=False).stdout
    assert "reading VM mt-test: the Compute Engine API is disabled in project proj-1. Fix: gcloud services " \
           "enable compute.googleapis.com --project proj-1" in out, out
    assert "roles/compute.admin" not in out
    nothing_created(w)


def test_max_run_duration_refused_for_a_reservation_bound_vm(world: Env) -> None:
    w = world
    w.fake.reservations["v6e-res"] = Reservation(delivered_by="CALENDAR")
    w.fake.bound_max_run_duration = False
    out = w.doit("vm_up").stdout
    first, second = (r.json()["scheduling"] for r in w.fake.inserts())
    assert first["provisioningModel"] == second["provisioningModel"] == "RESERVATION_BOUND"
    assert first["maxRunDuration"] == {"seconds": "14400"} and "maxRunDuration" not in second
    assert "Compute refused maxRunDuration for reservation-bound VM mt-test (creating VM mt-test: 400" in out, out
    assert "creating it once more without it. This VM is then not deleted automatically" in out
    assert vm_state.read_state(w.repo)["max_run_duration_s"] == 0
    w.doit("vm_down")
    assert w.instance() is None and not w.fake.firewalls and w.fake.reservations["v6e-res"].in_use == 0


@pytest.mark.parametrize("name, message", [
    ("a" * 64, "vm.name: '" + "a" * 64 + "' has 64 characters; Compute allows at most 63 (from NAME in the "
               "environment). Fix: use at most 59"),
    ("a" * 61, "vm.firewall.name: '" + "a" * 61 + "-ssh' has 65 characters; Compute allows at most 63 (from "
               "name, from NAME in the environment). Fix: use a "
               "NAME of at most 59 characters, or set firewall.name"),
    ("mt-test-", "vm.name: 'mt-test-' is not a Compute resource name"),
], ids=["vm", "firewall", "pattern"])
def test_names_beyond_googles_limits_are_refused_before_any_request(world: Env, name: str, message: str) -> None:
    w = world
    w.env["NAME"] = name
    out = w.doit("vm_up", ok=False).stdout
    assert message in out, out
    assert w.fake.requests == []


def test_label_values_beyond_googles_limits(world: Env) -> None:
    w = world
    w.configure(labels={"app": "x" * 64})
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.labels.app: app='" + "x" * 64 + "' is not a Compute label" in out, out
    assert w.fake.requests == []


def test_a_source_range_that_is_not_one(world: Env) -> None:
    w = world
    w.configure(firewall__source_ranges=["my-laptop"])
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.firewall.source_ranges: 'my-laptop' is not an address range" in out, out
    assert w.fake.requests == []
