"""The VM lifecycle end to end on loopback: `doit vm_up -> vm_setup -> vm_run -> vm_down`.

The full cycle ships the real project (a clone of the `pipeline_repo` fixture, where the embedded
default ran) to the loopback "VM", which pulls the artifacts from the GCS emulator, reruns the
pipeline there and pushes; the results come back and `dvc pull` fetches what the VM produced.
The failure paths (teardown, --keep, Ctrl-C, an unreachable VM) use a minimal DVC repo.

Stand-ins, all on 127.0.0.1 and reached through the real clients: the fake Compute API
(google-cloud-compute), an asyncssh server that admits only the key found in the fake instance's
`ssh-keys` metadata (asyncssh client), and the GCS emulator as the DVC remote (dvc-gs). doit runs in
process (as a subprocess for Ctrl-C) with HTTP(S)_PROXY pointing at a dead port, so any request
that is not to loopback fails instead of leaving the machine.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import secrets
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml
from doit.doit_cmd import DoitMain
from fake_compute import FakeCompute, running_fake
from gcs_emulator import (  # noqa: F401 (gcs_emulator is a fixture)
    GCS_TEST_ENV,
    GcsEmulator,
    add_dvc_remote,
    gcs_emulator,
    local_remote,
    missing_git_outputs,
    pipeline_stages,
)
from pipeline import md5_tree, ran_stages
from sshd import LoopbackSshd

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_" + secrets.token_hex(16)   # made at run time: the shipped sources cannot contain it
TARGET = {"PROJECT": "proj-1", "ZONE": "us-east5-b", "RESERVATION": "v6e-res", "NAME": "mt-test"}

# Run on the "VM" before the pipeline: what the pipeline's environment holds (HF_TOKEN only hashed).
PROBE = ("import hashlib, json, os; print(json.dumps({'token_sha256': hashlib.sha256("
         "os.environ.get('HF_TOKEN', '').encode()).hexdigest(), 'tpu': os.environ.get("
         "'TPU_ACCELERATOR_TYPE'), 'tpu_name': os.environ.get('TPU_NAME')}))")
EXPORT_DTYPE = "sft.to_huggingface.weight_dtype"


@dataclass
class Env:
    """One test's world: the fake API, the fake VM, the local repo and the doit environment."""

    fake: FakeCompute
    sshd: LoopbackSshd
    repo: Path
    env: dict[str, str]
    config: Path

    def doit(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
        """Run doit in this process (importing google-cloud-compute once saves seconds a call)."""
        out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
        report = self.repo.parent / "doit-report.txt"
        with mock.patch.dict(os.environ, self.env, clear=True), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = DoitMain().run(["-f", str(ROOT / "dodo.py"), "-d", str(self.repo),
                                     "--output-file", str(report), *args])
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
        return self.fake.instances.get(("proj-1", "us-east5-b", "mt-test"))


def _sh(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


def make_repo(repo: Path, emulator: GcsEmulator, env: dict[str, str]) -> None:
    """A DVC repo without stages, committed, whose default remote is gs:// on the emulator."""
    repo.mkdir()
    (repo / "conf" / "hardware").mkdir(parents=True)
    shutil.copy(ROOT / "conf" / "hardware" / "v6e-8.yaml", repo / "conf" / "hardware")
    _sh(["git", "init", "-q", "-b", "main"], repo, env)
    _sh([sys.executable, "-m", "dvc", "init", "-q"], repo, env)
    with (repo / ".dvc" / "config").open("w") as config:   # what `add_dvc_remote` writes, faster
        config.write(f"[core]\n    remote = gcs\n    analytics = false\n['remote \"gcs\"']\n"
                     f"    url = gs://{emulator.bucket}/{repo.parent.name}\n"
                     f"    endpointurl = {emulator.endpoint}\n    allow_anonymous_login = true\n")
    _sh(["git", "add", "-A"], repo, env)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], repo, env)


def clone_project(pipeline_repo: Path, repo: Path, emulator: GcsEmulator, env: dict[str, str]) -> None:
    """A clone of the pipeline's repo with a committed remote on the emulator holding its artifacts.

    The artifacts are pushed from `pipeline_repo` (through a `.dvc/config.local` removed afterwards),
    like a user who ran the pipeline and pushed before starting a VM.
    """
    prefix = repo.parent.name
    _sh(["git", "clone", "-q", str(pipeline_repo), str(repo)], repo.parent, env)
    assert not missing_git_outputs(repo), "outputs with `cache: false` must be committed to git"
    add_dvc_remote(repo, emulator, env, prefix=prefix, local=False)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "remote"], repo, env)
    with local_remote(pipeline_repo, emulator, env, prefix=prefix):
        _sh([sys.executable, "-m", "dvc", "push", "-q"], pipeline_repo, env)


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

        def authorized() -> list[str]:   # the VM admits exactly the keys in its ssh-keys metadata
            return [item["value"] for inst in fake.instances.values()
                    for item in inst.get("metadata", {}).get("items", []) if item["key"] == "ssh-keys"]

        sshd = LoopbackSshd(tmp_path / "vm-home", authorized,
                            env=dict(GCS_TEST_ENV, DVC_SITE_CACHE_DIR=str(tmp_path / "vm-dvc-site"))
                            ).start()
        config = tmp_path / "vm-test.yaml"
        config.write_text(yaml.safe_dump({
            "ssh": {"port": sshd.port, "key_file": str(tmp_path / "keys" / "id"), "ready_timeout_s": 10,
                    "connect_timeout_s": 5},
            "setup": {"commands": [f'ln -sfn {ROOT / ".venv"} "$HOME/venv"',
                                   'echo ran >> "$HOME/setup-count"']},
            # a sampler records the argv of every process of the remote session while the pipeline runs
            "run": {"command": 'SID=$(ps -o sid= -p $$ | tr -d " "); '
                               '( while :; do ps -o args= -s "$SID" >> "$HOME/argv.txt"; sleep 0.2; done ) & '
                               'trap "kill $! 2>/dev/null" EXIT; '
                               'source "$HOME/venv/bin/activate" && '
                               f'python -c "{PROBE}" > "$HOME/probe.json" && '
                               'dvc pull --allow-missing && {dvc} && dvc push',
                    "env": dict(GCS_TEST_ENV)},
        }))
        env = dict(local_env, **TARGET, MTPIPE_COMPUTE_ENDPOINT=fake.url, MTPIPE_VM_CONFIG=str(config),
                   HF_TOKEN=TOKEN, HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9",
                   NO_PROXY="127.0.0.1,localhost")
        try:
            yield Env(fake, sshd, repo, env, config)
        finally:
            sshd.stop()


@pytest.fixture
def world(tmp_path: Path, gcs_emulator: GcsEmulator,  # noqa: F811
          local_env: dict[str, str]) -> Iterator[Env]:
    """Around a minimal DVC repo: for the failure paths, which never get to run a stage."""
    repo = tmp_path / "repo"
    make_repo(repo, gcs_emulator, local_env)
    with loopback_world(tmp_path, repo, local_env) as w:
        yield w


@pytest.fixture
def project_world(tmp_path: Path, gcs_emulator: GcsEmulator, local_env: dict[str, str],  # noqa: F811
                  pipeline_repo: Path) -> Iterator[Env]:
    """Around a clone of the real project, its artifacts on the emulator."""
    repo = tmp_path / "repo"
    clone_project(pipeline_repo, repo, gcs_emulator, local_env)
    with loopback_world(tmp_path, repo, local_env) as w:
        yield w


def assert_deleted(w: Env) -> None:
    assert w.instance() is None and not w.fake.firewalls
    assert w.fake.calls("DELETE", "/instances/mt-test") and not (w.repo / ".vm_state.json").exists()


def assert_loopback_only(w: Env, outputs: str) -> None:
    hosts = {r.host for r in w.fake.requests}
    assert hosts == {w.fake.url.removeprefix("http://")}
    recorded = "\n".join(f"{r.path} {r.headers} {r.body}" for r in w.fake.requests)
    assert TOKEN not in recorded and TOKEN not in outputs


def locked_outs(repo: Path) -> dict[str, str]:
    """The md5 dvc.lock records for every output of the stages in dvc.yaml."""
    stages = pipeline_stages(repo)
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {o["path"]: o["md5"] for name in stages for o in lock[name].get("outs", [])}


def language_model_dtypes(directory: Path) -> set[str]:
    """The dtypes of the `language_model.*` tensors in every *.safetensors file of `directory`.

    (The export copies the vision tower from the source checkpoint as it is.)
    """
    dtypes = set()
    for path in directory.glob("*.safetensors"):
        with path.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        dtypes |= {v["dtype"] for k, v in header.items() if k.startswith("language_model.")}
    return dtypes


def dvc_json(w: Env, *args: str) -> dict:
    out = _sh([sys.executable, "-m", "dvc", *args, "--json"], w.repo, w.env).strip()
    return json.loads(out) if out else {}


@pytest.mark.slow
def test_full_cycle(project_world: Env, pipeline_repo: Path) -> None:
    """vm_up -> vm_setup -> vm_shell -> vm_run (repro, then exp run -S) -> dvc pull -> vm_down."""
    w = project_world
    outputs = []
    outputs.append(w.doit("vm_up").stdout)
    assert "21.60 USD per hour" in outputs[0] and "after 4 h" in outputs[0]
    inst = w.instance()
    assert inst and inst["status"] == "RUNNING"
    state = json.loads((w.repo / ".vm_state.json").read_text())
    assert state["name"] == "mt-test" and state["host_key"].startswith("ssh-ed25519 ")
    assert len([r for r in w.fake.requests if r.path.split("?")[0].endswith("/wait")]) >= 4

    outputs.append(w.doit("vm_up").stdout)              # second vm_up reuses the VM
    assert "reusing VM mt-test" in outputs[-1]
    assert len(w.fake.calls("POST", "/zones/us-east5-b/instances")) == 1
    assert len(w.fake.calls("POST", "/global/firewalls")) == 1

    outputs.append(w.doit("vm_setup").stdout)
    outputs.append(w.doit("vm_setup").stdout)           # the marker makes the rerun a no-op
    assert "nothing to do" in outputs[-1]
    assert (w.sshd.home / "setup-count").read_text() == "ran\n"
    assert "mtpipe: VM already set up" not in outputs[-2]

    # vm_shell: the system ssh client, host key pinned; commands come from stdin here.
    commands = w.repo.parent / "shell-input"
    commands.write_text('echo "shell in $HOME" > "$HOME/shell-proof"\nexit\n')
    saved = os.dup(0)
    with commands.open() as stdin:
        os.dup2(stdin.fileno(), 0)
        try:
            w.doit("vm_shell")
        finally:
            os.dup2(saved, 0)
            os.close(saved)
    assert (w.sshd.home / "shell-proof").read_text() == f"shell in {w.sshd.home}\n"

    # vm_run: the VM pulls what the laptop pushed; `dvc repro` there has nothing to do.
    vm_repo = w.sshd.home / "mtpipe"
    before = locked_outs(pipeline_repo)
    outputs.append(w.doit("vm_run").stdout + w.doit("vm_status").stdout)
    assert ran_stages(outputs[-1]) == set() and "Data and pipelines are up to date." in outputs[-1]
    assert md5_tree(vm_repo, list(before)) == md5_tree(pipeline_repo, list(before))
    assert "USD so far" in outputs[-1]
    probe = json.loads((w.sshd.home / "probe.json").read_text())   # the pipeline's environment
    assert probe["token_sha256"] == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert probe["tpu"] == "v6e-8" and probe["tpu_name"] == os.uname().nodename
    assert locked_outs(w.repo) == before

    # An experiment through the doit param: `dvc exp run -S ...` on the VM reruns only the export.
    outputs.append(w.doit("vm_run", f"--set={EXPORT_DTYPE}=bfloat16").stdout)
    assert ran_stages(outputs[-1]) == {"configure", "to_huggingface@sft"}, outputs[-1]
    after = locked_outs(w.repo)                          # dvc.lock as the VM wrote it
    assert (w.repo / "dvc.lock").read_bytes() == (vm_repo / "dvc.lock").read_bytes()
    assert {p for p in after if after[p] != before[p]} == {
        "config/sft/to_huggingface.yaml", "artifacts/sft/hf", "metrics/sft/to_huggingface.json"}
    params = yaml.safe_load((w.repo / "params.yaml").read_text())   # `-S` edited it on the VM
    assert params["sft"]["to_huggingface"]["weight_dtype"] == "bfloat16"
    vm_metrics = json.loads((vm_repo / "metrics" / "sft" / "to_huggingface.json").read_text())
    shown = dvc_json(w, "metrics", "show")
    assert shown[""]["data"]["metrics/sft/to_huggingface.json"]["data"] == vm_metrics
    # Every object dvc.lock names is on the remote ("deleted": there, not in our empty cache yet;
    # "missing" would mean nowhere), the weights the VM exported among them.
    cloud = dvc_json(w, "status", "--cloud")
    assert set(cloud.values()) == {"deleted"}, cloud
    exported = {str(f.relative_to(vm_repo)) for f in (vm_repo / "artifacts/sft/hf").glob("*.safetensors")}
    assert exported and exported <= set(cloud), cloud

    _sh([sys.executable, "-m", "dvc", "pull"], w.repo, w.env)   # fetches what the VM produced
    assert md5_tree(w.repo, ["artifacts/sft/hf"]) == md5_tree(vm_repo, ["artifacts/sft/hf"])
    assert language_model_dtypes(pipeline_repo / "artifacts" / "sft" / "hf") == {"F32"}
    assert language_model_dtypes(w.repo / "artifacts" / "sft" / "hf") == {"BF16"}
    assert dvc_json(w, "status", "--cloud") == {}
    assert dvc_json(w, "status") == {}                   # the workspace matches the VM's run

    argv = (w.sshd.home / "argv.txt").read_text()   # argv of every process of the remote session
    assert "dvc pull" in argv and "bash -c" in argv and TOKEN not in argv
    assert "mtpipe.launch maxtext.checkpoint_conversion.to_huggingface" in argv  # the stage's child was seen
    for path in [*w.repo.rglob("*"), *w.sshd.home.glob("mtpipe/**/*")]:
        if path.is_file() and not path.is_symlink():
            assert TOKEN.encode() not in path.read_bytes(), path

    outputs.append(w.doit("vm_down").stdout)
    assert_deleted(w)
    outputs.append(w.doit("vm_down").stdout)            # twice is fine
    assert "already gone" in outputs[-1]
    assert_loopback_only(w, "".join(outputs))


def test_failing_pipeline_deletes_vm(world: Env) -> None:
    proc = world.doit("vm_run", "--target", "no_such_stage", ok=False)
    assert "the pipeline failed on the VM" in proc.stderr + proc.stdout
    assert_deleted(world)
    assert_loopback_only(world, proc.stdout + proc.stderr)


def test_keep_leaves_vm_on_failure(world: Env) -> None:
    world.doit("vm_run", "--target", "no_such_stage", "--keep", ok=False)
    assert world.instance() is not None and (world.repo / ".vm_state.json").exists()
    world.doit("vm_down")
    assert_deleted(world)


def test_ctrl_c_during_run_deletes_vm(world: Env) -> None:
    w = world
    w.configure(run__command='touch "$HOME/started"; sleep 60')
    proc = subprocess.Popen([sys.executable, "-m", "doit", "-f", str(ROOT / "dodo.py"), "-d",
                             str(w.repo), "vm_run"], env=w.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (w.sshd.home / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode != 0, out
    assert "deleting VM mt-test" in out
    assert_deleted(w)


def test_unreachable_vm_is_deleted(world: Env) -> None:
    world.fake.nat_ip = "127.0.0.2"    # sshd listens on 127.0.0.1 only: nobody answers there
    world.configure(ssh__ready_timeout_s=2, ssh__connect_timeout_s=1)
    proc = world.doit("vm_up", ok=False)
    out = proc.stdout + proc.stderr
    assert "did not accept SSH at 127.0.0.2" in out and "firewall" in out
    assert_deleted(world)
