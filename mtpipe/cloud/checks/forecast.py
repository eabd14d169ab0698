"""Checks before spending that read preflight's cached forecast (nothing compiles here): its rows for
the TPU branches it has compiled (:func:`cached_forecasts`), and a Spot run's work bucket to resume
from, or its consent to restart, with what each preemption would cost (:func:`check_spot_resume`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from mtpipe.cloud.settings import prices
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError
from mtpipe.maxtext.run_dir import WORK_BUCKET_ENV, WORK_DIR_ENV
from mtpipe.pipeline import config
from mtpipe.planning import preflight
from mtpipe.planning.aot import composed_views, topology


def check_spot_resume(cfg: VmConfig, forecasts: list[dict[str, Any]]) -> None:
    """A Spot run keeps its training state in run.env's MTPIPE_WORK_BUCKET, where the VM that replaces
    a preempted one resumes it, unless `spot_without_work_bucket` accepts that each preemption restarts
    training from step 0 (conf/vm.yaml alone decides it). ``forecasts``: preflight's rows for the run
    (:func:`cached_forecasts`), whose training time and price say what each preemption would throw away."""
    if (cfg.provisioning != "spot" or cfg.spot_without_work_bucket
            or str(cfg.run.env.get(WORK_BUCKET_ENV) or "").strip()):
        return
    costs = [f"{r['stage']} of the {r['branch']} branch up to {r['est_train_s'] / 60:.1f} min ({r['steps']} steps x "
             f"{r['est_step_s']:.3f} s + start-up and checkpoints), about "
             f"{r['est_train_s'] / 3600 * r['usd_per_hour']:.2f} USD at {r['usd_per_hour']:.2f} USD/h"
             for r in forecasts]
    lost = "; ".join(costs) or ("the training done so far (no forecast: preflight has compiled no TPU branch's step "
                                "yet; `doit preflight --set ...` prints each one's)")
    where = str(cfg.run.env.get(WORK_DIR_ENV) or "").strip() or "work/ on the boot disk"
    raise ConfigError(
        f"vm.run.env.{WORK_BUCKET_ENV}", f"is not set for a Spot run: training keeps its checkpoints in {where} "
        "on the VM, which goes with the VM when Compute preempts it, so training restarts from step 0 on the "
        f"next VM (up to max_recoveries = {cfg.max_recoveries} times); each preemption throws away {lost}",
        f"add {WORK_BUCKET_ENV}: gs://BUCKET/work to run.env in conf/vm.yaml (training then resumes from its last "
        "checkpoint there), or set spot_without_work_bucket: true to accept the restarts, or use "
        "--provisioning=on-demand or reservation")


def cached_forecasts(cfg: VmConfig, root: Path, experiments: list[list[str]]) -> tuple[list[dict[str, Any]], list[str]]:
    """preflight's rows (mtpipe.planning.preflight.stored_report) of the TPU branches of every experiment
    whose training step preflight has a compile result of (its cache in work/preflight/, or a shipped
    preset's committed one), and the branches it has not compiled yet; nothing compiles here."""
    rate, rows, missing = prices.vm_rate(cfg), [], []
    for sets in experiments:
        params, _, views = composed_views(sets, root, tuple(config.BRANCH_STAGES), committed=True)
        for branch, view in views.items():
            topo = topology(view)
            if topo is None:
                continue
            row = preflight.stored_report(view, params[branch].preset, rate.price.usd, root / "work" / "preflight")
            if row is None:
                missing.append(f"{branch} ({params[branch].preset} on {topo})")
            else:
                rows.append(row)
    return rows, missing
