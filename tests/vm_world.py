"""The loopback world of the VM tests: the fake Compute API, an SSH server as the VM, the GCS
emulator as the DVC remote, and doit's environment around a repo (tests/cloud/lifecycle/test_vm_cycle.py's docstring
describes the stand-ins).

A fixture module (`pytest_plugins` in tests/conftest.py): the fixtures `local_env`, `world` (a
minimal DVC repo) and `project_world` (a clone of the real project), and the helpers the VM test
files share.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml
from doit.doit_cmd import DoitMain
from fakes.fake_compute import FakeCompute, running_fake
from fakes.gcs_emulator import GCS_TEST_ENV, GcsEmulator, add_dvc_remote, local_remote, missing_git_outputs
from fakes.hf_server import HubServer
from fakes.sshd import LoopbackSshd
from pipeline import ran_stages

from mtpipe.cloud.lifecycle import rehearsal
from mtpipe.cloud.on_vm import dvc_experiments

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_" + secrets.token_hex(16)   # made at run time: the shipped sources cannot contain it
TARGET = {"PROJECT": "proj-1", "ZONE": "us-east5-b", "RESERVATION": "v6e-res", "NAME": "mt-test"}

# Run on the "VM" before the pipeline: what the pipeline's environment holds (HF_TOKEN only hashed).
PROBE = ("import hashlib, json, os; print(json.dumps({'token_sha256': hashlib.sha256("
         "os.environ.get('HF_TOKEN', '').encode()).hexdigest(), 'tpu': os.environ.get("
         "'TPU_ACCELERATOR_TYPE'), 'tpu_name': os.environ.get('TPU_NAME')}))")


def as_script(args: tuple[str, ...] | list[str]) -> list[str]:
    """doit's arguments as a script gives them: ``--yes`` after a task that may create a VM (on a terminal
    it would ask; test_lifecycle's tests of the question pass ``yes=False``)."""
    args = list(args)
    return [args[0], "--yes", *args[1:]] if args and args[0] in ("vm_up", "vm_run") else args


@dataclass
class Env:
    """One test's world: the fake API, the fake VM, the local repo and the doit environment."""

    fake: FakeCompute
    sshd: LoopbackSshd
    repo: Path
    env: dict[str, str]
    config: Path

    def doit(self, *args: str, ok: bool = True, yes: bool = True) -> subprocess.CompletedProcess:
        """Run doit in this process (importing google-cloud-compute once saves seconds a call); ``yes``:
        as a script (:func:`as_script`)."""
        out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
        report = self.repo.parent / "doit-report.txt"
        with mock.patch.dict(os.environ, self.env, clear=True), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = DoitMain().run(["-f", str(ROOT / "dodo.py"), "-d", str(self.repo),
                                     "--output-file", str(report), *(as_script(args) if yes else args)])
            finally:
                os.chdir(cwd)
        proc = subprocess.CompletedProcess(args, rc, out.getvalue() + report.read_text(),
                                           err.getvalue())
        assert (rc == 0) == ok, f"doit {' '.join(args)} rc={rc}:\n{proc.stdout}{proc.stderr}"
        return proc

    def configure(self, **overrides: object) -> None:
        """Rewrite the test's vm config overlay (MTPIPE_VM_CONFIG) with deep overrides."""
        cfg = yaml.safe_load(self.config.read_text())
        for dotted, value in overrides.items():
            node = cfg
            *parents, leaf = dotted.split("__")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        self.config.write_text(yaml.safe_dump(cfg))

    def instance(self) -> dict | None:
        return self.fake.instances.get(("proj-1", self.env.get("ZONE", "us-east5-b"), "mt-test"))


def sh(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def make_repo(repo: Path, emulator: GcsEmulator, env: dict[str, str]) -> None:
    """A DVC repo without stages, committed, whose default remote is gs:// on the emulator."""
    repo.mkdir()
    (repo / "conf" / "hardware").mkdir(parents=True)
    shutil.copy(ROOT / "conf" / "hardware" / "v6e-8.yaml", repo / "conf" / "hardware")
    shutil.copy(ROOT / "params.yaml", repo)   # the checks before spending compose it
    sh(["git", "init", "-q", "-b", "main"], repo, env)
    sh([sys.executable, "-m", "dvc", "init", "-q"], repo, env)
    with (repo / ".dvc" / "config").open("w") as config:   # what `add_dvc_remote` writes, faster
        config.write(f"[core]\n    remote = gcs\n    analytics = false\n['remote \"gcs\"']\n"
                     f"    url = gs://{emulator.bucket}/{repo.parent.name}\n"
                     f"    endpointurl = {emulator.endpoint}\n    allow_anonymous_login = true\n")
    sh(["git", "add", "-A"], repo, env)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], repo, env)


def clone_project(pipeline_repo: Path, repo: Path, emulator: GcsEmulator, env: dict[str, str]) -> None:
    """A clone of the pipeline's repo with a committed remote on the emulator holding its artifacts.

    The artifacts are pushed from `pipeline_repo` (through a `.dvc/config.local` removed afterwards),
    like a user who ran the pipeline and pushed before starting a VM.
    """
    prefix = repo.parent.name
    sh(["git", "clone", "-q", str(pipeline_repo), str(repo)], repo.parent, env)
    assert not missing_git_outputs(repo), "outputs with `cache: false` must be committed to git"
    add_dvc_remote(repo, emulator, env, prefix=prefix, local=False)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "remote"], repo, env)
    with local_remote(pipeline_repo, emulator, env, prefix=prefix):
        sh([sys.executable, "-m", "dvc", "push", "-q"], pipeline_repo, env)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCompute]:
    """The fake Compute API, the Google clients pointed at it (TARGET's project, zone, reservation
    and name in the environment, no credentials file); a proxy that fails any non-loopback request."""
    from mtpipe.cloud.providers.gcp.api_errors import ENDPOINT_ENV
    from mtpipe.cloud.settings import vm_config

    with running_fake() as compute:
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        monkeypatch.delenv(vm_config.CONFIG_ENV, raising=False)
        monkeypatch.setenv(ENDPOINT_ENV, compute.url)
        monkeypatch.setenv("NO_GCE_CHECK", "true")
        for proxy in ("HTTP_PROXY", "HTTPS_PROXY"):   # anything not for loopback fails right here
            monkeypatch.setenv(proxy, "http://127.0.0.1:9")
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        for key, value in TARGET.items():
            monkeypatch.setenv(key, value)
        yield compute


@pytest.fixture
def local_env(tmp_path: Path) -> dict[str, str]:
    """The laptop's environment for git/DVC: emulator settings, DVC's own dirs under tmp_path."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")}
    environ.update(GCS_TEST_ENV, DVC_GLOBAL_CONFIG_DIR=str(tmp_path / "dvc-global"),
                   DVC_SITE_CACHE_DIR=str(tmp_path / "dvc-site"))
    return environ


@contextlib.contextmanager
def loopback_world(tmp_path: Path, repo: Path, local_env: dict[str, str]) -> Iterator[Env]:
    """The fake Compute API and the fake VM around `repo`, and doit's environment."""
    with running_fake() as fake:

        def authorized() -> list[str]:
            """The keys a VM admits: with enable-oslogin=TRUE in its metadata those of the OS Login
            profiles, for their POSIX users; else exactly those of its ssh-keys metadata."""
            keys = []
            for inst in fake.instances.values():
                items = {i["key"]: i["value"] for i in inst.get("metadata", {}).get("items", [])}
                keys += fake.org.authorized() if items.get("enable-oslogin") == "TRUE" else \
                    [items["ssh-keys"]] if "ssh-keys" in items else []
            return keys

        # PYTHONPATH: most repos here are stand-ins, not the project, yet `{dvc}` runs the project's
        # mtpipe.cloud.on_vm.exp_run; in the project's own repo (project_world) its checkout comes first
        sshd = LoopbackSshd(tmp_path / "vm-home", authorized,
                            env=dict(GCS_TEST_ENV, DVC_SITE_CACHE_DIR=str(tmp_path / "vm-dvc-site"),
                                     PYTHONPATH=str(ROOT))).start()
        config = tmp_path / "vm-test.yaml"
        config.write_text(yaml.safe_dump({
            "ssh": {"port": sshd.port, "key_file": str(tmp_path / "keys" / "id"), "ready_timeout_s": 10,
                    "connect_timeout_s": 5},
            "firewall": {"source_ranges": ["127.0.0.1/32"]},   # where SSH comes from: this machine
            # the VM keeps its XLA compile cache in work/ across runs; here it is the checkout's, warm
            "setup": {"files": [], "commands": [f'ln -sfn {ROOT / ".venv"} "$HOME/venv"',
                                   'mkdir -p "$HOME/mtpipe/work"',
                                   f'ln -sfn {ROOT / "work" / "jax_cache"} "$HOME/mtpipe/work/jax_cache"',
                                   'echo ran >> "$HOME/setup-count"']},
            # a sampler records the argv of every process of the remote session while the pipeline runs
            "run": {"command": 'SID=$(ps -o sid= -p $$ | tr -d " "); '
                               '( while :; do ps -o args= -s "$SID" >> "$HOME/argv.txt"; sleep 0.2; done ) & '
                               'trap "kill $! 2>/dev/null" EXIT; '
                               'source "$HOME/venv/bin/activate" && '
                               f'python -c "{PROBE}" > "$HOME/probe.json" && '
                               'dvc pull --allow-missing && {dvc} && dvc push',
                    # the TPU runtime check in the VM's venv, as conf/vm.yaml's in ~/maxtext_venv
                    "tpu_check": 'source "$HOME/venv/bin/activate" && {check}',
                    # run directories in the checkout's work/, as before conf/vm.yaml's /dev/shm: the
                    # loopback VM is this machine, whose /dev/shm other tests and checkouts share
                    "env": dict(GCS_TEST_ENV, MTPIPE_WORK_DIR="")},
        }))
        env = dict(local_env, **TARGET, MTPIPE_COMPUTE_ENDPOINT=fake.url, MTPIPE_VM_CONFIG=str(config),
                   HF_TOKEN=TOKEN, HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9",
                   NO_PROXY="127.0.0.1,localhost")
        try:
            yield Env(fake, sshd, repo, env, config)
        finally:
            sshd.stop()


@pytest.fixture
def world(tmp_path: Path, gcs_emulator: GcsEmulator,
          local_env: dict[str, str]) -> Iterator[Env]:
    """Around a minimal DVC repo: for the failure paths, which never get to run a stage."""
    repo = tmp_path / "repo"
    make_repo(repo, gcs_emulator, local_env)
    with loopback_world(tmp_path, repo, local_env) as w:
        yield w


@pytest.fixture
def project_world(tmp_path: Path, gcs_emulator: GcsEmulator, local_env: dict[str, str],
                  pipeline_repo: Path) -> Iterator[Env]:
    """Around a clone of the real project, its artifacts on the emulator."""
    repo = tmp_path / "repo"
    clone_project(pipeline_repo, repo, gcs_emulator, local_env)
    with loopback_world(tmp_path, repo, local_env) as w:
        yield w


def hub_with_tutorial_repos(hub: HubServer) -> None:
    """The SFT tutorial's model (gated) and dataset (open) on the loopback Hub, at the revisions the
    presets pin (what the checks before spending ask the Hub about)."""
    for kind, group, name in (("models", "model", "gemma3-4b"), ("datasets", "dataset", "ultrachat-200k")):
        source = yaml.safe_load((ROOT / "conf" / group / f"{name}.yaml").read_text())["source"]
        repo = hub.root / kind / source["repo_id"]
        (repo / source["revision"]).mkdir(parents=True)
        (repo / source["revision"] / "README.md").write_text("card\n")
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(source["revision"])
    hub.gated["google/gemma-3-4b-it"] = "hf_" + "a" * 30


def idle_limit(w: Env, tmp_path: Path, metadata_host: str) -> Path:
    """A 1-s idle limit polled every 0.2 s, a power-off that touches ``tmp_path/powered-off``, the VM's
    metadata server at ``metadata_host``: where the VM's lock file is."""
    lock = tmp_path / "vm-busy"
    w.configure(idle__delete_after_s=1, idle__poll_s=0.2, idle__lock_file=str(lock),
                idle__poweroff_command=f"touch {tmp_path / 'powered-off'}", run__env__GCE_METADATA_HOST=metadata_host)
    return lock


def assert_deleted(w: Env) -> None:
    assert w.instance() is None and not w.fake.firewalls
    assert w.fake.calls("DELETE", "/instances/mt-test") and not (w.repo / ".vm_state.json").exists()


def experiments(w: Env) -> dict[str, dict]:
    """`dvc exp show --json`: experiment name -> {rev, metrics (file -> data)} for HEAD's experiments."""
    found = {}
    for baseline in json.loads(sh([sys.executable, "-m", "dvc", "exp", "show", "--json"], w.repo, w.env)):
        for exp in baseline.get("experiments") or []:
            for rev in exp["revs"]:
                data = rev.get("data") or {}
                found[rev["name"]] = {"rev": rev["rev"], "metrics": {
                    path: m["data"] for path, m in (data.get("metrics") or {}).items()}}
    return found


# The rehearsal's one-chip machine type (doit vm_run --rehearse: mtpipe/cloud/lifecycle/rehearsal.py).
ONE_CHIP = "ct6e-standard-1t"
# What the rehearsal's VM may differ in from the real run's: its machine type (with the one thread per
# core that only the 8-chip type takes, bodies.SINGLE_THREADED) and how it is paid for (scheduling, the
# reservation it is not in, the label that names the mode); and each creation's run id
MACHINE_AND_PROVISIONING = ("machineType", "advancedMachineFeatures", "scheduling", "reservationAffinity")
PER_VM_LABELS = ("mtpipe-provisioning", "mtpipe-run")
REHEARSAL_RAN = {"train_sft@sft", "train_sft@rl", "train_rl", "to_huggingface@sft", "to_huggingface@rl",
                 "evaluate@sft", "evaluate@rl"}


def comparable(body: dict) -> dict:
    """An insert's body without what the rehearsal changes on purpose."""
    labels = {k: v for k, v in body["labels"].items() if k not in PER_VM_LABELS}
    return {k: v for k, v in body.items() if k not in MACHINE_AND_PROVISIONING} | {"labels": labels}


def assert_rehearsed(w: Env, out: str, rehearsed: dict, real: dict, usd_per_hour: float) -> None:
    """`doit vm_run --rehearse` printed ``out`` in ``w`` (a clone of the shared pipeline, its outputs in
    the bucket; tpu_stand_in and a Hub): its insert ``rehearsed`` is the real run's ``real`` on one chip,
    Spot; the TPU check and the Hub step ran; both branches trained, exported and evaluated on the VM with
    the one-chip preset's commands (the loopback VM's JAX has the CPU only, which runs them as they are:
    JAX finds no TPU and MaxText picks its attention by the device), so each loss equals the CPU
    record's; the experiment came back; HF_TOKEN was in no argv; the VM is gone."""
    assert rehearsed["machineType"].endswith(f"/machineTypes/{ONE_CHIP}") and real["machineType"].endswith("-8t")
    assert "advancedMachineFeatures" not in rehearsed and real["advancedMachineFeatures"] == {"threadsPerCore": 1}
    assert rehearsed["scheduling"]["provisioningModel"] == "SPOT"
    assert rehearsed["scheduling"]["maxRunDuration"]["seconds"] == str(rehearsal.MAX_RUN_DURATION_S)
    assert rehearsed["labels"]["mtpipe-provisioning"] == "spot"
    assert comparable(rehearsed) == comparable(real)
    assert f"creating {ONE_CHIP} VM mt-test (spot) in us-east5-b: about {usd_per_hour:.2f} USD per hour" in out
    minutes = rehearsal.SETUP_MIN + rehearsal.EXPERIMENT_MIN
    assert (f"rehearsal: about {minutes} minutes on the VM" in out
            and f"about {usd_per_hour * minutes / 60:.2f} USD at" in out), out
    # the TPU runtime check asked for the one chip, with the one-chip preset's environment
    calls = (w.sshd.home / "tpu-check-calls").read_text().splitlines()
    assert calls == ["-m mtpipe.maxtext.tpu_check --devices 1 --device-kind TPU v6 lite|v6e-1"]
    assert "TPU runtime ok: 1 x 'TPU v6 lite' (a stand-in)" in out
    assert "Hub download ok: README.md of dataset HuggingFaceH4/ultrachat_200k at 8049631c405a" in out
    # the VM trained, exported and evaluated both branches with the one-chip preset's commands
    assert REHEARSAL_RAN <= ran_stages(out), out
    argv = (w.sshd.home / "argv.txt").read_text()   # every process of the remote sessions
    assert "maxtext.trainers.post_train.sft.train_sft" in argv and "maxtext.trainers.post_train.rl.train_rl" in argv
    assert TOKEN not in argv and TOKEN not in out
    (name,) = [line.split("experiment ", 1)[1].split(" trained on the VM")[0] for line in out.splitlines()
               if " trained on the VM: " in line]
    (ref,) = [r for r in sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], w.repo, w.env).split()
              if r.endswith(f"/{name}")]
    baseline = "".join(ref.split("/")[2:4])   # refs/exps/<2 hex>/<38 hex>/<name>
    assert ref == dvc_experiments.experiment_ref(baseline, name)   # where compare and trained read the experiment
    view = yaml.safe_load(sh(["git", "show", f"{ref}:views/rl/train_sft.yaml"], w.repo, w.env))
    assert view["hardware"]["env"]["TPU_ACCELERATOR_TYPE"] == "v6e-1" and "JAX_PLATFORMS" not in view["hardware"]["env"]
    full = yaml.safe_load(sh(["git", "show", f"{baseline}:views/rl/train_sft.yaml"], w.repo, w.env))["train_sft"]["steps"]
    assert (view["train_sft"]["steps"], view["train_sft"]["extra_args"]["learning_rate_schedule_steps"]) == \
        (rehearsal.TRAIN_STEPS, full)
    steps = (rehearsal.TRAIN_STEPS, rehearsal.TRAIN_STEPS, rehearsal.GRPO_STEPS)
    assert (f"trained on the VM: train_sft@sft {steps[0]} steps on v6e-1, train_sft@rl {steps[1]} steps on "
            f"v6e-1, train_rl@rl {steps[2]} steps on v6e-1") in out
    # each loss beside the CPU record's at its step: the loopback VM's CPU computes the same
    for stage in ("train_sft@sft", "train_sft@rl"):
        assert (f"rehearsal: {stage}: steps 1-{rehearsal.TRAIN_STEPS} on the chip" in out
                and f"max |difference| 0.0000, within the tolerance {rehearsal.LOSS_TOLERANCE}" in out), out
    assert f"every loss within {rehearsal.LOSS_TOLERANCE} of the CPU record" in out
    assert f"vLLM is not rehearsed: the VM's setup does not run {rehearsal.VLLM_SETUP}" in out
    assert "VM mt-test: deleted" in out


def tpu_stand_in(w: Env) -> None:
    """A `python` first on PATH in run.tpu_check: `-m mtpipe.maxtext.tpu_check` records its arguments and
    TPU_ACCELERATOR_TYPE and answers as one chip would; any other command runs the VM's real python."""
    shim = w.sshd.home / "tpu" / "python"
    shim.parent.mkdir(parents=True)
    shim.write_text('#!/bin/sh\ncase "$*" in\n'
                    '  "-m mtpipe.maxtext.tpu_check "*) echo "$*|$TPU_ACCELERATOR_TYPE" >> "$HOME/tpu-check-calls"\n'
                    "    echo \"TPU runtime ok: 1 x 'TPU v6 lite' (a stand-in)\" ;;\n"
                    '  *) exec "$HOME/venv/bin/python" "$@" ;;\nesac\n')
    shim.chmod(0o755)
    w.configure(run__tpu_check='source "$HOME/venv/bin/activate" && export PATH="$HOME/tpu:$PATH" && {check}')


def add_count_stage(w: Env) -> None:
    """Make `w.repo` a one-stage pipeline, committed: `count` writes params.yaml's steps to count.json."""
    stage = ('python -c "import json, yaml; s = yaml.safe_load(open(\'params.yaml\'))[\'steps\']; '
             'json.dump({\'steps\': s}, open(\'count.json\', \'w\'))"')
    sh([sys.executable, "-m", "dvc", "stage", "add", "-q", "-n", "count", "-p", "steps", "-M", "count.json",
        stage], w.repo, w.env)
    sh(["git", "add", "-A"], w.repo, w.env)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "stage"], w.repo, w.env)


def admitted_by_nodes(tpu) -> list[str]:
    """The keys a TPU VM of the fake TPU API admits: the ssh-keys metadata of each READY node."""
    return [node["metadata"]["ssh-keys"] for node in tpu.nodes.values()
            if node.get("state") == "READY" and "ssh-keys" in node.get("metadata", {})]
