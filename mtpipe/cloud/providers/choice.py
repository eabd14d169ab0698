"""Which provider makes the VM: the route vm_config.route decides (compute: Compute Engine; tpu_api: the
Cloud TPU API's queued resources), as a factory the lifecycle calls with the VM's config."""

from __future__ import annotations

from mtpipe.cloud.providers.gcp.compute import compute_engine
from mtpipe.cloud.providers.interface import Provider
from mtpipe.cloud.providers.gcp.tpu_api.provider import tpu_api
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig


def provider_for(cfg: VmConfig) -> Provider:
    """The provider of ``cfg``'s route, for its zone."""
    return tpu_api(cfg) if vm_config.route(cfg) == "tpu_api" else compute_engine(cfg)
