"""The state file (.vm_state.json): the VM this checkout created, and the ledger of what the run's
VMs cost."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from mtpipe.cloud.settings import prices
from mtpipe.cloud.settings.vm_config import VmConfig

STATE_FILE = ".vm_state.json"


def read_state(root: Path) -> dict:
    path = root / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(root: Path, state: dict) -> None:
    path = root / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def clear_state(root: Path) -> None:
    (root / STATE_FILE).unlink(missing_ok=True)


def vm_started(state: dict, cfg: VmConfig, created: str) -> None:
    """Add a VM of this run to the state's ledger (`vms`): name, mode, rate (a reservation's VM: the
    on-demand equivalent, and the reservation that pays it), creation time."""
    rate = prices.vm_rate(cfg)
    state.setdefault("vms", []).append({
        "name": cfg.name, "provisioning": cfg.provisioning, "usd_per_hour": rate.usd_per_hour,
        "reservation": rate.reservation, "created": created, "ended": None, "why": None})


def vm_ended(state: dict, why: str) -> None:
    """Close the ledger entry of the current VM (it was deleted, preempted or is gone)."""
    if state.get("vms") and not state["vms"][-1]["ended"]:
        state["vms"][-1].update(ended=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                why=why)


@dataclass
class Spend:
    """What the VMs of a run cost: ``usd`` billed for them, and the number, hours and on-demand
    equivalent of those a reservation's commitment paid (``reservations`` names them)."""

    count: int = 0
    hours: float = 0.0
    usd: float = 0.0
    reserved_count: int = 0
    reserved_hours: float = 0.0
    reserved_usd: float = 0.0
    reservations: set[str] = field(default_factory=set)


def spend(state: dict) -> Spend:
    """The run's VMs, the hours they existed (the current one until now) and their cost."""
    now, total = datetime.now(timezone.utc), Spend()
    for entry in state.get("vms", []):
        end = datetime.fromisoformat(entry["ended"]) if entry["ended"] else now
        h = max(0.0, (end - datetime.fromisoformat(entry["created"])).total_seconds() / 3600)
        total.count, total.hours = total.count + 1, total.hours + h
        if entry.get("reservation"):
            total.reserved_count += 1
            total.reserved_hours += h
            total.reserved_usd += h * entry["usd_per_hour"]
            total.reservations.add(entry["reservation"])
        else:
            total.usd += h * entry["usd_per_hour"]
    return total
