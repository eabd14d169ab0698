"""Pinned Hugging Face downloads and local copies, used by the hf_download stage.

A source is a mapping (from the run config), one of:

* ``{kind: hub, repo_id: org/name, revision: <40-hex commit sha>, allow_patterns: [...]}``
* ``{kind: local, path: <directory>, allow_patterns: [...]}``

``allow_patterns`` is optional. Models default to :data:`MODEL_PATTERNS`; datasets default to the
files of ``splits: [train_sft, ...]`` (narrowed to one config directory by ``subset: main``).
Files land in ``<dest>.partial`` first, are checked, then renamed to ``dest``, so an interrupted or
failed fetch never leaves an output DVC would trust. An interrupted Hub download resumes: the
``.partial`` directory keeps what was complete, and every file is verified against the Hub's listing.

HF_TOKEN and HF_ENDPOINT come from the environment only; the token is never logged or returned.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import filter_repo_objects

from mtpipe.errors import ConfigError

log = logging.getLogger(__name__)

MODEL_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja")
DEFAULT_ENDPOINT = "https://huggingface.co"
_COMMIT_SHA = re.compile(r"[0-9a-f]{40}")
_HF_CACHE = Path(".cache") / "huggingface"  # metadata that snapshot_download(local_dir=...) leaves


def fetch_model(source: Mapping, dest: Path) -> dict:
    """Fetch a model (config, safetensors, tokenizer files) into ``dest``; return its manifest."""
    return _fetch(source, Path(dest), "model", _patterns(source, MODEL_PATTERNS, "model"))


def fetch_dataset(source: Mapping, dest: Path) -> dict:
    """Fetch the split files of a dataset into ``dest``; return its manifest."""
    default = () if source.get("allow_patterns") else _split_patterns(source)
    return _fetch(source, Path(dest), "dataset", _patterns(source, default, "dataset"))


def file_sha256(manifest: dict, under: str = "files") -> dict[str, str]:
    """A manifest's sha256 per file, keyed by its path in the output (``<under>/<path>``)."""
    return {f"{under}/{f['path']}": f["sha256"] for f in manifest["files"]}


def _split_patterns(source: Mapping) -> list[str]:
    """Patterns for the files of the given splits: ``[subset/]split-*.parquet``, ``split.jsonl``, ..."""
    splits = source.get("splits")
    if isinstance(splits, str):
        splits = [splits]
    if not splits:
        raise ConfigError(
            _key("dataset", "splits"),
            "the dataset source names neither splits nor allow_patterns, so which files to fetch is unknown",
            "set splits: [train_sft] (and subset: <config> for multi-config repos such as openai/gsm8k) "
            "or allow_patterns: ['data/train_sft-*.parquet']",
        )
    subset = source.get("subset")
    parent = f"{subset}/" if subset else ""
    return [p for split in splits for p in (f"{parent}{split}[-.]*", f"*/{parent}{split}[-.]*")]


def _patterns(source: Mapping, default: Sequence[str], repo_type: str) -> list[str]:
    patterns = source.get("allow_patterns") or default
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    if not all(isinstance(p, str) and p for p in patterns):
        raise ConfigError(
            _key(repo_type, "allow_patterns"), f"{patterns!r} is not a list of glob strings", "write e.g. ['*.json']"
        )
    return patterns


def _fetch(source: Mapping, dest: Path, repo_type: str, patterns: list[str]) -> dict:
    kind = source.get("kind")
    partial = dest.with_name(dest.name + ".partial")
    if kind == "hub":
        repo_id, revision = _hub_source(source, repo_type)
        manifest = {"kind": "hub", "repo_type": repo_type, "repo_id": repo_id, "revision": revision}
        files = _download(repo_id, revision, repo_type, patterns, partial)
    elif kind == "local":
        src = _local_source(source, repo_type)
        manifest = {"kind": "local", "repo_type": repo_type, "path": str(src), "revision": None}
        files = _copy(src, patterns, partial, repo_type)
    else:
        raise ConfigError(
            _key(repo_type, "kind"),
            f"{kind!r} is not a source kind",
            "use kind: hub (a Hub repo at a commit sha) or kind: local",
        )
    shutil.rmtree(partial / _HF_CACHE, ignore_errors=True)
    if (partial / ".cache").is_dir() and not any((partial / ".cache").iterdir()):
        (partial / ".cache").rmdir()
    if dest.exists():
        shutil.rmtree(dest)
    partial.rename(dest)
    manifest["allow_patterns"] = patterns
    manifest["files"] = [{"path": p, "size": size, "sha256": sha} for p, (size, sha, _) in sorted(files.items())]
    log.info("fetched %d files (%d bytes) into %s", len(files), sum(f[0] for f in files.values()), dest)
    return manifest


def _hub_source(source: Mapping, repo_type: str) -> tuple[str, str]:
    repo_id = source.get("repo_id")
    if not isinstance(repo_id, str) or not repo_id:
        raise ConfigError(_key(repo_type, "repo_id"), "missing for a kind: hub source", "set repo_id: <org>/<name>")
    revision = source.get("revision")
    if not isinstance(revision, str) or not _COMMIT_SHA.fullmatch(revision):
        raise ConfigError(
            _key(repo_type, "revision"),
            f"{revision!r} is not a 40-character commit sha, and branch or tag names move",
            f"pin a full commit sha of {repo_id}, listed at {repo_url(repo_id, repo_type)}/commits/main",
        )
    return repo_id, revision


def _local_source(source: Mapping, repo_type: str) -> Path:
    path = source.get("path")
    if not path or not Path(path).is_dir():
        raise ConfigError(
            _key(repo_type, "path"),
            f"local source directory {path!r} does not exist",
            "run `dvc repro make_embedded` to build the embedded default, or point path at an existing directory",
        )
    return Path(path)


def _download(repo_id: str, revision: str, repo_type: str, patterns: list[str], partial: Path) -> dict:
    """snapshot_download into ``partial`` (resuming what is there), then verify against the listing."""
    endpoint = _endpoint()
    token = os.environ.get("HF_TOKEN") or False  # False: never fall back to a token file on disk
    with _hub_errors(repo_id, revision, repo_type):
        listing = {
            f.path: f
            for f in HfApi(endpoint=endpoint, token=token).list_repo_tree(
                repo_id, repo_type=repo_type, revision=revision, recursive=True
            )
            if isinstance(f, RepoFile)
        }
        wanted = set(filter_repo_objects(listing, allow_patterns=patterns))
        if not wanted:
            raise ConfigError(
                _key(repo_type, "allow_patterns"),
                f"no file of {repo_id}@{revision} matches {patterns}",
                f"choose patterns from the file list at {repo_url(repo_id, repo_type)}/tree/{revision}",
            )
        log.info("downloading %d files of %s %s@%s from %s", len(wanted), repo_type, repo_id, revision, endpoint)
        partial.mkdir(parents=True, exist_ok=True)
        snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision,
            allow_patterns=patterns,
            local_dir=partial,
            token=token,
            endpoint=endpoint,
        )
    for stale in set(_files(partial)) - wanted:  # left by an earlier interrupted run with other settings
        (partial / stale).unlink()
    files = {path: _hash_file(partial / path) for path in _files(partial)}
    bad = sorted(p for p in wanted if p not in files or not _matches(listing[p], *files[p]))
    if bad:
        shutil.rmtree(partial)
        raise ConfigError(
            _key(repo_type, "revision"),
            f"{len(bad)} downloaded file(s) of {repo_id}@{revision} differ from the Hub listing: {bad[:3]}",
            "rerun the stage (the partial download was removed); if it repeats, check HF_ENDPOINT and any proxy",
        )
    return files


def _matches(remote: RepoFile, size: int, sha256: str, git_sha1: str) -> bool:
    """LFS files are addressed by sha256, regular files by their git blob id."""
    if remote.lfs is not None:
        return remote.lfs.size == size and remote.lfs.sha256 == sha256
    return remote.size == size and remote.blob_id == git_sha1


def _copy(src: Path, patterns: list[str], partial: Path, repo_type: str) -> dict:
    shutil.rmtree(partial, ignore_errors=True)
    chosen = list(filter_repo_objects(_files(src), allow_patterns=patterns))
    if not chosen:
        raise ConfigError(
            _key(repo_type, "allow_patterns"), f"no file in {src} matches {patterns}", f"list {src}, fix the patterns"
        )
    for rel in chosen:
        (partial / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, partial / rel)
    return {rel: _hash_file(partial / rel) for rel in chosen}


def _files(root: Path) -> list[str]:
    """Relative posix paths of the regular files under ``root``, without huggingface_hub's metadata."""
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and not p.relative_to(root).is_relative_to(_HF_CACHE)
    )


def _hash_file(path: Path) -> tuple[int, str, str]:
    """(size, sha256, git blob sha1) in one read."""
    size = path.stat().st_size
    sha256, git_sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            sha256.update(chunk)
            git_sha1.update(chunk)
    return size, sha256.hexdigest(), git_sha1.hexdigest()


def _key(repo_type: str, name: str) -> str:
    """The config key of a source setting, e.g. ``model.source.revision``."""
    return f"{repo_type}.source.{name}"


def gated(source: Mapping, repo_type: str) -> str | bool:
    """What the Hub says of a pinned repo's access (False, "auto" or "manual"), asked with HF_TOKEN if set."""
    repo_id, revision = _hub_source(source, repo_type)
    api = HfApi(endpoint=_endpoint(), token=os.environ.get("HF_TOKEN") or False)  # False: no token file
    info = api.model_info if repo_type == "model" else api.dataset_info
    with _hub_errors(repo_id, revision, repo_type):
        return info(repo_id, revision=revision).gated


def repo_url(repo_id: str, repo_type: str) -> str:
    """The repo's page on the Hub (or on HF_ENDPOINT)."""
    return f"{_endpoint()}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


@contextmanager
def _hub_errors(repo_id: str, revision: str, repo_type: str) -> Iterator[None]:
    """Turn huggingface_hub / network errors into ConfigErrors that say what to do."""
    url = repo_url(repo_id, repo_type)
    try:
        yield
    except RevisionNotFoundError as err:
        raise ConfigError(
            _key(repo_type, "revision"),
            f"{revision} is not a commit of {repo_id}",
            f"copy a commit sha from {url}/commits/main",
        ) from err
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status in (401, 403) and not os.environ.get("HF_TOKEN"):
            raise ConfigError(
                "HF_TOKEN",
                f"{repo_id} is gated or private (HTTP {status}) and HF_TOKEN is not set",
                f"accept the license at {url} while logged in, create a read token at "
                f"{_endpoint()}/settings/tokens, then `export HF_TOKEN=...` in the shell that runs the pipeline",
            ) from err
        if status in (401, 403):
            raise ConfigError(
                "HF_TOKEN",
                f"the token in HF_TOKEN lacks access to {repo_id} (HTTP {status})",
                f"accept the license at {url} with the account that owns the token, or export a token with read access",
            ) from err
        if isinstance(err, RepositoryNotFoundError):
            raise ConfigError(
                _key(repo_type, "repo_id"),
                f"{repo_type} repo {repo_id} does not exist on {_endpoint()}",
                "check the spelling",
            ) from err
        raise ConfigError("HF_ENDPOINT", f"{_endpoint()} answered HTTP {status} for {repo_id}", "retry later") from err
    except (httpx.TransportError, OfflineModeIsEnabled) as err:
        raise ConfigError(
            "HF_ENDPOINT",
            f"cannot reach {_endpoint()} ({type(err).__name__})",
            "check the network, HF_ENDPOINT, and that HF_HUB_OFFLINE is unset",
        ) from err
