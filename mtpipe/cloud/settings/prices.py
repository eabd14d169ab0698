"""conf/prices.yaml: the one table of prices that every cost line reads.

Prices are per chip-hour of a TPU generation (conf/generations.yaml's names), per provisioning mode that
has a price (on-demand, spot, flex-start) and per region, each mode with the date its source gives and
the page to check it on. A VM's rate is its machine type's chips (``ct6e-standard-8t``: 8) times its
mode's price in its zone's region (no zone: the generation's ``default_region``, said in every line). A reservation's VMs cost
nothing on top of the reservation: its commitment pays for the reserved capacity, used or not, so
their rate is the on-demand equivalent and every line that shows it names the reservation that pays
(:func:`paid_by`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Protocol

from annotated_types import Ge
from omegaconf import OmegaConf
from pydantic import Field

from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations
from mtpipe.pipeline.schema import KEEP_INT, Section, validate
from mtpipe.pipeline.view import load_yaml


PRICES = Path(__file__).resolve().parents[3] / "conf" / "prices.yaml"


class PricedVm(Protocol):
    """What a rate reads of a VM config (vm_config.VmConfig, which imports this module)."""

    machine_type: str
    provisioning: str
    zone: str | None
    reservation: str | None


class ModePrices(Section):
    """One provisioning mode's prices, by region."""

    as_of: str                               # the date the source gives
    source: str                              # the page to check it on
    usd: dict[str, Annotated[float, Ge(0), KEEP_INT]]   # per chip-hour, by region


class PerChipHour(Section):
    """The prices of each provisioning mode that has one (a reservation's commitment pays its VMs)."""

    on_demand: ModePrices = Field(alias="on-demand")
    spot: ModePrices | None                  # null: no price known, Spot VMs of this TPU are refused
    flex_start: ModePrices | None = Field(alias="flex-start")   # null: Flex-start VMs of this TPU are refused


class Tpu(Section):
    default_region: str                      # prices a VM whose zone is not set yet
    per_chip_hour: PerChipHour


@dataclass(frozen=True)
class ChipPrice:
    """One chip-hour's price in one region and mode, with its source."""

    usd: float
    region: str
    as_of: str
    source: str
    default_region: bool = False             # no zone set: the generation's default region


@dataclass(frozen=True)
class Prices:
    tpu: dict[str, Tpu]                      # by generation (conf/generations.yaml)


@functools.cache
def load(path: Path = PRICES) -> Prices:
    """The price table, checked (each error names its key)."""
    table = OmegaConf.to_container(load_yaml(path))
    tpus = table.get("tpu") if isinstance(table, dict) else None
    if not isinstance(tpus, dict):
        raise ConfigError("prices.tpu", f"is missing in {path}", "give each TPU generation its per_chip_hour prices")
    fix = lambda key, requirement: f"set {key.removeprefix('prices.')} {requirement} in {path}"  # noqa: E731
    return Prices({name: validate(Tpu, entry, f"prices.tpu.{name}", fix) for name, entry in tpus.items()})


def paid_by(reservation: str, on_demand: str) -> str:
    """How every cost line shows what a reservation's commitment pays, as one clause (``on_demand``: what
    the same costs at the on-demand price, for comparison only, e.g. "21.60 USD/h")."""
    return f"paid for by the commitment of reservation {reservation}, instead of {on_demand} on demand"


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

    def where(self) -> str:
        """The price's region and provisioning model, as every cost line names them."""
        return f"{self.tpu} {self.mode} in {self.price.region}{' (no zone set)' if self.price.default_region else ''}"

    def describe(self) -> str:
        """The rate as the cost lines print it."""
        if self.reservation:
            return paid_by(self.reservation, f"{self.usd_per_hour:.2f} USD/h")
        return (f"about {self.usd_per_hour:.2f} USD per hour ({self.chips} chips x {self.price.usd:.2f} "
                f"USD, {self.where()}, price as of {self.price.as_of}: conf/prices.yaml)")

    def per_chip(self) -> str:
        """Where the chip price comes from, as `doit preflight` prints it next to the price."""
        basis = f"{self.where()}, price as of {self.price.as_of}, conf/prices.yaml"
        if self.reservation:
            return f"{basis}: the on-demand equivalent; the VM is paid for by the commitment of reservation {self.reservation}"
        return basis


def mode_prices(cfg: PricedVm) -> tuple[str, int, str, ModePrices]:
    """The generation, chips and provisioning mode that price ``cfg``'s VM (a reservation: on-demand),
    and that mode's prices by region; a generation or mode without prices is refused naming its key. Loading
    the VM's settings checks this; the zone's region is checked where a rate is read (:func:`vm_rate`), after
    the checks have found that the zone offers the machine type (a zone without it is refused for that)."""
    gen, chips = generations.of_machine_type(cfg.machine_type)
    tpu = gen.name
    if tpu not in load().tpu:
        raise ConfigError(f"prices.tpu.{tpu}", f"is missing: conf/prices.yaml prices no {gen.title} ({cfg.machine_type})",
                          f"add tpu.{tpu}.per_chip_hour (on-demand, spot, flex-start: usd, as_of, source) to {PRICES}")
    mode = "on-demand" if cfg.provisioning == "reservation" else cfg.provisioning
    prices = getattr(load().tpu[tpu].per_chip_hour, mode.replace("-", "_"))
    if prices is None:
        raise ConfigError(f"prices.tpu.{tpu}.per_chip_hour.{mode}", f"is null: no {mode} price of TPU {tpu} is known",
                          f"set its usd (by region), as_of and source in {PRICES}, or use another provisioning")
    return tpu, chips, mode, prices


def vm_rate(cfg: PricedVm) -> Rate:
    """The rate of the VM ``cfg`` describes: its machine type's chips at its provisioning mode's price in
    its zone's region (a reservation: the on-demand price, as the equivalent of what the commitment pays).
    ``cfg`` is read by attribute: machine_type, provisioning, zone, reservation."""
    tpu, chips, mode, prices = mode_prices(cfg)
    reservation = (cfg.reservation or "(RESERVATION not set)") if cfg.provisioning == "reservation" else None
    zone = cfg.zone
    region = zone.rsplit("-", 1)[0] if zone else load().tpu[tpu].default_region
    if region not in prices.usd:
        raise ConfigError(f"prices.tpu.{tpu}.per_chip_hour.{mode}.usd.{region}",
                          f"is missing: conf/prices.yaml has no {mode} price of TPU {tpu} in {region} (zone {zone})",
                          f"add the region's price to {PRICES}, or use a zone of {', '.join(sorted(prices.usd))}")
    price = ChipPrice(prices.usd[region], region, prices.as_of, prices.source, default_region=not zone)
    return Rate(chips, tpu, mode, price, reservation)


def by_region(rate: Rate) -> str:
    """The chip-hour prices of ``rate``'s generation in its region for each provisioning model, and the
    range over the other regions: what `doit preflight` prints below the run's total."""
    modes = load().tpu[rate.tpu].per_chip_hour
    here, elsewhere = [], []
    for mode in ("on-demand", "spot", "flex-start"):
        prices = getattr(modes, mode.replace("-", "_"))
        if prices is None:
            here.append(f"{mode} none known")
            continue
        assumed = " (assumed)" if prices.as_of.startswith("assumed") else ""
        here.append(f"{mode} {prices.usd[rate.price.region]:.2f}{assumed}" if rate.price.region in prices.usd
                    else f"{mode} not listed")
        elsewhere.append(f"{mode} {min(prices.usd.values()):.2f}-{max(prices.usd.values()):.2f}")
    return (f"{rate.tpu} USD per chip-hour in {rate.price.region}: {', '.join(here)}; over the regions listed: "
            f"{', '.join(elsewhere)} (conf/prices.yaml: the Cloud Billing Catalog via SkyPilot's catalog)")
