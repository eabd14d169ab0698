"""The TPU VM's life: create, reach, run, recover, delete; what `doit vm_*` tasks drive.

:class:`VmLifecycle` holds the rules (checks before spending, a price to confirm before the first
insert, one VM per state file, delete on failure unless kept, replace a lost VM at most
``max_recoveries`` times, never replace one that ran out of time) and reads top to bottom: it holds
its parts and calls them in order. The parts: :class:`~.base.Vm` (base.py: the VM held, its config
and cloud, SSH, status, deleting), :class:`~.creation.Creation` (creation.py: zones, capacity,
Flex-start, the new VM reached) and :class:`~.recovery.Recovery` (recovery.py: a lost VM replaced);
this module is the run (the VM ensured after the checks, setup, the experiments, bringing them
back). The cloud behind it is a :class:`~mtpipe.cloud.providers.interface.Provider`, chosen by
mtpipe.cloud.providers.choice. What happens on the VM over SSH is in mtpipe.cloud.on_vm (ssh, setup,
dvc_experiments), the checks on it in mtpipe.cloud.checks (host: its RAM and /dev/shm against the
machine budget; tpu).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mtpipe.cloud.checks import host, prerequisites, self_delete, tpu
from mtpipe.cloud.checks.forecast import cached_forecasts, check_spot_resume
from mtpipe.cloud.checks.gcp import identity
from mtpipe.cloud.checks.project import check_project
from mtpipe.cloud.lifecycle import notify
from mtpipe.cloud.lifecycle.base import Vm
from mtpipe.cloud.lifecycle.creation import Creation
from mtpipe.cloud.lifecycle.lines import _say, creation_line, forecast_line, spend_line
from mtpipe.cloud.lifecycle.recovery import Recovery
from mtpipe.cloud.on_vm import dvc_experiments, setup, ssh
from mtpipe.cloud.providers import interrupts
from mtpipe.cloud.providers.choice import provider_for
from mtpipe.cloud.providers.interface import SETTLING, WAITING_FOR_CAPACITY, Provider
from mtpipe.cloud.settings import prices, vm_config, vm_state
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError
from mtpipe.planning import preflight as preflight_checks

Check = tuple[str, Callable[[ssh.Remote], str]]   # what is checked on the VM, and the check (its success line)


class VmLifecycle:
    """The VM's whole life for `doit vm_*`: :meth:`ensure` (reused, or created after the checks and the
    price confirmed) and :meth:`run_experiments` (setup, the experiments, bringing them back).

    ``keep``: a VM survives a failure or an interrupt of the task (never a loss). ``yes``: create
    without asking (--yes); else the price is confirmed on the terminal, and without one nothing is
    created. ``provider`` makes the cloud for a config (by default the one of its route)."""

    def __init__(self, cfg: VmConfig, root: Path, keep: bool = False, yes: bool = False,
                 provider: Callable[[VmConfig], Provider] = provider_for) -> None:
        self.vm = Vm(cfg, root, keep, provider)
        self.creation = Creation(self.vm)
        self.recovery = Recovery(self.vm, self.creation)
        self.yes = yes

    # The VM held (base.Vm), as dodo.py's tasks and the rehearsal reach it.
    @property
    def cfg(self) -> VmConfig:
        return self.vm.cfg

    @property
    def root(self) -> Path:
        return self.vm.root

    @property
    def cloud(self) -> Provider:
        return self.vm.cloud

    def remote(self) -> ssh.Remote:
        return self.vm.remote()

    def guarded(self, body: Callable[[], None]) -> None:
        self.vm.guarded(body)

    def delete(self) -> None:
        self.vm.delete()

    def delete_labelled(self) -> None:
        self.vm.delete_labelled()

    def status(self) -> list[str]:
        return self.vm.status()

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
        VM that exists only gets the project checks and the Spot one (:meth:`_reuse`). `preflight`
        then AOT-compiles the TPU branches (after the quick checks: a compile takes minutes the first
        time) and forecasts the run up to the DVC `target` (None: the whole pipeline), the price asked
        for. `may_create` False refuses to replace a VM that .vm_state.json records but the cloud no
        longer has (vm_run without --recreate).
        """
        self._check_settings(experiments)
        state = self._recorded_here()
        instance = self._existing()
        created, unproven = instance is None, []
        if instance is not None:
            self._reuse(instance, state, experiments)
        else:
            self._refuse_recreating(state, may_create)
            _say("checks before spending: Compute, the network and SSH, the presets with the --set values, "
                 "HF_TOKEN, the DVC remote, your APIs and permissions, the VM's service account")
            self.vm.cfg, unproven = prerequisites.before_spending(self.cfg, self.cloud, self.root, experiments)
        forecasts = self._forecasts(experiments, target) if preflight else []
        if created:
            self._confirm(forecasts)
            state = {}
            instance = self.creation.create(state)
        remote = self.creation.connect(state, instance, created)
        if created and unproven:   # before any setup minute; the VM is deleted unless --keep
            self.guarded(lambda: identity.probe_from_vm(remote, self.cfg, unproven))
        return remote

    def _check_settings(self, experiments: list[list[str]]) -> None:
        """The settings, before any request (prerequisites.check_settings, vm_config.check_create),
        each Flex-start zone not known to grant the VM said."""
        prerequisites.check_settings(self.cfg, self.root, experiments)
        self.vm.cfg, warned = vm_config.check_create(self.cfg)
        for line in warned:
            _say(line)

    def _recorded_here(self) -> dict:
        """The state file's record when it is this VM's; refused when it records another VM that
        still exists, forgotten ({}) when that one is gone."""
        cfg, state = self.cfg, vm_state.read_state(self.root)
        recorded = (state.get("project"), state.get("zone"), state.get("name"))
        if not state or recorded == (cfg.project, cfg.zone, cfg.name):
            return state
        elsewhere = vm_config.in_zone(cfg.model_copy(update={"project": state["project"]}), state["zone"])
        if self.vm.provider(elsewhere).get_instance(state["name"]) is not None:
            raise ConfigError("vm.name", f"{vm_state.STATE_FILE} tracks another VM, {state['name']} in "
                              f"{state['project']}/{state['zone']}",
                              "delete it first with `doit vm_down`, or use its name/zone/project")
        return {}

    def _existing(self) -> Any | None:
        """The VM as the cloud has it, once an insert or a Flex-start request another run sent has
        settled (None: there is none)."""
        cfg, cloud = self.cfg, self.cloud
        instance = cloud.get_instance(cfg.name)
        if instance is not None and instance.status in SETTLING:   # an insert another run sent
            _say(f"VM {cfg.name} is {instance.status}: waiting until Compute has created it")
            instance = cloud.settle(cfg.name, float(cfg.operation_timeout_s))
        if instance is not None and instance.status == WAITING_FOR_CAPACITY:   # a Flex-start request another run sent
            _say(f"VM {cfg.name} is {instance.status}: an earlier run's Flex-start request; waiting for its capacity")
            instance = self.creation.await_capacity(instance)
        return instance

    def _reuse(self, instance: Any, state: dict, experiments: list[list[str]]) -> None:
        """A VM that exists: logged into as recorded, the project checks and the Spot one (with
        preflight's cached forecast), its cost counted from its creation when created elsewhere."""
        _say(f"reusing VM {self.cfg.name} ({instance.status}) in {self.cfg.zone}")
        self.vm.cfg = cfg = vm_config.use_recorded_login(self.cfg, state)
        check_project(cfg, self.root, experiments)
        check_spot_resume(cfg, cached_forecasts(cfg, self.root, experiments)[0])
        if not state.get("vms"):   # created elsewhere: its cost counts from its creation
            vm_state.vm_started(state, cfg, instance.creation_timestamp)

    def _refuse_recreating(self, state: dict, may_create: bool) -> None:
        """Without ``may_create``, a VM the state file records and the cloud no longer has is not
        replaced (vm_run without --recreate)."""
        if not state or may_create:
            return
        cfg = self.cfg
        why = ("it deleted itself after idle.delete_after_s with nothing of vm_run running, Compute deleted it "
               "after max_run_duration_s, or someone else did" if state.get("created")
               else f"its insert, sent {state.get('insert_sent')}, never created it")
        raise vm_config.VmError(
            f"VM {cfg.name}, recorded in {vm_state.STATE_FILE} (created {state.get('created')}), no "
            f"longer exists in {cfg.project}/{cfg.zone}: {why}. Rerun with --recreate to create "
            f"a new one ({prices.vm_rate(cfg).describe()}), or `doit vm_down` to forget it")

    def _forecasts(self, experiments: list[list[str]], target: str | None) -> list[dict[str, Any]]:
        """preflight's forecast of each experiment up to ``target`` (it compiles what is not cached)."""
        cfg, forecasts = self.cfg, []
        rate = prices.vm_rate(cfg)
        for sets in experiments:
            forecasts += preflight_checks.run(sets, rate.price.usd, vm_config.budget_machine(cfg), self.root,
                                              committed=True, price_basis=rate.per_chip(), target=target)
        return forecasts

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

    def run_experiments(self, experiments: list[list[str]], names: list[str | None], target: str | None,
                        may_create: bool, preflight: bool, checks: Sequence[Check] = ()) -> list[str]:
        """Each experiment as a DVC experiment on the VM, brought back into this repository (their
        names are returned); a
        replacement VM runs only what is left. ``checks``: (what, check) pairs run on the VM after the
        TPU checks, before the pipeline (the rehearsal's: mtpipe.cloud.lifecycle.rehearsal), each saying
        its line. The end of the run, a recovery and a spend past budget_usd are notices
        (mtpipe.cloud.lifecycle.notify)."""
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
        return got

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
                         may_create: bool, preflight: bool, checks: Sequence[Check]) -> list[str]:
        """:meth:`run_experiments`' work: the run scripts, the VM (:meth:`ensure`), then, guarded and
        recovered, the VM prepared and the experiments not back yet run; the names of those that came back."""
        secret_lines, secret_data = dvc_experiments.secrets_stdin(list(self.cfg.run.secrets))
        scripts = [dvc_experiments.run_script(self.cfg, self.root, dvc_experiments.dvc_command(target, sets, name),
                                              secret_lines, name)
                   for sets, name in zip(experiments, names)]
        remote = self.ensure(experiments, may_create, preflight, target)  # will it fit the TPU? (docs/preflight.md)
        todo, came_back = list(zip(experiments, scripts)), []
        tpus: list[tpu.Target] = []   # the TPUs the branches that run on the VM target

        def attempt(remote: ssh.Remote) -> None:
            commit = self._prepare(remote, experiments, tpus, checks)
            while todo:
                sets, script = todo[0]
                if len(scripts) > 1:
                    _say(f"experiment {len(scripts) - len(todo) + 1} of {len(scripts)}: {' '.join(sets)}")
                came_back.extend(self._run_one(remote, script, secret_data, commit))
                todo.pop(0)

        def body() -> None:
            tpus.extend(tpu.targets(self.root, experiments))
            self.recovery.run(remote, attempt)

        self.guarded(body)
        return came_back

    def _prepare(self, remote: ssh.Remote, experiments: list[list[str]], tpus: list[tpu.Target],
                 checks: Sequence[Check]) -> str:
        """The VM made ready for the pipeline: setup (once per VM), its host against the machine budget,
        HEAD shipped, the TPU runtime and ``checks`` (each before anything is downloaded; a failure
        deletes the VM). Returns the commit shipped."""
        cfg, root = self.cfg, self.root
        _say(f"setting up VM {cfg.name} (once per VM)")
        setup.setup(remote, cfg, root)
        if vm_config.route(cfg) == "tpu_api":   # who deletes the node if this laptop stops watching
            _say(self_delete.check(remote, cfg, self.vm.keep))
        _say(host.check(remote, cfg, root, experiments))   # before anything is shipped or downloaded
        _say(f"shipping HEAD to VM {cfg.name}")
        commit = dvc_experiments.ship(remote, root, cfg.run.remote_dir)
        for target in tpus:   # mtpipe.cloud.checks.tpu
            _say(f"checking the TPU runtime on VM {cfg.name}: {target.command()}")
            _say(tpu.check(remote, cfg, root, target))
        for what, check in checks:
            _say(what)
            _say(check(remote))
        _say(f"shipped {commit[:12]}; running the pipeline on {cfg.name}")
        return commit

    def _run_one(self, remote: ssh.Remote, script: str, secrets: bytes, commit: str) -> list[str]:
        """One experiment's run script on the VM, and the experiment brought back: its names."""
        cfg = self.cfg
        ssh.check(remote, script, "the pipeline", stdin=secrets)
        _say(f"bringing the experiment back from VM {cfg.name}")
        got = dvc_experiments.fetch_experiments(remote, self.root, cfg.run.remote_dir, commit)
        if got:
            _say(f"experiment {', '.join(got)} (baseline {commit[:7]}) is now in this "
                 "repository: `dvc exp show` lists it, `dvc exp apply NAME && dvc pull` brings "
                 "it into the workspace")
        else:
            _say("the run made no DVC experiment (run.command without {dvc}?)")
        return got
