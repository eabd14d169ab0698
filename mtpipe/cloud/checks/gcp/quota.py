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
"""

from __future__ import annotations

from mtpipe.cloud.providers.gcp.api_errors import quota_page
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis
from mtpipe.cloud.providers.interface import ProviderError, region
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
