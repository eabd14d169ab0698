"""The loss curve of a run resumed after a preemption, from MaxText's metrics_file (JSONL)."""

import json
from pathlib import Path

from mtpipe.pipeline.metrics import loss_curve, missing_steps


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
