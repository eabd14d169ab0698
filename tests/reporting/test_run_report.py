"""The run report (mtpipe/reporting/report.py): generated from the committed metrics/ and plots/,
it holds every metric and draws every curve; the committed reports/embedded/ is what the committed
record gives; README.md's measured figures are the report's; no stage runs the report's code."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from matplotlib import image

from mtpipe.pipeline import fingerprint
from mtpipe.reporting import report

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "reports" / "embedded"
pytestmark = pytest.mark.explains


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """The report of the committed record, written afresh with the committed report's stage times."""
    return report.write(tmp_path_factory.mktemp("report"), ROOT, COMMITTED / report.TIMES)


def without_git_lines(text: str) -> list[str]:
    """The report's lines but those naming git commits (they follow HEAD)."""
    return [line for line in text.splitlines() if not line.startswith("- git ")]


def test_the_report_holds_every_metric_and_stage_time(written):
    text = written.read_text()
    for path in (ROOT / "metrics").glob("*/*.json"):
        stage = f"{path.stem}@{path.parent.name}"
        for key, value in report.flatten(json.loads(path.read_text())).items():
            assert f"| {stage} | `{key}` | {value} |" in text, (stage, key)
    for line in (COMMITTED / report.TIMES).read_text().splitlines():
        t = json.loads(line)
        assert f"| {t['stage']} | {t['wall_s']} |" in text
    assert "| base | warm-up | trained | gain: trained - base | warm-up - base | GRPO - warm-up |" in text
    sft = json.loads((ROOT / "metrics" / "sft" / "evaluate.json").read_text())
    assert (f"| evaluate@sft | held-out loss (lower is better) | {sft['base']['loss']} +/- {sft['base']['loss_ci95']} | - "
            f"| {sft['trained']['loss']} +/- {sft['trained']['loss_ci95']} |") in text
    rl = json.loads((ROOT / "metrics" / "rl" / "evaluate.json").read_text())
    assert " | ".join(f"{rl[who]['flexible_accuracy']} +/- {rl[who]['flexible_ci95']}"
                      for who in ("base", "warmup", "trained")) in text
    assert "none: every stage ran on this machine's CPU" in text
    assert yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]["train_rl"]["outs"][0]["md5"] in text


def test_every_curve_of_dvc_yaml_is_drawn(written):
    """One PNG per plot of dvc.yaml, each with its lines: pixels of matplotlib's first line colour."""
    first_line = np.array([0x1F, 0x77, 0xB4]) / 255
    titles = [title for title, _, _ in report.curve_files(ROOT)]
    assert len(titles) == 4
    for title in titles:
        assert f"![{title}](" in written.read_text()
        name = written.read_text().split(f"![{title}](", 1)[1].split(")", 1)[0]
        pixels = image.imread(written.parent / name)[..., :3]
        assert pixels.shape == (320, 600, 3), name
        assert np.all(np.abs(pixels - first_line) < 0.02, axis=-1).sum() > 300, f"{name} draws no line"


def test_the_committed_report_is_the_committed_records(written):
    """reports/embedded/ is what the committed metrics, plots and dvc.lock give (regenerate it after a
    pipeline run: python -m mtpipe.reporting.report --out reports/embedded)."""
    fix = "regenerate: python -m mtpipe.reporting.report --out reports/embedded --timings reports/embedded/timings.jsonl"
    assert without_git_lines((COMMITTED / report.REPORT).read_text()) == without_git_lines(written.read_text()), fix
    assert (COMMITTED / report.TIMES).read_text() == (written.parent / report.TIMES).read_text()
    pictures = sorted(p.name for p in written.parent.glob("*.png"))
    assert sorted(p.name for p in COMMITTED.glob("*.png")) == pictures, fix
    for name in pictures:
        assert (COMMITTED / name).read_bytes() == (written.parent / name).read_bytes(), f"{name}: {fix}"


def test_readme_quotes_the_committed_report():
    """Each headline figure of the report is in README.md's stage table, in the row of its stage."""
    readme = (ROOT / "README.md").read_text()
    assert "(reports/embedded/README.md)" in readme
    rows = {stage: line for line in readme.splitlines() if line.startswith("| ")
            for stage in line.split("|")[1].strip().split(", ")}
    figures = report.read_headlines(COMMITTED / report.REPORT)
    assert set(figures) == {"train_sft@sft", "train_sft@rl", "train_rl", "evaluate@rl", "evaluate@rl stages", "evaluate@rl strict",
                            "evaluate@sft"}
    for stage, text in figures.items():
        row = rows[stage.split()[0]]
        assert text in row, f"README.md's row of {stage} does not say {text!r} (reports/embedded/README.md)"


def test_headline_figures_round_as_people_do():
    assert report.fixed(31.25, 1) == "31.3" and report.fixed(32.8125, 1) == "32.8"
    assert [report.short(x) for x in (6.46889, 1.60931, 0.11834)] == ["6.5", "1.6", "0.12"]
    assert report.signed(4.16, 1) == "+4.2" and report.signed(-0.8, 1) == "-0.8"


def test_cost_comes_from_the_vm_ledger(tmp_path):
    (tmp_path / "views").mkdir()
    (tmp_path / "views" / "run.yaml").write_text(yaml.safe_dump({"sft": {"train_sft": {"hardware": {"name": "v6e-8"}}}}))
    assert report.cost(tmp_path).startswith("not recorded here: hardware v6e-8")
    (tmp_path / ".vm_state.json").write_text(json.dumps({"vms": [{
        "name": "vm", "provisioning": "on-demand", "usd_per_hour": 21.6, "reservation": None,
        "created": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T02:00:00+00:00", "why": "deleted"}]}))
    assert report.cost(tmp_path) == "1 VM(s), 2.00 h, 43.20 USD billed (.vm_state.json, conf/prices.yaml)"


def test_params_that_differ_from_the_presets():
    params = {"steps": 300, "sft": {"preset": "embedded-sft", "train_sft": {"learning_rate": None}},
              "rl": {"preset": "embedded-rl", "train_rl": {"num_batches": 8}}}
    assert report.overrides(params) == {"steps": 300, "rl.train_rl.num_batches": 8}


def test_no_stage_runs_the_report_code():
    """.dvcignore leaves mtpipe/reporting/ out of configure's `mtpipe` dependency: right only while no
    stage runs it (its code would then be missing from the stage's fingerprints' trigger)."""
    assert "mtpipe/reporting/" in (ROOT / ".dvcignore").read_text().splitlines()
    for script in (ROOT / "stages").glob("*.py"):
        modules = fingerprint.stage_modules(script.stem)
        assert not [m for m in modules if m.startswith("mtpipe/reporting/")], script.stem


def test_a_run_of_one_branch_has_that_branchs_figures():
    """`dvc exp run to_huggingface@sft` and the like: the report names what ran, nothing else."""
    sft_only = {stage: values for stage, values in report.metrics(ROOT).items() if stage.endswith("@sft")}
    assert set(report.headlines(sft_only)) == {"train_sft@sft", "evaluate@sft"}


@pytest.mark.rl_learns
def test_the_committed_demo_run_shows_grpo_raising_answer_accuracy():
    """metrics/rl/train_rl.json (the committed `make demo`): pass@1 on the same 96 held-out prompts,
    8 samples each, is higher after GRPO than before it."""
    rl = json.loads((ROOT / "metrics" / "rl" / "train_rl.json").read_text())
    assert rl["eval_pre_total"] == rl["eval_post_total"] == 96
    assert rl["eval_pre_samples_per_prompt"] == rl["eval_post_samples_per_prompt"] == 8
    assert rl["eval_post_pass_at_1"] > rl["eval_pre_pass_at_1"], rl
    assert rl["eval_post_accuracy"] == pytest.approx(rl["eval_post_pass_at_1"], abs=0.01)  # what the report quotes


@pytest.mark.scores
def test_the_records_lm_eval_scores_resolve_what_each_stage_added():
    """The committed RL record: lm-eval (train_rl's format, every held-out problem) puts the whole
    branch's gain above zero, and resolves a change of a few points between two trained models (the
    paired interval of GRPO against the warm-up is narrower than +/-5 points: +/-4.3 on the committed
    record, +/-3.1 on the earlier one, another CPU's)."""
    scores = json.loads((ROOT / "metrics" / "rl" / "evaluate.json").read_text())
    gain, grpo = scores["gain"], scores["grpo_gain"]
    assert gain["flexible_gain"] - gain["flexible_gain_ci95"] > 0, gain
    assert grpo["flexible_gain_ci95"] < 5, grpo
    assert scores["base"]["problems"] == scores["warmup"]["problems"] == scores["trained"]["problems"] == 500
    rl = json.loads((ROOT / "metrics" / "rl" / "train_rl.json").read_text())
    assert {f"eval_gain_pass_at_{k}{ci}" for k in (1, 2, 4, 8) for ci in ("", "_ci95")} <= set(rl)
