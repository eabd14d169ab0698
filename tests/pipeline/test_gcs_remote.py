"""DVC against a GCS remote (dvc-gs -> gcsfs -> patched gcp-storage-emulator on 127.0.0.1).

* round trip: files that trip the emulator's upload parser come back byte-identical;
* reproducibility: the real pipeline's repo pushes; fresh clones pull (or `repro --pull`) and
  `dvc repro` runs no stage, with identical outputs;
* cache safety: with the project's link-based cache, a workspace output cannot be edited in place
  (so the cache object it shares storage with stays intact).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.gcs_emulator import (
    GcsEmulator,
    add_dvc_remote,
    dvc_env,
    local_remote,
    missing_git_outputs,
    parse_multipart_related,
    pipeline_stages,
)
from pipeline import md5_tree, ran_stages

# The decision recorded in docs/remote-and-cache.md (keep in sync with the project's .dvc/config).
PROJECT_CACHE_TYPE = "hardlink,copy"


# ----------------------------------------------------------------------------------- helpers


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    """Run a command; return stdout+stderr, fail the test with that output if it fails."""
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed (rc={proc.returncode}):\n{output}"
    return output


def dvc(repo: Path, env: dict[str, str], *args: str) -> str:
    return run([sys.executable, "-m", "dvc", *args], repo, env)


def git(repo: Path, env: dict[str, str], *args: str) -> str:
    return run(["git", *args], repo, env)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """Subprocess environment: emulator settings, this venv first on PATH, a git identity."""
    environ = dvc_env(tmp_path)
    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ['PATH']}"
    for role in ("AUTHOR", "COMMITTER"):
        environ[f"GIT_{role}_NAME"] = "mtpipe tests"
        environ[f"GIT_{role}_EMAIL"] = "tests@mtpipe.invalid"
    return environ


def init_repo(repo: Path, env: dict[str, str]) -> None:
    repo.mkdir(parents=True)
    git(repo, env, "init", "-q", "-b", "main")
    dvc(repo, env, "init", "-q")
    dvc(repo, env, "config", "core.analytics", "false")
    dvc(repo, env, "config", "cache.type", PROJECT_CACHE_TYPE)


# ------------------------------------------------------------------- round trip through GCS


def test_parser_keeps_bytes_next_to_the_boundary() -> None:
    """The patched parser returns the payload exactly, for LF (gcsfs) and CRLF framing."""
    for eol in (b"\n", b"\r\n"):
        for payload in (b"", b"x\r", b"\r\n", b"a\r\n\r", b"--==0= not a boundary\n"):
            body = eol.join(
                [b"--==0==", b"Content-Type: application/json", b"", b'{"name": "o"}',
                 b"--==0==", b"Content-Type: text/plain", b"", payload + eol + b"--==0==--"]
            )
            parsed = parse_multipart_related(body, 'multipart/related; boundary="==0=="')
            assert parsed["content"] == payload
            assert parsed["meta"] == {"name": "o"}
            assert parsed["content-type"] == "text/plain"


@pytest.mark.slow
def test_push_pull_round_trip_is_byte_exact(
    gcs_emulator: GcsEmulator, tmp_path: Path, env: dict[str, str]
) -> None:
    """Trailing CR (small upload), over 5 MiB (resumable upload), empty and random files."""
    repo = tmp_path / "repo"
    init_repo(repo, env)
    add_dvc_remote(repo, gcs_emulator, env)
    data = repo / "data"
    data.mkdir()
    rng = random.Random(1234)
    (data / "ends_in_cr.txt").write_bytes(b"line one\r\nline two\r")
    (data / "only_cr").write_bytes(b"\r")
    (data / "empty").write_bytes(b"")
    (data / "big_ends_in_cr.bin").write_bytes(rng.randbytes(6 * 2**20) + b"\r")
    for i in range(40):
        (data / f"random_{i:02d}.bin").write_bytes(rng.randbytes(rng.randrange(1, 200_000)))
    before = md5_tree(repo, ["data"])

    dvc(repo, env, "add", "-q", "data")
    dvc(repo, env, "push")
    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(data)
    dvc(repo, env, "pull")

    assert md5_tree(repo, ["data"]) == before
    status = dvc(repo, env, "status", "--cloud")
    assert "Cache and remote 'gcs' are in sync" in status


# ------------------------------------------- the real pipeline: clone, pull, repro runs nothing


def assert_no_stage_ran(output: str) -> None:
    """DVC prints "Running stage '<name>':" for every stage it executes."""
    assert ran_stages(output) == set(), output
    assert "Data and pipelines are up to date." in output, output


@pytest.mark.slow
def test_clone_pull_repro_of_the_pipeline_runs_no_stage(
    pipeline_repo: Path, gcs_emulator: GcsEmulator, tmp_path: Path, env: dict[str, str]
) -> None:
    """A (the pipeline's repo) pushes; clones B (pull, repro) and C (repro --pull) run nothing."""
    a = pipeline_repo
    stages = pipeline_stages(a)
    outputs = [path for outs in stages.values() for path in outs]
    expected = md5_tree(a, outputs)
    with local_remote(a, gcs_emulator, env):
        dvc(a, env, "push")
        assert "Cache and remote 'gcs' are in sync" in dvc(a, env, "status", "--cloud")

    clones = {}
    for name in ("b", "c"):
        clone = tmp_path / name
        git(tmp_path, env, "clone", "-q", str(a), name)
        add_dvc_remote(clone, gcs_emulator, env)
        assert not (clone / ".dvc" / "cache").exists()  # everything must come from the remote
        assert not missing_git_outputs(clone), "outputs with `cache: false` must be committed to git"
        clones[name] = clone

    dvc(clones["b"], env, "pull")
    # Names what is missing or different in seconds, before a repro that would rerun it for minutes.
    assert dvc(clones["b"], env, "status", "--json").strip() == "{}"
    repro_b = dvc(clones["b"], env, "repro")
    assert_no_stage_ran(repro_b)
    assert all(f"Stage '{stage}' didn't change, skipping" in repro_b for stage in stages), repro_b
    repro_c = dvc(clones["c"], env, "repro", "--pull")
    assert_no_stage_ran(repro_c)
    for clone in clones.values():
        assert md5_tree(clone, outputs) == expected
        assert git(clone, env, "status", "--porcelain") == ""  # dvc.lock and tracked files unchanged


# -------------------------------------------------------------------------- cache safety


def drop_capabilities() -> None:
    """In a child about to exec: drop every capability so file modes apply even to root."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop = 24
    for cap in range(64):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def open_for_writing_as_plain_user(path: Path) -> subprocess.CompletedProcess:
    """Try `open(path, 'r+b')` in a child without privileges (as any non-root user would)."""
    code = "import sys; open(sys.argv[1], 'r+b').write(b'corrupt')"
    return subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        preexec_fn=drop_capabilities if os.geteuid() == 0 else None,
    )


@pytest.mark.slow
def test_workspace_output_cannot_corrupt_cache(tmp_path: Path, env: dict[str, str]) -> None:
    """With the project cache type, outputs share storage with the cache but are read-only."""
    repo = tmp_path / "repo"
    init_repo(repo, env)
    (repo / "ckpt").mkdir()
    (repo / "ckpt" / "params.bin").write_bytes(os.urandom(1_000_000))
    dvc(repo, env, "add", "-q", "ckpt")
    workspace = repo / "ckpt" / "params.bin"
    digest = hashlib.md5(workspace.read_bytes()).hexdigest()
    cached = repo / ".dvc" / "cache" / "files" / "md5" / digest[:2] / digest[2:]

    assert workspace.stat().st_ino == cached.stat().st_ino  # no second copy on disk
    assert workspace.stat().st_mode & 0o222 == 0  # no write bit for anyone

    attempt = open_for_writing_as_plain_user(workspace)
    assert attempt.returncode != 0 and "PermissionError" in attempt.stderr, attempt.stderr
    assert hashlib.md5(cached.read_bytes()).hexdigest() == digest

    # The supported way to edit: unprotect gives the workspace its own writable copy.
    dvc(repo, env, "unprotect", "ckpt")
    workspace.write_bytes(b"edited")
    assert hashlib.md5(cached.read_bytes()).hexdigest() == digest
    assert "modified" in dvc(repo, env, "status")
