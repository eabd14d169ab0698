"""doit tasks around the DVC pipeline: create, set up, use and delete the TPU v6e-8 VM.

    doit vm_up [--project P --zone Z --reservation R --name N]   (or env PROJECT/ZONE/RESERVATION/NAME)
               [--provisioning reservation|spot|on-demand]
    doit vm_run [--set=steps=2000 ...] [--exp-name NAME] [--target STAGE] [--keep] [--down] [--recreate]
                [--queue --set=steps=500 --set=steps=1000 ...] [--provisioning spot]
    doit vm_setup        doit vm_status       doit vm_shell        doit vm_down

vm_run creates and sets up the VM itself when needed; each run is a DVC experiment (`dvc exp show`);
a VM lost during the run (Spot preemption) is replaced up to `max_recoveries` times.

Configuration: conf/vm.yaml; what vm_up created: .vm_state.json; docs/tpu-vm.md explains it all.
"""

from __future__ import annotations

import functools
import getpass
import itertools
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from doit.exceptions import TaskFailed
from google.cloud import compute_v1
from omegaconf import DictConfig

from mtpipe.maxtext import preflight as preflight_checks
from mtpipe.cloud import vm, vm_checks
from mtpipe.errors import ConfigError
from mtpipe.cloud.gcp import Compute, GcpError, external_ip, firewall_body, instance_body

DOIT_CONFIG = {"default_tasks": ["vm_status"], "verbosity": 2, "backend": "json",
               "dep_file": ".doit.db.json"}

TARGET_PARAMS = [
    {"name": key, "long": key, "type": str, "default": None,
     "help": f"{key} (else env {var}, else conf/vm.yaml, else .vm_state.json)"}
    for key, var in vm.ENV_KEYS.items()
]
KEEP = {"name": "keep", "long": "keep", "type": bool, "default": False,
        "help": "keep the VM when this task fails or is interrupted"}
PROVISIONING = {"name": "provisioning", "long": "provisioning", "type": str, "default": None,
                "help": "reservation | spot | on-demand (else conf/vm.yaml's provisioning; vm_run: "
                        "the recorded VM's)"}


def _task_action(fn: Callable[..., None]) -> Callable[..., TaskFailed | None]:
    """Report our own errors as one clear doit failure instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> TaskFailed | None:
        try:
            fn(**kwargs)
        except (ConfigError, GcpError, vm.VmError) as e:
            return TaskFailed(f"{type(e).__name__}: {e}")
        return None

    return wrapper


def _target(params: dict[str, Any]) -> tuple[Path, dict, DictConfig]:
    root = vm.repo_root()
    state = vm.read_state(root)
    return root, state, vm.load_config(params, state)


def _compute(cfg: DictConfig) -> Compute:
    vm.require(cfg, "project", "zone")
    return Compute(cfg.project, cfg.zone, float(cfg.operation_timeout_s))


def _remote(cfg: DictConfig, state: dict) -> vm.Remote:
    """How to reach the recorded VM, after checking with Compute that it still exists."""
    instance = _compute(cfg).get_instance(cfg.name)
    if instance is None:
        raise vm.VmError(f"VM {cfg.name} does not exist in {cfg.project}/{cfg.zone} (deleted, or "
                         "max_run_duration_s ran out): create it with `doit vm_up`")
    ip = external_ip(instance)
    if not ip and not cfg.ssh.proxy_command:
        raise vm.VmError(f"VM {cfg.name} has no external IP: set ssh.proxy_command (IAP) in "
                         "conf/vm.yaml")
    host_key = state.get("host_key") if state.get("name") == cfg.name else None
    return vm.Remote.from_config(cfg, ip or cfg.name, host_key)


def spend_line(state: dict) -> str:
    """What the VMs of this run (the one recorded, and those it replaced) cost so far."""
    count, hours, usd = vm.spend(state)
    replaced = f", {count - 1} of them replaced after being lost" if count > 1 else ""
    return f"this run's VMs: {count}{replaced}; {hours:.2f} h in all, about {usd:.2f} USD"


def delete_all(cfg: DictConfig, root: Path) -> None:
    """Delete the VM and its firewall rule (each may already be gone); forget the state."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not stop this
    try:
        compute = _compute(cfg)
        gone = compute.delete_instance(cfg.name)
        print(f"mtpipe: VM {cfg.name}: {'deleted' if gone else 'already gone'}", flush=True)
        gone = compute.delete_firewall(cfg.firewall.name)
        print(f"mtpipe: firewall rule {cfg.firewall.name}: {'deleted' if gone else 'already gone'}",
              flush=True)
        state = vm.read_state(root)
        if state.get("vms") and state.get("name") == cfg.name:
            vm.vm_ended(state, "deleted")
            print(f"mtpipe: {spend_line(state)}", flush=True)
        vm.clear_state(root)
    finally:
        signal.signal(signal.SIGINT, previous)


def _guarded(cfg: DictConfig, root: Path, keep: bool, body: Callable[[], None]) -> None:
    """Run body; on any failure, Ctrl-C or SIGTERM/SIGHUP delete the VM unless --keep (a VM lost
    more often than max_recoveries is deleted anyway: a preempted VM cannot be restarted)."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        body()
    except BaseException as e:
        if keep and not isinstance(e, vm.VmLost):
            print(f"mtpipe: failed; VM {cfg.name} kept (--keep): `doit vm_down` deletes it",
                  flush=True)
        else:
            why = "a lost VM cannot be restarted" if keep else "use --keep to keep it"
            print(f"mtpipe: failed or interrupted; deleting VM {cfg.name} ({why})", flush=True)
            delete_all(cfg, root)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- actions


def ensure_vm(cfg: DictConfig, root: Path, experiments: list[list[str]], keep: bool,
              may_create: bool, preflight: bool = False) -> vm.Remote:
    """The VM `cfg` names, reachable over SSH: reused when it exists, else created.

    Before creating anything the checks before spending run (vm_checks.before_spending) for the
    `--set` values of every experiment; a VM that exists only gets the project checks. `preflight`
    then AOT-compiles the TPU branches (after the quick checks: a compile takes minutes the first
    time). `may_create` False refuses to replace a VM that .vm_state.json records but Compute no
    longer has (vm_run without --recreate).
    """
    state = vm.read_state(root)
    vm.check_create(cfg)
    compute = _compute(cfg)
    recorded = (state.get("project"), state.get("zone"), state.get("name"))
    if state and recorded != (cfg.project, cfg.zone, cfg.name):
        if Compute(state["project"], state["zone"]).get_instance(state["name"]) is not None:
            raise ConfigError("vm.name", f"{vm.STATE_FILE} tracks another VM, {state['name']} in "
                              f"{state['project']}/{state['zone']}",
                              "delete it first with `doit vm_down`, or use its name/zone/project")
        state = {}
    instance = compute.get_instance(cfg.name)
    created = instance is None
    if instance is not None:
        print(f"mtpipe: reusing VM {cfg.name} ({instance.status}) in {cfg.zone}", flush=True)
        vm_checks.check_project(cfg, root, experiments)
        if not state.get("vms"):   # created elsewhere: its cost counts from its creation
            vm.vm_started(state, cfg, instance.creation_timestamp)
    else:
        if state and not may_create:
            raise vm.VmError(
                f"VM {cfg.name}, recorded in {vm.STATE_FILE} (created {state.get('created')}), no "
                f"longer exists in {cfg.project}/{cfg.zone}: Compute deleted it after "
                "max_run_duration_s, or someone else did. Rerun with --recreate to create a new one "
                f"(about {vm.price_per_hour(cfg):.2f} USD per hour), or `doit vm_down` to forget it")
        vm_checks.before_spending(cfg, compute, root, experiments)
    if preflight:
        for sets in experiments:
            preflight_checks.run(sets, root, committed=True)
    if created:
        state = {}
        instance = create_vm(cfg, compute, state)
    return connect(cfg, root, state, instance, created, keep)


def create_vm(cfg: DictConfig, compute: Compute, state: dict) -> compute_v1.Instance:
    """Create the firewall rule (409: it exists) and the VM, print the price, add it to the ledger."""
    public_key = vm.ssh_public_key(cfg)
    run_id = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    labels = {**cfg.labels, "mtpipe-run": run_id, "created-by": vm.label_value(getpass.getuser())}
    usd, hours = vm.price_per_hour(cfg), int(cfg.max_run_duration_s) / 3600
    print(f"mtpipe: creating {cfg.machine_type} VM {cfg.name} ({cfg.provisioning}) in {cfg.zone}: "
          f"about {usd:.2f} USD per hour while it exists; "
          + (f"Compute deletes it after {hours:g} h (at most {hours * usd:.2f} USD)." if hours else
             "NO time limit (max_run_duration_s: 0): `doit vm_down` when done."), flush=True)
    compute.create_firewall(firewall_body(cfg, cfg.name, cfg.firewall.name))
    try:
        instance = compute.create_instance(instance_body(cfg, cfg.name, public_key, labels))
    except BaseException:
        compute.delete_firewall(cfg.firewall.name)
        raise
    vm.vm_started(state, cfg, instance.creation_timestamp)
    return instance


def connect(cfg: DictConfig, root: Path, state: dict, instance: compute_v1.Instance,
            created: bool, keep: bool) -> vm.Remote:
    """Record the VM in the state file, wait until its sshd takes our key (pinning its host key)."""
    if created:
        state.pop("host_key", None)   # a new VM, a new host key
    state.update(project=cfg.project, zone=cfg.zone, name=cfg.name, firewall=cfg.firewall.name,
                 created=instance.creation_timestamp, provisioning=cfg.provisioning,
                 max_run_duration_s=int(cfg.max_run_duration_s))
    vm.write_state(root, state)
    remote = _remote(cfg, state)
    try:
        state["host_key"] = vm.wait_ready(remote, float(cfg.ssh.ready_timeout_s))
    except BaseException:
        if created and not keep:
            print(f"mtpipe: VM {cfg.name} is unreachable; deleting it (use --keep to keep it)",
                  flush=True)
            delete_all(cfg, root)
        raise
    vm.write_state(root, state)
    remote.host_key = state["host_key"]
    print(f"mtpipe: VM {cfg.name} ready at {remote.host}:{remote.port}", flush=True)
    return remote


def lost(cfg: DictConfig, root: Path) -> str | None:
    """Why the VM can no longer run the pipeline (preempted, stopped, gone), or None while it is
    RUNNING: then a failed command is the pipeline's failure, not the VM's.

    Raises VmError when the VM must not be replaced: `doit vm_down` deleted it (the state file no
    longer records it), or it reached max_run_duration_s (the spending limit).
    """
    instance = _compute(cfg).get_instance(cfg.name)
    if instance is not None and instance.status == "RUNNING":
        return None
    state = vm.read_state(root)
    if state.get("name") != cfg.name:
        raise vm.VmError(f"VM {cfg.name} was deleted during the run (`doit vm_down`?): not replaced")
    limit = int(cfg.max_run_duration_s)
    age = (datetime.now(timezone.utc) - datetime.fromisoformat(state["created"])).total_seconds()
    if instance is None and limit and age >= limit:
        raise vm.VmError(f"VM {cfg.name} reached max_run_duration_s ({limit} s) and Compute "
                         "deleted it: raise max_run_duration_s in conf/vm.yaml (0: no limit) for "
                         "longer runs")
    spot = cfg.provisioning == "spot"
    if instance is None:
        why = "was preempted and deleted by Compute" if spot else "was deleted by someone else"
    else:
        why = f"was {'preempted' if spot else 'stopped by Compute'} (status {instance.status})"
    vm.vm_ended(state, why)
    vm.write_state(root, state)
    return why


def replace_vm(cfg: DictConfig, root: Path, keep: bool) -> vm.Remote:
    """Delete the lost VM (a preempted Spot VM cannot be restarted) and create a new one."""
    compute = _compute(cfg)
    compute.delete_instance(cfg.name)
    state = vm.read_state(root)
    return connect(cfg, root, state, create_vm(cfg, compute, state), created=True, keep=keep)


def with_recovery(cfg: DictConfig, root: Path, keep: bool, remote: vm.Remote,
                  attempt: Callable[[vm.Remote], None]) -> None:
    """Run `attempt` on the VM; when it fails because the VM was lost, replace the VM and run it
    again, at most `max_recoveries` times (a managed job: the pipeline resumes from the bucket)."""
    limit = int(cfg.max_recoveries)
    for recovery in itertools.count(1):
        try:
            attempt(remote)
            return
        except vm.VmError as e:
            why = lost(cfg, root)
            if why is None:
                raise
            if recovery > limit:
                raise vm.VmLost(f"VM {cfg.name} {why} ({e}); it was replaced {limit} times "
                                f"already (max_recoveries: {limit}), so vm_run gives up and deletes "
                                "it. Rerun later, raise max_recoveries in conf/vm.yaml, or use "
                                "--provisioning=reservation or on-demand") from e
            print(f"mtpipe: recovery {recovery} of {limit}: VM {cfg.name} {why} ({e}); deleting "
                  f"it and creating a new {cfg.provisioning} VM, then setup and the pipeline again",
                  flush=True)
            remote = replace_vm(cfg, root, keep)


@_task_action
def vm_up(keep: bool, **params: Any) -> None:
    root = vm.repo_root()
    ensure_vm(vm.load_config(params), root, [[]], keep, may_create=True)


@_task_action
def vm_setup(keep: bool, **params: Any) -> None:
    root, state, cfg = _target(params)
    remote = _remote(cfg, state)
    _guarded(cfg, root, keep, lambda: vm.setup(remote, cfg, root))


@_task_action
def vm_run(keep: bool, down: bool, recreate: bool, target: str | None, set: list[str],
           exp_name: str | None, queue: bool, no_preflight: bool, **params: Any) -> None:
    root, _, cfg = _target(params)
    experiments = vm.experiments(set, queue)
    names = vm.experiment_names(exp_name, len(experiments))
    for name in names:
        vm.check_exp_name(root, name)
    secret_lines, secret_data = vm.secrets_stdin(list(cfg.run.secrets))
    scripts = [vm.run_script(cfg, root, vm.dvc_command(target, sets, name), secret_lines, name)
               for sets, name in zip(experiments, names)]
    remote = ensure_vm(cfg, root, experiments, keep, may_create=recreate or bool(cfg.recreate),
                       preflight=not no_preflight)  # will it fit the TPU? (docs/preflight.md, cached)
    todo = list(zip(experiments, scripts))   # a replacement VM runs only what is left

    def attempt(remote: vm.Remote) -> None:
        vm.setup(remote, cfg, root)
        commit = vm.ship(remote, root, cfg.run.remote_dir)
        print(f"mtpipe: shipped {commit[:12]}; running the pipeline on {cfg.name}", flush=True)
        while todo:
            sets, script = todo[0]
            if len(scripts) > 1:
                print(f"mtpipe: experiment {len(scripts) - len(todo) + 1} of {len(scripts)}: "
                      f"{' '.join(sets)}", flush=True)
            vm.check(remote, script, "the pipeline", stdin=secret_data)
            got = vm.fetch_experiments(remote, root, cfg.run.remote_dir, commit)
            todo.pop(0)
            if got:
                print(f"mtpipe: experiment {', '.join(got)} (baseline {commit[:7]}) is now in this "
                      "repository: `dvc exp show` lists it, `dvc exp apply NAME && dvc pull` brings "
                      "it into the workspace", flush=True)
            else:
                print("mtpipe: the run made no DVC experiment (run.command without {dvc}?)",
                      flush=True)

    _guarded(cfg, root, keep, lambda: with_recovery(cfg, root, keep, remote, attempt))
    if down:
        delete_all(cfg, root)
    else:
        print(f"mtpipe: {spend_line(vm.read_state(root))}; VM {cfg.name} keeps running: "
              "`doit vm_down` deletes it", flush=True)


@_task_action
def vm_down(**params: Any) -> None:
    root, _, cfg = _target(params)
    delete_all(cfg, root)


@_task_action
def vm_status(**params: Any) -> None:
    root, state, cfg = _target(params)
    if not cfg.project or not cfg.zone:
        print("mtpipe: no VM recorded (.vm_state.json) and no PROJECT/ZONE set")
        return
    compute = _compute(cfg)
    instance = compute.get_instance(cfg.name)
    rule = compute.get_firewall(cfg.firewall.name)
    recorded = state if state.get("name") == cfg.name else {}
    print(f"firewall rule {cfg.firewall.name}: {'exists' if rule else 'none'}")
    if instance is None:
        print(f"VM {cfg.name} in {cfg.project}/{cfg.zone}: none")
    else:
        since = datetime.fromisoformat(instance.creation_timestamp)
        hours = (datetime.now(timezone.utc) - since).total_seconds() / 3600
        usd = recorded["vms"][-1]["usd_per_hour"] if recorded.get("vms") else vm.price_per_hour(cfg)
        print(f"VM {cfg.name} in {cfg.project}/{cfg.zone}: {instance.status}, "
              f"{instance.machine_type.rsplit('/', 1)[-1]}, {instance.scheduling.provisioning_model}, "
              f"external IP {external_ip(instance)}")
        print(f"  since {since.isoformat()} ({hours:.2f} h): about {hours * usd:.2f} USD so far at "
              f"{usd:.2f} USD/h")
        limit = instance.scheduling.max_run_duration.seconds
        if limit:
            print(f"  Compute deletes it at "
                  f"{time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(since.timestamp() + limit))}")
        if not recorded:
            print("  (not recorded in .vm_state.json: created elsewhere)")
    for entry in recorded.get("vms", [])[:-1]:
        print(f"  replaced: {entry['name']} ({entry['provisioning']}) {entry['created']} .. "
              f"{entry['ended']}: {entry['why']}")
    if recorded.get("vms"):
        print(f"  {spend_line(recorded)}")


@_task_action
def vm_shell(**params: Any) -> None:
    root, state, cfg = _target(params)
    remote = _remote(cfg, state)
    with tempfile.TemporaryDirectory() as tmp:
        rc = subprocess.call(vm.shell_argv(remote, Path(tmp) / "known_hosts"))
    if rc not in (0, 130):
        raise vm.VmError(f"ssh exited with {rc}")


# ---------------------------------------------------------------- tasks


def task_vm_up() -> dict:
    """Check, then create the TPU v6e-8 VM + SSH firewall rule (reuses an existing one); prints the cost."""
    return {"actions": [vm_up], "params": TARGET_PARAMS + [PROVISIONING, KEEP]}


def task_vm_setup() -> dict:
    """Install uv, Python 3.12, MaxText and DVC on the VM (once; a rerun is a no-op)."""
    return {"actions": [vm_setup], "params": TARGET_PARAMS + [KEEP]}


def task_vm_run() -> dict:
    """Run the pipeline on the VM as a DVC experiment (creating + setting up the VM when needed)."""
    return {
        "actions": [vm_run],
        "params": TARGET_PARAMS + [
            PROVISIONING,
            KEEP,
            {"name": "down", "long": "down", "type": bool, "default": False,
             "help": "delete the VM after a successful run too"},
            {"name": "recreate", "long": "recreate", "type": bool, "default": False,
             "help": "create a new VM when the recorded one is gone (else vm_run stops)"},
            {"name": "target", "long": "target", "type": str, "default": None,
             "help": "DVC stage to reproduce (default: the whole pipeline)"},
            {"name": "set", "long": "set", "type": list, "default": [],
             "help": "`dvc exp run -S VALUE`: --set=steps=2000 (repeatable)"},
            {"name": "exp_name", "long": "exp-name", "type": str, "default": None,
             "help": "the experiment's name (default: one DVC makes up); NAME-1, NAME-2, ... "
                     "with --queue"},
            {"name": "queue", "long": "queue", "type": bool, "default": False,
             "help": "one experiment per value of a --set key given several times (a grid for "
                     "several such keys), run one after another on one VM"},
            {"name": "no_preflight", "long": "no-preflight", "type": bool, "default": False,
             "help": "skip the AOT compile that checks the preset fits the TPU (doit preflight)"},
        ],
    }


def task_vm_status() -> dict:
    """Show the VM and firewall rule, how long the VM has existed and the run's cost so far."""
    return {"actions": [vm_status], "params": TARGET_PARAMS}


def task_vm_shell() -> dict:
    """Open an interactive ssh session on the VM."""
    return {"actions": [vm_shell], "params": TARGET_PARAMS}


def task_vm_down() -> dict:
    """Delete the VM and its firewall rule (fine when already gone)."""
    return {"actions": [vm_down], "params": TARGET_PARAMS}


# ---------------------------------------------------------------- preflight


@_task_action
def preflight(set: list[str]) -> None:
    """AOT-compile each TPU branch's training step on this CPU; fail when one does not fit."""
    preflight_checks.run(set, vm.repo_root())


def task_preflight() -> dict:
    """Will the TPU run fit, how long, what cost: AOT compile for the TPU on this CPU (cached)."""
    return {
        "actions": [preflight],
        "params": [{"name": "set", "long": "set", "type": list, "default": [],
                    "help": "params override as `dvc exp run -S`: --set=sft.preset=NAME (repeatable)"}],
        "verbosity": 2,
    }
