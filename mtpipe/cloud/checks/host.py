"""The VM's RAM and /dev/shm, read on it after the setup and held to the machine budget before training.

Before the VM exists the budget (mtpipe/planning/budget.py) takes them from Google's VM-type table
and the tmpfs default (half of RAM). A VM can have less: another image, a /dev/shm mounted smaller.
After the setup vm_run reads both over SSH (``df`` of /dev/shm, MemTotal of /proc/meminfo), and the
bytes of the run directories earlier runs left on a reused VM (``du`` of the checkout's work/<stage>/
and of run.env's MTPIPE_WORK_DIR/<stage>/, which the budget counts as taken for the whole run), and checks
each experiment's budget against them, before shipping HEAD and before anything is downloaded; one
that does not fit stops the run with the key to change, and the VM is deleted as after a failed setup.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from mtpipe.cloud.on_vm.ssh import Remote, run
from mtpipe.cloud.settings import vm_config
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.maxtext.run_dir import WORK_DIR_ENV
from mtpipe.pipeline.stage_table import TRAINING
from mtpipe.planning import budget, preflight

# /dev/shm's size in bytes, then MemTotal in KiB, then the bytes under each place's run directories
PROBE = r"""set -eo pipefail
df -B1 --output=size /dev/shm | tail -n 1
sed -n 's/^MemTotal: *\([0-9]*\) kB$/\1/p' /proc/meminfo
"""
DU = "{ du -sbc %s 2>/dev/null || true; } | tail -n 1 | cut -f 1\n"  # 0 where none exists


def run_dir_places(cfg: VmConfig) -> dict[str, list[str]]:
    """Where run directories live on the VM, by the budget's place: the checkout's work/<stage>/ (boot
    disk) and run.env's MTPIPE_WORK_DIR/<stage>/ (/dev/shm or the boot disk), as shell words."""
    bases = [f'"$HOME"/{shlex.quote(cfg.run.remote_dir)}/work']
    work_dir = str(cfg.run.env.get(WORK_DIR_ENV, "") or "")
    if work_dir:
        bases.append(shlex.quote(work_dir))
    places: dict[str, list[str]] = {budget.BOOT: [], budget.SHM: []}
    for base in bases:
        place = budget.SHM if base.startswith("/dev/shm") else budget.BOOT
        places[place] += [f"{base}/{stage}" for stage in TRAINING]
    return {place: paths for place, paths in places.items() if paths}


def read_host(remote: Remote, cfg: VmConfig) -> budget.Host:
    """What VM ``cfg.name`` has: its RAM (MemTotal), the size of its /dev/shm and the run directories
    earlier runs left there and on the boot disk."""
    places = run_dir_places(cfg)
    rc, out = run(remote, PROBE + "".join(DU % " ".join(paths) for paths in places.values()), stream=False)
    values = out.decode(errors="replace").split()
    if rc != 0 or len(values) != 2 + len(places) or not all(v.isdigit() for v in values):
        raise vm_config.VmError(f"reading /dev/shm's size, MemTotal and the run directories on VM {cfg.name} failed "
                                f"(exit {rc}): {out.decode(errors='replace').strip()}")
    shm_bytes, memory_kib, *left = map(int, values)
    return budget.Host(memory_gib=memory_kib * 1024 / budget.GIB, shm_gib=shm_bytes / budget.GIB,
                       source=f"read on VM {cfg.name} after the setup", left=dict(zip(places, left)))


def check(remote: Remote, cfg: VmConfig, root: Path, experiments: list[list[str]]) -> str:
    """Read the VM's RAM and /dev/shm and check every experiment's machine budget against them (a
    ConfigError naming the key to change when one does not fit); the line vm_run prints."""
    host = read_host(remote, cfg)
    machine = dataclasses.replace(vm_config.budget_machine(cfg), host=host)
    checked = [sets for sets in experiments if preflight.budget_on_vm(sets, machine, root) is not None]
    table = budget.host_of(machine.tpu) if machine.tpu else None
    told = (f" (Google's table: {table.memory_gib * budget.GIB / budget.GB:,.0f} GB, /dev/shm "
            f"{table.shm_gib * budget.GIB / budget.GB:,.0f} GB)") if table else ""
    what = "the machine budget fits them" if checked else ("no machine budget to hold them to (no branch "
                                                           "trains on this VM's TPU, or its model files are not here)")
    left = "".join(f"; earlier runs left {size / budget.GB:,.1f} GB of run directories on the {place}"
                   for place, size in host.left.items() if size)
    return (f"VM {cfg.name} has {host.memory_gib * budget.GIB / budget.GB:,.0f} GB of RAM and a /dev/shm of "
            f"{host.shm_gib * budget.GIB / budget.GB:,.0f} GB{told}{left}: {what}")
