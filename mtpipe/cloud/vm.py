"""The TPU VM from the laptop's side: configuration, state file, SSH and remote commands.

SSH goes through asyncssh with a key of our own (`ssh.key_file`, generated on first use); its public
half reaches the VM in the `ssh-keys` metadata. The VM's host key is trusted on first use and kept in
the state file. Secrets (HF_TOKEN) are written to the remote command's stdin and read there by the
shell builtin `read`, so they never appear in argv, metadata, logs or files.
"""

from __future__ import annotations

import asyncio
import codecs
import getpass
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import asyncssh
from annotated_types import Ge, Gt, Le
from omegaconf import DictConfig, OmegaConf
from pydantic import model_validator

from mtpipe.cloud import prices
from mtpipe.cloud.gcp import SHARED_RESERVATION
from mtpipe.errors import ConfigError
from mtpipe.pipeline.schema import KEEP_INT, PositiveInt, Section, validate

ROOT = Path(__file__).resolve().parents[2]
CONFIG_ENV = "MTPIPE_VM_CONFIG"
ENV_KEYS = {"project": "PROJECT", "zone": "ZONE", "reservation": "RESERVATION", "name": "NAME"}
STATE_FILE = ".vm_state.json"
PROVISIONING = ("reservation", "spot", "on-demand")   # how the VM is paid for (conf/vm.yaml)
RESERVATION_MODELS = ("auto", "bound", "standard")    # how a reservation's VMs are provisioned
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


class VmError(RuntimeError):
    """A failure on or reaching the VM, worded for the user."""


class SessionLost(VmError):
    """The SSH session broke before the command ended (the VM went away, or the network)."""


class VmLost(VmError):
    """The VM was lost (preempted, stopped, gone) more often than `max_recoveries` allows."""


# ---------------------------------------------------------------- configuration and state

Seconds = Annotated[float, Gt(0), KEEP_INT]


class Firewall(Section):
    name: Optional[str]                    # null = <name>-ssh
    source_ranges: list[str]


class Ssh(Section):
    user: str
    key_file: str
    port: Annotated[int, Ge(1), Le(65535)]
    proxy_command: Optional[str]           # null = the VM's external IP
    connect_timeout_s: Seconds
    keepalive_s: Seconds
    ready_timeout_s: Seconds


class Setup(Section):
    files: list[str]
    commands: list[str]
    marker: str
    apt_lock_timeout_s: Annotated[float, Ge(0), KEEP_INT]   # how long apt_get waits for the package lock


class Run(Section):
    remote_dir: str
    command: str
    hardware: Optional[str]                # conf/hardware/<this>.yaml
    env: dict[str, str]
    secrets: list[str]


class Stockout(Section):
    retry_for_s: Annotated[float, Ge(0), KEEP_INT]   # how long to retry the insert; 0: fail at once
    first_wait_s: Annotated[float, Gt(0), KEEP_INT]  # the first wait, doubled each time (at most 300 s)


class VmConfig(Section):
    """conf/vm.yaml as :func:`load_config` assembles it (the file's comments say what each key does).

    ``project``, ``zone`` and ``reservation`` may stay null until a task needs them (:func:`require`)."""

    project: Optional[str]
    zone: Optional[str]
    provisioning: str                      # one of PROVISIONING, checked below with the flag to pass
    reservation: Optional[str]             # NAME, or projects/OTHER/reservations/NAME (shared)
    reservation_model: str                 # one of RESERVATION_MODELS, checked below
    name: str
    network: str
    machine_type: str
    image_project: str
    image_family: str
    boot_disk_gb: PositiveInt
    service_account: str
    scopes: list[str]
    max_run_duration_s: int                # 0 disables it
    labels: dict[str, str]
    max_recoveries: int
    stockout: Stockout
    operation_timeout_s: Seconds
    recreate: bool
    remote_probe_timeout_s: Seconds
    firewall: Firewall
    ssh: Ssh
    setup: Setup
    run: Run

    @model_validator(mode="after")
    def check_values(self) -> VmConfig:
        if self.provisioning not in PROVISIONING:
            raise ConfigError("vm.provisioning", f"{self.provisioning!r} is not one of "
                              f"{', '.join(PROVISIONING)}",
                              "pass --provisioning=spot (or reservation, on-demand), or set "
                              "provisioning: in conf/vm.yaml")
        if not NAME_RE.match(self.name):
            raise ConfigError("vm.name", f"{self.name!r} is not a valid VM name",
                              "use lowercase letters, digits and dashes, starting with a letter (NAME)")
        if self.reservation_model not in RESERVATION_MODELS:
            raise ConfigError("vm.reservation_model", f"{self.reservation_model!r} is not one of "
                              f"{', '.join(RESERVATION_MODELS)}",
                              "set reservation_model: auto (decided from the reservation), bound or standard "
                              "in conf/vm.yaml")
        if self.reservation and not (NAME_RE.match(self.reservation)
                                     or SHARED_RESERVATION.fullmatch(self.reservation)):
            raise ConfigError("vm.reservation", f"{self.reservation!r} is neither a reservation name nor "
                              "projects/PROJECT/reservations/NAME",
                              "pass the name of a reservation of this project, or that form for one "
                              "another project shares with it (RESERVATION / --reservation)")
        if self.max_run_duration_s < 0:
            raise ConfigError("vm.max_run_duration_s", "is negative", "use seconds, or 0 to disable")
        if self.max_recoveries < 0:
            raise ConfigError("vm.max_recoveries", "is negative", "use 0 (never recreate a lost VM) or more")
        return self


def load_config(params: dict[str, Any] | None = None, state: dict | None = None) -> DictConfig:
    """conf/vm.yaml < $MTPIPE_VM_CONFIG < env PROJECT/ZONE/RESERVATION/NAME < doit params.

    Keys still unset after that are filled from the state file (the VM vm_up created), then
    `name` defaults to mtpipe-<user>. `provisioning` is the recorded VM's unless a doit param sets
    it, so that reusing or replacing that VM keeps its kind (and its price). The result is checked
    against :class:`VmConfig`.
    """
    cfg = OmegaConf.load(ROOT / "conf" / "vm.yaml")
    if os.environ.get(CONFIG_ENV):
        cfg = OmegaConf.merge(cfg, OmegaConf.load(os.environ[CONFIG_ENV]))
    for key, var in ENV_KEYS.items():
        if os.environ.get(var):
            cfg[key] = os.environ[var]
    for key, value in (params or {}).items():
        if value not in (None, ""):
            OmegaConf.update(cfg, key, value)
    for key in ("project", "zone", "name"):
        if not cfg[key] and state and state.get(key):
            cfg[key] = state[key]
    if not cfg.name:
        cfg.name = "mtpipe-" + label_value(getpass.getuser()).replace("_", "-")[:40]
    if not (params or {}).get("provisioning") and state and state.get("name") == cfg.name:
        cfg.provisioning = state.get("provisioning", cfg.provisioning)   # the recorded VM's kind
    if not cfg.firewall.name:
        cfg.firewall.name = f"{cfg.name}-ssh"
    validate(VmConfig, OmegaConf.to_container(cfg), "vm",
             lambda key, requirement: f"set {key.removeprefix('vm.')} {requirement} in conf/vm.yaml")
    prices.vm_rate(cfg)   # conf/prices.yaml prices this machine type in this mode
    return cfg


def label_value(text: str) -> str:
    """A Compute label value: lowercase letters, digits, dashes and underscores, 63 at most."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def require(cfg: DictConfig, *keys: str) -> None:
    """Fail early, naming the key and the fix, when a value needed to reach Compute is missing."""
    for key in keys:
        if not cfg[key]:
            var = ENV_KEYS[key]
            raise ConfigError(f"vm.{key}", "is not set",
                              f"export {var}=... or pass `--{key} ...` (or set {key}: in conf/vm.yaml)")


def check_create(cfg: DictConfig) -> None:
    """The settings vm_up needs, before any request (vm_checks asks Compute about the rest)."""
    reservation = ["reservation"] if cfg.provisioning == "reservation" else []
    require(cfg, "project", "zone", *reservation, "name")


def read_state(root: Path) -> dict:
    path = root / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def write_state(root: Path, state: dict) -> None:
    path = root / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


def clear_state(root: Path) -> None:
    (root / STATE_FILE).unlink(missing_ok=True)


def vm_started(state: dict, cfg: DictConfig, created: str) -> None:
    """Add a VM of this run to the state's ledger (`vms`): name, mode, rate (a reservation's VM: the
    on-demand equivalent, and the reservation that pays it), creation time."""
    rate = prices.vm_rate(cfg)
    state.setdefault("vms", []).append({
        "name": cfg.name, "provisioning": cfg.provisioning, "usd_per_hour": rate.usd_per_hour,
        "reservation": rate.reservation, "created": created, "ended": None, "why": None})


def vm_ended(state: dict, why: str) -> None:
    """Close the ledger entry of the current VM (it was deleted, preempted or is gone)."""
    if state.get("vms") and not state["vms"][-1]["ended"]:
        state["vms"][-1].update(ended=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                why=why)


@dataclass
class Spend:
    """What the VMs of a run cost: ``usd`` billed for them, and the number, hours and on-demand
    equivalent of those a reservation's commitment paid (``reservations`` names them)."""

    count: int = 0
    hours: float = 0.0
    usd: float = 0.0
    reserved_count: int = 0
    reserved_hours: float = 0.0
    reserved_usd: float = 0.0
    reservations: set[str] = field(default_factory=set)


def spend(state: dict) -> Spend:
    """The run's VMs, the hours they existed (the current one until now) and their cost."""
    now, total = datetime.now(timezone.utc), Spend()
    for entry in state.get("vms", []):
        end = datetime.fromisoformat(entry["ended"]) if entry["ended"] else now
        h = max(0.0, (end - datetime.fromisoformat(entry["created"])).total_seconds() / 3600)
        total.count, total.hours = total.count + 1, total.hours + h
        if entry.get("reservation"):
            total.reserved_count += 1
            total.reserved_hours += h
            total.reserved_usd += h * entry["usd_per_hour"]
            total.reservations.add(entry["reservation"])
        else:
            total.usd += h * entry["usd_per_hour"]
    return total


def repo_root() -> Path:
    """The git work tree doit runs in (the code vm_run ships)."""
    out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if out.returncode != 0:
        raise VmError(f"{Path.cwd()} is not a git repository: run doit from the project checkout")
    return Path(out.stdout.strip())


def ssh_public_key(cfg: DictConfig) -> str:
    """The public half of `ssh.key_file`, generating an ed25519 pair on first use."""
    key_file = Path(os.path.expanduser(cfg.ssh.key_file))
    if not key_file.exists():
        key_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = asyncssh.generate_private_key("ssh-ed25519", comment="mtpipe")
        key.write_private_key(str(key_file))
        key_file.chmod(0o600)
        key.write_public_key(str(key_file) + ".pub")
    return asyncssh.read_private_key(str(key_file)).export_public_key().decode().strip()


# ---------------------------------------------------------------- SSH


@dataclass
class Remote:
    """How to reach the VM's sshd."""

    host: str
    port: int
    user: str
    key_file: str
    proxy_command: str | None = None
    host_key: str | None = None      # OpenSSH public key line; None = trust on first use
    connect_timeout_s: float = 20
    keepalive_s: float = 15          # a VM that vanished is noticed after 3 unanswered keepalives

    @classmethod
    def from_config(cls, cfg: DictConfig, host: str, host_key: str | None) -> Remote:
        proxy = cfg.ssh.proxy_command
        if proxy:
            proxy = proxy.format(name=cfg.name, zone=cfg.zone, project=cfg.project)
        return cls(host, int(cfg.ssh.port), cfg.ssh.user, os.path.expanduser(cfg.ssh.key_file),
                   proxy, host_key, float(cfg.ssh.connect_timeout_s), float(cfg.ssh.keepalive_s))

    async def connect(self) -> asyncssh.SSHClientConnection:
        known: Any = None
        if self.host_key:
            known = ([asyncssh.import_public_key(self.host_key)], [], [])
        return await asyncssh.connect(
            self.host, port=self.port, username=self.user, client_keys=[self.key_file],
            known_hosts=known, proxy_command=self.proxy_command, config=None, agent_path=None,
            connect_timeout=self.connect_timeout_s, keepalive_interval=self.keepalive_s,
            keepalive_count_max=3)


async def _pump(stream: asyncssh.SSHReader, sink: Any) -> None:
    """Copy remote output to a local text stream as it arrives (doit may have replaced it)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := await stream.read(65536):
        sink.write(decoder.decode(chunk))
        sink.flush()


async def _run(remote: Remote, command: str, stdin: bytes, stream: bool) -> tuple[int, bytes]:
    try:
        conn = await remote.connect()
    except (OSError, asyncssh.Error, asyncio.TimeoutError) as e:
        raise VmError(f"cannot reach the VM over SSH at {remote.host}:{remote.port} ({e}); "
                      "check the firewall rule (vm.firewall.source_ranges) or ssh.proxy_command, "
                      "or recreate the VM with `doit vm_down vm_up`") from e
    try:
        async with conn:
            proc = await conn.create_process(command, encoding=None)
            proc.stdin.write(stdin)
            proc.stdin.write_eof()
            if stream:
                await asyncio.gather(_pump(proc.stdout, sys.stdout),
                                     _pump(proc.stderr, sys.stderr))
                out = b""
            else:
                out, _ = await asyncio.gather(proc.stdout.read(), _pump(proc.stderr, sys.stderr))
            result = await proc.wait()
    except (OSError, asyncssh.Error) as e:
        raise SessionLost(f"lost the SSH session to {remote.host}:{remote.port} ({e})") from e
    return (result.exit_status if result.exit_status is not None else 255), out


def run(remote: Remote, script: str, stdin: bytes = b"", stream: bool = True) -> tuple[int, bytes]:
    """Run a bash script on the VM (script text in argv: never put secrets in it)."""
    return asyncio.run(_run(remote, "bash -c " + shlex.quote(script), stdin, stream))


def failed(what: str, rc: int) -> str:
    return f"{what} failed on the VM (exit {rc}); see the output above"


def check(remote: Remote, script: str, what: str, stdin: bytes = b"", stream: bool = True) -> bytes:
    rc, out = run(remote, script, stdin, stream)
    if rc != 0:
        raise VmError(failed(what, rc))
    return out


def wait_ready(remote: Remote, timeout_s: float) -> str:
    """Wait until sshd accepts our key; return the VM's host key (trusted on first use)."""

    async def probe() -> str:
        conn = await remote.connect()
        async with conn:
            key = conn.get_server_host_key()
            assert key is not None
            return key.export_public_key().decode().strip()

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return asyncio.run(probe())
        except (OSError, asyncssh.Error, asyncio.TimeoutError) as e:
            if time.monotonic() > deadline:
                raise VmError(
                    f"the VM did not accept SSH at {remote.host}:{remote.port} within "
                    f"{timeout_s:.0f} s ({e}); check vm.firewall.source_ranges / ssh.proxy_command "
                    "(docs/tpu-vm.md) or raise ssh.ready_timeout_s") from e
            time.sleep(min(5.0, max(0.2, timeout_s / 20)))


def shell_argv(remote: Remote, known_hosts: Path) -> list[str]:
    """An interactive `ssh` command line for vm_shell (host key pinned to the recorded one)."""
    if remote.host_key:
        host = remote.host if remote.port == 22 else f"[{remote.host}]:{remote.port}"
        known_hosts.write_text(f"{host} {remote.host_key}\n")
    argv = ["ssh", "-i", remote.key_file, "-p", str(remote.port), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=accept-new"]
    if remote.proxy_command:
        argv += ["-o", f"ProxyCommand={remote.proxy_command}"]
    return argv + [f"{remote.user}@{remote.host}"]


# ---------------------------------------------------------------- scripts run on the VM


SETUP_FILES_DIR = ".mtpipe/setup"   # in the remote home: where `setup.files` land before the commands


def setup_files(cfg: DictConfig, root: Path) -> bytes:
    """`setup.files` (paths in the repo, e.g. requirements-vm.lock) as a tar stream, for the setup's stdin.

    Deterministic (fixed owner, mode and mtime), so the bytes can go into the setup marker's hash.
    """
    names = list(cfg.setup.get("files") or [])
    if not names:
        return b""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            path = root / name
            if not path.is_file():
                raise ConfigError("vm.setup.files", f"{name} does not exist in {root}",
                                  "name files of the repo (e.g. requirements-vm.lock; `make lock` writes it)")
            data = path.read_bytes()
            info = tarfile.TarInfo(Path(name).name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


APT_LOCK_EXIT = 75   # setup's exit status when apt_get ran out of setup.apt_lock_timeout_s

# `apt_get ARGS` in setup.commands: `sudo apt-get ARGS`, waiting while another apt or dpkg holds the
# package lock (on a fresh Ubuntu VM unattended-upgrades does, and apt exits 100). apt >= 1.9.11 waits
# for the dpkg lock itself with DPkg::Lock::Timeout (Ubuntu 22.04 has apt 2.4); `apt-get update`'s
# lists lock it does not wait for, so a lock failure is retried until the same deadline.
APT_GET = r"""apt_get() {
  local end=$((SECONDS + @TIMEOUT@)) err rc left
  err=$(mktemp)
  while :; do
    left=$((end > SECONDS ? end - SECONDS : 0))
    rc=0
    sudo DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=$left "$@" 2>"$err" || rc=$?
    if [ $rc -eq 0 ] || ! grep -q 'Could not get lock' "$err"; then
      cat "$err" >&2; rm -f "$err"; return $rc
    fi
    if [ $SECONDS -ge $end ]; then
      cat "$err" >&2; rm -f "$err"
      echo "mtpipe: apt-get $1: the package lock was still held after @TIMEOUT@ s (setup.apt_lock_timeout_s)" >&2
      return @EXIT@
    fi
    echo "mtpipe: apt-get $1: waiting for the package lock ($(grep -o 'held by process [0-9]* ([^)]*)' "$err" | head -n 1 || true)), up to $((end - SECONDS)) s more (setup.apt_lock_timeout_s)"
    sleep $((end - SECONDS < 5 ? (end - SECONDS > 1 ? end - SECONDS : 1) : 5))
  done
}"""


def setup_script(cfg: DictConfig, files: bytes = b"") -> str:
    """The setup commands, skipped when the marker holds their hash and the files' (rerun = no-op).

    `files` (from :func:`setup_files`) arrive on stdin and are unpacked into ~/.mtpipe/setup first.
    The commands may call `apt_get` (:data:`APT_GET`), which waits up to `setup.apt_lock_timeout_s`
    for the package lock and then exits the setup with :data:`APT_LOCK_EXIT`.
    """
    commands = list(cfg.setup.commands)
    digest = hashlib.sha256("\n".join(commands).encode() + files).hexdigest()
    marker = f'"$HOME"/{shlex.quote(cfg.setup.marker)}'
    unpack = [f'mkdir -p "$HOME"/{SETUP_FILES_DIR} && tar -xf - -C "$HOME"/{SETUP_FILES_DIR}'] if files else []
    apt_get = APT_GET.replace("@TIMEOUT@", str(int(cfg.setup.apt_lock_timeout_s))).replace(
        "@EXIT@", str(APT_LOCK_EXIT))
    return "\n".join([
        f'if [ "$(cat {marker} 2>/dev/null)" = {digest} ]; then',
        f'  echo "mtpipe: VM already set up ({digest[:12]}), nothing to do"; exit 0',
        "fi",
        "set -eo pipefail",
        apt_get,
        *unpack,
        *commands,
        f"mkdir -p \"$(dirname {marker})\" && echo {digest} > {marker}",
        'echo "mtpipe: VM set up"',
    ])


def setup(remote: Remote, cfg: DictConfig, root: Path) -> None:
    """Run `setup.commands` on the VM with `setup.files` (a no-op when both are unchanged)."""
    files = setup_files(cfg, root)
    rc, _ = run(remote, setup_script(cfg, files), stdin=files)
    if rc == APT_LOCK_EXIT:
        raise VmError(f"vm_setup: another apt or dpkg (on a fresh VM: unattended-upgrades) still held the "
                      f"package lock after {cfg.setup.apt_lock_timeout_s:g} s; raise setup.apt_lock_timeout_s "
                      "in conf/vm.yaml, or rerun `doit vm_setup` in a few minutes")
    if rc != 0:
        raise VmError(failed("vm_setup", rc))


def hardware_env(root: Path, hardware: str | None) -> dict[str, str]:
    """`env:` of conf/hardware/<hardware>.yaml in the shipped repo ({} when hardware is null)."""
    if not hardware:
        return {}
    path = root / "conf" / "hardware" / f"{hardware}.yaml"
    if not path.exists():
        raise ConfigError("vm.run.hardware", f"{path} does not exist",
                          "name a file of conf/hardware/ (e.g. v6e-8), or null for none")
    return {k: str(v) for k, v in (OmegaConf.load(path).get("env") or {}).items()}


def _export(env: dict[str, str]) -> list[str]:
    """`export` lines; the hardware presets' "@hostname" becomes the VM's hostname."""
    return [f'export {k}="$(hostname)"' if v == "@hostname" else f"export {k}={shlex.quote(v)}"
            for k, v in env.items()]


def secrets_stdin(names: list[str]) -> tuple[list[str], bytes]:
    """Shell lines reading the secrets set locally, and the stdin bytes that feed them."""
    lines, data = [], b""
    for name in names:
        value = os.environ.get(name)
        if not value:
            continue
        if "\n" in value:
            raise ConfigError(name, "contains a newline", f"export {name} as a single line")
        lines += [f"IFS= read -r {name}", f"export {name}"]
        data += value.encode() + b"\n"
    return lines, data


def set_key(value: str) -> str:
    """The params key a `--set` value sets (`+a.b=1` and `a.b=2` set the same key)."""
    return value.partition("=")[0].lstrip("+~")


def experiments(sets: list[str], queue: bool) -> list[list[str]]:
    """The `--set` values of each experiment of a vm_run.

    Without --queue: one experiment, and a key given twice is an error (dvc would keep one value).
    With --queue: a key given several times is swept, a key given once applies to every
    experiment, two swept keys make a grid (`--set=steps=100 --set=steps=200` is two experiments).
    """
    values: dict[str, list[str]] = {}
    for value in sets:
        values.setdefault(set_key(value), []).append(value)
    if not queue:
        for key, given in values.items():
            if len(given) > 1:
                raise ConfigError("--set", f"{key} is given {len(given)} times",
                                  "give it once, or add --queue to run one experiment per value")
        return [list(sets)]
    return [list(point) for point in itertools.product(*values.values())]


def experiment_names(exp_name: str | None, count: int) -> list[str | None]:
    """`--exp-name` for each experiment: NAME for one, NAME-1, NAME-2, ... for a sweep."""
    if count == 1 or not exp_name:
        return [exp_name] * count
    return [f"{exp_name}-{i}" for i in range(1, count + 1)]


def dvc_command(target: str | None, sets: list[str], exp_name: str | None) -> str:
    """`dvc exp run --pull [-S a=1 ...] [--name NAME] [TARGET]` through mtpipe.cloud.exp_run: every VM
    run is a DVC experiment; each stage reaches the remote when it ends, and a stage another VM
    finished is pulled (from the remote's run-cache), not rerun."""
    words = ["python", "-m", "mtpipe.cloud.exp_run", "exp", "run", "--pull", *[w for s in sets for w in ("-S", s)]]
    words += ["--name", exp_name] if exp_name else []
    words += [target] if target else []
    return " ".join(shlex.quote(w) for w in words)


EXPS_BEFORE = ".git/mtpipe-exps-before"   # in the VM's repo: the experiment refs before the run


def check_exp_name(root: Path, name: str | None) -> None:
    """`--exp-name` must be a valid ref name not yet used by an experiment of HEAD (checked here:
    on the VM, `dvc exp run --name` would fail only after the setup)."""
    if not name:
        return
    head = _git(root, "rev-parse", "HEAD").strip()
    ref = f"refs/exps/{head[:2]}/{head[2:]}/{name}"
    if subprocess.run(["git", "check-ref-format", ref], cwd=root).returncode != 0 or "/" in name:
        raise ConfigError("--exp-name", f"{name!r} is not a valid experiment name",
                          "use letters, digits, dashes and dots")
    if subprocess.run(["git", "show-ref", "--verify", "--quiet", ref], cwd=root).returncode == 0:
        raise ConfigError("--exp-name", f"HEAD already has an experiment {name!r}",
                          f"pick another name, or `dvc exp remove {name}` first")


def _forget_on_vm(exp_name: str | None) -> list[str]:
    """Drop a same-named experiment of HEAD left on the VM (the laptop has none: check_exp_name)."""
    if not exp_name:
        return []
    return ['b=$(git rev-parse HEAD)',
            f'git update-ref -d "refs/exps/${{b:0:2}}/${{b:2}}/"{shlex.quote(exp_name)} || true']


def run_script(cfg: DictConfig, root: Path, dvc: str, secret_lines: list[str],
               exp_name: str | None = None) -> str:
    """One experiment on the VM: secrets from stdin, env, cd into the repo, the command.

    The repo first goes back to the shipped commit (`git reset --hard`; DVC's outputs, its cache and
    work/ stay), so that each experiment of a sweep is HEAD plus its own `--set` values and reuses
    what the previous ones computed. The experiment refs present before the run are noted, so that
    :func:`fetch_experiments` brings back only the one this run made.
    """
    env = {**hardware_env(root, cfg.run.hardware), **{k: str(v) for k, v in cfg.run.env.items()}}
    return "\n".join([
        "set -eo pipefail",
        *secret_lines,
        *_export(env),
        f'cd "$HOME"/{shlex.quote(cfg.run.remote_dir)}',
        "git reset -q --hard && git clean -fdq",
        *_forget_on_vm(exp_name),
        f"git for-each-ref --format='%(refname)' refs/exps/ > {EXPS_BEFORE}",
        cfg.run.command.replace("{dvc}", dvc),
    ])


def ship(remote: Remote, root: Path, remote_dir: str) -> str:
    """Bring the VM's repo to local HEAD with a git bundle; return the commit shipped."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True)
    if head.returncode != 0:
        raise VmError("the repository has no commit yet: commit the code to run (vm_run ships HEAD)")
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        print("mtpipe: uncommitted changes are NOT shipped (vm_run runs the committed HEAD)")
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "head.bundle"
        subprocess.run(["git", "bundle", "create", "-q", str(bundle), "HEAD"], cwd=root, check=True)
        data = bundle.read_bytes()
    d = f'"$HOME"/{shlex.quote(remote_dir)}'
    check(remote, "\n".join([
        "set -eo pipefail",
        f"mkdir -p {d} && cd {d}",
        "[ -d .git ] || git init -q .",
        "git config user.name mtpipe && git config user.email mtpipe@localhost",
        "cat > .git/mtpipe.bundle",
        "git fetch -q .git/mtpipe.bundle HEAD",
        "git checkout -q -f -B mtpipe-run FETCH_HEAD",
        "git clean -fdq",
    ]), "shipping the code", stdin=data)
    return head.stdout.strip()


def fetch_experiments(remote: Remote, root: Path, remote_dir: str, baseline: str) -> list[str]:
    """Bring the experiments this run made on the VM into the local refs/exps; return their names.

    The VM bundles the new refs/exps/<baseline>/<name> refs without the baseline commit (the laptop
    has it: it shipped it), the way `dvc exp push` / `dvc exp pull` move experiments through git.
    Locally only refs and objects in .git change; `dvc exp apply NAME` brings one into the workspace.
    """
    prefix = f"refs/exps/{baseline[:2]}/{baseline[2:]}/"
    out = check(remote, "\n".join([
        "set -eo pipefail",
        f'cd "$HOME"/{shlex.quote(remote_dir)}',
        f"new=$(git for-each-ref --format='%(refname)' {prefix} | grep -vxFf {EXPS_BEFORE} || true)",
        '[ -n "$new" ] || exit 0',
        f"git bundle create -q .git/mtpipe-exps.bundle $new ^{baseline}",
        "cat .git/mtpipe-exps.bundle",
    ]), "collecting the experiment", stream=False)
    if not out:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "exps.bundle"
        bundle.write_bytes(out)
        heads = _git(root, "bundle", "list-heads", str(bundle)).split()
        refs = [r for r in heads[1::2] if r.startswith(prefix)]
        _git(root, "fetch", "-q", "--no-write-fetch-head", str(bundle), *[f"+{r}:{r}" for r in refs])
    return [r.removeprefix(prefix) for r in refs]


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise VmError(f"git {' '.join(args[:2])} failed locally: {proc.stderr.strip()}")
    return proc.stdout
