"""xpk's own argument parser as the judge of the xpk command lines mtpipe builds and documents.

xpk is not a dependency of the project (it pins its own google-cloud and kubernetes packages), so
:func:`side_env` installs the pinned ``xpk==XPK_VERSION`` once into a virtual environment of its
own, ``work/xpk_env`` of the checkout (uv from the project's environment; reused while its marker
names the same version). :func:`parse` runs this file there as a script: it builds the parser as
xpk's ``main()`` does (``xpk/parser/core.py::set_parser`` on ``ArgumentParser(prog="xpk")``), with
abbreviated flags refused, and parses each command line. Helper module: plain functions, no fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

XPK_VERSION = "1.13.1"   # the xpk release the command lines are checked against (docs/multihost.md)
ROOT = Path(__file__).resolve().parents[1]
ENV_DIR = ROOT / "work" / "xpk_env"
MARKER = ENV_DIR / "mtpipe-xpk-version"


def side_env() -> Path:
    """The side environment's python with xpk installed, created on first use (file-locked)."""
    from filelock import FileLock

    python = ENV_DIR / "bin" / "python"
    ENV_DIR.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ENV_DIR) + ".lock"):
        if MARKER.exists() and MARKER.read_text() == XPK_VERSION and python.exists():
            return python
        uv = Path(sys.executable).parent / "uv"
        if not uv.exists():
            raise RuntimeError(f"{uv} is missing: the xpk side environment is made with uv from the project's "
                               "environment; run `make venv` (requirements.lock has uv)")
        shutil.rmtree(ENV_DIR, ignore_errors=True)
        for step in (["venv", "--quiet", "--python", sys.executable, str(ENV_DIR)],
                     ["pip", "install", "--quiet", "--python", str(python), f"xpk=={XPK_VERSION}"]):
            done = subprocess.run([str(uv), *step], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"`uv {' '.join(step)}` failed ({done.stderr.strip()[-2000:]}): the xpk side "
                                   f"environment needs PyPI (xpk=={XPK_VERSION} and the versions it pins); "
                                   f"retry with PyPI reachable, or delete {ENV_DIR} if it is half made")
        MARKER.write_text(XPK_VERSION)
    return python


def parse(python: Path, lines: list[list[str]], home: Path) -> list[dict]:
    """Each command line (argv after ``xpk``) as xpk's parser reads it: ``{"ok": True, "command":
    "workload create", "args": {dest: value}}`` or ``{"ok": False, "exit": 2, "error": "..."}``.
    ``home`` is xpk's HOME (it may write its config there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run([str(python), __file__], input=json.dumps(lines), capture_output=True, text=True,
                          env={**env, "HOME": str(home)}, check=False, timeout=120)
    assert done.returncode == 0, f"xpk's parser did not run:\n{done.stdout}\n{done.stderr}"
    return [json.loads(line) for line in done.stdout.splitlines()]


def _main() -> None:
    """In the side environment: parse the JSON list of argv lists on stdin, one JSON result a line."""
    import argparse
    import contextlib
    import io

    from xpk.parser.core import set_parser

    parser = argparse.ArgumentParser(description="xpk command", prog="xpk")
    set_parser(parser=parser)
    parsers = [parser]
    while parsers:   # --flag abbreviations (argparse's default) would hide a misspelt or renamed flag
        current = parsers.pop()
        current.allow_abbrev = False
        for action in current._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
    for argv in json.load(sys.stdin):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
                ns = parser.parse_args(argv)
        except SystemExit as e:
            print(json.dumps({"ok": False, "exit": e.code, "error": err.getvalue()}))
            continue
        args = {k: v for k, v in vars(ns).items() if k != "func"}
        command = " ".join(str(v) for k, v in args.items() if k.startswith("xpk_") and k.endswith("subcommands"))
        print(json.dumps({"ok": True, "command": command, "function": ns.func.__name__, "args": args},
                         default=str))


if __name__ == "__main__":
    _main()
