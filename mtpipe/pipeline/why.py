"""Why does this stage rerun? What moved in a stage's address, in words (docs/why.md).

    python -m mtpipe.pipeline.why train_sft@sft      (or: doit why train_sft@sft)

A stage's address is its view (views/<branch>/<stage>.yaml: the values it reads, the fingerprints of its
code, the versions of its tools) and its input data. The command writes the views as ``configure`` would
write them now, with configure's own code (stages/configure.py, into a scratch directory), and compares
the stage's view with the one dvc.lock recorded (found in git's history by the hash dvc.lock holds). So it
answers both for a stage ``dvc status`` already calls changed and for an edit not yet run: which key moved
(old -> new), which tool version, which module and function's code, which input; which edits move nothing
and by which rule (quoted from the module where the rule is written); whether the stage trains, and what
follows it. When the user judges the change behaviour-free, DVC's own ``dvc commit`` keeps the output
(printed with the stage's name).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, fingerprint, toolchain
from mtpipe.pipeline.stage_table import BRANCH_STAGES, RUN_FILE, TRAINING
from mtpipe.pipeline.view import EMBEDDED_VIEW, ROOT, resolved_path

HISTORY = 200  # how many commits back the recorded view or module is looked for
KEEP = "dvc repro configure && dvc commit --force {stages}"
KEEPABLE = {"code", "tools"}  # what a user may judge behaviour-free; a moved value is another recipe
# Where each rule is written (the module or function whose docstring says it) and the first and last
# words of the sentences quoted.
RULES: dict[str, tuple[ModuleType | Callable, str, str]] = {
    "values": (config, "Each pipeline stage depends on its own file", "a tool's version changes"),
    "code": (fingerprint, "A fingerprint is the sha256", "a reworded log line"),
    "exempt": (fingerprint.stage_modules, "A module that declares itself exempt", "what only it imports"),
    "tools": (toolchain, "The packages are the toolchain packages", "that run that package"),
}


@dataclass
class Explanation:
    """What moved in one stage's address, and what follows from it."""

    stage: str
    view: str  # views/<branch>/<stage>.yaml
    status: list[str] = field(default_factory=list)   # what `dvc status` says changed, in words
    moved: list[str] = field(default_factory=list)    # in the view: recorded by dvc.lock -> written now
    kinds: set[str] = field(default_factory=set)      # what moved in the view: values, code, tools
    inputs: list[str] = field(default_factory=list)   # input data `dvc status` calls changed
    inert: list[str] = field(default_factory=list)    # edits that move nothing in this address
    rules: set[str] = field(default_factory=set)      # the rules that decided (RULES)
    upstream: dict[str, set[str]] = field(default_factory=dict)  # stage before it -> what moved in its view
    downstream: list[str] = field(default_factory=list)
    others: dict[str, set[str]] = field(default_factory=dict)  # other stages whose view the same edits move
    configure_behind: bool = False  # views/ on disk is not what configure writes now
    recorded_found: bool = True
    hardware: str = ""

    def text(self) -> str:
        """The explanation as the command prints it."""
        lines = [f"{self.stage} ({self.view})",
                 "dvc status: " + ("; ".join(self.status) if self.status else "up to date")]
        first = " (configure first: views/ is not yet what the edits make)" if self.configure_behind else ""
        if not self.recorded_found:
            lines.append(f"The view dvc.lock recorded is neither on disk nor in git's last {HISTORY} commits: what "
                         f"moved in it cannot be named (`git log -p {self.view}`).")
        elif self.moved:
            lines.append(f"Its view moved (dvc.lock's -> what configure writes now): `dvc repro` reruns {self.stage}"
                         f"{first}.")
        else:
            lines.append(f"Its view is the one dvc.lock recorded: no edit of params, conf/, code or tools reruns "
                         f"{self.stage}" + (" (configure reruns, about 5 s, and writes the same view)."
                                            if self.configure_behind else "."))
        if self.moved:
            lines += ["What moved:", *(f"  {m}" for m in self.moved)]
        if self.inputs:
            lines += [f"Inputs that moved ({self.stage} reruns for them):", *(f"  {i}" for i in self.inputs)]
        if self.upstream:
            lines += [f"Before it (their view moved: they rerun first; {self.stage} follows only if their output's "
                      "bytes move):", *(f"  {name}: {', '.join(sorted(kinds))}"
                                        for name, kinds in self.upstream.items())]
        if self.inert:
            lines += ["Edits that move nothing here:", *(f"  {i}" for i in self.inert)]
        if self.rules:
            lines.append("The rules that decided:")
            lines += [f"  {kind} ({where}): \"{words}\""
                      for kind in sorted(self.rules) for where, words in [rule(kind)]]
        if self.stage.split("@")[0] in TRAINING:
            lines.append(f"Cost: {self.stage} trains ({self.hardware}).")
        if self.downstream:
            lines.append("After it (each reruns when its inputs' bytes move): " + ", ".join(self.downstream))
        if self.others:
            lines.append("The same edits also move the view of: " + ", ".join(
                f"{name} ({', '.join(sorted(kinds))})" for name, kinds in self.others.items()))
        if self.moved and not self.inputs and self.kinds.union(*self.upstream.values()) <= KEEPABLE:
            keep = [self.stage, *self.upstream, *(name for name, kinds in self.others.items() if kinds <= KEEPABLE)]
            lines += ["If you judge the change behaviour-free, keep the outputs instead of rerunning them:",
                      f"  {KEEP.format(stages=' '.join(keep))}",
                      "  (configure writes the new views; DVC's commit records the new addresses with the outputs "
                      "as they are: `dvc status` is then clean and nothing reruns)"]
        return "\n".join(lines)


def rule(kind: str) -> tuple[str, str]:
    """(where, words) of a rule of :data:`RULES`: the file, and the sentences quoted from the docstring."""
    source, first, last = RULES[kind]
    words = " ".join((source.__doc__ or "").split())
    start = words.find(first)
    if start < 0 or last not in words[start:]:
        raise RuntimeError(f"{source.__name__}'s docstring no longer says {first!r} ... {last!r}: "
                           "update RULES in mtpipe/pipeline/why.py")
    end = words.find(".", words.index(last, start) + len(last)) + 1 or len(words)
    where = str(Path(inspect.getsourcefile(source) or "").resolve().relative_to(ROOT))
    return where, words[start:end].replace("``", "`")


def view_of(stage: str) -> tuple[str, str]:
    """(branch, stage) of a DVC stage name: ``train_sft@sft`` -> (sft, train_sft), ``train_rl`` -> (rl, train_rl)."""
    if stage == EMBEDDED_VIEW[1]:
        return EMBEDDED_VIEW
    if stage == "configure":
        raise ConfigError(stage, "has no view: it reruns (about 5 s) whenever stages/, mtpipe/, conf/, "
                          "requirements.lock or params.yaml change, and writes the views of the others",
                          "ask about a stage it feeds, e.g. `doit why train_sft@sft`")
    base, _, branch = stage.partition("@")
    owners = {s: [b for b, stages in BRANCH_STAGES.items() if s in stages]
              for s in dict.fromkeys(s for stages in BRANCH_STAGES.values() for s in stages)}
    found = [b for b in owners.get(base, []) if branch == b or not branch and len(owners[base]) == 1]
    if len(found) != 1:
        names = [EMBEDDED_VIEW[1], *(f"{s}@{b}" if len(bs) > 1 else s for s, bs in owners.items() for b in bs)]
        raise ConfigError(stage, "is not a stage with a view", f"name one of {', '.join(names)} (`dvc stage list`)")
    return found[0], base


def md5(text: str) -> str:
    """The hash dvc.lock records for a file (``hash: md5``)."""
    return hashlib.md5(text.encode()).hexdigest()


def git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""


def versions(root: Path, path: str) -> Iterator[str]:
    """The texts of ``path``: on disk, then as committed, newest first (``HISTORY`` commits)."""
    if (root / path).is_file():
        yield (root / path).read_text()
    for rev in git(root, "log", f"-n{HISTORY}", "--format=%H", "--", path).split():
        yield git(root, "show", f"{rev}:{path}")


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``a.b.c`` -> value of every leaf of a nested mapping (an empty mapping has none)."""
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): tree}


ABSENT = object()  # a key one side does not have


def spelled(value: Any) -> str:
    """A value as YAML spells it (``null``, ``true``, ``''``), or ``(not set)`` for a key that is not there."""
    if value is ABSENT:
        return "(not set)"
    return yaml.safe_dump(value, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def changes(old: dict, new: dict) -> list[tuple[str, str, str]]:
    """(key, old, new) of every leaf that differs, sorted by key, the values spelled as YAML spells them."""
    before, after = flat(old), flat(new)
    return [(k, spelled(before.get(k, ABSENT)), spelled(after.get(k, ABSENT)))
            for k in sorted(before.keys() | after.keys()) if before.get(k, ABSENT) != after.get(k, ABSENT)]


def code_moved(root: Path, module: str, old: str | None, new: str | None) -> str:
    """A module whose fingerprint moved, in words: which functions, or whether it came in or went out."""
    if old is None:
        return f"code   {module}: now run by this stage (a new import or child process)"
    if new is None:
        return f"code   {module}: no longer run by this stage"
    source = next((text for text in versions(root, module) if fingerprint.source_fingerprint(text) == old), None)
    if source is None:
        return f"code   {module}: changed (the recorded version is not in git's last {HISTORY} commits)"
    before = fingerprint.part_fingerprints(source)
    after = fingerprint.part_fingerprints((root / module).read_text())
    parts = [name for name in sorted(before.keys() | after.keys()) if before.get(name) != after.get(name)]
    return f"code   {module}: {', '.join(parts) or 'moved'}"


def edited_modules(root: Path) -> list[str]:
    """Project modules whose text differs from the last commit's (or that git does not hold yet)."""
    listed = git(root, "diff", "--name-only", "HEAD", "--", *fingerprint.PACKAGES).split()
    listed += git(root, "ls-files", "--others", "--exclude-standard", "--", *fingerprint.PACKAGES).split()
    return sorted(p for p in set(listed) if p.endswith(".py") and (root / p).is_file())


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def explain(stage: str) -> Explanation:
    """What moved in ``stage``'s address in this project: against dvc.lock's record, for what DVC already
    calls changed and for edits not yet run."""
    from stages.configure import write_views  # the stage's own code: the views it would write, no copy of it

    view_of(stage)  # a name that is no stage with a view stops here, before configure's few seconds
    with tempfile.TemporaryDirectory(prefix="mtpipe-why-") as scratch:
        write_views(Path(scratch))
        return _explain(stage, ROOT, Path(scratch))


def _explain(stage: str, root: Path, scratch: Path) -> Explanation:
    """:func:`explain`, with the views configure writes now under ``scratch``."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        graph = repo.index.graph
        nodes = {node.addressing: node for node in graph}
        if stage not in nodes:
            raise ConfigError(stage, "is not a stage of dvc.yaml", f"name one of {', '.join(sorted(nodes))}")
        status = repo.status(targets=[stage]).get(stage, [])
        downstream = sorted(n.addressing for n in nx.ancestors(graph, nodes[stage]))
        upstream = sorted(n.addressing for n in nx.descendants(graph, nodes[stage]) if n.addressing != "configure")
        producers = {out.def_path: n.addressing for n in graph for out in n.outs}
    lock = load(root / "dvc.lock").get("stages") or {}
    branch, base = view_of(stage)
    view = str(resolved_path(branch, base, root).relative_to(root))
    result = Explanation(stage, view)
    for change in status:
        result.status += [change] if isinstance(change, str) else [
            f"{kind.removeprefix('changed ')} {path} {state if isinstance(state, str) else 'modified'}"
            for kind, paths in change.items() for path, state in paths.items()]
        if isinstance(change, dict):
            result.inputs += [f"{path}: {state}" + (f" ({producers[path]}'s output)" if path in producers else "")
                              for path, state in change.get("changed deps", {}).items() if path != view]

    def view_path(name: str) -> str:
        return str(resolved_path(*view_of(name), root).relative_to(root))

    def digest_of(name: str) -> str | None:
        """The hash dvc.lock recorded for the view of ``name`` (None when it never ran)."""
        deps = (lock.get(name) or {}).get("deps", [])
        return next((d.get("md5") for d in deps if d["path"] == view_path(name)), None)

    def recorded(name: str) -> dict | None:
        """The view of ``name`` that dvc.lock recorded ({} when it never ran), or None when not found."""
        path, digest = view_path(name), digest_of(name)
        if digest is None:
            return {}
        text = next((t for t in versions(root, path) if md5(t) == digest), None)
        return None if text is None else yaml.safe_load(text)

    def written(name: str) -> dict:
        return load(resolved_path(*view_of(name), scratch))

    old, now = recorded(stage), written(stage)
    on_disk = root / view
    result.configure_behind = not on_disk.is_file() or on_disk.read_text() != resolved_path(branch, base,
                                                                                            scratch).read_text()
    if old is None:
        result.recorded_found = False
    else:
        describe(result, root, branch, old, now, params_of(root, view, digest_of(stage) or ""))
    result.upstream = {name: kinds for name in upstream if name in lock and (kinds := moved_kinds(recorded(name),
                                                                                                  written(name)))}
    result.downstream = [f"{name} (trains)" if name.split("@")[0] in TRAINING else name for name in downstream]
    result.others = {name: kinds for name in sorted(nodes) if name not in ("configure", stage, *upstream)
                     and name in lock and (kinds := moved_kinds(recorded(name), written(name)))}
    if base in TRAINING:
        run = (load(scratch / RUN_FILE).get(branch) or {}).get(base) or {}
        hardware = (run.get("hardware") or {}).get("name") or "?"
        on_cpu = ((now.get("hardware") or {}).get("env") or {}).get("JAX_PLATFORMS") == "cpu"
        result.hardware = f"hardware preset {hardware}: " + (
            "JAX on this machine's CPU, no TPU is paid; on a TPU preset each rerun is paid TPU time" if on_cpu
            else "each rerun is paid TPU time")
    return result


ADDRESS_PARTS = ("code", "tools")  # the view's keys that are not values


def moved_kinds(old: dict | None, new: dict) -> set[str]:
    """What moved between two views of a stage: values, code, tools (nothing when ``old`` is not known)."""
    if old is None:
        return set()
    kinds = {key for key in ADDRESS_PARTS if old.get(key) != new.get(key)}
    values = ({k: v for k, v in view.items() if k not in ADDRESS_PARTS} for view in (old, new))
    return kinds | ({"values"} if next(values) != next(values) else set())


def params_of(root: Path, view: str, digest: str) -> dict:
    """The params.yaml values configure ran with when it wrote ``view`` with hash ``digest``: from the dvc.lock
    (on disk or committed) whose configure record lists that view ({} when none does)."""
    for text in versions(root, "dvc.lock"):
        configure = (yaml.safe_load(text).get("stages") or {}).get("configure") or {}
        if any(out["path"] == view and out.get("md5") == digest for out in configure.get("outs", [])):
            return (configure.get("params") or {}).get("params.yaml") or {}
    return {}


def describe(result: Explanation, root: Path, branch: str, old: dict, now: dict, params: dict) -> None:
    """Fill ``result`` with what moved from the recorded view ``old`` to ``now`` (and in params.yaml since
    ``params``, the values that made ``old``), and the edits that moved nothing."""
    result.kinds = moved_kinds(old, now)
    for key, before, after in changes({k: v for k, v in old.items() if k not in ADDRESS_PARTS},
                                      {k: v for k, v in now.items() if k not in ADDRESS_PARTS}):
        result.moved.append(f"value  {key}: {before} -> {after}")
    if "values" in result.kinds:
        result.moved += [f"       params.yaml {key}: {before} -> {after}"
                         for key, before, after in changes(params, load(root / "params.yaml"))
                         if key == "steps" or key.startswith(f"{branch}.") or branch == "embedded"]
    result.moved += [f"tool   {name}: {before} -> {after} (requirements.lock)"
                     for name, before, after in changes(old.get("tools") or {}, now.get("tools") or {})]
    old_code, new_code = old.get("code") or {}, now.get("code") or {}
    result.moved += [code_moved(root, module, old_code.get(module), new_code.get(module))
                     for module in sorted(old_code.keys() | new_code.keys())
                     if old_code.get(module) != new_code.get(module)]
    result.rules = set(result.kinds)
    for module in edited_modules(root):
        if module in new_code and new_code[module] == old_code.get(module):
            result.inert.append(f"{module}: edited, same fingerprint (only docstrings, comments, layout or message "
                                "text changed)")
            result.rules.add("code")
        elif fingerprint.is_exempt(root / module):
            reason = re.search(rf'^{fingerprint.EXEMPT_MARK} = "(.*)"$', (root / module).read_text(), re.M)
            result.inert.append(f"{module}: declares {fingerprint.EXEMPT_MARK} (\"{reason[1] if reason else ''}\"): "
                                "in no stage's code")
            result.rules.add("exempt")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="+", metavar="STAGE", help="a stage as DVC names it, e.g. train_sft@sft")
    args = parser.parse_args(argv)
    try:
        print("\n\n".join(explain(stage).text() for stage in args.stages))
    except ConfigError as err:
        print(f"mtpipe: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
