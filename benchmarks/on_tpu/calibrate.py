"""preflight's forecast beside what the lent TPU v5e chip measured, for every calibration slice in
benchmarks/on_tpu/records/ (the SFT tutorial's model cut in depth and vocabulary, plan.py SLICES).

    python benchmarks/on_tpu/calibrate.py            # the table, from the stored compile results
    python benchmarks/on_tpu/calibrate.py --compile  # compile each slice again first (a minute or two each)

Prints one row per slice: HBM forecast (preflight.step_forecast) and measured (peak in use + peak
reserved of ``memory_stats()``), step time forecast and measured (median after the compile steps), the
measured MFU (MaxText's own TFLOP/s over the chip's peak), and the ratios; tests/test_on_tpu.py holds
each ratio to preflight's stated tolerances (HBM_TOLERANCE, STEP_TOLERANCE).

The compile results (XLA's memory analysis, MaxText's FLOP count) are stored in records/compiled.json
under preflight's own digest of the compile's module, arguments and MaxText/JAX/libtpu versions; a
slice whose digest has changed (another MaxText, say) must be compiled again (``--compile``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mtpipe.planning import preflight  # noqa: E402

RECORDS = Path(__file__).resolve().parent / "records"
COMPILED = RECORDS / "compiled.json"
GIB = 2**30


def slices() -> list[dict[str, Any]]:
    """Every measured slice of the committed records, with its record's name."""
    found = []
    for path in sorted(RECORDS.glob("slices*.json")):
        for name, run in json.loads(path.read_text())["runs"].items():
            if run["status"] == 0:
                found.append(run | {"name": name, "record": path.name})
    return found


def measured_hbm_gib(run: dict[str, Any]) -> float:
    """What the run held at most: peak bytes in use plus the peak the runtime reserved for the program."""
    mem = run["memory"]
    return (mem["peak_bytes_in_use"] + mem["peak_bytes_reserved"]) / GIB


def compiled_for(run: dict[str, Any], compile_now: bool = False) -> dict[str, Any]:
    """preflight's compile result for the slice's arguments on v5e-1: stored, or compiled (and stored)."""
    digest = preflight.compile_digest(run["module"], run["compile_args"])
    stored = json.loads(COMPILED.read_text()) if COMPILED.is_file() else {}
    if not compile_now:
        if digest not in stored:
            raise LookupError(f"no compile result for {run['name']} under digest {digest[:12]} (other MaxText/JAX "
                              "versions or arguments): run `python benchmarks/on_tpu/calibrate.py --compile`")
        return stored[digest]
    work = preflight.ROOT / "work" / "preflight"
    work.mkdir(parents=True, exist_ok=True)
    result = preflight.compile_step(run["module"], run["compile_args"], work, work / f"calibrate-{run['name']}.log")
    stored[digest] = {k: v for k, v in result.items() if k != "cached"} | {"slice": run["name"]}
    COMPILED.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
    return stored[digest]


def compare(run: dict[str, Any], compiled: dict[str, Any]) -> dict[str, Any]:
    """preflight's forecast from the slice's compile result beside the chip's measurement."""
    chip = preflight.CHIPS["v5e"]
    hbm, step_s = preflight.step_forecast(compiled, chip, 1, run["module"])
    hbm_measured = measured_hbm_gib(run)
    mfu = run["median_tflops_per_s"] / chip.peak_tflops
    return {"slice": run["name"], "trainer": run["module"].rsplit(".", 1)[-1], "layers": run["layers"],
            "vocab": run["vocab"], "params_b": compiled["param_count"] / 1e9,
            "hbm_forecast_gib": hbm, "hbm_measured_gib": hbm_measured, "hbm_ratio": hbm / hbm_measured,
            "step_forecast_s": step_s, "step_measured_s": run["median_step_s"],
            "step_ratio": step_s / run["median_step_s"], "mfu_measured": mfu}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("slice", "trainer", "layers", "vocab", "params B", "HBM forecast GiB", "HBM measured GiB", "ratio",
            "step forecast s", "step measured s", "ratio", "MFU measured")
    lines = [head] + [(r["slice"], r["trainer"], r["layers"], r["vocab"], f"{r['params_b']:.3f}",
                       f"{r['hbm_forecast_gib']:.2f}", f"{r['hbm_measured_gib']:.2f}", f"{r['hbm_ratio']:.2f}",
                       f"{r['step_forecast_s']:.4f}", f"{r['step_measured_s']:.4f}", f"{r['step_ratio']:.2f}",
                       f"{r['mfu_measured']:.1%}") for r in rows]
    return "\n".join("| " + " | ".join(str(v) for v in line) + " |" for line in lines[:1] + [("---",) * len(head)] + lines[1:])


if __name__ == "__main__":
    again = "--compile" in sys.argv[1:]
    print(table([compare(run, compiled_for(run, again)) for run in slices()]))
    print(f"preflight: MFU {preflight.MFU:.1%}, SFT trainer extra {preflight.SFT_TRAINER_EXTRA_BYTES_PER_PARAM} B per "
          f"parameter; tolerances: HBM {preflight.HBM_TOLERANCE:.0%}, step {preflight.STEP_TOLERANCE:.0%}")
