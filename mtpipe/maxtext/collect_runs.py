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
from dataclasses import dataclass

from mtpipe.errors import ConfigError
from mtpipe.maxtext import run_dir as rd
from mtpipe.pipeline.stage import WORK


@dataclass(frozen=True)
class Left:
    """A run directory nothing resumes, its size, and who holds it (None: nobody)."""

    run: rd.RunDir
    size: int
    holder: str | None


def current() -> tuple[dict[str, set[str]], list[str]]:
    """The run names the training recipes give now, by stage, and the stages not looked at: a branch's
    inputs are missing (a clone before `dvc pull`), so which names it would give is unknown."""
    names: dict[str, set[str]] = {}
    unknown: set[str] = set()
    for stage, branch in rd.TRAINING:
        try:
            names.setdefault(stage, set()).add(rd.run_name(stage, branch))
        except (FileNotFoundError, ConfigError):
            unknown.add(stage)
    return {stage: found for stage, found in names.items() if stage not in unknown}, sorted(unknown)


def _places() -> list[str]:
    """The bases run directories live under: work/, MTPIPE_WORK_DIR, the work bucket."""
    places = {str(WORK), str(rd.work_dir())}
    if bucket := rd.work_bucket():
        places.add(bucket)
    return sorted(places)


def left_behind(names: dict[str, set[str]]) -> list[Left]:
    """Every run directory under the places of :func:`_places` that no name of ``names`` (stage -> the run
    names its recipes give now, :func:`current`) is."""
    return [Left(run, run.size(), run.holder()) for base in _places() for stage, kept in names.items()
            for run in rd.run_dirs(f"{base}/{stage}") if run.run_name not in kept]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delete", action="store_true", help="remove them (never one a live run holds)")
    args = parser.parse_args()
    names, unknown = current()
    if unknown:
        print(f"not looked at: {', '.join(unknown)} (an input of its recipe is missing: `dvc pull` first)")
    left = left_behind(names)
    for item in left:
        note = f"held by {item.holder}, kept" if item.holder else ("removed" if args.delete else "")
        if args.delete and not item.holder:
            item.run.delete()
        print(f"{item.size / 1e9:8.3f} GB  {item.run.url}" + (f"  ({note})" if note else ""))
    total = sum(item.size for item in left if not item.holder)
    print(f"{len(left)} run directories no current recipe names, {total / 1e9:.3f} GB"
          + (" removed" if args.delete else ": `python -m mtpipe.maxtext.collect_runs --delete` removes them"))


if __name__ == "__main__":
    main()
