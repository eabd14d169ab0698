"""The loss curve of a run resumed after a preemption, from MaxText's metrics_file (JSONL); pass@k of train_rl's eval."""

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from mtpipe.maxtext.adapter import training
from mtpipe.maxtext import training_logs as metrics
from mtpipe.maxtext.training_logs import loss_curve, missing_steps, pass_at_k, rl_eval, rl_eval_gain


def write_jsonl(path: Path, steps: list[int]) -> None:
    path.write_text("".join(json.dumps({"step": s, "learning/loss": 10.0 - s / 10}) + "\n" for s in steps))


def test_a_resume_replaces_relogged_steps_and_keeps_one_row_per_step(tmp_path: Path) -> None:
    """Killed after logging step 7, resumed from checkpoint 5: steps 6 and 7 are logged twice."""
    metrics = tmp_path / "metrics.jsonl"
    write_jsonl(metrics, [1, 2, 3, 4, 5, 6, 7, 6, 7, 8])
    rows = loss_curve(metrics)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert missing_steps(rows) == []


def test_rows_lost_with_a_preempted_machine_are_named(tmp_path: Path) -> None:
    """The bucket's mirror ended at step 18; the run resumed from checkpoint 20 and logged 21 on."""
    metrics = tmp_path / "metrics.jsonl"
    write_jsonl(metrics, [*range(1, 19), *range(21, 26)])
    assert missing_steps(loss_curve(metrics)) == [19, 20]


def test_a_curve_that_starts_late_is_named_from_its_expected_first_step() -> None:
    """train_rl's rows come from tensorboard events: a killed run that never flushed them leaves
    a resumed run's curve starting after step 1."""
    rows = [{"step": s} for s in range(9, 17)]
    assert missing_steps(rows) == [] and missing_steps(rows, first=1) == list(range(1, 9))


@pytest.mark.rl_learns
@pytest.mark.parametrize("samples", [1, 2, 4, 8])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_sample(samples: int) -> None:
    """The closed form against brute force: every k-subset of n samples, c of them right."""
    for right in range(samples + 1):
        outcomes = [True] * right + [False] * (samples - right)
        for k in range(1, samples + 1):
            subsets = list(itertools.combinations(outcomes, k))
            expected = sum(any(subset) for subset in subsets) / len(subsets)
            assert pass_at_k(samples, right, k) == pytest.approx(expected, abs=1e-12), (samples, right, k)
    with pytest.raises(ValueError, match="pass@4 needs at least 4 samples"):
        pass_at_k(2, 1, 4)


EVAL_LOG = """\
0it [00:00, ?it/s]I1205 01:48:23 rollout_cpu.py:229] cpu_jax rollout: 3 prompts
W1205 01:48:42 training.py:207] mtpipe eval: right samples per prompt: 0/4 1/4 4/4
W1205 01:48:42 train_rl.py:743] Pre RL Training: corr=0.4166, total=3, accuracy=41.66%, partial_accuracy=50.0%, \
format_accuracy=100.0%, mean_reward=0.4125
W1205 01:49:00 training.py:207] mtpipe eval: right samples per prompt: 4/4 4/4 4/4
W1205 01:49:00 hooks.py:99] Intermediate Eval (step=10): corr=3.0, total=3, accuracy=100.0%
W1205 01:49:58 training.py:207] mtpipe eval: right samples per prompt: 2/4 0/4 3/4
W1205 01:50:00 train_rl.py:781] Post RL Training: corr=0.4166, total=3, accuracy=41.66%, partial_accuracy=50.0%, \
format_accuracy=100.0%, mean_reward=0.5000
"""


@pytest.mark.rl_learns
def test_rl_eval_reads_pass_at_k_of_the_evals_before_and_after_grpo() -> None:
    evals = rl_eval(EVAL_LOG)
    pre, post = evals["pre"], evals["post"]
    assert pre["samples_per_prompt"] == post["samples_per_prompt"] == 4
    assert "pass_at_8" not in pre  # 4 samples per prompt: pass@k for k <= 4 only
    # before: prompts 0/4, 1/4, 4/4 right; pass@1 is the share of samples right, as MaxText's pass_at_1 accuracy
    assert pre["pass_at_1"] == pytest.approx(100 * (0 + 1 / 4 + 1) / 3, abs=1e-3)
    assert pre["pass_at_2"] == pytest.approx(100 * (0 + 1 / 2 + 1) / 3, abs=1e-3)  # 1 - C(3,2)/C(4,2) = 1/2
    assert pre["pass_at_4"] == pytest.approx(100 * 2 / 3, abs=1e-3)
    # after: 2/4, 0/4, 3/4 (the intermediate eval's 4/4s belong to no one)
    assert post["pass_at_1"] == pytest.approx(100 * (2 / 4 + 0 + 3 / 4) / 3, abs=1e-3)
    assert post["pass_at_2"] == pytest.approx(100 * (5 / 6 + 0 + 1) / 3, abs=1e-3)
    assert post["pass_at_4"] == pytest.approx(100 * 2 / 3, abs=1e-3)
    assert post["mean_reward"] == 0.5


@pytest.mark.rl_learns
@pytest.mark.scores
def test_the_gain_of_each_pass_at_k_pairs_the_prompts() -> None:
    """Prompt i before GRPO against prompt i after: the gain is the mean of the differences and its
    interval their spread's (1.96 x sd / sqrt(n)), not two independent scores' errors."""
    gain = rl_eval_gain(EVAL_LOG)
    assert set(gain) == {f"pass_at_{k}{ci}" for k in (1, 2, 4) for ci in ("", "_ci95")}
    diffs = np.array([2 / 4 - 0, 0 - 1 / 4, 3 / 4 - 1])
    assert gain["pass_at_1"] == pytest.approx(100 * diffs.mean(), abs=1e-3)
    assert gain["pass_at_1_ci95"] == pytest.approx(100 * 1.959964 * diffs.std(ddof=1) / 3 ** 0.5, abs=1e-3)
    # pass@4 per prompt: 0, 1, 1 before; 1, 0, 1 after: no gain, and an interval from the two that moved
    assert gain["pass_at_4"] == 0.0 and gain["pass_at_4_ci95"] == pytest.approx(100 * 1.959964 / 3 ** 0.5, abs=1e-3)
    assert rl_eval_gain("\n".join(line for line in EVAL_LOG.splitlines() if "0/4 1/4 4/4" not in line)) == {}


@pytest.mark.rl_learns
def test_rl_eval_without_the_counts_has_no_pass_at_k() -> None:
    """A log from before the counts were logged still gives MaxText's totals."""
    log = "\n".join(line for line in EVAL_LOG.splitlines() if "mtpipe eval:" not in line)
    assert set(rl_eval(log)) == {"pre", "post"}
    assert not any(key.startswith("pass_at") for row in rl_eval(log).values() for key in row)
