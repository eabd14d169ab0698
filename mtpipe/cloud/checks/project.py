"""Checks before spending of the project as the VM will run it (HEAD's params.yaml with each
experiment's `--set` values applied): every branch composes (what the `configure` stage checks),
HF_TOKEN is set and may download each gated Hub model or dataset of a composed preset, the default
DVC remote is the one HEAD's .dvc/config ships and accepts a write. :func:`check_project` runs alone
before code is shipped to a VM that already runs. Each failure is a ConfigError naming the key and the fix.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mtpipe.cloud.checks.gcp import identity
from mtpipe.cloud.settings.vm_config import VmConfig
from mtpipe.data import hub, hub_access
from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, maxtext_check, overrides
from mtpipe.pipeline.schema import SftBranch


def check_project(cfg: VmConfig, root: Path, experiments: list[list[str]]) -> None:
    """For each experiment's `--set` values the branches compose and gated Hub repos have
    HF_TOKEN; the DVC remote is writable."""
    check_hub_tokens([branch for sets in experiments
                      for branch in composed_branches(root, sets).values()])
    identity.shipped_remote(root)   # the VM's dvc reads HEAD's .dvc/config, not this checkout's
    check_remote_writable(root, float(cfg.remote_probe_timeout_s))


def composed_branches(root: Path, sets: list[str]) -> dict[str, SftBranch]:
    """Every branch composed from HEAD's params.yaml with `sets` applied as `dvc exp run -S` does."""
    params = overrides.apply_sets(overrides.committed_params(root), sets)
    return {branch: maxtext_check.compose_checked(branch, params) for branch in config.BRANCH_STAGES}


def check_hub_tokens(branches: Iterable[SftBranch]) -> None:
    """Every Hub repo of the branches that is gated may be downloaded with HF_TOKEN (:func:`check_hub_repo`)."""
    for repo in hub_repos(branches):
        check_hub_repo(repo)


@dataclass(frozen=True)
class HubRepo:
    """A pinned Hub model or dataset a branch downloads (the first branch that names it)."""

    branch: str
    repo_type: str
    source: dict[str, Any]

    @property
    def repo_id(self) -> str:
        return self.source["repo_id"]


def hub_repos(branches: Iterable[SftBranch]) -> list[HubRepo]:
    """The Hub models and datasets of the branches, each pinned repo once."""
    found: dict[tuple[str, str, str], HubRepo] = {}
    for cfg in branches:
        for repo_type in ("model", "dataset"):
            source = getattr(cfg, repo_type).source
            if source.kind == "hub":
                found.setdefault((repo_type, source.repo_id, source.revision),
                                 HubRepo(cfg.branch, repo_type, source.model_dump()))
    return list(found.values())


def check_hub_repo(repo: HubRepo) -> str:
    """What the Hub says of the repo's access (its model or dataset info); a gated one needs HF_TOKEN,
    and the Hub's auth check must grant that token's account the repo (mtpipe.data.hub_access.check_access)."""
    access = hub.gated(repo.source, repo.repo_type)
    if not access:
        return "not gated"
    if not os.environ.get("HF_TOKEN"):
        raise ConfigError("HF_TOKEN", f"{repo.repo_id} ({repo.branch}.{repo.repo_type}) is gated "
                          f"({access}) and HF_TOKEN is not set",
                          f"accept its license at {hub.repo_url(repo.repo_id, repo.repo_type)}, "
                          "then `export HF_TOKEN=...` (a read token) before doit")
    hub_access.check_access(repo.source, repo.repo_type)
    return f"gated ({access}); HF_TOKEN's account may download it"


# The laptop's write probe waits at most this long (or remote_probe_timeout_s, if shorter): a bucket that
# answers does so in a second or two, and gcsfs retries an endpoint that does not for most of a minute.
WRITE_PROBE_S = 8.0
CONNECT_S = 3.0                        # to open a connection to the remote's endpoint
GCS_ENDPOINT = "https://storage.googleapis.com"


def check_remote_writable(root: Path, timeout_s: float) -> None:
    """Write and delete a small object on the default DVC remote, through DVC's own filesystem.

    The VM pushes its results there. The probe runs in a thread with a deadline of at most
    :data:`WRITE_PROBE_S`, after a connection to the remote's endpoint (a gs:// remote's
    ``endpointurl``, else Google's) is opened within :data:`CONNECT_S`; meanwhile gcsfs's retry log is
    held back, so a failure is one line.
    """
    from dvc.config import NoRemoteError
    from dvc.repo import Repo

    remote: dict[str, str] = {}
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            with Repo(str(root)) as repo:
                remote["name"] = repo.config["core"].get("remote", "")
                settings = repo.config["remote"].get(remote["name"], {})
                remote["url"] = settings.get("url", "")
                if remote["url"].startswith("gs://"):
                    _reachable(settings.get("endpointurl") or GCS_ENDPOINT)
                odb = repo.cloud.get_remote(command="vm_run").odb
                path = odb.fs.join(odb.path, f".mtpipe-write-probe-{uuid.uuid4().hex}")
                odb.fs.pipe_file(path, b"mtpipe checks that this remote is writable\n")
                odb.fs.rm_file(path)
            outcome.append(None)
        except BaseException as err:   # reported in the caller's thread
            outcome.append(err)

    thread = threading.Thread(target=probe, daemon=True)
    quiet = _Quiet(thread)
    logging.getLogger("gcsfs").addFilter(quiet)
    thread.start()
    limit = min(timeout_s, WRITE_PROBE_S)
    thread.join(limit)
    key = f"remote.{remote.get('name') or '?'}.url"
    fix = ("check the bucket name and endpoint (`dvc remote list`), and that your credentials may "
           "write it (roles/storage.objectAdmin): `dvc push` must work from here")
    if not outcome:
        raise ConfigError(key, f"writing a probe object to {remote.get('url')} took more than {limit:.0f} s", fix)
    err = outcome[0]
    if isinstance(err, NoRemoteError):
        raise ConfigError("core.remote", "no default DVC remote: the VM pushes its results there",
                          "`dvc remote add -d gcs gs://BUCKET/PATH` and commit .dvc/config")
    if err is not None:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ConfigError(key, f"{remote.get('url')} is not writable ({type(err).__name__}: {first})",
                          fix) from err


def _reachable(endpoint: str) -> None:
    """Open (and close) a TCP connection to ``endpoint`` within CONNECT_S; OSError naming it when it fails."""
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=CONNECT_S).close()
    except OSError as err:
        raise OSError(f"cannot reach {endpoint} ({err})") from err


class _Quiet(logging.Filter):
    """Drops gcsfs's log records while ``thread`` (the probe) runs: its retries' tracebacks."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        if self.thread.is_alive() or self.thread.ident is None:
            return False
        logging.getLogger("gcsfs").removeFilter(self)
        return True
