"""SSH to the VM: our own key, a connection, remote commands with their output streamed.

SSH goes through asyncssh with a key of our own (`ssh.key_file`, generated on first use); its public
half reaches the VM in the `ssh-keys` metadata, or with OS Login in the caller's OS Login profile
(mtpipe.cloud.checks.gcp.access); a VM without an external IP is reached through the provider's proxy command (Google's: an IAP tunnel). The VM's host key is trusted on first use and kept in
the state file. Secrets (HF_TOKEN) are written to the remote command's stdin and read there by the
shell builtin `read`, so they never appear in argv, metadata, logs or files.
"""

from __future__ import annotations

import asyncio
import codecs
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh

from mtpipe.cloud.settings.vm_config import SessionLost, VmConfig, VmError


def ssh_public_key(cfg: VmConfig) -> str:
    """The public half of `ssh.key_file`, generating an ed25519 pair on first use."""
    key_file = Path(os.path.expanduser(cfg.ssh.key_file))
    if not key_file.exists():
        key_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = asyncssh.generate_private_key("ssh-ed25519", comment="mtpipe")
        key.write_private_key(str(key_file))
        key_file.chmod(0o600)
        key.write_public_key(str(key_file) + ".pub")
    return asyncssh.read_private_key(str(key_file)).export_public_key().decode().strip()


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
    busy_lock: str | None = None     # the idle watch's lock file (conf/vm.yaml idle.lock_file)

    @classmethod
    def from_config(cls, cfg: VmConfig, host: str, host_key: str | None, proxy_command: str | None) -> Remote:
        """The VM at ``host`` as ``cfg``'s `ssh` reaches it, through ``proxy_command`` (None: straight)."""
        return cls(host, int(cfg.ssh.port), cfg.ssh.user, os.path.expanduser(cfg.ssh.key_file),
                   proxy_command, host_key, float(cfg.ssh.connect_timeout_s),
                   float(cfg.ssh.keepalive_s), cfg.idle.lock_file if cfg.idle.delete_after_s else None)

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
    """Run a bash script on the VM (script text in argv: never put secrets in it), holding the busy
    lock (``busy_lock``, shared) meanwhile: the VM's idle watch does not delete a VM in use
    (mtpipe.cloud.providers.gcp.idle_watch)."""
    command = "bash -c " + shlex.quote(script)
    if remote.busy_lock:
        command = f"flock -s {shlex.quote(remote.busy_lock)} {command}"
    return asyncio.run(_run(remote, command, stdin, stream))


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
