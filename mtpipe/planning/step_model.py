"""How long a training step takes on a TPU chip, from what preflight's compile gives, fit on the chip.

A step costs its arithmetic and the HBM traffic that grows with the parameters (weights read in the
forward, the recomputed forward and the backward pass, gradients, AdamW's moments, the SFT trainer's
accumulation buffer), whatever the batch::

    step_s = flops / (peak_flops x COMPUTE_EFFICIENCY) + params x STEP_BYTES_PER_PARAM / hbm_bandwidth

``flops`` is MaxText's count for the step (the number its MFU logging divides by), ``params`` the
parameters per chip. The two constants are fit by least squares on relative error to the step times
the lent TPU v5e chip measured (benchmarks/on_tpu/records/slices*.json): both tutorial families at
real width, batch 1-4. A constant MFU cannot follow the batch: at batch 1 a slice's parameter
traffic is as long as its arithmetic, at batch 4 a fifth of it (docs/preflight.md).

GRPO (train_rl with the JAX rollout, records/grpo*.json): each step samples ``new_tokens`` tokens,
each a decode step that reads the rollout's weights once (memory-bound, DECODE_EFFICIENCY of the HBM
bandwidth; vLLM's rollout, which the chip cannot run, at the assumed VLLM_DECODE_EFFICIENCY), then
trains on the completions: the step above on the GRPO batch, times
GRPO_TRAIN_FACTOR for the old-policy and reference log-prob passes around it.

The interval preflight prints is the largest leave-one-out miss on each side (:data:`STEP_ERROR`),
widened on another chip generation by :data:`GENERATION_ERROR` (docs/step-time.md).
``benchmarks/on_tpu/calibrate.py`` refits all of these; tests/planning/test_on_tpu.py holds the constants to
that fit and every record to its leave-one-out forecast.
"""

from __future__ import annotations

from typing import Sequence

# Fit on the SFT slices (least squares on relative error, benchmarks/on_tpu/calibrate.py --fit).
COMPUTE_EFFICIENCY = 0.829     # of the chip's bf16 peak, for MaxText's FLOP count of the step
STEP_BYTES_PER_PARAM = 83.5    # HBM bytes moved per parameter per step, whatever the batch
# measured / forecast of the step time over the leave-one-out forecasts of every record in the fit,
# lowest and highest: the printed interval (calibrate.OUTSIDE_THE_STEP_FIT: the records left out, and why)
STEP_ERROR = (0.83, 1.28)
# GRPO with the JAX rollout (records/grpo*.json)
DECODE_EFFICIENCY = 0.204      # of the HBM bandwidth, reading the rollout's weights once per token
VLLM_DECODE_EFFICIENCY = 0.5   # vLLM's rollout (the tutorial's): assumed, not measured (the chip cannot run it)
GRPO_TRAIN_FACTOR = 0.771      # the GRPO train step with its log-prob passes, over the SFT-step model
# Another chip generation than the one measured (v5e): the compute term scales with the peak, the
# traffic terms with the bandwidth; what the efficiencies do there is not measured (docs/preflight.md)
MEASURED_GENERATION = "v5e"
GENERATION_ERROR = 0.25


def train_step_s(flops: float, params: float, peak_tflops: float, hbm_gbps: float,
                 compute_efficiency: float = COMPUTE_EFFICIENCY,
                 bytes_per_param: float = STEP_BYTES_PER_PARAM) -> float:
    """Seconds of one training step of ``flops`` (per chip) over ``params`` parameters (per chip)."""
    return flops / (peak_tflops * 1e12 * compute_efficiency) + params * bytes_per_param / (hbm_gbps * 1e9)


def decode_s(new_tokens: int, weight_bytes: float, hbm_gbps: float, efficiency: float = DECODE_EFFICIENCY) -> float:
    """Seconds to sample ``new_tokens`` tokens when each decode step reads ``weight_bytes`` (per chip)."""
    return new_tokens * weight_bytes / (hbm_gbps * 1e9 * efficiency)


def interval(step_s: float, generation: str) -> tuple[float, float]:
    """The range the step time is forecast to fall in: the chip's leave-one-out misses, widened by
    :data:`GENERATION_ERROR` on a generation the records were not measured on."""
    low, high = STEP_ERROR
    if generation != MEASURED_GENERATION:
        low, high = low * (1 - GENERATION_ERROR), high * (1 + GENERATION_ERROR)
    return step_s * low, step_s * high


def fit_sft(compute_s: Sequence[float], traffic_s: Sequence[float], measured_s: Sequence[float]) -> tuple[float, float]:
    """(COMPUTE_EFFICIENCY, STEP_BYTES_PER_PARAM) from each record's arithmetic at the peak
    (flops / peak), its parameters over the bandwidth (params x 1 B / bandwidth) and its measured step,
    by least squares on the relative error."""
    a = [c / t for c, t in zip(compute_s, measured_s)]
    b = [m / t for m, t in zip(traffic_s, measured_s)]
    aa, ab, bb = sum(x * x for x in a), sum(x * y for x, y in zip(a, b)), sum(y * y for y in b)
    det = aa * bb - ab * ab  # the normal equations of min sum((x a + y b - 1)^2)
    inv_efficiency, bytes_per_param = (bb * sum(a) - ab * sum(b)) / det, (aa * sum(b) - ab * sum(a)) / det
    return 1 / inv_efficiency, bytes_per_param


def fit_ratio(forecast: Sequence[float], measured: Sequence[float]) -> float:
    """The one factor k minimising sum((k x forecast / measured - 1)^2)."""
    r = [f / m for f, m in zip(forecast, measured)]
    return sum(r) / sum(x * x for x in r)

