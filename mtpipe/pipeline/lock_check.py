"""Is the committed record current? dvc.lock against the files git holds, without running the pipeline.

dvc.lock is the record of which code, config and params made the committed metrics and plots. It is
current when every dependency and output of every stage that git tracks (the stage scripts, mtpipe/,
conf/, params.yaml, requirements.lock, the resolved views in views/, metrics/, plots/) has the hash
dvc.lock records for it. DVC's own ``dvc status`` compares them; what it says about files git does not
hold (the artifacts, which live in DVC's cache and remote) is left out, so the check runs on a clean
clone in seconds.

    python -m mtpipe.pipeline.lock_check      # exit 1, naming each stale entry and the fix

The test suite runs it on the files about to be committed (tests/pipeline/test_toolchain.py), so CI fails on a
commit whose dvc.lock does not come from its own code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIX = "run `dvc repro` (it reruns only what changed) and commit dvc.lock, views/, metrics/ and plots/"


def _tracked(root: Path) -> set[str]:
    """Every file git tracks in ``root`` (relative paths)."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    return set(filter(None, out.split("\0")))


def _is_tracked(path: str, tracked: set[str]) -> bool:
    return path in tracked or any(f.startswith(path.rstrip("/") + "/") for f in tracked)


def stale_entries(root: Path = ROOT) -> list[str]:
    """``stage: what`` for each git-tracked dependency or output whose hash is not dvc.lock's."""
    proc = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"dvc status failed in {root}:\n{proc.stderr}")
    lines = proc.stdout.strip().splitlines()
    status = json.loads(lines[-1]) if lines else {}  # warnings, if any, come before the JSON
    tracked = _tracked(root)
    stale = []
    for stage, changes in sorted(status.items()):
        for change in changes:
            if isinstance(change, str):  # e.g. "changed command": dvc.yaml's cmd is not the lock's
                stale.append(f"{stage}: {change}")
                continue
            for kind, paths in change.items():
                for path, state in paths.items():
                    if _is_tracked(path, tracked):
                        what = ", ".join(f"{key} {s}" for key, s in state.items()) if isinstance(state, dict) else state
                        stale.append(f"{stage}: {kind.removeprefix('changed ')} {path} {what}")
    return stale


def main() -> int:
    stale = stale_entries()
    if stale:
        print("dvc.lock does not record the committed files:", *(f"  {s}" for s in stale), f"Fix: {FIX}",
              sep="\n", file=sys.stderr)
        return 1
    print("dvc.lock records the committed code, config, params and views")
    return 0


if __name__ == "__main__":
    sys.exit(main())
