"""Checks before spending: what a TPU VM run needs that the laptop can verify in seconds.

`doit vm_up` and `doit vm_run` call :func:`before_spending` before they create anything billable
(the firewall rule and the VM), and :func:`check_project` before they ship code to a VM that already
runs. Each failure is a ConfigError naming the key and the fix:

* Compute: the credentials work (the first call is authenticated), the zone offers the machine type
  (TPU v6e), and with `provisioning: reservation` the reservation exists (another project's: shared
  with this one), is READY, reserves that machine type (or its TPU chips) and has room for one VM,
  and how its VMs are provisioned is decided (RESERVATION_BOUND or STANDARD);
* how the VM is reached (mtpipe.cloud.vm_access): network, subnetwork, external IP or IAP (gcloud
  as the credentials' account), a firewall rule for SSH, OS Login without 2-step verification;
* the project as the VM will run it (HEAD's params.yaml with each experiment's `--set` values
  applied): every branch composes (what the `configure` stage checks), HF_TOKEN is set when a Hub
  model or dataset of a composed preset is gated, the default DVC remote is the one HEAD's
  .dvc/config ships and accepts a write;
* the caller (mtpipe.cloud.vm_caller): the APIs the run uses are enabled (or enabled now, with
  `enable_apis: true`), and the caller holds the permissions the run will use;
* every other zone of ``zones`` as the first (it offers the machine type; its region has the
  subnetwork and, without an external IP, a Cloud NAT), and the TPU quota of each zone's region
  (mtpipe.cloud.vm_quota: a region without room is left out, none with room stops the run);
* the organisation policy compute.requireShieldedVm against what the insert sends;
* the VM's identity (mtpipe/cloud/vm_identity.py): its service account may use the DVC remote and
  the work bucket, as far as the allow policies readable here prove; the rest is probed from the VM;
* after preflight (:func:`check_spot_resume`): a Spot run has a work bucket to resume from, or says
  it does without one.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from google.cloud import compute_v1
from omegaconf import DictConfig, OmegaConf

from mtpipe.cloud import gcp, prices, vm_access, vm_caller, vm_config, vm_identity, vm_quota
from mtpipe.cloud.gcp import Compute, GcpError, reservation_path
from mtpipe.cloud.google_apis import GoogleApis, enforced
from mtpipe.data import hub
from mtpipe.errors import ConfigError
from mtpipe.planning.preflight import TRAIN_STARTUP_S
from mtpipe.maxtext.run_dir import WORK_BUCKET_ENV, WORK_DIR_ENV
from mtpipe.pipeline import config, maxtext_check, overrides
from mtpipe.pipeline.schema import SftBranch


def before_spending(cfg: DictConfig, compute: Compute, root: Path,
                    experiments: list[list[str]]) -> list[vm_identity.Target]:
    """Everything below, Compute first (it also proves the credentials), then how the VM is reached,
    the project, the caller's APIs and permissions, the other zones and the quota, Shielded VM, the
    VM's identity; returns the buckets only the VM can tell it may use (vm_identity.probe_from_vm)."""
    apis = GoogleApis()
    check_compute(cfg, compute)
    creates_rule = vm_access.check_access(cfg, compute, apis)
    check_project(cfg, root, experiments)
    vm_caller.check_caller(cfg, apis, creates_rule, uses_gcs=bool(vm_identity.targets(cfg, root)))
    check_zones(cfg, compute, apis)
    check_shielded_vm(cfg, apis)
    return vm_identity.check_identity(cfg, root)


def check_compute(cfg: DictConfig, compute: Compute) -> None:
    """The credentials work, the zone offers the machine type, a reservation has room for one VM."""
    if compute.get_machine_type(cfg.machine_type) is None:   # authenticated: bad credentials fail here
        raise ConfigError("vm.zones" if cfg.zones else "vm.zone", f"zone {cfg.zone!r} does not offer "
                          f"{cfg.machine_type} (TPU v6e)", "pick zones listed for v6e at "
                          "cloud.google.com/tpu/docs/regions-zones (e.g. us-east5-b) with ZONE / --zone or "
                          "zones: in conf/vm.yaml, where your reservation is")
    if cfg.provisioning == "reservation":
        check_reservation(cfg, compute)


def check_zones(cfg: DictConfig, compute: Compute, apis: GoogleApis) -> None:
    """Every other zone the VM may be created in as :func:`check_compute` and vm_access checked the
    first (the regional part: vm_access.check_region), then the quota of their regions
    (vm_quota.usable_zones), which may leave fewer zones to try: ``zones`` and ``zone`` become them."""
    zones = vm_config.candidate_zones(cfg)
    regions = {gcp.region(cfg.zone)}
    for zone in zones[1:]:
        here, there = OmegaConf.merge(cfg, {"zone": zone}), compute.in_zone(zone)
        check_compute(here, there)
        if gcp.region(zone) not in regions:
            regions.add(gcp.region(zone))
            vm_access.check_region(here, there)
    usable = vm_quota.usable_zones(cfg, apis, zones)
    cfg.zone, cfg.zones = usable[0], usable


SHIELDED = ("enable_secure_boot", "enable_vtpm", "enable_integrity_monitoring")


def check_shielded_vm(cfg: DictConfig, apis: GoogleApis) -> None:
    """Where the organisation policy compute.requireShieldedVm is enforced, Compute refuses a new VM
    that does not boot with Secure Boot, vTPM and Integrity Monitoring on: the insert body
    (gcp.instance_body) must send all three (a policy that cannot be read is said and passed over)."""
    try:
        policy = apis.effective_policy(cfg.project, "compute.requireShieldedVm")
    except GcpError as err:
        print(f"mtpipe: could not read the organisation policy compute.requireShieldedVm ({err}); going on as "
              "if it were not enforced (if it is, Compute refuses the insert)", flush=True)
        return
    if not enforced(policy):
        return
    sent = gcp.instance_body(cfg, cfg.name, "", {}, "STANDARD").get("shielded_instance_config", {})
    off = [name for name in SHIELDED if not sent.get(name)]
    if off:
        raise ConfigError("vm.project", "the organisation policy constraints/compute.requireShieldedVm is "
                          f"enforced for project {cfg.project}: Compute creates only VMs with Secure Boot, vTPM and "
                          f"Integrity Monitoring on, and the insert does not turn on {', '.join(off)} (mtpipe does not turn "
                          "Secure Boot on: whether the TPU image's drivers load under it is not known here)",
                          "use a project where the policy is not enforced, or ask your organisation's policy "
                          "administrator for an exception: gcloud resource-manager org-policies disable-enforce "
                          f"compute.requireShieldedVm --project {cfg.project} (needs roles/orgpolicy.policyAdmin)")


FULL_FIX = ("delete a VM that uses it (`gcloud compute instances list --filter=labels.app=mtpipe`), wait "
            "for one to end, or use another reservation")


def check_reservation(cfg: DictConfig, compute: Compute) -> None:
    """The reservation exists (another project's: shared with this one), is READY, reserves the
    machine type and has room for one VM: a free VM of a specific reservation, the VM's chips of an
    aggregate (TPU) one. Then the provisioning model of its VMs is decided, so that a lookup Compute
    refuses stops the run here (gcp.Compute.provisioning_model)."""
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
    training from step 0. ``forecasts``: preflight's rows for the run (mtpipe.planning.preflight.report),
    whose training time and price say what each preemption would throw away."""
    if (cfg.provisioning != "spot" or cfg.spot_without_work_bucket
            or str(cfg.run.env.get(WORK_BUCKET_ENV) or "").strip()):
        return
    costs = [f"{r['stage']} of the {r['branch']} branch up to {r['est_train_s'] / 60:.1f} min ({r['steps']} steps x "
             f"{r['est_step_s']:.3f} s + {TRAIN_STARTUP_S:.0f} s start-up), about "
             f"{r['est_train_s'] / 3600 * r['usd_per_hour']:.2f} USD at {r['usd_per_hour']:.2f} USD/h"
             for r in forecasts]
    lost = "; ".join(costs) or ("the training done so far (no forecast without preflight: `doit preflight "
                                "--set ...` prints each TPU branch's)")
    where = str(cfg.run.env.get(WORK_DIR_ENV) or "").strip() or "work/ on the boot disk"
    raise ConfigError(
        f"vm.run.env.{WORK_BUCKET_ENV}", f"is not set for a Spot run: training keeps its checkpoints in {where} "
        "on the VM, which goes with the VM when Compute preempts it, so training restarts from step 0 on the "
        f"next VM (up to max_recoveries = {cfg.max_recoveries} times); each preemption throws away {lost}",
        f"add {WORK_BUCKET_ENV}: gs://BUCKET/work to run.env in conf/vm.yaml (training then resumes from its last "
        "checkpoint there), or set spot_without_work_bucket: true to accept the restarts, or use "
        "--provisioning=on-demand or reservation")


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
    """HF_TOKEN is set when a Hub model or dataset of a branch is gated (the Hub's model info says)."""
    seen: set[tuple[str, str, str]] = set()
    for cfg in branches:
        for repo_type in ("model", "dataset"):
            source = getattr(cfg, repo_type).source
            if source.kind != "hub" or (repo_type, source.repo_id, source.revision) in seen:
                continue
            seen.add((repo_type, source.repo_id, source.revision))
            access = hub.gated(source.model_dump(), repo_type)
            if access and not os.environ.get("HF_TOKEN"):
                raise ConfigError("HF_TOKEN", f"{source.repo_id} ({cfg.branch}.{repo_type}) is gated "
                                  f"({access}) and HF_TOKEN is not set",
                                  f"accept its license at {hub.repo_url(source.repo_id, repo_type)}, "
                                  "then `export HF_TOKEN=...` (a read token) before doit")


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
