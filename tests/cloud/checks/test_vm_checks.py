"""The checks before spending (mtpipe/cloud/checks/): each fails before anything billable is created.

`doit vm_up` / `doit vm_run` run in process against the fake Compute API, with the GCS emulator as
the DVC remote and the loopback Hub for gated models. Every failing check is asserted to stop the
task before any instances.insert (or firewalls.insert) reaches the fake. Anything not on loopback
goes to a dead proxy port.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from doit.doit_cmd import DoitMain
from fakes.fake_compute import FakeCompute, Reservation, running_fake
from fakes.gcs_emulator import GCS_TEST_ENV, GcsEmulator
from fakes.hf_server import HubServer

from mtpipe.cloud.checks.project import check_hub_tokens, check_remote_writable, composed_branches
from mtpipe.cloud.providers.gcp.api_errors import ENDPOINT_ENV
from mtpipe.cloud.settings import vm_config, vm_state

from mtpipe.errors import ConfigError
from mtpipe.pipeline import generations
from mtpipe.planning import aot, preflight, step_model
import families
from vm_world import as_script, hub_with_tutorial_repos

pytestmark = [pytest.mark.checks, pytest.mark.vm_experiments]

ROOT = Path(__file__).resolve().parents[3]
TARGET = {"PROJECT": "proj-1", "ZONE": "us-east5-b", "RESERVATION": "v6e-res", "NAME": "mt-test"}
SFT_TUTORIAL = "--set=sft.preset=gemma3-4b-ultrachat-v6e8"


@dataclass
class World:
    fake: FakeCompute
    repo: Path
    emulator: GcsEmulator

    def doit(self, *args: str) -> str:
        """Run doit in `repo`, expect it to fail, return what it printed."""
        out, cwd = io.StringIO(), os.getcwd()
        report = self.repo.parent / "doit-report.txt"
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                rc = DoitMain().run(["-f", str(ROOT / "dodo.py"), "-d", str(self.repo),
                                     "--output-file", str(report), *as_script(args)])
            finally:
                os.chdir(cwd)
        text = out.getvalue() + report.read_text()
        assert rc != 0, text
        return text

    def nothing_created(self) -> None:
        assert self.fake.inserts() == [] and self.fake.calls("POST", "/global/firewalls") == []
        assert not (self.repo / vm_state.STATE_FILE).exists()

    def remote_url(self, url: str, endpoint: str | None = None) -> None:
        """Point the committed default remote elsewhere."""
        config = self.repo / ".dvc" / "config"
        text = config.read_text().replace(f"gs://{self.emulator.bucket}/dvc", url)
        config.write_text(text.replace(self.emulator.endpoint, endpoint or self.emulator.endpoint))
        _git(self.repo, "commit", "-qam", "remote")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.fixture
def world(tmp_path: Path, gcs_emulator: GcsEmulator,
          monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A committed project skeleton (params.yaml, the v6e-8 hardware preset, a DVC remote on the
    emulator) and the environment doit sees."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST", "HF_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for key, value in {**TARGET, **GCS_TEST_ENV, "DVC_GLOBAL_CONFIG_DIR": str(tmp_path / "dvc-global"),
                       "DVC_SITE_CACHE_DIR": str(tmp_path / "dvc-site"), "HF_HUB_DISABLE_TELEMETRY": "1",
                       "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
                       "NO_PROXY": "127.0.0.1,localhost"}.items():
        monkeypatch.setenv(key, value)
    overlay = tmp_path / "vm.yaml"
    overlay.write_text(f"ssh: {{key_file: {tmp_path / 'id'}, ready_timeout_s: 1}}\n"
                       "firewall: {source_ranges: [127.0.0.1/32]}\n")
    monkeypatch.setenv(vm_config.CONFIG_ENV, str(overlay))
    repo = tmp_path / "repo"
    (repo / "conf" / "hardware").mkdir(parents=True)
    shutil.copy(ROOT / "conf" / "hardware" / "v6e-8.yaml", repo / "conf" / "hardware")
    (repo / "params.yaml").write_text(families.committed_params_text())
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=repo, check=True)
    (repo / ".dvc").mkdir()   # what `dvc init` makes that matters here, without its 2 s start-up
    (repo / ".dvc" / ".gitignore").write_text("/config.local\n/tmp\n/cache\n")
    (repo / ".dvc" / "config").write_text(
        f"[core]\n    remote = gcs\n    analytics = false\n['remote \"gcs\"']\n"
        f"    url = gs://{gcs_emulator.bucket}/dvc\n    endpointurl = {gcs_emulator.endpoint}\n"
        f"    allow_anonymous_login = true\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "init")
    with running_fake() as fake:
        monkeypatch.setenv(ENDPOINT_ENV, fake.url)
        yield World(fake, repo, gcs_emulator)


# ---------------------------------------------------------------- Compute


def test_zone_without_v6e(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZONE", "us-west2-a")
    out = world.doit("vm_up")
    assert "vm.zone: zone 'us-west2-a' does not offer ct6e-standard-8t (TPU v6e (Trillium))" in out
    world.nothing_created()


def test_unknown_reservation(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESERVATION", "unknown-res")
    out = world.doit("vm_run")
    assert "vm.reservation: no reservation 'unknown-res' in proj-1/us-east5-b" in out
    assert "gcloud compute reservations list" in out
    world.nothing_created()


def test_full_reservation(world: World) -> None:
    world.fake.reservations["v6e-res"] = Reservation(count=1, in_use=1)
    out = world.doit("vm_up")
    assert "vm.reservation: v6e-res has no free VM (1 of 1 VMs in use)" in out
    world.nothing_created()


def test_reservation_of_another_machine_type(world: World) -> None:
    world.fake.reservations["v6e-res"] = Reservation(machine_type="n2-standard-8")
    out = world.doit("vm_up")
    assert "vm.reservation: v6e-res reserves n2-standard-8, not ct6e-standard-8t" in out
    world.nothing_created()


# ---------------------------------------------------------------- the project


def test_preset_must_pass_configure(world: World) -> None:
    out = world.doit("vm_run", "--set=+sft.train_sft.stepz=5")   # a key no preset has
    assert "ConfigError: sft.train_sft.stepz" in out     # the key, as params.yaml spells it
    world.nothing_created()
    out = world.doit("vm_run", "--set=sft.train_sft.stepz=5")    # `dvc exp run -S` refuses it
    assert "--set: sft.train_sft.stepz=5: Could not override 'sft.train_sft.stepz'" in out
    world.nothing_created()
    out = world.doit("vm_run", "--set=sft.preset=no-such-preset")
    assert "ConfigError: sft.preset" in out and "no-such-preset" in out
    world.nothing_created()


def test_set_outside_params_yaml(world: World) -> None:
    out = world.doit("vm_run", "--set=other.yaml:steps=5")
    assert "--set: sets values in ['other.yaml']" in out
    world.nothing_created()


def test_uncommitted_params(world: World) -> None:
    _git(world.repo, "rm", "-q", "params.yaml")
    _git(world.repo, "commit", "-qm", "no params")
    out = world.doit("vm_up")
    assert "params.yaml: is not committed" in out
    world.nothing_created()


def test_gated_model_needs_hf_token(world: World, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with HubServer(tmp_path / "hub") as hub:
        hub_with_tutorial_repos(hub)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        out = world.doit("vm_run", SFT_TUTORIAL)
        assert "HF_TOKEN: google/gemma-3-4b-it (sft.model) is gated (manual) and HF_TOKEN is not set" in out
        world.nothing_created()
        # With the granted token the same presets pass (the Hub's auth check says the token's account
        # may download the gated model); the open dataset never needed one.
        monkeypatch.setenv("HF_TOKEN", hub.gated["google/gemma-3-4b-it"])
        branches = composed_branches(world.repo, [SFT_TUTORIAL.removeprefix("--set=")])
        check_hub_tokens(branches.values())
        asked = {r.path.split("?")[0] for r in hub.requests}
    assert asked == {f"/api/models/google/gemma-3-4b-it/revision/{branches['sft'].model.source.revision}",
                     "/api/models/google/gemma-3-4b-it/auth-check",   # the token's account may download it
                     f"/api/datasets/HuggingFaceH4/ultrachat_200k/revision/"
                     f"{branches['sft'].dataset.source.revision}"}


def test_remote_bucket_missing(world: World) -> None:
    world.remote_url("gs://no-such-bucket/dvc")
    out = world.doit("vm_up")
    assert "remote.gcs.url: gs://no-such-bucket/dvc is not writable" in out
    world.nothing_created()


def test_remote_endpoint_dead(world: World, tmp_path: Path) -> None:
    """A dead endpoint fails in seconds (a connection first, not gcsfs's retries of most of a minute)."""
    world.remote_url(f"gs://{world.emulator.bucket}/dvc", endpoint="http://127.0.0.1:9")
    out = world.doit("vm_up")
    assert "remote.gcs.url: gs://mtpipe-test/dvc is not writable (OSError: cannot reach http://127.0.0.1:9" in out
    world.nothing_created()


def test_no_default_remote(world: World) -> None:
    (world.repo / ".dvc" / "config").write_text("[core]\n    analytics = false\n")
    _git(world.repo, "commit", "-qam", "no remote")
    out = world.doit("vm_up")
    assert "core.remote: no default DVC remote" in out
    world.nothing_created()


def test_writable_remote_passes_and_leaves_nothing(world: World) -> None:
    def stored(deleted: bool) -> set[Path]:
        """The emulator's objects: live ones, or the soft-deleted copies it keeps."""
        return {p for p in world.emulator.data_dir.rglob("*") if p.is_file()
                and ("_softdelete" in p.parts) == deleted and (deleted or ".cloudstorage" not in p.parts)}

    live, deleted = stored(False), stored(True)
    check_remote_writable(world.repo, timeout_s=30)
    assert stored(False) == live                    # nothing left behind ...
    assert len(stored(True) - deleted) == 1         # ... after one object was written and deleted


def test_check_project_errors_are_config_errors(world: World) -> None:
    with pytest.raises(ConfigError, match=r"^--set: steps=\[unclosed: no viable alternative"):
        composed_branches(world.repo, ["steps=[unclosed"])


@pytest.mark.preflight
def test_preset_that_does_not_fit_creates_nothing(world: World, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """vm_run runs preflight after the quick checks: a step too large for the chips' HBM stops it.

    The compile result comes from preflight's own cache, planted under the digest of the exact
    arguments (a real full-size compile takes 10+ minutes: benchmarks/preflight_full.py)."""
    sets = ["sft.preset=gemma3-4b-ultrachat-v6e8", "sft.train_sft.per_device_batch_size=64"]
    with HubServer(tmp_path / "hub") as hub:
        hub_with_tutorial_repos(hub)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", hub.gated["google/gemma-3-4b-it"])
        plant_compile(world, sets, temp_gib=300, tflops_per_device=6000.0)
        out = world.doit("vm_run", *(f"--set={s}" for s in sets))
    assert "sft.train_sft.per_device_batch_size: preset gemma3-4b-ultrachat-v6e8 needs" in out, out
    world.nothing_created()


def plant_compile(world: World, sets: list[str], temp_gib: float, tflops_per_device: float) -> None:
    """A compile result of the sft branch in preflight's own cache, under the digest of the exact
    arguments (a real full-size compile takes 10+ minutes: benchmarks/preflight_full.py)."""
    cmd = aot.stage_command(composed_branches(world.repo, sets)["sft"])
    args = aot.compile_args(cmd, "v6e-8")
    cache = world.repo / "work" / "preflight" / f"{aot.compile_digest(cmd.module, args)}.json"
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({
        "param_count": 4_300_000_000, "param_bytes": 8_600_000_000, "tflops_per_device": tflops_per_device,
        "config": {"steps": 1000}, "memory": {"argument_size_in_bytes": 6 * 2**30,
                                              "temp_size_in_bytes": int(temp_gib * 2**30),
                                              "generated_code_size_in_bytes": 0}}))


@pytest.mark.first_request
@pytest.mark.preflight
def test_spot_run_without_a_work_bucket_is_refused_with_what_a_preemption_costs(
        world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Spot run whose checkpoints would go with a preempted VM stops before anything is created,
    naming the key, the one that accepts it, and each preemption's cost by preflight's forecast (the
    compile planted: 100 TFLOP per chip and step at v6e's fitted share of 918 TFLOP/s, 4.3 B parameters'
    HBM traffic and FSDP's collectives (mtpipe.planning.step_model), 1000 steps at the chip's wall-clock
    factor + 180 s start-up + 5 checkpoint saves (the preset's checkpoint_period 200), 8 chips x 1.215 USD
    Spot in us-east5), read from preflight's cache before any compile; vm_up, whose branches have no
    compile cached, says so."""
    monkeypatch.delenv("RESERVATION")
    sets = ["sft.preset=gemma3-4b-ultrachat-v6e8"]
    with HubServer(tmp_path / "hub") as hub:
        hub_with_tutorial_repos(hub)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", hub.gated["google/gemma-3-4b-it"])
        plant_compile(world, sets, temp_gib=4.5, tflops_per_device=100.0)
        out = world.doit("vm_run", "--provisioning=spot", *(f"--set={s}" for s in sets))
        # bf16 weights: 32 B per parameter gathered on every chip, the rest of the traffic sharded over 8;
        # the collectives 7/8 x (2 x 2 + 4) B per parameter at 400 GB/s of ICI
        step_s = (100 / (918 * generations.load()["v6e"].step.compute_efficiency)
                  + (4.3e9 * 32 + 4.3e9 / 8 * (step_model.STEP_BYTES_PER_PARAM - 32)) / 1640e9
                  + 7 / 8 * 4.3e9 * 8 / 400e9)
        saves_s = preflight.checkpoint_s({"memory": {"argument_size_in_bytes": 6 * 2**30}}, 8, 1000 // 200)[1]
        train_s = 1000 * step_s * step_model.WALL_CLOCK_FACTOR[1] + preflight.TRAIN_STARTUP_S[1] + saves_s
        train_min = round(train_s, 1) / 60  # as preflight rounds est_train_s
        assert ("ConfigError: vm.run.env.MTPIPE_WORK_BUCKET: is not set for a Spot run: training keeps its "
                "checkpoints in /dev/shm/mtpipe-work on the VM") in out, out
        assert (f"each preemption throws away train_sft of the sft branch up to {train_min:.1f} min (1000 steps x "
                f"{step_s:.3f} s + start-up and checkpoints), about {train_min / 60 * 9.72:.2f} USD at 9.72 USD/h"
                ) in out, out
        assert "spot_without_work_bucket: true" in out and "up to max_recoveries = 3 times" in out
        world.nothing_created()
        out = world.doit("vm_up", "--provisioning=spot")   # params.yaml's branches: none compiled for a TPU
        assert "no forecast: preflight has compiled no TPU branch's step yet" in out, out
        world.nothing_created()

        overlay = Path(os.environ[vm_config.CONFIG_ENV])
        overlay.write_text(overlay.read_text() + "spot_without_work_bucket: true\n")
        out = world.doit("vm_run", "--provisioning=spot", *(f"--set={s}" for s in sets))
    assert "MTPIPE_WORK_BUCKET" not in out and len(world.fake.inserts()) == 1   # accepted: the VM is created
    assert not world.fake.instances   # (and deleted again: nothing answers SSH in this world)
