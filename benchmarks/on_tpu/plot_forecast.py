"""Forecast beside measurement for every TPU chip record (leave-one-out), as a PNG for docs/preflight.md.

    python benchmarks/on_tpu/plot_forecast.py      # -> reports/on_tpu/forecast_vs_measured.png

Two panels, step time and peak HBM: each record's forecast from the model fit on all the others
(calibrate.leave_one_out) against what the chip measured, with the tolerance band around the diagonal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import calibrate  # noqa: E402  (benchmarks/on_tpu/calibrate.py)

OUT = calibrate.preflight.ROOT / "reports" / "on_tpu" / "forecast_vs_measured.png"


def main() -> None:
    rows = calibrate.leave_one_out(calibrate.points())
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    panels = (("step", "step time (s)", calibrate.preflight.STEP_TOLERANCE, True),
              ("hbm", "peak HBM (GiB)", calibrate.preflight.HBM_TOLERANCE, False))
    for ax, (key, label, tolerance, log) in zip(axes, panels):
        measured = [r[f"{key}_measured_{'s' if key == 'step' else 'gib'}"] for r in rows]
        forecast = [r[f"{key}_forecast_{'s' if key == 'step' else 'gib'}"] for r in rows]
        lo, hi = min(measured + forecast) * 0.8, max(measured + forecast) * 1.2
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * (1 - tolerance), hi * (1 - tolerance)], [lo * (1 + tolerance), hi * (1 + tolerance)],
                        color="0.9", label=f"±{tolerance:.0%}")
        for kind, marker in (("SFT", "o"), ("pre-train", "^"), ("GRPO", "s")):
            pts = [(m, f, r["name"]) for m, f, r in zip(measured, forecast, rows) if r["kind"] == kind]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=f"{kind} (leave-one-out)")
            for m, f, name in pts:
                ax.annotate(name, (m, f), fontsize=6, xytext=(3, -3), textcoords="offset points")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured {label}, TPU v5e chip")
        ax.set_ylabel(f"forecast {label}, fit on the other records")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT.relative_to(calibrate.preflight.ROOT)}")


if __name__ == "__main__":
    main()
