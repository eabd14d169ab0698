"""Turn MaxText's metrics_file (one JSON object per step) into DVC plots and metrics."""

from __future__ import annotations

import csv
import json
from pathlib import Path

LOSS = "learning/loss"
EVAL_LOSS = "eval/avg_loss"
TOKENS_PER_S = "perf/per_device_tokens_per_sec"


def read_steps(path: Path) -> dict[int, dict]:
    """Last record per step (a resumed run appends steps it had already logged before the kill)."""
    records: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            records[int(record["step"])] = {**records.get(int(record["step"]), {}), **record}
    return dict(sorted(records.items()))


def loss_curve(path: Path) -> list[dict]:
    """Rows ``{step, loss[, eval_loss]}`` for the loss plot."""
    rows = []
    for step, record in read_steps(path).items():
        if LOSS in record:
            row = {"step": step, "loss": round(record[LOSS], 5)}
            if EVAL_LOSS in record:
                row["eval_loss"] = round(record[EVAL_LOSS], 5)
            if TOKENS_PER_S in record:
                row["tokens_per_s"] = round(record[TOKENS_PER_S], 1)
            rows.append(row)
    if not rows:
        raise RuntimeError(f"{path} holds no '{LOSS}' values: MaxText did not train")
    return rows


def summarize_sft(rows: list[dict]) -> dict:
    """First/last loss (mean of up to 5 steps at each end), last eval loss, median tokens/s."""
    head, tail = rows[: min(5, len(rows))], rows[-min(5, len(rows)):]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    tps = sorted(r["tokens_per_s"] for r in rows[1:] if "tokens_per_s" in r)
    return {
        "steps": rows[-1]["step"],
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "loss_first5_mean": round(sum(r["loss"] for r in head) / len(head), 5),
        "loss_last5_mean": round(sum(r["loss"] for r in tail) / len(tail), 5),
        **({"eval_loss_first": evals[0], "eval_loss_last": evals[-1]} if evals else {}),
        **({"tokens_per_s_median": tps[len(tps) // 2]} if tps else {}),
    }


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write rows as CSV with the union of their keys as header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
