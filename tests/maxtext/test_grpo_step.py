"""benchmarks/grpo_step.py: the GRPO step budget's report (the timings themselves are the benchmark's)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import grpo_step  # noqa: E402  (benchmarks/: the step budget)


@pytest.mark.fast_rl
def test_the_step_budget_reports_later_steps_and_names_late_compiles():
    """benchmarks/grpo_step.py's table on hand-made clock readings: medians of the steps after the
    first, the rest of a step as `other`, the first step's compiles, and any later compile named."""
    def step(seconds, rollout, update, compiled=(), compile_s=0.0):
        return {"seconds": seconds, "phases": {"rollout": rollout, "update": update}, "tokens": 100,
                "compile": {"update": compile_s} if compile_s else {}, "compiled": list(compiled)}

    runs = {
        "before": {"steps": [step(9.0, 2.0, 6.0, ["jit(_train_step)"], 5.0), step(3.0, 1.0, 1.5),
                             step(2.0, 0.5, 1.0), step(2.5, 0.7, 1.2)], "evals": [20.0, 22.0]},
        "after": {"steps": [step(8.0, 2.0, 5.0, ["jit(_train_step)"], 4.0), step(2.0, 0.5, 1.0),
                            step(2.2, 0.5, 1.1, ["jit(stage)"])], "evals": [3.0]},
    }
    flops = {"rollout": 1e9, "grading": 0.0, "ref logps": 0.0, "old logps": 0.0, "update": 3e9}
    rows = {line[:36].strip(): line[36:].split() for line in grpo_step.table(runs, flops, 1e10).splitlines()}
    assert rows["step (s)"] == ["2.500", "2.100", "0.400"]  # medians of steps 2.., beside 4 GFLOP at 10 GFLOP/s
    assert rows["rollout (s)"] == ["0.700", "0.500", "0.100"]
    assert rows["other: Python, data, transfers (s)"] == ["0.500", "0.550", "-"]
    assert rows["first step (s)"] == ["9.0", "8.0"] and rows["of it compiling (s)"] == ["5.0", "4.0"]
    assert rows["eval, before or after GRPO (s)"] == ["21.0", "3.0"]
    report = grpo_step.table(runs, flops, 1e10)
    assert "before: compiles after the first step: none" in report
    assert "after: compiles after the first step: step 3: jit(stage)" in report
