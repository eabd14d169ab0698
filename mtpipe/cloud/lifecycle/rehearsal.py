"""`doit vm_run --rehearse`: the real run's every step on the smallest VM of its TPU generation,
before the first long paid run (docs/vm-checks.md, "The rehearsal").

The rehearsal's VM is the real run's (conf/vm.yaml with the environment and the options: image,
disk, network, labels, service account, metadata, self-delete) with two changes: the machine type
holds one chip of the same generation (ct6e-standard-8t -> ct6e-standard-1t), and it is a Spot VM
unless --provisioning says otherwise. It runs the embedded default (the embedded-sft and
embedded-rl presets `make demo` runs) as a DVC experiment through every step of vm_run: the checks
before spending, the SSH route, the setup from the VM lock, the TPU runtime check on the one chip
(conf/hardware/<generation>-1.yaml), a download through the Hugging Face Hub client (with HF_TOKEN),
`dvc pull` / `dvc push` against the DVC remote as the VM's service account, the experiment brought
back; then the VM is deleted (unless --keep) and the spend line says what it cost.

Its experiment trains on the chip: both branches on the one-chip preset, the first TRAIN_STEPS steps of
train_sft@sft and of the warm-up train_sft@rl on the learning-rate schedule of their full run, GRPO_STEPS
of train_rl with the JAX rollout, both exports, and the evaluations on EVAL_PROBLEMS problems. Each
loss is then set beside the committed CPU record's at the same step (HEAD's plots/). Where the VM's
setup installs vLLM (MaxText's install_tpu_post_train_extra_deps), a second experiment runs train_rl
with vLLM's rollout and evaluate@rl with vLLM's server on the chip.
"""

from __future__ import annotations

import csv
import io
import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mtpipe.cloud.checks import prerequisites
from mtpipe.cloud.on_vm import dvc_experiments, ssh
from mtpipe.cloud.settings import prices, vm_config, vm_state
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, generations, overrides

if TYPE_CHECKING:
    from mtpipe.cloud.lifecycle.run import Check, VmLifecycle

PROVISIONING = "spot"          # unless --provisioning: about a fifth of the on-demand price
MAX_RUN_DURATION_S = 3600      # Compute deletes the VM after this at the latest (or conf/vm.yaml's, if shorter)
EMBEDDED = ["sft.preset=embedded-sft", "rl.preset=embedded-rl"]   # what `make demo` runs
# The Hub step: one small file of the SFT tutorial's dataset (an open repo) at its pinned revision
HUB_DATASET, HUB_FILENAME = "ultrachat-200k", "README.md"
# What it trains on the chip: the embedded default's first steps, each branch on the learning-rate
# schedule of its full run (MaxText's learning_rate_schedule_steps), so each step's loss is the CPU record's
TRAIN_STEPS = 10               # of train_sft@sft and of the warm-up train_sft@rl
GRPO_STEPS = 2                 # train_rl batches: rollouts and updates on the chip
EVAL_PROBLEMS = 8              # held-out GSM8K problems evaluate@rl scores each model on
# |loss on the chip - loss in the CPU record| allowed at each step. The lent v5e chip, JAX 0.10.2, the same
# commands: at most 0.0050 over 150 SFT steps and 0.073 over 400 warm-up steps (docs/tpu-chip.md); the
# first TRAIN_STEPS steps: benchmarks/on_tpu/records/rehearsal.json.
LOSS_TOLERANCE = 0.05
# Its minutes on the VM, as the price line quotes them: the setup (assumed: the package download of
# requirements-vm.lock, not measured on Google Cloud), the JAX rollout's experiment (measured: 5.0 min
# from the probe to the last evaluation on the loopback VM's 2 busy CPU cores, the suite's rehearsal in
# tests/project/test_quickstart.py; a chip's steps are faster) and vLLM's (assumed: train_rl and
# evaluate@rl again, and vLLM's start and compile on the TPU twice)
SETUP_MIN, EXPERIMENT_MIN, VLLM_MIN = 15, 6, 10
VLLM_SETUP = "install_tpu_post_train_extra_deps"   # MaxText's command that installs vLLM and tpu-inference
VLLM = ["rl.train_rl.rollout_backend=vllm", "++rl.evaluate.backend=vllm",
        "++rl.evaluate.server_timeout_s=1800"]   # vLLM loads and compiles on the TPU in minutes (the tutorial preset's)
# The curves compared: (branch, plot file, its stage)
CURVES = (("sft", "plots/sft/train_sft.csv", "train_sft@sft"), ("rl", "plots/rl/train_sft.csv", "train_sft@rl"))


def one_chip(machine_type: str) -> tuple[str, str]:
    """The machine type of one chip of ``machine_type``'s generation and its hardware preset, named as
    MaxText names the topology (conf/generations.yaml): ct6e-standard-8t -> (ct6e-standard-1t, v6e-1)."""
    gen, _ = generations.of_machine_type(machine_type)
    return gen.machine_type(1), gen.maxtext_topology(1)


def training_sets(root: Path, hardware: str) -> list[str]:
    """The rehearsal's experiment (``dvc exp run -S`` values): :data:`EMBEDDED` on ``hardware`` (both
    branches), cut to its steps; each SFT run keeps the schedule of HEAD's full run."""
    params = overrides.apply_sets(overrides.committed_params(root), EMBEDDED)
    full = {b: config.stage_view(config.compose(b, params), "train_sft").train_sft.steps for b in ("sft", "rl")}
    return [*EMBEDDED, f"sft.hardware={hardware}", f"rl.hardware={hardware}",
            f"steps={min(TRAIN_STEPS, full['sft'])}",
            f"++sft.train_sft.extra_args.learning_rate_schedule_steps={full['sft']}",
            f"rl.train_sft.steps={min(TRAIN_STEPS, full['rl'])}",
            f"++rl.train_sft.extra_args.learning_rate_schedule_steps={full['rl']}",
            f"rl.train_rl.num_batches={GRPO_STEPS}", "rl.train_rl.num_test_batches=1",
            f"rl.evaluate.num_problems={EVAL_PROBLEMS}"]


def experiments(cfg: VmConfig, root: Path) -> list[list[str]]:
    """The JAX rollout's experiment on ``cfg.run.hardware``, and vLLM's where the VM's setup installs it."""
    sets = training_sets(root, cfg.run.hardware)
    with_vllm = any(VLLM_SETUP in command for command in cfg.setup.commands)
    return [sets, sets + VLLM] if with_vllm else [sets]


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
    """What the rehearsal runs on the VM after shipping HEAD and the TPU runtime check on its one chip
    (vm_run's own: both branches train on the one-chip preset), before the pipeline: the Hub download."""
    return [(f"downloading through the Hugging Face Hub client on VM {cfg.name}: {hub_command()}",
             lambda remote: hub_download(remote, cfg, root))]


@dataclass(frozen=True)
class Curve:
    """One training stage's losses on the chip beside the CPU record's at the same steps."""

    stage: str
    chip: list[float]
    record: list[float]

    @property
    def max_diff(self) -> float:
        return max((abs(a - b) for a, b in zip(self.chip, self.record)), default=float("inf"))

    @property
    def ok(self) -> bool:
        return bool(self.chip) and len(self.record) >= len(self.chip) and self.max_diff <= LOSS_TOLERANCE

    def line(self) -> str:
        if not self.chip:
            return f"{self.stage}: no loss came back from the chip"
        verdict = "within" if self.ok else "OUTSIDE"
        return (f"{self.stage}: steps 1-{len(self.chip)} on the chip, loss {self.chip[0]:.4f} -> {self.chip[-1]:.4f}; "
                f"the CPU record {self.record[0]:.4f} -> {self.record[len(self.chip) - 1]:.4f}: max |difference| "
                f"{self.max_diff:.4f}, {verdict} the tolerance {LOSS_TOLERANCE}" if len(self.record) >= len(self.chip)
                else f"{self.stage}: the CPU record has {len(self.record)} steps, the chip ran {len(self.chip)}")


def losses(csv_text: str) -> list[float]:
    """The ``loss`` column of a training stage's plot file, by step."""
    return [float(row["loss"]) for row in csv.DictReader(io.StringIO(csv_text))]


def _show(root: Path, rev: str, path: str) -> str:
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, text=True)
    return shown.stdout if shown.returncode == 0 else ""


def compare(root: Path, baseline: str, name: str) -> list[Curve]:
    """Each SFT curve of experiment ``name`` (baseline ``baseline``) beside ``baseline``'s committed record."""
    ref = dvc_experiments.experiment_ref(baseline, name)
    return [Curve(stage, losses(_show(root, ref, path) or "loss\n"), losses(_show(root, baseline, path) or "loss\n"))
            for _, path, stage in CURVES]


def price_line(cfg: VmConfig, experiments: int) -> str:
    """What the rehearsal is expected to cost: its minutes (:data:`SETUP_MIN`, :data:`EXPERIMENT_MIN` and,
    with a second experiment, :data:`VLLM_MIN`) at ``cfg``'s rate."""
    minutes = SETUP_MIN + EXPERIMENT_MIN + (VLLM_MIN if experiments > 1 else 0)
    rate = prices.vm_rate(cfg)
    vllm = f", vLLM's {VLLM_MIN} assumed" if experiments > 1 else ""
    return (f"about {minutes} minutes on the VM (setup {SETUP_MIN}, assumed; the training, exports and "
            f"evaluations {EXPERIMENT_MIN}, measured on 2 CPU cores{vllm}), about "
            f"{rate.usd_per_hour * minutes / 60:.2f} USD at {rate.describe()}")


def trained(root: Path, baseline: str, name: str) -> str:
    """Which training stages experiment ``name`` ran, their steps (its metrics) and the accelerator of
    their hardware preset (its views)."""
    ref = dvc_experiments.experiment_ref(baseline, name)
    parts = []
    for branch, stage in (("sft", "train_sft"), ("rl", "train_sft"), ("rl", "train_rl")):
        env = ((yaml.safe_load(_show(root, ref, f"views/{branch}/{stage}.yaml") or "{}").get("hardware") or {})
               .get("env") or {})
        steps = json.loads(_show(root, ref, f"metrics/{branch}/{stage}.json") or "{}").get("steps", "no")
        parts.append(f"{stage}@{branch} {steps} steps on {env.get('TPU_ACCELERATOR_TYPE', 'no TPU')}")
    return f"experiment {name} trained on the VM: {', '.join(parts)}"


def run(life: VmLifecycle, exp_name: str | None) -> list[Curve]:
    """The rehearsal on a new VM of ``life``'s config (:func:`load_config`): refused without PROJECT, ZONE
    or credentials (all named at once, with whatever else fails), or when a VM of its name
    exists already (it would be reused, not rehearsed on), else vm_run's run of :func:`experiments` with
    :func:`checks`; each curve that came back beside the CPU record's (:func:`conclude` judges them after
    the caller deleted the VM, as after any vm_run)."""
    cfg, root = life.cfg, life.root
    runs = experiments(cfg, root)
    prerequisites.check_settings(cfg, root, runs)   # every missing value named at once
    if life.cloud.get_instance(cfg.name) is not None:
        raise ConfigError("vm.name", f"VM {cfg.name} exists in {cfg.project}/{cfg.zone}, and the rehearsal "
                          "creates a VM of its own", f"delete it with `doit vm_down --name {cfg.name}`, or "
                          "rehearse under another name: --name=NAME")
    names = [exp_name, f"{exp_name}-vllm"][:len(runs)] if exp_name else [None] * len(runs)
    for name in names:
        dvc_experiments.check_exp_name(root, name)
    if len(runs) == 1:
        print(f"mtpipe: vLLM is not rehearsed: the VM's setup does not run {VLLM_SETUP}", flush=True)
    print(f"mtpipe: rehearsal: {price_line(cfg, len(runs))}", flush=True)
    baseline = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
    got = life.run_experiments(runs, names, None, may_create=True, preflight=False, checks=checks(cfg, root))
    for name in got:
        print(f"mtpipe: rehearsal: {trained(root, baseline, name)}", flush=True)
    curves = [curve for name in got for curve in compare(root, baseline, name)]
    for curve in curves:
        print(f"mtpipe: rehearsal: {curve.line()}", flush=True)
    return curves


def conclude(curves: list[Curve]) -> None:
    """VmError when a curve is missing or left the tolerance: the chip trains otherwise than the CPU."""
    bad = [c for c in curves if not c.ok]
    if bad or not curves:
        raise vm_config.VmError("the rehearsal's training on the chip does not match the CPU record: "
                                + ("; ".join(c.line() for c in bad) or "no experiment came back")
                                + " (docs/vm-checks.md, \"The rehearsal\")")
    print(f"mtpipe: rehearsal: every loss within {LOSS_TOLERANCE} of the CPU record", flush=True)
