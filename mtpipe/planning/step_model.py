"""How long a training step takes on the TPU slice a user rents, from what preflight's compile gives.

A step costs its arithmetic, the HBM traffic that grows with the parameters, and the collectives that
move the parameters between chips under FSDP (MaxText's ``ici_fsdp_parallelism=-1``)::

    step_s = flops / (peak x efficiency[generation])
           + (params x gathered + params / chips x (bytes_per_param - gathered))
             / hbm_bandwidth
           + (chips - 1) / chips x params x (2 x weight_bytes + GRADIENT_BYTES) / ici_bandwidth

``flops`` is MaxText's count for the step per chip (the number its MFU logging divides by),
``params`` the model's. Every chip holds a shard of the weights, gradients and optimizer state
(the optimizer's traffic divides by the chips), but FSDP gathers each layer's full weights onto every
chip for the forward and again for the rematerialised forward and backward, and each chip writes the
layer's full gradient before the reduce-scatter: that part of the traffic does not divide
(``gathered``: :func:`gathered_bytes_per_param`). The collectives are counted at the generation's ICI
bandwidth and not overlapped with the arithmetic: the tutorials' commands pass none of the
collective-overlap XLA flags MaxText's tuned recipes set, whose public runs are fit with them
overlapped (``overlapped``; docs/step-time.md).

The efficiency is each generation's own (conf/generations.yaml ``step``): on v5e the fit on the lent
chip's records (benchmarks/on_tpu/records/slices*.json), on v6e the fit on public MaxText v6e runs
(records/public_v6e.json), elsewhere a judgement printed as one. ``bytes_per_param`` is fit on the chip
(the only records that vary the batch at a fixed model). ``benchmarks/on_tpu/calibrate.py`` refits
all of them; tests/planning/test_on_tpu.py holds the constants to that fit and every record to its
leave-one-out forecast.

GRPO (train_rl): each step samples ``new_tokens`` tokens, each a decode step that reads the rollout's
weights once (memory-bound: the JAX rollout at DECODE_EFFICIENCY of the HBM bandwidth, measured on the
chip; vLLM's at :data:`VLLM_DECODE_EFFICIENCY`, derived from a cited vLLM-on-TPU run), then trains on
the completions: the step above on the GRPO batch, times GRPO_TRAIN_FACTOR for the log-prob passes.
"""

from __future__ import annotations

from typing import Protocol, Sequence

# Fit on the lent v5e chip's SFT slices (least squares on relative error, benchmarks/on_tpu/calibrate.py --fit).
STEP_BYTES_PER_PARAM = 83.2    # HBM bytes moved per parameter per step, whatever the batch
GRADIENT_BYTES = 4             # a gradient's bytes in the reduce-scatter (f32)
GATHER_PASSES = 3              # the weights gathered for the forward, the rematerialised forward and the backward


def gathered_bytes_per_param(weight_bytes: float) -> float:
    """Of :data:`STEP_BYTES_PER_PARAM`, what FSDP moves through every chip's HBM whatever the chip count
    (assumed from the step's structure): per gather, the full weights written by the all-gather and read
    by the cast to bf16, the bf16 copy written and read by the matmuls; then the full f32 gradient of a
    layer written and read before its reduce-scatter. f32 weights: 3 x (4 + 4 + 2 + 2) + 2 x 4 = 44 B;
    the rest (the optimizer's update of each chip's shard: AdamW's weights, moments and gradient, ~36 B)
    divides by the chips."""
    return GATHER_PASSES * (2 * weight_bytes + 4) + 2 * GRADIENT_BYTES
# GRPO with the JAX rollout (records/grpo*.json)
DECODE_EFFICIENCY = 0.204      # of the HBM bandwidth, reading the rollout's weights once per token
GRPO_TRAIN_FACTOR = 0.773      # the GRPO train step with its log-prob passes, over the SFT-step model
# The wall-clock step over the device-bound one (the lower quartile the fit uses), low, mid, high:
# measured on the chip, each record's mean step after the first over its lower quartile, leaving out
# the steps over 10x the median (a checkpoint save: counted on its own); calibrate.wall_clock_factors
WALL_CLOCK_FACTOR = (1.014, 1.597, 2.322)
# vLLM's decode on v6e, of the HBM bandwidth per token (low, mid, high): derived from the one absolute
# vLLM-on-TPU figure found, Llama 3.3 70B on a v6e-8 (tensor parallel 8, vllm-tpu v0.12.0): mean time per
# output token 35.12 ms at 128 concurrent requests, 25.35 ms at 64 (AI-Hypercomputer/tpu-recipes
# inference/trillium/vLLM/Llama3.x/README.md @ b709d734, results of 2025-12-03): 17.6 GB of weights a chip
# over 1640 GB/s is 10.7 ms, so 31% and 42% of the bandwidth. The low end (15%) is assumed: a batch-1
# request or an 8B model's smaller matrices may do worse. No absolute Llama 3.1 8B v6e figure was found
# (benchmarks/public/vllm_tpu.yaml).
VLLM_DECODE_EFFICIENCY = (0.15, 0.31, 0.42)


class Slice(Protocol):
    """What the step reads of one JAX device of the rented TPU (conf/generations.yaml ``chip``)."""

    peak_tflops: float
    hbm_gbps: float
    ici_gbits: float


def collective_bytes(params: float, chips: int, weight_bytes: float) -> float:
    """Bytes each chip sends over ICI in one FSDP step: the weights gathered twice (forward; backward
    with its rematerialised forward) and the gradients reduce-scattered, each ring moving (chips - 1) /
    chips of the whole."""
    return (chips - 1) / chips * params * (2 * weight_bytes + GRADIENT_BYTES)


def parts_s(flops: float, params: float, chips: int, chip: Slice, efficiency: float,
            weight_bytes: float = 4.0, bytes_per_param: float = STEP_BYTES_PER_PARAM) -> dict[str, float]:
    """Seconds of one training step of ``flops`` per chip over a model of ``params`` parameters sharded
    over ``chips`` (``weight_bytes``: a weight's bytes, 4 for f32): its arithmetic, HBM traffic and collectives."""
    gathered = min(gathered_bytes_per_param(weight_bytes), bytes_per_param)
    traffic = params * gathered + params / chips * (bytes_per_param - gathered)
    return {"compute_s": flops / (chip.peak_tflops * 1e12 * efficiency), "hbm_s": traffic / (chip.hbm_gbps * 1e9),
            "ici_s": collective_bytes(params, chips, weight_bytes) / (chip.ici_gbits / 8 * 1e9)}


def train_step_s(flops: float, params: float, chips: int, chip: Slice, efficiency: float,
                 weight_bytes: float = 4.0, bytes_per_param: float = STEP_BYTES_PER_PARAM,
                 overlapped: bool = False) -> float:
    """Seconds of one training step: the sum of :func:`parts_s`; ``overlapped`` (a run with XLA's
    collective-overlap flags, as MaxText's tuned recipes set them): the collectives hidden behind the
    arithmetic, only what outlasts it counted."""
    p = parts_s(flops, params, chips, chip, efficiency, weight_bytes, bytes_per_param)
    ici = max(0.0, p["ici_s"] - p["compute_s"]) if overlapped else p["ici_s"]
    return p["compute_s"] + p["hbm_s"] + ici


def implied_mfu(flops: float, step_s: float, peak_tflops: float) -> float:
    """The share of the peak a forecast step implies: MaxText's counted FLOPs over the step at the peak."""
    return flops / (step_s * peak_tflops * 1e12)


def decode_s(new_tokens: int, weight_bytes: float, hbm_gbps: float, efficiency: float = DECODE_EFFICIENCY) -> float:
    """Seconds to sample ``new_tokens`` tokens when each decode step reads ``weight_bytes`` (per chip)."""
    return new_tokens * weight_bytes / (hbm_gbps * 1e9 * efficiency)


def interval(step_s: float, step_error: Sequence[float]) -> tuple[float, float]:
    """The range the step time is forecast to fall in: the generation's leave-one-out misses."""
    return step_s * step_error[0], step_s * step_error[1]


def fit_sft(compute_s: Sequence[float], traffic_s: Sequence[float], measured_s: Sequence[float]) -> tuple[float, float]:
    """(compute efficiency, bytes per parameter) from each record's arithmetic at the peak
    (flops / peak), its parameters over the bandwidth (params x 1 B / bandwidth) and its measured step,
    by least squares on the relative error."""
    a = [c / t for c, t in zip(compute_s, measured_s)]
    b = [m / t for m, t in zip(traffic_s, measured_s)]
    aa, ab, bb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b)), sum(y * y for y in b)
    det = aa * bb - ab * ab  # the normal equations of min sum((x a + y b - 1)^2)
    inv_efficiency, bytes_per_param = (bb * sum(a) - ab * sum(b)) / det, (aa * sum(b) - ab * sum(a)) / det
    return 1 / inv_efficiency, bytes_per_param


def fit_efficiency(compute_s: Sequence[float], rest_s: Sequence[float], measured_s: Sequence[float]) -> float:
    """The compute efficiency e minimising sum((compute / e + rest) / measured - 1)^2: ``rest`` the
    step's traffic and collectives, already known."""
    a = [c / m for c, m in zip(compute_s, measured_s)]
    r = [1 - x / m for x, m in zip(rest_s, measured_s)]
    return sum(x * x for x in a) / sum(x * y for x, y in zip(a, r))


def fit_ratio(forecast: Sequence[float], measured: Sequence[float]) -> float:
    """The one factor k minimising sum((k x forecast / measured - 1)^2)."""
    r = [f / m for f, m in zip(forecast, measured)]
    return sum(r) / sum(x * x for x in r)
