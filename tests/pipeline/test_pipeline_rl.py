"""The RL branch on the embedded default: SFT warm-up, GRPO with the cpu_jax rollout, export."""

import csv
import json

import numpy as np
import pytest
import yaml

from pipeline import dvc, export_logit_diff, orbax_arrays, ran_stages

pytestmark = pytest.mark.slow


def test_every_rl_stage_ran_the_real_tool(pipeline_repo):
    log = (pipeline_repo / "work" / "first_repro.log").read_text()
    assert {"hf_download@rl", "to_maxtext@rl", "train_sft@rl", "train_rl", "to_huggingface@rl"} <= ran_stages(log)
    rl_log = (pipeline_repo / "work/logs/rl/train_rl.log").read_text()
    assert "# launched as: python -m mtpipe.maxtext.launch_rl_cpu maxtext.trainers.post_train.rl.train_rl" in rl_log
    assert "cpu_jax rollout:" in rl_log, "the CPU rollout backend sampled the completions"
    assert (pipeline_repo / "artifacts/rl/trained/model_params").is_dir()
    assert (pipeline_repo / "artifacts/rl/warmup/model_params").is_dir()


def test_grpo_logged_rewards_kl_and_eval_before_and_after(pipeline_repo):
    metrics = json.loads((pipeline_repo / "metrics/rl/train_rl.json").read_text())
    rows = list(csv.DictReader(open(pipeline_repo / "plots/rl/train_rl.csv")))
    assert len(rows) >= metrics["steps"] > 0
    assert {"reward_mean", "reward_exact_format", "reward_answer", "kl", "loss"} <= set(rows[0])
    extra = yaml.safe_load((pipeline_repo / "views/rl/train_rl.yaml").read_text())["train_rl"]
    prompts = extra["num_test_batches"] * extra["extra_args"]["eval_batch_size"]
    for when in ("pre", "post"):
        # every test prompt scored, and the accuracy is the share of them answered right
        assert metrics[f"eval_{when}_total"] == prompts, metrics
        correct = metrics[f"eval_{when}_correct"]
        assert metrics[f"eval_{when}_accuracy"] == pytest.approx(100 * correct / prompts), metrics
        assert metrics[f"eval_{when}_partial_accuracy"] >= metrics[f"eval_{when}_accuracy"], metrics
    # The warm-up taught the answer format before GRPO started.
    assert metrics["eval_pre_format_accuracy"] >= 50, metrics


def test_grpo_changed_the_warm_started_params(pipeline_repo):
    """GRPO's output differs from its starting point (the warm-up), not just from the source model."""
    warm = orbax_arrays(pipeline_repo / "artifacts/rl/warmup/model_params", "", "['value']")  # SFT layout
    grpo = orbax_arrays(pipeline_repo / "artifacts/rl/trained/model_params", "['base']", "['value']")
    assert warm and set(warm) == set(grpo)
    changed = [k for k in warm if not np.array_equal(warm[k], grpo[k])]
    assert len(changed) >= len(warm) // 4, f"GRPO changed only {len(changed)} of {len(warm)} tensors"  # measured: 12 of 24


def test_rl_export_logits_match_maxtext_forward(pipeline_repo):
    diff = export_logit_diff(pipeline_repo, "rl", "llama3.1-8b", "llama3.1-tiny", n_tokens=64)
    print(f"\nmax |logit diff| RL export vs MaxText: {diff:.2e}")
    assert diff < 2e-5


@pytest.mark.scores
def test_base_warmup_and_grpo_are_scored_on_the_same_problems_with_paired_gains(pipeline_repo):
    """`dvc metrics show` has each model's lm-eval score and the gains between them; each gain is the
    paired difference of the per-problem results in scores/rl/, which the three models share."""
    from mtpipe.evaluation import gsm8k

    view = yaml.safe_load((pipeline_repo / "views/rl/evaluate.yaml").read_text())["evaluate"]
    assert view["task"] == "gsm8k_rl_format"
    results = {who: [json.loads(line) for line in (pipeline_repo / "scores/rl" / path).read_text().splitlines()]
               for who, path in (("base", "before/base.jsonl"), ("warmup", "before/warmup.jsonl"),
                                 ("trained", "trained.jsonl"))}
    problems = [(r["problem"], r["target"]) for r in results["base"]]
    assert len(problems) == view["num_problems"] == 64
    assert all([(r["problem"], r["target"]) for r in rows] == problems for rows in results.values())
    metrics = json.loads((pipeline_repo / "metrics/rl/evaluate.json").read_text())
    for who, rows in results.items():
        assert metrics[who] == gsm8k.scores(rows)
    for key, before, after in (("gain", "base", "trained"), ("warmup_gain", "base", "warmup"),
                               ("grpo_gain", "warmup", "trained")):
        assert metrics[key] == gsm8k.gain(results[before], results[after])
    # the warm-up taught train_rl's answer format: the untrained twin never closes an <answer> tag
    assert metrics["base"]["strict_accuracy"] == 0 < metrics["warmup"]["strict_accuracy"]
    assert metrics["gain"]["strict_gain"] - metrics["gain"]["strict_gain_ci95"] > 0
    shown = dvc(pipeline_repo, "metrics", "show", "--json").stdout
    assert all(f'"{key}"' in shown for key in ("warmup", "warmup_gain", "grpo_gain", "flexible_gain_ci95"))
