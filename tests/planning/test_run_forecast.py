"""The whole run in preflight's forecast and in vm_run's price question (mtpipe/planning/run_forecast.py):
for each tutorial preset, from its committed compile result (nothing compiles), `doit preflight`'s
phases each with its source, a total that is their sum, the same total in the `create it? [y/N]`
question with what it holds, and a DVC target that stops early leaving the later phases out."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import families
import pytest

from mtpipe.cloud.lifecycle.lines import forecast_line
from mtpipe.cloud.settings import prices, vm_config
from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations
from mtpipe.planning import aot, preflight, run_forecast

pytestmark = pytest.mark.forecast

TUTORIALS = {"sft": "gemma3-4b-ultrachat-v6e8", "rl": "llama3.1-8b-gsm8k-v6e8"}
# each line of the tutorial's run, with a word its source must say
LINES = {
    "sft": {"VM setup": "tutorials' boot + install", "hf_download@sft": "google/gemma-3-4b-it",
            "to_maxtext@sft": "s per billion", "train_sft@sft": "preflight: 1000 steps",
            "to_huggingface@sft": "like the conversion", "evaluate_base@sft": "1000 held-out conversations",
            "evaluate@sft": "1000 held-out conversations"},
    "rl": {"VM setup": "tutorials' boot + install", "hf_download@rl": "meta-llama/Llama-3.1-8B-Instruct",
           "to_maxtext@rl": "s per billion", "train_rl": "preflight: 50 steps",
           "to_huggingface@rl": "like the conversion", "evaluate_base@rl": "1319 problems 8-shot",
           "evaluate_warmup": "skipped: no warm-up", "evaluate@rl": "1319 problems 8-shot"},
}


@pytest.fixture(scope="module")
def tutorial_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict[str, Any]], str]]:
    """branch -> (preflight's rows, its printed output) of `doit preflight --set=<branch>.preset=<tutorial>
    --target=evaluate@<branch>`, from the committed compile results."""
    cfg = vm_config.load_config()
    rate = prices.vm_rate(cfg)
    runs = {}
    for branch, preset in TUTORIALS.items():
        root = tmp_path_factory.mktemp(branch)
        (root / "params.yaml").write_text(families.committed_params_text())
        with pytest.MonkeyPatch.context() as m:
            m.setattr(aot, "child_env", lambda *a: pytest.fail("preflight started a compile"))
            printed: list[str] = []
            m.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
            rows = preflight.check([f"{branch}.preset={preset}"], rate.price.usd, vm_config.budget_machine(cfg),
                                   root=root, branches=(branch,), price_basis=rate.per_chip(),
                                   target=f"evaluate@{branch}")
        runs[branch] = rows, "\n".join(printed)
    return runs


def phase_lines(out: str) -> list[str]:
    """The phase lines preflight printed, between their header and the total."""
    lines = out.split("by phase:\n")[1].splitlines()[1:]
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("total:"))]


def phase_name(line: str) -> str:
    return "VM setup" if line.startswith("VM setup") else line.split()[0]


@pytest.mark.parametrize("branch", sorted(TUTORIALS))
def test_preflight_prints_every_phase_of_the_tutorial_with_its_source(
        branch: str, tutorial_runs: dict[str, tuple[list[dict[str, Any]], str]]) -> None:
    rows, out = tutorial_runs[branch]
    assert [phase_name(line) for line in phase_lines(out)] == list(LINES[branch]), out
    for line in phase_lines(out):
        assert LINES[branch][phase_name(line)] in line, line
        minutes, low, high = re.search(r"\s(\d+\.\d)\s+(\d+\.\d)-(\d+\.\d)\s", line).groups()
        assert float(low) <= float(minutes) <= float(high), line
    run = run_forecast.forecast(rows)
    evaluations = [p for p in run.phases if p.kind == "evaluation" and p.name != "evaluate_warmup"]
    assert len(evaluations) == 2 and all(p.mid_s > run_forecast.VLLM_START_S[1] for p in evaluations)
    [training] = [p for p in run.phases if p.kind == "training"]
    assert training.mid_s == rows[0]["est_train_s"]


@pytest.mark.parametrize("branch", sorted(TUTORIALS))
def test_the_total_is_the_sum_of_the_phases_and_priced_at_the_vms_rate(
        branch: str, tutorial_runs: dict[str, tuple[list[dict[str, Any]], str]]) -> None:
    rows, out = tutorial_runs[branch]
    run = run_forecast.forecast(rows)
    low, mid, high = run.total_s()
    assert mid == pytest.approx(rows[0]["est_vm_setup_s"] + sum(p["mid_s"] for p in rows[0]["run_phases"]))
    assert low == pytest.approx(sum(p.low_s for p in run.phases))
    assert high == pytest.approx(sum(p.high_s for p in run.phases))
    assert low < mid < high
    hours, usd = re.search(r"^total: about (\d+\.\d\d) h .*?, (\d+\.\d\d) USD", out, re.M).groups()
    assert float(hours) == pytest.approx(mid / 3600, abs=0.005)
    assert float(usd) == pytest.approx(mid / 3600 * prices.vm_rate(vm_config.load_config()).usd_per_hour, abs=0.005)
    # the printed minutes add up to the printed total
    minutes = [float(re.search(r"\s(\d+\.\d)\s+\d+\.\d-\d+\.\d\s", line).group(1)) for line in phase_lines(out)]
    assert sum(minutes) / 60 == pytest.approx(float(hours), abs=0.01 + 0.05 * len(minutes) / 60)


@pytest.mark.parametrize("branch", sorted(TUTORIALS))
def test_the_price_question_shows_preflights_total_and_what_it_holds(
        branch: str, tutorial_runs: dict[str, tuple[list[dict[str, Any]], str]]) -> None:
    rows, out = tutorial_runs[branch]
    cfg = vm_config.load_config()
    line = forecast_line(cfg, rows)
    total = re.search(r"^total: (about .*? USD/h)", out, re.M).group(1)
    assert total.split(", ")[0] in line and total.split(", ")[1] in line, (line, total)
    assert "it holds VM setup, downloads, conversion, training, export, evaluation;" in line
    assert "come on top" not in line


def test_a_target_before_the_evaluation_leaves_its_lines_out(
        tutorial_runs: dict[str, tuple[list[dict[str, Any]], str]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)   # doit -d: the working directory need not be the checkout
    rows, _ = tutorial_runs["sft"]
    [row] = rows
    cfg = aot.composed_views(["sft.preset=gemma3-4b-ultrachat-v6e8"], preflight.ROOT, ("sft",), True)[1]["sft"]
    chip = generations.load()["v6e"].chip
    exported = run_forecast.branch_phases(cfg, row, chip, run_forecast.stages_of("to_huggingface@sft"))
    assert [p.name for p in exported] == ["hf_download@sft", "to_maxtext@sft", "train_sft@sft", "to_huggingface@sft"]
    trained = run_forecast.forecast([row | {"run_phases": run_forecast.as_row(
        run_forecast.branch_phases(cfg, row, chip, run_forecast.stages_of("train_sft@sft")))}])
    assert trained.kinds() == ["VM setup", "downloads", "conversion", "training"]
    assert "evaluation" not in trained.holds().split(";")[0] and "export" not in trained.holds().split(";")[0]
    with pytest.raises(ConfigError, match="--target"):
        run_forecast.stages_of("evaluate@nowhere")


def test_an_unknown_test_split_without_num_problems_is_refused_naming_the_key() -> None:
    cfg = aot.composed_views(["rl.preset=llama3.1-8b-gsm8k-v6e8"], preflight.ROOT, ("rl",), True)[1]["rl"]
    local = cfg.model_copy(update={"dataset": cfg.dataset.model_copy(
        update={"source": cfg.dataset.source.model_copy(update={"repo_id": "someone/else"})})})
    with pytest.raises(ConfigError, match=r"rl\.evaluate\.num_problems"):
        run_forecast._problems(local)


def test_tutorial_total_is_in_the_readme(tutorial_runs: dict[str, tuple[list[dict[str, Any]], str]]) -> None:
    """README's cost table quotes `doit preflight`'s totals."""
    readme = (Path(preflight.ROOT) / "README.md").read_text()
    for branch, (rows, out) in tutorial_runs.items():
        total = re.search(r"^total: (about .*? USD/h)", out, re.M).group(1)
        assert total in readme, (f"README's cost table quotes no `doit preflight` total of {TUTORIALS[branch]}: "
                                 f"paste this one (`doit preflight --set={branch}.preset={TUTORIALS[branch]} "
                                 f"--target=evaluate@{branch}`), and the phases below the table: {total}")
