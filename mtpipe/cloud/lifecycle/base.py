"""The VM a lifecycle holds (:class:`Vm`): its config and cloud, the way in over SSH, what it is and
costs (status), and deleting it (on failure or Ctrl-C unless kept, or every VM labelled as this
user's). The lifecycle's other parts (creation.py, recovery.py) share one :class:`Vm`."""

from __future__ import annotations

import functools
import getpass
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mtpipe.cloud.lifecycle.lines import _say, spend_line
from mtpipe.cloud.on_vm import run_status, ssh
from mtpipe.cloud.providers import choice, interrupts
from mtpipe.cloud.providers.choice import provider_for
from mtpipe.cloud.providers.interface import Provider, ProviderError
from mtpipe.cloud.settings import prices, vm_config, vm_state
from mtpipe.cloud.settings.vm_config import VmConfig

# Labels every VM gets besides conf/vm.yaml's `labels` (app: mtpipe); firewall rules, which have no
# labels, carry them in their description.
RUN_LABEL = "mtpipe-run"                    # a fresh id per VM creation
USER_LABEL = "created-by"
PROVISIONING_LABEL = "mtpipe-provisioning"  # reservation / spot / on-demand: its price
FIREWALL_LABEL = "mtpipe-firewall"          # the SSH rule made for it


class Vm:
    """The VM ``cfg`` names, recorded in ``root``'s state file (.vm_state.json).

    ``cfg`` is frozen: what the checks and the creation decide (a zone, OS Login's user) replaces it
    with a new config, and a new zone makes a new cloud client. ``keep``: a VM survives a failure or
    an interrupt of the task (never a loss: a lost VM cannot be restarted). ``provider`` makes the
    cloud for a config: by default the one of its route (vm_config.route: Compute Engine, or the
    Cloud TPU API's queued resources)."""

    def __init__(self, cfg: VmConfig, root: Path, keep: bool = False,
                 provider: Callable[[VmConfig], Provider] = provider_for) -> None:
        self._cfg, self.root, self.keep, self.provider = cfg, root, keep, provider
        self.deleted: list[str] = []   # the VMs vm_down deleted by their labels

    @property
    def cfg(self) -> VmConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: VmConfig) -> None:
        """A new config; in another zone (vm_config.in_zone) or route, the cloud's client is made again for it."""
        if (cfg.zone, cfg.route) != (self._cfg.zone, self._cfg.route):
            self.__dict__.pop("cloud", None)   # functools.cached_property
        self._cfg = cfg

    @functools.cached_property
    def cloud(self) -> Provider:
        """The provider's client for ``cfg``'s zone, made once per zone."""
        return self.provider(self.cfg)

    def remote(self, state: dict | None = None) -> ssh.Remote:
        """How to reach the VM, after checking with the cloud that it still exists."""
        cfg, state = self.cfg, vm_state.read_state(self.root) if state is None else state
        cloud = self.cloud
        instance = cloud.get_instance(cfg.name)
        if instance is None:
            raise vm_config.VmError(f"VM {cfg.name} does not exist in {cfg.project}/{cfg.zone} (deleted, or "
                             "max_run_duration_s ran out): create it with `doit vm_up`")
        ip, proxy = cloud.address(instance), cloud.proxy_command(cfg)
        if not ip and not proxy:
            raise vm_config.VmError(f"VM {cfg.name} has no external IP: set external_ip: false (SSH "
                                    "through IAP) or ssh.proxy_command in conf/vm.yaml")
        host_key = state.get("host_key") if state.get("name") == cfg.name else None
        return ssh.Remote.from_config(cfg, ip or cfg.name, host_key, proxy)

    def move_to(self, zone: str) -> None:
        """Make ``zone`` the VM's zone (vm_config.in_zone), and the cloud's client that zone's."""
        self.cfg = vm_config.in_zone(self.cfg, zone)

    def delete(self) -> None:
        """Delete the VM and its firewall rule (each may already be gone); forget the state. A VM the
        state file does not record is looked for in each of its zones, the first found deleted.
        A second Ctrl-C, SIGTERM or the terminal closing does not stop it."""
        cfg = self.cfg
        with interrupts.ignored():
            state = vm_state.read_state(self.root)
            if state.get("name") != cfg.name:
                for zone in vm_config.candidate_zones(cfg):
                    self.move_to(zone)
                    if self.cloud.get_instance(cfg.name) is not None:
                        break
            self.delete_vm(cfg.name, cfg.firewall.name)
            if state.get("vms") and state.get("name") == cfg.name:
                vm_state.vm_ended(state, "deleted")
                _say(spend_line(state))
            vm_state.clear_state(self.root)

    def delete_vm(self, name: str | None, firewall: str) -> None:
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
        no state file for; with no zone at all, in every zone (:meth:`delete_labelled_everywhere`)."""
        zones = vm_config.candidate_zones(self.cfg)
        if not zones:
            self.delete_labelled_everywhere()
        for zone in zones:
            self.move_to(zone)
            self._delete_labelled_here()

    def delete_labelled_everywhere(self) -> None:
        """:meth:`delete_labelled` in every zone of the project, on each route (choice.EVERYWHERE: Compute
        Engine's VMs, the Cloud TPU API's nodes and queued resources): says what each route searched and
        found, a route it could not search (the config's own route's failure stops the task) and the
        zones it could not read; with nothing of this user's anywhere, says so."""
        cfg, user = self.cfg, vm_config.label_value(getpass.getuser())
        vm_config.require(cfg, "project")
        labels = {k: str(v) for k, v in cfg.labels.items()}
        deleted_before = len(self.deleted)
        for route, (where, search) in choice.EVERYWHERE.items():
            try:
                found = search(cfg.project, labels)
            except ProviderError as err:
                if route == vm_config.route(cfg):
                    raise
                _say(f"not searched: {where} ({err})")
                continue
            zones = ", ".join(f"{zone} ({len(vms)})" for zone, vms in sorted(found.vms.items()))
            _say(f"searched {where} of {cfg.project} for VMs labelled {_labels(cfg)}: "
                 + (f"found in {zones}" if zones else "none"))
            if found.unread:
                _say(f"  could not read: {', '.join(found.unread)}")
            for zone in sorted(found.vms):
                self.cfg = vm_config.in_zone(cfg.model_copy(update={"route": route}), zone)
                self._delete_labelled_here()
        self.cfg = cfg
        if len(self.deleted) == deleted_before:
            _say(f"nothing of yours (label {USER_LABEL}={user}) to delete in any zone of {cfg.project}")

    def _delete_labelled_here(self) -> None:
        """:meth:`delete_labelled` in ``cfg.zone``."""
        cfg, user = self.cfg, vm_config.label_value(getpass.getuser())
        found = {i.name: i for i in self.labelled()}
        mine = sorted(n for n, i in found.items() if dict(i.labels).get(USER_LABEL) == user)
        if cfg.name not in mine and self.cloud.get_instance(cfg.name) is not None:
            mine.insert(0, cfg.name)
        if not mine:
            _say(f"no VM {cfg.name}, and none labelled {_labels(cfg)} by {user}, in {cfg.project}/{cfg.zone}")
        self.deleted += mine
        for name in mine:
            labels = dict(found[name].labels) if name in found else {}
            firewall = labels.get(FIREWALL_LABEL) or (cfg.firewall.name if name == cfg.name else f"{name}-ssh")
            with interrupts.ignored():
                self.delete_vm(name, firewall)
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


def _since(created: str, usd_per_hour: float, reservation: str | None = None) -> str:
    """How long a VM has existed and what it cost so far (a reservation's VM: paid by it)."""
    since = datetime.fromisoformat(created)
    hours = (datetime.now(timezone.utc) - since).total_seconds() / 3600
    so_far = f"{hours * usd_per_hour:.2f} USD so far at {usd_per_hour:.2f} USD/h"
    return f"since {since.isoformat()} ({hours:.2f} h): " + (
        prices.paid_by(reservation, so_far) if reservation else f"about {so_far}")


def _labels(cfg: VmConfig) -> str:
    return ", ".join(f"{key}={value}" for key, value in cfg.labels.items())


def _rate(cfg: VmConfig, instance: Any) -> prices.Rate:
    """The rate of a VM: the provisioning mode it was created with (its label), else ``cfg``'s."""
    mode = dict(instance.labels).get(PROVISIONING_LABEL)
    return prices.vm_rate(cfg.model_copy(update={"provisioning": mode}) if mode in vm_config.PROVISIONING else cfg)
