"""The TRL reference for MaxText's GRPO (benchmarks/grpo_trl.py, benchmarks/trl_reference.py).

Slow. The TRL side environment (work/trl_env: torch CPU, trl, transformers) is made before the tests
(tests/prefetch.py; a few minutes with PyPI). The reference's reward functions are a reimplementation, so they are checked
against MaxText's own on hand-written completions, with the benchmark preset's weights; then the
reference runs two GRPO steps end to end on the tiny Llama twin.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from mtpipe.pipeline import config
import families

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import grpo_trl  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.rl_learns]

# the benchmark preset's train_rl section with what it inherits from embedded-rl
BENCH_TRAIN_RL = OmegaConf.to_container(config.load_preset("embedded-rl", "preset"))["train_rl"]

COMPLETIONS = [  # (completion, gold answer)
    ("<reasoning>3 + 4 = 7</reasoning><answer>7</answer>", "7"),  # right, in format
    ("<reasoning>3 + 4 = 8</reasoning><answer>8</answer>", "7"),  # wrong, in format
    ("<reasoning>3 + 4 = 7</reasoning> <answer> 7 </answer>", "7"),  # right, spaces inside the tag
    ("<reasoning>half of 25</reasoning><answer>12.5</answer>", "12.5"),  # a decimal answer
    ("<reasoning>2 x 600</reasoning><answer>1,200</answer>", "1200"),  # thousands separator
    ("The answer is 7.", "7"),  # no tags
    ("<answer>7</answer>", "7"),  # right number, no reasoning: not the exact format
    ("<reasoning>7</reasoning><answer>5</answer><answer>7</answer>", "7"),  # the last answer tag counts
    ("<reasoning>unfinished", "7"),
]

MAXTEXT_CHILD = r"""
import json, multiprocessing.pool, os, sys  # utils_rl needs multiprocessing.pool imported first
from types import SimpleNamespace
from maxtext.trainers.post_train.rl import utils_rl

settings, items = json.loads(sys.argv[1]), json.loads(sys.argv[2])
cfg = SimpleNamespace(**settings, debug=False, math_verify_timeout=60, math_verify_num_procs=1)
completions, answers = [c for c, _ in items], [json.dumps([a]) for _, a in items]
kw = {"prompts": ["p"] * len(items), "completions": completions, "tmvp_config": cfg}
print(json.dumps([utils_rl.match_format_exactly(**kw), utils_rl.match_format_approximately(**kw),
                  utils_rl.check_numbers(**kw, answer=answers, question=["q"] * len(items))]), flush=True)
os._exit(0)  # the math-verify process pool hangs a normal interpreter exit
"""

REFERENCE_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from trl_reference import make_rewards

spec, items = json.loads(sys.argv[2]), json.loads(sys.argv[3])
rewards = make_rewards(spec["tokens"], spec["weights"])
print(json.dumps([fn(completions=[c for c, _ in items], answer=[a for _, a in items]) for fn in rewards]))
"""


def test_the_reference_rewards_score_like_maxtexts_with_the_benchmark_weights():
    settings = grpo_trl.maxtext_settings(BENCH_TRAIN_RL)
    keys = [*grpo_trl.REWARD_KEYS, *grpo_trl.TOKEN_KEYS, "reward_white_space_format_match", "reasoning_start_token_in_prompt"]
    maxtext_cfg = {k: settings[k] for k in keys}
    assert (maxtext_cfg["reward_exact_format_match"], maxtext_cfg["reward_exact_answer"]) == (0.1, 1.0)  # rl.yml's
    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE")
    run = subprocess.run([sys.executable, "-c", MAXTEXT_CHILD, json.dumps(maxtext_cfg), json.dumps(COMPLETIONS)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    maxtext = json.loads(run.stdout.strip().splitlines()[-1])

    spec = {"tokens": {k: settings[k] for k in grpo_trl.TOKEN_KEYS},
            "weights": {k: float(settings[k]) for k in grpo_trl.REWARD_KEYS}}
    side = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    run = subprocess.run([str(grpo_trl.side_env()), "-c", REFERENCE_CHILD, str(REPO / "benchmarks"), json.dumps(spec),
                          json.dumps(COMPLETIONS)], env=side, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    reference = json.loads(run.stdout.strip().splitlines()[-1])

    assert maxtext[0] == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1, 0.0, 0.0, 0.1, 0.0])  # the exact format, as MaxText scores it
    assert maxtext[2] == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]  # the right answer, as MaxText scores it
    for name, ours, theirs in zip(("exact format", "partial format", "answer"), reference, maxtext):
        assert ours == pytest.approx(theirs), (name, list(zip(COMPLETIONS, ours, theirs)))


def test_the_trl_reference_runs_two_grpo_steps_on_the_tiny_twin(tmp_path):
    from mtpipe.data import embedded

    families.twins()["llama3.1-tiny"].write(tmp_path / "llama")
    embedded.write_gsm8k_tiny(tmp_path / "gsm8k", n_train=32, n_test=8)
    settings = {**grpo_trl.maxtext_settings(BENCH_TRAIN_RL), "num_test_batches": 1, "eval_batch_size": 4}
    data = ([tmp_path / "gsm8k/main/train-00000-of-00001.parquet"], [tmp_path / "gsm8k/main/test-00000-of-00001.parquet"])
    spec = grpo_trl.make_spec(settings, tmp_path / "llama", data, seed=1, steps=2, eval_samples=2)
    assert len(spec["train_prompts"]) == 2 * BENCH_TRAIN_RL["batch_size"] and len(spec["eval_prompts"]) == 4
    assert spec["grpo"]["num_generations"] == BENCH_TRAIN_RL["num_generations"]
    assert spec["grpo"]["beta"] == BENCH_TRAIN_RL["grpo_beta"]
    assert spec["grpo"]["top_k"] == BENCH_TRAIN_RL["extra_args"]["decode_sampling_top_k"]

    result = grpo_trl.run_reference(spec, tmp_path)
    assert [row["step"] for row in result["curve"]] == [1, 2]
    assert all(math.isfinite(row["reward"]) for row in result["curve"])
    for when in ("before", "after"):
        assert result[when]["prompts"] == 4 and result[when]["samples_per_prompt"] == 2
        assert 0 <= result[when]["sampled_pass_at_1"] <= 100


def test_maxtexts_grpo_penalises_kl_with_tunixs_k1_estimator():
    """docs/grpo-benchmark.md explains why MaxText's GRPO drifts further from the warm-up than TRL's (KL 2-4x
    for the same answer gain): MaxText leaves tunix's `kl_loss_mode` at its default, the k1 estimator
    `logp - ref_logp`, whose gradient as a penalty is zero in expectation; TRL uses k3. A MaxText or tunix
    that changes this changes that explanation and the reference comparison."""
    import maxtext
    from tunix.rl import common
    from tunix.rl.grpo.grpo_learner import GrpoConfig

    assert GrpoConfig(num_generations=2).kl_loss_mode == "kl"
    train_rl = Path(maxtext.__file__).parent / "trainers" / "post_train" / "rl" / "train_rl.py"
    assert "GrpoConfig(" in train_rl.read_text() and "kl_loss_mode" not in train_rl.read_text()
    logp, ref = np.array([-1.0, -2.0]), np.array([-1.5, -1.0])
    assert np.allclose(common.compute_kl_divergence(logp, ref, "kl"), logp - ref)
