"""Committed AOT compile results of the shipped tutorial presets: `doit preflight` answers from them
where MaxText cannot compile (the control environment of `make control`: no JAX, no MaxText's stack).

One file per preset, ``mtpipe/planning/compiled/<branch>-<preset>.json``: the result preflight's compile
child wrote (:func:`mtpipe.planning.aot.compile_step`) and the key it holds for, the digest of
the work/preflight/ cache and what that digest hashes (trainer module, the compile arguments that shape
the step, the MaxText/JAX/libtpu versions, the cache format). preflight reads one when its own cache
misses and the digest is the one it computes now (:func:`mtpipe.planning.aot.committed`); otherwise
it says what moved (:func:`mismatch`). To record them again, in the full environment (`make`):

    python -m mtpipe.planning.compiled_presets [--preset NAME ...]

about 10-15 minutes of compile per preset on 2 cores (none for one compiled before in work/preflight/).
Rerun it when requirements-vm.lock moves MaxText, JAX or libtpu, or a preset changes its shapes:
tests/planning/test_compiled_presets.py fails then and names this command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mtpipe.pipeline.config import ROOT
from mtpipe.planning import aot

FOLDER = aot.COMMITTED
RECORD_COMMAND = "python -m mtpipe.planning.compiled_presets"
# The presets the project ships results for, each with its branch.
SHIPPED = {"gemma3-4b-ultrachat-v6e8": "sft", "llama3.1-8b-gsm8k-v6e8": "rl",
           "gemma3-4b-ultrachat-v6e32": "sft", "llama3.1-8b-gsm8k-v6e32": "rl",
           "gemma3-4b-ultrachat-v5p8": "sft", "gemma3-4b-ultrachat-tpu7x8": "sft"}


def path(branch: str, preset: str) -> Path:
    """The committed result file of a branch's preset."""
    return FOLDER / f"{branch}-{preset}.json"


def _args(key: dict[str, Any]) -> dict[str, str]:
    """A compile key's arguments by name."""
    return dict(arg.partition("=")[::2] for arg in key["args"])


def mismatch(branch: str, preset: str, key: dict[str, Any]) -> str:
    """Why the committed result of ``preset`` is not the one of this step (``key``: the compile key
    preflight computes now): other versions, or another shape; "" when none is committed for it."""
    file = path(branch, preset)
    if not file.is_file():
        return ""
    theirs, where = json.loads(file.read_text())["key"], file.relative_to(ROOT)
    moved = [f"{name} {theirs['versions'].get(name)} there, {version} here"
             for name, version in key["versions"].items() if theirs["versions"].get(name) != version]
    moved += [f"{name} {theirs[field]} there, {key[field]} here"
              for name, field in (("trainer", "module"), ("cache format", "format")) if theirs[field] != key[field]]
    if moved:
        return (f"the committed {where} was compiled by another toolchain, {'; '.join(moved)}: refresh it with "
                f"`{RECORD_COMMAND}` in the full environment (`make`)")
    ours, recorded = _args(key), _args(theirs)
    differ = [f"{name}={recorded.get(name, '(unset)')} there, {ours.get(name, '(unset)')} here"
              for name in sorted(ours.keys() | recorded.keys()) if ours.get(name) != recorded.get(name)]
    return f"the committed {where} is of another shape, {'; '.join(differ)}"


def record(preset: str, root: Path = ROOT) -> Path:
    """Write ``preset``'s committed file: its training step as `doit preflight --set=<branch>.preset=
    <preset>` compiles it (from work/preflight/ when compiled before)."""
    branch = SHIPPED[preset]
    _, _, views = aot.composed_views([f"{branch}.preset={preset}"], root, (branch,), committed=False)
    module, args = aot.training_step(views[branch])
    work = root / "work" / "preflight"
    result = aot.compile_step(module, args, work, work / f"{branch}-{preset}.log")
    result = {k: v for k, v in result.items() if k not in ("cached", "committed")}
    key = aot.compile_key(module, args)
    FOLDER.mkdir(exist_ok=True)
    file = path(branch, preset)
    digest = aot.compile_digest(module, args)
    file.write_text(json.dumps({"branch": branch, "preset": preset, "digest": digest, "key": key, "result": result},
                               indent=1) + "\n")
    return file


def main(argv: list[str] | None = None) -> int:
    """Record the shipped presets' compile results (all, or those named)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", action="append", choices=sorted(SHIPPED), help="only this one (repeatable)")
    presets = parser.parse_args(argv).preset or list(SHIPPED)
    if not aot.can_compile():
        sys.exit(f"mtpipe: {RECORD_COMMAND} compiles with MaxText, which this environment lacks: run it with the "
                 "full environment's python (`make`, then .venv/bin/python)")
    for preset in presets:
        start = time.monotonic()
        file = record(preset)
        print(f"{file.relative_to(ROOT)}: recorded in {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
