"""The control plane runs from its own light environment (requirements-control.lock, `make control`):
doit's VM tasks and DVC without JAX, libtpu or MaxText's stack, so any laptop can drive the TPU.

A fresh venv is made from the lock (uv's cache only: tests/prefetch.py fills it before the suite) and
doit runs in it against the fakes; the checks that need MaxText's code say so there (the values passed
to MaxText are then checked by configure, the first stage on the VM; preflight's compile by a full
environment)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import families
import pytest
from fakes.hf_server import HubServer
from vm_world import ROOT, Env, assert_deleted, hub_with_tutorial_repos

from mtpipe.pipeline import requirement_locks
from mtpipe.pipeline.toolchain import lock_pins

pytestmark = pytest.mark.first_hour


def test_the_control_lock_is_the_laptops_versions_without_maxtexts_stack() -> None:
    """Made from pyproject.toml's pins as `make lock` makes it (its header names the inputs), at the
    laptop lock's versions, universal, with MaxText but none of what MaxText needs to run."""
    text = requirement_locks.CONTROL_LOCK.read_text()
    control, laptop = lock_pins(text), lock_pins(requirement_locks.LAPTOP_LOCK.read_text())
    assert f"#   {' '.join(requirement_locks.control_requirements())}\n" in text, "run `make lock`"
    assert "resolved --universal, checked for x86_64-manylinux_2_35 aarch64-apple-darwin" in text
    # every package the laptop also installs at its version; the others are Windows' (the lock is universal)
    assert {name for name, version in control.items() if laptop.get(name) != version} == {"pywin32", "tzdata"}
    assert control["maxtext"] == requirement_locks.maxtext_version()
    assert not {"jax", "jaxlib", "libtpu", "google-tunix", "transformers", "torch", "lm-eval"} & control.keys()


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The python of a fresh venv holding exactly requirements-control.lock."""
    venv = tmp_path_factory.mktemp("control") / "venv"
    uv = str(requirement_locks.uv())
    env = {**os.environ, "UV_OFFLINE": "1",
           "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))}
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], env=env, check=True)
    subprocess.run([uv, "pip", "sync", "--quiet", "--require-hashes", "--python", str(venv / "bin" / "python"),
                    str(requirement_locks.CONTROL_LOCK)], env=env, check=True)
    yield venv / "bin" / "python"


def doit(python: Path, w: Env, *args: str) -> subprocess.CompletedProcess:
    """doit in the light venv, in the world's repo, with the world's environment."""
    env = {**w.env, "PYTHONPATH": str(ROOT), "PATH": f"{python.parent}:/usr/bin:/bin"}
    return subprocess.run([str(python), "-m", "doit", "-f", str(ROOT / "dodo.py"), "-d", str(w.repo), *args],
                          cwd=w.repo, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_light_environment_has_no_jax_and_lists_the_tasks(light: Path, world: Env) -> None:
    for module in ("jax", "jaxlib", "libtpu", "tunix", "transformers", "torch"):
        proc = subprocess.run([str(light), "-c", f"import {module}"], capture_output=True, text=True)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, module
    listed = doit(light, world, "list")
    assert listed.returncode == 0 and "vm_run" in listed.stdout and "preflight" in listed.stdout, listed.stderr
    helped = doit(light, world, "help", "vm_run")
    assert helped.returncode == 0 and "--keep" in helped.stdout and "--yes" in helped.stdout, helped.stderr


@pytest.mark.slow
def test_vm_run_from_the_light_environment(light: Path, world: Env) -> None:
    """The embedded default on the loopback VM: checks, the question answered by --yes, the run, the
    deletion; nothing of the laptop's side imports JAX."""
    w = world
    w.configure(run__command='echo run >> "$HOME/runs"')
    proc = doit(light, w, "vm_run", "--yes")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "about to create ct6e-standard-8t VM mt-test" in proc.stdout and "VM mt-test: deleted" in proc.stdout
    assert (w.sshd.home / "runs").read_text() == "run\n"
    assert_deleted(w)


@pytest.mark.first_run
def test_preflight_of_the_sft_tutorial_answers_without_jax(light: Path, tmp_path: Path) -> None:
    """No compile: the SFT tutorial's committed result (mtpipe/planning/compiled/) gives the HBM per
    chip and its fit, the step time and the whole run's price, the row preflight prints with MaxText
    (tests/planning/test_compiled_presets.py)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text(families.committed_params_text())
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    env = {"HOME": str(tmp_path), "PYTHONPATH": str(ROOT), "PATH": f"{light.parent}:/usr/bin:/bin"}
    proc = subprocess.run([str(light), "-m", "doit", "-f", str(ROOT / "dodo.py"), "-d", str(repo), "preflight",
                           "--set=sft.preset=gemma3-4b-ultrachat-v6e8"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "compile result committed (mtpipe/planning/compiled/sft-gemma3-4b-ultrachat-v6e8.json)" in out, out
    head, row = next(lines for lines in zip(out.splitlines(), out.splitlines()[1:]) if lines[0].startswith("branch"))
    cells = dict(zip(re.split(r"\s{2,}", head), re.split(r"\s{2,}", row)))
    hbm, available = (float(v.split()[0]) for v in cells["HBM GiB/chip"].split(" / "))
    assert cells["preset"] == "gemma3-4b-ultrachat-v6e8" and cells["TPU"] == "v6e-8" and cells["fits"] == "yes"
    assert 0 < hbm < available == 31.25 and float(cells["step s"].split()[0]) > 0, row
    total = re.search(r"^total: about [\d.]+ h \([\d.]+-[\d.]+ h\), ([\d.]+) USD", out, re.M)
    assert total and float(total.group(1)) > 0, out
    assert "compiled with maxtext" in out and "the TPU VM's (requirements-vm.lock)" in out


@pytest.mark.slow
def test_a_tutorial_run_without_a_compile_says_where_to_compile(light: Path, world: Env, tmp_path: Path) -> None:
    """A TPU preset of a shape no committed result holds (mtpipe/planning/compiled/: the tutorials' own)
    needs preflight's compile, which the light environment cannot run: vm_run stops
    before anything exists and names both ways on. With --no-preflight the checks before spending pass
    and the machine budget is computed from MaxText's config files (in the lock, without MaxText's
    dependencies) against the VM's RAM, read after the setup. The loopback VM is this machine: with
    less than about 30 GB of RAM the 4B export's host memory does not fit and the run stops there,
    naming the key; with more it runs run.command. Either way the VM is deleted."""
    w = world
    w.configure(run__command='echo run >> "$HOME/runs"')
    with HubServer(tmp_path / "hub") as hub:
        hub_with_tutorial_repos(hub)
        w.env.update(HF_ENDPOINT=hub.url, HF_TOKEN=hub.gated["google/gemma-3-4b-it"])
        sets = "--set=sft.preset=gemma3-4b-ultrachat-v6e8"
        refused = doit(light, w, "vm_run", "--yes", sets, "--set=sft.train_sft.per_device_batch_size=2",
                       "--target=evaluate@sft")
        assert refused.returncode != 0
        assert ("ConfigError: preflight: the sft branch's step (gemma3-4b-ultrachat-v6e8 on v6e-8) is not compiled "
                "yet (the committed mtpipe/planning/compiled/sft-gemma3-4b-ultrachat-v6e8.json is of another shape, "
                "per_device_batch_size=1 there, 2 here), and this environment (requirements-control.lock: no JAX, "
                "no MaxText) cannot compile it") in refused.stdout + refused.stderr
        assert w.fake.inserts() == []
        ran = doit(light, w, "vm_run", "--yes", sets, "--target=evaluate@sft", "--no-preflight")
    out = ran.stdout + ran.stderr
    assert "machine budget of sft on one v6e-8 VM" in out and "host memory (during to_huggingface@sft)" in out, out
    stopped = "ConfigError: sft.train_sft.max_num_checkpoints_to_keep: the run needs" in out
    assert (ran.returncode != 0) == stopped and (stopped or (w.sshd.home / "runs").read_text() == "run\n"), out
    assert len(w.fake.inserts()) == 1 and "VM mt-test: deleted" in out
    assert_deleted(w)
