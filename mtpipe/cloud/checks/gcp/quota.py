"""Checks before spending of the TPU quota: the project's Compute Engine quota has room for the VM's
chips in the region of each zone it may be created in.

Compute Engine meters TPU VMs against regional quotas of compute.googleapis.com (not the Cloud TPU
API's per-zone "TPU v6e cores per project per zone", which TPU nodes made through tpu.googleapis.com
use). The generation's quota is its row's ``compute.quota`` in conf/generations.yaml (none known: not
checked). A ct6e (TPU v6e) VM that is not Spot, Flex-start or a reservation's counts its chips against
TPUS_PER_TPU_FAMILY, the metric compute.googleapis.com/tpus_per_tpu_family with dimension
tpu_family=CT6E ("TPUs per TPU family" on the console's quota page), whose default is 0. regions.get
cannot tell it (compute.v1's Quota.metric enum has no v6e metric), so its limit is read from Service
Usage (v1beta1 consumerQuotaMetrics.get, view FULL: a bucket per region). Usage is not served there:
a limit below the VM's chips is certain to refuse the insert; a higher one may still be used up by
other VMs, which the insert reports (QUOTA_EXCEEDED, and vm_up moves to a zone of another region).

Spot and Flex-start VMs take the preemptible TPU v6e quota first and the standard one only when the
preemptible one is short (Compute's provisioning-models page, for Flex-start); the preemptible one's
metric is not read here, so a short standard quota is said and passed over for them. A reservation's
VMs consume what the reservation holds, no quota.

The Cloud TPU API route's nodes count against that API's own per-zone quotas instead, in TensorCores
(the accelerator type's count: 8 for a v5litepod-8, 8 for a v5p-8 of 4 chips): the generation's
``tpu_api.quota`` ids in conf/generations.yaml, ``on_demand`` or, for a Spot node, ``preemptible``.
:func:`tpu_api_zones` reads each from Cloud Quotas (quotaInfos.get, a limit per zone) and leaves out
the zones below the node's cores as :func:`usable_zones` leaves out regions; an id Cloud Quotas does
not know, or a read it refuses, is said as unknown. Usage is not served there either.
"""

from __future__ import annotations

from mtpipe.cloud.providers.gcp.api_errors import quota_page
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis, Unknown
from mtpipe.cloud.providers.interface import ProviderError, region
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations


def _say(line: str) -> None:
    print(f"mtpipe: {line}", flush=True)


def limit(buckets: list[dict], dimensions: dict[str, str]) -> int | None:
    """The effective limit of the most specific bucket that applies where ``dimensions`` say (a
    bucket applies when its dimensions are among them; none: the global default); None: unlimited
    (-1) or no bucket."""
    fitting = [b for b in buckets if all(dimensions.get(k) == v for k, v in (b.get("dimensions") or {}).items())]
    if not fitting:
        return None
    value = int(max(fitting, key=lambda b: len(b.get("dimensions") or {})).get("effectiveLimit", "-1"))
    return None if value < 0 else value


def usable_zones(cfg: VmConfig, apis: GoogleApis, zones: list[str]) -> list[str]:
    """``zones`` without those whose region's quota is below the VM's chips (each region left out is
    said); all of them when no quota applies or it cannot be read. None left: a ConfigError naming the
    quota, where to raise it and the other ways out."""
    gen, chips = generations.of_machine_type(cfg.machine_type)
    quota = gen.compute.quota
    if quota is None or cfg.provisioning == "reservation":
        return zones
    try:
        buckets = apis.quota_buckets(cfg.project, "compute.googleapis.com", quota.metric)
    except ProviderError as err:
        _say(f"could not read the quota {quota.name} ({err}); going on (a short quota fails the insert, "
             "which then moves to a zone of another region)")
        return zones
    where = ", ".join(f"{k}={v}" for k, v in quota.dimensions.items())
    short = {r: n for r in dict.fromkeys(region(z) for z in zones)
             if (n := limit(buckets, {"region": r, **quota.dimensions})) is not None and n < chips}
    if not short:
        return zones
    lines = "; ".join(f"{n} chips in {r}" for r, n in short.items())
    if cfg.provisioning != "on-demand":
        _say(f"quota {quota.name} ({where}) allows {lines}, and a {cfg.machine_type} takes {chips}: a "
             f"{cfg.provisioning} VM takes the preemptible TPU v6e quota first (not read here), so going on")
        return zones
    usable = [z for z in zones if region(z) not in short]
    if not usable:
        raise ConfigError(f"quota {quota.name}", f"Compute Engine's quota {quota.title!r} ({quota.metric}, {where}) "
                          f"allows {lines}, and a {cfg.machine_type} VM takes {chips}: the insert would be refused "
                          "(QUOTA_EXCEEDED)", f"request at least {chips} at {quota_page(cfg.project)} (filter: "
                          f"{quota.name}, {where}, the region), or list a zone of a region with room in zones: "
                          "(conf/vm.yaml), or use --provisioning=spot or flex-start (preemptible quota) or a "
                          "reservation")
    _say(f"quota {quota.name} ({where}) allows {lines}, and a {cfg.machine_type} takes {chips}: skipping "
         f"{', '.join(z for z in zones if z not in usable)}; trying {', '.join(usable)}")
    return usable


TPU_SERVICE = "tpu.googleapis.com"


def zone_limit(info: dict, zone: str) -> int | None:
    """A Cloud Quotas QuotaInfo's limit in ``zone``: the first (most specific) of its ``dimensionsInfos``
    whose dimensions all hold there (none: the default for every other place); None: unlimited (-1) or
    no entry."""
    here = {"zone": zone, "region": region(zone)}
    fitting = (d for d in info.get("dimensionsInfos", [])
               if all(here.get(k) == v for k, v in (d.get("dimensions") or {}).items()))
    value = int(next(fitting, {}).get("details", {}).get("value", "-1"))
    return None if value < 0 else value


def tpu_api_zones(cfg: VmConfig, apis: GoogleApis) -> tuple[str, VmConfig]:
    """The TPU API route's zones with room for the node's cores in the per-zone quota of its generation
    and provisioning (each zone without room said, and left out): what was found, and ``cfg`` in those
    zones. None with room: a ConfigError naming the quota and where to raise it; a quota id not known
    or not readable: Unknown."""
    gen, chips = generations.of_machine_type(cfg.machine_type)
    zones = vm_config.candidate_zones(cfg)
    if cfg.provisioning == "reservation":
        return "a reservation's nodes use what it holds, no quota", cfg
    ids = gen.tpu_api.quota if gen.tpu_api else None
    quota_id = (ids.preemptible if cfg.provisioning == "spot" else ids.on_demand) if ids else None
    if quota_id is None:
        raise Unknown(f"no Cloud TPU API quota of {gen.title} ({cfg.provisioning}) is known "
                      f"({generations.TABLE_NAME} tpu_api.quota); a short quota fails the queued resource, "
                      "and vm_up moves to the next zone")
    try:
        info = apis.quota_info(cfg.project, TPU_SERVICE, quota_id)
    except ProviderError as err:
        raise Unknown(f"could not read the quota {quota_id} from Cloud Quotas ({err})") from err
    if info is None:
        raise Unknown(f"Cloud Quotas knows no quota {quota_id} of {TPU_SERVICE} in project {cfg.project} "
                      f"(the id in {generations.TABLE_NAME} may be wrong)")
    cores, accelerator = chips * gen.cores_per_chip, vm_config.accelerator_type(cfg)
    short = {z: n for z in zones if (n := zone_limit(info, z)) is not None and n < cores}
    lines = "; ".join(f"{n} cores in {z}" for z, n in short.items())
    usable = [z for z in zones if z not in short]
    if not usable:
        raise ConfigError(f"quota {quota_id}", f"the Cloud TPU API's quota {quota_id} allows {lines}, and a "
                          f"{accelerator} node takes {cores}: the queued resource would be refused (HTTP 429)",
                          f"request at least {cores} at {quota_page(cfg.project)} (filter: {quota_id}, the zone), "
                          "or list a zone with room in zones: (conf/vm.yaml)"
                          + ("" if cfg.provisioning == "spot" else ", or use --provisioning=spot (the preemptible "
                             "quota) or a reservation"))
    found = f"quota {quota_id} has room for a {accelerator} node ({cores} cores) in {', '.join(usable)}"
    if short:
        found = f"quota {quota_id} allows {lines}: skipping {', '.join(short)}; {found}"
    return found, vm_config.in_zone(cfg, usable[0], usable)
