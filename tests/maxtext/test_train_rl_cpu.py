"""MaxText's GRPO trainer (train_rl) on CPU with the cpu_jax rollout backend, and MaxText's rewards.

The slow test runs the real `maxtext.trainers.post_train.rl.train_rl` (through
`python -m mtpipe.maxtext.launch_rl_cpu`) on the tiny Llama 3.1 twin converted by the real converter, for two
GRPO steps on GSM8K-format parquet files, and checks what a stage would rely on: exit status (no hang
at exit), the actor checkpoint, changed parameters, the tensorboard scalars and the eval lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import families
from pipeline import orbax_arrays

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "llama3.1-8b-Instruct"


REWARDS_CHILD = r"""
import json, multiprocessing.pool, os, sys  # utils_rl needs multiprocessing.pool imported first
from types import SimpleNamespace
from omegaconf import OmegaConf
from maxtext.trainers.post_train.rl import utils_rl

if sys.argv[3] == "adapted":  # the adapter's patch 13, which the launchers apply: grading never polls
    import time
    from mtpipe.maxtext.adapter import training

    training.grade_without_polling()

    def no_polling(seconds):
        raise AssertionError(f"math_verify_pool slept {seconds} s between polls")
    time.sleep = no_polling
rl = OmegaConf.load(sys.argv[1])  # MaxText's own rl.yml: the reward values are read, not copied
cfg = SimpleNamespace(**{k: rl[k] for k in rl if k.startswith(("reward_", "penalty_", "reasoning_", "solution_"))},
                      debug=False, math_verify_timeout=60, math_verify_num_procs=1)
completions = json.loads(sys.argv[2])
kw = {"prompts": ["p"] * len(completions), "completions": completions, "tmvp_config": cfg}
out = {
    "config": [cfg.reward_exact_answer, cfg.reward_exact_format_match, cfg.reward_partial_format_match],
    "match_format_exactly": utils_rl.match_format_exactly(**kw),
    "match_format_approximately": utils_rl.match_format_approximately(**kw),
    "check_numbers": utils_rl.check_numbers(**kw, answer=['["7"]'] * len(completions), question=["q"] * len(completions)),
}
print(json.dumps(out), flush=True)
os._exit(0)  # the math-verify process pool hangs a normal interpreter exit
"""


@pytest.mark.fast_rl
@pytest.mark.parametrize("grading", ["maxtext", "adapted"])
def test_maxtext_reward_functions_on_hand_written_completions(grading):
    """MaxText's rewards, with MaxText's math-verify pool and with the adapter's (patch 13), which
    waits on the pool's results instead of polling them every 0.1 s: the same scores."""
    import importlib.util

    rl_yml = Path(importlib.util.find_spec("maxtext").origin).parent / "configs" / "post_train" / "rl.yml"
    completions = [
        "<reasoning>3 + 4 = 7</reasoning><answer>7</answer>",  # right answer, right format
        "<reasoning>3 + 4 = 8</reasoning><answer>8</answer>",  # wrong answer (math-verify says no)
        "<reasoning>3 + 4 = 7</reasoning> <answer>7.0</answer>",  # equal value, other spelling (math-verify)
        "The answer is 7.",  # bad format: no tags at all
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", REWARDS_CHILD, str(rl_yml), json.dumps(completions), grading], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    scores = json.loads(run.stdout.strip().splitlines()[-1])
    assert scores["config"] == [1.0, 0.1, 0.0]  # rl.yml: exact answer 1.0, exact format 0.1, partial format 0.0
    assert scores["match_format_exactly"] == [0.1, 0.1, 0.1, 0]
    assert scores["match_format_approximately"] == [0.0, 0.0, 0.0, 0.0]
    assert scores["check_numbers"] == [1.0, 0.0, 1.0, 0.0]


EVAL_CHILD = r"""
import json, sys
from types import SimpleNamespace
from omegaconf import OmegaConf
from mtpipe.maxtext.adapter import training

training.log_right_samples_per_prompt()  # what the launchers apply before train_rl is imported
from maxtext.trainers.post_train.rl import evaluate_rl

rl = OmegaConf.load(sys.argv[1])
cfg = SimpleNamespace(**{k: rl[k] for k in rl if k.startswith(("reward_", "penalty_", "reasoning_", "solution_"))},
                      generation_configs=OmegaConf.to_container(rl.generation_configs), eval_sampling_strategy="liberal",
                      max_target_length=224, max_prefill_predict_length=160, eval_mode=sys.argv[2], debug=False,
                      math_verify_timeout=60, math_verify_num_procs=1)
passes = json.loads(sys.argv[3])  # per eval pass, one completion per prompt


class Rollout:
    calls = 0

    def generate(self, prompts, rollout_config):
        Rollout.calls += 1
        return SimpleNamespace(text=passes[Rollout.calls - 1])


batch = {"prompts": ["p7", "p12"], "question": ["q7", "q12"], "answer": ['["7"]', '["12"]']}
(corr, total, accuracy, *_), _ = evaluate_rl.evaluate(cfg, [batch], SimpleNamespace(rollout=Rollout()), num_passes=len(passes))
print(json.dumps({"corr": corr, "total": total, "accuracy": accuracy}), flush=True)
import os; os._exit(0)  # the math-verify process pool hangs a normal interpreter exit
"""


@pytest.mark.rl_learns
@pytest.mark.parametrize("eval_mode", ["pass_at_1", "pass"])
def test_each_eval_logs_how_many_samples_of_each_prompt_maxtext_scored_right(eval_mode):
    """The adapter's patch 12 around MaxText's real eval and scoring, on hand-written completions:
    the per-prompt counts behind pass@k, in both eval modes (pass_at_1 gives the share, pass one verdict)."""
    import importlib.util

    from mtpipe.maxtext.training_logs import right_samples

    rl_yml = Path(importlib.util.find_spec("maxtext").origin).parent / "configs" / "post_train" / "rl.yml"
    right7, right12 = "<reasoning>3 + 4 = 7</reasoning><answer>7</answer>", "<reasoning>5 + 7</reasoning><answer>12</answer>"
    wrong = "<reasoning>3 + 4 = 8</reasoning><answer>8</answer>"
    passes = [[right7, wrong], [wrong, wrong], ["<reasoning>7</reasoning> <answer>7.0</answer>", right12],
              ["The answer is 7.", wrong]]  # prompt 7: 2 of 4 right; prompt 12: 1 of 4
    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", EVAL_CHILD, str(rl_yml), eval_mode, json.dumps(passes)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["total"] == 2
    if eval_mode == "pass_at_1":
        assert summary["corr"] == pytest.approx(2 / 4 + 1 / 4)  # MaxText's own share, which the counts reproduce
    counts = right_samples(run.stderr + f"\nPre RL Training: corr={summary['corr']}")
    assert counts == {"pre": [(2, 4), (1, 4)]}, run.stderr[-3000:]


@pytest.mark.address
def test_a_resumed_run_reports_its_first_eval_before_grpo(tmp_path, monkeypatch):
    """Patch 16: the first process of a run evaluates and saves the result in the run directory; a
    later process of the same run (a resume) returns that record and logs its counts line, and its
    own evaluate is never called; the process's next evals (after GRPO) run as before."""
    import multiprocessing.pool  # noqa: F401  (MaxText's evaluate_rl needs it imported first)
    from types import SimpleNamespace

    from maxtext.trainers.post_train.rl import evaluate_rl

    from mtpipe.maxtext.adapter import training

    calls = []

    def fake_evaluate(cfg, dataset, rl_cluster, **kwargs):
        calls.append(dataset)
        return (len(calls), 4, 25.0 * len(calls), 50.0, 100.0, 0.5), ["responses"]

    cfg = SimpleNamespace(base_output_directory=str(tmp_path / "train_rl"), run_name="train_rl-abc")

    def new_process():
        monkeypatch.setattr(evaluate_rl, "evaluate", fake_evaluate)
        monkeypatch.setattr(evaluate_rl, "score_responses", evaluate_rl.score_responses)
        training.log_right_samples_per_prompt()
        training.keep_the_first_pre_eval()
        return evaluate_rl.evaluate

    first = new_process()
    assert first(cfg, "pre", None) == ((1, 4, 25.0, 50.0, 100.0, 0.5), ["responses"])
    assert first(cfg, "post", None)[0][0] == 2
    saved = tmp_path / "train_rl" / "train_rl-abc" / training.PRE_EVAL_FILE
    assert json.loads(saved.read_text())["counts_line"].startswith(training.EVAL_SAMPLES_LINE)

    resumed = new_process()
    assert resumed(cfg, "pre", None) == ((1, 4, 25.0, 50.0, 100.0, 0.5), [])  # the first process's
    assert calls == ["pre", "post"], "the resumed process evaluated before GRPO again"
    assert resumed(cfg, "post", None)[0][0] == 3 and calls[-1] == "post"


# ----------------------------------------------------------------------------- the real run

REWARDS_PY = '''
"""MaxText's three GSM8K rewards plus one that always separates a group, so GRPO has a signal."""
from maxtext.trainers.post_train.rl.utils_rl import check_numbers, match_format_approximately, match_format_exactly


def length_signal(prompts, completions, tmvp_config, **kwargs):
    return [len(c) / 100.0 for c in completions]
'''


@pytest.mark.slow
def test_train_rl_runs_two_grpo_steps_on_cpu(tmp_path):
    from mtpipe.data import embedded
    from mtpipe.maxtext.training_logs import read_tensorboard, rl_eval

    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE", PYTHONPATH=str(REPO))
    cache = f"jax_cache_dir={REPO / 'work' / 'jax_cache'}"
    families.twins()["llama3.1-tiny"].write(tmp_path / "llama")
    embedded.write_gsm8k_tiny(tmp_path / "gsm8k", n_train=8, n_test=2)
    dims = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in families.twins()["llama3.1-tiny"].overrides.items()]
    subprocess.run(
        [sys.executable, "-m", "mtpipe.maxtext.adapter.conversion", "maxtext.checkpoint_conversion.to_maxtext",
         f"model_name={MODEL_NAME}",
         *dims, f"base_output_directory={tmp_path / 'conv'}", "scan_layers=True", "use_multimodal=False",
         "hardware=cpu", "skip_jax_distributed_system=true", cache, f"--hf_model_path={tmp_path / 'llama'}"],
        env=env, check=True, capture_output=True, timeout=600,
    )
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    data = tmp_path / "gsm8k" / "main"
    argv = [
        f"model_name={MODEL_NAME}", *dims, f"load_parameters_path={tmp_path / 'conv' / '0' / 'items'}",
        "run_name=rl", f"base_output_directory={tmp_path / 'out'}", f"tokenizer_path={tmp_path / 'llama'}",
        "dataset_name=openai/gsm8k", f"hf_train_files={data / 'train-00000-of-00001.parquet'}",
        f"hf_eval_files={data / 'test-00000-of-00001.parquet'}", "hardware=cpu", "use_pathways=False",
        "skip_jax_distributed_system=True", "chips_per_vm=1", "rollout_data_parallelism=1",
        "rollout_tensor_parallelism=1", "batch_size=1", "num_batches=2", "num_test_batches=1", "num_generations=2",
        "max_prefill_predict_length=160", "max_target_length=176", "weight_dtype=float32", "dtype=float32",
        "learning_rate=1e-3", "adam_weight_decay=0.0", f"reward_functions_path={tmp_path / 'rewards.py'}",
        "reward_functions=match_format_exactly,match_format_approximately,check_numbers,length_signal", cache,
        "eval_sampling_strategy=liberal", "num_eval_passes=2", "eval_mode=pass_at_1",  # 2 samples: pass@1, pass@2
    ]
    run = subprocess.run([sys.executable, "-m", "mtpipe.maxtext.launch_rl_cpu", *argv], env=env, capture_output=True, text=True,
                         timeout=900)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]

    # eval before and after training, on stderr (absl warnings)
    assert re.search(r"Pre RL Training: corr=[\d.]+, total=1, accuracy=", log), log[-4000:]
    assert re.search(r"Post RL Training: corr=[\d.]+, total=1, accuracy=", log)
    evals = rl_eval(log)  # what the stage's metrics carry: pass@k from the per-prompt counts
    for when in ("pre", "post"):
        assert evals[when]["samples_per_prompt"] == 2, evals
        assert evals[when]["pass_at_1"] == pytest.approx(evals[when]["accuracy"]), evals  # pass_at_1 mode: the same share
        assert evals[when]["pass_at_2"] >= evals[when]["pass_at_1"], evals
    assert len(re.findall(r"cpu_jax rollout: 2 prompts", log)) == 2  # one rollout per GRPO step

    params = tmp_path / "out" / "rl" / "checkpoints" / "actor" / "2" / "model_params"
    assert params.is_dir()
    before = orbax_arrays(tmp_path / "conv" / "0" / "items", "['params']['params']", "")
    after = orbax_arrays(params, "['base']", "['value']")
    assert before.keys() <= after.keys() and len(before) >= 10
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert all(before[k].shape == after[k].shape for k in before)
    assert len(changed) >= len(before) // 2, changed  # weight decay is off: the change is GRPO's

    scalars = read_tensorboard(tmp_path / "out" / "rl" / "tensorboard")
    for tag in ("actor/train/loss", "actor/train/kl", "actor/train/grad_norm", "rewards/train/mean",
                "rewards/train/check_numbers", "rewards/train/length_signal", "completions/train/mean_length"):
        assert tag in scalars, sorted(scalars)
    assert [step for step, _ in scalars["actor/train/loss"]] == [1, 2]
    assert any(abs(v) > 0 for _, v in scalars["rewards/train/length_signal"])
