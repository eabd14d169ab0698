"""Recovering a lost VM (:class:`Recovery`, a part of the lifecycle): a preempted, stopped or vanished
VM is replaced and the attempt run again, at most ``max_recoveries`` times; never one that `doit
vm_down` deleted or that ran out of time (max_run_duration_s)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import datetime, timezone

from mtpipe.cloud.lifecycle import notify
from mtpipe.cloud.lifecycle.base import Vm
from mtpipe.cloud.lifecycle.creation import Creation
from mtpipe.cloud.lifecycle.lines import _say
from mtpipe.cloud.on_vm import ssh
from mtpipe.cloud.settings import vm_config, vm_state


class Recovery:
    """Replaces ``vm``'s VM through ``creation`` when it is lost: :meth:`run`."""

    def __init__(self, vm: Vm, creation: Creation) -> None:
        self.vm, self.creation = vm, creation

    def lost(self) -> str | None:
        """Why the VM can no longer run the pipeline (preempted, stopped, gone), or None while it
        is RUNNING: then a failed command is the pipeline's failure, not the VM's.

        Raises VmError when the VM must not be replaced: `doit vm_down` deleted it (the state file
        no longer records it), or it reached max_run_duration_s (the spending limit).
        """
        cfg, root = self.vm.cfg, self.vm.root
        instance = self.vm.cloud.get_instance(cfg.name)
        if instance is not None and instance.status == "RUNNING":
            return None
        state = vm_state.read_state(root)
        if state.get("name") != cfg.name:
            raise vm_config.VmError(f"VM {cfg.name} was deleted during the run (`doit vm_down`?): not replaced")
        limit = int(cfg.max_run_duration_s)
        age = (datetime.now(timezone.utc) - datetime.fromisoformat(state["created"])).total_seconds()
        if instance is None and limit and age >= limit:
            raise vm_config.VmError(f"VM {cfg.name} reached max_run_duration_s ({limit} s) and Compute "
                             "deleted it: raise max_run_duration_s in conf/vm.yaml (0: no limit) for "
                             "longer runs")
        spot = cfg.provisioning == "spot"
        if instance is None:
            why = "was preempted and deleted by Compute" if spot else "was deleted by someone else"
        else:
            why = f"was {'preempted' if spot else 'stopped by Compute'} (status {instance.status})"
        vm_state.vm_ended(state, why)
        vm_state.write_state(root, state)
        return why

    def replace(self) -> ssh.Remote:
        """Delete the lost VM (a preempted Spot VM cannot be restarted) and create a new one."""
        self.vm.cloud.delete_instance(self.vm.cfg.name)
        state = vm_state.read_state(self.vm.root)
        return self.creation.connect(state, self.creation.create(state), created=True)

    def run(self, remote: ssh.Remote, attempt: Callable[[ssh.Remote], None]) -> None:
        """Run `attempt` on the VM; when it fails because the VM was lost, replace the VM and run
        it again, at most `max_recoveries` times (a managed job: the pipeline resumes from the
        bucket)."""
        cfg = self.vm.cfg
        limit = int(cfg.max_recoveries)
        for recovery in itertools.count(1):
            try:
                attempt(remote)
                return
            except vm_config.VmError as e:
                why = self.lost()
                if why is None:
                    raise
                if recovery > limit:
                    raise vm_config.VmLost(f"VM {cfg.name} {why} ({e}); it was replaced {limit} times "
                                    f"already (max_recoveries: {limit}), so vm_run gives up and deletes "
                                    "it. Rerun later, raise max_recoveries in conf/vm.yaml, or use "
                                    "--provisioning=reservation or on-demand") from e
                _say(f"recovery {recovery} of {limit}: VM {cfg.name} {why} ({e}); deleting "
                     f"it and creating a new {cfg.provisioning} VM, then setup and the pipeline again")
                remote = self.replace()
                notify.send(notify.Event.RECOVERED, cfg.name, f"VM {cfg.name} {why}; recovery {recovery} of "
                            f"{limit}: a new {cfg.provisioning} VM is ready and runs setup and the pipeline "
                            "again, resuming from the bucket.", _say)
