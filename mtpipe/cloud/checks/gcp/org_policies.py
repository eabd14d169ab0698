"""The organisation policies that can refuse the VM's insert after every other check, read before it.

Each is the effective policy of the project (Organization Policy API, getEffectivePolicy: what its
organisation and folders set, merged), read with the caller's credentials:

* ``compute.requireShieldedVm``: Compute creates only VMs with Secure Boot, vTPM and Integrity
  Monitoring on; the insert (instance_body) must send all three;
* ``compute.trustedImageProjects``: the boot image must come from a project on the allow-list, and
  the TPU image's project (``image_project``: ubuntu-os-accelerator-images) rarely is;
* ``gcp.resourceLocations``: the VM's zone must be an allowed location;
* ``compute.requireOsLogin``: read and said (checks.access turns OS Login on when it is enforced).

A policy that cannot be read (the Org Policy API off, no orgpolicy.policies.get) raises
:class:`Unknown`: the checks report it as unknown, never as fine.
"""

from __future__ import annotations

import re

from mtpipe.cloud.providers import interface
from mtpipe.cloud.providers.gcp.bodies import instance_body
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis, Unknown, denies, enforced
from mtpipe.cloud.providers.interface import ProviderError
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError

SHIELDED = ("enable_secure_boot", "enable_vtpm", "enable_integrity_monitoring")
POLICY_ADMIN = "needs roles/orgpolicy.policyAdmin"
# Value groups of gcp.resourceLocations that hold every location of a region prefix (Google's
# "Supported services ... value groups" page: in:us-locations holds us-* regions, in:eu-locations
# europe-*, in:asia-locations asia-*). A group not here is not expanded: the check says unknown.
CONTINENT_GROUPS = {"us-": "in:us-locations", "northamerica-": "in:northamerica-locations",
                    "southamerica-": "in:southamerica-locations", "europe-": "in:eu-locations",
                    "asia-": "in:asia-locations", "australia-": "in:australia-locations",
                    "me-": "in:me-locations", "africa-": "in:africa-locations"}
# The value groups whose locations this check knows: those above, and a region's or a zone's own
# (in:us-east5-locations, in:us-east5-b-locations).
KNOWN_GROUP = re.compile("|".join(re.escape(g) for g in CONTINENT_GROUPS.values())
                         + r"|in:[a-z]+-[a-z]+[0-9]+(-[a-z0-9]+)?-locations")


def read(cfg: VmConfig, apis: GoogleApis, constraint: str) -> dict:
    """The effective policy of ``constraint`` for the project; :class:`Unknown` when it cannot be read."""
    try:
        return apis.effective_policy(cfg.project, constraint)
    except ProviderError as err:
        raise Unknown(f"could not read constraints/{constraint} ({err}): if it is enforced, Compute refuses "
                      "the insert; ask your organisation's policy administrator, or enable the Organization "
                      f"Policy API (gcloud services enable orgpolicy.googleapis.com --project {cfg.project}) "
                      "and get roles/orgpolicy.policyViewer") from err


def check_shielded_vm(cfg: VmConfig, apis: GoogleApis) -> str:
    """Where compute.requireShieldedVm is enforced, the insert body (instance_body) must turn on
    Secure Boot, vTPM and Integrity Monitoring."""
    if not enforced(read(cfg, apis, "compute.requireShieldedVm")):
        return "not enforced"
    sent = instance_body(cfg, cfg.name, "", {}, "STANDARD").get("shielded_instance_config", {})
    off = [name for name in SHIELDED if not sent.get(name)]
    if off:
        raise ConfigError("vm.project", "the organisation policy constraints/compute.requireShieldedVm is "
                          f"enforced for project {cfg.project}: Compute creates only VMs with Secure Boot, vTPM and "
                          f"Integrity Monitoring on, and the insert does not turn on {', '.join(off)} (mtpipe does not turn "
                          "Secure Boot on: whether the TPU image's drivers load under it is not known here)",
                          "use a project where the policy is not enforced, or ask your organisation's policy "
                          "administrator for an exception: gcloud resource-manager org-policies disable-enforce "
                          f"compute.requireShieldedVm --project {cfg.project} ({POLICY_ADMIN})")
    return "enforced, and the insert turns all three on"


def check_trusted_images(cfg: VmConfig, apis: GoogleApis) -> str:
    """compute.trustedImageProjects allows the project of the boot image the insert names."""
    image = f"projects/{cfg.image_project}"
    if denies(read(cfg, apis, "compute.trustedImageProjects"), image):
        raise ConfigError("vm.image_project", "the organisation policy constraints/compute.trustedImageProjects "
                          f"does not allow images from {image} for project {cfg.project}: Compute would refuse the "
                          f"insert of the TPU VM, whose boot image is {cfg.image_family} of {cfg.image_project}",
                          "ask your organisation's policy administrator to allow it: gcloud resource-manager "
                          f"org-policies allow compute.trustedImageProjects {image} --project {cfg.project} "
                          f"({POLICY_ADMIN})")
    return f"allows {image}"


def location_values(zone: str) -> set[str]:
    """How a gcp.resourceLocations rule can name ``zone``: the zone, its region, their groups."""
    region = interface.region(zone)
    names = {zone, region, f"zones/{zone}", f"regions/{region}", f"in:{zone}-locations", f"in:{region}-locations"}
    names |= {group for prefix, group in CONTINENT_GROUPS.items() if region.startswith(prefix)}
    return names


def check_locations(cfg: VmConfig, apis: GoogleApis) -> str:
    """gcp.resourceLocations allows the VM's zone (a zone, its region or a group of them listed);
    an allow-list of groups this check cannot expand is unknown."""
    policy = read(cfg, apis, "gcp.resourceLocations")
    rules = [r for r in policy.get("spec", {}).get("rules", []) if not r.get("condition")]
    values = location_values(cfg.zone)

    def listed(kind: str) -> list[str]:
        return [v.removeprefix("is:") for r in rules for v in r.get("values", {}).get(kind, [])]

    allowed, denied = listed("allowedValues"), listed("deniedValues")
    refused = any(r.get("denyAll") for r in rules) or bool(values & set(denied))
    if not refused and (any(r.get("allowAll") for r in rules) or not allowed or values & set(allowed)):
        return f"allows {cfg.zone}" if rules else "not set"
    if not refused and any(v.startswith("in:") and not KNOWN_GROUP.fullmatch(v) for v in allowed):
        raise Unknown(f"allows only {', '.join(allowed)}; whether {cfg.zone} is among their locations is not "
                      "known here (a value group not expanded by this check)")
    raise ConfigError("vm.zone", f"the organisation policy constraints/gcp.resourceLocations does not allow "
                      f"{cfg.zone} for project {cfg.project} (allowed: {', '.join(allowed) or 'none'}): Compute "
                      "would refuse the insert", "use a zone it allows (ZONE / --zone, zones: in conf/vm.yaml) "
                      "that offers TPU v6e, or ask your organisation's policy administrator: gcloud "
                      f"resource-manager org-policies allow gcp.resourceLocations zones/{cfg.zone} --project "
                      f"{cfg.project} ({POLICY_ADMIN})")


def check_os_login_policy(cfg: VmConfig, apis: GoogleApis) -> str:
    """compute.requireOsLogin, read and said: where it is enforced VMs take SSH keys from OS Login
    profiles only (access.check_os_login imports ours)."""
    if enforced(read(cfg, apis, "compute.requireOsLogin")):
        return "enforced: the VM takes SSH keys from OS Login profiles only (the OS Login line says whose)"
    return "not enforced"
