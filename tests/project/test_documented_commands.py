"""Every doit command line in README.md and docs/ works as typed: doit's own parser takes it, with
the options of the task as dodo.py declares them; a value split from `--set` is refused with the
form that works."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doit import doit_cmd
from doit.cmdparse import CmdOption, CmdParse
from doit.doit_cmd import DoitMain

import dodo

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.docs, pytest.mark.cloud_contract]
DOIT_COMMANDS = {"list", "help", "info", "run", "clean", "forget", "ignore", "auto", "dumpdb", "strace",
                 "tabcompletion", "reset-dep"}


def documented_lines() -> list[tuple[str, str]]:
    """(file, command line) of each `doit ...` command in code blocks and inline code of the docs.

    Usage synopses (`[--option]`, `...`) are not commands and are left out."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL)
        lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`(doit [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.DOTALL))
        for line in lines:
            line = line.strip().removeprefix("$ ").split("  #")[0].split(" # ")[0].strip()
            if line.startswith("doit ") and "[" not in line and "..." not in line:
                found.append((path.name, line))
    return found


def parse(line: str) -> dict:
    """The task options doit would give the action, by doit's own parsing steps."""
    words = DoitMain().process_args(shlex.split(line)[1:])   # takes KEY=VALUE words off as variables
    taken = dict(doit_cmd._CMDLINE_VARS)
    assert not taken, f"doit takes {taken} off as variables: no task sees them"
    if words and words[0] in DOIT_COMMANDS:
        return {}
    task, *options = words
    declared = getattr(dodo, f"task_{task}")()
    values, rest = CmdParse([CmdOption(p) for p in declared.get("params", [])]).parse(options)
    assert not rest or "pos_arg" in declared, f"{rest} are not options of {task}"  # pos_arg: the words left
    return dict(values)


LINES = documented_lines()


def test_the_docs_have_commands_to_check():
    assert len(LINES) >= 15 and any("--set=" in line for _, line in LINES)


@pytest.mark.parametrize(("source", "line"), LINES, ids=[f"{s}:{line[:60]}" for s, line in LINES])
def test_a_documented_command_parses(source: str, line: str):
    values = parse(line)
    for word in shlex.split(line):
        if word.startswith("--set="):
            assert word.removeprefix("--set=") in values["set"]


def test_a_value_split_from_set_is_refused_with_the_form_that_works(tmp_path: Path):
    proc = subprocess.run([sys.executable, "-m", "doit", "-f", str(ROOT / "dodo.py"), "-d", str(tmp_path),
                           "preflight", "--set", "steps=2000", "--set", "sft.preset=embedded-sft"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "doit took `steps=2000 sft.preset=embedded-sft` off the command line" in proc.stderr, proc.stderr
    assert "--set=KEY=VALUE (e.g. --set=steps=2000)" in proc.stderr


@pytest.mark.first_hour
def test_a_documented_run_with_settings_names_the_tutorial_and_the_target():
    """A `doit vm_run --set=...` in the docs that names no preset would train the tiny embedded default,
    both branches, on the paid TPU: every such command sets a branch's preset and a target stage."""
    runs = [(source, line) for source, line in LINES if line.startswith("doit vm_run") and "--set=" in line]
    assert runs, "no documented vm_run with --set"
    for source, line in runs:
        values = parse(line)
        assert any(v.split("=")[0] in ("sft.preset", "rl.preset") for v in values["set"]), (source, line)
        assert values["target"], (source, line)
