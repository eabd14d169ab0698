"""The TPU VM's life: create, reach, run, recover, delete; what `doit vm_*` tasks drive.

:class:`VmLifecycle` holds the rules (checks before spending, a price to confirm before the first
insert, one VM per state file, delete on failure unless kept, replace a lost VM at most
``max_recoveries`` times, never replace one that ran out of time); the cloud behind it is a
:class:`~mtpipe.cloud.providers.interface.Provider` (Compute Engine: mtpipe.cloud.providers.gcp.compute.Compute).
What happens on the VM over SSH is in vm_ssh (the connection), vm_setup (the environment), vm_host
(its RAM and /dev/shm against the machine budget) and vm_experiments (shipping the code, the
pipeline as DVC experiments).
"""

from __future__ import annotations

import functools
import getpass
import itertools
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mtpipe.cloud import notify
from mtpipe.cloud.checks import host, identity, prerequisites, tpu
from mtpipe.cloud.checks.forecast import cached_forecasts, check_spot_resume
from mtpipe.cloud.checks.project import check_project
from mtpipe.cloud.on_vm import dvc_experiments, run_status, setup, ssh
from mtpipe.cloud.providers import interrupts
from mtpipe.cloud.providers.gcp import ssh_route
from mtpipe.cloud.providers.gcp.compute import compute_engine
from mtpipe.cloud.providers.interface import (SETTLING, WAITING_FOR_CAPACITY, CapacityError, GcpError,
                                              MaxRunDurationRefused, Provider, QuotaExceeded, TryAgain, region)
from mtpipe.cloud.settings import prices, vm_config, vm_state
from mtpipe.errors import ConfigError
from mtpipe.planning import preflight as preflight_checks, run_forecast

STOCKOUT_MAX_WAIT_S = 300  # the longest wait between two rounds of the zones during a stockout
# A transient refusal of an insert (Compute's RETRY_CODES: RESOURCE_NOT_READY, RESOURCE_OPERATION_RATE_EXCEEDED) is
# retried in the same zone this many times, after waits of INSERT_RETRY_FIRST_WAIT_S doubled each time, then
# the zone is left as after a stockout.
INSERT_RETRIES = 3
INSERT_RETRY_FIRST_WAIT_S = 10.0
# Labels every VM gets besides conf/vm.yaml's `labels` (app: mtpipe); firewall rules, which have no
# labels, carry them in their description.
RUN_LABEL = "mtpipe-run"                    # a fresh id per VM creation
USER_LABEL = "created-by"
PROVISIONING_LABEL = "mtpipe-provisioning"  # reservation / spot / on-demand: its price
FIREWALL_LABEL = "mtpipe-firewall"          # the SSH rule made for it


def spend_line(state: dict) -> str:
    """What the VMs of this run (the one recorded, and those it replaced) cost so far."""
    spent = vm_state.spend(state)
    replaced = f", {spent.count - 1} of them replaced after being lost" if spent.count > 1 else ""
    line = f"this run's VMs: {spent.count}{replaced}; {spent.hours:.2f} h in all"
    if not spent.reservations:
        return f"{line}, about {spent.usd:.2f} USD"
    paid = prices.paid_by(", ".join(sorted(spent.reservations)), f"{spent.reserved_usd:.2f} USD")
    if spent.reserved_count == spent.count:
        return f"{line}, {paid}"
    return f"{line}: about {spent.usd:.2f} USD, and {spent.reserved_hours:.2f} h {paid}"


def creation_line(cfg: DictConfig, model: str) -> str:
    """What vm_up says before creating the VM: its kind, what it costs, when Compute deletes it."""
    rate, hours = prices.vm_rate(cfg), int(cfg.max_run_duration_s) / 3600
    kind = f"reservation {cfg.reservation}, {model}" if rate.reservation else cfg.provisioning
    if not hours:
        limit = "NO time limit (max_run_duration_s: 0): `doit vm_down` when done."
    elif model == "RESERVATION_BOUND":
        limit = (f"maxRunDuration {hours:g} h is sent, but it is not known to be honoured for "
                 "reservation-bound VMs: delete the VM with `doit vm_down` (Compute deletes it when the "
                 "reservation ends).")
    else:
        most = "" if rate.reservation else f" (at most {hours * rate.usd_per_hour:.2f} USD)"
        limit = f"Compute deletes it after {hours:g} h{most}."
    if model == "FLEX_START":
        limit = (f"Compute looks for capacity for up to {float(cfg.flex_start.request_valid_for_s):g} s "
                 f"(flex_start.request_valid_for_s); {limit}")
    billed = "" if rate.reservation else " while it exists"
    return f"creating {cfg.machine_type} VM {cfg.name} ({kind}) in {cfg.zone}: {rate.describe()}{billed}; {limit}"


def forecast_line(cfg: DictConfig, forecasts: list[dict[str, Any]]) -> str:
    """What the whole run takes and costs by preflight's forecast (its rows: the total `doit preflight`
    prints, mtpipe.planning.run_forecast) and what that counts, or why there is none."""
    if not forecasts:
        return ("no forecast of the run's length (no branch trains on a TPU, or --no-preflight): the VM bills "
                "until the run ends and it is deleted")
    run = run_forecast.forecast(forecasts)
    rate = prices.vm_rate(cfg)
    cost = prices.paid_by(rate.reservation, run.usd_text()) if rate.reservation else run.usd_text()
    return f"forecast (doit preflight): the run {run.hours_text()}, {cost}; it holds {run.holds()}"


def _say(line: str) -> None:
    try:
        print(f"mtpipe: {line}", flush=True)
    except OSError:   # the terminal is gone (SIGHUP): the cleanup goes on without it
        pass


def _since(created: str, usd_per_hour: float, reservation: str | None = None) -> str:
    """How long a VM has existed and what it cost so far (a reservation's VM: paid by it)."""
    since = datetime.fromisoformat(created)
    hours = (datetime.now(timezone.utc) - since).total_seconds() / 3600
    so_far = f"{hours * usd_per_hour:.2f} USD so far at {usd_per_hour:.2f} USD/h"
    return f"since {since.isoformat()} ({hours:.2f} h): " + (
        prices.paid_by(reservation, so_far) if reservation else f"about {so_far}")


class VmLifecycle:
    """The VM ``cfg`` names, recorded in ``root``'s state file (.vm_state.json).

    ``keep``: a VM survives a failure or an interrupt of the task (never a loss: a lost VM cannot
    be restarted). ``yes``: create without asking (--yes); else the price is confirmed on the
    terminal, and without one nothing is created. ``provider`` makes the cloud for a config (tests
    pass a loopback one)."""

    def __init__(self, cfg: DictConfig, root: Path, keep: bool = False, yes: bool = False,
                 provider: Callable[[DictConfig], Provider] = compute_engine) -> None:
        self.cfg, self.root, self.keep, self.yes, self._provider = cfg, root, keep, yes, provider

    @functools.cached_property
    def cloud(self) -> Provider:
        """The provider's client for ``cfg``'s zone, made once per lifecycle."""
        return self._provider(self.cfg)

    def remote(self, state: dict | None = None) -> ssh.Remote:
        """How to reach the VM, after checking with the cloud that it still exists."""
        cfg, state = self.cfg, vm_state.read_state(self.root) if state is None else state
        cloud = self.cloud
        instance = cloud.get_instance(cfg.name)
        if instance is None:
            raise vm_config.VmError(f"VM {cfg.name} does not exist in {cfg.project}/{cfg.zone} (deleted, or "
                             "max_run_duration_s ran out): create it with `doit vm_up`")
        ip = cloud.address(instance)
        if not ip and not ssh_route.proxy_command(cfg):
            raise vm_config.VmError(f"VM {cfg.name} has no external IP: set external_ip: false (SSH "
                                    "through IAP) or ssh.proxy_command in conf/vm.yaml")
        host_key = state.get("host_key") if state.get("name") == cfg.name else None
        return ssh.Remote.from_config(cfg, ip or cfg.name, host_key)

    # ------------------------------------------------------------ create and delete

    def ensure(self, experiments: list[list[str]], may_create: bool, preflight: bool = False,
               target: str | None = None) -> ssh.Remote:
        """The VM, reachable over SSH: reused when it exists, else created (:meth:`_ensure`);
        SIGTERM and SIGHUP meanwhile clean up as Ctrl-C does."""
        with interrupts.raising():
            return self._ensure(experiments, may_create, preflight, target)

    def _ensure(self, experiments: list[list[str]], may_create: bool, preflight: bool,
                target: str | None) -> ssh.Remote:
        """The VM, reachable over SSH: reused when it exists, else created.

        PROJECT, ZONE, RESERVATION and the credentials are checked first, all named at once. Before
        creating anything every check before spending runs (prerequisites.before_spending, what `doit
        check` runs) for the `--set` values of every experiment, and one error lists every failure; a
        VM that exists only gets the project checks and the Spot one (check_spot_resume,
        with preflight's cached forecast). `preflight` then AOT-compiles the TPU branches (after the
        quick checks: a compile takes minutes the first time) and forecasts the run up to the DVC
        `target` (None: the whole pipeline), the price asked for. `may_create`
        False refuses to replace a VM that .vm_state.json records but the cloud no longer has (vm_run
        without --recreate).
        """
        cfg, root = self.cfg, self.root
        state = vm_state.read_state(root)
        prerequisites.check_settings(cfg)   # before any request
        for line in vm_config.check_create(cfg):
            _say(line)
        cloud = self.cloud
        recorded = (state.get("project"), state.get("zone"), state.get("name"))
        if state and recorded != (cfg.project, cfg.zone, cfg.name):
            other = self._provider(OmegaConf.merge(cfg, {"project": state["project"], "zone": state["zone"]}))
            if other.get_instance(state["name"]) is not None:
                raise ConfigError("vm.name", f"{vm_state.STATE_FILE} tracks another VM, {state['name']} in "
                                  f"{state['project']}/{state['zone']}",
                                  "delete it first with `doit vm_down`, or use its name/zone/project")
            state = {}
        instance = cloud.get_instance(cfg.name)
        if instance is not None and instance.status in SETTLING:   # an insert another run sent
            _say(f"VM {cfg.name} is {instance.status}: waiting until Compute has created it")
            instance = cloud.settle(cfg.name, float(cfg.operation_timeout_s))
        if instance is not None and instance.status == WAITING_FOR_CAPACITY:   # a Flex-start request another run sent
            _say(f"VM {cfg.name} is {instance.status}: an earlier run's Flex-start request; waiting for its capacity")
            instance = self._await_capacity(instance)
        created, unproven = instance is None, []
        if instance is not None:
            _say(f"reusing VM {cfg.name} ({instance.status}) in {cfg.zone}")
            vm_config.use_recorded_login(cfg, state)
            check_project(cfg, root, experiments)
            check_spot_resume(cfg, cached_forecasts(cfg, root, experiments)[0])
            if not state.get("vms"):   # created elsewhere: its cost counts from its creation
                vm_state.vm_started(state, cfg, instance.creation_timestamp)
        else:
            if state and not may_create:
                why = ("Compute deleted it after max_run_duration_s, or someone else did" if state.get("created")
                       else f"its insert, sent {state.get('insert_sent')}, never created it")
                raise vm_config.VmError(
                    f"VM {cfg.name}, recorded in {vm_state.STATE_FILE} (created {state.get('created')}), no "
                    f"longer exists in {cfg.project}/{cfg.zone}: {why}. Rerun with --recreate to create "
                    f"a new one ({prices.vm_rate(cfg).describe()}), or `doit vm_down` to forget it")
            _say("checks before spending: Compute, the network and SSH, the presets with the --set values, "
                 "HF_TOKEN, the DVC remote, your APIs and permissions, the VM's service account")
            unproven = prerequisites.before_spending(cfg, cloud, root, experiments)
        forecasts = []
        if preflight:
            rate = prices.vm_rate(cfg)
            for sets in experiments:
                forecasts += preflight_checks.run(sets, rate.price.usd, vm_config.budget_machine(cfg), root,
                                                  committed=True, price_basis=rate.per_chip(), target=target)
        if created:
            self._confirm(forecasts)
            state = {}
            instance = self._create(state)
        remote = self._connect(state, instance, created)
        if created and unproven:   # before any setup minute; the VM is deleted unless --keep
            self.guarded(lambda: identity.probe_from_vm(remote, cfg, unproven))
        return remote

    def _confirm(self, forecasts: list[dict[str, Any]]) -> None:
        """Say what is about to be created, its price and the run's forecast, and ask (the last step
        before the first insert, after every check): ``yes`` answers for a script; without a terminal
        to ask on, nothing is created."""
        cfg = self.cfg
        what = creation_line(cfg, self.cloud.provisioning_model(cfg)).replace("creating ", "about to create ", 1)
        _say(what)
        _say(forecast_line(cfg, forecasts))
        if self.yes:
            return
        if not sys.stdin.isatty():
            raise ConfigError("--yes", "is needed to create a VM when there is no terminal to ask on",
                              "rerun with --yes once the price above is right")
        try:
            answer = input("mtpipe: create it? [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            raise vm_config.VmError(f"VM {cfg.name} not created (answered {answer.strip() or 'nothing'!r}); "
                                    "nothing was spent")

    def _create(self, state: dict) -> Any:
        """Create the firewall rule (it may exist) and the VM (:meth:`create_vm`: in the first zone
        with room), print the price, add it to the ledger.

        The VM (name, zone, run id, when the insert went out) is recorded in the state file before
        each insert is sent, so `doit vm_status` / `vm_down` find it even when this process dies
        during the insert. An insert that fails, times out or is interrupted is followed until
        Compute says whether the VM exists (:meth:`_abandon`): the run is abandoned, so a VM that
        exists is deleted."""
        cfg = self.cfg
        public_key = ssh.ssh_public_key(cfg)
        run_id = secrets.token_hex(4)
        labels = {**cfg.labels, RUN_LABEL: run_id, USER_LABEL: vm_config.label_value(getpass.getuser()),
                  PROVISIONING_LABEL: cfg.provisioning, FIREWALL_LABEL: cfg.firewall.name}
        before = dict(state)
        state.pop("host_key", None)   # a new VM, a new host key
        state["run_id"] = run_id
        _record_insert(self.root, cfg, state)
        try:
            self.cloud.open_ssh(cfg, labels)   # a global rule: it admits SSH to the VM in any zone
            instance = self.create_vm(public_key, labels, state)
        except BaseException as e:
            self._abandon(e, before)
            raise
        vm_state.vm_started(state, cfg, instance.creation_timestamp)
        return instance

    def _abandon(self, error: BaseException, before: dict) -> None:
        """The insert gave no VM (refused, failed, timed out, interrupted): clear its zone
        (:meth:`_clear_zone`), delete the firewall rule, and put the state file back as it was before
        the insert. A VM that
        cannot be deleted stays recorded, for `doit vm_down`. Signals are ignored meanwhile."""
        cfg, timeout_s = self.cfg, float(self.cfg.operation_timeout_s)
        with interrupts.ignored():
            if isinstance(error, KeyboardInterrupt):
                _say(f"interrupted while creating VM {cfg.name}: waiting (at most {timeout_s:g} s) until "
                     "Compute has finished the insert, then deleting the VM")
            try:
                self._clear_zone()
                self._delete_vm(None, cfg.firewall.name)
            except GcpError as e:
                _say(f"could not delete VM {cfg.name} ({e}); {vm_state.STATE_FILE} still records it: "
                     "`doit vm_down` deletes it")
                return
            if before:
                vm_state.write_state(self.root, before)
            else:
                vm_state.clear_state(self.root)

    def create_vm(self, public_key: str, labels: dict[str, str], state: dict | None = None) -> Any:
        """Create the VM in the first of its zones (vm_config.candidate_zones) that has room, as
        SkyPilot's failover does: after a stockout the next zone at once, after a quota error the next
        zone of another region (Compute's TPU quotas are regional; an ..._ALL_REGIONS one stops
        here). Each zone left is left empty (:meth:`_leave`), and what was tried and why it moved on is
        printed. When every zone is out of stock, the zones are tried again after doubling waits for
        ``stockout.retry_for_s``, then the error names the zones tried and the other zones that offer
        the machine type. ``state`` (the state file's record) gets each insert's zone before the insert.
        A reservation-bound VM whose maxRunDuration Compute refuses is created once more without it."""
        cfg = self.cfg
        zones, spent = vm_config.candidate_zones(cfg), set()   # spent: regions whose quota is spent
        deadline, wait = time.monotonic() + cfg.stockout.retry_for_s, cfg.stockout.first_wait_s
        quota: QuotaExceeded | None = None
        while True:
            tried, stockout, full = [], None, set()   # full: regions out of stock this round
            for zone in zones:
                if region(zone) in spent | full:
                    continue
                self._move_to(zone)
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
                    quota, why = err, f"the quota of region {region(zone)} is spent ({err})"
                    spent.add(region(zone))
                self._leave(why)
                tried.append(zone)
            if stockout is None:   # every zone's region is out of quota
                raise QuotaExceeded(f"{quota}; zones tried: {', '.join(tried)} (zones in conf/vm.yaml)", False)
            left = deadline - time.monotonic()
            if left <= 0:
                others = [z for z in self.cloud.zones_offering(cfg.machine_type) if z not in zones]
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
        Flex-start VM waited on until it has capacity (:meth:`_await_capacity`)."""
        cfg = self.cfg
        _say(creation_line(cfg, self.cloud.provisioning_model(cfg)))
        if state is not None:
            _record_insert(self.root, cfg, state)
        retries, wait = 0, INSERT_RETRY_FIRST_WAIT_S
        while True:
            try:
                return self._await_capacity(self.cloud.create_vm(cfg, public_key, labels))
            except MaxRunDurationRefused as err:
                _say(f"Compute refused maxRunDuration for reservation-bound VM {cfg.name} ({err}); creating it "
                     "once more without it. This VM is then not deleted automatically after max_run_duration_s: "
                     "vm_run still deletes it when the run ends, unless --keep; Compute when the reservation ends; "
                     "otherwise `doit vm_down`")
                cfg.max_run_duration_s = 0
            except TryAgain as err:
                if retries == INSERT_RETRIES:
                    raise CapacityError(f"{err}; the same after {INSERT_RETRIES} retries") from err
                retries += 1
                self._clear_zone()
                _say(f"{err}: the same insert again in {wait:g} s (retry {retries} of {INSERT_RETRIES})")
                time.sleep(wait)
                wait *= 2

    def _await_capacity(self, instance: Any) -> Any:
        """``instance`` once it has capacity. A Flex-start VM is PENDING while Compute looks for its
        capacity: it is waited on, said every flex_start.poll_s, until it is RUNNING (returned); one
        that disappears (its request window, flex_start.request_valid_for_s, expired) or is still
        PENDING a poll after that window is a stockout (CapacityError), whose zone the caller clears."""
        cfg = self.cfg
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
            instance = self.cloud.get_instance(cfg.name)
        if instance is None:
            raise CapacityError(f"Flex-start VM {cfg.name} got no capacity in {cfg.zone} within its request window "
                                f"({window:g} s, flex_start.request_valid_for_s): Compute removed it")
        return instance

    def _move_to(self, zone: str) -> None:
        """Make ``zone`` the VM's zone, and the cloud's client that zone's."""
        self.cfg.zone = zone
        if self.cloud.zone != zone:
            del self.__dict__["cloud"]   # functools.cached_property: made again for cfg.zone

    def _leave(self, why: str) -> None:
        """After a failed insert in ``cfg.zone``: clear the zone (:meth:`_clear_zone`), say why the run
        moves on."""
        self._clear_zone()
        _say(f"leaving zone {self.cfg.zone}: {why}; nothing of VM {self.cfg.name} is left there")

    def _clear_zone(self) -> None:
        """After a failed or interrupted insert in ``cfg.zone``: wait (at most operation_timeout_s) until
        Compute has settled whether the VM exists there, delete it if it does, and a boot disk it left."""
        cfg, cloud = self.cfg, self.cloud
        if cloud.settle(cfg.name, float(cfg.operation_timeout_s)) is not None:
            _say(f"VM {cfg.name}: {'deleted' if cloud.delete_instance(cfg.name) else 'already gone'}")
        try:
            if cloud.delete_orphan_disk(cfg.name):
                _say(f"disk {cfg.name} in {cfg.zone}, left by the failed insert: deleted")
        except GcpError as err:   # a disk costs little: said, not a reason to stop here
            _say(f"could not look for a disk {cfg.name} left in {cfg.zone} ({err}): `gcloud compute disks list "
                 f"--filter=name={cfg.name} --project {cfg.project}` shows one, `gcloud compute disks delete` deletes it")

    def _connect(self, state: dict, instance: Any, created: bool) -> ssh.Remote:
        """Record the VM in the state file, wait until its sshd takes our key (pinning its host key)."""
        cfg = self.cfg
        state.update(_recorded(cfg), created=instance.creation_timestamp)
        vm_state.write_state(self.root, state)
        try:
            remote = self.remote(state)   # inside: a new VM without an address is deleted too
            state["host_key"] = ssh.wait_ready(remote, float(cfg.ssh.ready_timeout_s))
        except BaseException:
            if created and not self.keep:
                _say(f"VM {cfg.name} is unreachable; deleting it (use --keep to keep it)")
                self.delete()
            raise
        vm_state.write_state(self.root, state)
        remote.host_key = state["host_key"]
        _say(f"VM {cfg.name} ready at {remote.host}:{remote.port}")
        return remote

    def delete(self) -> None:
        """Delete the VM and its firewall rule (each may already be gone); forget the state. A VM the
        state file does not record is looked for in each of its zones, the first found deleted.
        A second Ctrl-C, SIGTERM or the terminal closing does not stop it."""
        cfg = self.cfg
        with interrupts.ignored():
            state = vm_state.read_state(self.root)
            if state.get("name") != cfg.name:
                for zone in vm_config.candidate_zones(cfg):
                    self._move_to(zone)
                    if self.cloud.get_instance(cfg.name) is not None:
                        break
            self._delete_vm(cfg.name, cfg.firewall.name)
            if state.get("vms") and state.get("name") == cfg.name:
                vm_state.vm_ended(state, "deleted")
                _say(spend_line(state))
            vm_state.clear_state(self.root)

    def _delete_vm(self, name: str | None, firewall: str) -> None:
        """Delete VM ``name`` (None: there is none) and firewall rule ``firewall``, saying for each
        whether it was deleted or already gone."""
        if name is not None:
            _say(f"VM {name}: {'deleted' if self.cloud.delete_instance(name) else 'already gone'}")
        _say(f"firewall rule {firewall}: {'deleted' if self.cloud.delete_firewall(firewall) else 'already gone'}")

    def labelled(self) -> list[Any]:
        """The VMs in the zone that carry conf/vm.yaml's `labels` (app: mtpipe), whoever made them."""
        return self.cloud.list_instances({k: str(v) for k, v in self.cfg.labels.items()})

    def delete_labelled(self) -> None:
        """`doit vm_down` with no VM recorded and no --name / NAME: in each of the VM's zones
        (vm_config.candidate_zones), delete the VM ``cfg`` names (mtpipe-<user> by default) and every
        VM labelled with `labels` and created by this user (label created-by), each with its firewall
        rule; other users' VMs are named, not deleted. Finds what a fresh clone or another laptop has
        no state file for."""
        for zone in vm_config.candidate_zones(self.cfg):
            self._move_to(zone)
            self._delete_labelled_here()

    def _delete_labelled_here(self) -> None:
        """:meth:`delete_labelled` in ``cfg.zone``."""
        cfg, user = self.cfg, vm_config.label_value(getpass.getuser())
        found = {i.name: i for i in self.labelled()}
        mine = sorted(n for n, i in found.items() if dict(i.labels).get(USER_LABEL) == user)
        if cfg.name not in mine and self.cloud.get_instance(cfg.name) is not None:
            mine.insert(0, cfg.name)
        if not mine:
            _say(f"no VM {cfg.name}, and none labelled {_labels(cfg)} by {user}, in {cfg.project}/{cfg.zone}")
        for name in mine:
            labels = dict(found[name].labels) if name in found else {}
            firewall = labels.get(FIREWALL_LABEL) or (cfg.firewall.name if name == cfg.name else f"{name}-ssh")
            with interrupts.ignored():
                self._delete_vm(name, firewall)
        for name in sorted(set(found) - set(mine)):
            who = dict(found[name].labels).get(USER_LABEL, "someone else")
            _say(f"VM {name}, created by {who}, left alone: `doit vm_down --name {name}` deletes it")

    def guarded(self, body: Callable[[], None]) -> None:
        """Run body; on any failure, Ctrl-C or SIGTERM/SIGHUP delete the VM unless kept (a VM lost
        more often than max_recoveries is deleted anyway: a preempted VM cannot be restarted)."""
        with interrupts.raising():
            try:
                body()
            except BaseException as e:
                if self.keep and not isinstance(e, vm_config.VmLost):
                    _say(f"failed; VM {self.cfg.name} kept (--keep): `doit vm_down` deletes it")
                else:
                    why = "a lost VM cannot be restarted" if self.keep else "use --keep to keep it"
                    _say(f"failed or interrupted; deleting VM {self.cfg.name} ({why})")
                    self.delete()
                raise

    # ------------------------------------------------------------ losing and replacing

    def lost(self) -> str | None:
        """Why the VM can no longer run the pipeline (preempted, stopped, gone), or None while it
        is RUNNING: then a failed command is the pipeline's failure, not the VM's.

        Raises VmError when the VM must not be replaced: `doit vm_down` deleted it (the state file
        no longer records it), or it reached max_run_duration_s (the spending limit).
        """
        cfg = self.cfg
        instance = self.cloud.get_instance(cfg.name)
        if instance is not None and instance.status == "RUNNING":
            return None
        state = vm_state.read_state(self.root)
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
        vm_state.write_state(self.root, state)
        return why

    def replace(self) -> ssh.Remote:
        """Delete the lost VM (a preempted Spot VM cannot be restarted) and create a new one."""
        self.cloud.delete_instance(self.cfg.name)
        state = vm_state.read_state(self.root)
        return self._connect(state, self._create(state), created=True)

    def with_recovery(self, remote: ssh.Remote, attempt: Callable[[ssh.Remote], None]) -> None:
        """Run `attempt` on the VM; when it fails because the VM was lost, replace the VM and run
        it again, at most `max_recoveries` times (a managed job: the pipeline resumes from the
        bucket)."""
        cfg, limit = self.cfg, int(self.cfg.max_recoveries)
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

    # ------------------------------------------------------------ running and reporting

    def run_experiments(self, experiments: list[list[str]], names: list[str | None], target: str | None,
                        may_create: bool, preflight: bool,
                        checks: Sequence[tuple[str, Callable[[ssh.Remote], str]]] = ()) -> None:
        """Each experiment as a DVC experiment on the VM, brought back into this repository; a
        replacement VM runs only what is left. ``checks``: (what, check) pairs run on the VM after the
        TPU checks, before the pipeline (the rehearsal's: mtpipe.cloud.rehearsal), each saying its line.
        The end of the run, a recovery and a spend past budget_usd are notices (mtpipe.cloud.notify)."""
        watch = self._budget_watch()
        try:
            got = self._run_experiments(experiments, names, target, may_create, preflight, checks)
        except BaseException as e:
            what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
            notify.send(notify.Event.FAILED, self.cfg.name, f"{what}\n{self._spent()}", _say)
            raise
        finally:
            watch.stop()
        notify.send(notify.Event.FINISHED, self.cfg.name,
                    f"experiments {', '.join(got) or '(none made)'} are back in the repository "
                    f"(`dvc exp show`)\n{self._spent()}", _say)

    def _spent(self) -> str:
        state = vm_state.read_state(self.root)
        return spend_line(state) if state.get("vms") else "no VM of this run is left running"

    def _budget_watch(self) -> notify.BudgetWatch:
        """A running watch that notifies once this run's VMs cost more than budget_usd (billed, and
        the on-demand equivalent of a reservation's); one that never fires without a budget."""

        def spent() -> float:
            total = vm_state.spend(vm_state.read_state(self.root))
            return total.usd + total.reserved_usd

        budget = self.cfg.budget_usd
        watch = notify.BudgetWatch(float(budget) if budget is not None else float("inf"), spent, self.cfg.name, _say)
        if budget is not None:
            watch.start()
        return watch

    def _run_experiments(self, experiments: list[list[str]], names: list[str | None], target: str | None,
                         may_create: bool, preflight: bool,
                         checks: Sequence[tuple[str, Callable[[ssh.Remote], str]]]) -> list[str]:
        """:meth:`run_experiments`' work; the names of the experiments that came back."""
        cfg, root = self.cfg, self.root
        secret_lines, secret_data = dvc_experiments.secrets_stdin(list(cfg.run.secrets))
        scripts = [dvc_experiments.run_script(cfg, root, dvc_experiments.dvc_command(target, sets, name), secret_lines, name)
                   for sets, name in zip(experiments, names)]
        remote = self.ensure(experiments, may_create, preflight, target)  # will it fit the TPU? (docs/preflight.md)
        todo, came_back = list(zip(experiments, scripts)), []
        tpus: list[tpu.Target] = []   # the TPUs the branches that run on the VM target

        def attempt(remote: ssh.Remote) -> None:
            _say(f"setting up VM {cfg.name} (once per VM)")
            setup.setup(remote, cfg, root)
            _say(host.check(remote, cfg, root, experiments))   # before anything is shipped or downloaded
            _say(f"shipping HEAD to VM {cfg.name}")
            commit = dvc_experiments.ship(remote, root, cfg.run.remote_dir)
            for target in tpus:   # before anything is downloaded; a failure deletes the VM (mtpipe.cloud.checks.tpu)
                _say(f"checking the TPU runtime on VM {cfg.name}: {target.command()}")
                _say(tpu.check(remote, cfg, root, target))
            for what, check in checks:
                _say(what)
                _say(check(remote))
            _say(f"shipped {commit[:12]}; running the pipeline on {cfg.name}")
            while todo:
                sets, script = todo[0]
                if len(scripts) > 1:
                    _say(f"experiment {len(scripts) - len(todo) + 1} of {len(scripts)}: {' '.join(sets)}")
                ssh.check(remote, script, "the pipeline", stdin=secret_data)
                _say(f"bringing the experiment back from VM {cfg.name}")
                got = dvc_experiments.fetch_experiments(remote, root, cfg.run.remote_dir, commit)
                todo.pop(0)
                came_back.extend(got)
                if got:
                    _say(f"experiment {', '.join(got)} (baseline {commit[:7]}) is now in this "
                         "repository: `dvc exp show` lists it, `dvc exp apply NAME && dvc pull` brings "
                         "it into the workspace")
                else:
                    _say("the run made no DVC experiment (run.command without {dvc}?)")

        def body() -> None:
            tpus.extend(tpu.targets(root, experiments))
            self.with_recovery(remote, attempt)

        self.guarded(body)
        return came_back

    def status(self) -> list[str]:
        """The VM and firewall rule as the cloud sees them, with what the run has cost and, over SSH,
        where its run is (stage, step, loss, ETA: mtpipe.cloud.on_vm.run_status), then the other VMs in
        the zone labelled with `labels` (app: mtpipe), each with its cost so far."""
        cfg, state = self.cfg, vm_state.read_state(self.root)
        cloud = self.cloud
        instance, rule = cloud.get_instance(cfg.name), cloud.get_firewall(cfg.firewall.name)
        recorded = state if state.get("name") == cfg.name else {}
        lines = [f"firewall rule {cfg.firewall.name}: {'exists' if rule else 'none'}"]
        if instance is None:
            unconfirmed = recorded and not recorded.get("created")
            lines.append(f"VM {cfg.name} in {cfg.project}/{cfg.zone}: none" + (
                f" (recorded: its insert, sent {recorded.get('insert_sent')}, never created it)"
                if unconfirmed else ""))
        else:
            entry, rate = recorded["vms"][-1] if recorded.get("vms") else {}, _rate(cfg, instance)
            usd = entry.get("usd_per_hour", rate.usd_per_hour)
            reservation = entry.get("reservation") if entry else rate.reservation
            machine, model, limit = cloud.describe(instance)
            lines += [f"VM {cfg.name} in {cfg.project}/{cfg.zone}: {instance.status}, {machine}, {model}, "
                      f"external IP {cloud.address(instance)}",
                      f"  {_since(instance.creation_timestamp, usd, reservation)}"]
            if limit:
                since = datetime.fromisoformat(instance.creation_timestamp)
                lines.append("  Compute deletes it at "
                             f"{time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(since.timestamp() + limit))}")
            if not recorded:
                lines.append(f"  (not recorded in {vm_state.STATE_FILE}: created elsewhere)")
        lines += [f"  replaced: {e['name']} ({e['provisioning']}) {e['created']} .. {e['ended']}: {e['why']}"
                  for e in recorded.get("vms", [])[:-1]]
        if recorded.get("vms"):
            lines.append(f"  {spend_line(recorded)}")
        if instance is not None and instance.status == "RUNNING" and recorded.get("host_key"):
            lines += run_status.run_lines(self.remote(recorded), self.cfg.run.remote_dir)
        others = [i for i in self.labelled() if i.name != cfg.name]
        if others:
            lines.append(f"other VMs labelled {_labels(cfg)} in {cfg.project}/{cfg.zone}:")
        for other in sorted(others, key=lambda i: i.name):
            labels, rate = dict(other.labels), _rate(cfg, other)
            lines.append(f"  {other.name}: {other.status}, {labels.get(PROVISIONING_LABEL, '?')}, run "
                         f"{labels.get(RUN_LABEL, '?')}, created by {labels.get(USER_LABEL, '?')}, "
                         f"{_since(other.creation_timestamp, rate.usd_per_hour, rate.reservation)}")
        return lines


def _record_insert(root: Path, cfg: DictConfig, state: dict) -> None:
    """Record in the state file the VM an insert in ``cfg.zone`` is about to create."""
    state.update(_recorded(cfg), created=None, insert_sent=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    vm_state.write_state(root, state)


def _recorded(cfg: DictConfig) -> dict[str, Any]:
    """What the state file records of the VM ``cfg`` describes."""
    return {"project": cfg.project, "zone": cfg.zone, "name": cfg.name, "firewall": cfg.firewall.name,
            "provisioning": cfg.provisioning, "max_run_duration_s": int(cfg.max_run_duration_s),
            "os_login": cfg.ssh.os_login is True, "ssh_user": cfg.ssh.user}


def _labels(cfg: DictConfig) -> str:
    return ", ".join(f"{key}={value}" for key, value in cfg.labels.items())


def _rate(cfg: DictConfig, instance: Any) -> prices.Rate:
    """The rate of a VM: the provisioning mode it was created with (its label), else ``cfg``'s."""
    mode = dict(instance.labels).get(PROVISIONING_LABEL)
    return prices.vm_rate(OmegaConf.merge(cfg, {"provisioning": mode}) if mode in vm_config.PROVISIONING else cfg)
