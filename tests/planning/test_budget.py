"""The machine budget (mtpipe/planning/budget.py): disk peaks per file system and host memory of a
run on its TPU VM, before the VM exists; and its forecast against what the embedded default wrote.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mtpipe.cloud.settings import vm_config
from mtpipe.errors import ConfigError
from mtpipe.maxtext.run_dir import run_dir
from mtpipe.pipeline import generations, overrides
from mtpipe.pipeline.config import ROOT, compose, stage_view
from mtpipe.pipeline.maxtext_check import compose_checked
from mtpipe.planning import aot, budget, preflight
import families

pytestmark = [pytest.mark.checks, pytest.mark.first_contact]

TUTORIALS = ["sft.preset=gemma3-4b-ultrachat-v6e8", "rl.preset=llama3.1-8b-gsm8k-v6e8"]
FIXTURES = {"google/gemma-3-4b-it": ("gemma-3-4b-it", "gemma3-4b"),
            "meta-llama/Llama-3.1-8B-Instruct": ("Llama-3.1-8B-Instruct", "llama3.1-8b")}
SHM_ENV = {"MTPIPE_WORK_DIR": "/dev/shm/mtpipe-work"}


def budget_of(sets: list[str], machine: budget.Machine, tmp_path: Path) -> dict | None:
    """preflight's machine budget of params.yaml + ``sets`` (refusing what does not fit)."""
    params = overrides.apply_sets(families.committed_params_text().encode(), sets)
    composed = {b: compose_checked(b, params) for b in ("sft", "rl")}
    views = {b: stage_view(cfg, aot.trainer_of(b).stage) for b, cfg in composed.items()}
    return preflight.machine_budget(composed, views, machine, ROOT, tmp_path, refuse=True)


def test_hub_model_sizes_are_the_published_indexes() -> None:
    """HUB_MODELS against tests/fixtures/ (the Hub indexes' tensor inventories and total_size)."""
    for repo_id, (fixture, maxtext_name) in FIXTURES.items():
        index = json.loads((ROOT / "tests" / "fixtures" / fixture / "tensors.json").read_text())
        lm = {k: v for k, v in index["tensors"].items() if budget.is_language_model(k)}
        hub = budget.HUB_MODELS[repo_id]
        assert hub.total_bytes == index["total_size"]
        assert hub.lm_params == sum(math.prod(shape) for _, shape in lm.values())
        assert hub.lm_arrays == budget.maxtext_arrays(list(lm), maxtext_name)


def test_the_shipped_tutorial_presets_fit_their_vm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture) -> None:
    """Both tutorials on one v6e-8 with conf/vm.yaml as shipped: run directories on /dev/shm, the
    latest checkpoint kept; every place keeps its margin free."""
    monkeypatch.delenv("MTPIPE_VM_CONFIG", raising=False)
    machine = vm_config.budget_machine(vm_config.load_config())
    assert machine.env == SHM_ENV
    rep = budget_of(TUTORIALS, machine, tmp_path)
    assert rep == json.loads((tmp_path / "budget.json").read_text())
    lines = capsys.readouterr().out
    places = rep["places"]
    assert set(places) == {budget.BOOT, budget.SHM, "host memory"} and all(p["fits"] for p in places.values())
    assert places[budget.BOOT]["capacity_gb"] == machine.boot_disk_gb
    # Gemma 3 4B: 3.88e9 params x (f32 weights + f32 Adam mu and nu) = 46.6 GB per checkpoint; the
    # latest kept, so at most 2 while the newer is written. Llama 3.1 8B: 8.03e9 x (bf16 x 3) = 48.2 GB.
    runs = {i["stage"]: i for i in rep["items"] if i["where"] == budget.SHM}
    assert runs["train_sft@sft"]["gb"] == pytest.approx(2 * 46.6, rel=0.01)
    assert runs["train_rl"]["gb"] == pytest.approx(2 * 48.2, rel=0.01)
    assert places[budget.SHM]["peak_gb"] == pytest.approx(96.4, rel=0.01)
    for place in ("boot disk", "/dev/shm", "host memory"):
        assert place in lines
    # the VM's RAM in Google's VM-type table (1,440 GB), not the host's 1,536 GiB; /dev/shm half of it
    assert f"{places[budget.BOOT]['capacity_gb']:.0f}" in lines and "720" in lines and "1440" in lines


@pytest.mark.first_request
def test_a_vm_with_less_than_the_table_fails_the_budget_naming_the_fix(tmp_path: Path) -> None:
    """The budget before the VM exists uses Google's VM-type table (ct6e-standard-8t: 1,440 GB of RAM,
    /dev/shm half of it); what the VM says after the setup replaces it: a /dev/shm mounted at 64 GB
    cannot hold the tutorials' run directories (96.4 GB at the peak), with the keys and the remount."""
    host = budget.host_of("v6e-8")
    assert (host.memory_gib * 2**30, host.shm_gib * 2**30) == (1440e9, 720e9)
    shipped = budget.Machine(200, SHM_ENV, "v6e-8")
    measured = budget.Host(memory_gib=1340.0, shm_gib=64.0, source="read on VM mt-test after the setup")
    budget_of(TUTORIALS, budget.Machine(200, SHM_ENV, "v6e-8", budget.Host(1340.0, 670.0, "read")), tmp_path)
    assert budget_of(TUTORIALS, shipped, tmp_path)["source"] == host.source
    with pytest.raises(ConfigError) as err:
        budget_of(TUTORIALS, budget.Machine(200, SHM_ENV, "v6e-8", measured), tmp_path)
    assert err.value.key == "sft.train_sft.max_num_checkpoints_to_keep"
    assert "needs 96 GB of the v6e-8 VM's /dev/shm at its peak, which holds 69 GB (read on VM mt-test" in str(err.value)
    assert "MTPIPE_WORK_BUCKET" in err.value.fix and "sudo mount -o remount,size=SIZE /dev/shm" in err.value.fix


def test_every_checkpoint_kept_on_the_boot_disk_is_refused_before_anything_compiles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint_period 50 of 1000 steps, all kept (21 checkpoints of 46.6 GB), run directories on
    the 200 GB boot disk: refused naming the key, before the AOT compile (and so before any VM)."""
    (tmp_path / "params.yaml").write_text(families.committed_params_text())
    monkeypatch.setattr(preflight, "compile_step", lambda *a: pytest.fail("compiled a run that cannot fit"))
    sets = [TUTORIALS[0], "sft.train_sft.checkpoint_period=50", "sft.train_sft.max_num_checkpoints_to_keep=21"]
    with pytest.raises(ConfigError) as err:
        preflight.run(sets, 2.70, budget.Machine(200, {}), tmp_path)
    assert err.value.key == "sft.train_sft.max_num_checkpoints_to_keep"
    assert "boot disk" in err.value.problem and "21 of 21 checkpoints" in err.value.problem
    for key in ("sft.train_sft.checkpoint_period", "MTPIPE_WORK_DIR", "boot_disk_gb"):
        assert key in err.value.fix
    # the fix it names: the preset's latest-only checkpoint, and the same period fits the boot disk
    budget_of(sets[:2], budget.Machine(200, {}), tmp_path)


def test_run_directories_on_dev_shm_are_refused_past_the_host_memory(tmp_path: Path) -> None:
    """/dev/shm is host memory: every checkpoint of a 20-step period kept there does not fit."""
    sets = [TUTORIALS[1], "rl.train_rl.max_num_checkpoints_to_keep=50", "rl.train_rl.num_batches=100",
            "+rl.train_rl.extra_args.checkpoint_period=2"]
    with pytest.raises(ConfigError) as err:
        budget_of(sets, budget.Machine(200, SHM_ENV), tmp_path)
    assert err.value.key == "rl.train_rl.max_num_checkpoints_to_keep" and "/dev/shm" in err.value.problem
    assert "MTPIPE_WORK_BUCKET" in err.value.fix


def test_checkpoints_written_and_held() -> None:
    """Orbax saves the first step, every period and the last; it holds the kept ones plus the one
    being written."""
    assert [budget.saves(steps, period) for steps, period in ((150, 50), (400, 400), (1000, 200), (16, 50))] == \
        [4, 2, 6, 2]


def test_run_directories_follow_mtpipe_work_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MTPIPE_WORK_DIR moves local run directories (and their scratch files); final params leave
    them for the checkout even from another file system (shutil.move); a relative path is refused."""
    monkeypatch.delenv("MTPIPE_WORK_BUCKET", raising=False)
    monkeypatch.setenv("MTPIPE_WORK_DIR", str(tmp_path / "shm"))
    run = run_dir("train_sft", "r1")
    assert run.url == str(tmp_path / "shm" / "train_sft" / "r1")
    assert run.scratch == tmp_path / "shm" / "train_sft" / "r1"
    monkeypatch.setenv("MTPIPE_WORK_DIR", "shm")
    with pytest.raises(ConfigError, match="MTPIPE_WORK_DIR"):
        run_dir("train_sft", "r1")


@pytest.mark.slow
def test_forecast_bytes_are_what_each_stage_wrote(pipeline_repo: Path) -> None:
    """The budget of the embedded default against `du -sb` of each stage's output in the shared
    pipeline (DVC's cache hardlinks them: counted once), within 10%."""
    params = overrides.apply_sets((pipeline_repo / "params.yaml").read_bytes(), [])
    stages = {b: {s: stage_view(compose(b, params), s) for s in preflight.BUDGET_STAGES[b]} for b in ("sft", "rl")}
    place = budget.Placement(budget.BOOT, dvc_links=budget.dvc_cache_links(pipeline_repo))
    assert place.dvc_links
    plan = budget.plan(stages, place, None, pipeline_repo)
    forecast = {i.stage: i.bytes for i in plan.items if i.where == budget.BOOT and not i.transient}
    outputs = {"hf_download@sft": ["sft/model", "sft/dataset"], "to_maxtext@sft": ["sft/maxtext"],
               "train_sft@sft": ["sft/trained"], "to_huggingface@sft": ["sft/hf"],
               "hf_download@rl": ["rl/model", "rl/dataset"], "to_maxtext@rl": ["rl/maxtext"],
               "train_sft@rl": ["rl/warmup"], "train_rl": ["rl/trained"], "to_huggingface@rl": ["rl/hf"]}
    measured = {stage: sum(budget.tree_bytes(pipeline_repo / "artifacts" / d) for d in dirs)
                for stage, dirs in outputs.items()}
    print("\nstage  forecast  du -sb  ratio")
    for stage, du in measured.items():
        print(f"{stage}  {forecast[stage]}  {du}  {forecast[stage] / du:.3f}")
    assert {s: round(forecast[s] / du, 2) for s, du in measured.items() if abs(forecast[s] / du - 1) > 0.10} == {}
    # counted once: the outputs are hardlinks into DVC's cache, not copies
    weights = next((pipeline_repo / "artifacts" / "sft" / "hf").glob("*.safetensors"))
    assert weights.stat().st_nlink >= 2


@pytest.mark.slow
def test_sft_keeps_max_num_checkpoints_to_keep(tmp_path: Path) -> None:
    """Adapter patch 11, as `apply` sets it up for train_sft (in a child process: it patches tunix):
    the checkpoint manager the trainer makes gets max_num_checkpoints_to_keep as Orbax's max_to_keep
    (unpatched: None, every checkpoint kept)."""
    code = f"""
import orbax.checkpoint as ocp
from tunix.sft import checkpoint_manager
from mtpipe.maxtext.adapter import training

def options():
    manager = checkpoint_manager.CheckpointManager({str(tmp_path)!r}, ocp.CheckpointManagerOptions(save_interval_steps=50))
    return manager._checkpoint_manager._options

print(options().max_to_keep)
training.apply(training.SFT.module, ["steps=100", "max_num_checkpoints_to_keep=2"])
print(options().save_interval_steps, options().max_to_keep)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["None", "50", "2"], out.stdout


def test_a_v5e_vm_runs_the_tutorials_on_its_own_tpu(tmp_path: Path) -> None:
    """conf/hardware/v5e-8.yaml: the VM's accelerator type v5litepod-8 is MaxText's v5e-8 for the
    compile and the budget, 8 chips of 15.75 GiB at v5e's price; a VM config of another TPU is refused
    naming vm.machine_type, before anything compiles."""
    params = overrides.apply_sets(families.committed_params_text().encode(), [TUTORIALS[0], "sft.hardware=v5e-8"])
    view = stage_view(compose_checked("sft", params), "train_sft")
    assert preflight.topology(view) == "v5litepod-8" and preflight.maxtext_topology("v5litepod-8") == "v5e-8"
    chip, chips = preflight.chip_of(preflight.topology(view), "sft", "v5e-8")
    assert (chip, chips) == (generations.load()["v5e"].chip, 8) and chip.hbm_gib == 15.75
    args = aot.compile_args(aot.stage_command(view), preflight.maxtext_topology(preflight.topology(view)))
    assert "compile_topology=v5e-8" in args
    from maxtext.utils.accelerator_to_spec_map import get_system_characteristics
    assert get_system_characteristics("v5e-8").chips_per_host_bounds[:2] == (2, 2)  # MaxText's name: no ValueError
    v5e_vm = vm_config.load_config({"machine_type": "ct5lp-hightpu-8t", "boot_disk_type": "pd-balanced",
                                    "provisioning": "on-demand"})
    machine = vm_config.budget_machine(v5e_vm)
    assert machine.tpu == "v5e-8"
    rep = budget_of([*TUTORIALS, "sft.hardware=v5e-8", "rl.hardware=v5e-8"], machine, tmp_path)
    assert rep["topology"] == "v5e-8" and rep["places"]["host memory"]["capacity_gb"] == pytest.approx(384, abs=1)
    with pytest.raises(ConfigError) as err:
        budget_of([TUTORIALS[0], "sft.hardware=v5e-8"], budget.Machine(200, {}, "v6e-8"), tmp_path)
    assert err.value.key == "vm.machine_type" and "sft.hardware (v5e-8) runs on a v5e-8" in err.value.problem
    assert "conf/hardware/v5e-8.yaml" in err.value.fix


@pytest.mark.address
def test_run_directories_earlier_runs_left_are_counted_for_the_whole_run(tmp_path: Path, monkeypatch) -> None:
    """A reused VM: the run directories killed runs left (in the checkout's work/ and in MTPIPE_WORK_DIR
    on /dev/shm) are read on it and count against each place for the whole run. The tutorials fit a
    120 GB /dev/shm (96.4 GB at the peak) but not with 30 GB left there; the error names the collector."""
    from omegaconf import OmegaConf

    from mtpipe.cloud.checks import host

    shm = Path("/dev/shm") / f"mtpipe-test-{tmp_path.name}"
    (tmp_path / "home" / "mtpipe" / "work" / "train_rl" / "train_rl-000000000001").mkdir(parents=True)
    (tmp_path / "home" / "mtpipe" / "work" / "train_rl" / "train_rl-000000000001" / "w").write_bytes(b"w" * 50_000)
    (shm / "train_sft" / "train_sft-sft-000000000002").mkdir(parents=True)
    try:
        (shm / "train_sft" / "train_sft-sft-000000000002" / "w").write_bytes(b"w" * 20_000)
        cfg = OmegaConf.create({"name": "mt-test", "run": {"remote_dir": "mtpipe", "env": {"MTPIPE_WORK_DIR": str(shm)}}})
        monkeypatch.setattr(host, "run", lambda _remote, script, stream: (0, subprocess.run(
            ["bash", "-c", script], env={"HOME": str(tmp_path / "home"), "PATH": "/usr/bin:/bin"},
            capture_output=True, check=True).stdout))
        read = host.read_host(None, cfg)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert 50_000 <= read.left[budget.BOOT] < 70_000 and 20_000 <= read.left[budget.SHM] < 40_000
    assert read.memory_gib > 0 and read.shm_gib > 0

    fits = budget.Host(1340.0, 120e9 / 2**30, "read on VM mt-test after the setup")
    assert budget_of(TUTORIALS, budget.Machine(200, SHM_ENV, "v6e-8", fits), tmp_path)["places"][budget.SHM]["fits"]
    left = budget.Host(1340.0, 120e9 / 2**30, "read on VM mt-test after the setup", left={budget.SHM: 30 * 10**9})
    with pytest.raises(ConfigError) as err:
        budget_of(TUTORIALS, budget.Machine(200, SHM_ENV, "v6e-8", left), tmp_path)
    assert "needs 126 GB of the v6e-8 VM's /dev/shm at its peak" in str(err.value)
    assert "left behind: run directories of earlier runs" in str(err.value) and "collect_runs --delete" in str(err.value)
