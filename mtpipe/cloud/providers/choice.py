"""Which provider makes the VM: the route vm_config.route decides (compute: Compute Engine; tpu_api: the
Cloud TPU API's queued resources), as a factory the lifecycle calls with the VM's config; and each route's
search of every zone of a project (:data:`EVERYWHERE`)."""

from __future__ import annotations

from collections.abc import Callable

from mtpipe.cloud.providers.gcp import compute
from mtpipe.cloud.providers.gcp.compute import compute_engine
from mtpipe.cloud.providers.interface import Everywhere, Provider
from mtpipe.cloud.providers.gcp.tpu_api import provider as tpu_provider
from mtpipe.cloud.providers.gcp.tpu_api.provider import tpu_api
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig

# What `doit vm_down` searches with nothing recorded and no zone: each route (vm_config.ROUTES), what it
# searches in words, and the search (project, labels -> the VMs carrying them, by zone).
EVERYWHERE: dict[str, tuple[str, Callable[[str, dict[str, str]], Everywhere]]] = {
    "compute": ("Compute Engine's VMs in every zone (instances.aggregatedList)", compute.labelled_everywhere),
    "tpu_api": ("the Cloud TPU API's nodes and queued resources in each of its locations",
                tpu_provider.labelled_everywhere),
}


def provider_for(cfg: VmConfig) -> Provider:
    """The provider of ``cfg``'s route, for its zone."""
    return tpu_api(cfg) if vm_config.route(cfg) == "tpu_api" else compute_engine(cfg)
