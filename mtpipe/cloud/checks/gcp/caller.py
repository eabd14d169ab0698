"""Checks before spending of the caller, the account of the Application Default Credentials: the
APIs the run uses are enabled in the project, and the caller holds every permission the run will use
there, as `sky check` tests them (Service Usage, Cloud Resource Manager testIamPermissions).

A disabled API stops the run naming `gcloud services enable`, unless ``enable_apis: true`` (conf/vm.yaml)
lets vm_up enable it (never without that key). A missing permission stops it naming the predefined role
that holds it. What cannot be read (Service Usage or Resource Manager refusing the caller) is reported
as unknown (mtpipe.errors.Unknown), not as fine: the call that needs it then fails with its own message.
"""

from __future__ import annotations

from collections import defaultdict

from mtpipe.cloud.checks.gcp import identity
from mtpipe.cloud.providers.gcp import ssh_route
from mtpipe.cloud.providers.gcp.api_errors import SERVICE_TITLES
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis, Unknown, member
from mtpipe.cloud.providers.interface import ProviderError
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError

INSTANCE_ADMIN = "roles/compute.instanceAdmin.v1"
SECURITY_ADMIN = "roles/compute.securityAdmin"
IAP_ACCESSOR = "roles/iap.tunnelResourceAccessor"
SA_USER = "roles/iam.serviceAccountUser"
ACT_AS = "iam.serviceAccounts.actAs"
IAP_TUNNEL = "iap.tunnelInstances.accessViaIAP"
# What creating, waiting for, listing and deleting the VM takes on the project (instances.insert's
# permissions: the disk, the subnetwork, metadata, tags, labels, the service account; SkyPilot's
# VM_MINIMAL_PERMISSIONS; a boot disk a failed insert left, read and deleted), beyond the reads the
# checks before have made already. Each is in
# roles/compute.instanceAdmin.v1 (docs/tpu-vm.md, "Permissions and APIs").
VM_PERMISSIONS = ("compute.instances.create", "compute.instances.get", "compute.instances.list",
                  "compute.instances.delete", "compute.instances.setMetadata", "compute.instances.setLabels",
                  "compute.instances.setTags", "compute.instances.setServiceAccount", "compute.disks.create",
                  "compute.disks.get", "compute.disks.delete", "compute.subnetworks.use",
                  "compute.zoneOperations.get", "compute.machineTypes.list")
# The Cloud TPU API route's VM (vm_config.route: tpu_api): its queued resource and node created, read,
# listed and deleted, their operations waited on, the zones offering the accelerator listed; each is in
# roles/tpu.admin. Google authorises the queued resource's calls with the node's permissions (its
# reference names tpu.nodes.reset for queuedResources.reset; no predefined role, roles/owner included,
# holds a tpu.queuedResources permission: docs/roles.md).
TPU_ADMIN = "roles/tpu.admin"
TPU_PERMISSIONS = ("tpu.nodes.create", "tpu.nodes.get", "tpu.nodes.list", "tpu.nodes.delete", "tpu.operations.get",
                   "tpu.locations.list", "tpu.acceleratortypes.get", "tpu.acceleratortypes.list")
# What the TPU API route reads of the node's network through Compute Engine (the checks before spending
# and vm_up's look for a rule admitting SSH): roles/tpu.admin grants none of it.
NETWORK_VIEWER = "roles/compute.networkViewer"
NETWORK_PERMISSIONS = ("compute.networks.get", "compute.subnetworks.get", "compute.firewalls.list",
                       "compute.firewalls.get")
# vm_up's own SSH rule: firewalls.insert and delete, which also take networks.updatePolicy.
FIREWALL_PERMISSIONS = ("compute.firewalls.create", "compute.firewalls.delete", "compute.networks.updatePolicy",
                        "compute.globalOperations.get")


def tpu_route(cfg: VmConfig) -> bool:
    """The VM is the Cloud TPU API's (vm_config.route), not Compute Engine's."""
    return vm_config.route(cfg) == "tpu_api"


def _say(line: str) -> None:
    print(f"mtpipe: {line}", flush=True)


def services(cfg: VmConfig, uses_gcs: bool) -> dict[str, str]:
    """The APIs the run calls in ``project``, each with what for: Compute, Resource Manager (these
    checks), OS Login where it is on, IAP for SSH through its tunnel, Cloud Storage for a gs:// DVC
    remote or work bucket (the VM's service account reads and writes it)."""
    wanted = {"compute.googleapis.com": "the VM", "cloudresourcemanager.googleapis.com": "these checks"}
    if tpu_route(cfg):
        wanted["compute.googleapis.com"] = "the network and its firewall"
        wanted["tpu.googleapis.com"] = "the VM (a queued resource, route: tpu_api)"
    if cfg.ssh.os_login is True:
        wanted["oslogin.googleapis.com"] = "OS Login"
    if ssh_route.through_iap(cfg):
        wanted["iap.googleapis.com"] = "SSH through IAP's tunnel"
    if uses_gcs:
        wanted["storage.googleapis.com"] = "the buckets the VM uses"
    return wanted


def check_apis(cfg: VmConfig, apis: GoogleApis, wanted: dict[str, str], enable: bool = True) -> str:
    """Every API in ``wanted`` is enabled in the project; with ``enable_apis: true`` the disabled ones
    are enabled now (``enable``; free of charge), else the run stops naming them. Returns what it found."""
    try:
        enabled = apis.enabled_services(cfg.project, list(wanted))
    except ProviderError as err:
        raise Unknown(f"could not read which APIs project {cfg.project} has enabled ({err}); a disabled one "
                      "fails its first call, naming `gcloud services enable`") from err
    disabled = [s for s in wanted if s not in enabled]
    if not disabled:
        return f"enabled: {', '.join(wanted)}"
    named = "; ".join(f"{SERVICE_TITLES.get(s, s)} ({s}, for {wanted[s]})" for s in disabled)
    if not cfg.enable_apis:
        raise ConfigError("vm.enable_apis", f"project {cfg.project} has not enabled: {named}",
                          f"gcloud services enable {' '.join(disabled)} --project {cfg.project} (needs "
                          "roles/serviceusage.serviceUsageAdmin), or set enable_apis: true in conf/vm.yaml and "
                          "vm_up enables them")
    if not enable:
        return f"vm_up enables {', '.join(disabled)} (enable_apis: true)"
    _say(f"enabling in project {cfg.project} (enable_apis: true; free of charge, can take a minute): {named}")
    try:
        apis.enable_services(cfg.project, disabled)
    except ProviderError as err:
        raise ConfigError("vm.enable_apis", f"enabling {', '.join(disabled)} failed ({err})",
                          f"ask for roles/serviceusage.serviceUsageAdmin on {cfg.project}, or have someone who "
                          f"holds it run: gcloud services enable {' '.join(disabled)} --project {cfg.project}") from err
    _say(f"enabled {', '.join(disabled)}")
    return f"enabled {', '.join(disabled)} now (enable_apis: true)"


def permissions(cfg: VmConfig, creates_rule: bool) -> dict[str, str]:
    """The permissions the run will use on the project, each with the predefined role the fix
    names (each is in it: tests/fixtures/gcp/role-permissions.txt): the VM's life (and on the TPU API
    route the reads of its network), vm_up's firewall rule when it makes one, the IAP tunnel, and acting
    as the VM's service account."""
    if tpu_route(cfg):
        wanted = dict.fromkeys(TPU_PERMISSIONS, TPU_ADMIN) | dict.fromkeys(NETWORK_PERMISSIONS, NETWORK_VIEWER)
    else:
        wanted = dict.fromkeys(VM_PERMISSIONS, INSTANCE_ADMIN)
    if cfg.external_ip and not tpu_route(cfg):
        wanted["compute.subnetworks.useExternalIp"] = INSTANCE_ADMIN
    if creates_rule:
        wanted |= dict.fromkeys(FIREWALL_PERMISSIONS, SECURITY_ADMIN)
    if ssh_route.through_iap(cfg):
        wanted[IAP_TUNNEL] = IAP_ACCESSOR
    wanted[ACT_AS] = SA_USER
    return wanted


def check_permissions(cfg: VmConfig, apis: GoogleApis, wanted: dict[str, str]) -> str:
    """projects.testIamPermissions for ``wanted``; iam.serviceAccounts.actAs, when the project does
    not grant it, once more on the VM's service account (where it is often granted). Every missing
    permission is named, grouped by the role that holds it."""
    try:
        granted = apis.granted(cfg.project, sorted(wanted))
    except ProviderError as err:
        raise Unknown(f"could not test your permissions on project {cfg.project} ({err})") from err
    email = ""
    if ACT_AS in wanted and ACT_AS not in granted:
        try:
            email = identity.service_account(cfg)
            granted |= apis.granted_on_service_account(email, [ACT_AS])
        except ProviderError as err:
            _say(f"could not test {ACT_AS} on the VM's service account ({err}); going on")
            granted.add(ACT_AS)
    missing = defaultdict(list)
    for permission, role in wanted.items():
        if permission not in granted:
            missing[role].append(permission)
    if not missing:
        return f"all {len(wanted)} the run uses"
    account = apis.account()
    who, principal = (account, member(account)) if account else ("the account of your credentials", "user:ACCOUNT")
    fixes = [f"gcloud iam service-accounts add-iam-policy-binding {email} --member {principal} --role {role}"
             if role == SA_USER else
             f"gcloud projects add-iam-policy-binding {cfg.project} --member {principal} --role {role}"
             for role in missing]
    listed = "; ".join(f"{', '.join(perms)} (in {role})" for role, perms in missing.items())
    raise ConfigError("vm.project", f"{who} lacks permissions the run needs on project {cfg.project}: {listed}",
                      " && ".join(fixes) + " (or ask an administrator for those roles)")
