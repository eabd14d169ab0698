"""The TPU VM's life: create, reach, run, recover, delete; what `doit vm_*` tasks drive.

:class:`VmLifecycle` holds the rules (checks before spending, a price to confirm before the first
insert, one VM per state file, delete on failure unless kept, replace a lost VM at most
``max_recoveries`` times, never replace one that ran out of time), in layers: :class:`VmBase`
(mtpipe.cloud.lifecycle.base: the cloud, SSH, status, deleting), :class:`VmCreation` (creation.py: zones,
capacity, Flex-start), :class:`VmRecovery` (recovery.py: a lost VM replaced) and this module's run
(the VM ensured after the checks, setup, the experiments, bringing them back). The cloud behind it is a
:class:`~mtpipe.cloud.providers.interface.Provider` (Compute Engine: mtpipe.cloud.providers.gcp.compute.Compute).
What happens on the VM over SSH is in mtpipe.cloud.on_vm (ssh, setup, dvc_experiments), the checks
on it in mtpipe.cloud.checks (host: its RAM and /dev/shm against the machine budget; tpu).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from mtpipe.cloud.checks.gcp import identity
from mtpipe.cloud.checks import host, prerequisites, tpu
from mtpipe.cloud.checks.forecast import cached_forecasts, check_spot_resume
from mtpipe.cloud.checks.project import check_project
from mtpipe.cloud.lifecycle import notify
from mtpipe.cloud.lifecycle.lines import _say, creation_line, forecast_line, spend_line
from mtpipe.cloud.lifecycle.recovery import VmRecovery
from mtpipe.cloud.on_vm import dvc_experiments, setup, ssh
from mtpipe.cloud.providers import interrupts
from mtpipe.cloud.providers.interface import SETTLING, WAITING_FOR_CAPACITY
from mtpipe.cloud.settings import prices, vm_config, vm_state
from mtpipe.errors import ConfigError
from mtpipe.planning import preflight as preflight_checks


class VmLifecycle(VmRecovery):
    """The VM's whole life for `doit vm_*`: :meth:`ensure` (reused, or created after the checks and the
    price confirmed) and :meth:`run_experiments` (setup, the experiments, bringing them back)."""

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
        root, state = self.root, vm_state.read_state(self.root)
        prerequisites.check_settings(self.cfg)   # before any request
        self.cfg, dropped = vm_config.check_create(self.cfg)
        for line in dropped:
            _say(line)
        cfg, cloud = self.cfg, self.cloud
        recorded = (state.get("project"), state.get("zone"), state.get("name"))
        if state and recorded != (cfg.project, cfg.zone, cfg.name):
            other = self._provider(vm_config.in_zone(cfg.model_copy(update={"project": state["project"]}), state["zone"]))
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
            self.cfg = cfg = vm_config.use_recorded_login(cfg, state)
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
            self.cfg, unproven = prerequisites.before_spending(cfg, cloud, root, experiments)
            cfg = self.cfg
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
            self.guarded(lambda: identity.probe_from_vm(remote, self.cfg, unproven))
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
            cfg = self.cfg   # as the checks and the creation left it (zone, OS Login user)
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
