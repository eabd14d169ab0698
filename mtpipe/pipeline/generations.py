"""conf/generations.yaml: the one table of TPU generations every module reads.

A generation is named three ways: by Compute Engine's machine type (``ct6e-standard-8t``: 8 chips),
by its accelerator type (``v6e-8``, the Cloud TPU API's and TPU_ACCELERATOR_TYPE's; ``v5litepod-8`` for
v5e; ``v5p-8`` counts TensorCores, so 4 chips) and by MaxText's topology name (``v5e-8``). This module
turns each into a :class:`Generation` and a chip count, and back; what a generation *is* (its chip,
its host, what each route creates) is the table's row.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Annotated, Literal, Optional

from annotated_types import Ge, Gt, Le, Len
from omegaconf import OmegaConf

from mtpipe.errors import ConfigError
from mtpipe.pipeline.schema import KEEP_INT, Section, validate
from mtpipe.pipeline.view import load_yaml

TABLE = Path(__file__).resolve().parents[2] / "conf" / "generations.yaml"
TABLE_NAME = "conf/generations.yaml"
# Compute's TPU machine types: <family>-<kind>-<N>t holds N chips of <family> (ct6e-standard-8t).
MACHINE_TYPE = re.compile(r"(?P<family>[a-z][a-z0-9]*)-(?P<kind>[a-z]+)-(?P<chips>[0-9]+)t")
COUNTED = re.compile(r"(?P<name>[a-z][a-z0-9]*)-(?P<count>[0-9]+)")

Positive = Annotated[float, Gt(0), KEEP_INT]


class Machine(Section):
    family: str                           # <family>-<kind>-<N>t
    kind: str


class Chip(Section):
    """One chip's published numbers (``source``)."""

    hbm_gib: Positive                     # HBM the runtime lets a program use
    peak_tflops: Positive                 # bf16 dense peak
    hbm_gbps: Positive                    # HBM bandwidth, GB/s
    ici_gbits: Positive                   # inter-chip interconnect bandwidth, Gbit/s, as the page gives it
    source: str


class Step(Section):
    """The step model's efficiency on a generation and the interval its forecasts carry."""

    compute_efficiency: Annotated[float, Gt(0), Le(1)]   # of the bf16 peak, for MaxText's FLOP count
    step_error: Annotated[list[Positive], Len(2, 2)]     # measured / forecast: lowest, highest
    evidence: Literal["measured", "public", "assumed"]
    source: str


class BestMfu(Section):
    """The best public MaxText MFU on a generation."""

    pct: Positive
    run: str
    source: str


class Quota(Section):
    """A Compute Engine quota of a TPU machine family."""

    name: str                             # as Compute's QUOTA_EXCEEDED error names it
    metric: str                           # its Service Usage (and Cloud Quotas) metric
    dimensions: dict[str, str]
    title: str                            # its name on the console's quota page


class ComputeRoute(Section):
    refused: Optional[str]                # why instances.insert does not create it; null: it does
    boot_disks: Optional[list[str]]       # the disk types its VMs boot from; null: any
    single_threaded_chips: list[int]      # VMs of these chips take threadsPerCore 1
    flex_start_zones: list[str]           # zones known to grant Flex-start VMs
    reservation_family: str               # an aggregate reservation's vmFamily
    quota: Optional[Quota]                # null: none known, not checked


class TpuApiQuota(Section):
    """The Cloud Quotas ids of a generation's per-zone TPU API quotas (in TensorCores)."""

    on_demand: Optional[str]              # a node that is not Spot; null: none known
    preemptible: Optional[str]            # a Spot node; null: none known


class TpuApiRoute(Section):
    runtime_version: str                  # the TPU VM image its nodes boot
    flex_start_version: Optional[str]     # the API version whose queued resources take FLEX_START; null: none
    quota: Optional[TpuApiQuota]          # null: none known, not checked


class Generation(Section):
    """One row of conf/generations.yaml (its header says what each key is)."""

    name: str = ""                        # the row's key: v6e, v5e, ...
    title: str
    machine: Machine
    accelerator: str
    maxtext: str
    cores_per_chip: Annotated[int, Ge(1)]
    devices_per_chip: Annotated[int, Ge(1)]
    device_kinds: list[str]
    chips_per_host: Annotated[int, Ge(1)]
    chip: Chip
    step: Step
    best_mfu: BestMfu
    host_ram_gb: dict[int, Positive]
    compute: ComputeRoute
    tpu_api: Optional[TpuApiRoute]

    def accelerator_type(self, chips: int) -> str:
        """The accelerator type of ``chips`` chips: v6e-8, v5litepod-8, v5p-8 (4 chips)."""
        return f"{self.accelerator}-{chips * self.cores_per_chip}"

    def maxtext_topology(self, chips: int) -> str:
        """MaxText's name of ``chips`` chips (its compile_topology): v6e-8, v5e-8, v5p-8 (4 chips)."""
        return f"{self.maxtext}-{chips * self.cores_per_chip}"

    def device(self) -> Chip:
        """One JAX device's share of a chip (a TPU7x chip is two devices, each with half of it)."""
        n = self.devices_per_chip
        return self.chip.model_copy(update={"hbm_gib": self.chip.hbm_gib / n, "peak_tflops": self.chip.peak_tflops / n,
                                            "hbm_gbps": self.chip.hbm_gbps / n,
                                            "ici_gbits": self.chip.ici_gbits / n})

    def machine_type(self, chips: int) -> str:
        """Compute Engine's machine type of a VM of ``chips`` chips: ct6e-standard-8t."""
        return f"{self.machine.family}-{self.machine.kind}-{chips}t"


@functools.cache
def load(path: Path = TABLE) -> dict[str, Generation]:
    """The table, checked (each error names its key), by generation name."""
    rows = OmegaConf.to_container(load_yaml(path))
    if not isinstance(rows, dict) or not rows:
        raise ConfigError("generations", f"{path} holds no generation", "write one row per TPU generation")
    fix = lambda key, requirement: f"set {key.removeprefix('generations.')} {requirement} in {path}"  # noqa: E731
    return {name: validate(Generation, {**row, "name": name}, f"generations.{name}", fix)
            for name, row in rows.items()}


def of_accelerator(accelerator_type: str) -> tuple[Generation, int]:
    """(generation, chips) of an accelerator type (``v6e-8``, ``v5litepod-8``, ``v5p-8`` -> 4 chips) or
    of MaxText's name for one (``v5e-8``). ValueError for one the table does not know."""
    found = COUNTED.fullmatch(accelerator_type)
    for gen in load().values():
        if found and found["name"] in (gen.accelerator, gen.maxtext):
            count = int(found["count"])
            if count >= gen.cores_per_chip and count % gen.cores_per_chip == 0:
                return gen, count // gen.cores_per_chip
    names = ", ".join(sorted({g.accelerator for g in load().values()}))
    raise ValueError(f"TPU accelerator type {accelerator_type!r} is none of {names} followed by -<count> "
                     f"({TABLE_NAME})")


def of_machine_type(machine_type: str) -> tuple[Generation, int]:
    """(generation, chips) of a Compute TPU machine type: ct6e-standard-8t -> (v6e, 8). A ConfigError
    naming vm.machine_type for one the table does not know."""
    found = MACHINE_TYPE.fullmatch(machine_type)
    gen = next((g for g in load().values() if found and g.machine.family == found["family"]), None)
    if gen is None or int(found["chips"]) < 1:
        families = ", ".join(f"{g.machine_type(g.chips_per_host)} ({g.title})" for g in load().values())
        raise ConfigError("vm.machine_type", f"{machine_type!r} is not a TPU machine type of {TABLE_NAME} "
                          "(<family>-<kind>-<N>t, N chips)", f"use one of {families}, as the tutorials use "
                          f"ct6e-standard-8t, or add the generation to {TABLE_NAME}")
    return gen, int(found["chips"])
