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
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh
from omegaconf import DictConfig, OmegaConf

from mtpipe.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG_ENV = "MTPIPE_VM_CONFIG"
ENV_KEYS = {"project": "PROJECT", "zone": "ZONE", "reservation": "RESERVATION", "name": "NAME"}
STATE_FILE = ".vm_state.json"
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")


class VmError(RuntimeError):
    """A failure on or reaching the VM, worded for the user."""


# ---------------------------------------------------------------- configuration and state


def load_config(params: dict[str, Any] | None = None, state: dict | None = None) -> DictConfig:
    """conf/vm.yaml < $MTPIPE_VM_CONFIG < env PROJECT/ZONE/RESERVATION/NAME < doit params.

    Keys still unset after that are filled from the state file (the VM vm_up created), then
    `name` defaults to mtpipe-<user>.
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
    if not cfg.firewall.name:
        cfg.firewall.name = f"{cfg.name}-ssh"
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
    if "name" in keys and not NAME_RE.match(cfg.name):
        raise ConfigError("vm.name", f"{cfg.name!r} is not a valid VM name",
                          "use lowercase letters, digits and dashes, starting with a letter (NAME)")


def check_create(cfg: DictConfig) -> None:
    """Everything vm_up needs before it spends money."""
    require(cfg, "project", "zone", "reservation", "name")
    if cfg.machine_type.startswith("ct6e") and cfg.zone not in cfg.v6e_zones:
        raise ConfigError("vm.zone", f"zone {cfg.zone!r} has no TPU v6e",
                          f"pick one of {', '.join(cfg.v6e_zones)} (ZONE / --zone), or add the zone "
                          "to v6e_zones in conf/vm.yaml if Google now offers v6e there")
    if int(cfg.max_run_duration_s) < 0:
        raise ConfigError("vm.max_run_duration_s", "is negative", "use seconds, or 0 to disable")


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

    @classmethod
    def from_config(cls, cfg: DictConfig, host: str, host_key: str | None) -> Remote:
        proxy = cfg.ssh.proxy_command
        if proxy:
            proxy = proxy.format(name=cfg.name, zone=cfg.zone, project=cfg.project)
        return cls(host, int(cfg.ssh.port), cfg.ssh.user, os.path.expanduser(cfg.ssh.key_file),
                   proxy, host_key, float(cfg.ssh.connect_timeout_s))

    async def connect(self) -> asyncssh.SSHClientConnection:
        known: Any = None
        if self.host_key:
            known = ([asyncssh.import_public_key(self.host_key)], [], [])
        return await asyncssh.connect(
            self.host, port=self.port, username=self.user, client_keys=[self.key_file],
            known_hosts=known, proxy_command=self.proxy_command, config=None, agent_path=None,
            connect_timeout=self.connect_timeout_s)


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
        return (result.exit_status if result.exit_status is not None else 255), out


def run(remote: Remote, script: str, stdin: bytes = b"", stream: bool = True) -> tuple[int, bytes]:
    """Run a bash script on the VM (script text in argv: never put secrets in it)."""
    return asyncio.run(_run(remote, "bash -c " + shlex.quote(script), stdin, stream))


def check(remote: Remote, script: str, what: str, stdin: bytes = b"", stream: bool = True) -> bytes:
    rc, out = run(remote, script, stdin, stream)
    if rc != 0:
        raise VmError(f"{what} failed on the VM (exit {rc}); see the output above")
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


def setup_script(cfg: DictConfig) -> str:
    """The setup commands, skipped when the marker holds their hash (rerun = no-op)."""
    commands = list(cfg.setup.commands)
    digest = hashlib.sha256("\n".join(commands).encode()).hexdigest()
    marker = f'"$HOME"/{shlex.quote(cfg.setup.marker)}'
    return "\n".join([
        f'if [ "$(cat {marker} 2>/dev/null)" = {digest} ]; then',
        f'  echo "mtpipe: VM already set up ({digest[:12]}), nothing to do"; exit 0',
        "fi",
        "set -eo pipefail",
        *commands,
        f"mkdir -p \"$(dirname {marker})\" && echo {digest} > {marker}",
        'echo "mtpipe: VM set up"',
    ])


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


def dvc_command(target: str | None, sets: list[str]) -> str:
    """`dvc exp run -S a=1 ...` when sets are given, else `dvc repro [TARGET]`."""
    if sets:
        return "dvc exp run " + " ".join(f"-S {shlex.quote(s)}" for s in sets) + (
            f" {shlex.quote(target)}" if target else "")
    return "dvc repro" + (f" {shlex.quote(target)}" if target else "")


def run_script(cfg: DictConfig, root: Path, dvc: str, secret_lines: list[str]) -> str:
    """The pipeline run on the VM: secrets from stdin, env, cd into the repo, the command."""
    env = {**hardware_env(root, cfg.run.hardware), **{k: str(v) for k, v in cfg.run.env.items()}}
    return "\n".join([
        "set -eo pipefail",
        *secret_lines,
        *_export(env),
        f'cd "$HOME"/{shlex.quote(cfg.run.remote_dir)}',
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


def fetch_results(remote: Remote, root: Path, remote_dir: str, paths: list[str]) -> list[str]:
    """Copy `paths` (dvc.lock, config, metrics, plots) from the VM's repo over the local ones."""
    quoted = " ".join(shlex.quote(p) for p in paths)
    out = check(remote, "\n".join([
        f'cd "$HOME"/{shlex.quote(remote_dir)}',
        f"files=(); for p in {quoted}; do [ -e \"$p\" ] && files+=(\"$p\"); done",
        '[ ${#files[@]} -eq 0 ] || tar -cf - "${files[@]}"',
    ]), "collecting results", stream=False)
    if not out:
        return []
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        names = {m.name.split("/")[0] for m in tar.getmembers()}
        for name in names:
            target = root / name
            if target.is_dir():
                shutil.rmtree(target)
        tar.extractall(root, filter="data")
    return sorted(names)
