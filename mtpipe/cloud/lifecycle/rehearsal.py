"""`doit vm_run --rehearse`: the real run's every step on the smallest VM of its TPU generation,
before the first long paid run (docs/tpu-vm.md, "The rehearsal").

The rehearsal's VM is the real run's (conf/vm.yaml with the environment and the options: image,
disk, network, labels, service account, metadata, self-delete) with two changes: the machine type
holds one chip of the same generation (ct6e-standard-8t -> ct6e-standard-1t), and it is a Spot VM
unless --provisioning says otherwise. It runs the embedded default (the embedded-sft and
embedded-rl presets `make demo` runs) as a DVC experiment through every step of vm_run: the checks
before spending, the SSH route, the setup from the VM lock, the TPU runtime check on the one chip
(conf/hardware/<generation>-1.yaml), a download through the Hugging Face Hub client (with HF_TOKEN),
`dvc pull` / `dvc push` against the DVC remote as the VM's service account, the experiment brought
back; then the VM is deleted (unless --keep) and the spend line says what it cost.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtpipe.cloud.checks import prerequisites, tpu
from mtpipe.cloud.on_vm import dvc_experiments, ssh
from mtpipe.cloud.settings import vm_config, vm_state
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations

if TYPE_CHECKING:
    from mtpipe.cloud.lifecycle.run import Check, VmLifecycle

PROVISIONING = "spot"          # unless --provisioning: about a fifth of the on-demand price
MAX_RUN_DURATION_S = 3600      # Compute deletes the VM after this at the latest (or conf/vm.yaml's, if shorter)
EMBEDDED = ["sft.preset=embedded-sft", "rl.preset=embedded-rl"]   # what `make demo` runs
# The Hub step: one small file of the SFT tutorial's dataset (an open repo) at its pinned revision
HUB_DATASET, HUB_FILENAME = "ultrachat-200k", "README.md"
WHO = "the rehearsal"          # how the TPU check's failure names what runs on the chip


def one_chip(machine_type: str) -> tuple[str, str]:
    """The machine type of one chip of ``machine_type``'s generation and its hardware preset, named as
    MaxText names the topology (conf/generations.yaml): ct6e-standard-8t -> (ct6e-standard-1t, v6e-1)."""
    gen, _ = generations.of_machine_type(machine_type)
    return gen.machine_type(1), gen.maxtext_topology(1)


def check_options(sets: list[str], queue: bool, target: str | None) -> None:
    """The rehearsal runs the embedded default whole: no --set, --queue or --target."""
    for flag, given in (("--set", bool(sets)), ("--queue", queue), ("--target", bool(target))):
        if given:
            raise ConfigError(flag, "is not taken with --rehearse, which runs the embedded default "
                              f"({', '.join(EMBEDDED)}) end to end", f"drop {flag}, or run without --rehearse")


def load_config(params: dict[str, Any], root: Path) -> VmConfig:
    """The real run's VM config (conf/vm.yaml < $MTPIPE_VM_CONFIG < env < options) with the rehearsal's
    changes: one chip, Spot unless --provisioning, run.hardware the one-chip preset, at most
    MAX_RUN_DURATION_S, and Spot without a work bucket accepted (a preemption costs the embedded
    default's minutes). Refused while .vm_state.json records a VM: the rehearsal makes its own."""
    state = vm_state.read_state(root)
    if state.get("name"):
        raise ConfigError("--rehearse", f"{vm_state.STATE_FILE} records VM {state['name']} in "
                          f"{state.get('project')}/{state.get('zone')}, and the rehearsal creates a VM of its own",
                          "delete that one first with `doit vm_down`, or run on it without --rehearse")
    params = {**params, "provisioning": params.get("provisioning") or PROVISIONING}
    real = vm_config.load_config(params)
    machine, hardware = one_chip(real.machine_type)
    if not (root / "conf" / "hardware" / f"{hardware}.yaml").is_file():
        raise ConfigError("vm.machine_type", f"{real.machine_type}: the rehearsal needs conf/hardware/{hardware}.yaml "
                          f"(the one-chip {machine})", "write it as the other one-chip presets of conf/hardware/ are written")
    limit = int(real.max_run_duration_s)
    return vm_config.load_config({**params, "machine_type": machine, "run.hardware": hardware,
                                  "max_run_duration_s": min(limit, MAX_RUN_DURATION_S) if limit else MAX_RUN_DURATION_S,
                                  "spot_without_work_bucket": True})


def tpu_target(cfg: VmConfig, root: Path) -> tpu.Target:
    """The VM's one chip as run.hardware's preset (e.g. conf/hardware/v6e-1.yaml) describes it."""
    env = dvc_experiments.hardware_env(root, cfg.run.hardware)
    return tpu.Target(env["TPU_ACCELERATOR_TYPE"], cfg.run.hardware, env, [WHO])


def hub_command() -> str:
    """The Hub step's command line, run on the VM in the shipped repo."""
    return shlex.join(["python", "-m", "mtpipe.data.hub_file", "--dataset", HUB_DATASET, "--filename", HUB_FILENAME])


def hub_download(remote: ssh.Remote, cfg: VmConfig, root: Path) -> str:
    """Download the Hub step's file on the VM (HF_TOKEN over stdin, the run's environment, the VM's
    venv as `run.tpu_check` enters it); its success line, or VmError with the Hub's answer."""
    lines, secrets = dvc_experiments.secrets_stdin(list(cfg.run.secrets))
    script = "\n".join(["exec 2>&1", "set -eo pipefail", *lines,
                        *dvc_experiments.export_lines(dvc_experiments.run_env(cfg, root)),
                        f'cd "$HOME"/{shlex.quote(cfg.run.remote_dir)}',
                        cfg.run.tpu_check.replace("{check}", hub_command())])
    rc, out = ssh.run(remote, script, stdin=secrets, stream=False)
    text = out.decode(errors="replace").strip()
    if rc != 0:
        raise vm_config.VmError(f"the download through the Hugging Face Hub client failed on VM {cfg.name} (exit "
                                f"{rc}), before the pipeline started: `{hub_command()}` said:\n{text}")
    return text.splitlines()[-1] if text else f"{hub_command()}: exit 0"


def checks(cfg: VmConfig, root: Path) -> list[Check]:
    """What the rehearsal runs on the VM after shipping HEAD, before the pipeline: the TPU runtime
    check on its one chip, then the Hub download."""
    target = tpu_target(cfg, root)
    return [(f"checking the TPU runtime on VM {cfg.name}: {target.command()}",
             lambda remote: tpu.check(remote, cfg, root, target)),
            (f"downloading through the Hugging Face Hub client on VM {cfg.name}: {hub_command()}",
             lambda remote: hub_download(remote, cfg, root))]


def run(life: VmLifecycle, exp_name: str | None) -> None:
    """The rehearsal on a new VM of ``life``'s config (:func:`load_config`): refused without PROJECT, ZONE
    or credentials (all named at once, with whatever else fails), or when a VM of its name
    exists already (it would be reused, not rehearsed on), else vm_run's run of :data:`EMBEDDED` with
    :func:`checks`. The caller deletes the VM afterwards, as after any vm_run."""
    cfg = life.cfg
    prerequisites.check_settings(cfg, life.root, [EMBEDDED])   # every missing value named at once
    if life.cloud.get_instance(cfg.name) is not None:
        raise ConfigError("vm.name", f"VM {cfg.name} exists in {cfg.project}/{cfg.zone}, and the rehearsal "
                          "creates a VM of its own", f"delete it with `doit vm_down --name {cfg.name}`, or "
                          "rehearse under another name: --name=NAME")
    dvc_experiments.check_exp_name(life.root, exp_name)
    life.run_experiments([EMBEDDED], [exp_name], None, may_create=True, preflight=False,
                         checks=checks(cfg, life.root))
