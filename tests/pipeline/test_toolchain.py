"""The environment is an input: one toolchain on the laptop and the TPU VM, the versions of the tools a
stage runs in its address, and a dvc.lock that records the committed code
(mtpipe/pipeline/requirement_locks.py, mtpipe/pipeline/toolchain.py, mtpipe/pipeline/lock_check.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from packaging.utils import canonicalize_name

from mtpipe.data import embedded
from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, lock_check, requirement_locks, toolchain, view
from mtpipe.pipeline.toolchain import lock_pins
from pipeline import ROOT, copy_project, env
import families

pytestmark = pytest.mark.environment

LAPTOP = lock_pins(requirement_locks.LAPTOP_LOCK.read_text())
VM = lock_pins(requirement_locks.VM_LOCK.read_text())
MAXTEXT_STACK = {"maxtext", "jax", "jaxlib", "libtpu", "orbax-checkpoint", "flax", "optax", "google-tunix", "grain",
                 "transformers", "safetensors", "tokenizers", "numpy"}


def test_the_two_locks_pin_one_version_of_every_shared_package():
    shared = LAPTOP.keys() & VM.keys()
    assert len(shared) > 250
    assert {name: (LAPTOP[name], VM[name]) for name in shared if LAPTOP[name] != VM[name]} == {}
    assert toolchain.TOOLCHAIN <= shared, "an artifact-touching package is missing from one machine"
    # what the VM adds is its own: vLLM's stack and torch (the tutorial's TPU post-training extra)
    assert {"torch", "torchvision"} <= VM.keys() - LAPTOP.keys()


def test_this_environment_is_the_laptop_lock():
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    assert {name: (version, installed.get(name)) for name, version in LAPTOP.items()
            if installed.get(name) != version} == {}, "run `make` to install requirements.lock"


def test_the_installed_packages_carry_their_bytecode():
    """`make` compiles the venv's bytecode at install (uv --compile-bytecode): where
    PYTHONDONTWRITEBYTECODE=1 is set, a module without its .pyc is compiled from source in every
    process that imports it (docs/testing.md)."""
    sources = [Path(metadata.distribution(name).locate_file(module)) for name, module in (
        ("jax", "jax/_src/core.py"), ("maxtext", "maxtext/configs/types.py"), ("dvc", "dvc/repo/__init__.py"),
        ("transformers", "transformers/modeling_utils.py"))]   # found without importing them
    assert all(source.is_file() for source in sources), sources
    missing = [source for source in sources if not Path(importlib.util.cache_from_source(str(source))).is_file()]
    assert missing == [], "the venv was installed without its bytecode: run `make` (it recompiles what is missing)"


@pytest.mark.first_contact
def test_doit_prints_no_warning():
    """`doit list` as a user runs it (the venv's Python, no warning filter of the test run's): every doit
    command imports what it does here (dodo.py imports at the top). With grpcio 1.82.1 google-api-core
    and google-auth printed three FutureWarnings (six lines) on every command."""
    user_env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, "-m", "doit", "list"], cwd=ROOT, env=user_env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "vm_up" in proc.stdout, out
    assert not re.findall(r"\w*Warning\b|WARNING|Traceback", out), out


def test_each_view_records_the_versions_of_the_tools_its_stage_runs(tmp_path: Path):
    config.write_resolved(config.compose_all(families.load_params()), config.twin_confs(embedded.FAMILIES), tmp_path)
    tools = {(branch, stage): OmegaConf.load(config.resolved_path(branch, stage, tmp_path)).tools
             for branch, stages in [*config.BRANCH_STAGES.items(), ("embedded", ("make_embedded",))]
             for stage in stages}
    for (branch, stage), recorded in tools.items():
        assert all(LAPTOP[name] == version for name, version in recorded.items()), (branch, stage)
    for stage in ("to_maxtext", "to_huggingface"):  # the converters' code imports no tunix (only the trainers' patches do)
        assert MAXTEXT_STACK - {"google-tunix"} <= set(tools["sft", stage]), stage
        assert "google-tunix" not in tools["sft", stage], stage
    assert MAXTEXT_STACK <= set(tools["sft", "train_sft"])
    assert MAXTEXT_STACK <= set(tools["rl", "train_rl"])
    # the download runs the Hub client and reads parquet; it compiles nothing
    assert set(tools["sft", "hf_download"]) == {"huggingface-hub", "pyarrow"}
    # the twins' configs and tensor shapes come from MaxText's tables: MaxText and what it requires
    assert {"safetensors", "transformers", "pyarrow", "maxtext", "jax"} <= set(tools["embedded", "make_embedded"])


def test_a_stage_refuses_to_run_under_other_tool_versions(tmp_path: Path):
    """A view written for another environment (an upgraded lock not installed, a hand-made venv)
    stops the stage before any work: its outputs would be filed under the wrong versions."""
    config.write_resolved(config.compose_all(families.load_params()), config.twin_confs(embedded.FAMILIES), tmp_path)
    path = view.resolved_path("sft", "to_maxtext", tmp_path)
    cfg = OmegaConf.load(path)
    cfg.tools["orbax-checkpoint"] = "0.0.1"
    OmegaConf.save(cfg, path)
    with pytest.raises(ConfigError, match=rf"views/sft/to_maxtext.yaml: records other tool versions than installed "
                                          rf"\(orbax-checkpoint: 0.0.1 -> {LAPTOP['orbax-checkpoint']}\).*make"):
        view.load_stage("sft", "to_maxtext", tmp_path)


def test_preflight_names_a_compiler_that_is_not_the_vms(tmp_path: Path):
    other = tmp_path / "requirements-vm.lock"
    other.write_text(requirement_locks.VM_LOCK.read_text().replace(f"\nlibtpu=={VM['libtpu']} ", "\nlibtpu==0.0.1 "))
    assert f"libtpu {VM['libtpu']}: the TPU VM's" in preflight_line(requirement_locks.VM_LOCK)
    assert "NOT the TPU VM's (libtpu 0.0.1): run `make`" in preflight_line(other)


def preflight_line(vm_lock: Path) -> str:
    from mtpipe.planning import preflight
    return preflight.versions_line(vm_lock)


def test_the_record_about_to_be_committed_is_current(tmp_path: Path):
    """dvc.lock records the code, conf/, params and views as they are (what git would commit): the
    committed metrics and plots come from this code. Fails after an edit until `dvc repro` ran."""
    repo = copy_project(tmp_path / "repo", test_params=False)
    assert lock_check.stale_entries(repo) == [], lock_check.FIX


def test_a_stale_record_is_named_and_fails_the_check(tmp_path: Path):
    repo = copy_project(tmp_path / "repo", test_params=False)
    edits = {
        "mtpipe/maxtext/training_logs.py": ("\n\n\ndef ", "\n\n\nTOUCHED = 1\n\n\ndef "),
        "conf/hardware/cpu.yaml": ("\n", "\n# an edit\n"),
        "params.yaml": ("\nsteps: ", "\nsteps: 1"),
        "views/sft/train_sft.yaml": ("branch: sft\n", "branch: sft\nextra: 1\n"),
    }
    for path, (old, new) in edits.items():
        text = (repo / path).read_text()
        assert old in text, path
        (repo / path).write_text(text.replace(old, new, 1))
    assert sorted(lock_check.stale_entries(repo)) == ["configure: deps conf modified", "configure: deps mtpipe modified",
                     "configure: deps params.yaml steps modified", "configure: outs views/sft/train_sft.yaml modified",
                     "train_sft@sft: deps views/sft/train_sft.yaml modified"]
    proc = subprocess.run([sys.executable, "-m", "mtpipe.pipeline.lock_check"], cwd=repo, env=env() | {
        "PYTHONPATH": str(repo)}, capture_output=True, text=True)
    assert proc.returncode == 1 and "configure: deps mtpipe modified" in proc.stderr and "dvc repro" in proc.stderr
