"""The VM's RAM and /dev/shm, read on it after the setup and held to the machine budget before training.

Before the VM exists the budget (mtpipe/maxtext/budget.py) takes them from Google's VM-type table
and the tmpfs default (half of RAM). A VM can have less: another image, a /dev/shm mounted smaller.
After the setup vm_run reads both over SSH (``df`` of /dev/shm, MemTotal of /proc/meminfo) and checks
each experiment's budget against them, before shipping HEAD and before anything is downloaded; one
that does not fit stops the run with the key to change, and the VM is deleted as after a failed setup.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import DictConfig

from mtpipe.cloud import vm_config
from mtpipe.cloud.vm_ssh import Remote, run
from mtpipe.maxtext import budget, preflight

# /dev/shm's size in bytes, then MemTotal in KiB
PROBE = r"""set -eo pipefail
df -B1 --output=size /dev/shm | tail -n 1
sed -n 's/^MemTotal: *\([0-9]*\) kB$/\1/p' /proc/meminfo"""


def read_host(remote: Remote, name: str) -> budget.Host:
    """What VM ``name`` has: its RAM (MemTotal) and the size of its /dev/shm."""
    rc, out = run(remote, PROBE, stream=False)
    values = out.decode(errors="replace").split()
    if rc != 0 or len(values) != 2 or not all(v.isdigit() for v in values):
        raise vm_config.VmError(f"reading /dev/shm's size and MemTotal on VM {name} failed (exit {rc}): "
                                f"{out.decode(errors='replace').strip()}")
    shm_bytes, memory_kib = map(int, values)
    return budget.Host(memory_gib=memory_kib * 1024 / budget.GIB, shm_gib=shm_bytes / budget.GIB,
                       source=f"read on VM {name} after the setup")


def check(remote: Remote, cfg: DictConfig, root: Path, experiments: list[list[str]]) -> str:
    """Read the VM's RAM and /dev/shm and check every experiment's machine budget against them (a
    ConfigError naming the key to change when one does not fit); the line vm_run prints."""
    host = read_host(remote, cfg.name)
    machine = dataclasses.replace(vm_config.budget_machine(cfg), host=host)
    checked = [sets for sets in experiments if preflight.budget_on_vm(sets, machine, root) is not None]
    table = budget.HOSTS.get(machine.tpu or "")
    told = (f" (Google's table: {table.memory_gib * budget.GIB / budget.GB:,.0f} GB, /dev/shm "
            f"{table.shm_gib * budget.GIB / budget.GB:,.0f} GB)") if table else ""
    what = "the machine budget fits them" if checked else ("no machine budget to hold them to (no branch "
                                                           "trains on this VM's TPU, or its model files are not here)")
    return (f"VM {cfg.name} has {host.memory_gib * budget.GIB / budget.GB:,.0f} GB of RAM and a /dev/shm of "
            f"{host.shm_gib * budget.GIB / budget.GB:,.0f} GB{told}: {what}")
