"""The AOT compile of a branch's training step, and its cache: what preflight, the machine budget and the
committed results of the shipped presets (:mod:`mtpipe.planning.compiled_presets`) read.

MaxText's own cross-compilation (``maxtext.trainers.pre_train.train_compile``) compiles the step of the
branch's training method (:func:`trainer_of`: the last of its training stages) for the hardware
preset's TPU topology, with the arguments of the stage's own command line
(:func:`mtpipe.maxtext.training_commands.placeholder_command`, from the composed config) but its paths.
It runs in a child process (``python -m mtpipe.planning.aot --compile``), cached in
``work/preflight/<digest>.json`` by the digest of its command line but the :data:`SHAPE_FREE_ARGS`
and the MaxText/JAX/libtpu versions; a shipped preset's committed result (``mtpipe/planning/compiled/``)
answers where that cache misses (:func:`stored_compile`). Nothing here compiles unless
:func:`compile_step` is asked to.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from mtpipe.maxtext import commands, training_commands
from mtpipe.maxtext.runner import child_env
from mtpipe.pipeline.trainers import BY_MODULE, Trainer, of_branch
from mtpipe.pipeline import generations, maxtext_check, overrides, toolchain
from mtpipe.pipeline.config import ROOT, stage_view
from mtpipe.pipeline.maxtext_check import compose_checked
from mtpipe.pipeline.stage_table import BRANCH_STAGES
from mtpipe.pipeline.view import View

COMMITTED = Path(__file__).resolve().parent / "compiled"   # the shipped presets' results (compiled_presets)

# Keys the compile sets itself (hardware=cpu in a CPU preset's extra_args would fight the topology).
# jax_cache_dir is empty: a compile-only TPU executable cannot be loaded back from JAX's disk cache.
COMPILE_OWN_KEYS = ("hardware", "run_name", "base_output_directory", "compile_topology",
                    "compile_topology_num_slices", "skip_jax_distributed_system", "jax_cache_dir")
# MaxText arguments that change no shape, dtype or buffer of the compiled training step, only scalars
# in it (the learning-rate schedule) or what happens around it: the compile's cache key leaves them out,
# so a sweep over them compiles once, and the report takes the step count from the run's own arguments.
SHAPE_FREE_ARGS = frozenset({"learning_rate", "steps", "num_batches", "num_test_batches", "warmup_steps_fraction",
                             "checkpoint_period", "eval_interval", "log_period", "max_num_checkpoints_to_keep"})
CACHE_FORMAT = 2   # of the cached compile results: 2 records num_batches (GRPO's step count scales with it)
OOM_MARKERS = ("resource_exhausted", "hbm", "out of memory", "exceeds the memory")


# ---------------------------------------------------------------- parent: config -> compile args


def trainer_of(branch: str) -> Trainer:
    """The training method a branch's compile is of: its last training stage's."""
    return of_branch(BRANCH_STAGES[branch])


def composed_views(sets: list[str], root: Path, branches: tuple[str, ...],
                   committed: bool) -> tuple[Any, dict[str, Any], dict[str, View]]:
    """(params, composed branch, training-stage view per branch) of params.yaml + ``sets`` (HEAD's
    params.yaml when ``committed``); every config error before anything else."""
    params_yaml = overrides.committed_params(root) if committed else (root / "params.yaml").read_bytes()
    params = overrides.apply_sets(params_yaml, sets)
    composed = {branch: compose_checked(branch, params) for branch in branches}
    return params, composed, {branch: stage_view(cfg, trainer_of(branch).stage) for branch, cfg in composed.items()}


def topology(cfg: View) -> str | None:
    """The TPU topology a branch's hardware preset targets: its TPU_ACCELERATOR_TYPE on a TPU VM, its
    `xpk.tpu_type` on GKE (backend xpk), or None (CPU)."""
    if cfg.hardware.backend == "xpk":
        return cfg.hardware.xpk.tpu_type
    return cfg.hardware.env.get("TPU_ACCELERATOR_TYPE")


def maxtext_topology(topo: str) -> str:
    """MaxText's name of an accelerator type, for its AOT compile and the machine budget (a v5e VM's
    accelerator type is spelled otherwise than MaxText's topology: conf/generations.yaml)."""
    gen, chips = generations.of_accelerator(topo)
    return gen.maxtext_topology(chips)


def stage_command(cfg: View) -> commands.MaxTextCommand:
    """The training command the branch's compiled stage runs, with placeholder paths."""
    return training_commands.placeholder_command(cfg, trainer_of(cfg.branch))


def compile_args(cmd: commands.MaxTextCommand, topo: str) -> list[str]:
    """The stage's arguments without file paths, plus the cross-compilation target."""
    kept: dict[str, str] = {}
    for arg in cmd.args:
        key, _, value = arg.partition("=")
        if value.startswith(training_commands.PLACEHOLDER) or key in COMPILE_OWN_KEYS:
            continue
        kept[key] = value
    kept |= {"run_name": "preflight", "compile_topology": topo, "compile_topology_num_slices": "1",
             "skip_jax_distributed_system": "true", "jax_cache_dir": ""}
    return [f"{k}={v}" for k, v in kept.items()]


def training_step(cfg: View) -> tuple[str, list[str]]:
    """(MaxText module, compile arguments) of the training step of a TPU branch's view."""
    cmd = stage_command(cfg)
    return cmd.module, compile_args(cmd, maxtext_topology(topology(cfg)))


# ---------------------------------------------------------------- parent: compile (cached)


def versions() -> dict[str, str]:
    """What the compiled result depends on besides its arguments: the installed compiler's versions,
    which are the VM lock's (one toolchain); the VM lock's where they are not installed (the control
    plane's light environment, which can still read a result compiled elsewhere)."""
    names = ("maxtext", "jax", "jaxlib", "libtpu")
    try:
        return {name: metadata.version(name) for name in names}
    except metadata.PackageNotFoundError:
        pins = toolchain.lock_pins((ROOT / "requirements-vm.lock").read_text())
        return {name: pins[name] for name in names}


def can_compile() -> bool:
    """Whether JAX and MaxText are installed here (not in requirements-control.lock's environment)."""
    return maxtext_check.installed()


def compile_key(module: str, args: list[str]) -> dict[str, Any]:
    """What the compiled step depends on: the trainer, its arguments but the :data:`SHAPE_FREE_ARGS`,
    the software versions, the cache format."""
    shaped = [a for a in args if a.partition("=")[0] not in SHAPE_FREE_ARGS]
    return {"module": module, "args": shaped, "versions": versions(), "format": CACHE_FORMAT}


def compile_digest(module: str, args: list[str]) -> str:
    """sha256 of :func:`compile_key`: the name of the step's compile result."""
    return hashlib.sha256(json.dumps(compile_key(module, args), sort_keys=True).encode()).hexdigest()


def stored_compile(module: str, args: list[str], work: Path) -> dict[str, Any] | None:
    """The step's compile result from ``work`` (this machine's cache), else the committed one of a
    shipped preset with the same digest (:mod:`mtpipe.planning.compiled_presets`), else None."""
    digest = compile_digest(module, args)
    cache = work / f"{digest}.json"
    return json.loads(cache.read_text()) if cache.is_file() else committed(digest)


def committed(digest: str) -> dict[str, Any] | None:
    """The committed compile result recorded under ``digest`` (``committed``: its file), or None."""
    for file in sorted(COMMITTED.glob("*.json")):
        record = json.loads(file.read_text())
        if record["digest"] == digest:
            return record["result"] | {"committed": str(file.relative_to(ROOT))}
    return None


def run_steps(compiled: dict[str, Any], args: list[str]) -> int:
    """The training steps of the run ``args`` describe, which a cached compile of another step count
    (:data:`SHAPE_FREE_ARGS`) does not hold: SFT's ``steps``; GRPO's MaxText derives from num_batches
    (train_steps = num_batches x num_iterations x train_fraction x num_epoch), so it scales with it."""
    given = dict(a.partition("=")[::2] for a in args)
    c = compiled["config"]
    if "num_batches" in given and c.get("num_batches"):
        return round(int(c["steps"]) * int(given["num_batches"]) / int(c["num_batches"]))
    return int(given.get("steps", c["steps"]))


def _wait_showing_progress(child: subprocess.Popen, log: Path, every_s: float = 60) -> int:
    """The compile's exit status; meanwhile a line each ``every_s`` with the minutes it has taken."""
    start = time.monotonic()
    while True:
        try:
            return child.wait(timeout=every_s)
        except subprocess.TimeoutExpired:
            print(f"mtpipe preflight: still compiling, {(time.monotonic() - start) / 60:.0f} min so far "
                  f"(its log: {log})", flush=True)
        except BaseException:
            child.kill()
            child.wait()
            raise


def compile_step(module: str, args: list[str], work: Path, log: Path) -> dict[str, Any]:
    """Cross-compile the training step in a child process; the result is cached by its digest."""
    stored = stored_compile(module, args, work)
    if stored is not None:
        return stored | {"cached": True}
    cache = work / f"{compile_digest(module, args)}.json"
    work.mkdir(parents=True, exist_ok=True)
    # No Hub token (as for every MaxText child). The compile touches no TPU, so libtpu's one-process
    # lock (/tmp/libtpu_lockfile) would only stop two preflights, or a preflight and a test, side by side.
    env = child_env({"JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE", "ALLOW_MULTIPLE_LIBTPU_LOAD": "true"})
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "mtpipe.planning.aot", "--compile", str(out), module,
                *args, f"base_output_directory={tmp}"]
        with open(log, "w", encoding="utf8") as log_file:
            log_file.write(f"$ {' '.join(argv)}\n")
            log_file.flush()
            code = _wait_showing_progress(subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                                           cwd=ROOT), log)
        if not out.is_file():
            tail = log.read_text(errors="replace").splitlines()[-30:]
            raise RuntimeError(f"the AOT compile exited with {code} and no result; log {log}:\n" + "\n".join(tail))
        result = json.loads(out.read_text())
    tmp_cache = cache.with_suffix(".partial")
    tmp_cache.write_text(json.dumps(result, indent=1))
    os.replace(tmp_cache, cache)
    return result | {"cached": False}


# ---------------------------------------------------------------- child: the compile itself

GRPO_BATCH_KEYS = ("global_batch_size_to_load", "global_batch_size_to_train_on", "micro_batch_size_to_train_on")


def _grpo_config(initialize: Any, rl_config: type, argv: list[str], **kwargs: Any) -> Any:
    """train_rl's config (rl.yml read as RLConfig, as train_rl reads it), shaped as one GRPO mini-batch.

    A GRPO step trains on ``batch_size`` prompts x ``num_generations`` completions of up to
    ``max_target_length`` tokens; RLConfig leaves pre-training's batch fields unset, so they are set
    here. The compiled step shards its batch over every chip, so the sequences are rounded up to a
    multiple of the chips (the tutorial's 1 x 2 becomes 8: an upper bound on the temporaries).
    """
    config = initialize(argv, config_class=rl_config, **kwargs)
    grpo = config._pydantic_config  # the attribute paths train_rl itself reads
    sequences = grpo.batch_size * grpo.rl.num_generations
    chips = int(config.compile_topology.rsplit("-", 1)[1])
    compiled = math.ceil(sequences / chips) * chips
    config._flat_config.update(
        dict.fromkeys(GRPO_BATCH_KEYS, compiled), per_device_batch_size=compiled // chips, grpo_sequences=sequences,
        steps=grpo.train_steps, num_generations=grpo.rl.num_generations, grpo_beta=grpo.rl.grpo_beta)
    return config


def _child(out: Path, module: str, args: list[str]) -> int:
    """Run MaxText's train_compile for ``module``'s config file; write memory, FLOPs and shapes to ``out``."""
    import jax
    from absl import app
    from maxtext.configs import pyconfig, types
    from maxtext.trainers.pre_train import train_compile
    from maxtext.utils import maxtext_utils
    from maxtext.utils.globals import MAXTEXT_CONFIGS_DIR

    config_file = os.path.join(MAXTEXT_CONFIGS_DIR, pyconfig._CONFIG_FILE_MAPPING[module])  # the stage's own
    argv = ["train_compile", config_file, *args]
    if module in BY_MODULE and BY_MODULE[module].rollout:   # GRPO: the batch is prompts x generations
        pyconfig.initialize = functools.partial(_grpo_config, pyconfig.initialize, types.RLConfig)
    seen: dict[str, Any] = {}
    original = train_compile.jit_and_compile

    def capture(func, func_input_args, *rest):
        seen["config"], seen["state"] = rest[-2], func_input_args[0]
        try:
            seen["compiled"] = original(func, func_input_args, *rest)
        except Exception as err:  # MaxText: "you will see the same OOM error as on the target hardware"
            if not any(m in str(err).lower() for m in OOM_MARKERS):
                raise
            seen["oom"] = str(err).splitlines()[0][:500]
            raise SystemExit(0) from None
        return seen["compiled"]

    train_compile.jit_and_compile = capture
    try:
        app.run(train_compile.main, argv=argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            return int(exc.code) if isinstance(exc.code, int) else 1
    config = seen["config"]
    state = seen["state"]  # linen: a TrainState with .params; NNX (pure_nnx): a State with a "model" subtree
    weights = getattr(state, "params", None) or state["model"]
    params = [p for p in jax.tree.leaves(weights) if jax.numpy.issubdtype(p.dtype, jax.numpy.floating)]
    result: dict[str, Any] = {
        "param_count": int(sum(math.prod(p.shape) for p in params)),
        "param_bytes": int(sum(math.prod(p.shape) * p.dtype.itemsize for p in params)),
        "tflops_per_device": float(maxtext_utils.calculate_tflops_training_per_device(config, log=False)[0]),
        "config": {k: getattr(config, k, None) for k in (
            "model_name", "per_device_batch_size", "global_batch_size_to_train_on", "max_target_length",
            "max_prefill_predict_length", "steps", "num_batches", "weight_dtype", "dtype", "remat_policy", "scan_layers",
            "num_decoder_layers", "num_kv_heads", "head_dim", "emb_dim", "vocab_size", "batch_size",
            "hbm_utilization_vllm", "num_generations", "grpo_beta", "grpo_sequences", "compile_topology")},
    }
    result["config"] = {k: (str(v) if not isinstance(v, (int, float, bool, str, type(None))) else v)
                        for k, v in result["config"].items()}
    if "oom" in seen:
        result |= {"oom": seen["oom"], "memory": dict.fromkeys(
            ("argument_size_in_bytes", "temp_size_in_bytes", "generated_code_size_in_bytes"), 0)}
    else:
        stats = seen["compiled"].memory_analysis()
        result["memory"] = {k: int(getattr(stats, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_temp_size_in_bytes")}
        cost = seen["compiled"].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        result["xla_flops"] = float(cost.get("flops", 0.0)) if cost else None
    out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "--compile":
        sys.exit("usage: python -m mtpipe.planning.aot --compile OUT.json <maxtext trainer module> key=value ...")
    _status = _child(Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
    gc.freeze()  # the exit frees MaxText's modules without a collection over them (mtpipe.maxtext.launch)
    sys.exit(_status)
