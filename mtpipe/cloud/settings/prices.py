"""conf/prices.yaml: the one table of prices that every cost line reads.

Prices are per chip-hour of a TPU version, one per provisioning mode that has a price (on-demand,
spot, flex-start), each with the date its source gives and the page to check it on. A VM's rate is
its machine type's chips (``ct6e-standard-8t``: 8) times its mode's price. A reservation's VMs cost
nothing on top of the reservation: its commitment pays for the reserved capacity, used or not, so
their rate is the on-demand equivalent and every line that shows it names the reservation that pays
(:func:`paid_by`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from annotated_types import Ge
from omegaconf import OmegaConf
from pydantic import Field

from mtpipe.errors import ConfigError
from mtpipe.pipeline.schema import KEEP_INT, Section, validate
from mtpipe.pipeline.view import load_yaml

if TYPE_CHECKING:   # vm_config imports this module
    from mtpipe.cloud.settings.vm_config import VmConfig

PRICES = Path(__file__).resolve().parents[3] / "conf" / "prices.yaml"
# Compute's TPU machine types: <family>-<kind>-<N>t holds N chips of <family> (ct6e-standard-8t).
TPU_MACHINE = re.compile(r"(?P<family>[a-z][a-z0-9]*)-[a-z]+-(?P<chips>[0-9]+)t")


class ChipPrice(Section):
    usd: Annotated[float, Ge(0), KEEP_INT]   # per chip-hour
    as_of: str                               # the date the source gives
    source: str                              # the page to check it on


class PerChipHour(Section):
    """One price per provisioning mode that has one (a reservation's commitment pays its VMs)."""

    on_demand: ChipPrice = Field(alias="on-demand")
    spot: ChipPrice | None                   # null: no price known, Spot VMs of this TPU are refused
    flex_start: ChipPrice | None = Field(alias="flex-start")   # null: Flex-start VMs of this TPU are refused


class Tpu(Section):
    machine_family: str                      # Compute's machine types <family>-<kind>-<N>t
    per_chip_hour: PerChipHour


class Tpus(Section):
    v6e: Tpu                                 # TPU v6e (Trillium)
    v5e: Tpu                                 # TPU v5e


class Prices(Section):
    tpu: Tpus


@functools.cache
def load(path: Path = PRICES) -> Prices:
    """The price table, checked (each error names its key)."""
    return validate(Prices, OmegaConf.to_container(load_yaml(path)), "prices",
                    lambda key, requirement: f"set {key.removeprefix('prices.')} {requirement} in {path}")


def tpu_chips(machine_type: str) -> tuple[str, int]:
    """(machine family, chips) of a Compute TPU machine type: ct6e-standard-8t -> ("ct6e", 8)."""
    found = TPU_MACHINE.fullmatch(machine_type)
    if not found:
        raise ConfigError("vm.machine_type", f"{machine_type!r} is not a TPU machine type "
                          "(<family>-<kind>-<N>t, N chips)", "use ct6e-standard-8t (a v6e-8), as the tutorials do")
    return found["family"], int(found["chips"])


def paid_by(reservation: str, on_demand: str) -> str:
    """How every cost line shows what a reservation's commitment pays (``on_demand``: its on-demand
    equivalent, e.g. "21.60 USD/h")."""
    return f"paid by reservation {reservation}'s commitment (on-demand equivalent {on_demand})"


@dataclass(frozen=True)
class Rate:
    """What one VM costs per hour: ``chips`` x ``price`` of ``tpu`` in ``mode``; with ``reservation``
    that reservation's commitment pays it and the rate is the on-demand equivalent."""

    chips: int
    tpu: str
    mode: str
    price: ChipPrice
    reservation: str | None

    @property
    def usd_per_hour(self) -> float:
        return self.chips * self.price.usd

    def describe(self) -> str:
        """The rate as the cost lines print it."""
        if self.reservation:
            return paid_by(self.reservation, f"{self.usd_per_hour:.2f} USD/h")
        return (f"about {self.usd_per_hour:.2f} USD per hour ({self.chips} chips x {self.price.usd:.2f} "
                f"USD, {self.tpu} {self.mode} price as of {self.price.as_of}: conf/prices.yaml)")

    def per_chip(self) -> str:
        """Where the chip price comes from, as `doit preflight` prints it next to the price."""
        basis = f"{self.tpu} {self.mode} price as of {self.price.as_of}, conf/prices.yaml"
        if self.reservation:
            return f"{basis}: the on-demand equivalent, reservation {self.reservation}'s commitment pays the VM"
        return basis


def machine_tpu(machine_type: str) -> tuple[str, int]:
    """(TPU, chips) a Compute TPU machine type holds, by conf/prices.yaml's machine families:
    ct6e-standard-8t -> ("v6e", 8), ct5lp-hightpu-8t -> ("v5e", 8)."""
    family, chips = tpu_chips(machine_type)
    tpus = {name: getattr(load().tpu, name) for name in Tpus.model_fields}
    tpu = next((name for name, entry in tpus.items() if entry.machine_family == family), None)
    if tpu is None:
        raise ConfigError("vm.machine_type", f"conf/prices.yaml prices no TPU of machine family {family!r} "
                          f"({machine_type})", "use ct6e-standard-8t (TPU v6e), or add the TPU to "
                          "conf/prices.yaml and mtpipe/cloud/settings/prices.py Tpus")
    return tpu, chips


def vm_rate(cfg: VmConfig) -> Rate:
    """The rate of the VM ``cfg`` describes: its machine type's chips at its provisioning mode's price
    (a reservation: the on-demand price, as the equivalent of what the commitment pays)."""
    tpu, chips = machine_tpu(cfg.machine_type)
    tpus = {name: getattr(load().tpu, name) for name in Tpus.model_fields}
    reserved = cfg.provisioning == "reservation"
    reservation = (cfg.reservation or "(RESERVATION not set)") if reserved else None
    mode = "on-demand" if reserved else cfg.provisioning
    price = getattr(tpus[tpu].per_chip_hour, mode.replace("-", "_"))
    if price is None:
        raise ConfigError(f"prices.tpu.{tpu}.per_chip_hour.{mode}", f"is null: no {mode} price of TPU {tpu} is known",
                          f"set its usd, as_of and source in {PRICES} (the region's price), or use another provisioning")
    return Rate(chips, tpu, mode, price, reservation)
