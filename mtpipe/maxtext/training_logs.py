"""MaxText and tunix training logs (metrics_file JSONL, tensorboard events, eval lines) as DVC plots and metrics."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

from mtpipe.maxtext.log_protocol import EVAL_SAMPLES_LINE
from mtpipe.pipeline.stats import mean_ci

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
            rows.append(row)
    if not rows:
        raise RuntimeError(f"{path} holds no '{LOSS}' values: MaxText did not train")
    return rows


def missing_steps(rows: list[dict], first: int | None = None) -> list[int]:
    """Steps from ``first`` (default: the curve's first row) to its last row that have no row. A
    resumed run restarts after its checkpoint, so rows of steps up to it that a stopped run had not
    yet written (MaxText writes a step's row one step late) or mirrored to the bucket are never
    logged again."""
    logged = {row["step"] for row in rows}
    start = rows[0]["step"] if first is None else first
    return [step for step in range(start, rows[-1]["step"] + 1) if step not in logged]


def tokens_per_s_median(path: Path) -> float | None:
    """Median tokens/s per device over the steps after the first (compile) step, if MaxText logged it.

    Speed differs run to run, so it goes to work/timings.jsonl, not into the DVC metrics or plots
    (a forced rerun with identical inputs must leave dvc.lock as it was)."""
    tps = sorted(r[TOKENS_PER_S] for r in list(read_steps(path).values())[1:] if TOKENS_PER_S in r)
    return round(tps[len(tps) // 2], 1) if tps else None


def summarize_sft(rows: list[dict]) -> dict:
    """First/last loss (mean of up to 5 steps at each end), first/last eval loss."""
    head, tail = rows[: min(5, len(rows))], rows[-min(5, len(rows)):]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return {
        "steps": rows[-1]["step"],
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "loss_first5_mean": round(sum(r["loss"] for r in head) / len(head), 5),
        "loss_last5_mean": round(sum(r["loss"] for r in tail) / len(tail), 5),
        **({"eval_loss_first": evals[0], "eval_loss_last": evals[-1]} if evals else {}),
    }


def write_csv(path: Path, rows: list[dict]) -> None:
    """Write rows as CSV with the union of their keys as header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def read_tensorboard(log_dir: Path | str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from the tensorboard event files under ``log_dir`` (tunix's logger),
    a local directory or a gs:// URL (a run directory in the work bucket, mtpipe.maxtext.run_dir)."""
    import struct

    from fsspec.core import url_to_fs
    from tensorboardX.proto import event_pb2

    fs, root = url_to_fs(str(log_dir))
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(fs.glob(f"{root}/**/events.out.tfevents.*")):
        with fs.open(path, "rb") as f:
            while header := f.read(12):
                event = event_pb2.Event.FromString(f.read(struct.unpack("<Q", header[:8])[0]))
                f.read(4)
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


RL_EVAL = re.compile(r"(Pre|Post) RL Training: corr=([\d.]+), total=(\d+), accuracy=([\d.]+)%, "
                     r"partial_accuracy=([\d.]+)%, format_accuracy=([\d.]+)%, mean_reward=([-\d.]+)")
# an eval's per-prompt counts, then any eval's summary line (pre, post, intermediate)
RL_EVAL_EVENTS = re.compile(re.escape(EVAL_SAMPLES_LINE) + r" ([\d/ ]*)$|(Pre|Post) RL Training: |Intermediate Eval",
                            re.MULTILINE)
PASS_AT_K = (1, 2, 4, 8)
RL_CURVES = {  # plot column -> tensorboard tag
    "reward_mean": "rewards/train/mean",
    "reward_exact_format": "rewards/train/match_format_exactly",
    "reward_approx_format": "rewards/train/match_format_approximately",
    "reward_answer": "rewards/train/check_numbers",
    "kl": "actor/train/kl",
    "loss": "actor/train/loss",
    "completion_length": "completions/train/mean_length",
}


def pass_at_k(samples: int, right: int, k: int) -> float:
    """Chance that at least one of k samples, drawn without replacement from `samples` of which
    `right` are right, is right: the unbiased pass@k estimate 1 - C(n-c, k) / C(n, k)."""
    if not 1 <= k <= samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {samples}")
    return 1.0 - math.comb(samples - right, k) / math.comb(samples, k)


def right_samples(log_text: str) -> dict[str, list[tuple[int, int]]]:
    """(right, samples) per prompt of the evals before and after GRPO: the counts line logged just
    before each eval's summary line (mtpipe.maxtext.adapter.training, patch 12); {} for a log without them."""
    found, counts = {}, None
    for event in RL_EVAL_EVENTS.finditer(log_text):
        if event.group(1) is not None:
            counts = [tuple(map(int, item.split("/"))) for item in event.group(1).split()]
        else:
            if event.group(2) and counts is not None:
                found[event.group(2).lower()] = counts
            counts = None
    return found


def rl_eval(log_text: str) -> dict[str, dict]:
    """train_rl's eval before and after GRPO, from its log: {"pre": {...}, "post": {...}}.

    With the per-prompt counts (mtpipe.maxtext.adapter.training, patch 12) each also has `samples_per_prompt` and
    `pass_at_K` (percent, mean over prompts) for each K in PASS_AT_K up to the samples drawn.
    """
    found = {}
    for when, corr, total, acc, partial, fmt, reward in RL_EVAL.findall(log_text):
        found[when.lower()] = {"correct": float(corr) if "." in corr else int(corr),  # float: eval_mode pass_at_1
                               "total": int(total), "accuracy": float(acc),
                               "partial_accuracy": float(partial), "format_accuracy": float(fmt),
                               "mean_reward": float(reward)}
    for when, counts in right_samples(log_text).items():
        if when not in found:
            continue
        samples = min(n for _, n in counts)
        found[when]["samples_per_prompt"] = samples
        for k in (k for k in PASS_AT_K if k <= samples):
            found[when][f"pass_at_{k}"] = round(100 * sum(pass_at_k(n, c, k) for c, n in counts) / len(counts), 4)
    return found


def rl_eval_gain(log_text: str) -> dict[str, float]:
    """pass@k after GRPO - before, in points, for each k up to the samples drawn, with the 95% interval
    of the per-prompt differences (``pass_at_K`` and ``pass_at_K_ci95``): the evals before and after
    ask the same prompts in the same order, so they pair prompt by prompt. {} without both counts."""
    counts = right_samples(log_text)
    pre, post = counts.get("pre"), counts.get("post")
    if not pre or not post or len(pre) != len(post):
        return {}
    out = {}
    for k in (k for k in PASS_AT_K if k <= min(n for _, n in pre + post)):
        gain, ci, _ = mean_ci([pass_at_k(n1, c1, k) - pass_at_k(n0, c0, k) for (c0, n0), (c1, n1) in zip(pre, post)])
        out[f"pass_at_{k}"], out[f"pass_at_{k}_ci95"] = round(100 * gain, 4), round(100 * ci, 4)
    return out


def rl_curve(scalars: dict[str, list[tuple[int, float]]]) -> list[dict]:
    """One row per GRPO step with the reward (mean and per function), KL, loss and completion length.

    Rollout scalars are logged at the step before the update, actor scalars at the step after; both
    are aligned on the GRPO step they belong to (1-based).
    """
    rows: dict[int, dict] = {}
    for column, tag in RL_CURVES.items():
        shift = 0 if tag.startswith("actor/") else 1
        for step, value in scalars.get(tag, []):
            rows.setdefault(step + shift, {"step": step + shift})[column] = round(value, 5)
    if not any("reward_mean" in r for r in rows.values()):
        raise RuntimeError("no rewards/train/mean in train_rl's tensorboard logs: GRPO did not run")
    return [rows[s] for s in sorted(rows)]
