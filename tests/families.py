"""What the tests run on, found in the project rather than listed in each test file.

* every tiny twin: conf/model/<name>-tiny.yaml (its MaxText name and shrunk dims) with its family in
  mtpipe.data.embedded.FAMILIES, so a new family's twin is converted, logit-checked and tokenizer-checked
  without editing a test;
* every full-size fixture: tests/fixtures/<dir>/ (the Hub's config.json and tensor inventory), with the
  conf/model file whose `source.repo_id` ends in <dir> and a shipped preset that converts it;
* the committed params.yaml (`git show HEAD:params.yaml`): `dvc exp run -S ...` rewrites the workspace's
  copy (the preset, and every `null` written as an empty value), and no test may depend on it.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mtpipe.data import embedded
from mtpipe.pipeline import config

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


@dataclass(frozen=True)
class Twin:
    """A tiny twin of a model family (conf/model/<name>.yaml, written to embedded/<name>)."""

    name: str
    maxtext_name: str  # MaxText's model_name, as the pipeline passes it
    overrides: dict[str, Any]  # maxtext_overrides: the shrunk dims passed to every MaxText command

    def write(self, out: str | Path) -> None:
        """Write the twin's Hugging Face directory (config, tokenizer, weights) to ``out``."""
        embedded.write_twin(self.name, {"maxtext_name": self.maxtext_name, "maxtext_overrides": self.overrides}, out)


def _model_conf(path: Path) -> dict[str, Any]:
    return OmegaConf.to_container(config.load_yaml(path))


@functools.cache
def twins() -> dict[str, Twin]:
    """Every tiny twin, by name: conf/model/*-tiny.yaml."""
    found = {}
    for path in sorted((config.CONF_DIR / "model").glob("*-tiny.yaml")):
        conf = _model_conf(path)
        found[path.stem] = Twin(path.stem, conf["maxtext_name"], conf["maxtext_overrides"])
    return found


TWINS = sorted(twins())  # for pytest.mark.parametrize


@dataclass(frozen=True)
class RealModel:
    """A full-size model described by tests/fixtures/<fixture>/ (no weights)."""

    fixture: str  # tests/fixtures/<fixture>/
    model: str  # conf/model/<model>.yaml
    branch: str  # sft | rl: the branch the preset belongs to
    preset: str  # a shipped preset that converts it (one that trains on this machine first, then by name)


def _preset_branch(preset: dict[str, Any]) -> str:
    return "rl" if "train_rl" in preset else "sft"


def _on_xpk(preset: dict[str, Any]) -> bool:
    hardware = config.load_yaml(config.CONF_DIR / "hardware" / f"{preset['defaults']['hardware']}.yaml")
    return hardware.get("backend") == "xpk"


@functools.cache
def real_models() -> dict[str, RealModel]:
    """Every full-size fixture, by directory name: tests/fixtures/*/config.json."""
    models = {Path(c["source"]["repo_id"]).name: p.stem for p in sorted((config.CONF_DIR / "model").glob("*.yaml"))
              if (c := _model_conf(p))["source"]["kind"] == "hub"}
    presets = {p.stem: OmegaConf.to_container(config.load_preset(p.stem, "preset"))
               for p in sorted((config.CONF_DIR / "preset").glob("*.yaml"))}
    found = {}
    for fixture in sorted(d.name for d in FIXTURES.iterdir() if (d / "config.json").is_file()):
        assert fixture in models, f"tests/fixtures/{fixture}: no conf/model/*.yaml has a source.repo_id ending in it"
        model = models[fixture]
        using = sorted((_on_xpk(p), name) for name, p in presets.items() if p["defaults"]["model"] == model)
        assert using, f"tests/fixtures/{fixture}: no conf/preset/*.yaml names model {model}"
        preset = using[0][1]
        found[fixture] = RealModel(fixture, model, _preset_branch(presets[preset]), preset)
    return found


REAL_MODELS = sorted(real_models())  # for pytest.mark.parametrize


def committed_params_text(root: Path = ROOT) -> str:
    """params.yaml as committed at HEAD (a tree without git history: the file as it is)."""
    proc = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=root, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else (root / "params.yaml").read_text()


@functools.cache
def committed_params_path() -> Path:
    """A file holding the committed params.yaml (for code that reads a path)."""
    folder = tempfile.mkdtemp(prefix="mtpipe-params-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = Path(folder) / "params.yaml"
    path.write_text(committed_params_text())
    return path


def load_params() -> DictConfig:
    """config.load_params() of the committed params.yaml, not the workspace's."""
    return config.load_params(committed_params_path())
