"""The VM lifecycle end to end on loopback: `doit vm_up -> vm_setup -> vm_run -> vm_down`.

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
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import yaml
from doit.doit_cmd import DoitMain
from fake_compute import FakeCompute, running_fake
from gcs_emulator import GCS_TEST_ENV, GcsEmulator, gcs_emulator  # noqa: F401
from sshd import LoopbackSshd

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "hf_loopbackSECRETtoken0123456789"
TARGET = {"PROJECT": "proj-1", "ZONE": "us-east5-b", "RESERVATION": "v6e-res", "NAME": "mt-test"}

PREPARE = """\
import pathlib, yaml
n = yaml.safe_load(open("params.yaml"))["n"]
pathlib.Path("out").mkdir(exist_ok=True)
pathlib.Path("out/prepared.txt").write_text("x" * n + "\\r")
"""
REPORT = """\
import hashlib, json, os, pathlib
text = pathlib.Path("out/prepared.txt").read_text()
pathlib.Path("metrics").mkdir(exist_ok=True)
token = os.environ.get("HF_TOKEN", "")
json.dump({"length": len(text), "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
           "tpu": os.environ.get("TPU_ACCELERATOR_TYPE"), "tpu_name": os.environ.get("TPU_NAME")},
          open("metrics/summary.json", "w"))
pathlib.Path("out/report.txt").write_text(f"length {len(text)}\\n")
"""


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
    """A 2-stage DVC project, committed, whose default remote is gs:// on the emulator."""
    repo.mkdir()
    (repo / "prepare.py").write_text(PREPARE)
    (repo / "report.py").write_text(REPORT)
    (repo / "params.yaml").write_text("n: 5\n")
    (repo / "conf" / "hardware").mkdir(parents=True)
    shutil.copy(ROOT / "conf" / "hardware" / "v6e-8.yaml", repo / "conf" / "hardware")
    (repo / "dvc.yaml").write_text(textwrap.dedent("""\
        stages:
          prepare:
            cmd: python prepare.py
            deps: [prepare.py]
            params: [n]
            outs: [out/prepared.txt]
          report:
            cmd: python report.py
            deps: [report.py, out/prepared.txt]
            outs: [out/report.txt]
            metrics: [{metrics/summary.json: {cache: false}}]
        """))
    dvc = [sys.executable, "-m", "dvc"]
    _sh(["git", "init", "-q", "-b", "main"], repo, env)
    _sh(dvc + ["init", "-q"], repo, env)
    with (repo / ".dvc" / "config").open("w") as config:   # what `dvc remote add/modify` writes
        config.write(f"[core]\n    remote = gcs\n    analytics = false\n['remote \"gcs\"']\n"
                     f"    url = gs://{emulator.bucket}/{repo.parent.name}\n"
                     f"    endpointurl = {emulator.endpoint}\n    allow_anonymous_login = true\n")
    _sh(["git", "add", "-A"], repo, env)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"], repo, env)


@pytest.fixture
def world(tmp_path: Path, gcs_emulator: GcsEmulator) -> Iterator[Env]:  # noqa: F811
    local_env = {k: v for k, v in os.environ.items()
                 if k not in ("GOOGLE_APPLICATION_CREDENTIALS", "STORAGE_EMULATOR_HOST")}
    local_env.update(GCS_TEST_ENV, DVC_GLOBAL_CONFIG_DIR=str(tmp_path / "dvc-global"),
                     DVC_SITE_CACHE_DIR=str(tmp_path / "dvc-site"))
    repo = tmp_path / "repo"
    make_repo(repo, gcs_emulator, local_env)
    with running_fake() as fake:

        def authorized() -> list[str]:   # the VM admits exactly the keys in its ssh-keys metadata
            return [item["value"] for inst in fake.instances.values()
                    for item in inst.get("metadata", {}).get("items", []) if item["key"] == "ssh-keys"]

        sshd = LoopbackSshd(tmp_path / "vm-home", authorized, env=dict(GCS_TEST_ENV)).start()
        config = tmp_path / "vm-test.yaml"
        config.write_text(yaml.safe_dump({
            "ssh": {"port": sshd.port, "key_file": str(tmp_path / "keys" / "id"), "ready_timeout_s": 10,
                    "connect_timeout_s": 5},
            "setup": {"commands": [f'ln -sfn {ROOT / ".venv"} "$HOME/venv"',
                                   'echo ran >> "$HOME/setup-count"']},
            "run": {"command": 'ps -o args= -s "$(ps -o sid= -p $$ | tr -d " ")" > "$HOME/argv.txt"; '
                               'source "$HOME/venv/bin/activate" && dvc pull --allow-missing && '
                               '{dvc} && dvc push',
                    "env": dict(GCS_TEST_ENV)},
        }))
        env = dict(local_env, **TARGET, MTPIPE_COMPUTE_ENDPOINT=fake.url, MTPIPE_VM_CONFIG=str(config),
                   HF_TOKEN=TOKEN, HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9",
                   NO_PROXY="127.0.0.1,localhost")
        try:
            yield Env(fake, sshd, repo, env, config)
        finally:
            sshd.stop()


def assert_deleted(w: Env) -> None:
    assert w.instance() is None and not w.fake.firewalls
    assert w.fake.calls("DELETE", "/instances/mt-test") and not (w.repo / ".vm_state.json").exists()


def assert_loopback_only(w: Env, outputs: str) -> None:
    hosts = {r.host for r in w.fake.requests}
    assert hosts == {w.fake.url.removeprefix("http://")}
    recorded = "\n".join(f"{r.path} {r.headers} {r.body}" for r in w.fake.requests)
    assert TOKEN not in recorded and TOKEN not in outputs


def test_full_cycle(world: Env) -> None:
    w = world
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

    outputs.append(w.doit("vm_run").stdout + w.doit("vm_status").stdout)
    metrics = json.loads((w.repo / "metrics" / "summary.json").read_text())
    assert metrics["token_sha256"] == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert metrics["tpu"] == "v6e-8" and metrics["tpu_name"] == os.uname().nodename
    assert metrics["length"] == 6
    assert "out/report.txt" in (w.repo / "dvc.lock").read_text()
    assert "USD so far" in outputs[-1]
    shown = _sh([sys.executable, "-m", "dvc", "metrics", "show", "--json"], w.repo, w.env)
    assert '"length": 6' in shown
    _sh([sys.executable, "-m", "dvc", "pull"], w.repo, w.env)   # the VM pushed the artifacts
    assert (w.repo / "out" / "report.txt").read_text() == "length 6\n"
    assert (w.repo / "out" / "prepared.txt").read_bytes() == b"xxxxx\r"

    # An experiment sweep through the doit param: `dvc exp run -S n=7` on the VM.
    outputs.append(w.doit("vm_run", "--set=n=7").stdout)
    assert json.loads((w.repo / "metrics" / "summary.json").read_text())["length"] == 8
    assert (w.repo / "params.yaml").read_text() == "n: 7\n"     # dvc.lock and params agree

    argv = (w.sshd.home / "argv.txt").read_text()   # argv of every process of the remote session
    assert "dvc pull" in argv and "bash -c" in argv and TOKEN not in argv
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
