"""What the tests would otherwise fetch from a package index while they run, made before they start.

    python tests/prefetch.py      # `make test` runs it (the work/.test-envs target); safe to run twice

* xpk's side environment, ``work/xpk_env`` (tests/xpk_parser.py; tests/training/test_xpk.py);
* the TRL side environment, ``work/trl_env`` (benchmarks/grpo_trl.py; tests/maxtext/test_grpo_trl.py);
* the uv that tests/cloud/on_vm/test_vm_lock.py runs, ``work/uv-<version>`` (mtpipe.pipeline.requirement_locks.uv);
* requirements-vm.lock in uv's cache: tests/cloud/on_vm/test_vm_lock.py installs the whole lock into a fresh
  venv with ``UV_OFFLINE=1``, so uv takes every file from its cache (about 3.5 GB the first time);
* requirements-control.lock in uv's cache, for tests/project/test_control_plane.py's fresh venv.

Each one is made only when its marker does not name what it holds (the side environments' own
markers; for the cache, the lock's sha256). The suite then runs with the network cut (tests/offline.py).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import grpo_trl  # noqa: E402
import xpk_parser  # noqa: E402

from mtpipe.pipeline import requirement_locks  # noqa: E402



def uv_cache_dir() -> str:
    """The cache tests/cloud/on_vm/test_vm_lock.py installs from (its run_setup passes the same one)."""
    return os.environ.get("UV_CACHE_DIR", str(Path.home() / ".cache" / "uv"))


def warm_uv_cache(lock: Path) -> None:
    """Install ``lock`` into a throwaway venv, so that every file of it is in uv's cache."""
    marker = ROOT / "work" / f"uv-cache-holds-{lock.stem}"   # the sha256 of the lock last installed through it
    stamp = f"{hashlib.sha256(lock.read_bytes()).hexdigest()} {uv_cache_dir()}"
    if marker.exists() and marker.read_text() == stamp:
        return
    uv, env = str(requirement_locks.uv()), {**os.environ, "UV_CACHE_DIR": uv_cache_dir()}
    with tempfile.TemporaryDirectory(dir=ROOT / "work") as tmp:   # beside the cache's disk: hardlinks
        venv = Path(tmp) / "venv"
        subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], env=env, check=True)
        subprocess.run([uv, "pip", "sync", "--quiet", "--require-hashes", "--python", str(venv / "bin" / "python"),
                        str(lock)], env=env, check=True)
    marker.write_text(stamp)


def main() -> None:
    """Make the four side by side: pip and uv each wait on the network or use one core, so together they
    take about as long as the TRL side environment alone (docs/testing.md)."""
    (ROOT / "work").mkdir(exist_ok=True)
    requirement_locks.uv()  # the uv both cache warmers run, made before them (its install takes no lock)
    makers = {"xpk side environment": xpk_parser.side_env, "TRL side environment": grpo_trl.side_env,
              "requirements-vm.lock in uv's cache": lambda: warm_uv_cache(requirement_locks.VM_LOCK),
              "requirements-control.lock in uv's cache": lambda: warm_uv_cache(requirement_locks.CONTROL_LOCK)}
    start = time.monotonic()

    def made(name: str) -> None:
        makers[name]()
        print(f"prefetch: {name} ({time.monotonic() - start:.0f} s)", flush=True)

    with ThreadPoolExecutor(max_workers=len(makers)) as pool:
        for future in [pool.submit(made, name) for name in makers]:
            future.result()  # the first failure is raised here, with its own message


if __name__ == "__main__":
    main()
