"""Forecast beside measurement for every record (leave-one-out), as a PNG for docs/step-time.md.

    python benchmarks/on_tpu/plot_forecast.py      # -> reports/on_tpu/forecast_vs_measured.png

Two panels, step time and peak HBM: each record's forecast from the model fit on all the others
(calibrate.leave_one_out) against what was measured, with the tolerance band around the diagonal. The
lent v5e chip's records and the public v6e runs (step time only: their logs give no HBM) are marked
apart; a record outside the step fit is drawn hollow.
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


# (kind, marker, colour) of each kind of record: the chip's, then the public v6e runs'
KINDS = (("SFT", "o", "tab:blue"), ("pre-train", "^", "tab:orange"), ("GRPO", "s", "tab:green"),
         ("public pre-train", "D", "tab:red"))


def main() -> None:
    rows = calibrate.leave_one_out(calibrate.points())
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    panels = (("step", "s", "step time (s)", calibrate.preflight.STEP_TOLERANCE, True),
              ("hbm", "gib", "peak HBM (GiB)", calibrate.preflight.HBM_TOLERANCE, False))
    for ax, (key, unit, label, tolerance, log) in zip(axes, panels):
        shown = [r for r in rows if r[f"{key}_forecast_{unit}"] is not None]
        values = [r[f"{key}_{side}_{unit}"] for r in shown for side in ("measured", "forecast")]
        lo, hi = min(values) * 0.8, max(values) * 1.2
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.fill_between([lo, hi], [lo * (1 - tolerance), hi * (1 - tolerance)], [lo * (1 + tolerance), hi * (1 + tolerance)],
                        color="0.9", label=f"±{tolerance:.0%}")
        for kind, marker, colour in KINDS:
            for outside in (False, True):
                pts = [r for r in shown if r["kind"] == kind and (key == "step" and r["outside_the_step_fit"]) == outside]
                if not pts:
                    continue
                where = "public v6e runs" if kind.startswith("public") else "v5e chip"
                ax.scatter([r[f"{key}_measured_{unit}"] for r in pts], [r[f"{key}_forecast_{unit}"] for r in pts],
                           marker=marker, edgecolors=colour, facecolors="none" if outside else colour,
                           label=f"{kind.removeprefix('public ')} ({where}){', outside the fit' if outside else ''}")
                for r in pts:
                    ax.annotate(r["name"], (r[f"{key}_measured_{unit}"], r[f"{key}_forecast_{unit}"]), fontsize=5,
                                xytext=(3, -3), textcoords="offset points")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
        ax.set_xlabel(f"measured {label}" + (": the v5e chip, or the public v6e run's log" if key == "step" else ", TPU v5e chip"))
        ax.set_ylabel(f"forecast {label}, fit on the other records")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT.relative_to(calibrate.preflight.ROOT)}")


if __name__ == "__main__":
    main()
