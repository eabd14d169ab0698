"""Preflight: will a preset's training fit its TPU, how long will it take, what will it cost?

Answered on the laptop CPU, with no TPU and no network, before any VM exists:

* **Compiled** (exact): MaxText's own cross-compilation (``maxtext.trainers.pre_train.train_compile``)
  compiles the training step for the hardware preset's TPU topology (``TPU_ACCELERATOR_TYPE``, e.g.
  v6e-8) with the model, batch, sequence length, dtypes and remat settings of the stage's own
  command line (:mod:`mtpipe.maxtext.training_commands`, from the composed config). XLA's memory
  analysis gives the HBM per chip of the train state (params + optimizer state) and of the step's temporaries.
* **Estimated** (stated formulas): the FLOPs per step (MaxText's own
  ``calculate_tflops_training_per_device``, the number its MFU logging uses; XLA's cost analysis
  counts a scanned layer block once, not once per layer), step and run time from them and the
  parameters (:mod:`mtpipe.planning.step_model`, fit on a TPU chip), and for
  GRPO the reference model, the rollout engine's weights and KV cache, and the rollout time.
* The compile (:mod:`mtpipe.planning.aot`) runs in a child process, cached in
  ``work/preflight/<digest>.json`` by the digest of its command line and the MaxText/JAX/libtpu
  versions: an unchanged preflight costs nothing the second time.

Entry points: :func:`run` (``doit preflight``, and ``doit vm_run`` before it creates anything),
``benchmarks/preflight_full.py``. docs/preflight.md explains the numbers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mtpipe.errors import ConfigError
from mtpipe.pipeline.trainers import BY_STAGE, SFT
from mtpipe.pipeline import generations, toolchain
from mtpipe.pipeline.config import ROOT, stage_view
from mtpipe.pipeline.stage_table import BRANCH_STAGES, BUDGET_STAGES
from mtpipe.pipeline.view import View
from mtpipe.planning import budget, compiled_presets, run_forecast, step_model
from mtpipe.planning.aot import (can_compile, compile_key, compile_step, composed_views, maxtext_topology,
                                     run_steps, stored_compile, topology, trainer_of, training_step, versions)


Chip = generations.Chip   # one TPU generation's per-chip numbers (conf/generations.yaml)

# Measured on one TPU v5e chip: the SFT tutorial's model (Gemma 3 4B at full width, batch 1 x 2048) cut
# in depth and vocabulary to fit it, through the SFT stage's trainer and MaxText's pre-training trainer
# (benchmarks/on_tpu/records/slices*.json, docs/step-time.md;
# benchmarks/on_tpu/calibrate.py prints forecast vs measurement, tests/planning/test_on_tpu.py holds them together).
# The step time: mtpipe.planning.step_model (arithmetic + parameter traffic, fit on the same records).
SFT_TRAINER_EXTRA_BYTES_PER_PARAM = 3.7  # tunix's SFT trainer holds ~4 B/parameter beyond MaxText's compiled
                               # step (least squares over the SFT slices); one fp32 copy is its
                               # gradient-accumulation buffer (sft.yml: use_tunix_gradient_accumulation)
GRPO_EXTRA_BYTES_PER_PARAM = 1.9  # train_rl with the JAX rollout, beyond the compiled step, reference and KV cache
HBM_ERROR = 0.10               # the HBM forecast's largest leave-one-out under-forecast on the chip's records
                               # (measured 9.2% above it), rounded up: the printed high end holds on every
                               # record; two over-forecasts miss by 22-23% (docs/step-time.md)
HBM_TOLERANCE = 0.10           # a forecast further than this from the chip's peak HBM is a finding
STEP_TOLERANCE = 0.25          # likewise for the step time

# Assumptions of the time and cost estimates; each lands in the JSON report.
CONVERT_S_PER_BPARAM = 70.0    # to_maxtext: the tutorials' ~5 min for Gemma 3 4B (4.3 B params)
EXPORT_S_PER_BPARAM = 70.0     # to_huggingface: assumed like the conversion
# Loading the checkpoint and compiling the step on the TPU VM (low, mid, high): assumed, not measured
# on a v6e VM; the lent chip compiled the tutorials' cut steps in under a minute (docs/step-time.md)
TRAIN_STARTUP_S = (90.0, 180.0, 600.0)
# Writing one checkpoint (the f32 train state: weights and AdamW's two moments), MiB/s (fast, mid, slow):
# Hyperdisk Balanced's 2,400 MiB/s per volume at most and its 140 MiB/s free baseline (cited:
# cloud.google.com/compute/docs/disks/hd-types/hyperdisk-balanced, benchmarks/public/checkpoint_write.yaml);
# the mid is Balanced PD's 1,200 MiB/s write cap per instance (cited there too), no save was measured
CHECKPOINT_MIB_S = (2400.0, 1200.0, 140.0)
VM_SETUP_S = 900.0             # VM creation, boot and `doit vm_setup` (apt, uv, MaxText install)
GIB = 2**30


# ---------------------------------------------------------------- the chips and their price


def usd_per_hour(chips: int, usd_per_chip_hour: float) -> float:
    """What `chips` chips cost per hour (TPU prices are per chip-hour: a v6e-32 slice costs 4 v6e-8s)."""
    return usd_per_chip_hour * chips


def chip_of(topo: str, branch: str, hardware: str) -> tuple[Chip, int]:
    """(one JAX device's specs, number of devices) of an accelerator type (conf/generations.yaml): the
    unit MaxText shards over and reports memory of. A chip is one device, a TPU7x chip two."""
    try:
        gen, chips = generations.of_accelerator(topo)
    except ValueError as err:
        raise ConfigError(f"{branch}.hardware", f"preflight knows no TPU {topo!r} (conf/hardware/{hardware}.yaml): "
                          f"{err}", f"spell it as an accelerator type of {generations.TABLE_NAME}, or add the "
                          "generation there") from None
    return gen.device(), chips * gen.devices_per_chip


def chips_of(topo: str) -> int:
    """The chips of an accelerator type, what the price counts."""
    return generations.of_accelerator(topo)[1]


# ---------------------------------------------------------------- parent: the report


def hbm_parts(compiled: dict[str, Any], chips: int, module: str) -> dict[str, float]:
    """GiB per chip of one training step of ``module``: MaxText's compiled train state, temporaries and
    code, and for tunix's SFT trainer what it holds beside them (measured on a TPU chip)."""
    mem = compiled["memory"]
    parts = {"train_state": mem["argument_size_in_bytes"] / GIB, "step_temporaries": mem["temp_size_in_bytes"] / GIB,
             "code": mem["generated_code_size_in_bytes"] / GIB}
    if module == SFT.module:
        parts["sft_trainer_extra"] = SFT_TRAINER_EXTRA_BYTES_PER_PARAM * compiled["param_count"] / chips / GIB
    return parts


def generation_of(topo: str) -> generations.Generation:
    """The row of conf/generations.yaml of an accelerator type (v6e-8: v6e)."""
    return generations.of_accelerator(topo)[0]


def train_step_s(compiled: dict[str, Any], chip: Chip, chips: int, efficiency: float, flops: float | None = None) -> float:
    """:func:`step_model.train_step_s` of a compile: its FLOPs per chip (MaxText's count, or ``flops``),
    parameters and weight bytes, sharded over ``chips`` at the generation's ``efficiency``."""
    return step_model.train_step_s(compiled["tflops_per_device"] * 1e12 if flops is None else flops,
                                   compiled["param_count"], chips, chip, efficiency,
                                   compiled["param_bytes"] / compiled["param_count"])


def step_forecast(compiled: dict[str, Any], chip: Chip, chips: int, module: str,
                  efficiency: float) -> tuple[float, float]:
    """(HBM GiB per chip, seconds per step) of one training step of ``module`` (not GRPO's rollout): the
    parts of :func:`hbm_parts`, and :func:`train_step_s`."""
    return sum(hbm_parts(compiled, chips, module).values()), train_step_s(compiled, chip, chips, efficiency)


def checkpoint_s(compiled: dict[str, Any], chips: int, saves: int) -> tuple[float, float, float]:
    """(low, mid, high) seconds of ``saves`` checkpoints of the compiled train state (all ``chips``'
    shards) at :data:`CHECKPOINT_MIB_S`."""
    state = compiled["memory"]["argument_size_in_bytes"] * chips
    return tuple(saves * state / (rate * 2**20) for rate in CHECKPOINT_MIB_S)  # type: ignore[return-value]


def checkpoint_saves(args: list[str], steps: int) -> int:
    """How many checkpoints a run of ``steps`` steps writes: one each ``checkpoint_period`` (none without one)."""
    period = next((int(a.split("=", 1)[1]) for a in args if a.startswith("checkpoint_period=")), 0)
    return steps // period if period > 0 else 0


def report(cfg: View, preset: str, compiled: dict[str, Any], chip: Chip, chips: int,
           usd_per_hour: float, args: list[str]) -> dict[str, Any]:
    """HBM per chip, fit, FLOPs, time and cost of one branch from its compile result (of the step
    ``args`` compile: the step count is theirs, :func:`run_steps`)."""
    trainer = trainer_of(cfg.branch)
    c = compiled["config"]
    hbm = hbm_parts(compiled, chips, trainer.module)
    # GRPO: the compiled batch is rounded up to a multiple of the chips; FLOPs count the real one
    real_batch = c["grpo_sequences"] / c["global_batch_size_to_train_on"] if trainer.rollout else 1.0
    flops_per_chip = compiled["tflops_per_device"] * 1e12 * real_batch
    gen = generation_of(topology(cfg) or "")
    step_s = train_step_s(compiled, chip, chips, gen.step.compute_efficiency, flops_per_chip)
    step_low, step_high = step_model.interval(step_s, gen.step.step_error)
    steps = run_steps(compiled, args)
    notes = ["compiled: the train step (params, optimizer state, temporaries) for the topology"]
    startup = TRAIN_STARTUP_S
    if trainer.rollout:
        rollout_backend = getattr(cfg, trainer.stage).rollout_backend
        extra, needed, rollout = _grpo_estimate(rollout_backend, compiled, chip, chips, hbm)
        notes.append(extra)
        # the rollout's own range (its decode efficiency), around the train step's interval
        step_low, step_s, step_high = (step_model.GRPO_TRAIN_FACTOR * t + r
                                       for t, r in zip((step_low, step_s, step_high), rollout))
        if rollout_backend == "vllm":   # vLLM starts inside train_rl
            startup = tuple(a + b for a, b in zip(startup, run_forecast.VLLM_START_S))
    else:
        needed = sum(hbm.values())
    mfu = step_model.implied_mfu(flops_per_chip, step_s, chip.peak_tflops)
    if mfu > gen.best_mfu.pct / 100:
        notes.append(f"the step implies {mfu:.0%} MFU, above the best public {gen.best_mfu.pct:.1f}% on {gen.name} "
                     f"({gen.best_mfu.run}): the forecast is likely too fast")
    wall = step_model.WALL_CLOCK_FACTOR
    saves = checkpoint_saves(args, steps)
    ckpt = checkpoint_s(compiled, chips, saves)
    train_range = tuple(start + steps * step * w + c for start, step, w, c
                        in zip(startup, (step_low, step_s, step_high), wall, ckpt))
    train_s = train_range[1]
    params_b = compiled["param_count"] / 1e9
    convert_s, export_s = CONVERT_S_PER_BPARAM * params_b, EXPORT_S_PER_BPARAM * params_b
    total_s = VM_SETUP_S + convert_s + train_s + export_s
    fits = not compiled.get("oom") and needed <= chip.hbm_gib
    return {
        "branch": cfg.branch, "preset": preset, "topology": topology(cfg), "stage": trainer.stage,
        "fits": fits, "compile_oom": compiled.get("oom"),
        "hbm_gib_per_chip": round(needed, 3), "hbm_gib_available": chip.hbm_gib,
        "hbm_headroom_gib": round(chip.hbm_gib - needed, 3),
        "hbm_parts_gib": {k: round(v, 3) for k, v in hbm.items()},
        "flops_per_step": flops_per_chip * chips, "flops_per_step_per_chip": flops_per_chip,
        "xla_cost_analysis_flops_per_chip": compiled.get("xla_flops"),
        "steps": steps, "est_step_s": step_s, "est_train_s": round(train_s, 1),
        "est_train_s_range": [round(t, 1) for t in train_range], "implied_mfu": round(mfu, 4),
        "best_public_mfu": gen.best_mfu.pct / 100, "mfu_above_best_public": mfu > gen.best_mfu.pct / 100,
        "step_evidence": gen.step.evidence, "compute_efficiency": gen.step.compute_efficiency,
        "est_startup_s": list(startup), "wall_clock_factor": list(wall), "checkpoint_saves": saves,
        "est_checkpoint_s": [round(c, 1) for c in ckpt],
        "est_convert_s": round(convert_s, 1), "est_export_s": round(export_s, 1), "est_vm_setup_s": VM_SETUP_S,
        "est_total_s": round(total_s, 1), "usd_per_hour": usd_per_hour,
        "est_total_usd": round(total_s / 3600 * usd_per_hour, 2),
        "param_count": compiled["param_count"], "maxtext_config": c,
        "est_step_s_range": (step_low, step_high), "hbm_error": HBM_ERROR,
        "assumptions": {"compute_efficiency": gen.step.compute_efficiency, "efficiency_source": gen.step.source,
                        "step_bytes_per_param": step_model.STEP_BYTES_PER_PARAM, "step_error": gen.step.step_error,
                        "gathered_bytes_per_param": step_model.gathered_bytes_per_param(
                            compiled["param_bytes"] / compiled["param_count"]),
                        "sft_trainer_extra_bytes_per_param":
                        SFT_TRAINER_EXTRA_BYTES_PER_PARAM, "decode_efficiency": step_model.DECODE_EFFICIENCY,
                        "vllm_decode_efficiency_assumed": step_model.VLLM_DECODE_EFFICIENCY,
                        "grpo_train_factor": step_model.GRPO_TRAIN_FACTOR, "peak_tflops_per_chip": chip.peak_tflops,
                        "convert_s_per_bparam": CONVERT_S_PER_BPARAM, "export_s_per_bparam": EXPORT_S_PER_BPARAM,
                        "train_startup_s": TRAIN_STARTUP_S, "checkpoint_mib_s": CHECKPOINT_MIB_S,
                        "vm_setup_s": VM_SETUP_S},
        "notes": notes, "versions": versions(), "compile_cached": compiled.get("cached", False),
    }


def stored_report(cfg: View, preset: str, usd_per_chip_hour: float, work: Path) -> dict[str, Any] | None:
    """:func:`report` of a TPU branch from the compile result preflight already has (its cache in
    ``work``, or a shipped preset's committed one); None when it has none. Nothing compiles here."""
    topo = topology(cfg)
    chip, chips = chip_of(topo, cfg.branch, cfg.hardware.name)
    module, args = training_step(cfg)
    compiled = stored_compile(module, args, work)
    if compiled is None:
        return None
    return report(cfg, preset, compiled, chip, chips, usd_per_hour(chips_of(topo), usd_per_chip_hour), args)


def _grpo_estimate(rollout_backend: str, compiled: dict[str, Any], chip: Chip, chips: int,
                   hbm: dict[str, float]) -> tuple[str, float, tuple[float, float, float]]:
    """Add GRPO's estimated parts to ``hbm``; return (note, HBM needed per chip, (low, mid, high) seconds
    a GRPO step spends beside its train step: sampling, and for vLLM syncing the trained weights to it).

    One VM: trainer and rollout share every chip (MaxText splits devices only across VMs). The
    reference model is a second copy of the weights on the trainer mesh. vLLM (tpu-inference) sizes
    its KV cache as hbm_utilization_vllm x HBM minus what is already in use, so the state held
    between steps is at least that fraction of HBM; the train step's temporaries come on top.
    """
    c = compiled["config"]
    weight_bytes = compiled["param_bytes"]
    hbm["reference_weights"] = weight_bytes / chips / GIB if c["grpo_beta"] else 0.0
    sequences = c["grpo_sequences"]
    kv_shards = max(1, min(chips, c["num_kv_heads"]))
    kv_bytes_per_token = 2 * c["num_decoder_layers"] * c["num_kv_heads"] * c["head_dim"] * 2  # K and V, bf16
    hbm["rollout_kv_cache_min"] = sequences * c["max_target_length"] * kv_bytes_per_token / kv_shards / GIB
    held = hbm["train_state"] + hbm["reference_weights"] + hbm["code"] + hbm["rollout_kv_cache_min"]
    if rollout_backend == "vllm":
        rollout_weight_bytes = 2 * compiled["param_count"] / chips  # bf16 copy, sharded over the chips
        hbm["rollout_weights"] = rollout_weight_bytes / GIB
        held += hbm["rollout_weights"]
        reserved = c["hbm_utilization_vllm"] * chip.hbm_gib
        hbm["vllm_reservation"] = max(reserved, held)
        needed = hbm["vllm_reservation"] + hbm["step_temporaries"]
        note = (f"estimated: reference weights, vLLM weights + KV cache (hbm_utilization_vllm="
                f"{c['hbm_utilization_vllm']} of each chip), rollout and reference-forward time")
    else:  # the JAX rollout samples with the actor's own weights
        rollout_weight_bytes = weight_bytes / chips
        hbm["grpo_trainer_extra"] = GRPO_EXTRA_BYTES_PER_PARAM * compiled["param_count"] / chips / GIB
        needed = held + hbm["grpo_trainer_extra"] + hbm["step_temporaries"]
        note = ("calibrated on a TPU chip: reference weights, the JAX rollout's KV cache and what train_rl holds "
                "beside them, rollout and log-prob passes")
    new_tokens = c["max_target_length"] - c["max_prefill_predict_length"]
    if rollout_backend == "vllm":   # cited (step_model.VLLM_DECODE_EFFICIENCY); each step copies the weights to vLLM
        sync_s = 2 * rollout_weight_bytes / (chip.hbm_gbps * 1e9)   # read the trained bf16 copy, write vLLM's
        rollout = tuple(step_model.decode_s(new_tokens, rollout_weight_bytes, chip.hbm_gbps, e) + sync_s
                        for e in reversed(step_model.VLLM_DECODE_EFFICIENCY))
        note += f"; vLLM decoding at {'-'.join(f'{e:.0%}' for e in step_model.VLLM_DECODE_EFFICIENCY)} of the HBM bandwidth (cited, docs/grpo-step.md) and the weight sync"
    else:
        rollout = (step_model.decode_s(new_tokens, rollout_weight_bytes, chip.hbm_gbps),) * 3
    return note, needed, rollout  # type: ignore[return-value]


def check_fits(row: dict[str, Any]) -> None:
    """Raise ConfigError naming the keys to change when a branch does not fit its TPU."""
    if row["fits"]:
        return
    branch, stage = row["branch"], row["stage"]
    keys = [f"{branch}.{stage}.{k}" for k in BY_STAGE[stage].memory_keys]
    need = (f"ran out of HBM while compiling for {row['topology']} ({row['compile_oom']})" if row["compile_oom"] else
            f"needs {row['hbm_gib_per_chip']:.1f} GiB of HBM per chip, {row['topology']} has "
            f"{row['hbm_gib_available']:.2f} (parts: {row['hbm_parts_gib']})")
    raise ConfigError(
        keys[0], f"preset {row['preset']} {need}",
        f"lower one of {', '.join(keys)} (or set {branch}.{stage}.extra_args.remat_policy: full), "
        f"or use a larger TPU; `doit preflight --set ...` checks a change in seconds once compiled")


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table, with the calibration's error bars."""
    head = ("branch", "preset", "TPU", "HBM GiB/chip", "fits", "TFLOP/step", "step s", "MFU", "train min")
    lines = [head]
    for r in rows:
        low, high = r["est_step_s_range"]
        bar = f" ±{HBM_ERROR:.0%}" if r["stage"] == SFT.stage else ""  # calibrated for the SFT trainer only
        hbm = "compile OOM" if r["compile_oom"] else f"{r['hbm_gib_per_chip']:.1f}{bar}"
        lines.append((r["branch"], r["preset"], r["topology"], f"{hbm} / {r['hbm_gib_available']:.2f}",
                      "yes" if r["fits"] else "NO", f"{r['flops_per_step'] / 1e12:.1f}",
                      f"{r['est_step_s']:.3f} ({low:.3f}-{high:.3f})",
                      f"{r['implied_mfu']:.1%}" + (" (above the best public)" if r["mfu_above_best_public"] else ""),
                      f"{r['est_train_s'] / 60:.1f}"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip() for line in lines)


def run(sets: list[str], usd_per_chip_hour: float, machine: budget.Machine, root: Path = ROOT,
        branches: tuple[str, ...] = tuple(BRANCH_STAGES), committed: bool = False,
        price_basis: str = "", target: str | None = None) -> list[dict[str, Any]]:
    """:func:`check`, then raise ConfigError (naming the keys to change) if a branch does not fit;
    a run that does not fit the machine's disks or memory stops before anything compiles.
    ``machine``: the VM config's boot disk and run environment (mtpipe.cloud.settings.vm_config.budget_machine)."""
    rows = check(sets, usd_per_chip_hour, machine, root, branches, committed, price_basis, refuse=True,
                 target=target)
    for row in rows:
        check_fits(row)
    return rows


def check(sets: list[str], usd_per_chip_hour: float, machine: budget.Machine, root: Path = ROOT,
          branches: tuple[str, ...] = tuple(BRANCH_STAGES), committed: bool = False,
          price_basis: str = "", refuse: bool = False, target: str | None = None) -> list[dict[str, Any]]:
    """Preflight the branches of params.yaml (+ ``--set`` overrides, as ``dvc exp run -S``) that target a TPU.

    ``usd_per_chip_hour``: the chip price of conf/vm.yaml's mode (mtpipe.cloud.settings.prices), which the cost
    column multiplies by the topology's chips; ``price_basis`` says where it comes from (and, for a
    reservation, that its commitment pays).
    ``committed``: HEAD's params.yaml (what vm_run ships) instead of the workspace's. Prints a table,
    writes ``work/preflight/<branch>-<preset>.json`` per branch and returns the rows.
    First the machine budget of the TPU VM's branches (:func:`machine_budget`; ``refuse``: raise when
    it does not fit, before anything compiles). Then the whole run (:mod:`mtpipe.planning.run_forecast`):
    each phase of the stages DVC's ``target`` reaches (None: the whole pipeline), in each row's
    ``run_phases``, the total with its interval and price printed below the table.
    """
    stages = run_forecast.stages_of(target, root)
    params, composed, views = composed_views(sets, root, branches, committed)
    work = root / "work" / "preflight"
    machine_budget(composed, views, machine, root, work, refuse)
    rows = []
    for branch, cfg in views.items():
        topo = topology(cfg)
        preset = params[branch].preset
        if topo is None:
            print(f"mtpipe preflight: {branch} ({preset}) runs on hardware {cfg.hardware.name}: no TPU to check")
            continue
        chip, chips = chip_of(topo, branch, cfg.hardware.name)
        module, args = training_step(cfg)
        stored = stored_compile(module, args, work)
        # a shipped preset's committed result that does not hold for these shapes or versions: why
        missed = "" if stored else compiled_presets.mismatch(branch, preset, compile_key(module, args))
        if stored is None and not can_compile():
            raise ConfigError("preflight", f"the {branch} branch's step ({preset} on {topo}) is not compiled yet"
                              + (f" ({missed})" if missed else "") + ", and this environment "
                              "(requirements-control.lock: no JAX, no MaxText) cannot compile it",
                              "run `doit preflight` with the same --set values once where `make` installs the full "
                              "environment (Linux x86_64) and bring its work/preflight/ here (results are reused by "
                              "shape), or pass --no-preflight to vm_run")
        print(f"mtpipe preflight: {branch} ({preset}): "
              + (f"compile result committed ({stored['committed']})" if stored and "committed" in stored else
                 "compile result cached (the same shapes compiled before)" if stored else
                 (f"{missed}; " if missed else "") + f"compiling the training step for {topo} on the CPU, once "
                 "per shape (model, batch, lengths, dtypes, remat): a learning-rate or step-count sweep reuses it. "
                 "The tutorial models took 11-15 min on 2 cores (docs/preflight.md), a tiny one about a minute"),
              flush=True)
        compiled = compile_step(module, args, work, work / f"{branch}-{preset}.log")
        row = report(cfg, preset, compiled, chip, chips, usd_per_hour(chips_of(topo), usd_per_chip_hour), args)
        row["run_phases"] = run_forecast.as_row(run_forecast.branch_phases(composed[branch], row, chip, stages, root))
        work.mkdir(parents=True, exist_ok=True)
        (work / f"{branch}-{preset}.json").write_text(json.dumps(row, indent=1) + "\n")
        rows.append(row)
    if rows:
        print(table(rows))
        print(f"the whole run (target {target or 'the whole pipeline'}), by phase:")
        print(run_forecast.forecast(rows).table())
        basis = f" ({price_basis})" if price_basis else ""
        for r in rows:
            print(assumptions_line(r))
        print(f"HBM ±{HBM_ERROR:.0%} (docs/preflight.md), {usd_per_chip_hour:.2f} USD per chip-hour{basis}; "
              f"reports in {work}/<branch>-<preset>.json")
        print(versions_line())
    return rows


def assumptions_line(row: dict[str, Any]) -> str:
    """What the row's step, start-up and checkpoints rest on, each with its source."""
    gen = generation_of(row["topology"])
    best = f"best public {gen.best_mfu.pct:.1f}%: {gen.best_mfu.run}"
    start, ckpt, wall = row["est_startup_s"], row["est_checkpoint_s"], row["wall_clock_factor"]
    return (f"{row['branch']}: step = FLOPs at {gen.step.compute_efficiency:.0%} of the peak ({gen.step.evidence}: "
            f"{gen.step.source}) + {step_model.STEP_BYTES_PER_PARAM:.0f} B per parameter at the HBM bandwidth, FSDP's "
            f"weight gathers and gradient reduce-scatter at the ICI bandwidth, not overlapped; implied MFU "
            f"{row['implied_mfu']:.1%} ({best}); wall clock x{wall[1]:.2f} ({wall[0]:.2f}-{wall[2]:.2f}: the chip's "
            f"stalls, measured); start-up {start[1] / 60:.0f} min ({start[0] / 60:.1f}-{start[2] / 60:.0f}, assumed); "
            f"{row['checkpoint_saves']} checkpoint saves {ckpt[1] / 60:.1f} min ({ckpt[0] / 60:.1f}-{ckpt[2] / 60:.1f}: "
            f"the train state at {CHECKPOINT_MIB_S[2]:.0f}-{CHECKPOINT_MIB_S[0]:.0f} MiB/s, cited)")


def budget_on_vm(sets: list[str], machine: budget.Machine, root: Path = ROOT) -> dict[str, Any] | None:
    """The machine budget of HEAD's params.yaml + ``sets`` (what vm_run ships) on ``machine``, no compile;
    raises ConfigError naming the key to change when it does not fit (:func:`machine_budget`)."""
    _, composed, views = composed_views(sets, root, tuple(BRANCH_STAGES), committed=True)
    return machine_budget(composed, views, machine, root, root / "work" / "preflight", refuse=True)


def machine_budget(composed: dict[str, Any], views: dict[str, View], machine: budget.Machine, root: Path,
                   work: Path, refuse: bool) -> dict[str, Any] | None:
    """Print the budget of the branches that run on one TPU VM (backend local): disk peaks per file
    system and host memory next to the VM's capacity (mtpipe/planning/budget.py), from the compiled
    train state where a compile is cached, else from the model's files. Written to
    ``work/preflight/budget.json`` and returned (None when no branch runs on a TPU VM); ``refuse``:
    raise ConfigError naming the key to change when it does not fit."""
    on_vm = [b for b, cfg in views.items() if topology(cfg) and cfg.hardware.backend == "local"]
    if not on_vm:
        return None
    for branch in on_vm:
        hardware, wanted = views[branch].hardware.name, maxtext_topology(topology(views[branch]))
        if machine.tpu and wanted != machine.tpu:
            raise ConfigError("vm.machine_type", f"holds a {machine.tpu}, but {branch}.hardware ({hardware}) runs "
                              f"on a {wanted}", f"give the VM the branch's TPU (conf/hardware/{hardware}.yaml names its "
                              "machine type) in a VM config named by $MTPIPE_VM_CONFIG, or set "
                              f"{branch}.hardware to a preset of the VM's TPU")
    topo = maxtext_topology(topology(views[on_vm[0]]))
    host = machine.host or budget.host_of(topo)
    if host is None:   # no published figure: the VM's own RAM and /dev/shm decide, after its setup
        print(f"mtpipe preflight: machine budget of {'+'.join(on_vm)} deferred to the VM: {generations.TABLE_NAME} "
              f"gives no RAM for a {topo} VM, so it is read on the VM after the setup (mtpipe/cloud/checks/host.py)")
        return None
    stages = {b: {s: stage_view(composed[b], s) for s in BUDGET_STAGES[b]} for b in on_vm}
    missing = [str(root / cfg.model.source.path) for b in on_vm for cfg in [stages[b]["hf_download"]]
               if cfg.model.source.kind == "local" and not (root / cfg.model.source.path).is_dir()]
    if missing:
        print(f"mtpipe preflight: machine budget skipped: {', '.join(missing)} not generated "
              "(`dvc repro make_embedded`)")
        return None
    compiled = {}
    for b in on_vm:
        stored = stored_compile(*training_step(views[b]), work)
        if stored is not None:
            compiled[b] = stored
    place = budget.Placement.from_env(machine.env)
    plan = budget.plan(stages, place, compiled, root, host.left)
    rep = budget.report(plan, topo, machine.boot_disk_gb, host) | {
        "run_dirs": place.run_dirs, "compiled_branches": sorted(compiled), "boot_disk_gb": machine.boot_disk_gb}
    work.mkdir(parents=True, exist_ok=True)
    (work / "budget.json").write_text(json.dumps(rep, indent=1) + "\n")
    print(f"mtpipe preflight: machine budget of {'+'.join(on_vm)} on one {topo} VM (run directories: "
          f"{place.run_dirs}; sizes from {'the compiled train state' if compiled else 'the model files'}; "
          f"RAM and /dev/shm: {host.source}; each peak x {1 + budget.MARGIN:.2f} must fit):\n{budget.table(rep)}\n"
          f"items: {work}/budget.json", flush=True)
    if refuse:
        budget.check(plan, rep, place)
    return rep


def versions_line(vm_lock: Path = ROOT / "requirements-vm.lock") -> str:
    """The compiler's versions, and whether they are the TPU VM's (``vm_lock``)."""
    ours, vm = versions(), toolchain.lock_pins(vm_lock.read_text())
    said = ", ".join(f"{name} {version}" for name, version in ours.items())
    differ = [f"{name} {vm.get(name, 'absent')}" for name, version in ours.items() if vm.get(name) != version]
    if differ:
        return f"compiled with {said}: NOT the TPU VM's ({', '.join(differ)}): run `make` to install requirements.lock"
    return f"compiled with {said}: the TPU VM's (requirements-vm.lock)"


# ---------------------------------------------------------------- child: the compile itself
