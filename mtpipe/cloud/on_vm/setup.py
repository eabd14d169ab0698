"""`doit vm_setup`: conf/vm.yaml's `setup.commands` on the VM, once per VM (a marker makes a rerun a
no-op), with `setup.files` (the VM's lock) on stdin."""

from __future__ import annotations

import hashlib
import io
import shlex
import tarfile
from pathlib import Path

from mtpipe.cloud.on_vm.ssh import Remote, failed, run
from mtpipe.cloud.settings.vm_config import VmConfig, VmError
from mtpipe.errors import ConfigError


SETUP_FILES_DIR = ".mtpipe/setup"   # in the remote home: where `setup.files` land before the commands


def setup_files(cfg: VmConfig, root: Path) -> bytes:
    """`setup.files` (paths in the repo, e.g. requirements-vm.lock) as a tar stream, for the setup's stdin.

    Deterministic (fixed owner, mode and mtime), so the bytes can go into the setup marker's hash.
    """
    names = list(cfg.setup.files)
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


# `stop_auto_upgrades` in setup.commands: the image's packages stay the ones it was validated with. On
# Ubuntu the apt-daily timers start apt-daily.service (package lists) and apt-daily-upgrade.service
# (`unattended-upgrade`, the upgrades); both timers are disabled and both services stopped, as SkyPilot
# stops unattended-upgrades before its setup. apt-daily-upgrade.service has KillMode=process: an upgrade
# already installing packages finishes (dpkg is not cut short), and apt_get waits for its lock.
STOP_AUTO_UPGRADES = """stop_auto_upgrades() {
  sudo systemctl disable --now apt-daily.timer apt-daily-upgrade.timer
  sudo systemctl stop apt-daily.service apt-daily-upgrade.service
}"""


def setup_script(cfg: VmConfig, files: bytes = b"") -> str:
    """The setup commands, skipped when the marker holds their hash and the files' (rerun = no-op).

    `files` (from :func:`setup_files`) arrive on stdin and are unpacked into ~/.mtpipe/setup first.
    The commands may call `apt_get` (:data:`APT_GET`), which waits up to `setup.apt_lock_timeout_s`
    for the package lock and then exits the setup with :data:`APT_LOCK_EXIT`, and
    `stop_auto_upgrades` (:data:`STOP_AUTO_UPGRADES`).
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
        STOP_AUTO_UPGRADES,
        *unpack,
        *commands,
        f"mkdir -p \"$(dirname {marker})\" && echo {digest} > {marker}",
        'echo "mtpipe: VM set up"',
    ])


def setup(remote: Remote, cfg: VmConfig, root: Path) -> None:
    """Run `setup.commands` on the VM with `setup.files` (a no-op when both are unchanged)."""
    files = setup_files(cfg, root)
    rc, _ = run(remote, setup_script(cfg, files), stdin=files)
    if rc == APT_LOCK_EXIT:
        raise VmError(f"vm_setup: another apt or dpkg (on a fresh VM: unattended-upgrades) still held the "
                      f"package lock after {cfg.setup.apt_lock_timeout_s:g} s; raise setup.apt_lock_timeout_s "
                      "in conf/vm.yaml, or rerun `doit vm_setup` in a few minutes")
    if rc != 0:
        raise VmError(failed("vm_setup", rc))
