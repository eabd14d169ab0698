"""mtpipe's packages keep the order docs/architecture.md declares: no import runs against it."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.architecture


def declared_order() -> list[str]:
    """The packages, lowest first, from the "Package order:" line of docs/architecture.md."""
    match = re.search(r"^Package order: (.+)$", (ROOT / "docs" / "architecture.md").read_text(), re.MULTILINE)
    assert match, "docs/architecture.md has no 'Package order:' line"
    return [name.strip() for name in match.group(1).split("<")]


def package_of(module: str) -> str:
    """`mtpipe.cloud.vm` -> `cloud`; `mtpipe.errors` -> `errors`."""
    return module.split(".")[1]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `mtpipe.*` import in a file, those inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, module) for line, module in found if module.startswith("mtpipe.")]


def test_every_package_is_in_the_declared_order():
    order = declared_order()
    packages = {p.stem if p.is_file() else p.name for p in (ROOT / "mtpipe").iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert set(order) == packages, f"declared {order}, found {sorted(packages)}"


def test_no_import_runs_against_the_order():
    rank = {name: i for i, name in enumerate(declared_order())}
    against = []
    for path in sorted((ROOT / "mtpipe").rglob("*.py")):
        relative = path.relative_to(ROOT)
        if len(relative.parts) < 3:   # mtpipe/__init__.py, mtpipe/errors.py
            source = relative.stem
            if source == "__init__":
                continue
        else:
            source = relative.parts[1]
        for line, module in imports(path):
            if rank[package_of(module)] > rank[source]:
                against.append(f"{relative}:{line} ({source}) imports {module} ({package_of(module)})")
    assert not against, "imports against docs/architecture.md's package order:\n" + "\n".join(against)


def test_the_check_sees_an_import_against_the_order(tmp_path: Path):
    """The walker finds a late import inside a function (the kind that slipped through before)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from mtpipe.cloud import xpk\n    return xpk\n")
    assert imports(module) == [(2, "mtpipe.cloud")]
