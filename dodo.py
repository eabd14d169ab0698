"""doit tasks around the DVC pipeline: create, set up, use and delete the TPU v6e-8 VM.

    doit vm_up [--project P --zone Z --reservation R --name N]   (or env PROJECT/ZONE/RESERVATION/NAME)
               [--provisioning reservation|spot|on-demand|flex-start] [--yes]
    doit vm_run [--set=steps=2000 ...] [--exp-name NAME] [--target STAGE] [--keep] [--recreate] [--yes]
                [--queue --set=steps=500 --set=steps=1000 ...] [--provisioning spot]
    doit vm_run --rehearse [--provisioning on-demand] [--keep] [--yes]   (one chip, the embedded default)
    doit check [--set=...] [--provisioning spot] [--project P ...] [--rehearse]   (every prerequisite of vm_run; creates nothing)
    doit vm_setup        doit vm_status       doit vm_shell        doit vm_down
    doit publish --exp NAME --repo ORG/NAME [--branch rl|sft] [--public]   (HF_TOKEN: a write token)

vm_run creates and sets up the VM itself when needed (after the checks, it prints the price and asks;
--yes answers for a script), runs each experiment as a DVC experiment (`dvc exp show`) and deletes
the VM when the run ends, unless --keep; a VM lost during the run (Spot preemption) is replaced up to
`max_recoveries` times.

Configuration: conf/vm.yaml; what vm_up created: .vm_state.json; docs/tpu-vm.md explains it all.
This file only declares the tasks and their options; the VM's life is mtpipe/cloud/lifecycle/ (VmLifecycle: run.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from doit import doit_cmd
from doit.exceptions import TaskFailed

from mtpipe.cloud.settings.vm_env import ENV_KEYS

if TYPE_CHECKING:
    from mtpipe.cloud.lifecycle.run import VmLifecycle

# `doit list` and `doit help` import this file and run no action: each action imports what it uses
# (Google's clients, MaxText, JAX, DVC take seconds to import; docs/decisions/reporting.md).


def refuse_split_values() -> None:
    """Stop when the command line had `--set KEY=VALUE` (a space, not `=`) or any other lone
    `KEY=VALUE` word: doit takes such words out as its own command-line variables before it parses
    options (doit_cmd.DoitMain.process_args), so the value would reach no task. The project uses no
    doit variables, so any one of them is such a word."""
    taken = doit_cmd._CMDLINE_VARS or {}  # doit's own record of them: get_var() needs their names
    if taken:
        words = " ".join(f"{name}={value}" for name, value in taken.items())
        sys.exit(f"mtpipe: doit took `{words}` off the command line as doit variables, so no task would "
                 "see it: write each override as one word, --set=KEY=VALUE (e.g. --set=steps=2000)")


refuse_split_values()

DOIT_CONFIG = {"default_tasks": ["vm_status"], "verbosity": 2, "backend": "json",
               "dep_file": ".doit.db.json"}
# Every action runs on the process's own stdout/stderr, not doit's per-action capture streams: the
# libraries an action imports bind to the streams of that moment and keep them (DVC's import wraps
# sys.stdout/sys.stderr with colorama, absl's log handler keeps sys.stderr and closes it at exit: a
# captured stream gave "Exception ignored in atexit callback ... 'Writer' object has no attribute
# 'close'"). verbosity 2 shows the output live anyway; doit prints captured output only below it.
NO_CAPTURE = {"capture": False}

TARGET_PARAMS = [
    {"name": key, "long": key, "type": str, "default": None,
     "help": f"{key} (else env {var}, else conf/vm.yaml, else .vm_state.json)"}
    for key, var in ENV_KEYS.items()
]
KEEP = {"name": "keep", "long": "keep", "type": bool, "default": False,
        "help": "keep the VM when this task fails or is interrupted"}
KEEP_AFTER_RUN = {**KEEP, "help": "keep the VM when the run ends, however it ends (else it is deleted; "
                                   "`doit vm_down` deletes a kept one)"}
YES = {"name": "yes", "long": "yes", "type": bool, "default": False,
       "help": "create the VM without asking (scripts); else the price is printed and confirmed"}
PROVISIONING = {"name": "provisioning", "long": "provisioning", "type": str, "default": None,
                "help": "reservation | spot | on-demand | flex-start (else conf/vm.yaml's provisioning; vm_run: "
                        "the recorded VM's)"}
SET = {"name": "set", "long": "set", "type": list, "default": [],
       "help": "`dvc exp run -S VALUE`: --set=steps=2000 (repeatable)"}
REHEARSE = {"name": "rehearse", "long": "rehearse", "type": bool, "default": False,
            "help": "the first paid step: the embedded default through every step of the run on a new "
                    "one-chip VM of the same generation (Spot unless --provisioning), then deleted"}
QUEUE = {"name": "queue", "long": "queue", "type": bool, "default": False,
         "help": "one experiment per value of a --set key given several times (a grid for "
                 "several such keys), run one after another on one VM"}


def _task_action(fn: Callable[..., None]) -> Callable[..., TaskFailed | None]:
    """Report our own errors as one clear doit failure instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> TaskFailed | None:
        from mtpipe.cloud.providers.interface import ProviderError
        from mtpipe.cloud.settings.vm_config import VmError
        from mtpipe.errors import ConfigError

        try:
            fn(**kwargs)
        except (ConfigError, ProviderError, VmError) as e:
            return TaskFailed(f"{type(e).__name__}: {e}")
        return None

    return wrapper


def _target(params: dict[str, Any], keep: bool = False, yes: bool = False) -> VmLifecycle:
    """The VM the options, the environment, conf/vm.yaml and .vm_state.json name."""
    from mtpipe.cloud.lifecycle.run import VmLifecycle
    from mtpipe.cloud.on_vm import dvc_experiments
    from mtpipe.cloud.settings import vm_config, vm_state

    root = dvc_experiments.repo_root()
    return VmLifecycle(vm_config.load_config(params, vm_state.read_state(root)), root, keep, yes)


@_task_action
def vm_up(keep: bool, yes: bool, **params: Any) -> None:
    from mtpipe.cloud.lifecycle.run import VmLifecycle
    from mtpipe.cloud.on_vm import dvc_experiments
    from mtpipe.cloud.settings import vm_config

    root = dvc_experiments.repo_root()
    VmLifecycle(vm_config.load_config(params), root, keep, yes).ensure([[]], may_create=True)


@_task_action
def vm_setup(keep: bool, **params: Any) -> None:
    from mtpipe.cloud.on_vm.setup import setup as setup_vm

    life = _target(params, keep)
    remote = life.remote()
    life.guarded(lambda: setup_vm(remote, life.cfg, life.root))


@_task_action
def vm_run(keep: bool, yes: bool, recreate: bool, target: str | None, set: list[str],
           exp_name: str | None, queue: bool, no_preflight: bool, rehearse: bool, **params: Any) -> None:
    from mtpipe.cloud.lifecycle import rehearsal
    from mtpipe.cloud.lifecycle.lines import spend_line
    from mtpipe.cloud.lifecycle.run import VmLifecycle
    from mtpipe.cloud.on_vm import dvc_experiments
    from mtpipe.cloud.settings import vm_state

    if rehearse:   # the embedded default on a new one-chip VM (mtpipe/cloud/lifecycle/rehearsal.py)
        rehearsal.check_options(set, queue, target)
        root = dvc_experiments.repo_root()
        life = VmLifecycle(rehearsal.load_config(params, root), root, keep, yes)
        curves = rehearsal.run(life, exp_name)
    else:
        life = _target(params, keep, yes)
        experiments = dvc_experiments.experiments(set, queue)
        names = dvc_experiments.experiment_names(exp_name, len(experiments))
        for name in names:
            dvc_experiments.check_exp_name(life.root, name)
        life.run_experiments(experiments, names, target, may_create=recreate or bool(life.cfg.recreate),
                             preflight=not no_preflight)
    if keep:
        print(f"mtpipe: {spend_line(vm_state.read_state(life.root))}; VM {life.cfg.name} keeps running "
              "(--keep): `doit vm_down` deletes it", flush=True)
    else:
        life.delete()
    if rehearse:
        rehearsal.conclude(curves)


@_task_action
def vm_down(**params: Any) -> None:
    """The VM .vm_state.json records, or the one --name / NAME names; with neither (a fresh clone,
    another laptop), this user's VMs found by their labels in the zone, or with no zone in every zone."""
    from mtpipe.cloud.settings import vm_state

    life = _target(params)
    if vm_state.read_state(life.root) or params.get("name") or os.environ.get(ENV_KEYS["name"]):
        life.delete()
    else:
        life.delete_labelled()


@_task_action
def vm_status(**params: Any) -> None:
    life = _target(params)
    if not life.cfg.project or not life.cfg.zone:
        print("mtpipe: no VM recorded (.vm_state.json) and no PROJECT/ZONE set")
        return
    print("\n".join(life.status()))


@_task_action
def vm_shell(**params: Any) -> None:
    from mtpipe.cloud.on_vm import ssh
    from mtpipe.cloud.settings import vm_config

    remote = _target(params).remote()
    with tempfile.TemporaryDirectory() as tmp:
        rc = subprocess.call(ssh.shell_argv(remote, Path(tmp) / "known_hosts"))
    if rc not in (0, 130):
        raise vm_config.VmError(f"ssh exited with {rc}")


# ---------------------------------------------------------------- tasks


@_task_action
def check(set: list[str], queue: bool, rehearse: bool, **params: Any) -> None:
    from mtpipe.cloud.checks import prerequisites

    if rehearse:   # the rehearsal's VM and the embedded default (mtpipe/cloud/lifecycle/rehearsal.py)
        from mtpipe.cloud.lifecycle import rehearsal
        from mtpipe.cloud.on_vm import dvc_experiments
        from mtpipe.errors import ConfigError

        rehearsal.check_options(set, queue, None)
        root = dvc_experiments.repo_root()
        try:   # a config that does not load is named by the checks, with the embedded default's presets
            sets = rehearsal.experiments(rehearsal.load_config(params, root), root)[0]
        except ConfigError:
            sets = rehearsal.EMBEDDED
        prerequisites.check_everything(params, sets, False, lambda p: rehearsal.load_config(p, root))
    else:
        prerequisites.check_everything(params, set, queue)


def task_check() -> dict:
    """Every prerequisite of `doit vm_run` with the same options, one line each; creates nothing."""
    return {"actions": [check], "io": NO_CAPTURE, "params": TARGET_PARAMS + [PROVISIONING, SET, QUEUE, REHEARSE]}


def task_vm_up() -> dict:
    """Check, then create the TPU v6e-8 VM + SSH firewall rule (reuses an existing one) after you confirm its price."""
    return {"actions": [vm_up], "io": NO_CAPTURE, "params": TARGET_PARAMS + [PROVISIONING, KEEP, YES]}


def task_vm_setup() -> dict:
    """Install uv, Python 3.12, MaxText and DVC on the VM (once; a rerun is a no-op)."""
    return {"actions": [vm_setup], "io": NO_CAPTURE, "params": TARGET_PARAMS + [KEEP]}


def task_vm_run() -> dict:
    """Run the pipeline on the VM as a DVC experiment (creating + setting up the VM when needed), then delete it."""
    return {
        "actions": [vm_run], "io": NO_CAPTURE,
        "params": TARGET_PARAMS + [
            PROVISIONING,
            KEEP_AFTER_RUN,
            YES,
            {"name": "recreate", "long": "recreate", "type": bool, "default": False,
             "help": "create a new VM when the recorded one is gone (else vm_run stops)"},
            {"name": "target", "long": "target", "type": str, "default": None,
             "help": "DVC stage to reproduce (default: the whole pipeline)"},
            SET,
            {"name": "exp_name", "long": "exp-name", "type": str, "default": None,
             "help": "the experiment's name (default: one DVC makes up); NAME-1, NAME-2, ... "
                     "with --queue"},
            QUEUE,
            {"name": "no_preflight", "long": "no-preflight", "type": bool, "default": False,
             "help": "skip the AOT compile that checks the preset fits the TPU (doit preflight)"},
            REHEARSE,
        ],
    }


def task_vm_status() -> dict:
    """Show the VM and firewall rule, how long the VM has existed and the run's cost so far."""
    return {"actions": [vm_status], "io": NO_CAPTURE, "params": TARGET_PARAMS}


def task_vm_shell() -> dict:
    """Open an interactive ssh session on the VM."""
    return {"actions": [vm_shell], "io": NO_CAPTURE, "params": TARGET_PARAMS}


def task_vm_down() -> dict:
    """Delete the VM and its firewall rule, or your labelled ones (fine when already gone).

    Without .vm_state.json or a name (a fresh clone, another laptop): your VMs labelled app=mtpipe in the zone
    (no ZONE: in every zone, on both routes)."""
    return {"actions": [vm_down], "io": NO_CAPTURE, "params": TARGET_PARAMS}


# ---------------------------------------------------------------- preflight


@_task_action
def preflight(set: list[str], target: str | None) -> None:
    """The machine budget (disks, host memory) of the TPU VM's branches, then each one's training step
    AOT-compiled on this CPU for HBM, time and cost, and the whole run up to ``target`` by phase; fail
    when one does not fit."""
    from mtpipe.cloud.on_vm import dvc_experiments
    from mtpipe.cloud.settings import prices, vm_config
    from mtpipe.planning import preflight as preflight_checks

    cfg = vm_config.load_config()
    rate = prices.vm_rate(cfg)
    preflight_checks.run(set, rate.price.usd, vm_config.budget_machine(cfg), dvc_experiments.repo_root(),
                         price_basis=rate.per_chip(), target=target)
    print(prices.by_region(rate))


def task_preflight() -> dict:
    """Will the TPU run fit (disks, host memory, HBM), how long, what cost: before any VM exists (cached)."""
    return {
        "actions": [preflight], "io": NO_CAPTURE,
        "params": [{"name": "set", "long": "set", "type": list, "default": [],
                    "help": "params override as `dvc exp run -S`: --set=sft.preset=NAME (repeatable)"},
                   {"name": "target", "long": "target", "type": str, "default": None,
                    "help": "the DVC stage vm_run would reproduce (default: the whole pipeline): the run's forecast "
                            "counts the stages up to it"}],
        "verbosity": 2,
    }


# ---------------------------------------------------------------- publish


@_task_action
def publish(exp: str | None, repo: str | None, branch: str, public: bool) -> None:
    """An experiment's export to the Hugging Face Hub with its model card (mtpipe/data/publish.py)."""
    from mtpipe.cloud.on_vm import dvc_experiments
    from mtpipe.data import publish as hub_publish
    from mtpipe.errors import ConfigError

    if not exp or not repo:
        raise ConfigError("--exp/--repo", "both are needed", "doit publish --exp NAME --repo ORG/NAME")
    print(hub_publish.publish(dvc_experiments.repo_root(), exp, repo, branch, private=not public,
                              endpoint=os.environ.get("HF_ENDPOINT")))


def task_publish() -> dict:
    """Upload an experiment's exported model to the Hub (private), with its lineage and scores."""
    return {
        "actions": [publish], "io": NO_CAPTURE,
        "params": [
            {"name": "exp", "long": "exp", "type": str, "default": None, "help": "the experiment (dvc exp show)"},
            {"name": "repo", "long": "repo", "type": str, "default": None, "help": "the Hub repo, ORG/NAME"},
            {"name": "branch", "long": "branch", "type": str, "default": "rl", "help": "rl or sft"},
            {"name": "public", "long": "public", "type": bool, "default": False,
             "help": "a public repo (default: private)"},
        ],
        "verbosity": 2,
    }


# ---------------------------------------------------------------- why


def why(pos: list[str]) -> TaskFailed | None:
    """What moved in each named stage's address, in words (mtpipe/pipeline/why.py)."""
    from mtpipe.pipeline import why as why_stage

    if not pos:
        return TaskFailed("name a stage: doit why train_sft@sft (the names: dvc stage list)")
    return TaskFailed("the line above says what to name") if why_stage.main(pos) else None


def task_why() -> dict:
    """Why a stage reruns, or will after your edits, and how to keep its output (docs/why.md)."""
    return {"actions": [why], "io": NO_CAPTURE, "pos_arg": "pos", "verbosity": 2}
