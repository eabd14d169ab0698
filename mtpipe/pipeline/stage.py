"""What every stage script shares: paths, atomic outputs, content digests, recipes, metrics files.

An output directory is written as ``<out>.partial`` and renamed into place only after the stage
checked it, so an interrupted stage never leaves an output that DVC (or a later stage) would trust.
Each output carries ``mtpipe.json``: the stage, the content digest of its other files and what its
bytes imply (a manifest, a step), nothing about how it was made, so a rerun that writes the same
bytes writes the same stamp and nothing downstream reruns. How it was made (the view, the inputs'
content digests) is a training run's :func:`recipe`, which names its run directory under work/ (or
in the work bucket): identical recipes resume a killed run, changed ones start clean.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpipe.errors import ConfigError
from mtpipe.pipeline import stage_table
from mtpipe.pipeline.schema import Source
from mtpipe.pipeline.view import ROOT, View, load_stage, resolved_path

WORK = ROOT / "work"                # untracked: MaxText run dirs (resume), logs, JAX compile cache
# JAX's compile cache is content-addressed, so every workspace of a checkout shares one: DVC_ROOT is the
# checkout where DVC runs a queued experiment in a temporary copy (.dvc/tmp/exps/), which has no work/.
JAX_CACHE = Path(os.environ.get("DVC_ROOT") or ROOT) / "work" / "jax_cache"
TIMINGS = WORK / "timings.jsonl"    # stage wall times (not DVC outputs: they differ run to run)
STAMP = "mtpipe.json"
EMBEDDED_DIR = "embedded"           # make_embedded's output: the twins and datasets of the embedded default
# Hugging Face Hub tokens: only hf_download may hold them (docs/secrets.md).
HUB_TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def artifact(branch: str, name: str) -> Path:
    """``artifacts/<branch>/<name>``: a DVC output of the pipeline."""
    return ROOT / "artifacts" / branch / name


def source_manifest(branch: str, root: Path = ROOT) -> Path:
    """``artifacts/<branch>/source.json``: the sha256 of each file of the embedded directories the branch's
    hf_download copies (``{"model": {path: sha256}, "dataset": ...}``, empty for Hub sources), written by
    make_embedded; hf_download@<branch> depends on it instead of on all of embedded/."""
    return root / stage_table.BY_NAME["make_embedded"].outs[f"source_{branch}"]


def is_embedded(source: Source) -> bool:
    """Whether a source is a directory make_embedded writes (``kind: local`` under embedded/)."""
    return source.kind == "local" and Path(source.path).parts[:1] == (EMBEDDED_DIR,)


def log_path(branch: str, stage: str) -> Path:
    """Where a stage's full MaxText log goes."""
    return WORK / "logs" / branch / f"{stage}.log"


@dataclass(frozen=True)
class StageContext:
    """What a stage script works with (:func:`open_stage`): its view and the paths the stage table
    (:mod:`mtpipe.pipeline.stage_table`, held equal to dvc.yaml) declares for it, absolute."""

    name: str
    branch: str
    view: View
    reads: Mapping[str, Path]    # its inputs besides the view, by name
    outs: Mapping[str, Path]     # what it writes, by name
    metrics: Path | None         # its DVC metrics file
    plots: Path | None           # its DVC plots file

    @property
    def log(self) -> Path:
        """Where its full log goes (work/logs/)."""
        return log_path(self.branch, self.name)


def open_stage(name: str, branch: str) -> StageContext:
    """``name`` in ``branch`` as its script runs it: the view :func:`load_stage` checks, and its paths."""
    declared = stage_table.BY_NAME[name]

    def at(template: str) -> Path:
        return ROOT / declared.path(template, branch)

    return StageContext(name, branch, load_stage(branch, name),
                        {k: at(t) for k, t in declared.reads.items()}, {k: at(t) for k, t in declared.outs.items()},
                        at(declared.metrics) if declared.metrics else None, at(declared.plots) if declared.plots else None)


@contextlib.contextmanager
def atomic_dir(out: Path, resume: bool = False) -> Iterator[Path]:
    """Yield ``<out>.partial``; on success replace ``out`` with it.

    On failure the partial directory is removed, unless ``resume`` (a download that verifies every
    file it keeps) asks to pick it up again on the next run.
    """
    partial = out.with_name(out.name + ".partial")
    if not resume:
        shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True, exist_ok=True)
    try:
        yield partial
    except BaseException:
        if not resume:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(partial, out)


def content_digest(out: Path, sha256: dict[str, str] | None = None) -> str:
    """sha256 of the files under ``out`` but the stamp: their relative paths and their sha256s (taken
    from ``sha256``, relative path -> hex, where the stage already has them, e.g. a download's manifest)."""
    h = hashlib.sha256()
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p != out / STAMP):
        rel = str(path.relative_to(out))
        h.update(f"{rel}\0{sha256[rel] if sha256 and rel in sha256 else file_sha256(path)}\n".encode())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of one file, hex."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tree_sha256(root: Path) -> dict[str, str]:
    """The sha256 of every file under ``root``, by its relative path."""
    return {str(p.relative_to(root)): file_sha256(p) for p in sorted(root.rglob("*")) if p.is_file()}


def recipe(branch: str, stage: str, *inputs: Path) -> str:
    """sha256 of what a stage computes from: its address view (views/<branch>/<stage>.yaml: values,
    code fingerprints, tool versions) and the content digests stamped in its input directories."""
    h = hashlib.sha256(resolved_path(branch, stage).read_bytes())
    for path in inputs:
        h.update(read_stamp(path)["content"].encode())
    return h.hexdigest()


def read_stamp(out: Path) -> dict[str, Any]:
    """The ``mtpipe.json`` of an output; fails if the producing stage did not finish."""
    path = out / STAMP
    if not path.is_file():
        raise FileNotFoundError(f"{out} has no {STAMP}: its stage did not finish; run `dvc repro` for it")
    return json.loads(path.read_text())


def write_stamp(out: Path, stage: str, sha256: dict[str, str] | None = None, **facts: Any) -> None:
    """Mark ``out`` finished: the stage, its content digest (:func:`content_digest`) and ``facts``, which
    must follow from its bytes (never a run name, a path or a config digest)."""
    stamp = {"stage": stage, "content": content_digest(out, sha256), **facts}
    (out / STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write a metrics file (created with its directory) atomically: no half-written file is left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".partial")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class Timer:
    """Wall time of a stage, recorded in work/timings.jsonl."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def seconds(self) -> float:
        return round(time.monotonic() - self.start, 1)

    def record(self, branch: str, stage: str, **speed: float | None) -> None:
        """Append the wall time (and ``speed``, e.g. tokens/s) to work/timings.jsonl.

        They differ run to run, so they stay out of the outputs DVC hashes: a stage rerun on
        identical inputs writes the same bytes, and dvc.lock does not change."""
        line = {"stage": f"{stage}@{branch}", "wall_s": self.seconds(), **speed,
                "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        TIMINGS.parent.mkdir(parents=True, exist_ok=True)
        with TIMINGS.open("a") as f:
            f.write(json.dumps(line) + "\n")


def size_mib(path: Path) -> float:
    """Total size of the files under ``path``, in MiB."""
    return round(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20, 3)


def drop_hub_token() -> None:
    """Restart this process with the same command minus the Hub token variables, if any is set.

    Deleting them from ``os.environ`` is not enough: ``/proc/<pid>/environ`` keeps the environment a
    process was started with, for its whole life. After the restart neither this process nor anything
    it starts (MaxText, its worker processes) has ever held the token. Call it before any work.
    """
    if not any(name in os.environ for name in HUB_TOKEN_ENV):
        return
    env = {name: value for name, value in os.environ.items() if name not in HUB_TOKEN_ENV}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)


def run_stage(main: Callable[..., None], *args: str, hub_token: bool = False) -> None:
    """Run a stage's main; bad input ends it with ``<stage>: <key>: <problem>. Fix: <fix>``, no traceback.

    Only a stage that downloads from the Hub passes ``hub_token=True``; every other one restarts
    without the token first (:func:`drop_hub_token`).
    """
    if not hub_token:
        drop_hub_token()
    try:
        main(*args)
    except ConfigError as err:
        sys.exit(f"{Path(sys.argv[0]).stem}: {err}")
    gc.freeze()  # done: the interpreter's exit frees the modules without a full collection over them


def require(path: Path, what: str) -> Path:
    """Fail loudly when a tool did not produce what it should have."""
    if not path.exists():
        raise RuntimeError(f"{what} missing: {path} (the MaxText command did not produce it)")
    return path
