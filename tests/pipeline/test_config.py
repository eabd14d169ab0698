"""Config composition, validation and the per-stage views that make invalidation exact."""

import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from mtpipe.data import embedded
from mtpipe.pipeline import config
from mtpipe.errors import ConfigError
import families


def params(**sft) -> OmegaConf:
    base = families.load_params()
    return OmegaConf.merge(base, {"sft": sft}) if sft else base


def test_default_params_compose_both_branches():
    p = families.load_params()
    sft, rl = config.compose("sft", p), config.compose("rl", p)
    assert (sft.model.name, sft.dataset.name, sft.hardware.name) == ("gemma3-tiny", "ultrachat-tiny", "cpu")
    assert (rl.model.name, rl.dataset.name) == ("llama3.1-tiny", "gsm8k-tiny")


def test_top_level_steps_overrides_the_preset():
    p = OmegaConf.merge(families.load_params(), {"steps": 2000})
    assert config.compose("sft", p).train_sft.steps == 2000


def test_null_keeps_preset_and_value_overrides():
    p = params(train_sft={"learning_rate": 5e-4, "per_device_batch_size": None})
    cfg = config.compose("sft", p)
    assert cfg.train_sft.learning_rate == 5e-4
    assert cfg.train_sft.per_device_batch_size == 4


def test_group_override_swaps_a_part():
    cfg = config.compose("sft", params(hardware="v6e-8"))
    assert cfg.hardware.env["TPU_TOPOLOGY"] == "2x4"
    assert cfg.model.name == "gemma3-tiny"


@pytest.mark.parametrize(
    ("override", "key", "fix"),
    [
        ({"preset": "nope"}, "sft.preset", "embedded-sft"),
        ({"model": "gpt5"}, "sft.model", "gemma3-4b"),
        ({"dataset": "missing"}, "sft.dataset", "ultrachat-200k"),
        ({"train_sft": {"per_device_batch_size": 0}}, "sft.train_sft.per_device_batch_size", ">= 1"),
        ({"to_huggingface": {"weight_dtype": "fp8"}}, "sft.to_huggingface.weight_dtype", "bfloat16"),
    ],
)
def test_bad_input_names_key_and_fix(override, key, fix):
    with pytest.raises(ConfigError) as err:
        config.compose("sft", params(**override))
    assert err.value.key == key
    assert fix in str(err.value)


@pytest.mark.parametrize("steps", [0, -5, "ten", 2.5])
def test_bad_steps_rejected(steps):
    with pytest.raises(ConfigError, match=r"^steps: must be a positive integer.*Fix: set e.g. `dvc exp run"):
        config.compose("sft", OmegaConf.merge(families.load_params(), {"steps": steps}))


def test_bad_rollout_backend_rejected():
    p = OmegaConf.merge(families.load_params(), {"rl": {"train_rl": {"rollout_backend": "sglang"}}})
    with pytest.raises(ConfigError, match="rollout_backend"):
        config.compose("rl", p)


def test_unpinned_hub_revision_rejected(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    src = config.CONF_DIR / "model" / "gemma3-4b.yaml"
    (tmp_path / "model" / "gemma3-4b.yaml").write_text(src.read_text().replace(
        "093f9f388b31de276ce2de164bdc2081324b9767", "main"))
    for group in ("preset", "dataset", "hardware"):
        (tmp_path / group).symlink_to(config.CONF_DIR / group)
    monkeypatch.setattr(config, "CONF_DIR", tmp_path)
    with pytest.raises(ConfigError, match=r"^sft.model.source.revision: must be a 40-hex commit sha"):
        config.compose("sft", params(preset="gemma3-4b-ultrachat-v6e8"))


def test_views_change_only_for_the_stages_that_read_a_value(tmp_path):
    base = families.load_params()
    config.write_resolved(config.compose_all(base), config.twin_confs(embedded.FAMILIES), tmp_path / "a")
    config.write_resolved(config.compose_all(OmegaConf.merge(base, {"steps": 7})), config.twin_confs(embedded.FAMILIES), tmp_path / "b")
    changed = {
        f"{p.parent.name}/{p.stem}"
        for p in (tmp_path / "a").rglob("*.yaml")
        if p.read_text() != (tmp_path / "b" / p.relative_to(tmp_path / "a")).read_text()
    }
    assert changed == {"sft/train_sft"}


def test_configure_fails_early_and_keeps_existing_views(tmp_path):
    """A bad value stops `configure` with the key and the fix; the files already written stay."""
    good = families.load_params()
    config.write_resolved(config.compose_all(good), config.twin_confs(embedded.FAMILIES), tmp_path)
    before = {p: p.read_text() for p in tmp_path.rglob("*.yaml")}
    with pytest.raises(ConfigError):
        config.write_resolved(config.compose_all(OmegaConf.merge(good, {"steps": 0})), config.twin_confs(embedded.FAMILIES), tmp_path)
    assert {p: p.read_text() for p in tmp_path.rglob("*.yaml")} == before


@pytest.mark.slow
def test_configure_stage_exit_message(tmp_path):
    """`python -m stages.configure` with `steps: 0` ends with one line naming the key, no traceback,
    and leaves the resolved views it had written before untouched."""
    from pipeline import copy_project

    repo = copy_project(tmp_path / "repo")
    stage = [sys.executable, "-m", "stages.configure"]
    subprocess.run(stage, cwd=repo, check=True, capture_output=True)
    before = {p: p.read_text() for p in (repo / "views").rglob("*.yaml")}
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("steps: null", "steps: 0", 1))
    proc = subprocess.run(stage, cwd=repo, capture_output=True, text=True)
    assert proc.returncode != 0
    assert proc.stderr.strip() == ("configure: steps: must be a positive integer, got 0. "
                                   "Fix: set e.g. `dvc exp run -S steps=200`")
    assert {p: p.read_text() for p in (repo / "views").rglob("*.yaml")} == before


@pytest.mark.families
@pytest.mark.parametrize("where", [
    {"train_sft": {"extra_args": {"hf_access_token": "x"}}},
    {"train_sft": {"extra_args": {"tokenizer_path": "hf_" + "a" * 30}}},
])
def test_a_token_in_the_config_is_rejected(where):
    with pytest.raises(ConfigError, match="export HF_TOKEN"):
        config.compose("sft", params(**where))


@pytest.mark.parametrize(("override", "key"), [
    ({"train_sft": {"learnig_rate": 1e-3}}, "sft.train_sft.learnig_rate"),
    ({"train_sft": 5}, "sft.train_sft"),
    ({"to_huggingface": {"weight_dtype": {"a": 1}}}, "sft.to_huggingface.weight_dtype"),
])
def test_unknown_or_misshapen_override_is_rejected(override, key):
    with pytest.raises(ConfigError) as err:
        config.compose("sft", params(**override))
    assert err.value.key == key


def test_malformed_params_yaml_names_the_file(tmp_path):
    (tmp_path / "params.yaml").write_text("steps: [1\n")
    with pytest.raises(ConfigError, match="params.yaml: is not valid YAML"):
        config.load_params(tmp_path / "params.yaml")
