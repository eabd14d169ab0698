"""The TPU runtime proven on the VM before anything is downloaded.

After the setup and shipping HEAD (which holds the check), vm_run runs `python -m
mtpipe.maxtext.tpu_check --devices N --device-kind K` in the VM's MaxText venv (`run.tpu_check` in
conf/vm.yaml), once for each TPU that the branches running on the VM target: a branch whose hardware
preset runs MaxText where DVC runs (`backend: local`) and names a TPU (preflight's
:func:`~mtpipe.planning.preflight.topology`: its TPU_ACCELERATOR_TYPE, e.g. v6e-8). CPU presets and
xpk presets (their training runs on a GKE slice, not on this VM) need no check. A failure is a
VmError carrying the check's own words (what JAX found, the fix); vm_run then deletes the VM as after
a failed setup, before `dvc pull` or any stage starts.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from mtpipe.cloud.checks.project import composed_branches
from mtpipe.cloud.on_vm import dvc_experiments
from mtpipe.cloud.on_vm.ssh import Remote, run
from mtpipe.cloud.settings.vm_config import VmConfig, VmError
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations
from mtpipe.planning import preflight


@dataclass
class Target:
    """A TPU the VM must have: its accelerator type, the hardware preset that names it, its env and
    the branches that run on it."""

    accelerator_type: str
    hardware: str
    env: dict[str, str]
    branches: list[str] = field(default_factory=list)

    def command(self) -> str:
        """`python -m mtpipe.maxtext.tpu_check --devices N --device-kind K` for this accelerator type
        (its generation's device kinds, conf/generations.yaml)."""
        try:
            gen, chips = generations.of_accelerator(self.accelerator_type)
        except ValueError as err:
            raise ConfigError(f"conf/hardware/{self.hardware}.yaml TPU_ACCELERATOR_TYPE", str(err),
                              "spell it as the TPU VM's accelerator type (conf/generations.yaml)") from err
        kinds = [arg for kind in gen.device_kinds for arg in ("--device-kind", kind)]
        devices = chips * gen.devices_per_chip
        return shlex.join(["python", "-m", "mtpipe.maxtext.tpu_check", "--devices", str(devices), *kinds])


def targets(root: Path, experiments: list[list[str]]) -> list[Target]:
    """The TPUs the branches that run on the VM target, over every experiment's `--set` values
    (HEAD's params.yaml, as the VM composes it); [] when none does (CPU or xpk presets)."""
    found: dict[str, Target] = {}
    for sets in experiments:
        for name, branch in composed_branches(root, sets).items():
            topo = preflight.topology(branch)
            if topo is None or branch.hardware.backend != "local":
                continue
            target = found.setdefault(topo, Target(topo, branch.hardware.name, dict(branch.hardware.env)))
            if name not in target.branches:
                target.branches.append(name)
    return list(found.values())


def script(cfg: VmConfig, root: Path, target: Target) -> str:
    """The check on the VM: the run's environment and the hardware preset's (what a stage's MaxText
    sees), in the shipped repo, `run.tpu_check` with {check} filled in; its output all on stdout."""
    return "\n".join([
        "exec 2>&1",
        "set -eo pipefail",
        *dvc_experiments.export_lines({**dvc_experiments.run_env(cfg, root), **target.env}),
        f'cd "$HOME"/{shlex.quote(cfg.run.remote_dir)}',
        cfg.run.tpu_check.replace("{check}", target.command()),
    ])


def check(remote: Remote, cfg: VmConfig, root: Path, target: Target) -> str:
    """Run the check for ``target`` on the VM; return its success line, or raise VmError with what it
    found and the fix."""
    rc, out = run(remote, script(cfg, root, target), stream=False)
    text = out.decode(errors="replace").strip()
    if rc != 0:
        raise VmError(f"the TPU runtime check failed on VM {cfg.name} (exit {rc}), before anything was "
                      f"downloaded: {', '.join(target.branches)} run on hardware {target.hardware} "
                      f"(TPU_ACCELERATOR_TYPE {target.accelerator_type}); `{target.command()}` said:\n{text}")
    return text.splitlines()[-1] if text else f"{target.command()}: exit 0"
