"""A stand-in for `apt-get`, for the unattended-upgrades that holds its locks on a fresh Ubuntu VM, and
for the `systemctl` that stops it.

`fake_apt.py apt-get [-o Key=Value ...] COMMAND ...` behaves like apt 2.4 (Ubuntu 22.04) where
vm_setup depends on it: `update` takes the lists lock (var/lib/apt/lists/lock) and fails at once when
another process holds it; every other command takes the dpkg frontend lock
(var/lib/dpkg/lock-frontend) and, with `-o DPkg::Lock::Timeout=N`, waits up to N s for it, printing
apt's "Waiting for cache lock" line, before it fails. A failure is apt's: exit 100 and
`E: Could not get lock PATH. It is held by process PID (NAME)` on stderr. The locks are fcntl locks,
as apt's are, on files under $FAKE_APT_ROOT; each call's arguments are appended to
$FAKE_APT_ROOT/calls.log.

`fake_apt.py hold ROOT LISTS_S DPKG_S` holds the lists lock for LISTS_S and the dpkg lock for DPKG_S
seconds (the apt-daily jobs: lists first, then the upgrade), printing `held` once it holds both;
:func:`hold` starts it and returns once it does.

`fake_apt.py systemctl ARGS` appends ARGS to $FAKE_APT_ROOT/systemctl.log and does what systemd does to
those jobs: `stop apt-daily.service` while the holder holds the lists lock (apt-daily.service, the
package lists, runs) ends the holder, as systemd kills a stopped service's processes, so the upgrade
after it never starts; once it only holds the dpkg lock (the upgrade runs) stopping
apt-daily-upgrade.service leaves it running, as that unit's KillMode=process leaves
`unattended-upgrade` to finish. Enabling or disabling a timer is only recorded.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

LISTS_LOCK, DPKG_LOCK = "var/lib/apt/lists/lock", "var/lib/dpkg/lock-frontend"


def _open(root: Path, name: str) -> IO[str]:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("a+")


def _take(lock: IO[str]) -> bool:
    try:
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _holder(root: Path, name: str) -> str:
    """"PID (NAME)" of the process holding a lock, as apt names it (the holder wrote its pid)."""
    pid = (root / name).read_text().strip() or "?"
    comm = Path(f"/proc/{pid}/comm")
    return f"{pid} ({comm.read_text().strip()[:15] if comm.exists() else '?'})"


def apt_get(root: Path, args: list[str]) -> int:
    """One apt-get call: take its lock (waiting up to DPkg::Lock::Timeout for dpkg's), then succeed."""
    with (root / "calls.log").open("a") as log:
        log.write(" ".join(args) + "\n")
    options = dict(args[i + 1].split("=", 1) for i, a in enumerate(args[:-1]) if a == "-o")
    command = next(a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or args[i - 1] != "-o"))
    name = LISTS_LOCK if command == "update" else DPKG_LOCK
    timeout = 0 if command == "update" else float(options.get("DPkg::Lock::Timeout", 0))
    path = root / name
    with _open(root, name) as lock:
        deadline, waited = time.monotonic() + timeout, False
        while not _take(lock):
            if time.monotonic() >= deadline:
                print(f"E: Could not get lock {path}. It is held by process {_holder(root, name)}",
                      file=sys.stderr)
                print(f"E: Unable to acquire the dpkg frontend lock ({path}), is another process using it?"
                      if name == DPKG_LOCK else f"E: Unable to lock directory {path.parent}/", file=sys.stderr)
                return 100
            if not waited:
                print(f"Waiting for cache lock: Could not get lock {path}. It is held by process "
                      f"{_holder(root, name)}", flush=True)
                waited = True
            time.sleep(0.1)
        print(f"fake apt-get {command}: done", flush=True)
    return 0


def _hold(root: Path, lists_s: float, dpkg_s: float) -> None:
    locks = {name: _open(root, name) for name in (LISTS_LOCK, DPKG_LOCK)}
    for name, lock in locks.items():
        fcntl.lockf(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
    print("held", flush=True)
    start = time.monotonic()
    for name, seconds in sorted({LISTS_LOCK: lists_s, DPKG_LOCK: dpkg_s}.items(), key=lambda kv: kv[1]):
        time.sleep(max(0.0, start + seconds - time.monotonic()))
        fcntl.lockf(locks[name], fcntl.LOCK_UN)


def systemctl(root: Path, args: list[str]) -> int:
    """One systemctl call: recorded; `stop apt-daily.service` ends the holder while it holds the lists lock."""
    with (root / "systemctl.log").open("a") as log:
        log.write(" ".join(args) + "\n")
    if args[0] == "stop" and "apt-daily.service" in args[1:]:
        with _open(root, LISTS_LOCK) as lock:
            if not _take(lock):   # the package lists are being fetched: kill that job, wait until it is gone
                os.kill(int((root / LISTS_LOCK).read_text().split()[0]), signal.SIGTERM)
                while not _take(lock):
                    time.sleep(0.05)
            fcntl.lockf(lock, fcntl.LOCK_UN)
    return 0


def hold(root: Path, lists_s: float, dpkg_s: float) -> subprocess.Popen:
    """Start a process holding the locks under ``root`` (see the module docstring); return it once it does."""
    proc = subprocess.Popen([sys.executable, __file__, "hold", str(root), str(lists_s), str(dpkg_s)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


if __name__ == "__main__":
    if sys.argv[1] == "hold":
        _hold(Path(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
    elif sys.argv[1] == "systemctl":
        sys.exit(systemctl(Path(os.environ["FAKE_APT_ROOT"]), sys.argv[2:]))
    else:
        sys.exit(apt_get(Path(os.environ["FAKE_APT_ROOT"]), sys.argv[2:]))
