"""Tool versions in a stage's address: the packages that make a stage's bytes, as the lock pins them.

``configure`` writes into each stage's resolved view a ``tools:`` mapping, package -> version, next to
``code:`` (:mod:`mtpipe.pipeline.fingerprint`). The packages are the toolchain packages (:data:`TOOLCHAIN`:
those that write or read an artifact or compile a step) that the stage's code reaches: the third-party
imports of the modules it runs, followed through the installed packages' requirements (MaxText through
the extra the laptop installs). The versions are requirements.lock's, which pins every package the VM
shares with the laptop at the VM's version (:mod:`mtpipe.pipeline.requirement_locks`), and ``configure``
depends on that lock (dvc.yaml): a version bump in it reruns exactly the stages that run that package.

``load_stage`` refuses to run when the installed version of a recorded package is not the view's (an
environment that is not the lock's: run ``make``), so the address always names the tools that ran.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from mtpipe.errors import ConfigError
from mtpipe.pipeline import fingerprint

ADDRESS_EXEMPT = "compares a view's recorded tool versions with the installed ones; a mismatch stops the stage"
ROOT = Path(__file__).resolve().parents[2]
LAPTOP_LOCK = ROOT / "requirements.lock"
# Packages whose version can change an artifact's bytes: they write or read checkpoints, weights,
# tokenizers or data files, or compile and run the step. Everything else (dvc, doit, rich, ...) moves
# no byte of an output.
TOOLCHAIN = frozenset({
    "maxtext", "jax", "jaxlib", "libtpu", "orbax-checkpoint", "tensorstore", "flax", "optax", "qwix",
    "google-tunix", "grain", "datasets", "pyarrow", "transformers", "tokenizers", "sentencepiece",
    "safetensors", "huggingface-hub", "numpy", "ml-dtypes", "scipy", "lm-eval",
})
EXTRAS = {"maxtext": "tpu"}  # the extra whose requirements count (requirement_locks.LAPTOP_MAXTEXT_EXTRA)
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", re.M)


def lock_pins(text: str) -> dict[str, str]:
    """name (canonical) -> version of every ``name==version`` line of a requirements file."""
    return {canonicalize_name(m[1]): m[2] for m in PIN.finditer(text)}


@functools.cache  # keyed by the source text: an edited file is parsed again
def _third_party_imports(source: str) -> frozenset[str]:
    """Top-level names of what a module imports from outside the project and the standard library."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return frozenset(n for n in names if n not in sys.stdlib_module_names and n not in fingerprint.PACKAGES)


@functools.cache
def _requires(dist: str) -> frozenset[str]:
    """The installed distribution's requirements (its :data:`EXTRAS` extra included) for this platform."""
    try:
        texts = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return frozenset()
    out = set()
    for text in texts:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": EXTRAS.get(dist, "")}):
            out.add(canonicalize_name(req.name))
    return frozenset(out)


@functools.cache
def _distributions() -> dict[str, list[str]]:
    """import name -> the installed distributions that provide it."""
    return metadata.packages_distributions()


def stage_packages(stage: str, root: Path = ROOT, backends: dict[str, str] | None = None) -> list[str]:
    """The toolchain packages stage ``stage`` runs with ``backends`` (as in
    :func:`mtpipe.pipeline.fingerprint.stage_modules`), sorted."""
    by_import = _distributions()
    todo = {canonicalize_name(d) for module in fingerprint.stage_modules(stage, root, backends)
            for name in _third_party_imports((root / module).read_text()) for d in by_import.get(name, ())}
    seen: set[str] = set()
    while todo:
        dist = todo.pop()
        if dist not in seen:
            seen.add(dist)
            todo |= _requires(dist) - seen
    return sorted(seen & TOOLCHAIN)


def stage_tools(stage: str, root: Path = ROOT, lock: Path = LAPTOP_LOCK,
                backends: dict[str, str] | None = None) -> dict[str, str]:
    """package -> version (the lock's), for every toolchain package ``stage`` runs (the view's ``tools:``)."""
    pins, packages = lock_pins(lock.read_text()), stage_packages(stage, root, backends)
    if missing := [p for p in packages if p not in pins]:
        raise ConfigError(lock.name, f"pins no version of {', '.join(missing)} (stage {stage} runs them)",
                          "run `make lock`")
    return {p: pins[p] for p in packages}


def installed_mismatches(tools: dict[str, str]) -> list[str]:
    """``name: recorded -> installed`` for each recorded package whose installed version differs."""
    out = []
    for name, version in tools.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "not installed"
        if installed != version:
            out.append(f"{name}: {version} -> {installed}")
    return out
