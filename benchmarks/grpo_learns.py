"""Does GRPO learn on the embedded default? Prints one table: reward and eval accuracy before and
after GRPO, per seed, and the mean gain across seeds with a 95% confidence interval.

The setup is the preset `embedded-rl` (conf/preset/embedded-rl.yaml), the demo's RL branch: the RL branch's
tiny Llama 3.1 twin on generated GSM8K-style problems, after the demo's 400-step SFT warm-up (the
answer format learnt, about one sampled answer in four right), then 100 GRPO steps of 8 prompts x 8
samples: the rewards within a group differ by the answer, and GRPO raises held-out accuracy.
In a throwaway copy of the project (the working tree as git would commit it) it runs
`dvc repro train_sft@rl` once (data, download, conversion, warm-up: shared by all seeds), then
`dvc repro train_rl` once per seed. The seed is MaxText's `data_shuffle_seed`: it orders the prompts
and seeds the CPU sampler (mtpipe.maxtext.rollout_cpu).

The eval (MaxText's, before and after GRPO, on 96 of the 500 embedded test prompts) samples
`num_eval_passes` completions per prompt (`eval_mode: pass_at_1`) with `eval_sampling_strategy:
liberal` (rl.yml: temperature 0.85, top-k 2000, no cut on the tiny 512-token vocabulary), the
distribution the preset gives GRPO's rollouts: it measures what GRPO optimises, the reward under its
own sampling, on fixed prompts. The CPU sampler draws a prompt's k-th eval sample with the same
random numbers before and after GRPO (common random numbers, mtpipe/maxtext/rollout_cpu.py), so the
difference is the policy's, not the dice's:

* reward under sampling: the mean reward (the training reward functions, with rl.yml's
  weights: 0.1 for the exact format, 1.0 for the right answer) per sampled completion;
* accuracy: the fraction of sampled completions with the right answer (pass@1 estimate);
* pass@k (k = 1, 2, 4, 8 up to the samples per prompt): the chance that at least one of k samples
  of a prompt is right, estimated without bias from the prompt's n samples, c of them right
  (1 - C(n-c, k) / C(n, k)), averaged over prompts (train_rl's metrics, mtpipe.maxtext.training_logs).
  pass@k far above pass@1 before GRPO is room GRPO can use: it makes right answers the model can
  already sample more likely;
* format: the fraction of sampled completions in the exact answer format (the format reward's test);
* training reward: the mean reward per completion of GRPO's own samples (other
  prompts at each step) over its first and last 5 steps, in the eval's units (the sum of the reward
  functions; tunix's `rewards/train/mean` is their mean, a third of it);
* KL: GRPO's KL estimate to the warm-up model over the last 5 steps (how far the policy moved);
* gain: mean over seeds of (after - before), 95% Student-t interval over seeds.

With the TRL reference (on unless --no-trl), each seed also gets, under one evaluator (transformers, the
reference's: greedy accuracy, and pass@1 over 8 samples per prompt at the rollouts' sampling), the
warm-up, MaxText's GRPO result (exported by to_huggingface@rl) and TRL's GRPOTrainer run from the same
exported warm-up with the same prompts and settings (benchmarks/grpo_trl.py); gains over seeds with
95% intervals for both implementations.

Usage: python benchmarks/grpo_learns.py [--seeds 1,2,3] [--set rl.KEY=VALUE ...] [--keep] [--repo KEPT_COPY] [--no-trl]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml
from scipy import stats

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PROJECT / "tests"))
sys.path.insert(0, str(PROJECT))
from pipeline import copy_project, dvc  # noqa: E402  (the tests' throwaway project copy)

from mtpipe.maxtext.training_logs import PASS_AT_K  # noqa: E402

import grpo_trl  # noqa: E402  (benchmarks/: the TRL reference)

PRESET = "embedded-rl"
EDGE_STEPS = 5  # training reward: mean over the first and the last this many GRPO steps
REWARD_COLUMNS = ("reward_exact_format", "reward_approx_format", "reward_answer")  # plots/rl/train_rl.csv


def set_params(repo: Path, sets: list[str], seed: int | None) -> None:
    """params.yaml of the copy: the benchmark preset, `--set` overrides, and the seed."""
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    params["rl"]["preset"] = PRESET
    overrides = [*sets, *([f"rl.train_rl.extra_args.data_shuffle_seed={seed}"] if seed is not None else [])]
    for item in overrides:
        key, value = item.split("=", 1)
        node = params
        *parents, leaf = key.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% Student-t interval over the values (one per seed)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def run_seed(repo: Path, seed: int, sets: list[str]) -> dict:
    """One GRPO run: the eval before and after it, from the stage's metrics."""
    set_params(repo, sets, seed)
    start = time.monotonic()
    dvc(repo, "repro", "train_rl", timeout=3600)
    metrics = json.loads((repo / "metrics" / "rl" / "train_rl.json").read_text())
    curve = list(csv.DictReader(open(repo / "plots" / "rl" / "train_rl.csv")))
    rewards = [sum(float(row[key]) for key in REWARD_COLUMNS) for row in curve]
    # the stage's resolved config (params.yaml, the preset and --set overrides), as train_rl ran it
    extra_args = yaml.safe_load((repo / "views" / "rl" / "train_rl.yaml").read_text())["train_rl"]["extra_args"]
    return {"seed": seed, "seconds": time.monotonic() - start, "steps": metrics["steps"],
            "eval_n": metrics["eval_pre_total"], "eval_passes": extra_args.get("num_eval_passes", 1),
            "train_reward_first": statistics.fmean(rewards[:EDGE_STEPS]),
            "train_reward_last": statistics.fmean(rewards[-EDGE_STEPS:]),
            "kl_last": statistics.fmean(float(row["kl"]) for row in curve[-EDGE_STEPS:]),
            **{f"{key}_{when}": metrics[f"eval_{when}_{key}"] for when in ("pre", "post")
               for key in ("mean_reward", "accuracy", "format_accuracy", *(f"pass_at_{k}" for k in PASS_AT_K))
               if f"eval_{when}_{key}" in metrics}}


def run_reference(repo: Path, seed: int, out: Path, warmup_hf: Path) -> dict:
    """The independent reference for one seed (benchmarks/grpo_trl.py): MaxText's GRPO result, exported by
    to_huggingface@rl, under the reference's evaluator (transformers: greedy, and 8 samples per prompt), and
    TRL's GRPO from the same exported warm-up with the same prompts and settings, under the same evaluator."""
    dvc(repo, "repro", "to_huggingface@rl", timeout=3600)
    _, maxtext = grpo_trl.reference(repo, out / f"maxtext_seed{seed}", seed, steps=0, model=repo / "artifacts/rl/hf")
    start = time.monotonic()
    _, trl = grpo_trl.reference(repo, out / f"trl_seed{seed}", seed, model=warmup_hf)
    return {"seed": seed, "warmup": trl["before"], "maxtext": maxtext["before"], "trl": trl["after"],
            "trl_kl_last": statistics.fmean(row["kl"] for row in trl["curve"][-EDGE_STEPS:]),
            "trl_seconds": time.monotonic() - start}


def print_reference_table(refs: list[dict]) -> None:
    print("\nThe same seeds under one evaluator (transformers; benchmarks/grpo_trl.py): the warm-up, MaxText's GRPO "
          "result, and TRL's GRPOTrainer from the same warm-up with the same prompts and settings")
    print(f"| seed | greedy: warm-up | MaxText GRPO | TRL GRPO | pass@1 sampled: warm-up | MaxText GRPO | TRL GRPO "
          f"| TRL KL, last {EDGE_STEPS} | TRL minutes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in refs:
        print(f"| {r['seed']} | " + " | ".join(f"{r[who][key]:.1f}%" for key in ("greedy_accuracy", "sampled_pass_at_1")
                                             for who in ("warmup", "maxtext", "trl"))
              + f" | {r['trl_kl_last']:.3f} | {r['trl_seconds'] / 60:.1f} |")
    print()
    for key, label in (("greedy_accuracy", "greedy accuracy"), ("sampled_pass_at_1", "pass@1 under sampling")):
        for who, name in (("maxtext", "MaxText"), ("trl", "TRL")):
            mean, low, high = mean_ci([r[who][key] - r["warmup"][key] for r in refs])
            verdict = "excludes 0" if low > 0 or high < 0 else "includes 0"
            print(f"gain in {label}, {name}'s GRPO: {mean:+.3f} points, 95% CI [{low:+.3f}, {high:+.3f}] "
                  f"over {len(refs)} seeds ({verdict})")


def print_table(runs: list[dict], warmup_s: float) -> None:
    print(f"\nGRPO on the embedded default, preset {PRESET}: data, conversion and warm-up (shared) "
          f"{warmup_s / 60:.1f} min")
    print("| seed | eval reward before | after | eval accuracy before | after | format before / after "
          f"| training reward, first / last {EDGE_STEPS} steps | KL, last {EDGE_STEPS} | minutes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        print(f"| {r['seed']} | {r['mean_reward_pre']:.3f} | {r['mean_reward_post']:.3f} | {r['accuracy_pre']:.1f}% | "
              f"{r['accuracy_post']:.1f}% | {r['format_accuracy_pre']:.1f}% / {r['format_accuracy_post']:.1f}% | "
              f"{r['train_reward_first']:.3f} / {r['train_reward_last']:.3f} | {r['kl_last']:.3f} | "
              f"{r['seconds'] / 60:.1f} |")
    ks = [k for k in PASS_AT_K if all(f"pass_at_{k}_pre" in r for r in runs)]
    if ks:
        print("\n| seed | " + " | ".join(f"pass@{k} before / after" for k in ks) + " |")
        print("| --- |" + " --- |" * len(ks))
        for r in runs:
            print(f"| {r['seed']} | " + " | ".join(f"{r[f'pass_at_{k}_pre']:.1f}% / {r[f'pass_at_{k}_post']:.1f}%" for k in ks) + " |")
    print()
    for what, key, unit in (("eval reward under sampling", "mean_reward", ""), ("eval accuracy (pass@1)", "accuracy", " points"),
                            ("eval format", "format_accuracy", " points"),
                            *((f"eval pass@{k}", f"pass_at_{k}", " points") for k in ks)):
        mean, low, high = mean_ci([r[f"{key}_post"] - r[f"{key}_pre"] for r in runs])
        verdict = "excludes 0" if low > 0 or high < 0 else "includes 0"
        print(f"gain in {what}: {mean:+.3f}{unit}, 95% CI [{low:+.3f}, {high:+.3f}] over {len(runs)} seeds ({verdict})")
    mean, low, high = mean_ci([r["train_reward_last"] - r["train_reward_first"] for r in runs])
    print(f"training reward, last - first {EDGE_STEPS} steps: {mean:+.3f}, 95% CI [{low:+.3f}, {high:+.3f}] "
          "(other prompts at each step: noisier than the eval)")
    print(f"eval: {runs[0]['eval_n']} test prompts x {runs[0]['eval_passes']} samples, paired before/after; "
          f"{runs[0]['steps']} GRPO steps per seed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated data_shuffle_seed values")
    parser.add_argument("--set", action="append", default=[], help="rl.KEY=VALUE override in params.yaml")
    parser.add_argument("--workdir", type=Path, default=None, help="where the project copy goes")
    parser.add_argument("--keep", action="store_true", help="keep the project copy (its path is printed)")
    parser.add_argument("--repo", type=Path, default=None,
                        help="reuse a project copy kept by --keep: DVC skips what it already ran there")
    parser.add_argument("--no-trl", action="store_true",
                        help="skip the TRL reference (its side environment needs PyPI on first use)")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    base = args.repo.parent if args.repo else Path(tempfile.mkdtemp(prefix="grpo-learns-", dir=args.workdir))
    try:
        repo = args.repo or copy_project(base / "repo")
        set_params(repo, args.set, None)
        start = time.monotonic()
        dvc(repo, "repro", "train_sft@rl", timeout=3600)
        warmup_s = time.monotonic() - start
        warmup_hf = None if args.no_trl else grpo_trl.export_warmup(repo, base / "trl" / "warmup_hf")
        runs, refs = [], []
        for seed in seeds:
            runs.append(run_seed(repo, seed, args.set))
            print(json.dumps(runs[-1]), flush=True)
            if warmup_hf:
                refs.append(run_reference(repo, seed, base / "trl", warmup_hf))
                print(json.dumps(refs[-1]), flush=True)
        print_table(runs, warmup_s)
        if refs:
            print_reference_table(refs)
    finally:
        if args.keep or args.repo:
            print(f"project copy kept: {base / 'repo'}")
        else:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
