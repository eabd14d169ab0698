"""The VM lifecycle end to end on loopback: `doit vm_up -> vm_setup -> vm_run -> vm_down`.

The full cycle ships the real project (a clone of the `pipeline_repo` fixture, where the embedded
default ran) to the loopback "VM", which pulls the artifacts from the GCS emulator and runs two
tutorial-like experiments there (`dvc exp run`, one per branch, one of them training) and pushes;
the experiments come back as refs (`dvc exp show`), and `dvc exp apply` + `dvc pull` fetch what the
VM produced. The failure paths (teardown, --keep, an unreachable VM, a VM deleted by
maxRunDuration) use a minimal DVC repo; Ctrl-C in each phase is tests/cloud/lifecycle/test_vm_interrupts.py's.

Stand-ins, all on 127.0.0.1 and reached through the real clients: the fake Compute API
(google-cloud-compute), an asyncssh server that admits only the key found in the fake instance's
`ssh-keys` metadata (asyncssh client), and the GCS emulator as the DVC remote (dvc-gs). doit runs in
process with HTTP(S)_PROXY pointing at a dead port, so any request that is not to loopback fails
instead of leaving the machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from fakes import fake_apt
from fakes.hf_server import HubServer
from pipeline import md5_tree, ran_stages
from vm_world import ROOT, TOKEN, Env, assert_deleted, experiments, hub_with_tutorial_repos, sh

from mtpipe.cloud.checks import tpu
from mtpipe.pipeline import generations

SFT_DTYPE = "sft.to_huggingface.weight_dtype"


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
    out = sh([sys.executable, "-m", "dvc", *args, "--json"], w.repo, w.env).strip()
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
    refs = sh(["git", "for-each-ref", "--format=%(refname) %(objectname)"], repo, env).splitlines()
    head = sh(["git", "rev-parse", "HEAD"], repo, env).strip()
    return files | {"HEAD": head} | {r.split()[0]: r.split()[1] for r in refs
                                     if not r.startswith("refs/exps/")}


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
    sh([*dvc, "pull"], w.repo, w.env)
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
    assert "paid for by the commitment of reservation v6e-res, instead of 21.60 USD/h on demand" in outputs[0]
    assert "Compute deletes it after 4 h" in outputs[0]
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
    head = sh(["git", "rev-parse", "HEAD"], w.repo, w.env).strip()
    before = workspace(w.repo)
    outputs.append(w.doit("vm_run", f"--set={SFT_DTYPE}=bfloat16", "--target=evaluate@sft",
                          "--exp-name=sft-bf16", "--keep").stdout)
    assert ran_stages(outputs[-1]) == {"configure", "to_huggingface@sft", "evaluate@sft"}, outputs[-1]
    assert "experiment sft-bf16" in outputs[-1] and "dvc exp apply" in outputs[-1]
    sft_metrics = json.loads((vm_repo / "metrics/sft/to_huggingface.json").read_text())
    assert workspace(w.repo) == before
    # The pipeline ran with HF_TOKEN in its environment: the canary. (A training on the VM, with the
    # one-chip preset's commands: tests/cloud/lifecycle/test_rehearsal.py.)
    outputs.append(w.doit("vm_status").stdout)
    assert "USD so far" in outputs[-1]
    probe = json.loads((w.sshd.home / "probe.json").read_text())   # the pipeline's environment
    assert probe["token_sha256"] == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert probe["tpu"] == "v6e-8" and probe["tpu_name"] == os.uname().nodename
    assert len(w.fake.inserts()) == 1                   # the run used the VM vm_up made

    refs = sh(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], w.repo, w.env).split()
    assert refs == [f"refs/exps/{head[:2]}/{head[2:]}/sft-bf16"]
    shown = experiments(w)
    assert shown["sft-bf16"]["metrics"]["metrics/sft/to_huggingface.json"] == sft_metrics
    baseline_rl = json.loads((w.repo / "metrics/rl/train_rl.json").read_text())
    assert shown["sft-bf16"]["metrics"]["metrics/rl/train_rl.json"] == baseline_rl

    # Each experiment comes into the workspace with `dvc exp apply` and its artifacts with `dvc pull`.
    assert language_model_dtypes(pipeline_repo / "artifacts" / "sft" / "hf") == {"F32"}
    apply_and_pull(w, "sft-bf16")
    params = yaml.safe_load((w.repo / "params.yaml").read_text())
    assert params["sft"]["to_huggingface"]["weight_dtype"] == "bfloat16"
    assert language_model_dtypes(w.repo / "artifacts" / "sft" / "hf") == {"BF16"}
    assert md5_tree(w.repo, ["artifacts/sft/hf"]) == md5_tree(vm_repo, ["artifacts/sft/hf"])
    assert dvc_json(w, "status", "--cloud") == {}

    # HF_TOKEN: in no argv of the remote session, no file of the VM's home, no file here.
    argv = (w.sshd.home / "argv.txt").read_text()   # argv of every process of the remote session
    assert "dvc pull" in argv and "bash -c" in argv and TOKEN not in argv
    assert "maxtext.checkpoint_conversion.to_huggingface" in argv   # the export stage's child was seen
    for path in [*tree_without_symlinks(w.sshd.home), *tree_without_symlinks(w.repo)]:
        assert TOKEN.encode() not in path.read_bytes(), path

    outputs.append(w.doit("vm_down").stdout)
    assert_deleted(w)
    outputs.append(w.doit("vm_down").stdout)            # twice is fine
    assert "already gone" in outputs[-1]
    assert_loopback_only(w, "".join(outputs))


def commit_failing_stage(w: Env) -> None:
    """A stage whose command fails, committed (vm_run ships HEAD): the pipeline fails on the VM."""
    (w.repo / "dvc.yaml").write_text("stages:\n  fails:\n    cmd: exit 3\n")
    sh(["git", "add", "dvc.yaml"], w.repo, w.env)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a failing stage"], w.repo, w.env)


def test_failing_pipeline_deletes_vm(world: Env) -> None:
    """A --target that names no stage is refused before anything is created; a stage that fails on
    the VM deletes it."""
    proc = world.doit("vm_run", "--target", "no_such_stage", ok=False)
    assert "ConfigError: --target: 'no_such_stage' is no stage of" in proc.stdout, proc.stdout
    assert world.fake.inserts() == [] and not world.fake.firewalls
    commit_failing_stage(world)
    proc = world.doit("vm_run", "--target", "fails", ok=False)
    assert "the pipeline failed on the VM" in proc.stderr + proc.stdout
    assert_deleted(world)
    assert_loopback_only(world, proc.stdout + proc.stderr)


def test_keep_leaves_vm_on_failure(world: Env) -> None:
    commit_failing_stage(world)
    world.doit("vm_run", "--target", "fails", "--keep", ok=False)
    assert world.instance() is not None and (world.repo / ".vm_state.json").exists()
    world.doit("vm_down")
    assert_deleted(world)


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
    assert "--recreate" in out and "idle.delete_after_s" in out and len(w.fake.inserts()) == 1
    assert not (w.sshd.home / "runs").exists()
    proc = w.doit("vm_run", "--recreate")
    assert len(w.fake.inserts()) == 2
    assert "creating ct6e-standard-8t VM mt-test" in proc.stdout
    assert (w.sshd.home / "runs").read_text().count("run ") == 1
    assert "made no DVC experiment" in proc.stdout
    assert "VM mt-test: deleted" in proc.stdout   # after a successful run, without --keep
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


# The embedded SFT branch with its MaxText on the VM's TPU: the v6e-8 hardware preset (no Hub model,
# so the checks before spending stay on loopback); preflight's AOT compile is not what these test.
TPU_RUN = ("--set=sft.hardware=v6e-8", "--no-preflight")
TPU_CHECK = "python -m mtpipe.maxtext.tpu_check --devices 8 --device-kind 'TPU v6 lite'"
TPU_CHECK_SENT = TPU_CHECK.split(" '")[0]   # as sent over SSH, inside bash -c '...' (its quotes escaped)


@pytest.mark.vm_experiments
@pytest.mark.on_tpu
def test_which_tpu_the_vm_must_have() -> None:
    """The check's chips and device kinds from TPU_ACCELERATOR_TYPE, by conf/generations.yaml (a v5e VM's
    type is v5litepod-N, MaxText's v5e-N; a v5p's and a TPU7x's number counts TensorCores, two a chip);
    the branches on the CPU or on a GKE slice (xpk) need none."""
    types = ("v6e-8", "v5litepod-8", "v5litepod-1", "v5e-4", "v5p-8", "tpu7x-8")
    found = [generations.of_accelerator(t) for t in types]
    assert [(gen.name, chips) for gen, chips in found] == [
        ("v6e", 8), ("v5e", 8), ("v5e", 1), ("v5e", 4), ("v5p", 4), ("tpu7x", 4)]
    assert [gen.device_kinds for gen, _ in found][3:] == [["TPU v5 lite"], ["TPU v5", "TPU v5p"], ["TPU7x"]]
    for wrong in ("v4-8", "v6e", "v6e-x", "v5p-1"):
        with pytest.raises(ValueError, match="is none of tpu7x, v5litepod, v5p, v6e"):
            generations.of_accelerator(wrong)
    found = tpu.targets(ROOT, [[], ["sft.preset=gemma3-4b-ultrachat-v6e32"],
                                  ["sft.preset=gemma3-4b-ultrachat-v6e8", "rl.preset=llama3.1-8b-gsm8k-v6e8"]])
    assert [(t.accelerator_type, t.hardware, t.branches, t.command()) for t in found] == [
        ("v6e-8", "v6e-8", ["sft", "rl"], TPU_CHECK)]
    assert tpu.targets(ROOT, [[], ["sft.preset=gemma3-4b-ultrachat-v6e32"]]) == []


def index_of(commands: list[str | None], text: str) -> int:
    """The position of the first command the loopback VM received that contains `text`."""
    return next(i for i, c in enumerate(commands) if c and text in c)


@pytest.mark.vm_experiments
@pytest.mark.on_tpu
def test_tpu_check_stops_a_run_on_a_vm_without_the_tpu(world: Env) -> None:
    """A preset that targets a v6e-8 on the loopback VM, whose JAX has only the CPU: the run stops
    right after the setup with the check's own words, the VM is deleted, no stage started."""
    proc = world.doit("vm_run", *TPU_RUN, ok=False)
    out = proc.stdout + proc.stderr
    assert ("the TPU runtime check failed on VM mt-test (exit 1), before anything was downloaded: sft run on "
            "hardware v6e-8 (TPU_ACCELERATOR_TYPE v6e-8)") in out
    assert "expected 8 x 'TPU v6 lite' on backend tpu, found 1 x ['cpu'] on backend 'cpu'" in out
    assert "fix: check the VM's accelerator type" in out
    assert_deleted(world)
    commands = world.sshd.commands
    assert index_of(commands, "mtpipe: VM set up") < index_of(commands, TPU_CHECK_SENT) == len(commands) - 1
    assert not (world.sshd.home / "probe.json").exists()   # run.command never started: no dvc pull, no stage
    assert "running the pipeline" not in out and "hf_download" not in out


@pytest.mark.vm_experiments
@pytest.mark.on_tpu
def test_tpu_check_runs_between_setup_and_the_pipeline(world: Env) -> None:
    """The check's command line comes after the setup and shipping HEAD, before run.command, in the
    shipped repo with the hardware preset's environment; vm_run prints its line. The TPU is a stand-in:
    a `python` first on PATH after the venv, as tests/fakes/fake_apt.py stands in for apt. A run on the
    CPU presets (params.yaml's embedded ones) sends no check."""
    w = world
    shim = w.sshd.home / "tpu" / "python"
    shim.parent.mkdir(parents=True)
    shim.write_text('#!/bin/sh\necho "$*|$TPU_ACCELERATOR_TYPE|$PWD" >> "$HOME/tpu-check-calls"\n'
                    "echo \"TPU runtime ok: 8 x 'TPU v6 lite' (a stand-in)\"\n")
    shim.chmod(0o755)
    w.configure(run__tpu_check='source "$HOME/venv/bin/activate" && export PATH="$HOME/tpu:$PATH" && {check}',
                run__command='echo "run $(git rev-parse HEAD)" >> "$HOME/runs"')
    out = w.doit("vm_run", *TPU_RUN, "--keep").stdout
    commands = w.sshd.commands
    setup, ship = index_of(commands, "mtpipe: VM set up"), index_of(commands, "git fetch -q .git/mtpipe.bundle")
    assert setup < ship < index_of(commands, TPU_CHECK_SENT) < index_of(commands, '>> "$HOME/runs"')
    calls = (w.sshd.home / "tpu-check-calls").read_text().splitlines()
    assert calls == [f"{TPU_CHECK.removeprefix('python ').replace(chr(39), '')}|v6e-8|{w.sshd.home / 'mtpipe'}"]
    assert (f"mtpipe: checking the TPU runtime on VM mt-test: {TPU_CHECK}\n"
            "mtpipe: TPU runtime ok: 8 x 'TPU v6 lite' (a stand-in)\nmtpipe: shipped ") in out
    before = len(commands)
    out = w.doit("vm_run").stdout
    assert not any(TPU_CHECK_SENT in c for c in commands[before:] if c) and "TPU runtime" not in out
    assert (w.sshd.home / "runs").read_text().count("run ") == 2
    assert_deleted(w)   # the second run, without --keep


def apt_on_the_vm(w: Env, apt_root: Path, timeout_s: int, commands: list[str]) -> None:
    """Setup commands that run `apt_get` and `stop_auto_upgrades` against the apt-get and systemctl
    stand-ins (tests/fakes/fake_apt.py): `sudo` runs its command as this user, the stand-ins are first
    on PATH."""
    bin_dir = w.sshd.home / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("apt-get", "systemctl"):
        (bin_dir / tool).write_text(f'#!/bin/sh\nFAKE_APT_ROOT={apt_root} exec {sys.executable} '
                                    f'{fake_apt.__file__} {tool} "$@"\n')
        (bin_dir / tool).chmod(0o755)
    w.configure(setup__apt_lock_timeout_s=timeout_s,
                setup__commands=['sudo() { env "$@"; }', 'export PATH="$HOME/bin:$PATH"', *commands])


@pytest.mark.cloud_contract
@pytest.mark.slow
def test_setup_waits_for_the_package_lock(world: Env, tmp_path: Path) -> None:
    """A fresh Ubuntu VM's apt-daily jobs hold apt's locks (lists, then dpkg) and apt exits 100:
    apt_get retries `update` itself and passes DPkg::Lock::Timeout, so apt waits for the dpkg lock."""
    w, apt_root = world, tmp_path / "apt"
    apt_on_the_vm(w, apt_root, 30, ["apt_get update", "apt_get install -y git"])
    w.doit("vm_up")
    holder = fake_apt.hold(apt_root, lists_s=1, dpkg_s=7)
    try:
        out = w.doit("vm_setup").stdout
    finally:
        holder.kill()
        holder.wait()
    assert f"mtpipe: apt-get update: waiting for the package lock (held by process {holder.pid} (" in out
    assert f"Waiting for cache lock: Could not get lock {apt_root}/var/lib/dpkg/lock-frontend" in out
    assert "fake apt-get install: done" in out and "mtpipe: VM set up" in out
    calls = [line.split() for line in (apt_root / "calls.log").read_text().splitlines()]
    assert [c[2:] for c in calls] == [["update"], ["update"], ["install", "-y", "git"]]
    assert all(c[0] == "-o" and 0 < int(c[1].removeprefix("DPkg::Lock::Timeout=")) <= 30 for c in calls)
    w.doit("vm_down")


@pytest.mark.first_request
@pytest.mark.cloud_contract
def test_setup_stops_unattended_upgrades_and_upgrades_nothing(world: Env, tmp_path: Path) -> None:
    """The shipped setup upgrades none of the image's packages and first stops the apt-daily jobs: on a
    fresh VM whose apt-daily job fetches the package lists for a minute (the upgrade would follow),
    `stop_auto_upgrades` ends it, so apt waits for no lock and the upgrade never starts."""
    shipped = list(yaml.safe_load((ROOT / "conf" / "vm.yaml").read_text())["setup"]["commands"])
    assert shipped[0] == "stop_auto_upgrades"
    assert not [c for c in shipped if "upgrade" in c.split()[1:2] or "unattended-upgrade" in c]
    w, apt_root = world, tmp_path / "apt"
    apt_on_the_vm(w, apt_root, 10, [c for c in shipped if c.startswith(("stop_auto_upgrades", "apt_get "))])
    w.doit("vm_up")
    holder = fake_apt.hold(apt_root, lists_s=60, dpkg_s=120)
    try:
        out = w.doit("vm_setup").stdout
        assert holder.wait(5) is not None   # the apt-daily job was ended, not waited for
    finally:
        holder.kill()
        holder.wait()
    assert "waiting for the package lock" not in out and "Waiting for cache lock" not in out
    assert (apt_root / "systemctl.log").read_text().splitlines() == [
        "disable --now apt-daily.timer apt-daily-upgrade.timer", "stop apt-daily.service apt-daily-upgrade.service"]
    calls = [line.split()[2] for line in (apt_root / "calls.log").read_text().splitlines()]
    assert calls == ["update", "install"] and "mtpipe: VM set up" in out
    w.doit("vm_down")


@pytest.mark.first_request
def test_the_vms_ram_and_dev_shm_are_held_to_the_budget_before_anything_is_shipped(world: Env, tmp_path: Path) -> None:
    """After the setup vm_run reads the VM's /dev/shm and RAM (the loopback VM: this machine's) and
    holds the run's machine budget to them: the SFT tutorial's run directories (93 GB at the peak) in
    this /dev/shm stop the run with the key and the fix, before HEAD is shipped, and the VM is deleted."""
    w = world
    shm = int(subprocess.run(["df", "-B1", "--output=size", "/dev/shm"], capture_output=True, text=True,
                             check=True).stdout.split()[-1])
    w.configure(run__env__MTPIPE_WORK_DIR="/dev/shm/mtpipe-never-written")
    with HubServer(tmp_path / "hub") as hub:
        hub_with_tutorial_repos(hub)
        w.env.update(HF_ENDPOINT=hub.url, HF_TOKEN=hub.gated["google/gemma-3-4b-it"])
        proc = w.doit("vm_run", "--set=sft.preset=gemma3-4b-ultrachat-v6e8", "--no-preflight", ok=False)
    out = proc.stdout + proc.stderr
    assert (f"ConfigError: sft.train_sft.max_num_checkpoints_to_keep: the run needs 93 GB of the v6e-8 VM's "
            f"/dev/shm at its peak, which holds {shm / 1e9:.0f} GB (read on VM mt-test after the setup)") in out, out
    assert "sudo mount -o remount,size=SIZE /dev/shm" in out and "MTPIPE_WORK_BUCKET" in out
    commands = "\n".join(c for c in w.sshd.commands if c)
    assert "mtpipe: VM set up" in commands and "MemTotal" in commands
    assert "git fetch -q .git/mtpipe.bundle" not in commands   # HEAD was never shipped
    assert_deleted(w)


@pytest.mark.cloud_contract
def test_setup_stops_when_the_package_lock_stays_held(world: Env, tmp_path: Path) -> None:
    w, apt_root = world, tmp_path / "apt"
    apt_on_the_vm(w, apt_root, 2, ["apt_get install -y git", "touch \"$HOME/after-apt\""])
    w.doit("vm_up")
    holder = fake_apt.hold(apt_root, lists_s=60, dpkg_s=60)
    try:
        proc = w.doit("vm_setup", ok=False)
    finally:
        holder.kill()
        holder.wait()
    out = proc.stdout + proc.stderr
    assert "still held the package lock after 2 s; raise setup.apt_lock_timeout_s in conf/vm.yaml" in out
    assert "E: Could not get lock" in out and not (w.sshd.home / "after-apt").exists()
    assert_deleted(w)   # a failed setup deletes the VM (no --keep)


@pytest.mark.vm_experiments
@pytest.mark.slow
def test_vm_run_brings_back_an_experiment(world: Env) -> None:
    """A one-stage repo: the run comes back as an experiment ref and nothing else changes locally."""
    w = world
    stage = ('python -c "import json, yaml; s = yaml.safe_load(open(\'params.yaml\'))[\'steps\']; '
             'json.dump({\'steps\': s}, open(\'count.json\', \'w\')); open(\'out.txt\', \'w\').write(str(s))"')
    sh([sys.executable, "-m", "dvc", "stage", "add", "-q", "-n", "count", "-p", "steps",
         "-M", "count.json", "-o", "out.txt", stage], w.repo, w.env)
    sh(["git", "add", "-A"], w.repo, w.env)
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "stage"], w.repo, w.env)
    w.doit("vm_up")                                      # .vm_state.json: the VM, not the work
    before = workspace(w.repo)
    out = w.doit("vm_run", "--set=steps=7", "--exp-name=seven", "--keep").stdout
    assert "experiment seven" in out and workspace(w.repo) == before
    assert experiments(w)["seven"]["metrics"] == {"count.json": {"steps": 7}}
    apply_and_pull(w, "seven")
    assert (w.repo / "out.txt").read_text() == "7"
    # A name HEAD already has fails here, before anything runs; once removed locally it is free
    # again, even though the VM still has the old ref.
    proc = w.doit("vm_run", "--set=steps=8", "--exp-name=seven", ok=False)
    assert "--exp-name: HEAD already has an experiment 'seven'" in proc.stdout
    sh([sys.executable, "-m", "dvc", "exp", "remove", "seven"], w.repo, w.env)
    w.doit("vm_run", "--set=steps=8", "--exp-name=seven")
    assert experiments(w)["seven"]["metrics"] == {"count.json": {"steps": 8}}
    w.doit("vm_down")
