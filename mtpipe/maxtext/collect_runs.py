"""Run directories no current recipe names, with their sizes; ``--delete`` removes them.

A killed training leaves its run directory for the run that resumes it: the next one with the same
recipe. Once the recipe changed (other params, code, inputs), nothing resumes it any more and its
checkpoints stay: in work/<stage>/ (the scratch files and local run directories), under
MTPIPE_WORK_DIR (on the VM: /dev/shm, which is host memory) and in the work bucket
(MTPIPE_WORK_BUCKET). The current run names are the training stages' recipes as the views and
inputs are now (mtpipe.maxtext.run_dir.run_name); a stage whose inputs are not here (a clone before
`dvc pull`) names none, and then none of its directories is listed. A directory whose lease a live
run holds is never removed.

    python -m mtpipe.maxtext.collect_runs            # list
    python -m mtpipe.maxtext.collect_runs --delete   # and remove
On the VM: `doit vm_shell`, then the same in ~/mtpipe with the pipeline's environment.
"""

from __future__ import annotations

import argparse
import shutil
from dataclasses import dataclass
from pathlib import Path

from mtpipe.errors import ConfigError
from mtpipe.maxtext import run_dir as rd
from mtpipe.pipeline.stage import WORK


@dataclass(frozen=True)
class Left:
    """A run directory nothing resumes: where it is, its size, and who holds it (None: nobody)."""

    url: str
    size: int
    holder: str | None


def current() -> dict[str, set[str] | None]:
    """stage -> the run names its recipes give now (None: a branch's inputs are missing, so unknown)."""
    names: dict[str, set[str] | None] = {}
    for stage, branch in rd.TRAINING:
        try:
            name = rd.run_name(stage, branch)
        except (FileNotFoundError, ConfigError):
            names[stage] = None
            continue
        if names.get(stage, set()) is not None:
            names[stage] = names.get(stage, set()) | {name}
    return names


def _places() -> list[str]:
    """The bases run directories live under: work/, MTPIPE_WORK_DIR, the work bucket."""
    places = {str(WORK), str(rd.work_dir())}
    if bucket := rd.work_bucket():
        places.add(bucket)
    return sorted(places)


def left_behind() -> list[Left]:
    """Every run directory under the places of :func:`_places` that no current recipe names."""
    names, found = current(), []
    for base in _places():
        for stage in rd.RECIPE_INPUTS:
            kept = names.get(stage)
            if kept is None:
                continue
            for run in _listed(f"{base}/{stage}"):
                if run.rsplit("/", 1)[-1] not in kept:
                    directory = rd.RunDir(f"{base}/{stage}", run.rsplit("/", 1)[-1], Path(run))
                    found.append(Left(directory.url, _size(directory.url), directory.holder()))
    return found


def _listed(url: str) -> list[str]:
    if url.startswith("gs://"):
        fs = rd.gcs()
        return [f"gs://{p}" for p in fs.ls(url, detail=False)] if fs.exists(url) else []
    path = Path(url)
    return sorted(str(p) for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


def _size(url: str) -> int:
    if url.startswith("gs://"):
        return int(rd.gcs().du(url))
    return sum(p.stat().st_size for p in Path(url).rglob("*") if p.is_file())


def remove(left: Left) -> None:
    if left.url.startswith("gs://"):
        rd.gcs().rm(left.url, recursive=True)
    else:
        shutil.rmtree(left.url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delete", action="store_true", help="remove them (never one a live run holds)")
    args = parser.parse_args()
    unknown = sorted(stage for stage, names in current().items() if names is None)
    if unknown:
        print(f"not looked at: {', '.join(unknown)} (an input of its recipe is missing: `dvc pull` first)")
    left = left_behind()
    for item in left:
        note = f"held by {item.holder}, kept" if item.holder else ("removed" if args.delete else "")
        if args.delete and not item.holder:
            remove(item)
        print(f"{item.size / 1e9:8.3f} GB  {item.url}" + (f"  ({note})" if note else ""))
    total = sum(item.size for item in left if not item.holder)
    print(f"{len(left)} run directories no current recipe names, {total / 1e9:.3f} GB"
          + (" removed" if args.delete else ": `python -m mtpipe.maxtext.collect_runs --delete` removes them"))


if __name__ == "__main__":
    main()
