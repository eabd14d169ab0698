"""Every prerequisite of a TPU VM run, checked at once: `doit check`, and the checks before spending
of `doit vm_up` / `doit vm_run`.

Each prerequisite is a named check that says ok (with what it found), fails (the ConfigError or
ProviderError text: what is wrong and the fix), unknown (what cannot be read here: an organisation policy
without the Org Policy API, a permission test refused; never passed as fine) or not checked (a check
it needs failed: nothing about Compute is asked without credentials). All of them run, so one run
lists every failure; :class:`ChecksFailed` is the one error that names them all. `doit check` asks
and creates nothing (no API enabled, no SSH key imported); before spending, vm_up does both where
conf/vm.yaml says so (enable_apis, OS Login).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpipe.cloud.checks.gcp import access, caller, identity, org_policies, quota
from mtpipe.cloud.checks.gcp.capacity import check_machine_type, check_reservation, check_zones
from mtpipe.cloud.checks.forecast import cached_forecasts, check_spot_resume
from mtpipe.cloud.checks.project import check_hub_repo, check_remote_writable, composed_branches, hub_repos
from mtpipe.cloud.providers.gcp.compute import Compute
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis, Unknown
from mtpipe.cloud.providers.interface import ProviderError
from mtpipe.cloud.providers.gcp.tpu_api.client import TpuClient
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import ConfigErrors, VmConfig, VmError
from mtpipe.errors import ConfigError
from mtpipe.planning import preflight

OK, FAILS, UNKNOWN, NOT_CHECKED = "ok", "FAILS", "unknown", "not checked"


@dataclass(frozen=True)
class Outcome:
    """What one check found."""

    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status:>11}  {self.name}: {self.detail}"


class ChecksFailed(ConfigError):
    """Several checks failed: one error listing each (its key, the problem, the fix)."""

    def __init__(self, failures: list[str]) -> None:
        super().__init__("checks", f"{len(failures)} of them failed", "each fix above")
        self.failures = failures

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        return ChecksFailed, (self.failures,)

    def __str__(self) -> str:
        return f"{len(self.failures)} checks failed; nothing was created:\n" + "\n".join(
            f"  - {failure}" for failure in self.failures)


@dataclass
class Runner:
    """Runs named checks in order and keeps their outcomes; ``say`` prints each line as it comes."""

    say: Callable[[str], None] | None = None
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    errors: list[Exception] = field(default_factory=list)

    def check(self, name: str, body: Callable[[], Any], needs: tuple[str, ...] = ()) -> Any:
        """Run ``body`` unless a check it ``needs`` failed or was not checked (a need that never ran,
        e.g. RESERVATION without provisioning: reservation, does not hold it back). ``body`` returns
        the ok line's detail (a str), or a (detail, value) pair whose value this returns; None when
        the check did not pass."""
        held = [n for n in needs if n in self.outcomes and self.outcomes[n].status in (FAILS, NOT_CHECKED)]
        if held:
            return self._record(name, NOT_CHECKED, f"needs {', '.join(held)}")
        try:
            result = body()
        except Unknown as err:
            return self._record(name, UNKNOWN, str(err))
        except ConfigErrors as several:   # one line each, the first under the check's own name
            for i, err in enumerate(several.errors):
                self.errors.append(err)
                self._record(name, FAILS, str(err), key=f"{name} ({i + 1})" if i else name)
            return None
        except (ConfigError, ProviderError, VmError) as err:
            self.errors.append(err)
            return self._record(name, FAILS, str(err))
        detail, value = result if isinstance(result, tuple) else (result, None)
        self._record(name, OK, detail or "")
        return value

    def skip(self, name: str, why: str) -> None:
        """Record ``name`` as not checked (so what needs it is held back too), saying ``why``."""
        self._record(name, NOT_CHECKED, why)

    def _record(self, name: str, status: str, detail: str, key: str | None = None) -> None:
        self.outcomes[key or name] = outcome = Outcome(name, status, detail)
        if self.say:
            self.say(outcome.line())

    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes.values() if o.status == FAILS]

    def raise_failures(self) -> None:
        """The one failure as it was raised, or :class:`ChecksFailed` naming every one."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ChecksFailed([o.detail for o in self.failed()])


def _say(line: str) -> None:
    print(f"mtpipe check: {line}", flush=True)


def settings(run: Runner, cfg: VmConfig) -> GoogleApis | None:
    """PROJECT, ZONE, RESERVATION (with provisioning: reservation) and the Google credentials, each
    its own check so that every missing one is named in one run; the Google APIs' client."""
    for key in ("project", "zone", *(["reservation"] if cfg.provisioning == "reservation" else [])):
        run.check(vm_config.ENV_KEYS[key], lambda key=key: vm_config.require(cfg, key) or str(getattr(cfg, key)))
    return run.check("credentials", _credentials)


# What google.auth.default's credentials are, by the module of their class.
CREDENTIAL_KINDS = {"google.oauth2.credentials": "a user's (gcloud auth application-default login)",
                    "google.oauth2.service_account": "a service account's key",
                    "google.auth.impersonated_credentials": "impersonated",
                    "google.auth.compute_engine.credentials": "the metadata server's",
                    "google.auth.credentials": "anonymous (MTPIPE_COMPUTE_ENDPOINT's loopback fakes)"}


def _credentials() -> tuple[str, GoogleApis]:
    """The Application Default Credentials load (google.auth.default); what they are."""
    apis = GoogleApis()
    module = type(apis.credentials).__module__
    email = getattr(apis.credentials, "service_account_email", None)
    return (CREDENTIAL_KINDS.get(module, module) + (f": {email}" if email and email != "default" else "")), apis


def check_settings(cfg: VmConfig, root: Path, experiments: list[list[str]]) -> None:
    """:func:`settings` alone, before any request; when one fails, every check that needs no cloud too
    (what needs one is not checked), then one error naming every failure."""
    run = Runner()
    apis = settings(run, cfg)
    if run.errors:
        check_all(run, cfg, root, experiments, settings_failed=True, apis=apis)
    run.raise_failures()


def check_all(run: Runner, cfg: VmConfig, root: Path, experiments: list[list[str]],
              client: Compute | None = None, act: bool = False, settings_failed: bool = False,
              apis: GoogleApis | None = None) -> tuple[VmConfig, list[identity.Target]]:
    """Every check, in the order the run would meet them. Returns ``cfg`` as the checks decided it (the
    Flex-start zones, OS Login and its user, the zones with quota) and the buckets only the VM can
    tell it may use (identity.probe_from_vm). ``client``: the zone's Compute client (made here when
    None). ``act``: vm_up's mode, which enables disabled APIs (enable_apis: true) and imports the SSH
    key into the OS Login profile; without it nothing is changed anywhere. ``settings_failed``:
    :func:`settings` ran in ``run`` already, and failed (``apis``: what it gave): what needs a cloud is not
    checked."""
    apis = apis if settings_failed else settings(run, cfg)
    run.check("route", lambda: vm_config.check_route(cfg))
    tpu_route = vm_config.route(cfg) == "tpu_api"
    if cfg.provisioning == "flex-start":
        cfg = run.check("Flex-start zones", lambda: _flex_start_zones(cfg)) or cfg
    run.check("gcloud", lambda: access.check_gcloud(cfg, apis), needs=("credentials",))
    if settings_failed:   # no request to Compute while a setting is wrong
        compute = run.skip("Compute", "not asked while a setting above fails")
    else:
        compute = run.check("Compute", lambda: _compute(cfg, client), needs=("PROJECT", "ZONE", "credentials"))
    compute_needs = ("Compute",)
    if tpu_route:
        run.check("machine type", lambda: _accelerator_type(cfg), needs=(*compute_needs, "route"))
    else:
        run.check("machine type", lambda: check_machine_type(cfg, compute)
                  or f"{cfg.zone} offers {cfg.machine_type}", needs=(*compute_needs, "route"))
    if cfg.provisioning == "reservation" and not tpu_route:
        run.check("reservation", lambda: check_reservation(cfg, compute)
                  or f"{cfg.reservation} has room for one {cfg.machine_type}", needs=(*compute_needs, "RESERVATION"))
    run.check("network", lambda: access.check_network(cfg, compute) or f"{cfg.network}"
              + (f", subnetwork {cfg.subnetwork}" if cfg.subnetwork else ""), needs=compute_needs)
    creates_rule = run.check("SSH route", lambda: _ssh_route(cfg, compute, apis), needs=("network",))
    cfg = run.check("OS Login", lambda: access.check_os_login(cfg, compute, apis, import_key=act),
                    needs=compute_needs) or cfg
    branches = run.check("presets", lambda: _presets(root, experiments), needs=("--set",))
    run.check("DVC remote", lambda: _dvc_remote(cfg, root), needs=("credentials",))
    uses_gcs = run.outcomes["DVC remote"].status == OK and bool(identity.targets(cfg, root))
    run.check("APIs", lambda: caller.check_apis(cfg, apis, caller.services(cfg, uses_gcs), enable=act),
              needs=compute_needs)
    run.check("permissions", lambda: caller.check_permissions(cfg, apis, caller.permissions(cfg, bool(creates_rule))),
              needs=(*compute_needs, "SSH route"))
    if tpu_route:   # the TPU API's own per-zone quotas, from Cloud Quotas
        cfg = run.check("zones and quota", lambda: quota.tpu_api_zones(cfg, apis), needs=("machine type",)) or cfg
    else:
        cfg = run.check("zones and quota", lambda: _zones(cfg, compute, apis), needs=("machine type",)) or cfg
    for constraint, check in (("compute.requireShieldedVm", org_policies.check_shielded_vm),
                              ("compute.trustedImageProjects", org_policies.check_trusted_images),
                              ("gcp.resourceLocations", org_policies.check_locations),
                              ("compute.requireOsLogin", org_policies.check_os_login_policy)):
        run.check(f"policy {constraint}", lambda check=check: check(cfg, apis), needs=compute_needs)
    unproven = run.check("VM's service account", lambda: _identity(cfg, root), needs=(*compute_needs, "DVC remote"))
    if tpu_route:   # the node's idle watch deletes it with that account's token
        run.check("node's self-delete", lambda: identity.check_node_self_delete(cfg), needs=compute_needs)
    for repo in hub_repos(branches or []):
        run.check(f"Hub {repo.repo_type} {repo.repo_id}", lambda repo=repo: check_hub_repo(repo))
    forecasts = run.check("preflight", lambda: _preflight(cfg, root, experiments), needs=("presets",))
    run.check("Spot run", lambda: _spot(cfg, forecasts or []))
    return cfg, unproven or []


def _flex_start_zones(cfg: VmConfig) -> tuple[str, VmConfig]:
    """A Flex-start VM's zones, each not known to grant it said (vm_config.flex_start_zones)."""
    zoned, warned = vm_config.flex_start_zones(cfg)
    return ("; ".join(warned) or f"{', '.join(vm_config.candidate_zones(zoned))} grant Flex-start "
            f"{cfg.machine_type} VMs"), zoned


def _zones(cfg: VmConfig, compute: Compute, apis: GoogleApis) -> tuple[str, VmConfig]:
    """The zones to try, each offering the machine type with quota in its region (check_zones)."""
    zoned = check_zones(cfg, compute, apis)
    return f"trying {', '.join(zoned.zones or [])}", zoned


def _compute(cfg: VmConfig, client: Any) -> tuple[str, Compute]:
    """The first authenticated Compute call (projects.get): the credentials and the project work. ``client``:
    the lifecycle's provider, used when it is Compute Engine's (the TPU API route's reads the network here)."""
    compute = client if isinstance(client, Compute) else Compute(cfg.project, cfg.zone, float(cfg.operation_timeout_s))
    compute.project_metadata()
    return f"project {cfg.project} answers", compute


def _accelerator_type(cfg: VmConfig) -> str:
    """The Cloud TPU API offers the VM's accelerator type in its zone (acceleratorTypes.get)."""
    name = vm_config.accelerator_type(cfg)
    if TpuClient(cfg.project, cfg.zone, float(cfg.operation_timeout_s)).accelerator_type(name) is None:
        raise ConfigError("vm.zone", f"the Cloud TPU API offers no {name} ({cfg.machine_type}) in {cfg.zone}",
                          f"use a zone that does: gcloud compute tpus accelerator-types list --zone ZONE "
                          f"--project {cfg.project}")
    return f"the Cloud TPU API offers {name} in {cfg.zone}"


def _ssh_route(cfg: VmConfig, compute: Compute, apis: GoogleApis) -> tuple[str, bool]:
    """An external IP (allowed by the organisation) or IAP (gcloud as the credentials' account, a
    Cloud NAT), then a firewall rule for SSH; whether vm_up creates its own rule."""
    access.check_external_ip(cfg, compute, apis)
    creates_rule = access.check_firewall(cfg, compute)
    how = "the VM's external IP" if cfg.external_ip else "IAP's tunnel"
    rule = f"vm_up creates firewall rule {cfg.firewall.name}" if creates_rule else "a firewall rule admits it"
    return f"SSH through {how}; {rule}", creates_rule


def _presets(root: Path, experiments: list[list[str]]) -> tuple[str, list]:
    """Every branch of every experiment composes (HEAD's params.yaml with its --set values)."""
    branches = [branch for sets in experiments for branch in composed_branches(root, sets).values()]
    presets = sorted({f"{b.branch} ({b.model.name} on {b.hardware.name})" for b in branches})
    return f"{len(experiments)} experiment(s) compose: {', '.join(presets)}", branches


def _dvc_remote(cfg: VmConfig, root: Path) -> str:
    name, remote = identity.shipped_remote(root)
    check_remote_writable(root, float(cfg.remote_probe_timeout_s))
    return f"{name} ({remote['url']}) is HEAD's and accepts a write"


def _identity(cfg: VmConfig, root: Path) -> tuple[str, list[identity.Target]]:
    unproven = identity.check_identity(cfg, root)
    if unproven:
        return f"the VM tries {', '.join(t.url for t in unproven)} itself, right after SSH", unproven
    return "may use every bucket the run needs (as the allow policies readable here show)", unproven


def _preflight(cfg: VmConfig, root: Path, experiments: list[list[str]]) -> tuple[str, list[dict[str, Any]]]:
    """Whether preflight has a cached compile of each TPU branch, and whether it fits (nothing compiles)."""
    rows, not_compiled = cached_forecasts(cfg, root, experiments)
    for row in rows:
        preflight.check_fits(row)
    said = [f"{r['branch']} ({r['preset']}) fits: {r['hbm_gib_per_chip']:.1f} of {r['hbm_gib_available']} GiB HBM "
            f"per chip, training about {r['est_train_s'] / 60:.0f} min (`doit preflight`: the whole run)" for r in rows]
    if not_compiled:
        said.append(f"not compiled yet: {', '.join(not_compiled)} (vm_run compiles it first, minutes per shape; "
                    "or `doit preflight --set ...`)")
    return "; ".join(said) or "no branch trains on a TPU", rows


def _spot(cfg: VmConfig, forecasts: list[dict[str, Any]]) -> str:
    """A Spot run can resume after a preemption (check_spot_resume): conf/vm.yaml decides."""
    check_spot_resume(cfg, forecasts)
    if cfg.provisioning != "spot":
        return f"not a Spot run ({cfg.provisioning})"
    return "training resumes from the work bucket" if not cfg.spot_without_work_bucket else \
        "spot_without_work_bucket: true: each preemption restarts training"


def before_spending(cfg: VmConfig, compute: Compute, root: Path,
                    experiments: list[list[str]]) -> tuple[VmConfig, list[identity.Target]]:
    """vm_up's and vm_run's checks before the first insert: every check, each line printed, then one
    error listing every failure; returns ``cfg`` as the checks decided it and the buckets only the VM
    can tell it may use."""
    run = Runner(_say)
    checked = check_all(run, cfg, root, experiments, compute, act=True)
    run.raise_failures()
    return checked


def check_everything(params: dict[str, Any], sets: list[str], queue: bool,
                     load: Callable[[dict[str, Any]], VmConfig] = vm_config.load_config) -> None:
    """`doit check`: every check of a vm_run with these options (``params``: doit's target options;
    ``load``: how they make the VM's config, the rehearsal's or the real run's), one line each; a
    ConfigError when any fails. Nothing is created or changed. A config with wrong values gets a line
    for each (with where it came from), and the presets are still composed."""
    from mtpipe.cloud.on_vm import dvc_experiments

    run, root = Runner(_say), dvc_experiments.repo_root()
    cfg = run.check("VM config", lambda: ("loads", load(params)))
    experiments = run.check("--set", lambda: _experiments(sets, queue))
    if cfg is None:
        run.check("presets", lambda: _presets(root, experiments or [[]]), needs=("--set",))
        run.check("the other checks", lambda: None, needs=("VM config",))
    else:
        check_all(run, cfg, root, experiments or [[]])
    counts = {status: sum(o.status == status for o in run.outcomes.values())
              for status in (OK, FAILS, UNKNOWN, NOT_CHECKED)}
    _say(", ".join(f"{n} {status}" for status, n in counts.items()) + "; nothing was created")
    if counts[FAILS]:
        raise ConfigError("doit check", f"{counts[FAILS]} of {len(run.outcomes)} checks failed (the FAILS lines above)",
                          "each line's Fix, then `doit check` again")


def _experiments(sets: list[str], queue: bool) -> tuple[str, list[list[str]]]:
    from mtpipe.cloud.on_vm import dvc_experiments

    experiments = dvc_experiments.experiments(sets, queue)
    return f"{len(experiments)} experiment(s): " + "; ".join(" ".join(e) or "params.yaml as committed"
                                                              for e in experiments), experiments
