"""Model families: what the tests find by themselves, the CPU model server's refusal at configure, and
tests that hold whatever a user's `dvc exp run -S ...` left in the workspace's params.yaml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import families
from mtpipe.data import embedded
from mtpipe.evaluation import cpu_backend
from mtpipe.pipeline import config
from pipeline import copy_project, env

pytestmark = pytest.mark.families

ROOT = Path(__file__).resolve().parents[2]
# A family MaxText converts but the numpy forward cannot run (a mixture of experts): its twin would
# train, then fail in evaluate's model server, unless configure refuses it.
UNSERVED = {"name": "mixtral-tiny", "maxtext_name": "mixtral-8x7b", "model_type": "mixtral"}


def test_every_tiny_model_file_is_a_twin_with_a_family():
    """conf/model/*-tiny.yaml are found, each with its family (so the tests cover a new one by themselves)."""
    names = {p.stem for p in (config.CONF_DIR / "model").glob("*-tiny.yaml")}
    assert set(families.TWINS) == names and {"gemma3-tiny", "llama3.1-tiny"} <= names
    for twin in families.twins().values():
        assert twin.name in embedded.FAMILIES, f"conf/model/{twin.name}.yaml has no family in FAMILIES"
        assert twin.overrides["override_model_config"] is True


def test_every_fixture_is_found_with_a_preset_that_converts_it():
    fixtures = {d.name for d in families.FIXTURES.iterdir() if (d / "config.json").is_file()}
    assert set(families.REAL_MODELS) == fixtures and {"gemma-3-4b-it", "Llama-3.1-8B-Instruct"} <= fixtures
    for model in families.real_models().values():
        preset = config.load_preset(model.preset, "preset")
        assert preset.defaults.model == model.model


def _with_model(conf: Path, maxtext_name: str, name: str) -> None:
    """conf/model/<name>.yaml: the Llama twin's file under another MaxText name."""
    text = (config.CONF_DIR / "model" / "llama3.1-tiny.yaml").read_text()
    (conf / "model" / f"{name}.yaml").write_text(text.replace("maxtext_name: llama3.1-8b-Instruct",
                                                              f"maxtext_name: {maxtext_name}"))


@pytest.fixture
def conf(tmp_path, monkeypatch) -> Path:
    """A writable copy of conf/ that compose reads instead of the real one."""
    shutil.copytree(config.CONF_DIR, tmp_path / "conf")
    monkeypatch.setattr(config, "CONF_DIR", tmp_path / "conf")
    return tmp_path / "conf"


def test_the_cpu_backend_is_refused_for_a_family_the_forward_cannot_serve(conf):
    _with_model(conf, UNSERVED["maxtext_name"], UNSERVED["name"])
    cfg = config.compose("sft", OmegaConf.merge(families.load_params(), {"sft": {"model": UNSERVED["name"]}}))
    assert cfg.evaluate.backend == "cpu"
    [err] = cpu_backend.cpu_forward_errors(cfg)
    assert err.key == "sft.evaluate.backend"
    assert f"model_type='{UNSERVED['model_type']}'" in err.problem
    assert "evaluate.backend: vllm" in err.fix and "mtpipe/evaluation/numpy_forward.py" in err.fix
    vllm = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"backend": "vllm"})})
    assert cpu_backend.cpu_forward_errors(vllm) == []


def test_a_llama_like_family_needs_no_forward_code(conf):
    """Qwen 3 (MaxText's qwen3-0.6b: tied, q/k norms) passes the check on the flags alone."""
    _with_model(conf, "qwen3-0.6b", "qwen3-check")
    cfg = config.compose("sft", OmegaConf.merge(families.load_params(), {"sft": {"model": "qwen3-check"}}))
    assert cpu_backend.cpu_forward_errors(cfg) == []
    for name in families.TWINS:  # and every shipped twin, on both branches' default backend
        assert cpu_backend.cpu_forward_errors(config.compose("sft", OmegaConf.merge(
            families.load_params(), {"sft": {"model": name}}))) == []


def _apply_dvc_set(params: Path, overrides: list[str]) -> None:
    """Rewrite params.yaml as `dvc exp run -S` does (DVC's own code: the values, and `null` as empty)."""
    from dvc.utils.hydra import apply_overrides

    apply_overrides(params, overrides)


@pytest.mark.slow
def test_configure_stops_before_anything_long_naming_the_fix(tmp_path):
    """`python -m stages.configure` refuses evaluate.backend: cpu for the unserved family in one line."""
    repo = copy_project(tmp_path / "repo")
    _with_model(repo / "conf", UNSERVED["maxtext_name"], UNSERVED["name"])
    _apply_dvc_set(repo / "params.yaml", [f"sft.model={UNSERVED['name']}"])
    proc = subprocess.run([sys.executable, "-m", "stages.configure"], cwd=repo, env=env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("configure: sft.evaluate.backend: is cpu, but the CPU model server cannot run mixtral-tiny")
    assert "Fix: set evaluate.backend: vllm" in last and "mtpipe/evaluation/numpy_forward.py" in last


@pytest.mark.slow
def test_config_tests_pass_after_a_dvc_exp_run_rewrote_params(tmp_path):
    """A user's `dvc exp run -S sft.preset=...` leaves its params.yaml in the workspace (another preset,
    every `null` written as an empty value); the config tests still pass there: they read the committed file."""
    repo = copy_project(tmp_path / "repo")
    params = repo / "params.yaml"
    _apply_dvc_set(params, ["sft.preset=gemma3-4b-ultrachat-v6e8"])
    text = params.read_text()
    assert "preset: gemma3-4b-ultrachat-v6e8" in text and "\nsteps: null" not in text and "\nsteps:" in text
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
                           "-m", "not slow", "tests/pipeline/test_config.py"],
                          cwd=repo, env=env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert params.read_text() == text  # the workspace file stays as the experiment left it
