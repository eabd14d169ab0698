"""What the VM's lifecycle says: the creation line (kind, price, when Compute deletes it), the run's
forecast, what this run's VMs cost so far, each line printed as `mtpipe: ...`."""

from __future__ import annotations

from typing import Any

from mtpipe.cloud.settings import prices, vm_config, vm_state
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.planning import run_forecast


def spend_line(state: dict) -> str:
    """What the VMs of this run (the one recorded, and those it replaced) cost so far."""
    spent = vm_state.spend(state)
    replaced = f", {spent.count - 1} of them replaced after being lost" if spent.count > 1 else ""
    line = f"this run's VMs: {spent.count}{replaced}; {spent.hours:.2f} h in all"
    if not spent.reservations:
        return f"{line}, about {spent.usd:.2f} USD"
    paid = prices.paid_by(", ".join(sorted(spent.reservations)), f"{spent.reserved_usd:.2f} USD")
    if spent.reserved_count == spent.count:
        return f"{line}, {paid}"
    return f"{line}: about {spent.usd:.2f} USD, and {spent.reserved_hours:.2f} h {paid}"


def creation_line(cfg: VmConfig, model: str) -> str:
    """What vm_up says before creating the VM: its kind, what it costs, when Compute deletes it."""
    rate, hours = prices.vm_rate(cfg), int(cfg.max_run_duration_s) / 3600
    kind = f"reservation {cfg.reservation}, {model}" if rate.reservation else cfg.provisioning
    if vm_config.route(cfg) == "tpu_api":
        limit = ("the Cloud TPU API sets it no time limit (max_run_duration_s is Compute Engine's): vm_run deletes "
                 "it when the run ends, unless --keep; else `doit vm_down`.")
    elif not hours:
        limit = "NO time limit (max_run_duration_s: 0): `doit vm_down` when done."
    elif model == "RESERVATION_BOUND":
        limit = (f"maxRunDuration {hours:g} h is sent, but it is not known to be honoured for "
                 "reservation-bound VMs: delete the VM with `doit vm_down` (Compute deletes it when the "
                 "reservation ends).")
    else:
        most = "" if rate.reservation else f" (at most {hours * rate.usd_per_hour:.2f} USD)"
        limit = f"Compute deletes it after {hours:g} h{most}."
    if model == "FLEX_START":
        limit = (f"Compute looks for capacity for up to {float(cfg.flex_start.request_valid_for_s):g} s "
                 f"(flex_start.request_valid_for_s); {limit}")
    billed = "" if rate.reservation else " while it exists"
    return f"creating {cfg.machine_type} VM {cfg.name} ({kind}) in {cfg.zone}: {rate.describe()}{billed}; {limit}"


def forecast_line(cfg: VmConfig, forecasts: list[dict[str, Any]]) -> str:
    """What the whole run takes and costs by preflight's forecast (its rows: the total `doit preflight`
    prints, mtpipe.planning.run_forecast) and what that counts, or why there is none."""
    if not forecasts:
        return ("no forecast of the run's length (no branch trains on a TPU, or --no-preflight): the VM bills "
                "until the run ends and it is deleted")
    run = run_forecast.forecast(forecasts)
    rate = prices.vm_rate(cfg)
    cost = prices.paid_by(rate.reservation, run.usd_text()) if rate.reservation else run.usd_text()
    return f"forecast (doit preflight): the run {run.hours_text()}, {cost}; it holds {run.holds()}"


def _say(line: str) -> None:
    try:
        print(f"mtpipe: {line}", flush=True)
    except OSError:   # the terminal is gone (SIGHUP): the cleanup goes on without it
        pass
