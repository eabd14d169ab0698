"""The VM lifecycle end to end on loopback: `doit vm_up -> vm_setup -> vm_run -> vm_down`.

The full cycle ships the real project (a clone of the `pipeline_repo` fixture, where the embedded
default ran) to the loopback "VM", which pulls the artifacts from the GCS emulator and runs two
tutorial-like experiments there (`dvc exp run`, one per branch, one of them training) and pushes;
the experiments come back as refs (`dvc exp show`), and `dvc exp apply` + `dvc pull` fetch what the
VM produced. The failure paths (teardown, --keep, Ctrl-C, an unreachable VM, a VM deleted by
maxRunDuration) use a minimal DVC repo.

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
SFT_DTYPE = "sft.to_huggingface.weight_dtype"


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
    shutil.copy(ROOT / "params.yaml", repo)   # the checks before spending compose it
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

        # PYTHONPATH: most repos here are stand-ins, not the project, yet `{dvc}` runs the project's
        # mtpipe.cloud.exp_run; in the project's own repo (project_world) its checkout comes first
        sshd = LoopbackSshd(tmp_path / "vm-home", authorized,
                            env=dict(GCS_TEST_ENV, DVC_SITE_CACHE_DIR=str(tmp_path / "vm-dvc-site"),
                                     PYTHONPATH=str(ROOT))).start()
        config = tmp_path / "vm-test.yaml"
        config.write_text(yaml.safe_dump({
            "ssh": {"port": sshd.port, "key_file": str(tmp_path / "keys" / "id"), "ready_timeout_s": 10,
                    "connect_timeout_s": 5},
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


def workspace(repo: Path) -> dict[str, str]:
    """What vm_run must leave alone: every file (md5) and every git ref but the experiment refs.

    Left out: .git's internals (objects, the refs/exps vm_run adds), DVC's and doit's bookkeeping
    (.dvc/tmp, .doit.db.json).
    """
    files = {str(f.relative_to(repo)): hashlib.md5(f.read_bytes()).hexdigest()
             for f in repo.rglob("*") if f.is_file() and not f.is_symlink()
             and f.relative_to(repo).parts[0] not in (".git", ".doit.db.json")
             and f.relative_to(repo).parts[:2] != (".dvc", "tmp")}
    env = dict(os.environ)
    refs = _sh(["git", "for-each-ref", "--format=%(refname) %(objectname)"], repo, env).splitlines()
    head = _sh(["git", "rev-parse", "HEAD"], repo, env).strip()
    return files | {"HEAD": head} | {r.split()[0]: r.split()[1] for r in refs
                                     if not r.startswith("refs/exps/")}


def experiments(w: Env) -> dict[str, dict]:
    """`dvc exp show --json`: experiment name -> {rev, metrics (file -> data)} for HEAD's experiments."""
    found = {}
    for baseline in json.loads(_sh([sys.executable, "-m", "dvc", "exp", "show", "--json"], w.repo, w.env)):
        for exp in baseline.get("experiments") or []:
            for rev in exp["revs"]:
                data = rev.get("data") or {}
                found[rev["name"]] = {"rev": rev["rev"], "metrics": {
                    path: m["data"] for path, m in (data.get("metrics") or {}).items()}}
    return found


def apply_and_pull(w: Env, name: str) -> None:
    """`dvc exp apply NAME`, then `dvc pull`.

    vm_run brings back refs only (no artifact download to the laptop), so apply writes the
    experiment's git files and then stops at the outputs the local cache lacks (DVC's checkout step,
    exit 255, "Is your cache up to date?"); `dvc pull` fetches them from the bucket.
    """
    dvc = [sys.executable, "-m", "dvc"]
    applied = subprocess.run([*dvc, "exp", "apply", name], cwd=w.repo, env=w.env, capture_output=True,
                             text=True)
    assert applied.returncode == 0 or "Is your cache up to date?" in applied.stderr, applied.stderr
    _sh([*dvc, "pull"], w.repo, w.env)
    assert dvc_json(w, "status") == {}


def tree_without_symlinks(root: Path) -> Iterator[Path]:
    """Every regular file under root, not following symlinks (the VM's home links to the venv)."""
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder) / name
            if path.is_file() and not path.is_symlink():
                yield path


@pytest.mark.slow
@pytest.mark.vm_experiments
@pytest.mark.secrets
def test_full_cycle(project_world: Env, pipeline_repo: Path) -> None:
    """vm_up -> vm_setup -> vm_shell -> two vm_runs as experiments -> exp apply + pull -> vm_down."""
    w = project_world
    outputs = []
    outputs.append(w.doit("vm_up").stdout)
    assert "21.60 USD per hour" in outputs[0] and "after 4 h" in outputs[0]
    inst = w.instance()
    assert inst and inst["status"] == "RUNNING"
    state = json.loads((w.repo / ".vm_state.json").read_text())
    assert state["name"] == "mt-test" and state["host_key"].startswith("ssh-ed25519 ")
    assert len([r for r in w.fake.requests if r.path.split("?")[0].endswith("/wait")]) >= 4
    # The checks before spending asked Compute first: v6e in the zone, a free reservation.
    paths = [r.path.split("?")[0] for r in w.fake.requests]
    insert = paths.index("/compute/v1/projects/proj-1/zones/us-east5-b/instances")
    assert paths.index("/compute/v1/projects/proj-1/zones/us-east5-b/machineTypes/ct6e-standard-8t") < insert
    assert paths.index("/compute/v1/projects/proj-1/zones/us-east5-b/reservations/v6e-res") < insert

    outputs.append(w.doit("vm_up").stdout)              # second vm_up reuses the VM
    assert "reusing VM mt-test" in outputs[-1]
    assert len(w.fake.inserts()) == 1
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

    # Two tutorial-like runs, each a DVC experiment on the VM; the laptop's workspace stays as it is.
    vm_repo = w.sshd.home / "mtpipe"
    head = _sh(["git", "rev-parse", "HEAD"], w.repo, w.env).strip()
    before = workspace(w.repo)
    outputs.append(w.doit("vm_run", f"--set={SFT_DTYPE}=bfloat16", "--target=to_huggingface@sft",
                          "--exp-name=sft-bf16").stdout)
    assert ran_stages(outputs[-1]) == {"configure", "to_huggingface@sft"}, outputs[-1]
    assert "experiment sft-bf16" in outputs[-1] and "dvc exp apply" in outputs[-1]
    sft_metrics = json.loads((vm_repo / "metrics/sft/to_huggingface.json").read_text())
    assert workspace(w.repo) == before
    # The GRPO-like run trains (train_rl, 2 batches) with HF_TOKEN in its environment: the canary.
    outputs.append(w.doit("vm_run", "--set=rl.train_rl.num_batches=2",
                          "--set=rl.train_rl.num_test_batches=1",
                          "--set=rl.to_huggingface.weight_dtype=bfloat16",
                          "--exp-name=grpo-short").stdout + w.doit("vm_status").stdout)
    assert ran_stages(outputs[-1]) == {"configure", "train_rl", "to_huggingface@rl"}, outputs[-1]
    assert "USD so far" in outputs[-1]
    probe = json.loads((w.sshd.home / "probe.json").read_text())   # the pipeline's environment
    assert probe["token_sha256"] == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert probe["tpu"] == "v6e-8" and probe["tpu_name"] == os.uname().nodename
    rl_metrics = json.loads((vm_repo / "metrics/rl/train_rl.json").read_text())
    assert rl_metrics["steps"] == 2
    assert workspace(w.repo) == before
    assert len(w.fake.inserts()) == 1                   # both runs used the VM vm_up made

    refs = _sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], w.repo, w.env).split()
    assert sorted(refs) == [f"refs/exps/{head[:2]}/{head[2:]}/{n}" for n in ("grpo-short", "sft-bf16")]
    shown = experiments(w)
    assert shown["sft-bf16"]["metrics"]["metrics/sft/to_huggingface.json"] == sft_metrics
    assert shown["grpo-short"]["metrics"]["metrics/rl/train_rl.json"] == rl_metrics
    baseline_rl = json.loads((w.repo / "metrics/rl/train_rl.json").read_text())
    assert shown["sft-bf16"]["metrics"]["metrics/rl/train_rl.json"] == baseline_rl

    # Each experiment comes into the workspace with `dvc exp apply` and its artifacts with `dvc pull`.
    assert language_model_dtypes(pipeline_repo / "artifacts" / "sft" / "hf") == {"F32"}
    apply_and_pull(w, "sft-bf16")
    params = yaml.safe_load((w.repo / "params.yaml").read_text())
    assert params["sft"]["to_huggingface"]["weight_dtype"] == "bfloat16"
    assert language_model_dtypes(w.repo / "artifacts" / "sft" / "hf") == {"BF16"}
    apply_and_pull(w, "grpo-short")
    assert json.loads((w.repo / "metrics/rl/train_rl.json").read_text()) == rl_metrics
    assert md5_tree(w.repo, ["artifacts/rl/hf"]) == md5_tree(vm_repo, ["artifacts/rl/hf"])
    assert language_model_dtypes(w.repo / "artifacts" / "sft" / "hf") == {"F32"}   # the baseline's
    assert dvc_json(w, "status", "--cloud") == {}

    # HF_TOKEN: in no argv of the remote session, no file of the VM's home, no file here.
    argv = (w.sshd.home / "argv.txt").read_text()   # argv of every process of the remote session
    assert "dvc pull" in argv and "bash -c" in argv and TOKEN not in argv
    assert "maxtext.trainers.post_train.rl.train_rl" in argv   # the training stage's child was seen
    for path in [*tree_without_symlinks(w.sshd.home), *tree_without_symlinks(w.repo)]:
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


@pytest.mark.vm_experiments
def test_vm_run_does_not_silently_recreate(world: Env) -> None:
    """A VM that maxRunDuration deleted is reported; only --recreate makes a new one."""
    w = world
    w.configure(run__command='echo "run $(git rev-parse HEAD)" >> "$HOME/runs"')
    w.doit("vm_up")
    w.fake.expire("proj-1", "us-east5-b", "mt-test")
    proc = w.doit("vm_run", ok=False)
    out = proc.stdout + proc.stderr
    assert "VM mt-test, recorded in .vm_state.json" in out and "no longer exists" in out
    assert "--recreate" in out and len(w.fake.inserts()) == 1
    assert not (w.sshd.home / "runs").exists()
    proc = w.doit("vm_run", "--recreate")
    assert len(w.fake.inserts()) == 2 and w.instance() is not None
    assert "creating ct6e-standard-8t VM mt-test" in proc.stdout
    assert (w.sshd.home / "runs").read_text().count("run ") == 1
    assert "made no DVC experiment" in proc.stdout
    w.doit("vm_down")
    assert_deleted(w)


@pytest.mark.vm_experiments
@pytest.mark.parametrize("keep", [True, False])
def test_setup_failure_in_vm_run(world: Env, keep: bool) -> None:
    """vm_run sets the VM up itself; --keep keeps it when that step fails, else it is deleted."""
    world.configure(setup__commands=["echo setting up", "exit 7"])
    proc = world.doit("vm_run", *(["--keep"] if keep else []), ok=False)
    assert "vm_setup failed on the VM (exit 7)" in proc.stdout + proc.stderr
    if keep:
        assert world.instance() is not None and (world.repo / ".vm_state.json").exists()
        world.doit("vm_down")
    assert_deleted(world)


@pytest.mark.vm_experiments
def test_vm_run_brings_back_an_experiment(world: Env) -> None:
    """A one-stage repo: the run comes back as an experiment ref and nothing else changes locally."""
    w = world
    stage = ('python -c "import json, yaml; s = yaml.safe_load(open(\'params.yaml\'))[\'steps\']; '
             'json.dump({\'steps\': s}, open(\'count.json\', \'w\')); open(\'out.txt\', \'w\').write(str(s))"')
    _sh([sys.executable, "-m", "dvc", "stage", "add", "-q", "-n", "count", "-p", "steps",
         "-M", "count.json", "-o", "out.txt", stage], w.repo, w.env)
    _sh(["git", "add", "-A"], w.repo, w.env)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "stage"], w.repo, w.env)
    w.doit("vm_up")                                      # .vm_state.json: the VM, not the work
    before = workspace(w.repo)
    out = w.doit("vm_run", "--set=steps=7", "--exp-name=seven").stdout
    assert "experiment seven" in out and workspace(w.repo) == before
    assert experiments(w)["seven"]["metrics"] == {"count.json": {"steps": 7}}
    apply_and_pull(w, "seven")
    assert (w.repo / "out.txt").read_text() == "7"
    # A name HEAD already has fails here, before anything runs; once removed locally it is free
    # again, even though the VM still has the old ref.
    proc = w.doit("vm_run", "--set=steps=8", "--exp-name=seven", ok=False)
    assert "--exp-name: HEAD already has an experiment 'seven'" in proc.stdout
    _sh([sys.executable, "-m", "dvc", "exp", "remove", "seven"], w.repo, w.env)
    w.doit("vm_run", "--set=steps=8", "--exp-name=seven")
    assert experiments(w)["seven"]["metrics"] == {"count.json": {"steps": 8}}
    w.doit("vm_down")
