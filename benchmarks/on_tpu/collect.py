"""Turn what a chip run brought back (``<group>.tgz`` from chip_run.py) into the committed record
``benchmarks/on_tpu/records/<group>.json``, checked by the project's own code on the laptop.

    python benchmarks/on_tpu/collect.py DIR        # DIR holds sft.tgz, rl.tgz and/or slices.tgz

sft and rl: loss curves beside the committed CPU run's (plots/), repeatability (sft_a vs sft_b), peak
HBM and step times; the TPU-trained SFT and GRPO params exported by MaxText's to_huggingface as the
stage does and scored by the evaluate stage's own scorer (held-out loss, GSM8K) beside the committed
base and CPU-trained scores. slices: peak HBM and step time of each slice beside preflight's forecast
for topology v5e-1 (the same compile `doit preflight` runs; tests/planning/test_on_tpu.py recomputes it).
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mtpipe.maxtext import conversion_commands, runner  # noqa: E402
from mtpipe.maxtext.training_logs import read_steps, read_tensorboard, rl_curve, rl_eval  # noqa: E402
from mtpipe.pipeline.stage import ROOT, artifact  # noqa: E402
from mtpipe.evaluation import scoring  # noqa: E402
from plan import GRPO_GROUPS, SLICE_GROUPS, committed_view, slice_forecast  # noqa: E402  (benchmarks/on_tpu/plan.py)

RECORDS = Path(__file__).resolve().parent / "records"
STEP_TIME = "perf/step_time_seconds"
TFLOPS = "perf/per_device_tflops_per_sec"


def cpu_curve(csv_path: Path, column: str) -> dict[int, float]:
    """The committed CPU run's curve (plots/<branch>/<stage>.csv): step -> value."""
    with open(csv_path, newline="") as f:
        return {int(r["step"]): float(r[column]) for r in csv.DictReader(f) if r.get(column)}


def step_stats(metrics: Path) -> dict[str, Any]:
    """Loss per step, and the step times after the first two (compile) steps: each, their median, and their
    lower quartile, the steady step (MaxText's step time is wall time between steps, so a checkpoint save or
    a stalled host adds seconds to a few steps: the device-bound step is the lower quartile, which a run
    of 17 steps with up to four such stalls keeps)."""
    steps = read_steps(metrics)
    times = [r[STEP_TIME] for s, r in steps.items() if s > 2 and STEP_TIME in r]
    tflops = [r[TFLOPS] for s, r in steps.items() if s > 2 and TFLOPS in r]
    return {"loss": {s: round(r["learning/loss"], 6) for s, r in steps.items() if "learning/loss" in r},
            "eval_loss": {s: round(r["eval/avg_loss"], 6) for s, r in steps.items() if "eval/avg_loss" in r},
            "step_s": [round(t, 5) for t in times],
            "median_step_s": round(statistics.median(times), 5) if times else None,
            "steady_step_s": round(statistics.quantiles(times, n=4)[0], 5) if len(times) > 3 else None,
            "median_tflops_per_s": round(statistics.median(tflops), 2) if tflops else None}


def beside(chip: dict[int, float], cpu: dict[int, float]) -> dict[str, Any]:
    """Per-step difference chip - CPU over the steps both logged."""
    common = sorted(chip.keys() & cpu.keys())
    diffs = [abs(chip[s] - cpu[s]) for s in common]
    return {"steps": len(common), "max_abs_diff": round(max(diffs), 6), "mean_abs_diff": round(statistics.mean(diffs), 6),
            "final_chip": chip[common[-1]], "final_cpu": cpu[common[-1]]}


def export_and_score(branch: str, params_tgz: Path, work: Path) -> dict[str, Any]:
    """The params exported as to_huggingface@<branch> does, then scored as evaluate@<branch> does."""
    params = work / f"{branch}-params"
    with tarfile.open(params_tgz) as tar:
        tar.extractall(params, filter="data")
    hf = work / f"{branch}-hf"
    cmd = conversion_commands.to_huggingface(committed_view(branch, "to_huggingface"), params=params / "model_params",
                                             hf_src_dir=artifact(branch, "model") / "files", out_dir=hf)
    runner.run(cmd, work / f"{branch}-to_huggingface.log")
    from transformers import AutoConfig  # noqa: PLC0415 (slow import, only here)
    AutoConfig.from_pretrained(hf)
    cfg = committed_view(branch, "evaluate")
    scores = scoring.score(cfg, hf, artifact(branch, "dataset"), work / f"{branch}-eval", work / f"{branch}-eval.log")
    committed = json.loads((ROOT / "metrics" / branch / "evaluate.json").read_text())
    return {"chip_trained": scores, "cpu_trained": committed["trained"], "base": committed["base"],
            "gain_over_base": scoring.gain(cfg, committed["base"], scores)}


def checkout_relative(command: str) -> str:
    """A command line the chip ran, its paths in the carried checkout named relative to a checkout (the
    chip's copy of the working tree sits where this one does)."""
    return command.replace(f"{ROOT}/", "")


def embedded(group: Path, summary: dict[str, Any], work: Path) -> dict[str, Any]:
    runs = {r["name"]: r for r in summary["runs"]}
    out: dict[str, Any] = {"runs": {}}
    for name, run in runs.items():
        row = {k: run.get(k) for k in ("status", "process_s", "wall_s", "jax_open_s", "device_kind", "params_sha256")}
        row["peak_hbm_bytes"] = (run.get("memory") or {}).get("peak_bytes_in_use")
        row["command"] = checkout_relative((group / f"{name}.command.txt").read_text().strip()) \
            if (group / f"{name}.command.txt").is_file() else None
        if (group / f"{name}.metrics.jsonl").is_file():
            row |= step_stats(group / f"{name}.metrics.jsonl")
        out["runs"][name] = row
    a, b = out["runs"].get("sft_a", {}), out["runs"].get("sft_b", {})
    if a and b:
        out["repeatable"] = {"params_equal": bool(a.get("params_sha256")) and a.get("params_sha256") == b.get("params_sha256"),
                             "loss_equal": bool(a.get("loss")) and a.get("loss") == b.get("loss")}
    for key, run_names, plot in (("sft_vs_cpu", ("sft_a", "rehearsal_sft"), "sft"),
                                 ("warmup_vs_cpu", ("rl_warmup", "rehearsal_warmup"), "rl")):
        chip = next((out["runs"][n]["loss"] for n in run_names if "loss" in out["runs"].get(n, {})), None)
        if chip:
            out[key] = beside(chip, cpu_curve(ROOT / "plots" / plot / "train_sft.csv", "loss"))
    if summary["runs"] and summary["runs"][0]["name"].startswith("rehearsal"):
        out["sets"] = json.loads((ROOT / ".tpu-chip" / "plan.json").read_text())["groups"]["rehearsal"][0]["sets"]
    grpo_name = next((n for n in ("rl_grpo", "rehearsal_grpo") if runs.get(n, {}).get("status") == 0), None)
    grpo_log = group / f"{grpo_name}.log"
    if grpo_name and grpo_log.is_file():
        text = grpo_log.read_text(errors="replace")
        out["grpo_eval"] = rl_eval(text)
        out["grpo_eval_cpu"] = {w: {k.removeprefix(f"eval_{w}_"): v for k, v in
                                    json.loads((ROOT / "metrics" / "rl" / "train_rl.json").read_text()).items()
                                    if k.startswith(f"eval_{w}_")} for w in ("pre", "post")}
        stamps = [_seconds(t) for t in re.findall(r"^I\d{4} (\d\d:\d\d:\d\d\.\d+) .*Train step \d+ training loss",
                                                   text, re.M)]
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        out["runs"][grpo_name]["median_step_s"] = round(statistics.median(gaps[2:]), 4) if len(gaps) > 3 else None
        if (group / f"{grpo_name}.tensorboard").is_dir():
            curve = rl_curve(read_tensorboard(str(group / f"{grpo_name}.tensorboard")))
            out["runs"][grpo_name]["reward"] = {r["step"]: r["reward_mean"] for r in curve if "reward_mean" in r}
    for branch, name in (("sft", "sft_a"), ("rl", "rl_grpo")):
        if (group / f"{name}.params.tgz").is_file():
            out[f"{branch}_export"] = export_and_score(branch, group / f"{name}.params.tgz", work)
    return out


def _seconds(clock: str) -> float:
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def slices(group: Path, summary: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    planned = {r["name"]: r for runs in plan["groups"].values() for r in runs}
    out: dict[str, Any] = {"runs": {}}
    for run in summary["runs"]:
        name = run["name"]
        row = {k: run.get(k) for k in ("status", "process_s", "wall_s", "device_kind")}
        row |= {k: planned[name][k] for k in ("module", "family", "layers", "vocab", "batch")}
        row["compile_args"] = slice_forecast(planned[name])
        row["memory"] = run.get("memory")
        if run.get("together"):  # several slices in one process: the peaks before this one's run
            row |= {"together": run["together"], "memory_before": run.get("memory_before"),
                    "peaks_own": peaks_own(run)}
        if (group / f"{name}.metrics.jsonl").is_file():
            stats = step_stats(group / f"{name}.metrics.jsonl")
            row |= {k: stats[k] for k in ("median_step_s", "steady_step_s", "step_s", "median_tflops_per_s", "loss")}
        out["runs"][name] = row
    return out


def peaks_own(run: dict[str, Any]) -> bool:
    """Whether a run that shared its process holds its own peak HBM: memory_stats() keeps one peak
    per process, so both peaks (in use, reserved) must have risen during the run."""
    after, before = run.get("memory") or {}, run.get("memory_before") or {}
    keys = ("peak_bytes_in_use", "peak_bytes_reserved")
    return all(after.get(k) is not None and after[k] > (before.get(k) or 0) for k in keys)


ROLLOUT = re.compile(r"cpu_jax rollout: (\d+) prompts, prompt length (\d+), (\d+) new tokens max, kv_cache=(\w+), "
                     r"([\d.]+) s")


def grpo_steps(log: str) -> dict[str, Any]:
    """From a train_rl log: the median GRPO step (between tunix's "Train step" lines) and rollout
    (the cpu_jax rollout's own timing line), both after the first two steps (compiles)."""
    stamps = [_seconds(t) for t in re.findall(r"^I\d{4} (\d\d:\d\d:\d\d\.\d+) .*Train step \d+ training loss", log, re.M)]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    rollouts = [(int(m[0]), int(m[2]), m[3] == "True", float(m[4])) for m in ROLLOUT.findall(log)]
    late = rollouts[2:]
    return {"steps_logged": len(stamps), "median_step_s": round(statistics.median(gaps[1:]), 4) if len(gaps) > 2 else None,
            "rollout_rows": rollouts[0][0] if rollouts else None, "rollout_kv_cache": rollouts[0][2] if rollouts else None,
            "rollout_new_tokens_max": rollouts[0][1] if rollouts else None,
            "median_rollout_s": round(statistics.median(r[3] for r in late), 4) if late else None,
            "rollout_s": [r[3] for r in rollouts]}


def grpo(group: Path, summary: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """GRPO at real width: peak HBM, the GRPO step and its rollout, beside preflight's compile arguments."""
    planned = {r["name"]: r for r in plan["groups"][group.name]}
    out: dict[str, Any] = {"runs": {}}
    for run in summary["runs"]:
        name = run["name"]
        row = {k: run.get(k) for k in ("status", "process_s", "wall_s", "device_kind", "memory")}
        row |= {k: planned[name][k] for k in ("module", "family", "layers", "vocab", "batch", "generations",
                                              "new_tokens", "prompt")}
        row["compile_args"] = slice_forecast(planned[name])
        if (group / f"{name}.log").is_file():
            row |= grpo_steps((group / f"{name}.log").read_text(errors="replace"))
        out["runs"][name] = row
    return out


def main() -> None:
    source = Path(sys.argv[1])
    RECORDS.mkdir(exist_ok=True)
    plan = json.loads((ROOT / ".tpu-chip" / "plan.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for tgz in sorted(source.glob("*.tgz")):
            with tarfile.open(tgz) as tar:
                tar.extractall(work, filter="data")
            name = tgz.name.removesuffix(".tgz")
            group = work / name
            summary = json.loads((group / "summary.json").read_text())
            record = {"group": name, "smoke": summary["smoke"], "versions": summary["versions"], "nproc": summary["nproc"],
                      "tpu_check": summary.get("tpu_check")}
            if name in SLICE_GROUPS:
                record |= slices(group, summary, plan)
            elif name in GRPO_GROUPS:
                record |= grpo(group, summary, plan)
            else:
                record |= embedded(group, summary, work)
            path = RECORDS / f"{name}.json"
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
