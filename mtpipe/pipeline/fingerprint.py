"""Code fingerprints: what a stage's code does, not how its text reads.

``configure`` writes into each stage's resolved view (config/<branch>/<stage>.yaml) a ``code:``
mapping, module path -> fingerprint, for every project module the stage runs: its script, the
modules it imports (transitively, imports inside functions included), and the entry points of the
child processes it starts. DVC hashes the view, so a stage reruns exactly when one of those
fingerprints moves; the stage's .py files are deps of ``configure`` only.

A fingerprint is the sha256 of the module's syntax tree with what cannot change a result left out:
comments and layout (the parser drops them), docstrings, and the text of error messages (string
literals and f-strings in ``raise`` statements and in ``assert`` messages). Everything else counts:
a changed default, a renamed variable, a reworded log line. The tree is serialized field by field,
empty fields skipped, so the same source gives the same fingerprint on the Python versions the
project supports (3.12 on the laptop and the VM).
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mtpipe", "stages")  # the project's own top-level packages; every other import is a tool
# The child processes a stage starts (`python -m <module>`), beyond what its script imports:
# mtpipe.maxtext.commands.MaxTextCommand.launcher, the evaluation's model server.
CHILD_ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "to_maxtext": ("mtpipe/maxtext/launch.py",),
    "train_sft": ("mtpipe/maxtext/launch.py",),
    "train_rl": ("mtpipe/maxtext/launch.py", "mtpipe/maxtext/rollout_cpu.py"),
    "to_huggingface": ("mtpipe/maxtext/launch.py",),
    "evaluate_base": ("mtpipe/evaluation/server.py",),  # mtpipe.evaluation.serving.server_command (cpu)
    "evaluate": ("mtpipe/evaluation/server.py",),
}
MESSAGE = ast.Constant("<message>")


def _module_file(dotted: str, root: Path) -> Path | None:
    """The file of a project module or package, or None when ``dotted`` is not one."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path, root: Path) -> frozenset[Path]:
    """Project files that importing ``path`` loads: each imported module and its parent packages."""
    return _imported_by_source(path.read_text(), root)


@functools.cache  # keyed by the source text: an edited file is parsed again
def _imported_by_source(source: str, root: Path) -> frozenset[Path]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if name.split(".")[0] not in PACKAGES:
                continue
            parts = name.split(".")
            found |= {f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i]), root))}
    return frozenset(found)


def stage_modules(stage: str, root: Path = ROOT) -> list[str]:
    """The project modules stage ``stage`` runs, as sorted paths relative to ``root``."""
    todo = [root / "stages" / f"{stage}.py", *(root / p for p in CHILD_ENTRY_POINTS.get(stage, ()))]
    seen: set[Path] = set()
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(_imported(path, root) - seen)
    return sorted(str(p.relative_to(root)) for p in seen)


class _Normalize(ast.NodeTransformer):
    """Drop docstrings; replace the text of error messages by one placeholder."""

    def _strip_docstring(self, node: Any) -> Any:
        self.generic_visit(node)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        return node

    visit_Module = visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _strip_docstring

    def visit_Raise(self, node: ast.Raise) -> ast.Raise:
        return _MessagesOnly().visit(node)

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        self.generic_visit(node)
        if node.msg is not None:
            node.msg = _MessagesOnly().visit(node.msg)
        return node


class _MessagesOnly(ast.NodeTransformer):
    """Every string literal and f-string below a node becomes the placeholder."""

    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        return MESSAGE if isinstance(node.value, str) else node

    def visit_JoinedStr(self, node: ast.JoinedStr) -> ast.Constant:
        return MESSAGE


def _serialize(node: Any) -> Any:
    """A syntax tree as nested lists: node type, then its non-empty fields (positions left out)."""
    if isinstance(node, ast.AST):
        fields = [(name, _serialize(value)) for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return [type(node).__name__, fields]
    if isinstance(node, list):
        return [_serialize(item) for item in node]
    return repr(node)


def module_fingerprint(path: Path) -> str:
    """The fingerprint of one module (16 hex digits of a sha256)."""
    return source_fingerprint(path.read_text())


@functools.cache  # keyed by the source text, as above
def source_fingerprint(source: str) -> str:
    """The fingerprint of a module's source text."""
    tree = _Normalize().visit(ast.parse(source))
    return hashlib.sha256(repr(_serialize(tree)).encode()).hexdigest()[:16]


def stage_code(stage: str, root: Path = ROOT) -> dict[str, str]:
    """module path -> fingerprint, for every module ``stage`` runs (the view's ``code:`` mapping)."""
    return {module: module_fingerprint(root / module) for module in stage_modules(stage, root)}
