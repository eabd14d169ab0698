"""doit tasks around the DVC pipeline: create, set up, use and delete the TPU v6e-8 VM.

    doit vm_up [--project P --zone Z --reservation R --name N]   (or env PROJECT/ZONE/RESERVATION/NAME)
    doit vm_run [--set=steps=2000 ...] [--exp-name NAME] [--target STAGE] [--keep] [--down] [--recreate]
    doit vm_setup        doit vm_status       doit vm_shell        doit vm_down

vm_run creates and sets up the VM itself when needed; each run is a DVC experiment (`dvc exp show`).

Configuration: conf/vm.yaml; what vm_up created: .vm_state.json; docs/tpu-vm.md explains it all.
"""

from __future__ import annotations

import functools
import getpass
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from doit.exceptions import TaskFailed
from omegaconf import DictConfig

from mtpipe import preflight as preflight_checks
from mtpipe import vm, vm_checks
from mtpipe.errors import ConfigError
from mtpipe.gcp import Compute, GcpError, external_ip, firewall_body, instance_body

DOIT_CONFIG = {"default_tasks": ["vm_status"], "verbosity": 2, "backend": "json",
               "dep_file": ".doit.db.json"}

TARGET_PARAMS = [
    {"name": key, "long": key, "type": str, "default": None,
     "help": f"{key} (else env {var}, else conf/vm.yaml, else .vm_state.json)"}
    for key, var in vm.ENV_KEYS.items()
]
KEEP = {"name": "keep", "long": "keep", "type": bool, "default": False,
        "help": "keep the VM when this task fails or is interrupted"}


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
        vm.clear_state(root)
    finally:
        signal.signal(signal.SIGINT, previous)


def _guarded(cfg: DictConfig, root: Path, keep: bool, body: Callable[[], None]) -> None:
    """Run body; on any failure, Ctrl-C or SIGTERM/SIGHUP delete the VM unless --keep."""

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        body()
    except BaseException:
        if keep:
            print(f"mtpipe: failed; VM {cfg.name} kept (--keep): `doit vm_down` deletes it",
                  flush=True)
        else:
            print(f"mtpipe: failed or interrupted; deleting VM {cfg.name} (use --keep to keep it)",
                  flush=True)
            delete_all(cfg, root)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- actions


def ensure_vm(cfg: DictConfig, root: Path, sets: list[str], keep: bool, may_create: bool,
              preflight: bool = False) -> vm.Remote:
    """The VM `cfg` names, reachable over SSH: reused when it exists, else created.

    Before creating anything the checks before spending run (vm_checks.before_spending); a VM that
    exists only gets the project checks. `preflight` then AOT-compiles the TPU branches (after the
    quick checks: a compile takes minutes the first time). `may_create` False refuses to replace a
    VM that .vm_state.json records but Compute no longer has (vm_run without --recreate).
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
    public_key = vm.ssh_public_key(cfg)
    instance = compute.get_instance(cfg.name)
    created = instance is None
    if instance is not None:
        print(f"mtpipe: reusing VM {cfg.name} ({instance.status}) in {cfg.zone}", flush=True)
        vm_checks.check_project(cfg, root, sets)
        if preflight:
            preflight_checks.run(sets, root, committed=True)
    else:
        if state and not may_create:
            raise vm.VmError(
                f"VM {cfg.name}, recorded in {vm.STATE_FILE} (created {state.get('created')}), no "
                f"longer exists in {cfg.project}/{cfg.zone}: Compute deleted it after "
                "max_run_duration_s, or someone else did. Rerun with --recreate to create a new one "
                f"(about {cfg.price_per_hour_usd:.2f} USD per hour), or `doit vm_down` to forget it")
        vm_checks.before_spending(cfg, compute, root, sets)
        if preflight:
            preflight_checks.run(sets, root, committed=True)
        run_id = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        labels = {**cfg.labels, "mtpipe-run": run_id, "created-by": vm.label_value(getpass.getuser())}
        hours = int(cfg.max_run_duration_s) / 3600
        print(f"mtpipe: creating {cfg.machine_type} VM {cfg.name} in {cfg.zone}: about "
              f"{cfg.price_per_hour_usd:.2f} USD per hour while it exists; "
              + (f"Compute deletes it after {hours:g} h (at most "
                 f"{hours * cfg.price_per_hour_usd:.2f} USD)." if hours else
                 "NO time limit (max_run_duration_s: 0): `doit vm_down` when done."), flush=True)
        compute.create_firewall(firewall_body(cfg, cfg.name, cfg.firewall.name))
        try:
            instance = compute.create_instance(instance_body(cfg, cfg.name, public_key, labels))
        except BaseException:
            compute.delete_firewall(cfg.firewall.name)
            raise
        state = {}
    state.update(project=cfg.project, zone=cfg.zone, name=cfg.name, firewall=cfg.firewall.name,
                 created=instance.creation_timestamp, price_per_hour_usd=cfg.price_per_hour_usd,
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


@_task_action
def vm_up(keep: bool, **params: Any) -> None:
    root = vm.repo_root()
    ensure_vm(vm.load_config(params), root, [], keep, may_create=True)


@_task_action
def vm_setup(keep: bool, **params: Any) -> None:
    root, state, cfg = _target(params)
    remote = _remote(cfg, state)
    _guarded(cfg, root, keep, lambda: vm.setup(remote, cfg, root))


@_task_action
def vm_run(keep: bool, down: bool, recreate: bool, target: str | None, set: list[str],
           exp_name: str | None, no_preflight: bool, **params: Any) -> None:
    root, _, cfg = _target(params)
    vm.check_exp_name(root, exp_name)
    secret_lines, secret_data = vm.secrets_stdin(list(cfg.run.secrets))
    script = vm.run_script(cfg, root, vm.dvc_command(target, set, exp_name), secret_lines, exp_name)
    remote = ensure_vm(cfg, root, set, keep, may_create=recreate or bool(cfg.recreate),
                       preflight=not no_preflight)  # will it fit the TPU? (docs/preflight.md, cached)

    def body() -> None:
        vm.setup(remote, cfg, root)
        commit = vm.ship(remote, root, cfg.run.remote_dir)
        print(f"mtpipe: shipped {commit[:12]}; running the pipeline on {cfg.name}", flush=True)
        vm.check(remote, script, "the pipeline", stdin=secret_data)
        names = vm.fetch_experiments(remote, root, cfg.run.remote_dir, commit)
        if names:
            print(f"mtpipe: experiment {', '.join(names)} (baseline {commit[:7]}) is now in this "
                  "repository: `dvc exp show` lists it, `dvc exp apply NAME && dvc pull` brings it "
                  "into the workspace", flush=True)
        else:
            print("mtpipe: the run made no DVC experiment (run.command without {dvc}?)", flush=True)

    _guarded(cfg, root, keep, body)
    if down:
        delete_all(cfg, root)


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
    print(f"firewall rule {cfg.firewall.name}: {'exists' if rule else 'none'}")
    if instance is None:
        print(f"VM {cfg.name} in {cfg.project}/{cfg.zone}: none")
        return
    since = datetime.fromisoformat(instance.creation_timestamp)
    hours = (datetime.now(timezone.utc) - since).total_seconds() / 3600
    print(f"VM {cfg.name} in {cfg.project}/{cfg.zone}: {instance.status}, "
          f"{instance.machine_type.rsplit('/', 1)[-1]}, external IP {external_ip(instance)}")
    print(f"  since {since.isoformat()} ({hours:.2f} h): about "
          f"{hours * cfg.price_per_hour_usd:.2f} USD so far at {cfg.price_per_hour_usd:.2f} USD/h")
    limit = instance.scheduling.max_run_duration.seconds
    if limit:
        print(f"  Compute deletes it at {since.timestamp() + limit:.0f} "
              f"({time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(since.timestamp() + limit))})")
    if state.get("name") != cfg.name:
        print("  (not recorded in .vm_state.json: created elsewhere)")


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
    return {"actions": [vm_up], "params": TARGET_PARAMS + [KEEP]}


def task_vm_setup() -> dict:
    """Install uv, Python 3.12, MaxText and DVC on the VM (once; a rerun is a no-op)."""
    return {"actions": [vm_setup], "params": TARGET_PARAMS + [KEEP]}


def task_vm_run() -> dict:
    """Run the pipeline on the VM as a DVC experiment (creating + setting up the VM when needed)."""
    return {
        "actions": [vm_run],
        "params": TARGET_PARAMS + [
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
             "help": "the experiment's name (default: one DVC makes up)"},
            {"name": "no_preflight", "long": "no-preflight", "type": bool, "default": False,
             "help": "skip the AOT compile that checks the preset fits the TPU (doit preflight)"},
        ],
    }


def task_vm_status() -> dict:
    """Show the VM and firewall rule, how long the VM has existed and its cost so far."""
    return {"actions": [vm_status], "params": TARGET_PARAMS}


def task_vm_shell() -> dict:
    """Open an interactive ssh session on the VM."""
    return {"actions": [vm_shell], "params": TARGET_PARAMS}


def task_vm_down() -> dict:
    """Delete the VM and its firewall rule (fine when already gone)."""
    return {"actions": [vm_down], "params": TARGET_PARAMS}


# ---------------------------------------------------------------- preflight (issue 9)


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
