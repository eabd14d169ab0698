"""The stage table (mtpipe/pipeline/stage_table.py) says what dvc.yaml says, and stage scripts take their
paths from it: a stage is declared in two places that a test holds equal, and nowhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from mtpipe.pipeline import stage_table
from mtpipe.pipeline.stage_table import STAGES, Stage

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.house


def _paths(entries: list[Any]) -> set[str]:
    """dvc.yaml's list of paths (a plain path, or ``{path: {options}}``) as a set of paths."""
    return {next(iter(e)) if isinstance(e, dict) else e for e in entries or []}


def _fill(value: Any, item: Any, key: str | None) -> Any:
    """dvc.yaml's ``${item}``, ``${key}`` and ``${item.x}`` filled in, as DVC's foreach does."""
    if isinstance(value, str):
        value = value.replace("${key}", str(key))
        value = re.sub(r"\$\{item\.(\w+)\}", lambda m: str(item[m[1]]), value)
        return value.replace("${item}", str(item))
    if isinstance(value, list):
        return [_fill(v, item, key) for v in value]
    if isinstance(value, dict):
        return {_fill(k, item, key): _fill(v, item, key) for k, v in value.items()}
    return value


def dvc_stages(dvc_yaml: dict) -> dict[str, dict]:
    """dvc.yaml's stages with ``foreach`` expanded: ``train_sft@sft`` -> its definition."""
    found = {}
    for name, stage in dvc_yaml["stages"].items():
        if "foreach" not in stage:
            found[name] = stage
            continue
        items = stage["foreach"]
        for key, item in (items.items() if isinstance(items, dict) else ((i, i) for i in items)):
            found[f"{name}@{key}"] = _fill(stage["do"], item, key)
    return found


def table_stages() -> dict[str, dict]:
    """The stage table as the same shape: address -> cmd, deps, outs, metrics, plots."""
    found = {}
    for stage in STAGES:
        for branch in stage.branches:
            arg = "embedded" if stage.name == "make_embedded" else branch if len(stage.branches) > 1 else None
            found[stage.address(branch)] = {
                "cmd": f"exec python -m stages.{stage.name}" + (f" {arg}" if arg else ""),
                "deps": {stage.view(branch), *(stage.path(p, branch) for p in stage.reads.values())},
                "outs": {stage.path(p, branch) for p in stage.outs.values()},
                "metrics": {stage.path(stage.metrics, branch)} if stage.metrics else set(),
                "plots": {stage.path(stage.plots, branch)} if stage.plots else set(),
            }
    return found


def compare(dvc_yaml: dict) -> list[str]:
    """Where dvc.yaml and the stage table disagree (configure, which writes the views, is dvc.yaml's alone)."""
    declared, table = dvc_stages(dvc_yaml), table_stages()
    configure = declared.pop("configure")
    wrong = [f"{name}: in {'dvc.yaml' if name in declared else 'the stage table'} only"
             for name in sorted(declared.keys() ^ table.keys())]
    for name in sorted(declared.keys() & table.keys()):
        stage = declared[name]
        said = {"cmd": stage["cmd"], "deps": _paths(stage.get("deps")), "outs": _paths(stage.get("outs")),
                "metrics": _paths(stage.get("metrics")), "plots": _paths(stage.get("plots"))}
        wrong += [f"{name} {part}: dvc.yaml {said[part]!r}, the stage table {table[name][part]!r}"
                  for part in said if said[part] != table[name][part]]
    views = {s.view(b) for s in STAGES for b in s.branches} | {stage_table.RUN_FILE}
    if _paths(configure.get("outs")) != views:
        wrong.append(f"configure's outs are not the table's views: {sorted(_paths(configure.get('outs')) ^ views)}")
    return wrong


def test_dvc_yaml_and_the_stage_table_agree():
    assert compare(yaml.safe_load((ROOT / "dvc.yaml").read_text())) == []


def test_a_disagreement_is_found():
    """An out renamed in dvc.yaml, a stage dvc.yaml lacks, a view configure does not write: each is named."""
    dvc_yaml = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    dvc_yaml["stages"]["to_maxtext"]["do"]["outs"] = ["artifacts/${item}/orbax"]
    del dvc_yaml["stages"]["evaluate_warmup"]
    dvc_yaml["stages"]["configure"]["outs"].pop()
    wrong = compare(dvc_yaml)
    assert any(w.startswith("to_maxtext@sft outs:") and "orbax" in w for w in wrong), wrong
    assert "evaluate_warmup: in the stage table only" in wrong
    assert any(w.startswith("configure's outs") for w in wrong)


def test_the_derived_tables_follow_the_declarations():
    assert stage_table.BRANCH_STAGES["rl"] == ("hf_download", "to_maxtext", "train_sft", "train_rl", "to_huggingface",
                                               "evaluate_base", "evaluate_warmup", "evaluate")
    assert stage_table.TRAINING == ("train_sft", "train_rl")
    assert stage_table.BUDGET_STAGES["sft"] == ("hf_download", "train_sft", "to_huggingface")
    assert stage_table.address("train_sft", "rl") == "train_sft@rl" and stage_table.address("train_rl", "rl") == "train_rl"
    added = Stage("score_twice", ("sft",), ("dataset",), outs={"x": "scores/{branch}/twice.jsonl"})
    assert added.path(added.metrics, "sft") == "metrics/sft/score_twice.json" and added.address("sft") == "score_twice"


DECLARED_ROOTS = ("metrics", "artifacts", "plots", "scores")


def built_paths(path: Path) -> list[str]:
    """Where a script builds a path dvc.yaml declares: a string that starts with one of those folders
    (``"metrics/..."``, ``ROOT / "plots"``), outside docstrings, or a call of ``artifact(...)``."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    joined = {id(side) for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
              for side in (node.left, node.right)}   # `ROOT / "metrics"`
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                and node.value.split("/")[0] in DECLARED_ROOTS and ("/" in node.value or id(node) in joined):
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "artifact":
            found.append(f"{path.name}:{node.lineno} artifact(...)")
    return sorted(found)


def test_no_stage_script_builds_a_declared_path():
    found = [hit for script in sorted((ROOT / "stages").glob("*.py")) for hit in built_paths(script)]
    assert found == []


def test_the_path_check_sees_a_built_path(tmp_path: Path):
    script = tmp_path / "s.py"
    script.write_text('"""Writes metrics/x.json."""\nout = ROOT / "metrics" / b\nm = artifact(b, "hf")\n'
                      'p = f(stage.outs["scores"], "plots/x.csv")\n')
    assert built_paths(script) == ["s.py:2 'metrics'", "s.py:3 artifact(...)", "s.py:4 'plots/x.csv'"]


def test_every_training_stage_has_one_trainer_record_whose_keys_its_section_has():
    """A stage that trains is run, budgeted, forecast and reported through its record
    (mtpipe/pipeline/trainers.py); a key the record names that its section lacks would fail preflight's
    or the budget's message, so each is checked here."""
    from mtpipe.pipeline import trainers
    from mtpipe.pipeline import schema

    assert [t.stage for t in trainers.TRAINERS] == list(stage_table.TRAINING)
    assert [trainers.of_branch(stages).stage for stages in stage_table.BRANCH_STAGES.values()] == ["train_sft", "train_rl"]
    for t in trainers.TRAINERS:
        section = schema.RlStages.model_fields[t.stage].annotation
        for key in (t.steps_key, *t.memory_keys, *t.checkpoint_keys):
            assert key.split(".")[0] in section.model_fields, f"{t.stage}: {key}"
