"""An artifact is its bytes: what `dvc repro` runs after a change that cannot change an output.

Each output's stamp holds only what its bytes imply (mtpipe/pipeline/stage.py), so a stage that
reruns and writes the same bytes stops the cascade: DVC finds the next stage's inputs as recorded.
A training run's recipe (its view and its inputs' content digests) names its run directory under
work/ instead. Every test here asserts on what `dvc repro` ran, on the real embedded pipeline.
"""

from pathlib import Path

import pytest
import yaml

from conftest import restore
from mtpipe.pipeline import stage
from pipeline import dvc, git, md5_tree, ran_stages, reproduced_stages

pytestmark = pytest.mark.content_address


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}: update the test"
    path.write_text(text.replace(old, new, 1))


def artifact_outs(repo: Path) -> dict[str, str]:
    """Every output path in dvc.lock but configure's (the views) -> its md5."""
    lock = yaml.safe_load((repo / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for name, stage in lock["stages"].items() if name != "configure"
            for o in stage.get("outs", [])}


def test_a_stamp_is_its_outputs_content_and_a_recipe_its_inputs_content(tmp_path, monkeypatch):
    """Two stages that write the same files write the same stamp, whatever their views; a recipe moves
    with the view's bytes and with an input's content, not with how the input was made."""
    outs = {name: tmp_path / name for name in ("a", "b")}
    for out in outs.values():
        (out / "0" / "items").mkdir(parents=True)
        (out / "0" / "items" / "w").write_bytes(b"weights")
    stage.write_stamp(outs["a"], "to_maxtext")
    stage.write_stamp(outs["b"], "to_maxtext")
    assert (outs["a"] / stage.STAMP).read_bytes() == (outs["b"] / stage.STAMP).read_bytes()

    view = tmp_path / "views" / "sft" / "train_sft.yaml"
    view.parent.mkdir(parents=True)
    view.write_text("train_sft:\n  checkpoint_period: 50\n")
    monkeypatch.setattr(stage, "resolved_path", lambda branch, name: tmp_path / "views" / branch / f"{name}.yaml")
    first = stage.recipe("sft", "train_sft", outs["a"])
    assert stage.recipe("sft", "train_sft", outs["b"]) == first, "the same input bytes, another producer"
    view.write_text("train_sft:\n  checkpoint_period: 75\n")
    assert stage.recipe("sft", "train_sft", outs["a"]) != first
    view.write_text("train_sft:\n  checkpoint_period: 50\n")
    (outs["b"] / "0" / "items" / "w").write_bytes(b"other weights")
    stage.write_stamp(outs["b"], "to_maxtext")
    assert stage.recipe("sft", "train_sft", outs["b"]) != first


@pytest.mark.slow
def test_a_behaviour_preserving_edit_of_a_stage_script_reruns_only_that_stage(pipeline_repo):
    """A statement that does nothing, added to stages/to_maxtext.py: its fingerprint moves, so configure
    and both conversions run; they write the bytes they wrote (the same files, byte for byte), and every
    stage after them didn't change."""
    converted = ["artifacts/sft/maxtext", "artifacts/rl/maxtext"]
    before, outs = md5_tree(pipeline_repo, converted), artifact_outs(pipeline_repo)
    try:
        edit(pipeline_repo / "stages" / "to_maxtext.py", "\n\n\ndef main(", "\n\n\nUNUSED = 1\n\n\ndef main(")
        out = dvc(pipeline_repo, "repro", "--no-run-cache").stdout  # run, not restored from an earlier run
        assert ran_stages(out) == {"configure", "to_maxtext@sft", "to_maxtext@rl"}, out
        for stage in ("train_sft@sft", "train_sft@rl", "train_rl", "to_huggingface@sft", "evaluate@rl"):
            assert f"Stage '{stage}' didn't change, skipping" in out, out
        assert md5_tree(pipeline_repo, converted) == before, "a conversion wrote other bytes"
        assert artifact_outs(pipeline_repo) == outs
    finally:
        restore(pipeline_repo)


@pytest.mark.slow
def test_rewording_error_messages_reruns_only_configure(pipeline_repo):
    """Message text in the forms the code builds it: a combination rule (``add(...)``) and a variable
    only messages read (rules.py, configure's alone), the schema's wording of a key (``Words``:
    schema.py is in every stage's view), a stage's own error. The views are written as they were."""
    schema, rules = (pipeline_repo / "mtpipe" / "pipeline" / f"{m}.py" for m in ("schema", "rules"))
    try:
        edit(rules, '"is missing for a kind: hub source"', '"names no Hub repository"')
        edit(schema, 'means="a 40-hex commit sha"', 'means="a full commit hash"')
        edit(rules, '"(one replica on all chips)"', '"(a single replica)"')
        edit(pipeline_repo / "stages" / "train_rl.py", "not installed here", "missing on this machine")
        out = dvc(pipeline_repo, "repro").stdout
        assert ran_stages(out) == {"configure"}, out
        assert not git(pipeline_repo, "status", "--porcelain", "views"), "a resolved view changed"
    finally:
        restore(pipeline_repo)


@pytest.mark.slow
def test_export_name_and_operational_keys_rerun_only_what_reads_them(pipeline_repo):
    """A model's export_name is read by the export alone; the evaluation server's start-up timeout
    and the presets' file names by no output: configure writes them to views/run.yaml."""
    try:
        edit(pipeline_repo / "conf" / "model" / "gemma3-tiny.yaml", "export_name: gemma3-4b", "export_name: gemma3-4b-pt")
        params = pipeline_repo / "params.yaml"
        p = yaml.safe_load(params.read_text())
        p["rl"]["evaluate"] = {**(p["rl"].get("evaluate") or {}), "server_timeout_s": 300}
        params.write_text(yaml.safe_dump(p, sort_keys=False))
        dvc(pipeline_repo, "repro", "configure")
        stale = dvc(pipeline_repo, "status", "--json").stdout.strip().splitlines()[-1]
        assert set(yaml.safe_load(stale)) == {"to_huggingface@sft"}, stale
    finally:
        restore(pipeline_repo)


@pytest.mark.slow
def test_a_twin_size_reruns_the_generator_and_what_reads_the_size(pipeline_repo):
    """A twin's sizes are in make_embedded's view (views/embedded/make_embedded.yaml): after configure
    the generator is stale, as are the MaxText stages that pass the sizes; the download, whose input is
    the generator's output, waits for its bytes."""
    try:
        edit(pipeline_repo / "conf" / "model" / "llama3.1-tiny.yaml", "base_mlp_dim: 256", "base_mlp_dim: 128")
        dvc(pipeline_repo, "repro", "configure")
        stale = dvc(pipeline_repo, "status", "--json").stdout.strip().splitlines()[-1]
        assert set(yaml.safe_load(stale)) == {"make_embedded", "to_maxtext@rl", "train_sft@rl", "train_rl",
                                              "to_huggingface@rl", "evaluate_warmup"}, stale  # it exports too
    finally:
        restore(pipeline_repo)


@pytest.mark.slow
@pytest.mark.address
def test_a_twin_no_branch_uses_is_in_no_branchs_address(pipeline_repo):
    """A download depends on its own twin and dataset (artifacts/<branch>/source.json, written by
    make_embedded), not on all of embedded/: resizing a twin no branch uses, or adding a family's twin,
    reruns configure and make_embedded and leaves every branch's stages up to date."""
    added = pipeline_repo / "conf" / "model" / "llama3.1b-tiny.yaml"
    try:
        edit(pipeline_repo / "conf" / "model" / "qwen3-tiny.yaml", "base_mlp_dim: 256", "base_mlp_dim: 128")
        ran = reproduced_stages(dvc(pipeline_repo, "repro", "make_embedded").stdout)
        assert ran == {"configure", "make_embedded"}, ran
        assert dvc(pipeline_repo, "status", "--json").stdout.strip().splitlines()[-1] == "{}"

        added.write_text((pipeline_repo / "conf" / "model" / "llama3.1-tiny.yaml").read_text()
                         .replace("embedded/llama3.1-tiny", "embedded/llama3.1b-tiny"))
        edit(pipeline_repo / "mtpipe" / "data" / "embedded.py", "\n# A twin's sizes: MaxText override key",
             '\nFAMILIES["llama3.1b-tiny"] = FAMILIES["llama3.1-tiny"]\n\n# A twin\'s sizes: MaxText override key')
        ran = reproduced_stages(dvc(pipeline_repo, "repro", "make_embedded").stdout)
        assert ran == {"configure", "make_embedded"}, ran
        assert (pipeline_repo / "embedded" / "llama3.1b-tiny" / "config.json").is_file()
        assert dvc(pipeline_repo, "status", "--json").stdout.strip().splitlines()[-1] == "{}"
    finally:
        added.unlink(missing_ok=True)
        restore(pipeline_repo)


@pytest.mark.slow
def test_checkpoint_period_reruns_the_training_and_nothing_after_it(pipeline_repo):
    """Other checkpoint periods train the same model: the params are the same bytes, so the export and
    the evaluation are not run again. The run directory is another one (the recipe moved)."""
    trained = ["artifacts/sft/trained"]
    before = md5_tree(pipeline_repo, trained)
    period = yaml.safe_load((pipeline_repo / "views/sft/train_sft.yaml").read_text())["train_sft"]["checkpoint_period"]
    try:
        out = dvc(pipeline_repo, "exp", "run", "-S", f"sft.train_sft.checkpoint_period={period + 25}").stdout
        assert reproduced_stages(out) == {"configure", "train_sft@sft"}, out
        assert "Stage 'to_huggingface@sft' didn't change, skipping" in out, out
        assert md5_tree(pipeline_repo, trained) == before, "other checkpoint periods trained other params"
    finally:
        restore(pipeline_repo)
