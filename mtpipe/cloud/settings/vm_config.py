"""conf/vm.yaml: its schema (`VmConfig`), how it is assembled from the file, the environment and
doit's parameters into a frozen `VmConfig`, the one place its zone changes (:func:`in_zone`), and the
VM's errors."""

from __future__ import annotations

import getpass
import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from annotated_types import Ge, Gt, Le
from omegaconf import OmegaConf
from pydantic import model_validator

from mtpipe.cloud.settings import prices
from mtpipe.cloud.settings.vm_env import CONFIG_ENV, ENV_KEYS
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations
from mtpipe.pipeline.schema import KEEP_INT, PositiveInt, Section, validate
from mtpipe.planning.budget import Machine

ROOT = Path(__file__).resolve().parents[3]
PROVISIONING = ("reservation", "spot", "on-demand", "flex-start")   # how the VM is paid for (conf/vm.yaml)
# Compute runs a Flex-start VM at most seven days (cloud.google.com/compute/docs/instances/about-flex-start-vms)
FLEX_START_MAX_RUN_S = 7 * 24 * 3600
ZONE_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z0-9]+$")   # us-east5-b, europe-west4-a
RESERVATION_MODELS = ("auto", "bound", "standard")    # how a reservation's VMs are provisioned
# A reservation named as reservationAffinity.values names a shared one: another project's.
SHARED_RESERVATION = re.compile(r"projects/(?P<project>[^/]+)/reservations/(?P<name>[^/]+)")
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")   # Compute's resource names (RFC 1035)
NAME_MAX = 63
LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_VALUE_RE = re.compile(r"^[a-z0-9_-]{0,63}$")
# Compute Engine's bounds on params.requestValidForDuration (a Flex-start insert's wait for capacity):
# it refuses values outside 90-7200 s (the error text public Flex-start reports quote)
FLEX_START_WAIT_S = (90, 7200)
# The two ways to create the VM (conf/vm.yaml `route:`, :func:`route`): Compute Engine's instances.insert,
# or the Cloud TPU API's queued resources (tpu.googleapis.com/v2). null: by machine type, a generation
# Compute Engine refuses (conf/generations.yaml compute.refused) taking the TPU API, every other Compute
# Engine (docs/vm-provisioning.md, "Two routes").
ROUTES = ("compute", "tpu_api")


class VmError(RuntimeError):
    """A failure on or reaching the VM, worded for the user."""


class ConfigErrors(ConfigError):
    """Several wrong values found at once (:attr:`errors`: a ConfigError each), one line each."""

    def __init__(self, errors: list[ConfigError]) -> None:
        super().__init__("vm", f"{len(errors)} values are wrong", "each fix")
        self.errors = errors

    def __reduce__(self) -> tuple[type, tuple[list[ConfigError]]]:
        return ConfigErrors, (self.errors,)

    def __str__(self) -> str:
        return f"{len(self.errors)} values are wrong:\n" + "\n".join(f"  - {e}" for e in self.errors)


class SessionLost(VmError):
    """The SSH session broke before the command ended (the VM went away, or the network)."""


class VmLost(VmError):
    """The VM was lost (preempted, stopped, gone) more often than `max_recoveries` allows."""


Seconds = Annotated[float, Gt(0), KEEP_INT]


class Firewall(Section):
    name: Optional[str]                    # null = <name>-ssh
    source_ranges: Optional[list[str]]     # null = IAP's range through IAP, else a rule open to 0.0.0.0/0


class Ssh(Section):
    user: str
    key_file: str
    port: Annotated[int, Ge(1), Le(65535)]
    proxy_command: Optional[str]           # null = the VM's external IP, or IAP without one
    os_login: Union[bool, Literal["auto"]]  # auto: as the project metadata and org policy say
    os_login_account: Optional[str]        # null = the account of the Google credentials
    connect_timeout_s: Seconds
    keepalive_s: Seconds
    ready_timeout_s: Seconds


class Setup(Section):
    files: list[str]
    commands: list[str]
    marker: str
    apt_lock_timeout_s: Annotated[float, Ge(0), KEEP_INT]   # how long apt_get waits for the package lock


class Idle(Section):
    delete_after_s: Annotated[int, Ge(0)]  # 0: the VM never deletes itself when idle
    poll_s: Seconds
    lock_file: str                         # held (flock -s) by every command vm_run sends
    poweroff_command: str                  # run as root when the VM's account may not delete it


class Run(Section):
    remote_dir: str
    command: str
    tpu_check: str                         # {check}: mtpipe.maxtext.tpu_check's command line
    hardware: Optional[str]                # conf/hardware/<this>.yaml
    env: dict[str, str]
    secrets: list[str]


class Stockout(Section):
    retry_for_s: Annotated[float, Ge(0), KEEP_INT]   # how long to retry the zones; 0: try each once
    first_wait_s: Annotated[float, Gt(0), KEEP_INT]  # the first wait, doubled each time (at most 300 s)


class FlexStart(Section):
    request_valid_for_s: Seconds           # params.requestValidForDuration: how long Compute looks for capacity
    poll_s: Seconds                        # how often vm_up looks at a PENDING VM (and says it still waits)


class TpuApi(Section):
    runtime_version: Optional[str]         # the node's runtimeVersion; null: the generation's (conf/generations.yaml)
    valid_for_s: Seconds                   # queueingPolicy.validUntilDuration: how long the queue may wait
    poll_s: Seconds                        # how often vm_up looks at a waiting queued resource (and says so)


class VmConfig(Section):
    """conf/vm.yaml as :func:`load_config` assembles it (the file's comments say what each key does).

    ``project``, ``zone`` and ``reservation`` may stay null until a task needs them (:func:`require`)."""

    project: Optional[str]
    zone: Optional[str]                    # the VM's zone; null: the first of zones (then the one it is in)
    zones: Optional[list[str]]             # the zones to create the VM in, tried in order; null: [zone]
    provisioning: str                      # one of PROVISIONING, checked below with the flag to pass
    reservation: Optional[str]             # NAME, or projects/OTHER/reservations/NAME (shared)
    reservation_model: str                 # one of RESERVATION_MODELS, checked below
    name: str
    network: str
    subnetwork: Optional[str]              # null = the auto-mode network's subnetwork of the region
    external_ip: bool                      # false: no external IP, SSH through IAP
    machine_type: str
    route: Optional[str]                   # compute | tpu_api; null: by machine type (:func:`route`)
    tpu_api: TpuApi                        # the Cloud TPU API route's queued resource
    image_project: str
    image_family: str
    boot_disk_gb: PositiveInt
    boot_disk_type: str                    # a Compute disk type, one the generation boots from (conf/generations.yaml)
    service_account: str
    scopes: list[str]
    max_run_duration_s: int                # 0 disables it
    idle: Idle                             # mtpipe.cloud.providers.gcp.idle_watch
    labels: dict[str, str]
    max_recoveries: int
    spot_without_work_bucket: bool         # true: a Spot run may restart training after each preemption
    budget_usd: Optional[Annotated[float, Gt(0)]]   # vm_run's notice when the run's VMs cost more; null: none
    stockout: Stockout
    flex_start: FlexStart
    operation_timeout_s: Seconds
    recreate: bool
    enable_apis: bool                      # vm_up enables the APIs the run needs that are disabled
    remote_probe_timeout_s: Seconds
    firewall: Firewall
    ssh: Ssh
    setup: Setup
    run: Run

    @model_validator(mode="after")
    def check_values(self) -> VmConfig:
        """Every rule of several keys, each broken one named (:class:`ConfigErrors` when several are)."""
        found = self.problems()
        if len(found) > 1:
            raise ConfigErrors(found)
        if found:
            raise found[0]
        return self

    def problems(self) -> list[ConfigError]:
        """What is wrong with the values, one ConfigError each (the key, the problem, the fix)."""
        found: list[ConfigError] = []
        if self.provisioning not in PROVISIONING:
            found.append(ConfigError("vm.provisioning", f"{self.provisioning!r} is not one of "
                                     f"{', '.join(PROVISIONING)}",
                                     "pass --provisioning=spot (or reservation, on-demand, flex-start), or set "
                                     "provisioning: in conf/vm.yaml"))
        try:
            self.check_zones()
        except ConfigError as err:
            found.append(err)
        if self.route is not None and self.route not in ROUTES:
            found.append(ConfigError("vm.route", f"{self.route!r} is not one of {', '.join(ROUTES)}",
                                     "set route: compute (Compute Engine), tpu_api (the Cloud TPU API's queued "
                                     "resources) or null (by machine type) in conf/vm.yaml"))
        if self.provisioning == "flex-start" and not 0 < self.max_run_duration_s <= FLEX_START_MAX_RUN_S:
            found.append(ConfigError("vm.max_run_duration_s", f"is {self.max_run_duration_s} with provisioning: "
                                     "flex-start, which Compute runs for a limited time only (its maxRunDuration, at "
                                     "most 7 days)", f"set max_run_duration_s between 1 and {FLEX_START_MAX_RUN_S} in "
                                     "conf/vm.yaml (Compute deletes the VM then)"))
        low, high = FLEX_START_WAIT_S
        if not low <= self.flex_start.request_valid_for_s <= high:
            found.append(ConfigError("vm.flex_start.request_valid_for_s", f"is {self.flex_start.request_valid_for_s:g} "
                                     f"s, and Compute takes a request window (requestValidForDuration) of {low}-{high} "
                                     f"s only", f"set flex_start.request_valid_for_s between {low} and {high} in "
                                     "conf/vm.yaml"))
        if problem := name_problem(self.name):
            found.append(ConfigError("vm.name", f"{self.name!r} {problem}",
                                     f"use at most {NAME_MAX - len('-ssh')} lowercase letters, digits and dashes, "
                                     "starting with a letter (NAME / --name; the firewall rule adds -ssh)"))
        elif self.firewall.name and (problem := name_problem(self.firewall.name)):
            found.append(ConfigError("vm.firewall.name", f"{self.firewall.name!r} {problem}",
                                     f"use a NAME of at most {NAME_MAX - len('-ssh')} characters, or set "
                                     "firewall.name: in conf/vm.yaml"))
        for cidr in self.firewall.source_ranges or []:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                found.append(ConfigError("vm.firewall.source_ranges", f"{cidr!r} is not an address range",
                                         "write ranges as ADDRESS/BITS, e.g. 203.0.113.7/32"))
        for key, value in self.labels.items():
            if not (LABEL_KEY_RE.match(key) and LABEL_VALUE_RE.match(value)):
                found.append(ConfigError(f"vm.labels.{key}", f"{key}={value!r} is not a Compute label",
                                         "keys: a lowercase letter, then up to 62 lowercase letters, digits, "
                                         "_ or -; values: up to 63 of those (conf/vm.yaml labels:)"))
        if self.reservation_model not in RESERVATION_MODELS:
            found.append(ConfigError("vm.reservation_model", f"{self.reservation_model!r} is not one of "
                                     f"{', '.join(RESERVATION_MODELS)}",
                                     "set reservation_model: auto (decided from the reservation), bound or "
                                     "standard in conf/vm.yaml"))
        if self.reservation and not (NAME_RE.match(self.reservation)
                                     or SHARED_RESERVATION.fullmatch(self.reservation)):
            found.append(ConfigError("vm.reservation", f"{self.reservation!r} is neither a reservation name nor "
                                     "projects/PROJECT/reservations/NAME",
                                     "pass the name of a reservation of this project, or that form for one "
                                     "another project shares with it (RESERVATION / --reservation)"))
        if self.max_run_duration_s < 0:
            found.append(ConfigError("vm.max_run_duration_s", "is negative", "use seconds, or 0 to disable"))
        if self.max_recoveries < 0:
            found.append(ConfigError("vm.max_recoveries", "is negative", "use 0 (never recreate a lost VM) or more"))
        try:
            gen, _ = generations.of_machine_type(self.machine_type)
        except ConfigError as err:
            found.append(err)
            return found
        disks = gen.compute.boot_disks
        if disks is not None and self.boot_disk_type not in disks:
            found.append(ConfigError("vm.boot_disk_type", f"{self.boot_disk_type!r} cannot be the boot disk of a "
                                     f"{self.machine_type} VM ({gen.title} boots from {', '.join(disks)} only: "
                                     f"{generations.TABLE_NAME})", f"set boot_disk_type: {disks[0]} in conf/vm.yaml"))
        return found

    def check_zones(self) -> None:
        """``zones`` holds zone names, each once; a reservation, which is in one zone, gets one."""
        zones = self.zones or []
        for zone in [self.zone or "", *zones]:
            if zone and not ZONE_RE.match(zone):
                raise ConfigError("vm.zones" if zone in zones else "vm.zone", f"{zone!r} is not a zone name",
                                  "name zones as Compute does, e.g. us-east5-b (REGION-LETTER)")
        if len(set(zones)) < len(zones):
            raise ConfigError("vm.zones", f"{list(zones)} names a zone twice", "list each zone once")
        if self.provisioning == "reservation" and len(zones) > 1:
            raise ConfigError("vm.zones", f"lists {len(zones)} zones with provisioning: reservation, and a "
                              "reservation is in one zone", "set zones: [ITS_ZONE] (or zone:), or use "
                              "--provisioning=spot, on-demand or flex-start to fail over across zones")


def load_config(params: dict[str, Any] | None = None, state: dict | None = None) -> VmConfig:
    """conf/vm.yaml < $MTPIPE_VM_CONFIG < env PROJECT/ZONE/RESERVATION/NAME < doit params, checked
    against :class:`VmConfig` and frozen: a later change is a new config (``model_copy``). Every wrong
    value is named at once (:class:`ConfigErrors` when several are), each with where it came from.

    `project` and `name`, still unset after that, are filled from the state file (the VM vm_up
    created), then `name` defaults to mtpipe-<user>; the zone is :func:`first_zone`'s (a `zone` given
    alongside `zones` must be one of them). `provisioning` is the recorded VM's unless a doit param
    sets it, so that reusing or replacing that VM keeps its kind (and its price), and so is its OS
    Login user (:func:`use_recorded_login`).
    """
    raw = OmegaConf.load(ROOT / "conf" / "vm.yaml")
    sources: dict[str, str] = {}   # dotted key -> where its value came from (else conf/vm.yaml)
    overlay = os.environ.get(CONFIG_ENV)
    if overlay:
        layer = OmegaConf.load(overlay)
        raw = OmegaConf.merge(raw, layer)
        sources |= dict.fromkeys(_dotted(OmegaConf.to_container(layer)), f"{overlay} (${CONFIG_ENV})")
    for key, var in ENV_KEYS.items():
        if os.environ.get(var):
            raw[key], sources[key] = os.environ[var], f"{var} in the environment"
    for key, value in (params or {}).items():
        if value not in (None, ""):
            OmegaConf.update(raw, key, value)
            sources[key] = f"--{key}" if key in (*ENV_KEYS, "provisioning") else f"the task's {key}"
    for key in ("project", "name"):
        if not raw[key] and state and state.get(key):
            raw[key], sources[key] = state[key], RECORD
    if not raw.name:
        raw.name = "mtpipe-" + label_value(getpass.getuser()).replace("_", "-")[:40]
    recorded = bool(state) and state.get("name") == raw.name
    if not (params or {}).get("provisioning") and recorded:
        raw.provisioning = state.get("provisioning", raw.provisioning)   # the recorded VM's kind
        sources["provisioning"] = RECORD
    if not raw.firewall.name:
        raw.firewall.name = f"{raw.name}-ssh"
        sources["firewall.name"] = f"name, from {sources.get('name', 'conf/vm.yaml')}"
    try:
        cfg = validate(VmConfig, OmegaConf.to_container(raw), "vm",
                       lambda key, requirement: f"set {key.removeprefix('vm.')} {requirement} in conf/vm.yaml")
        if cfg.zones and cfg.zone and cfg.zone not in cfg.zones:
            raise ConfigError("vm.zone", f"{cfg.zone!r} (ZONE / --zone) is not one of zones: {list(cfg.zones)}",
                              "unset ZONE / --zone to try zones in order, or add it to zones: in conf/vm.yaml")
        prices.mode_prices(cfg)   # conf/prices.yaml prices this machine type in this mode (its region: vm_rate)
    except ConfigError as err:
        raise sourced(err, sources, overlay) from None
    zone = first_zone(cfg, state or {})
    if zone:
        cfg = in_zone(cfg, zone)
    if recorded:
        cfg = use_recorded_login(cfg, state or {})
    return cfg


RECORD = ".vm_state.json (the VM vm_up recorded)"   # a value's source: the state file


def _dotted(tree: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a nested dict's leaves (and of its sections)."""
    if not isinstance(tree, dict):
        return [prefix] if prefix else []
    return [key for name, value in tree.items()
            for key in ([f"{prefix}{name}"] + _dotted(value, f"{prefix}{name}."))]


def sourced(err: ConfigError, sources: dict[str, str], overlay: str | None) -> ConfigError:
    """``err`` (each of :class:`ConfigErrors`) saying where its value came from (``sources``: the dotted key,
    or a section above it; else conf/vm.yaml); a fix that names conf/vm.yaml names the overlay file
    instead where the value came from that file."""
    if isinstance(err, ConfigErrors):
        return ConfigErrors([sourced(e, sources, overlay) for e in err.errors])
    key = err.key.removeprefix("vm.")
    while key and key not in sources:
        key = key.rpartition(".")[0]
    source = sources.get(key, "conf/vm.yaml")
    fix = err.fix.replace("conf/vm.yaml", overlay) if overlay and source.startswith(overlay) else err.fix
    return ConfigError(err.key, f"{err.problem} (from {source})", fix)


def first_zone(cfg: VmConfig, state: dict) -> str | None:
    """The zone a loaded config starts in: the recorded VM's when it is one of ``zones`` (whichever
    ZONE / --zone says to try first), else ZONE / --zone / conf/vm.yaml's ``zone``, else the zone the
    state file records, else the first of ``zones``."""
    recorded = state.get("zone")
    if (recorded and recorded in (cfg.zones or [])
            and (state.get("project"), state.get("name")) == (cfg.project, cfg.name)):
        return recorded
    return cfg.zone or recorded or (cfg.zones[0] if cfg.zones else None)


def in_zone(cfg: VmConfig, zone: str, zones: list[str] | None = None) -> VmConfig:
    """``cfg`` in ``zone`` (and, given ``zones``, trying those): the one place a config's zone changes,
    as a new config (loading, Flex-start's zones, the quota check's usable zones, the failover)."""
    return cfg.model_copy(update={"zone": zone, **({"zones": list(zones)} if zones is not None else {})})


def candidate_zones(cfg: VmConfig) -> list[str]:
    """The zones a VM may be created in, in the order they are tried: ``zone`` (the first of ``zones``,
    the one a VM was last in, or ZONE / --zone) first, then the rest of ``zones``."""
    return [cfg.zone, *(z for z in cfg.zones or [] if z != cfg.zone)] if cfg.zone else list(cfg.zones or [])


def use_recorded_login(cfg: VmConfig, state: dict) -> VmConfig:
    """``cfg`` logging in as the VM ``state`` records was created for: its OS Login POSIX user, if it
    has one (the checks that found it run only before a VM is created)."""
    if state.get("os_login") and cfg.ssh.os_login is not False:
        return with_login(cfg, True, state["ssh_user"])
    return cfg


def with_login(cfg: VmConfig, os_login: bool, user: str | None = None) -> VmConfig:
    """``cfg`` with OS Login decided (``ssh.os_login``) and, given one, the POSIX user SSH logs in as."""
    ssh = cfg.ssh.model_copy(update={"os_login": os_login, **({"user": user} if user else {})})
    return cfg.model_copy(update={"ssh": ssh})


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a Compute resource (a VM, a firewall rule), or None."""
    if len(name) > NAME_MAX:
        return f"has {len(name)} characters; Compute allows at most {NAME_MAX}"
    if not NAME_RE.match(name):
        return ("is not a Compute resource name (lowercase letters, digits and dashes, starting with a "
                "letter, not ending with a dash)")
    return None


def label_value(text: str) -> str:
    """A Compute label value: lowercase letters, digits, dashes and underscores, 63 at most."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def require(cfg: VmConfig, *keys: str) -> None:
    """Fail early, naming the key and the fix, when a value needed to reach Compute is missing."""
    for key in keys:
        if not getattr(cfg, key):
            var = ENV_KEYS[key]
            raise ConfigError(f"vm.{key}", "is not set",
                              f"export {var}=... or pass `--{key} ...` (or set {key}: in conf/vm.yaml)")


def check_create(cfg: VmConfig) -> tuple[VmConfig, list[str]]:
    """The settings vm_up needs, before any request (mtpipe.cloud.checks asks Compute about the rest): the
    machine type on a route that creates it (:func:`check_route`), the required keys, a Flex-start
    VM's zones (:func:`flex_start_zones`). Returns the config and what to say about zones not known to
    grant Flex-start."""
    check_route(cfg)
    reservation = ["reservation"] if cfg.provisioning == "reservation" else []
    require(cfg, "project", "zone", *reservation, "name")
    return flex_start_zones(cfg)


def route(cfg: VmConfig) -> str:
    """How the VM is created, decided here only: conf/vm.yaml's ``route`` when set, else by machine type:
    a generation Compute Engine refuses (its ``compute.refused`` in conf/generations.yaml) takes the Cloud
    TPU API (``tpu_api``), every other Compute Engine (``compute``; one the TPU API offers may take either)."""
    if cfg.route:
        return str(cfg.route)
    return "tpu_api" if generations.of_machine_type(cfg.machine_type)[0].compute.refused else "compute"


def accelerator_type(cfg: VmConfig) -> str:
    """The Cloud TPU API's acceleratorType of ``machine_type`` (the generation's accelerator type of
    its chips, conf/generations.yaml)."""
    gen, chips = generations.of_machine_type(cfg.machine_type)
    return gen.accelerator_type(chips)


def runtime_version(cfg: VmConfig) -> str:
    """The TPU VM image of a node: ``tpu_api.runtime_version``, else the generation's (conf/generations.yaml)."""
    gen, _ = generations.of_machine_type(cfg.machine_type)
    return cfg.tpu_api.runtime_version or (gen.tpu_api.runtime_version if gen.tpu_api else "")


def check_route(cfg: VmConfig) -> str:
    """The route of the VM (:func:`route`) checked before any request, said in a line: a machine type
    Compute Engine lists but does not create (``compute.refused`` in conf/generations.yaml) is refused on
    the Compute route, naming ``route: tpu_api``; the TPU API route takes the generations it offers
    (``tpu_api`` there), not Flex-start (a Compute Engine provisioning model)."""
    gen, chips = generations.of_machine_type(cfg.machine_type)
    tpu = gen.name
    if route(cfg) == "tpu_api":
        if gen.tpu_api is None:
            offered = ", ".join(g.title for g in generations.load().values() if g.tpu_api)
            raise ConfigError("vm.route", f"tpu_api creates {offered} VMs, not {cfg.machine_type} ({tpu}: "
                              f"{generations.TABLE_NAME})", "set route: compute (or null) in conf/vm.yaml")
        if cfg.provisioning == "flex-start":
            version = gen.tpu_api.flex_start_version
            offered = (f"the Cloud TPU API offers it in {version} only (a queued resource's provisioningModel "
                       f"FLEX_START), and route tpu_api speaks v2") if version else \
                f"the Cloud TPU API offers no Flex-start {tpu} node ({generations.TABLE_NAME})"
            raise ConfigError("vm.provisioning", f"flex-start on route tpu_api: {offered}; nothing was requested",
                              "use --provisioning=spot, on-demand or reservation (the queued resource waits for "
                              "capacity by itself, tpu_api.valid_for_s), or route: compute where the generation "
                              "offers Flex-start there")
        return (f"the Cloud TPU API creates {accelerator_type(cfg)} ({cfg.machine_type}) as a queued resource "
                f"(route: tpu_api{'' if cfg.route else ', by machine type'}), runtime {runtime_version(cfg)}")
    if not gen.compute.refused:
        return f"Compute Engine creates {cfg.machine_type}"
    accelerator = gen.accelerator_type(chips)
    by_hand = (f"; by hand: `gcloud compute tpus tpu-vm create NAME --zone ZONE --accelerator-type={accelerator} "
               f"--version {gen.tpu_api.runtime_version}`") if gen.tpu_api else ""
    others = ", ".join(g.machine_type(g.chips_per_host) for g in generations.load().values()
                       if not g.compute.refused)
    raise ConfigError(
        "vm.machine_type", f"{cfg.machine_type} ({tpu}) cannot be created on Compute Engine, the route vm_up "
        f"takes with route: compute: {gen.compute.refused.format(machine_type=cfg.machine_type)}, even for a project holding {tpu} "
        "quota (docs/vm-provisioning.md, \"What Google refuses\"); nothing was requested",
        f"set route: tpu_api (or null: by machine type) in conf/vm.yaml: vm_up then creates the {tpu} VM through the "
        f"Cloud TPU API as a queued resource (`gcloud compute tpus queued-resources create`, accelerator type "
        f"{accelerator}{by_hand}); or a machine type Compute Engine creates ({others}), or GKE "
        f"through xpk (a branch's hardware preset with backend: xpk); `doit preflight` still forecasts a {tpu} run "
        f"(conf/hardware/{gen.maxtext_topology(chips)}.yaml)")


def flex_start_zones(cfg: VmConfig) -> tuple[VmConfig, list[str]]:
    """A line for each of a Flex-start VM's zones that is not among those known to grant its TPU family
    Flex-start VMs (conf/generations.yaml ``compute.flex_start_zones``): the list is what public runs and
    Google's page show, not all Google grants, so such a zone is tried all the same, in its turn. Returns
    ``cfg`` unchanged and those lines (nothing for other modes, and for a generation with no zones listed)."""
    known = generations.of_machine_type(cfg.machine_type)[0].compute.flex_start_zones
    if cfg.provisioning != "flex-start" or not known:
        return cfg, []
    return cfg, [f"zone {z} is not among those known to grant Flex-start {cfg.machine_type} VMs ({', '.join(known)}: "
                 f"{generations.TABLE_NAME}); trying it all the same" for z in candidate_zones(cfg) if z not in known]


def budget_machine(cfg: VmConfig) -> Machine:
    """What the machine budget (mtpipe.planning.budget) reads of a loaded VM config: the boot disk's size,
    the run's environment and the TPU its machine type holds."""
    gen, chips = generations.of_machine_type(cfg.machine_type)
    return Machine(int(cfg.boot_disk_gb), {str(k): str(v) for k, v in cfg.run.env.items()}, gen.maxtext_topology(chips))
