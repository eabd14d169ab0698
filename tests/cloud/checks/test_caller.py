"""The caller's side of the first paid request (mtpipe/cloud/checks/gcp/caller.py, access.py): what would
let vm_up create a VM that can never be reached, or have Compute refuse the insert, is found before
the insert, with a message naming the fix and nothing left behind: OS Login 2-step verification, no
IAP role, gcloud's account other than the credentials', a missing permission, a disabled API, and
the Shielded-VM policy. Where the fix is to go on differently (a service account for OS Login, the
same account for gcloud, `enable_apis: true`), vm_up goes on and the loopback VM accepts SSH.

`doit vm_up` runs in process against the loopback world (tests/vm_world.py); the fake Compute API
serves OS Login, Org Policy, Resource Manager, IAM, Service Usage and OAuth's token endpoint too
(tests/fakes/fake_org.py), each API call checked against its discovery document.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from fakes import fake_gcloud
from vm_world import Env

from mtpipe.cloud.checks.gcp import caller
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings import vm_state

pytestmark = [pytest.mark.checks, pytest.mark.first_request]
RUNNER = "runner@proj-1.iam.gserviceaccount.com"
DEFAULT_SA = "1234-compute@developer.gserviceaccount.com"   # fake Compute: proj-1 is project 1234
NAT_ROUTER = {"name": "nat-router", "region": "us-east5", "network": "default",
              "nats": [{"name": "nat", "sourceSubnetworkIpRangesToNat": "ALL_SUBNETWORKS_ALL_IP_RANGES"}]}
# Everything a run through IAP that makes its own firewall rule asks testIamPermissions for.
ALL = {*caller.VM_PERMISSIONS, *caller.FIREWALL_PERMISSIONS, caller.ACT_AS, caller.IAP_TUNNEL,
       "compute.subnetworks.useExternalIp", "compute.instances.osAdminLogin"}


def nothing_created(w: Env) -> None:
    """No insert reached Compute: no VM, no firewall rule, no state file."""
    assert w.fake.inserts() == [] and not w.fake.calls("POST", "/global/firewalls") and not w.fake.firewalls
    assert not (w.repo / vm_state.STATE_FILE).exists()


def up_and_down(w: Env) -> str:
    """vm_up (which must succeed), then vm_down; what vm_up printed. Nothing is left."""
    out = w.doit("vm_up").stdout
    w.doit("vm_down")
    assert w.instance() is None and not w.fake.firewalls
    return out


def service_account_credentials(w: Env, email: str) -> None:
    """Application Default Credentials of service account ``email``: a key file (a fresh RSA key)
    whose token endpoint is the fake's, as GOOGLE_APPLICATION_CREDENTIALS names one."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path = w.repo.parent / "adc.json"
    path.write_text(json.dumps({"type": "service_account", "project_id": "proj-1", "private_key_id": "k1",
                                "private_key": key.decode(), "client_email": email, "client_id": "1",
                                "token_uri": f"{w.fake.url}/token"}))
    w.env["GOOGLE_APPLICATION_CREDENTIALS"] = str(path)


def through_iap(w: Env, tmp_path: Path, gcloud_account: str) -> None:
    """No external IP: SSH through the stand-in gcloud's IAP tunnel (logged in as ``gcloud_account``),
    downloads through a Cloud NAT."""
    w.configure(external_ip=False, firewall__source_ranges=None)
    w.fake.routers.append(NAT_ROUTER)
    w.env["PATH"] = f"{fake_gcloud.install(tmp_path / 'bin')}:/usr/bin:/bin"
    w.env["FAKE_GCLOUD_ACCOUNT"] = gcloud_account


def asked_permissions(w: Env) -> set[str]:
    """Every permission testIamPermissions was asked for, on the project or a service account."""
    return {p for r in w.fake.requests if r.api_method.endswith("testIamPermissions") for p in r.json()["permissions"]}


def test_two_step_verification_on(world: Env) -> None:
    """enable-oslogin-2fa=TRUE: SSH as a user would wait for a second factor, so the VM would never be
    reached; vm_up stops before the insert naming both ways out. As a service account, on which
    Google does not enforce it, vm_up goes on and SSH logs in as the account's POSIX user."""
    w = world
    w.fake.project_metadata.update({"enable-oslogin": "TRUE", "enable-oslogin-2fa": "TRUE"})
    w.configure(ssh__os_login_account="ci-runner@example.com")
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.ssh.os_login: OS Login 2-step verification is on in project proj-1 (project metadata " \
           "enable-oslogin-2fa=TRUE): each SSH login as ci-runner@example.com would wait for a second factor" in out, out
    assert "run as a service account, on which Google does not enforce 2-step verification" in out
    assert "gcloud compute project-info add-metadata --metadata enable-oslogin-2fa=FALSE --project proj-1" in out
    nothing_created(w)
    assert not w.fake.org.keys   # stopped before the key went into the profile
    w.configure(ssh__os_login_account=RUNNER)
    out = up_and_down(w)
    assert "SSH as runner_proj_1_iam_gserviceaccount_com" in out, out


def test_no_iap_role(world: Env, tmp_path: Path) -> None:
    """SSH through IAP needs iap.tunnelInstances.accessViaIAP: without it the tunnel is refused and
    the VM would wait ssh.ready_timeout_s and be deleted. It is asked for only when SSH goes through
    IAP, and its absence stops vm_up naming roles/iap.tunnelResourceAccessor."""
    w = world
    service_account_credentials(w, RUNNER)
    through_iap(w, tmp_path, RUNNER)
    w.fake.org.permissions = ALL - {caller.IAP_TUNNEL}
    out = w.doit("vm_up", ok=False).stdout
    assert f"vm.project: {RUNNER} lacks permissions the run needs on project proj-1: " \
           "iap.tunnelInstances.accessViaIAP (in roles/iap.tunnelResourceAccessor)" in out, out
    assert f"gcloud projects add-iam-policy-binding proj-1 --member serviceAccount:{RUNNER} --role " \
           "roles/iap.tunnelResourceAccessor" in out
    nothing_created(w)
    assert caller.IAP_TUNNEL in asked_permissions(w)
    w.fake.requests.clear()
    w.configure(external_ip=True, firewall__source_ranges=["127.0.0.1/32"])   # straight to the VM's IP
    up_and_down(w)
    assert caller.IAP_TUNNEL not in asked_permissions(w)


def test_gcloud_and_adc_accounts_differ(world: Env, tmp_path: Path) -> None:
    """The IAP tunnel runs as gcloud's account, the checks and the insert as the credentials' (a
    service account key here): told apart before the insert. gcloud without an account stops too;
    with the credentials' account the run goes through the tunnel to the loopback VM."""
    w = world
    service_account_credentials(w, RUNNER)
    through_iap(w, tmp_path, "me@example.com")
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.ssh.proxy_command: SSH to the VM goes through `gcloud compute start-iap-tunnel`, which runs as " \
           f"gcloud's account me@example.com, while the checks before spending and the VM's creation use the " \
           f"Application Default Credentials, of {RUNNER}" in out, out
    assert f"`gcloud config set account {RUNNER}`" in out and "`gcloud auth application-default login` as " \
           "me@example.com" in out
    nothing_created(w)
    del w.env["FAKE_GCLOUD_ACCOUNT"]
    out = w.doit("vm_up", ok=False).stdout
    assert "gcloud has no active account. Fix: `gcloud auth login " + RUNNER in out, out
    nothing_created(w)
    w.env["FAKE_GCLOUD_ACCOUNT"] = RUNNER
    out = up_and_down(w)
    assert f"IAP tunnel as {RUNNER}, the account of the Application Default Credentials" in out, out
    assert "VM mt-test ready at mt-test:" in out


def test_a_missing_permission(world: Env) -> None:
    """testIamPermissions before the insert: every missing permission named with the role that holds
    it and the command that grants it (iam.serviceAccounts.actAs on the VM's service account, where
    the project does not grant it). The firewall permissions are asked for only when vm_up makes
    its own rule."""
    w = world
    w.fake.org.permissions = ALL - {"compute.instances.create", "compute.disks.create", caller.ACT_AS}
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.project: the account of your credentials lacks permissions the run needs on project proj-1: " \
           "compute.instances.create, compute.disks.create (in roles/compute.instanceAdmin.v1); " \
           "iam.serviceAccounts.actAs (in roles/iam.serviceAccountUser)" in out, out
    assert "gcloud projects add-iam-policy-binding proj-1 --member user:ACCOUNT --role " \
           "roles/compute.instanceAdmin.v1 && gcloud iam service-accounts add-iam-policy-binding " \
           f"{DEFAULT_SA} --member user:ACCOUNT --role roles/iam.serviceAccountUser" in out
    nothing_created(w)
    methods = [r.api_method for r in w.fake.requests]
    assert "iam.projects.serviceAccounts.testIamPermissions" in methods   # actAs asked again on the account
    assert "compute.firewalls.create" in asked_permissions(w)   # no rule admits 127.0.0.1/32: vm_up makes one
    w.fake.org.permissions = ALL
    w.fake.requests.clear()
    w.fake.firewalls[("proj-1", "corp-ssh")] = {
        "name": "corp-ssh", "network": "global/networks/default", "direction": "INGRESS", "priority": 1000,
        "sourceRanges": ["127.0.0.0/8"], "allowed": [{"IPProtocol": "tcp", "ports": ["22"]}]}
    w.doit("vm_up")
    assert "compute.firewalls.create" not in asked_permissions(w) and w.instance() is not None
    w.doit("vm_down")
    assert w.instance() is None


def test_an_api_disabled(world: Env) -> None:
    """Service Usage says the Cloud Storage API (the VM's buckets) is disabled: vm_up stops naming
    `gcloud services enable` and enable_apis; with `enable_apis: true` it enables it and goes on."""
    w = world
    w.fake.org.disabled.add("storage.googleapis.com")
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.enable_apis: project proj-1 has not enabled: Cloud Storage API (storage.googleapis.com, for the " \
           "buckets the VM uses). Fix: gcloud services enable storage.googleapis.com --project proj-1" in out, out
    assert "or set enable_apis: true in conf/vm.yaml" in out
    nothing_created(w)
    assert w.fake.org.enabled == []   # never without the key
    w.configure(enable_apis=True)
    out = up_and_down(w)
    assert "enabling in project proj-1 (enable_apis: true; free of charge, can take a minute): Cloud Storage " \
           "API (storage.googleapis.com, for the buckets the VM uses)" in out, out
    assert w.fake.org.enabled == ["storage.googleapis.com"] and not w.fake.org.disabled


def test_shielded_vm_required(world: Env) -> None:
    """compute.requireShieldedVm enforced: Compute would refuse an insert without Secure Boot, which
    mtpipe does not send; vm_up stops before it, naming the policy and the exception to ask for."""
    w = world
    w.fake.org.policies["compute.requireShieldedVm"] = [{"enforce": True}]
    out = w.doit("vm_up", ok=False).stdout
    assert "vm.project: the organisation policy constraints/compute.requireShieldedVm is enforced for project " \
           "proj-1: Compute creates only VMs with Secure Boot, vTPM and Integrity Monitoring on, and the insert " \
           "does not turn on enable_secure_boot, enable_vtpm, enable_integrity_monitoring" in out, out
    assert "gcloud resource-manager org-policies disable-enforce compute.requireShieldedVm --project proj-1" in out
    nothing_created(w)


ROLE_CONTENTS = Path(__file__).resolve().parents[2] / "fixtures" / "gcp" / "role-permissions.txt"


def role_contents() -> dict[str, set[str]]:
    """tests/fixtures/gcp/role-permissions.txt: each predefined role's permissions, as Google publishes them."""
    roles: dict[str, set[str]] = {}
    for line in ROLE_CONTENTS.read_text().splitlines():
        if line.startswith("[roles/"):
            current = roles.setdefault(line.strip("[]"), set())
        elif line and not line.startswith("#"):
            current.add(line)
    return roles


@pytest.mark.billing
@pytest.mark.parametrize("route", ["compute", "tpu_api"])
def test_every_permission_tested_is_in_the_role_the_fix_names(route: str) -> None:
    """Each permission the caller check tests, on either route, is in the published contents of the
    predefined role its fix grants (a permission no role holds, tpu.queuedResources.create say, would
    make testIamPermissions fail and the fix grant nothing); the TPU API route's network reads are
    Compute's, which roles/tpu.admin lacks."""
    cfg = vm_config.load_config({"external_ip": False, "name": "n", "zone": "us-east5-b", "project": "p",
                                 "route": route, "provisioning": "spot"})
    wanted = caller.permissions(cfg, creates_rule=True)
    contents = role_contents()
    assert set(wanted.values()) <= set(contents), set(wanted.values()) - set(contents)
    outside = {p: role for p, role in wanted.items() if p not in contents[role]}
    assert not outside, f"permissions not in the role the fix names: {outside}"
    if route == "tpu_api":
        assert not {p for p in wanted if p.startswith("compute.")} & contents[caller.TPU_ADMIN]
        assert {"tpu.nodes.create", "tpu.nodes.delete", "compute.firewalls.list"} <= set(wanted)
