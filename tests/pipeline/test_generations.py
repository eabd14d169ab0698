"""A TPU generation is a row of conf/generations.yaml, a hardware preset and a price (docs/extending.md,
"A TPU generation"): every module reads the table, so v5p and TPU7x came in as rows, and a made-up
generation runs `doit check`, preflight's forecast, the price and vm_run with no other file changed.

Against the loopback world of tests/vm_world.py (the fake Compute API, the fake TPU API, an SSH server
as the VM) around a one-stage repo: the embedded pipeline on a VM is test_vm_cycle.py's, and a new
generation changes only how the VM is made and named.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import families
import pytest
import yaml
from fakes import fake_tpu
from fakes.fake_tpu import FakeTpu, Outcome
from vm_world import ROOT, Env, add_count_stage, admitted_by_nodes, as_script, experiments, sh

from mtpipe.cloud.providers.gcp.tpu_api.client import TPU_ENDPOINT_ENV
from mtpipe.cloud.settings import prices, vm_config
from mtpipe.pipeline import generations
from mtpipe.planning import aot, compiled_presets, preflight

pytestmark = pytest.mark.generation
ZONE = "us-east5-b"
# the generations added through the table: machine type of one VM, its hardware preset, the SFT tutorial on it
ADDED = {"v5p": ("ct5p-hightpu-4t", "v5p-8", "gemma3-4b-ultrachat-v5p8"),
         "tpu7x": ("tpu7x-standard-4t", "tpu7x-8", "gemma3-4b-ultrachat-tpu7x8")}


def hardware_topologies() -> dict[str, str]:
    """Each TPU hardware preset of conf/hardware/ with the accelerator type it names."""
    found = {}
    for file in sorted((ROOT / "conf" / "hardware").glob("*.yaml")):
        preset = yaml.safe_load(file.read_text())
        topo = (preset.get("xpk") or {}).get("tpu_type") or (preset.get("env") or {}).get("TPU_ACCELERATOR_TYPE")
        if topo:
            found[file.stem] = topo
    return found


def test_each_generation_is_named_alike_on_every_route_and_priced() -> None:
    """Machine type, accelerator type and MaxText's topology name each lead back to the row and the
    chips (v5p's and TPU7x's counts are TensorCores, two a chip); every row has a price; every TPU
    hardware preset names a generation of the table in a topology MaxText knows, its file named so."""
    from maxtext.utils.accelerator_to_spec_map import get_system_characteristics  # pylint: disable=import-outside-toplevel

    table = generations.load()
    for gen in table.values():
        for chips in (1, 4, 8):
            for name in (gen.machine_type(chips), gen.accelerator_type(chips), gen.maxtext_topology(chips)):
                found = generations.of_machine_type(name) if name.endswith("t") else generations.of_accelerator(name)
                assert found == (gen, chips), name
    assert [table["v5p"].accelerator_type(4), table["v5p"].machine_type(4), table["tpu7x"].maxtext_topology(4)] == [
        "v5p-8", "ct5p-hightpu-4t", "tpu7x-8"]
    assert set(prices.load().tpu) == set(table)
    for preset, topo in hardware_topologies().items():
        gen, chips = generations.of_accelerator(topo)
        assert preset == gen.maxtext_topology(chips), f"conf/hardware/{preset}.yaml names {topo}"
        assert get_system_characteristics(preset).devices_per_slice == chips * gen.devices_per_chip, preset


@pytest.mark.parametrize("name", sorted(ADDED))
def test_the_sft_tutorial_on_an_added_generation_is_forecast_from_its_committed_compile(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """preflight's compile of the SFT tutorial for a v5p-8 and a tpu7x-8 (4 chips each; a TPU7x chip is
    two JAX devices), committed (mtpipe/planning/compiled/): read back with no compile, on each device's
    HBM, at the generation's price for 4 chips."""
    machine, hardware, preset = ADDED[name]
    gen = generations.load()[name]
    (tmp_path / "params.yaml").write_text(families.committed_params_text())
    monkeypatch.setattr(aot, "child_env", lambda *a: pytest.fail("preflight started a compile"))
    cfg = vm_config.load_config({"machine_type": machine, "provisioning": "on-demand"})
    rate = prices.vm_rate(cfg)
    assert vm_config.budget_machine(cfg).tpu == hardware
    [row] = preflight.check([f"sft.preset={preset}"], rate.price.usd, vm_config.budget_machine(cfg), root=tmp_path,
                            branches=("sft",), price_basis=rate.per_chip())
    out = capsys.readouterr().out
    assert f"compile result committed (mtpipe/planning/compiled/sft-{preset}.json)" in out, out
    assert row["topology"] == hardware and row["maxtext_config"]["compile_topology"] == hardware
    assert row["fits"] and row["hbm_gib_available"] == gen.chip.hbm_gib / gen.devices_per_chip   # per JAX device
    assert row["maxtext_config"]["global_batch_size_to_train_on"] == 4 * gen.devices_per_chip   # 1 per device
    assert row["usd_per_hour"] == pytest.approx(4 * rate.price.usd) and rate.tpu == name
    assert compiled_presets.SHIPPED[preset] == "sft"


@pytest.fixture
def tpu_api(world: Env) -> Iterator[FakeTpu]:
    """The fake TPU API beside `world`'s fake Compute API, offering v5p-8 too; the loopback VM admits
    the keys of READY nodes as well as those of Compute's VMs; a one-stage repo."""
    with fake_tpu.running_fake() as tpu:
        world.env[TPU_ENDPOINT_ENV] = tpu.url
        world.env.pop("RESERVATION")
        tpu.zones[ZONE].add("v5p-8")
        compute_keys = world.sshd.authorized
        world.sshd.authorized = lambda: admitted_by_nodes(tpu) + compute_keys()
        world.configure(provisioning="on-demand", tpu_api__poll_s=0.05, stockout__retry_for_s=0)
        add_count_stage(world)
        yield tpu


@pytest.mark.slow
@pytest.mark.parametrize("machine,route", [("ct5p-hightpu-4t", "compute"), ("ct5p-hightpu-4t", "tpu_api"),
                                           ("tpu7x-standard-4t", "compute")])
def test_vm_run_makes_runs_and_deletes_a_vm_of_an_added_generation(
        world: Env, tpu_api: FakeTpu, machine: str, route: str) -> None:
    """`doit check` then vm_run on a v5p VM (Compute Engine or the Cloud TPU API) and a TPU7x VM (Compute
    Engine): every check passes, the VM is asked for by the table's names, runs the experiment, which
    comes back, and is deleted."""
    w, gen = world, generations.of_machine_type(machine)[0]
    zone = "us-central1-c" if gen.name == "tpu7x" else ZONE   # conf/prices.yaml prices TPU7x in us-central1 only
    w.env["ZONE"] = zone
    w.fake.machine_types.setdefault(zone, set()).add(machine)
    w.configure(machine_type=machine, route=route)
    assert " 0 FAILS" in w.doit("check").stdout
    out = w.doit("vm_run", "--set=steps=4", "--exp-name=four", "--no-preflight").stdout
    assert experiments(w)["four"]["metrics"] == {"count.json": {"steps": 4}}
    if route == "compute":
        (insert,) = w.fake.inserts()
        assert insert.json()["machineType"].endswith(f"/machineTypes/{machine}")
        assert f"Compute Engine creates {machine}" in out
    else:
        (create,) = tpu_api.calls("POST", "/queuedResources")
        assert f'"acceleratorType": "{gen.accelerator_type(4)}"' in create[2]
        assert f'"runtimeVersion": "{gen.tpu_api.runtime_version}"' in create[2]
        assert not tpu_api.nodes and not tpu_api.queued
    region = zone.rsplit("-", 1)[0]   # the zone's region prices the VM
    assert f"{4 * prices.load().tpu[gen.name].per_chip_hour.on_demand.usd[region]:.2f} USD per hour" in out
    assert not w.fake.instances and not w.fake.firewalls


# ---------------------------------------------------------------- a made-up generation

MADE_UP = """
v9z:
  title: TPU v9z (made up)
  machine: {family: ct9z, kind: standard}
  accelerator: v9z
  maxtext: v9z
  cores_per_chip: 1
  devices_per_chip: 1
  device_kinds: [TPU v9 lite]
  chips_per_host: 4
  chip: {hbm_gib: 64, peak_tflops: 2000, hbm_gbps: 4000, ici_gbits: 6400, source: made up}
  step: {compute_efficiency: 0.5, step_error: [0.6, 2.1], evidence: assumed, source: made up}
  best_mfu: {pct: 50.0, run: made up, source: made up}
  host_ram_gb: {4: 720}
  compute:
    refused: null
    boot_disks: [hyperdisk-balanced]
    single_threaded_chips: []
    flex_start_zones: []
    reservation_family: VM_FAMILY_CLOUD_TPU_POD_SLICE_CT9Z
    quota: null
  tpu_api: null
"""
MADE_UP_PRICE = """
  v9z:
    default_region: us-central1
    per_chip_hour:
      on-demand: {usd: {us-central1: 5.00, us-east5: 5.00}, as_of: made up, source: https://cloud.google.com/tpu/pricing}
      spot: null
      flex-start: null
"""
MADE_UP_HARDWARE = {"backend": "local", "processes": 1, "maxtext_args": {},
                    "env": {"TPU_ACCELERATOR_TYPE": "v9z-4", "TPU_WORKER_ID": "0", "TPU_NAME": "@hostname",
                            "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost", "TPU_TOPOLOGY": "2x2",
                            "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_HOST_BOUNDS": "1,1,1"}}


def doit_in(w: Env, *args: str) -> str:
    """doit with the repo's own dodo.py and mtpipe (not the checkout's), in a process of its own."""
    env = dict(w.env, PYTHONPATH=str(w.repo))
    done = subprocess.run([sys.executable, "-m", "doit", "-f", str(w.repo / "dodo.py"), "-d", str(w.repo),
                           *as_script(args)], env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"doit {' '.join(args)}: {out}"
    return out


@pytest.mark.slow
def test_a_made_up_generation_is_a_row_a_hardware_preset_and_a_price(world: Env) -> None:
    """The project's code and conf/ in the repo, plus a row of conf/generations.yaml, a
    conf/hardware/v9z-4.yaml and a row of conf/prices.yaml, nothing else: `doit check` passes on a
    ct9z-standard-4t VM, preflight forecasts the SFT tutorial on it from a stored compile (MaxText cannot
    compile a made-up chip) at its price, and vm_run makes the VM, runs the experiment and deletes it."""
    w = world
    for part in ("mtpipe", "conf"):
        shutil.copytree(ROOT / part, w.repo / part, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for file in ("dodo.py", "requirements-vm.lock", "requirements.lock", "pyproject.toml"):
        shutil.copy(ROOT / file, w.repo / file)
    with open(w.repo / "conf" / "generations.yaml", "a", encoding="utf8") as table:
        table.write(MADE_UP)
    with open(w.repo / "conf" / "prices.yaml", "a", encoding="utf8") as table:
        table.write(MADE_UP_PRICE)
    (w.repo / "conf" / "hardware" / "v9z-4.yaml").write_text(yaml.safe_dump(MADE_UP_HARDWARE))
    add_count_stage(w)
    w.env.pop("RESERVATION")
    w.fake.machine_types[ZONE].add("ct9z-standard-4t")
    w.configure(machine_type="ct9z-standard-4t", provisioning="on-demand", stockout__retry_for_s=0)

    out = doit_in(w, "check")
    assert "Compute Engine creates ct9z-standard-4t" in out and " 0 FAILS" in out, out

    # the stored compile: the SFT tutorial's step on 4 chips (the v5p-8's), under the digest of this one's
    sets = ["sft.preset=gemma3-4b-ultrachat-v5p8", "sft.hardware=v9z-4"]
    digest = subprocess.run(
        [sys.executable, "-c", "import sys; from mtpipe.planning import aot; "
         "_, _, views = aot.composed_views(sys.argv[1:], aot.ROOT, ('sft',), True); "
         "print(aot.compile_digest(*aot.training_step(views['sft'])))", *sets],
        env=dict(os.environ, PYTHONPATH=str(w.repo)), cwd=w.repo, capture_output=True, text=True, check=True).stdout
    stored = json.loads(compiled_presets.path("sft", "gemma3-4b-ultrachat-v5p8").read_text())["result"]
    (w.repo / "work" / "preflight").mkdir(parents=True)
    (w.repo / "work" / "preflight" / f"{digest.strip()}.json").write_text(json.dumps(stored))
    out = doit_in(w, "preflight", *(f"--set={s}" for s in sets))
    assert "sft     gemma3-4b-ultrachat-v5p8  v9z-4" in out and "/ 64.00" in out, out
    assert "5.00 USD per chip-hour (v9z on-demand in us-east5, price as of made up" in out and "20.00 USD/h" in out

    out = doit_in(w, "vm_run", "--set=steps=2", "--exp-name=two", "--no-preflight")
    (insert,) = w.fake.inserts()
    assert insert.json()["machineType"].endswith("/machineTypes/ct9z-standard-4t")
    assert "about 20.00 USD per hour (4 chips x 5.00 USD, v9z on-demand in us-east5, price as of made up" in out, out
    assert experiments(w)["two"]["metrics"] == {"count.json": {"steps": 2}}
    assert not w.fake.instances and not w.fake.firewalls
    assert sh(["git", "status", "--porcelain", "--untracked-files=no"], w.repo, w.env) == ""
