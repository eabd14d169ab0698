"""Creating the VM (:class:`Creation`, a part of the lifecycle that works on its :class:`~.base.Vm`): in the first of its zones with room (after a stockout the
next zone, after a regional quota error the next region, rounds of the zones while a stockout lasts),
a transient refusal retried, a Flex-start VM waited on while PENDING, every zone left holding nothing of
it; recorded in the state file before each insert, and reached over SSH once it runs."""

from __future__ import annotations

import getpass
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtpipe.cloud.lifecycle.base import FIREWALL_LABEL, PROVISIONING_LABEL, RUN_LABEL, USER_LABEL, Vm
from mtpipe.cloud.lifecycle.lines import _say, creation_line
from mtpipe.cloud.on_vm import ssh
from mtpipe.cloud.providers import interrupts
from mtpipe.cloud.providers.interface import (SETTLING, WAITING_FOR_CAPACITY, CapacityError, ProviderError,
                                              MaxRunDurationRefused, QuotaExceeded, TryAgain, region)
from mtpipe.cloud.settings import vm_config, vm_state
from mtpipe.cloud.settings.vm_config import VmConfig

STOCKOUT_MAX_WAIT_S = 300  # the longest wait between two rounds of the zones during a stockout
# A transient refusal of an insert (Compute's RETRY_CODES: RESOURCE_NOT_READY, RESOURCE_OPERATION_RATE_EXCEEDED) is
# retried in the same zone this many times, after waits of INSERT_RETRY_FIRST_WAIT_S doubled each time, then
# the zone is left as after a stockout.
INSERT_RETRIES = 3
INSERT_RETRY_FIRST_WAIT_S = 10.0


class Creation:
    """Creates ``vm``'s VM: :meth:`create` (the firewall rule, :meth:`create_vm` with the insert's
    failover, the ledger), and :meth:`connect` to it over SSH."""

    def __init__(self, vm: Vm) -> None:
        self.vm = vm

    def create(self, state: dict) -> Any:
        """Create the firewall rule (it may exist) and the VM (:meth:`create_vm`: in the first zone
        with room), print the price, add it to the ledger.

        The VM (name, zone, run id, when the insert went out) is recorded in the state file before
        each insert is sent, so `doit vm_status` / `vm_down` find it even when this process dies
        during the insert. An insert that fails, times out or is interrupted is followed until
        Compute says whether the VM exists (:meth:`_abandon`): the run is abandoned, so a VM that
        exists is deleted."""
        cfg = self.vm.cfg
        public_key = ssh.ssh_public_key(cfg)
        run_id = secrets.token_hex(4)
        labels = {**cfg.labels, RUN_LABEL: run_id, USER_LABEL: vm_config.label_value(getpass.getuser()),
                  PROVISIONING_LABEL: cfg.provisioning, FIREWALL_LABEL: cfg.firewall.name}
        before = dict(state)
        state.pop("host_key", None)   # a new VM, a new host key
        state["run_id"] = run_id
        _record_insert(self.vm.root, cfg, state)
        try:
            self.vm.cloud.open_ssh(cfg, labels)   # a global rule: it admits SSH to the VM in any zone
            instance = self.create_vm(public_key, labels, state)
        except BaseException as e:
            self._abandon(e, before)
            raise
        vm_state.vm_started(state, self.vm.cfg, instance.creation_timestamp)
        return instance

    def _abandon(self, error: BaseException, before: dict) -> None:
        """The insert gave no VM (refused, failed, timed out, interrupted): clear its zone
        (:meth:`_clear_zone`), delete the firewall rule, and put the state file back as it was before
        the insert. A VM that
        cannot be deleted stays recorded, for `doit vm_down`. Signals are ignored meanwhile."""
        cfg, timeout_s = self.vm.cfg, float(self.vm.cfg.operation_timeout_s)
        with interrupts.ignored():
            if isinstance(error, KeyboardInterrupt):
                _say(f"interrupted while creating VM {cfg.name}: waiting (at most {timeout_s:g} s) until "
                     "Compute has finished the insert, then deleting the VM")
            try:
                self._clear_zone()
                self.vm.delete_vm(None, cfg.firewall.name)
            except ProviderError as e:
                _say(f"could not delete VM {cfg.name} ({e}); {vm_state.STATE_FILE} still records it: "
                     "`doit vm_down` deletes it")
                return
            if before:
                vm_state.write_state(self.vm.root, before)
            else:
                vm_state.clear_state(self.vm.root)

    def create_vm(self, public_key: str, labels: dict[str, str], state: dict | None = None) -> Any:
        """Create the VM in the first of its zones (vm_config.candidate_zones) that has room, as
        SkyPilot's failover does: after a stockout the next zone at once, after a quota error the next
        zone of another region (Compute's TPU quotas are regional; an ..._ALL_REGIONS one stops
        here), or the next zone after a per-zone one (the Cloud TPU API's). Each zone left is left empty (:meth:`_leave`), and what was tried and why it moved on is
        printed. When every zone is out of stock, the zones are tried again after doubling waits for
        ``stockout.retry_for_s``, then the error names the zones tried and the other zones that offer
        the machine type. ``state`` (the state file's record) gets each insert's zone before the insert.
        A reservation-bound VM whose maxRunDuration Compute refuses is created once more without it."""
        cfg = self.vm.cfg
        zones, spent = vm_config.candidate_zones(cfg), set()   # spent: regions (or zones) whose quota is spent
        deadline, wait = time.monotonic() + cfg.stockout.retry_for_s, cfg.stockout.first_wait_s
        quota: QuotaExceeded | None = None
        while True:
            tried, stockout, full = [], None, set()   # full: regions out of stock this round
            for zone in zones:
                if region(zone) in spent | full or zone in spent:
                    continue
                self.vm.move_to(zone)
                try:
                    return self._insert(public_key, labels, state)
                except CapacityError as err:
                    stockout, why = err, f"no {cfg.machine_type} free there now (stockout: {err})"
                    if err.region_wide:
                        full.add(region(zone))
                        why += f"; skipping the other zones of region {region(zone)} this round"
                except QuotaExceeded as err:
                    if err.global_quota:
                        raise
                    if err.per_zone:
                        quota, why = err, f"the quota of zone {zone} is spent ({err})"
                        spent.add(zone)
                    else:
                        quota, why = err, f"the quota of region {region(zone)} is spent ({err})"
                        spent.add(region(zone))
                self._leave(why)
                tried.append(zone)
            if stockout is None:   # every zone's region is out of quota
                raise QuotaExceeded(f"{quota}; zones tried: {', '.join(tried)} (zones in conf/vm.yaml)", False)
            left = deadline - time.monotonic()
            if left <= 0:
                others = [z for z in self.vm.cloud.zones_offering(cfg.machine_type) if z not in zones]
                raise CapacityError(
                    f"{stockout}; zones tried: {', '.join(tried)}, for {cfg.stockout.retry_for_s:g} s. Other zones "
                    f"that offer {cfg.machine_type}: {', '.join(others) or 'none'} (add them to zones: in "
                    "conf/vm.yaml; or a reservation, or raise stockout.retry_for_s)") from None
            _say(f"no {cfg.machine_type} free in {', '.join(tried)} now (stockout); trying again in "
                 f"{min(wait, left):.0f} s (for {left:.0f} s more: stockout.retry_for_s)")
            time.sleep(min(wait, left))
            wait = min(wait * 2, STOCKOUT_MAX_WAIT_S)

    def _insert(self, public_key: str, labels: dict[str, str], state: dict | None) -> Any:
        """One insert in ``cfg.zone``, its price printed and (with ``state``) recorded first; a transient
        refusal (TryAgain) retried INSERT_RETRIES times after doubling waits, then a CapacityError; a
        Flex-start VM waited on until it has capacity (:meth:`await_capacity`)."""
        cfg = self.vm.cfg
        _say(creation_line(cfg, self.vm.cloud.provisioning_model(cfg)))
        if state is not None:
            _record_insert(self.vm.root, cfg, state)
        retries, wait = 0, INSERT_RETRY_FIRST_WAIT_S
        while True:
            try:
                return self.await_capacity(self.vm.cloud.create_vm(cfg, public_key, labels))
            except MaxRunDurationRefused as err:
                _say(f"Compute refused maxRunDuration for reservation-bound VM {cfg.name} ({err}); creating it "
                     "once more without it. This VM is then not deleted automatically after max_run_duration_s: "
                     "vm_run still deletes it when the run ends, unless --keep; Compute when the reservation ends; "
                     "otherwise `doit vm_down`")
                self.vm.cfg = cfg = cfg.model_copy(update={"max_run_duration_s": 0})
            except TryAgain as err:
                if retries == INSERT_RETRIES:
                    raise CapacityError(f"{err}; the same after {INSERT_RETRIES} retries") from err
                retries += 1
                self._clear_zone()
                _say(f"{err}: the same insert again in {wait:g} s (retry {retries} of {INSERT_RETRIES})")
                time.sleep(wait)
                wait *= 2

    def await_capacity(self, instance: Any) -> Any:
        """``instance`` once it has capacity. A Flex-start VM is PENDING while Compute looks for its
        capacity: it is waited on, said every flex_start.poll_s, until it is RUNNING (returned); one
        that disappears (its request window, flex_start.request_valid_for_s, expired) or is still
        PENDING a poll after that window is a stockout (CapacityError), whose zone the caller clears."""
        cfg = self.vm.cfg
        if instance.status != WAITING_FOR_CAPACITY:
            return instance
        window, poll = float(cfg.flex_start.request_valid_for_s), float(cfg.flex_start.poll_s)
        start = time.monotonic()
        while instance is not None and instance.status in (WAITING_FOR_CAPACITY, *SETTLING):
            waited = time.monotonic() - start
            if waited > window + poll:
                raise CapacityError(f"Flex-start VM {cfg.name} is still {instance.status} in {cfg.zone} after its "
                                    f"request window ({window:g} s, flex_start.request_valid_for_s)")
            _say(f"VM {cfg.name} is {instance.status} in {cfg.zone}: Compute is looking for its capacity ({waited:.0f} "
                 f"s so far, at most {window:g} s: flex_start.request_valid_for_s); Ctrl-C deletes it")
            time.sleep(poll)
            instance = self.vm.cloud.get_instance(cfg.name)
        if instance is None:
            raise CapacityError(f"Flex-start VM {cfg.name} got no capacity in {cfg.zone} within its request window "
                                f"({window:g} s, flex_start.request_valid_for_s): Compute removed it")
        return instance

    def _leave(self, why: str) -> None:
        """After a failed insert in ``cfg.zone``: clear the zone (:meth:`_clear_zone`), say why the run
        moves on."""
        self._clear_zone()
        _say(f"leaving zone {self.vm.cfg.zone}: {why}; nothing of VM {self.vm.cfg.name} is left there")

    def _clear_zone(self) -> None:
        """After a failed or interrupted insert in ``cfg.zone``: wait (at most operation_timeout_s) until
        Compute has settled whether the VM exists there, delete it if it does, and a boot disk it left."""
        cfg, cloud = self.vm.cfg, self.vm.cloud
        if cloud.settle(cfg.name, float(cfg.operation_timeout_s)) is not None:
            _say(f"VM {cfg.name}: {'deleted' if cloud.delete_instance(cfg.name) else 'already gone'}")
        try:
            if cloud.delete_orphan_disk(cfg.name):
                _say(f"disk {cfg.name} in {cfg.zone}, left by the failed insert: deleted")
        except ProviderError as err:   # a disk costs little: said, not a reason to stop here
            _say(f"could not look for a disk {cfg.name} left in {cfg.zone} ({err}): `gcloud compute disks list "
                 f"--filter=name={cfg.name} --project {cfg.project}` shows one, `gcloud compute disks delete` deletes it")

    def connect(self, state: dict, instance: Any, created: bool) -> ssh.Remote:
        """Record the VM in the state file, wait until its sshd takes our key (pinning its host key)."""
        cfg = self.vm.cfg
        state.update(_recorded(cfg), created=instance.creation_timestamp)
        vm_state.write_state(self.vm.root, state)
        try:
            remote = self.vm.remote(state)   # inside: a new VM without an address is deleted too
            state["host_key"] = ssh.wait_ready(remote, float(cfg.ssh.ready_timeout_s))
        except BaseException:
            if created and not self.vm.keep:
                _say(f"VM {cfg.name} is unreachable; deleting it (use --keep to keep it)")
                self.vm.delete()
            raise
        vm_state.write_state(self.vm.root, state)
        remote.host_key = state["host_key"]
        _say(f"VM {cfg.name} ready at {remote.host}:{remote.port}")
        return remote


def _record_insert(root: Path, cfg: VmConfig, state: dict) -> None:
    """Record in the state file the VM an insert in ``cfg.zone`` is about to create."""
    state.update(_recorded(cfg), created=None, insert_sent=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    vm_state.write_state(root, state)


def _recorded(cfg: VmConfig) -> dict[str, Any]:
    """What the state file records of the VM ``cfg`` describes."""
    return {"project": cfg.project, "zone": cfg.zone, "name": cfg.name, "firewall": cfg.firewall.name,
            "provisioning": cfg.provisioning, "max_run_duration_s": int(cfg.max_run_duration_s),
            "os_login": cfg.ssh.os_login is True, "ssh_user": cfg.ssh.user}
