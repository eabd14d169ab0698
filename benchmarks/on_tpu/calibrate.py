"""preflight's forecast beside what the lent TPU v5e chip measured, for every record in
benchmarks/on_tpu/records/: the SFT slices (both tutorial families at real width, cut in depth and
vocabulary, batch 1-4) and the GRPO cuts (train_rl with the JAX rollout), each forecast by a model
fit on the OTHER records (leave-one-out).

    python benchmarks/on_tpu/calibrate.py            # the table, from the stored compile results
    python benchmarks/on_tpu/calibrate.py --fit      # and the constants fit on every record
    python benchmarks/on_tpu/calibrate.py --compile  # compile each record's step again first (minutes each)

The model (mtpipe/planning/step_model.py): step = FLOPs at a compute efficiency + a number of HBM
bytes per parameter at the bandwidth; the SFT trainer's HBM is the compile's plus bytes per parameter
(preflight.SFT_TRAINER_EXTRA_BYTES_PER_PARAM); GRPO adds a memory-bound decode per sampled token and
what train_rl holds beside the compiled step. tests/planning/test_on_tpu.py holds every record's leave-one-out
forecast within preflight's HBM_TOLERANCE and STEP_TOLERANCE, and the committed constants to this fit.

The compile results (XLA's memory analysis, MaxText's FLOP count) are stored in records/compiled.json
under preflight's own digest of the compile's module, arguments and MaxText/JAX/libtpu versions; a
record whose digest has changed (another MaxText, say) must be compiled again (``--compile``).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpipe.maxtext import commands  # noqa: E402
from mtpipe.pipeline import generations  # noqa: E402
from mtpipe.planning import aot, preflight, step_model  # noqa: E402

RECORDS = Path(__file__).resolve().parent / "records"
COMPILED = RECORDS / "compiled.json"
GIB = 2**30
MEASURED = "v5e"              # the lent chip's generation
CHIP = generations.load()[MEASURED].chip
PUBLIC = RECORDS / "public_v6e.json"   # the public v6e runs (benchmarks/public/v6e_points.py)


# Records the step-time fit and its interval leave out, with what the chip showed. Each stays in the table
# beside its forecast, and tests/planning/test_on_tpu.py checks it still misses (else it belongs in the fit again).
OUTSIDE_THE_STEP_FIT = {
    name: "a two-layer Llama: its steady step is 1.5x what one and three layers say (llama_d1_v16k_b1 0.062 s, "
          "llama_d3_v4k_b1 0.125 s), at 16k and 8k vocabularies alike; a shape this compile handles badly, "
          "not a cost the tutorial's 32-layer model pays"
    for name in ("llama_d2_v16k_b1", "llama_d2_v8k_b1")} | {
    "mixtral-8x7b_v6e-256": "a mixture of experts: its routing and expert dispatch are no term of the step model "
                            "(32% MFU where the dense runs hold 38-47%), and no tutorial trains one"}


def measured_runs(prefix: str) -> list[dict[str, Any]]:
    """Every run of the committed records ``<prefix>*.json`` that finished, with its record's name."""
    found = []
    for path in sorted(RECORDS.glob(f"{prefix}*.json")):
        for name, run in json.loads(path.read_text())["runs"].items():
            if run["status"] == 0:
                found.append(run | {"name": name, "record": path.name})
    return found


def slices() -> list[dict[str, Any]]:
    """The measured SFT-tutorial slices (records/slices*.json). A slice measured after another in one process
    (``--together``) and again in a process of its own (records/own_*.json) counts by the latter: a stage's
    process runs one training, and memory_stats() keeps one peak per process."""
    own = {run["name"]: run for run in measured_runs("own")}
    return [own.get(run["name"], run) for run in measured_runs("slices")]


def grpo_runs() -> list[dict[str, Any]]:
    """The measured GRPO cuts (records/grpo*.json)."""
    return measured_runs("grpo")


def measured_hbm_gib(run: dict[str, Any]) -> float:
    """What the run held at most: peak bytes in use plus the peak the runtime reserved for the program."""
    mem = run["memory"]
    return (mem["peak_bytes_in_use"] + mem["peak_bytes_reserved"]) / GIB


def measured_step_s(run: dict[str, Any]) -> float:
    """The device-bound step: the lower quartile of the step times where the record has them (collect.py's
    ``steady_step_s``: a checkpoint save or a stalled host adds seconds to a few steps), else the median."""
    return run.get("steady_step_s") or run["median_step_s"]


def wall_clock_factors() -> list[float]:
    """Per SFT slice that kept every step: the mean step after the first over the lower quartile (the
    device-bound step the fit uses), leaving out the steps over 10x the median (a checkpoint save or an
    evaluation, counted on their own)."""
    factors = []
    for run in slices():
        if "step_s" in run:
            times = run["step_s"][1:]
            kept = [t for t in times if t <= 10 * statistics.median(times)]
            factors.append(statistics.mean(kept) / run["steady_step_s"])
    return factors


def compiled_for(run: dict[str, Any], compile_now: bool = False) -> dict[str, Any]:
    """preflight's compile result for the run's arguments on v5e-1: stored, or compiled (and stored)."""
    digest = aot.compile_digest(run["module"], run["compile_args"])
    stored = json.loads(COMPILED.read_text()) if COMPILED.is_file() else {}
    if not compile_now:
        if digest not in stored:
            raise LookupError(f"no compile result for {run['name']} under digest {digest[:12]} (other MaxText/JAX "
                              "versions or arguments): run `python benchmarks/on_tpu/calibrate.py --compile`")
        return stored[digest]
    work = preflight.ROOT / "work" / "preflight"
    work.mkdir(parents=True, exist_ok=True)
    result = aot.compile_step(run["module"], run["compile_args"], work, work / f"calibrate-{run['name']}.log")
    stored[digest] = {k: v for k, v in result.items() if k != "cached"} | {"slice": run["name"]}
    COMPILED.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    return stored[digest]


@dataclass(frozen=True)
class Point:
    """One record, reduced to what the model reads: from its compile (or count) and its measurement."""

    name: str
    kind: str               # the trainer: SFT, pre-train or GRPO
    grpo: bool
    generation: str         # conf/generations.yaml's row it ran on
    chips: int
    flops: float            # MaxText's count per chip (GRPO: the train step on the real batch)
    params: float           # the model's parameters
    weight_bytes: float     # a weight's bytes
    decode_s: float         # GRPO: the sampled tokens x the rollout's weight bytes at the bandwidth; else 0
    hbm_compiled_gib: float | None  # preflight's HBM forecast without the fitted bytes per parameter; None: no HBM measured
    params_gib: float       # parameters / GiB (times the fitted bytes per parameter: the rest of the HBM)
    step_s: float           # measured
    hbm_gib: float | None   # measured; None where the record has none (the public runs)
    rollout_s: float        # measured (GRPO; else 0)
    overlapped: bool = False  # ran with XLA's collective-overlap flags (the public recipes)

    @property
    def chip(self) -> generations.Chip:
        return generations.load()[self.generation].chip

    @property
    def compute_s(self) -> float:
        """The step's FLOPs at the chip's peak."""
        return self.flops / (self.chip.peak_tflops * 1e12)

    @property
    def traffic_s(self) -> float:
        """Its parameters x 1 byte at the chip's HBM bandwidth (one chip: all of them)."""
        return self.params / self.chips / (self.chip.hbm_gbps * 1e9)

    def rest_s(self, bytes_per_param: float) -> float:
        """The step's HBM traffic and collectives at ``bytes_per_param`` (overlapped: none left over)."""
        parts = step_model.parts_s(self.flops, self.params, self.chips, self.chip, 1.0, self.weight_bytes,
                                   bytes_per_param)
        return parts["hbm_s"] + (0.0 if self.overlapped else parts["ici_s"])


def point(run: dict[str, Any], compiled: dict[str, Any]) -> Point:
    """The chip's record ``run`` as a :class:`Point`, through preflight's own HBM parts."""
    grpo = run["module"] == commands.TRAIN_RL
    hbm = preflight.hbm_parts(compiled, 1, run["module"])
    hbm.pop("sft_trainer_extra", None)
    flops = compiled["tflops_per_device"] * 1e12
    decode = 0.0
    if grpo:
        c = compiled["config"]
        flops *= c["grpo_sequences"] / c["global_batch_size_to_train_on"]
        _, needed, _ = preflight._grpo_estimate("cpu_jax", compiled, CHIP, 1, hbm)
        hbm_compiled = needed - hbm.pop("grpo_trainer_extra")
        decode = step_model.decode_s(run["new_tokens"], compiled["param_bytes"], CHIP.hbm_gbps, efficiency=1.0)
    else:
        hbm_compiled = sum(hbm.values())
    extra_applies = grpo or run["module"] == commands.TRAIN_SFT
    kind = "GRPO" if grpo else "SFT" if run["module"] == commands.TRAIN_SFT else "pre-train"
    return Point(run["name"], kind, grpo, "v5e", 1, flops, compiled["param_count"],
                 compiled["param_bytes"] / compiled["param_count"], decode, hbm_compiled,
                 compiled["param_count"] / GIB if extra_applies else 0.0,
                 measured_step_s(run), measured_hbm_gib(run), run.get("median_rollout_s") or 0.0)


def public_points() -> list[Point]:
    """The public MaxText v6e runs (records/public_v6e.json, from benchmarks/public/v6e_maxtext.yaml by
    benchmarks/public/v6e_points.py): MaxText's FLOP count and the parameters, no HBM measured."""
    runs = json.loads(PUBLIC.read_text())["runs"].values()
    return [Point(r["name"], "public pre-train", False, generations.of_accelerator(r["chips"])[0].name,
                  generations.of_accelerator(r["chips"])[1], r["tflops_per_device"] * 1e12, r["param_count"],
                  r["param_bytes"] / r["param_count"], 0.0, None, 0.0, r["step_s"], None, 0.0, r["overlapped"])
            for r in runs if "error" not in r]


@dataclass(frozen=True)
class Constants:
    """What the model fits: step_model's and preflight's constants, an efficiency per generation."""

    compute_efficiency: dict[str, float]
    step_bytes_per_param: float
    sft_extra_bytes_per_param: float
    decode_efficiency: float
    grpo_train_factor: float
    grpo_extra_bytes_per_param: float


def _bytes_per_param(points: list[Point]) -> float:
    """Least squares (relative) of measured - compiled HBM over the parameters, in bytes per parameter."""
    num = sum(p.params_gib * (p.hbm_gib - p.hbm_compiled_gib) / p.hbm_gib**2 for p in points)
    den = sum(p.params_gib**2 / p.hbm_gib**2 for p in points)
    return num / den if den else 0.0


def fit(points: list[Point]) -> Constants:
    """The constants fit on ``points``: the SFT step (v5e's efficiency and the bytes per parameter) and
    HBM on the chip's SFT slices; each other generation's efficiency on its own records, with those
    bytes; then, on the GRPO cuts, the rollout's decode efficiency on its measured time, the train-step
    factor on the rest of the step (the train step through the SFT fit), and the extra HBM."""
    chip = [p for p in points if p.generation == MEASURED]
    sft = [p for p in chip if not p.grpo and p.name not in OUTSIDE_THE_STEP_FIT]
    sft_hbm = [p for p in chip if not p.grpo and p.params_gib]
    grpo = [p for p in chip if p.grpo]
    efficiency, bytes_per_param = step_model.fit_sft([p.compute_s for p in sft], [p.traffic_s for p in sft],
                                                     [p.step_s for p in sft])
    efficiencies = {MEASURED: efficiency}
    for gen in sorted({p.generation for p in points} - {MEASURED}):
        own = [p for p in points if p.generation == gen and p.name not in OUTSIDE_THE_STEP_FIT]
        efficiencies[gen] = step_model.fit_efficiency([p.compute_s for p in own],
                                                      [p.rest_s(bytes_per_param) for p in own], [p.step_s for p in own])
    train = [p.compute_s / efficiency + p.traffic_s * bytes_per_param for p in grpo]
    # each part on its own measurement: the rollout's time, and the rest of the step
    decode_efficiency = 1 / step_model.fit_ratio([p.decode_s for p in grpo], [p.rollout_s for p in grpo])
    train_factor = step_model.fit_ratio(train, [p.step_s - p.rollout_s for p in grpo])
    return Constants(efficiencies, bytes_per_param, _bytes_per_param(sft_hbm),
                     decode_efficiency, train_factor, _bytes_per_param(grpo))


def forecast(p: Point, k: Constants) -> tuple[float | None, float]:
    """(HBM GiB, step s) of ``p`` under the constants ``k`` (HBM None where the record measured none)."""
    train = step_model.train_step_s(p.flops, p.params, p.chips, p.chip, k.compute_efficiency[p.generation],
                                    p.weight_bytes, k.step_bytes_per_param, p.overlapped)
    if p.grpo:
        return (p.hbm_compiled_gib + k.grpo_extra_bytes_per_param * p.params_gib,
                p.decode_s / k.decode_efficiency + k.grpo_train_factor * train)
    if p.hbm_compiled_gib is None:
        return None, train
    return p.hbm_compiled_gib + k.sft_extra_bytes_per_param * p.params_gib, train


def points(compile_now: bool = False) -> list[Point]:
    """Every measured record (the chip's SFT slices, GRPO cuts, then the public v6e runs) as a :class:`Point`."""
    return [point(run, compiled_for(run, compile_now)) for run in slices() + grpo_runs()] + public_points()


def leave_one_out(pts: list[Point]) -> list[dict[str, Any]]:
    """Each record beside its forecast from the constants fit on all the others."""
    rows = []
    for i, p in enumerate(pts):
        hbm, step_s = forecast(p, fit(pts[:i] + pts[i + 1:]))
        rows.append({"name": p.name, "kind": p.kind, "generation": p.generation, "chips": p.chips,
                     "hbm_forecast_gib": hbm, "hbm_measured_gib": p.hbm_gib,
                     "hbm_ratio": hbm / p.hbm_gib if hbm is not None else None, "step_forecast_s": step_s,
                     "step_measured_s": p.step_s, "step_ratio": step_s / p.step_s,
                     "mfu_measured": p.compute_s / p.step_s, "outside_the_step_fit": p.name in OUTSIDE_THE_STEP_FIT})
    return rows


def transfer(pts: list[Point]) -> list[float]:
    """measured / forecast of each record off the chip's generation when its forecast takes the chip's
    efficiency (fit on the chip alone): how far the v5e fit carries to v6e."""
    k = fit([p for p in pts if p.generation == MEASURED])
    return [p.step_s / step_model.train_step_s(p.flops, p.params, p.chips, p.chip, k.compute_efficiency[MEASURED],
                                               p.weight_bytes, k.step_bytes_per_param, p.overlapped)
            for p in pts if p.generation != MEASURED]


def table(rows: list[dict[str, Any]]) -> str:
    head = ("record", "kind", "HBM forecast GiB", "HBM measured GiB", "ratio", "step forecast s", "step measured s",
            "ratio", "MFU measured")
    gib = lambda v, f=".2f": "-" if v is None else format(v, f)  # noqa: E731
    lines = [head] + [(r["name"] + (" (outside the step fit)" if r["outside_the_step_fit"] else ""), r["kind"],
                       gib(r["hbm_forecast_gib"]), gib(r["hbm_measured_gib"]),
                       gib(r["hbm_ratio"], ".3f"), f"{r['step_forecast_s']:.4f}", f"{r['step_measured_s']:.4f}",
                       f"{r['step_ratio']:.3f}", f"{r['mfu_measured']:.1%}") for r in rows]
    return "\n".join("| " + " | ".join(str(v) for v in line) + " |" for line in lines[:1] + [("---",) * len(head)] + lines[1:])


def step_error(rows: list[dict[str, Any]], generation: str = MEASURED) -> tuple[float, float]:
    """measured / forecast of the step time, lowest and highest over ``generation``'s leave-one-out rows in the fit."""
    ratios = [1 / r["step_ratio"] for r in rows if not r["outside_the_step_fit"] and r["generation"] == generation]
    return min(ratios), max(ratios)


if __name__ == "__main__":
    pts = points("--compile" in sys.argv[1:])
    loo = leave_one_out(pts)
    print(table(loo))
    for gen in sorted({r["generation"] for r in loo}):
        low, high = step_error(loo, gen)
        print(f"leave-one-out on {gen}: step measured/forecast {low:.3f}-{high:.3f}")
    moved = transfer(pts)
    print(f"the chip's fit alone on the other generation's records: measured/forecast {min(moved):.2f}-{max(moved):.2f} "
          f"(median {statistics.median(moved):.2f})")
    print(f"({len(OUTSIDE_THE_STEP_FIT)} records outside "
          f"the step fit), HBM within {max(abs(r['hbm_ratio'] - 1) for r in loo if r['hbm_ratio']):.1%}; median |step miss| "
          f"{statistics.median(abs(r['step_ratio'] - 1) for r in loo if not r['outside_the_step_fit']):.1%}")
    wall = wall_clock_factors()
    print(f"wall clock over the steady step: {min(wall):.3f}-{max(wall):.3f}, median {statistics.median(wall):.3f}")
    if "--fit" in sys.argv[1:]:
        print(fit(pts))
