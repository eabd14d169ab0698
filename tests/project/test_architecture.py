"""mtpipe's packages, and mtpipe/cloud's rooms, keep the orders docs/architecture.md declares: no import
runs against them; no class is longer than 300 lines. The tests keep the layout docs/testing.md
describes: no test file imports another, fakes in tests/fakes/, each test file in its room's folder."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS, FAKES = ROOT / "tests", ROOT / "tests" / "fakes"
pytestmark = pytest.mark.architecture


def declared_order() -> list[str]:
    """The packages, lowest first, from the "Package order:" line of docs/architecture.md."""
    match = re.search(r"^Package order: (.+)$", (ROOT / "docs" / "architecture.md").read_text(), re.MULTILINE)
    assert match, "docs/architecture.md has no 'Package order:' line"
    return [name.strip() for name in match.group(1).split("<")]


def package_of(module: str) -> str:
    """`mtpipe.cloud.on_vm.ssh` -> `cloud`; `mtpipe.errors` -> `errors`."""
    return module.split(".")[1]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file, those inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `mtpipe.*` import in a file, those inside functions included."""
    return [(line, module) for line, module in imported_modules(path) if module.startswith("mtpipe.")]


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
    module.write_text("def f():\n    from mtpipe.training import xpk\n    return xpk\n")
    assert imports(module) == [(2, "mtpipe.training")]


def module_name(path: Path, root: Path) -> str:
    """`mtpipe/planning/preflight.py` -> `mtpipe.planning.preflight` (``root``: the folder above mtpipe/); a
    package's `__init__.py` -> the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_mtpipe_modules(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` a file imports, those inside functions and under TYPE_CHECKING included:
    `from mtpipe.planning import budget` names `mtpipe.planning.budget`, `from mtpipe.planning.budget
    import plan` names it too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                      for alias in node.names}
    return found & known


def import_circles(root: Path) -> list[list[str]]:
    """Each circle of imports among the modules of one package under ``root`` (mtpipe/<package>/...),
    as the modules around it, the first one repeated at the end."""
    files = {module_name(path, root.parent): path for path in sorted(root.rglob("*.py"))}
    graph = {m: sorted(n for n in imported_mtpipe_modules(path, set(files))
                       if n != m and n.split(".")[:2] == m.split(".")[:2]) for m, path in files.items()}
    circles: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(start: str, here: str, trail: list[str]) -> None:
        for nxt in graph[here]:
            if nxt == start and frozenset(trail) not in seen:
                seen.add(frozenset(trail))
                circles.append([*trail, start])
            elif nxt not in trail and nxt > start:   # each circle found once, from its smallest module
                walk(start, nxt, [*trail, nxt])

    for module in sorted(graph):
        walk(module, module, [module])
    return circles


def test_no_package_imports_itself_in_a_circle():
    """Inside a package, imports go one way: a module that imports another is not imported by it,
    directly or around a circle (an import inside a function counts: it only hides the circle)."""
    circles = import_circles(ROOT / "mtpipe")
    assert not circles, "import circles inside a package:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_check_sees_an_import_circle(tmp_path: Path):
    package = tmp_path / "mtpipe" / "planning"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from mtpipe.planning import b\n")
    (package / "b.py").write_text("def f():\n    from mtpipe.planning.c import g\n")
    (package / "c.py").write_text("import mtpipe.planning.a\nfrom mtpipe.errors import ConfigError\n")
    (package / "d.py").write_text("from mtpipe.planning import a, b\n")
    assert import_circles(tmp_path / "mtpipe") == [["mtpipe.planning.a", "mtpipe.planning.b", "mtpipe.planning.c",
                                                    "mtpipe.planning.a"]]


CLOUD = ROOT / "mtpipe" / "cloud"
MAX_CLASS_LINES = 300


def declared_cloud_order() -> list[str]:
    """mtpipe/cloud's rooms, lowest first, from the "Cloud order:" line of docs/architecture.md."""
    match = re.search(r"^Cloud order: (.+)$", (ROOT / "docs" / "architecture.md").read_text(), re.MULTILINE)
    assert match, "docs/architecture.md has no 'Cloud order:' line"
    return [name.strip() for name in match.group(1).split("<")]


def cloud_rooms_imported(path: Path) -> list[tuple[int, str]]:
    """(line, room) of every import of mtpipe.cloud's rooms in a file, those inside functions included:
    `from mtpipe.cloud.on_vm.ssh import run` and `from mtpipe.cloud import on_vm` both name `on_vm`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                   [f"{node.module}.{alias.name}" for alias in node.names] if isinstance(node, ast.ImportFrom)
                   and node.module == "mtpipe.cloud" else
                   [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        found += [(node.lineno, module.split(".")[2]) for module in modules
                  if module.startswith("mtpipe.cloud.")]
    return found


def test_every_cloud_room_is_in_the_declared_order():
    """mtpipe/cloud holds a few rooms (sub-packages), each named in the order, and no loose module."""
    order = declared_cloud_order()
    rooms = {p.name for p in CLOUD.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    loose = sorted(p.name for p in CLOUD.glob("*.py") if p.name != "__init__.py")
    assert set(order) == rooms and not loose, f"declared {order}, found {sorted(rooms)} and modules {loose}"
    assert len(rooms) <= 6, f"{len(rooms)} rooms in mtpipe/cloud: {sorted(rooms)}"


def test_no_cloud_import_runs_against_the_order():
    """A room imports from itself and the rooms before it, so no two rooms import each other."""
    rank = {name: i for i, name in enumerate(declared_cloud_order())}
    against = []
    for path in sorted(CLOUD.rglob("*.py")):
        relative = path.relative_to(ROOT)
        if len(relative.parts) < 4:   # mtpipe/cloud/__init__.py
            continue
        source = relative.parts[2]
        against += [f"{relative}:{line} ({source}) imports mtpipe.cloud.{room}" for line, room in cloud_rooms_imported(path)
                    if rank[room] > rank[source]]
    assert not against, "imports against docs/architecture.md's cloud order:\n" + "\n".join(against)


def provider_folders_imported(path: Path) -> list[str]:
    """The provider folders (mtpipe.cloud.providers.<folder>) a file imports, those inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                   [f"{node.module}.{alias.name}" for alias in node.names] if isinstance(node, ast.ImportFrom)
                   and node.module and node.level == 0 else [])
        found += [m.split(".")[3] for m in modules if m.startswith("mtpipe.cloud.providers.")
                  and len(m.split(".")) >= 4 and (CLOUD / "providers" / m.split(".")[3]).is_dir()]
    return found


def test_the_lifecycle_and_the_vm_speak_to_providers_through_the_interface():
    """on_vm and lifecycle are provider-neutral: they reach a cloud through providers/interface.py and
    choice.py, never a provider's own folder (gcp/)."""
    neutral = [p for room in ("on_vm", "lifecycle") for p in sorted((CLOUD / room).rglob("*.py"))]
    bound = [f"{p.relative_to(ROOT)} imports mtpipe.cloud.providers.{folder}"
             for p in neutral for folder in provider_folders_imported(p)]
    assert not bound, "\n".join(bound)


def test_the_provider_check_sees_a_provider_folder(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text("from mtpipe.cloud.providers.interface import Provider\n\n\ndef f():\n"
                      "    from mtpipe.cloud.providers.gcp import ssh_route\n")
    assert provider_folders_imported(module) == ["gcp"]


def test_the_check_sees_an_import_of_a_later_room(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text("from mtpipe.cloud import lifecycle\n\n\ndef f():\n    from mtpipe.cloud.on_vm.ssh import run\n")
    assert cloud_rooms_imported(module) == [(1, "lifecycle"), (5, "on_vm")]


def test_no_class_is_longer_than_300_lines():
    """A class past MAX_CLASS_LINES does too many things to read at once: split it by what it does
    (as VmLifecycle is, in mtpipe/cloud/lifecycle/)."""
    long = [f"{path.relative_to(ROOT)}:{node.lineno} class {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for path in sorted((ROOT / "mtpipe").rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES]
    assert not long, f"classes longer than {MAX_CLASS_LINES} lines:\n" + "\n".join(long)


def imported_test_modules(path: Path) -> list[str]:
    """`line: module` for every import of a test module (`test_*`) in a file."""
    return [f"{line}: {module}" for line, module in imported_modules(path) if module.startswith("test_")]


def test_no_test_file_imports_another():
    """What several test files share lives in tests/conftest.py, in a fixture or helper module
    (tests/vm_world.py, tests/work_bucket.py, tests/pipeline.py) or in tests/fakes/, never in a test
    file that others import (docs/testing.md)."""
    found = [f"{path.relative_to(ROOT)}:{hit}" for path in sorted(TESTS.rglob("*.py"))
             for hit in imported_test_modules(path)]
    assert not found, "imports of test modules (move what they share to a fixture or helper module):\n" + \
        "\n".join(found)


def test_the_check_sees_an_import_of_a_test_module(tmp_path: Path):
    module = tmp_path / "test_m.py"
    module.write_text("import test_a\n\n\ndef f():\n    from test_b import x\n    return x\n")
    assert imported_test_modules(module) == ["1: test_a", "5: test_b"]


def test_every_fake_lives_in_tests_fakes():
    """A `fake_*` module or a server class (an HTTP or SSH server or request handler) outside
    tests/fakes/ is a fake the next reader will not find."""
    misplaced = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.is_relative_to(FAKES):
            continue
        if path.name.startswith("fake_"):
            misplaced.append(f"{path.relative_to(ROOT)}: a fake_ module")
        misplaced += [f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}"
                      for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)
                      and any(ast.unparse(base).endswith(("Server", "RequestHandler")) for base in node.bases)]
    assert not misplaced, "fakes outside tests/fakes/:\n" + "\n".join(misplaced)


def test_every_test_file_is_in_the_folder_of_the_room_it_tests():
    """A test file lives in tests/<package>/ (a package of the package order), tests/cloud/<room>/ (a
    room of the cloud order) or tests/project/ (the project as a whole), and no two test files share a
    name: pytest imports each by its name (docs/testing.md, "Where the tests are")."""
    folders = ({name for name in declared_order() if name != "cloud"} | {"project"}
               | {f"cloud/{room}" for room in declared_cloud_order()})
    files = sorted(TESTS.rglob("test_*.py"))
    misplaced = [str(path.relative_to(ROOT)) for path in files
                 if path.parent.relative_to(TESTS).as_posix() not in folders]
    assert not misplaced, f"test files outside the rooms' folders {sorted(folders)}:\n" + "\n".join(misplaced)
    names = [path.name for path in files]
    assert len(names) == len(set(names)), sorted({name for name in names if names.count(name) > 1})


# The project's own environment variables: each says where or how patiently something runs, or how to
# reach a service, never what a stage computes (that is a config key, in the stage's address).
OPERATIONAL_ENV = {
    "MTPIPE_WORK_DIR": "where local run directories live",
    "MTPIPE_WORK_BUCKET": "the bucket run directories live in (docs/decisions/training.md)",
    "MTPIPE_WORK_BUCKET_KEEP": "keep the bucket's run directory after success",
    "MTPIPE_STOP_TIMEOUT_S": "how long a stopped tool may take to save before it is killed",
    "MTPIPE_HOLD_AFTER_STEP": "the tests' hold after a step, to kill a run at a known point",
    "MTPIPE_VM_CONFIG": "which VM config file",
    "MTPIPE_COMPUTE_ENDPOINT": "the Compute API's address (the tests' fake)",
    "MTPIPE_TPU_ENDPOINT": "the Cloud TPU API's address (the tests' fake; else MTPIPE_COMPUTE_ENDPOINT's)",
    "MTPIPE_IAM_ENDPOINT": "the IAM API's address (the tests' fake)",
    "MTPIPE_NOTIFY_URL": "where run notifications go",
    "MTPIPE_XPK": "the xpk executable",
}


@pytest.mark.address
def test_no_environment_variable_of_ours_changes_what_a_stage_computes():
    """Every MTPIPE_* variable the code names is declared above with what it is for: a switch that
    changed a result would be in no stage's address, so it has to be a config key instead."""
    named = {m for path in [*(ROOT / "mtpipe").rglob("*.py"), *(ROOT / "stages").glob("*.py")]
             for m in re.findall(r"\bMTPIPE_[A-Z0-9_]+\b", path.read_text())}
    assert named == set(OPERATIONAL_ENV), f"undeclared: {named - set(OPERATIONAL_ENV)}, gone: {set(OPERATIONAL_ENV) - named}"


# ---------------------------------------------------------------- TPU generations


def generation_spellings() -> re.Pattern:
    """Every way conf/generations.yaml spells a generation other than its row's name: machine families,
    accelerator and MaxText names, device kinds, runtimes, reservation families, quota names and ids."""
    from mtpipe.pipeline import generations  # pylint: disable=import-outside-toplevel

    words: set[str] = set()
    for gen in generations.load().values():
        words |= {gen.machine.family, gen.accelerator, gen.maxtext, gen.compute.reservation_family, *gen.device_kinds}
        if gen.tpu_api:
            quota = gen.tpu_api.quota
            words |= {gen.tpu_api.runtime_version, *((quota.on_demand, quota.preemptible) if quota else ())}
        words |= {gen.compute.quota.name, gen.compute.quota.metric} if gen.compute.quota else set()
        words -= {gen.name, None}
    return re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, words), key=len, reverse=True)) + r")(?!\w)")


def generation_literals(path: Path, spellings: re.Pattern) -> list[tuple[int, str]]:
    """(line, spelling) of each generation spelling in a string of the code (docstrings, which explain
    with examples, and comments are not code)."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, found.group(1)) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
            for found in spellings.finditer(node.value)]


@pytest.mark.generation
def test_no_generation_is_spelt_outside_its_table():
    """What a TPU generation is called on each route, and what it is, lives in conf/generations.yaml: the
    code reads it through mtpipe/pipeline/generations.py and spells none of it itself."""
    spellings, table = generation_spellings(), ROOT / "mtpipe" / "pipeline" / "generations.py"
    code = [*ROOT.glob("mtpipe/**/*.py"), *ROOT.glob("stages/*.py"), ROOT / "dodo.py"]
    found = [f"{path.relative_to(ROOT)}:{line}: {word}" for path in code if path != table
             for line, word in generation_literals(path, spellings)]
    assert not found, "generation facts outside conf/generations.yaml:\n" + "\n".join(found)


@pytest.mark.generation
def test_the_check_sees_a_generation_spelt_in_code(tmp_path: Path):
    module = tmp_path / "m.py"
    module.write_text('"""A v5litepod-8 in a docstring is an example."""\nTYPE = "ct6e-standard-8t"  # a v6e-8\n'
                      'KIND = f"{1} x TPU v6 lite"\n')
    assert generation_literals(module, generation_spellings()) == [(2, "ct6e"), (3, "TPU v6 lite")]
