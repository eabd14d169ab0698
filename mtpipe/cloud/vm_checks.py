"""Checks before spending: what a TPU VM run needs that the laptop can verify in seconds.

mtpipe.cloud.prerequisites runs them all, each a named check, for `doit check` and before `doit
vm_up` / `doit vm_run` create anything billable; :func:`check_project` runs alone before they ship
code to a VM that already runs. Each failure is a ConfigError naming the key and the fix:

* Compute: the zone offers the machine type (TPU v6e), and with `provisioning: reservation` the
  reservation exists (another project's: shared with this one), is READY, reserves that machine
  type (or its TPU chips) and has room for one VM, and how its VMs are provisioned is decided
  (RESERVATION_BOUND or STANDARD);
* the project as the VM will run it (HEAD's params.yaml with each experiment's `--set` values
  applied): every branch composes (what the `configure` stage checks), HF_TOKEN is set and may
  download each gated Hub model or dataset of a composed preset, the default DVC remote is the one
  HEAD's .dvc/config ships and accepts a write;
* every other zone of ``zones`` as the first (it offers the machine type; its region has the
  subnetwork and, without an external IP, a Cloud NAT), and the TPU quota of each zone's region
  (mtpipe.cloud.vm_quota: a region without room is left out, none with room stops the run);
* a Spot run has a work bucket to resume from, or says it does without one, with what each
  preemption would cost by preflight's cached compile (:func:`check_spot_resume`), before any compile.

How the VM is reached (vm_access), the caller's APIs and permissions (vm_caller), the organisation
policies (org_policies) and the VM's identity (vm_identity) are checked in their own modules.
"""
from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.cloud import compute_v1
from omegaconf import DictConfig, OmegaConf

from mtpipe.cloud import vm_access, vm_identity, vm_quota
from mtpipe.cloud.providers.gcp.bodies import reservation_path
from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis
from mtpipe.cloud.providers.interface import region
from mtpipe.cloud.settings import prices, vm_config
from mtpipe.data import hub, hub_access
from mtpipe.errors import ConfigError
from mtpipe.maxtext.run_dir import WORK_BUCKET_ENV, WORK_DIR_ENV
from mtpipe.pipeline import config, maxtext_check, overrides
from mtpipe.pipeline.schema import SftBranch
from mtpipe.planning import preflight
from mtpipe.planning.preflight import TRAIN_STARTUP_S


def check_compute(cfg: DictConfig, compute: Compute) -> None:
    """The zone offers the machine type, a reservation has room for one VM."""
    check_machine_type(cfg, compute)
    if cfg.provisioning == "reservation":
        check_reservation(cfg, compute)


def check_machine_type(cfg: DictConfig, compute: Compute) -> None:
    """The zone offers the machine type (an authenticated call: bad credentials fail here too)."""
    if compute.get_machine_type(cfg.machine_type) is None:
        raise ConfigError("vm.zones" if cfg.zones else "vm.zone", f"zone {cfg.zone!r} does not offer "
                          f"{cfg.machine_type} (TPU v6e)", "pick zones listed for v6e at "
                          "cloud.google.com/tpu/docs/regions-zones (e.g. us-east5-b) with ZONE / --zone or "
                          "zones: in conf/vm.yaml, where your reservation is")


def check_zones(cfg: DictConfig, compute: Compute, apis: GoogleApis) -> None:
    """Every other zone the VM may be created in as :func:`check_compute` and vm_access checked the
    first (the regional part: vm_access.check_region), then the quota of their regions
    (vm_quota.usable_zones), which may leave fewer zones to try: ``zones`` and ``zone`` become them."""
    zones = vm_config.candidate_zones(cfg)
    regions = {region(cfg.zone)}
    for zone in zones[1:]:
        here, there = OmegaConf.merge(cfg, {"zone": zone}), compute.in_zone(zone)
        check_compute(here, there)
        if region(zone) not in regions:
            regions.add(region(zone))
            vm_access.check_region(here, there)
    usable = vm_quota.usable_zones(cfg, apis, zones)
    cfg.zone, cfg.zones = usable[0], usable


FULL_FIX = ("delete a VM that uses it (`gcloud compute instances list --filter=labels.app=mtpipe`), wait "
            "for one to end, or use another reservation")


def check_reservation(cfg: DictConfig, compute: Compute) -> None:
    """The reservation exists (another project's: shared with this one), is READY, reserves the
    machine type and has room for one VM: a free VM of a specific reservation, the VM's chips of an
    aggregate (TPU) one. Then the provisioning model of its VMs is decided, so that a lookup Compute
    refuses stops the run here (Compute.provisioning_model)."""
    owner, name = reservation_path(cfg.reservation, cfg.project)
    reservation = compute.get_reservation(cfg.reservation)
    if reservation is None:
        raise ConfigError("vm.reservation", f"no reservation {name!r} in {owner}/{cfg.zone}",
                          f"`gcloud compute reservations list --project {owner}` shows their "
                          "names and zones; pass the name as RESERVATION / --reservation (another "
                          "project's as projects/PROJECT/reservations/NAME)")
    if owner != cfg.project:
        share = reservation.share_settings
        if not (share.share_type == "ORGANIZATION"
                or (share.share_type == "SPECIFIC_PROJECTS" and cfg.project in share.project_map)):
            raise ConfigError("vm.reservation", f"{cfg.reservation} is not shared with {cfg.project} "
                              f"(shareSettings.shareType {share.share_type or 'LOCAL'})",
                              f"ask the owner of {owner} to share it: `gcloud compute reservations update "
                              f"{name} --project={owner} --zone={cfg.zone} --add-share-with={cfg.project}`")
    if reservation.status not in ("", "READY"):
        raise ConfigError("vm.reservation", f"{cfg.reservation} is {reservation.status}, not READY",
                          "wait until `gcloud compute reservations describe` says READY (a reservation "
                          "from a future reservation is usable from its start time), or use another one")
    if "aggregate_reservation" in reservation:
        _check_chips(cfg, reservation.aggregate_reservation)
    elif "specific_reservation" in reservation:
        _check_vms(cfg, reservation.specific_reservation)
    else:
        raise ConfigError("vm.reservation", f"{cfg.reservation} reserves neither VMs "
                          "(specificReservation) nor TPU chips (aggregateReservation)",
                          "use a reservation of v6e-8 VMs (ct6e-standard-8t) or of TPU v6e chips")
    compute.provisioning_model(cfg)   # decided (and kept for the insert) before anything exists


def _check_vms(cfg: DictConfig, specific: compute_v1.AllocationSpecificSKUReservation) -> None:
    """A specific reservation: VMs of one machine type, ``count`` of them, ``inUseCount`` taken."""
    reserved = specific.instance_properties.machine_type.rsplit("/", 1)[-1]
    if reserved and reserved != cfg.machine_type:
        raise ConfigError("vm.reservation", f"{cfg.reservation} reserves {reserved}, not "
                          f"{cfg.machine_type}", "use a reservation of v6e-8 VMs (ct6e-standard-8t)")
    if specific.count - specific.in_use_count < 1:
        raise ConfigError("vm.reservation", f"{cfg.reservation} has no free VM ({specific.in_use_count}"
                          f" of {specific.count} VMs in use)", FULL_FIX)


def _check_chips(cfg: DictConfig, aggregate: compute_v1.AllocationAggregateReservation) -> None:
    """An aggregate (TPU) reservation: chips of one VM family (vmFamily ..._CT6E for v6e), counted in
    ``reservedResources`` and ``inUseResources``; a VM takes its machine type's chips (8 for a v6e-8)."""
    family, chips = prices.tpu_chips(cfg.machine_type)
    reserved_family = aggregate.vm_family.rsplit("_", 1)[-1].lower()
    if reserved_family != family:
        raise ConfigError("vm.reservation", f"{cfg.reservation} reserves {aggregate.vm_family} chips, "
                          f"not {family} ones ({cfg.machine_type})",
                          "use a reservation of TPU v6e chips (VM_FAMILY_CLOUD_TPU_LITE_POD_SLICE_CT6E)")

    def count(resources: Iterable[compute_v1.AllocationAggregateReservationReservedResourceInfo]) -> int:
        return sum(r.accelerator.accelerator_count for r in resources
                   if r.accelerator.accelerator_type.rsplit("/", 1)[-1] == family)

    total, used = count(aggregate.reserved_resources), count(aggregate.in_use_resources)
    if total - used < chips:
        raise ConfigError("vm.reservation", f"{cfg.reservation} has no free VM ({used} of {total} chips "
                          f"in use; a {cfg.machine_type} takes {chips})", FULL_FIX)


def check_spot_resume(cfg: DictConfig, forecasts: list[dict[str, Any]]) -> None:
    """A Spot run keeps its training state in run.env's MTPIPE_WORK_BUCKET, where the VM that replaces
    a preempted one resumes it, unless `spot_without_work_bucket` accepts that each preemption restarts
    training from step 0 (conf/vm.yaml alone decides it). ``forecasts``: preflight's rows for the run
    (:func:`cached_forecasts`), whose training time and price say what each preemption would throw away."""
    if (cfg.provisioning != "spot" or cfg.spot_without_work_bucket
            or str(cfg.run.env.get(WORK_BUCKET_ENV) or "").strip()):
        return
    costs = [f"{r['stage']} of the {r['branch']} branch up to {r['est_train_s'] / 60:.1f} min ({r['steps']} steps x "
             f"{r['est_step_s']:.3f} s + {TRAIN_STARTUP_S:.0f} s start-up), about "
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


def cached_forecasts(cfg: DictConfig, root: Path, experiments: list[list[str]]) -> tuple[list[dict[str, Any]], list[str]]:
    """preflight's rows (mtpipe.planning.preflight.report) of the TPU branches of every experiment whose
    training step preflight has a compile result of (preflight.stored_compile: its cache in
    work/preflight/, or a shipped preset's committed one), and the branches it has not compiled yet;
    nothing compiles here."""
    rate, rows, missing = prices.vm_rate(cfg), [], []
    for sets in experiments:
        params, _, views = preflight.composed_views(sets, root, tuple(config.BRANCH_STAGES), committed=True)
        for branch, view in views.items():
            topo = preflight.topology(view)
            if topo is None:
                continue
            chip, chips = preflight.chip_of(topo, branch, view.hardware.name)
            cmd = preflight.stage_command(view)
            args = preflight.compile_args(cmd, preflight.maxtext_topology(topo))
            compiled = preflight.stored_compile(cmd.module, args, root / "work" / "preflight")
            if compiled is None:
                missing.append(f"{branch} ({params[branch].preset} on {topo})")
                continue
            rows.append(preflight.report(view, params[branch].preset, compiled, chip, chips,
                                         preflight.usd_per_hour(chips, rate.price.usd), args))
    return rows, missing


def check_project(cfg: DictConfig, root: Path, experiments: list[list[str]]) -> None:
    """For each experiment's `--set` values the branches compose and gated Hub repos have
    HF_TOKEN; the DVC remote is writable."""
    check_hub_tokens([branch for sets in experiments
                      for branch in composed_branches(root, sets).values()])
    vm_identity.shipped_remote(root)   # the VM's dvc reads HEAD's .dvc/config, not this checkout's
    check_remote_writable(root, float(cfg.remote_probe_timeout_s))


def composed_branches(root: Path, sets: list[str]) -> dict[str, SftBranch]:
    """Every branch composed from HEAD's params.yaml with `sets` applied as `dvc exp run -S` does."""
    params = overrides.apply_sets(overrides.committed_params(root), sets)
    return {branch: maxtext_check.compose_checked(branch, params) for branch in config.BRANCH_STAGES}


def check_hub_tokens(branches: Iterable[SftBranch]) -> None:
    """Every Hub repo of the branches that is gated may be downloaded with HF_TOKEN (:func:`check_hub_repo`)."""
    for repo in hub_repos(branches):
        check_hub_repo(repo)


@dataclass(frozen=True)
class HubRepo:
    """A pinned Hub model or dataset a branch downloads (the first branch that names it)."""

    branch: str
    repo_type: str
    source: dict[str, Any]

    @property
    def repo_id(self) -> str:
        return self.source["repo_id"]


def hub_repos(branches: Iterable[SftBranch]) -> list[HubRepo]:
    """The Hub models and datasets of the branches, each pinned repo once."""
    found: dict[tuple[str, str, str], HubRepo] = {}
    for cfg in branches:
        for repo_type in ("model", "dataset"):
            source = getattr(cfg, repo_type).source
            if source.kind == "hub":
                found.setdefault((repo_type, source.repo_id, source.revision),
                                 HubRepo(cfg.branch, repo_type, source.model_dump()))
    return list(found.values())


def check_hub_repo(repo: HubRepo) -> str:
    """What the Hub says of the repo's access (its model or dataset info); a gated one needs HF_TOKEN,
    and the Hub's auth check must grant that token's account the repo (mtpipe.data.hub_access.check_access)."""
    access = hub.gated(repo.source, repo.repo_type)
    if not access:
        return "not gated"
    if not os.environ.get("HF_TOKEN"):
        raise ConfigError("HF_TOKEN", f"{repo.repo_id} ({repo.branch}.{repo.repo_type}) is gated "
                          f"({access}) and HF_TOKEN is not set",
                          f"accept its license at {hub.repo_url(repo.repo_id, repo.repo_type)}, "
                          "then `export HF_TOKEN=...` (a read token) before doit")
    hub_access.check_access(repo.source, repo.repo_type)
    return f"gated ({access}); HF_TOKEN's account may download it"


def check_remote_writable(root: Path, timeout_s: float) -> None:
    """Write and delete a small object on the default DVC remote, through DVC's own filesystem.

    The VM pushes its results there. The probe runs in a thread with a deadline: gcsfs retries a
    dead endpoint for minutes.
    """
    from dvc.config import NoRemoteError
    from dvc.repo import Repo

    remote: dict[str, str] = {}
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            with Repo(str(root)) as repo:
                remote["name"] = repo.config["core"].get("remote", "")
                remote["url"] = repo.config["remote"].get(remote["name"], {}).get("url", "")
                odb = repo.cloud.get_remote(command="vm_run").odb
                path = odb.fs.join(odb.path, f".mtpipe-write-probe-{uuid.uuid4().hex}")
                odb.fs.pipe_file(path, b"mtpipe checks that this remote is writable\n")
                odb.fs.rm_file(path)
            outcome.append(None)
        except BaseException as err:   # reported in the caller's thread
            outcome.append(err)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s)
    key = f"remote.{remote.get('name') or '?'}.url"
    fix = ("check the bucket name and endpoint (`dvc remote list`), and that your credentials may "
           "write it (roles/storage.objectAdmin): `dvc push` must work from here")
    if not outcome:
        raise ConfigError(key, f"writing a probe object to {remote.get('url')} took more than "
                          f"{timeout_s:.0f} s", fix)
    err = outcome[0]
    if isinstance(err, NoRemoteError):
        raise ConfigError("core.remote", "no default DVC remote: the VM pushes its results there",
                          "`dvc remote add -d gcs gs://BUCKET/PATH` and commit .dvc/config")
    if err is not None:
        raise ConfigError(key, f"{remote.get('url')} is not writable ({type(err).__name__}: {err})",
                          fix) from err
