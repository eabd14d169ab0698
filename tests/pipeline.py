"""A throwaway copy of the project to run the real pipeline in, and DVC commands against it.

The copy holds what git would commit (tracked and untracked-but-not-ignored files), is a git repo of
its own with one commit (DVC experiments need one), and shares the JAX compile cache with the
checkout so that repeated test sessions skip XLA compiles.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIT_ID = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def env() -> dict[str, str]:
    """Environment for pipeline commands: the project's venv first on PATH, no cloud probing."""
    venv_bin = str(Path(sys.executable).parent)
    return {
        **os.environ, **GIT_ID,
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "NO_GCE_CHECK": "true", "DVC_NO_ANALYTICS": "1",
    }


def copy_project(dest: Path) -> Path:
    """Copy the project into ``dest`` (a new git repo with one commit) and return it."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    cache = ROOT / "work" / "jax_cache"
    cache.mkdir(parents=True, exist_ok=True)
    (dest / "work").mkdir(exist_ok=True)
    (dest / "work" / "jax_cache").symlink_to(cache)
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "test copy")
    return dest


def md5_tree(root: Path, paths: list[str]) -> dict[str, str]:
    """md5 of every file under each of `paths` (files or directories), keyed by relative path."""
    import hashlib

    files = [f for rel in paths for f in ([root / rel] if not (root / rel).is_dir()
                                          else sorted((root / rel).rglob("*"))) if not f.is_dir()]
    return {str(f.relative_to(root)): hashlib.md5(f.read_bytes()).hexdigest() for f in files}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, env=env(), capture_output=True, text=True, check=True).stdout


def dvc(repo: Path, *args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run ``dvc <args>`` in ``repo``; output is captured (stdout + stderr)."""
    proc = subprocess.run(["dvc", *args], cwd=repo, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    return proc


def ran_stages(output: str) -> set[str]:
    """The stages DVC says it ran (``Running stage 'x':``)."""
    return set(re.findall(r"Running stage '([^']+)'", output))


def reproduced_stages(output: str) -> set[str]:
    """Stages DVC ran or restored from its run-cache (``Stage 'x' is cached - skipping run``)."""
    return ran_stages(output) | set(re.findall(r"Stage '([^']+)' is cached - skipping run", output))


def export_logit_diff(repo: Path, branch: str, maxtext_name: str, tiny: str, n_tokens: int = 100) -> float:
    """Max |logit| difference: numpy forward of a branch's exported HF directory vs MaxText's own
    forward of the trained params it was exported from (docs/logit-check.md)."""
    import maxtext_forward
    import numpy as np
    import numpy_forward

    from mtpipe import embedded

    ids = np.random.default_rng(0).integers(4, embedded.TINY_VOCAB, size=n_tokens)
    ours = maxtext_forward.logits(repo / f"artifacts/{branch}/trained/model_params", maxtext_name, ids,
                                  embedded.MAXTEXT_OVERRIDES[tiny])
    ref = numpy_forward.logits(repo / f"artifacts/{branch}/hf", ids, match_maxtext=True)
    assert ref.std() > 0.1, "degenerate logits would make the comparison meaningless"
    return float(np.abs(ours - ref).max())
