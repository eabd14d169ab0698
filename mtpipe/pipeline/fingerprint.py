"""Code fingerprints: what a stage's code does, not how its text reads.

``configure`` writes into each stage's resolved view (views/<branch>/<stage>.yaml) a ``code:``
mapping, module path -> fingerprint, for every project module the stage runs: its script, the
modules it imports (transitively, imports inside functions included), and the entry points of the
child processes it starts, less the modules that declare that they only check (:data:`EXEMPT_MARK`). DVC
hashes the view, so a stage reruns exactly when one of those fingerprints moves; the stage's .py files are
deps of ``configure`` only.

A fingerprint is the sha256 of the module's syntax tree with what cannot change a result left out:
comments and layout (the parser drops them), docstrings, and the text of messages, however it is
built: string literals and f-strings in ``raise`` statements, ``assert`` messages and the arguments of
exceptions, warnings and ``sys.exit``; in the arguments of functions that only raise or collect such a
message; in the whole body of functions whose results only messages use; in local variables of text
that only messages read. Everything else counts: a changed default, a renamed variable, a reworded log
line. The tree is serialized field by field, empty fields skipped, so the same source gives the same
fingerprint on the Python versions the project supports (3.12 on the laptop and the VM).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
from pathlib import Path
from typing import Any

ADDRESS_EXEMPT = "compares a view's recorded fingerprints with the running code's; a mismatch stops the stage"
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mtpipe", "stages")  # the project's own top-level packages; every other import is a tool
# A string that is a project module's dotted name is the entry point of a child process the code starts
# (`[sys.executable, "-m", "mtpipe.evaluation.server", ...]`, MaxTextCommand.launcher): it counts as the
# module imported there, inside a function, so no child's code is left out of a stage's address.
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")
# Modules a stage runs only with one backend: the view's key -> its value -> those modules, each a child
# entry point or imported inside a function (mtpipe.training.backend imports xpk only for backend: xpk).
# With another value they, and what only they import, are not in the stage's code.
BACKEND_MODULES: dict[str, dict[str, tuple[str, ...]]] = {
    "hardware.backend": {"xpk": ("mtpipe/training/xpk.py",)},
    "train_rl.rollout_backend": {"cpu_jax": ("mtpipe/maxtext/launch_rl_cpu.py",)},
    "evaluate.backend": {"cpu": ("mtpipe/evaluation/server.py",)},
    # the task in train_rl's format reads MaxText's rl.yml template (so MaxText is among its tools)
    "evaluate.task": {"gsm8k_rl_format": ("mtpipe/data/gsm8k_chat.py",)},
}
# A module that only checks, so that it can stop a stage but never change what the stage writes, says so
# where it is defined: a module-level `ADDRESS_EXEMPT = "<why>"`. It is in no stage's code and the walk
# does not follow its imports (a module the stage also imports elsewhere is still found there). It stays
# a dep of configure, which reruns when it changes and rewrites each view whose fingerprints it moves.
EXEMPT_MARK = "ADDRESS_EXEMPT"
MESSAGE = ast.Constant("<message>")


def _module_file(dotted: str, root: Path) -> Path | None:
    """The file of a project module or package, or None when ``dotted`` is not one."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path, root: Path) -> tuple[frozenset[Path], frozenset[Path]]:
    """Project files that importing ``path`` loads (each imported module and its parent packages): those
    imported at module level, and those imported inside a function."""
    return _imported_by_source(path.read_text(), root)


def is_exempt(path: Path) -> bool:
    """Whether a module declares itself outside every stage's address (:data:`EXEMPT_MARK`)."""
    return _declares_exempt(path.read_text())


@functools.cache
def _declares_exempt(source: str) -> bool:
    return any(isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == EXEMPT_MARK for t in node.targets)
               and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) and node.value.value
               for node in ast.parse(source).body)


@functools.cache  # keyed by the source text: an edited file is parsed again
def _imported_by_source(source: str, root: Path) -> tuple[frozenset[Path], frozenset[Path]]:
    tree = ast.parse(source)
    late = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f)}
    found: tuple[set[Path], set[Path]] = (set(), set())
    for node in ast.walk(tree):
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
            found[id(node) in late].update(
                f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i]), root)))
    found[1].update(f for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and DOTTED.fullmatch(node.value) and node.value.split(".")[0] in PACKAGES
                    and (f := _module_file(node.value, root)))
    return frozenset(found[0]), frozenset(found[1])


def _left_out(backends: dict[str, str] | None) -> set[str]:
    """The backend modules of the backends not selected (all of them when ``backends`` is None: every
    module counts)."""
    if backends is None:
        return set()
    return {m for key, by_value in BACKEND_MODULES.items() for value, modules in by_value.items()
            if backends.get(key) != value for m in modules}


def stage_modules(stage: str, root: Path = ROOT, backends: dict[str, str] | None = None) -> list[str]:
    """The project modules stage ``stage`` runs, as sorted paths relative to ``root``: its script, what it
    imports and the child processes' entry points it names (:data:`DOTTED`), transitively. With ``backends``
    (:data:`BACKEND_MODULES` key -> the value its view has) a backend module of another backend is left
    out where it is a child entry point or imported inside a function; a module-level import keeps it. A
    module that declares itself exempt (:data:`EXEMPT_MARK`) is left out, and so is what only it imports."""
    left_out = {root / m for m in _left_out(backends)}
    todo = [root / "stages" / f"{stage}.py"]
    seen: set[Path] = set()
    exempt: set[Path] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if is_exempt(path):
            exempt.add(path)
            continue
        top, late = _imported(path, root)
        todo.extend((top | (late - left_out)) - seen)
    return sorted(str(p.relative_to(root)) for p in seen - exempt)


# Calls whose arguments are message text: exceptions and warnings (by their class name's ending),
# ``sys.exit`` with a message, ``warnings.warn``, and the schema's error wording (mtpipe.pipeline.schema.Words).
MESSAGE_SUFFIXES = ("Error", "Exception", "Warning", "Exit")
MESSAGE_CALLS = frozenset({"exit", "warn", "Words"})


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _is_message_call(node: ast.AST, helpers: frozenset[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    name = _called_name(node)
    if name == "exit" or name.endswith("Exit"):  # sys.exit(main()) passes a status, not a message
        return bool(node.args) and _is_text(node.args[0])
    # a helper is called by its bare name: `seen.add("xpk")` is a set's method, not the module's `add`
    return name.endswith(MESSAGE_SUFFIXES) or name in MESSAGE_CALLS or name in helpers and isinstance(node.func, ast.Name)


def _message_helpers(tree: ast.Module) -> frozenset[str]:
    """Functions whose one statement (docstring aside) raises or collects a message, like the schema's
    ``add(key, problem, fix)``: ``errors.append(ConfigError(key, problem, fix))``. Calls to them by
    their bare name are message calls too; a method of the same name (``seen.add(...)``) is not."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if len(body) == 1 and (isinstance(body[0], ast.Raise) or isinstance(body[0], ast.Expr)
                                   and isinstance(body[0].value, ast.Call)) \
                    and any(_is_message_call(n, frozenset()) for n in ast.walk(body[0])):
                found.add(node.name)
    return frozenset(found)


def _message_contexts(node: ast.AST, helpers: frozenset[str]) -> list[ast.AST]:
    """The subtrees of ``node`` that are message text: what a raise raises, an assert's message, the
    arguments of a message call."""
    out: list[ast.AST] = []
    for n in ast.walk(node):
        if isinstance(n, ast.Raise) and n.exc is not None:
            out.append(n.exc)
        elif isinstance(n, ast.Assert) and n.msg is not None:
            out.append(n.msg)
        elif _is_message_call(n, helpers):
            out += [*n.args, *(k.value for k in n.keywords)]
    return out


def _is_text(value: ast.AST) -> bool:
    """A string built from literals, f-strings, ``+``, ``%`` and ``.format``."""
    if isinstance(value, ast.Constant):
        return isinstance(value.value, str)
    if isinstance(value, ast.JoinedStr):
        return True
    if isinstance(value, ast.BinOp) and isinstance(value.op, (ast.Add, ast.Mod)):
        return _is_text(value.left)
    return isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "format" \
        and _is_text(value.func.value)


def _message_functions(tree: ast.Module, helpers: frozenset[str]) -> frozenset[str]:
    """Functions whose results only messages use: every reference to their name is message text or
    inside another such function (the schema's descriptions of a key's type and range). All they
    compute is wording, so their whole body is."""
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside: dict[str, set[int]] = {}  # a function's own body: its recursive calls do not count
    for f in funcs:
        inside.setdefault(f.name, set()).update(id(n) for n in ast.walk(f))
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    refs: dict[str, list[ast.Name]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Name) and n.id in inside and n.id not in imported:
            refs.setdefault(n.id, []).append(n)
    covered = {id(n) for ctx in _message_contexts(tree, helpers) for n in ast.walk(ctx)}
    chosen: set[str] = set()
    while True:
        new = {name for name, found in refs.items() if name not in chosen
               and any(id(r) not in inside[name] for r in found)
               and all(id(r) in covered or id(r) in inside[name] for r in found)}
        if not new:
            return frozenset(chosen)
        chosen |= new
        covered |= set().union(*(inside[name] for name in new))


class _Normalize(ast.NodeTransformer):
    """Drop docstrings; replace the text of messages by one placeholder, however it is built: in a
    raise, an assert, the arguments of an exception, a warning, ``sys.exit``, a function that only
    builds messages, a function whose result only messages use, and a local variable holding text that
    only those read."""

    def __init__(self, tree: ast.Module) -> None:
        self.helpers = _message_helpers(tree)
        self.wording = _message_functions(tree, self.helpers)

    def _strip_docstring(self, node: Any) -> Any:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
        return node

    def visit_Module(self, node: ast.Module) -> ast.Module:
        self.generic_visit(node)
        return self._strip_docstring(node)

    visit_ClassDef = visit_Module

    def visit_FunctionDef(self, node: Any) -> Any:
        self._message_variables(node)
        self.generic_visit(node)
        node = self._strip_docstring(node)
        return _MessagesOnly().visit(node) if node.name in self.wording else node

    visit_AsyncFunctionDef = visit_FunctionDef

    def _message_variables(self, func: Any) -> None:
        """Replace the text assigned to a local name that only message text reads."""
        in_messages = {id(n) for ctx in _message_contexts(func, self.helpers) for n in ast.walk(ctx)}
        assigns: dict[str, list[ast.Assign]] = {}
        loads: dict[str, list[ast.Name]] = {}
        for n in ast.walk(func):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                assigns.setdefault(n.targets[0].id, []).append(n)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                loads.setdefault(n.id, []).append(n)
        for name, nodes in assigns.items():
            read = loads.get(name, [])
            if read and all(id(r) in in_messages for r in read) and all(_is_text(a.value) for a in nodes):
                for a in nodes:
                    a.value = MESSAGE

    def visit_Raise(self, node: ast.Raise) -> ast.Raise:
        return _MessagesOnly().visit(node)

    def visit_Assert(self, node: ast.Assert) -> ast.Assert:
        self.generic_visit(node)
        if node.msg is not None:
            node.msg = _MessagesOnly().visit(node.msg)
        return node

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        if _is_message_call(node, self.helpers):
            node.args = [_MessagesOnly().visit(a) for a in node.args]
            for k in node.keywords:
                k.value = _MessagesOnly().visit(k.value)
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


def _digest(node: ast.AST) -> str:
    return hashlib.sha256(repr(_serialize(node)).encode()).hexdigest()[:16]


def _normalized(source: str) -> ast.Module:
    """A module's syntax tree as its fingerprint sees it: docstrings dropped, message text replaced."""
    tree = ast.parse(source)
    return _Normalize(tree).visit(tree)


@functools.cache  # keyed by the source text, as above
def source_fingerprint(source: str) -> str:
    """The fingerprint of a module's source text."""
    return _digest(_normalized(source))


MODULE_LEVEL = "module level"  # the statements of a module outside its functions and classes


def part_fingerprints(source: str) -> dict[str, str]:
    """Name -> fingerprint of each part of a module as :func:`source_fingerprint` sees it: each function
    (``name``), each method (``Class.name``), each class's other statements (``Class``) and the module's
    other statements (:data:`MODULE_LEVEL`). Which parts two versions differ in says where an edit moved
    the module's fingerprint (``python -m mtpipe.pipeline.why``)."""
    parts: dict[str, str] = {}

    def split(body: list[ast.stmt], prefix: str, rest_name: str) -> None:
        rest: list[ast.stmt] = []
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                parts[prefix + node.name] = _digest(node)
            elif isinstance(node, ast.ClassDef):
                split(node.body, f"{prefix}{node.name}.", prefix + node.name)
                node.body = []
                rest.append(node)  # its bases and decorators
            else:
                rest.append(node)
        if rest:
            parts[rest_name] = _digest(ast.Module(body=rest, type_ignores=[]))

    split(_normalized(source).body, "", MODULE_LEVEL)
    return parts


def stage_code(stage: str, root: Path = ROOT, backends: dict[str, str] | None = None) -> dict[str, str]:
    """module path -> fingerprint, for every module ``stage`` runs with ``backends`` (the view's ``code:``)."""
    return {module: module_fingerprint(root / module) for module in stage_modules(stage, root, backends)}
