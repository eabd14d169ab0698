"""The requirement lockfiles and how they are made (``make lock``): one toolchain for laptop and VM.

``requirements-vm.lock`` is the TPU VM's environment. The tutorial installs it as::

    uv pip install "maxtext[tpu-post-train]==V" --resolution=lowest
    uv pip install dvc dvc-gs ...

MaxText's requirements for that extra are MaxText's own lock written as floors: its
``generate_requirements.sh`` resolves a uv lock with ``--resolution=lowest`` and exports each ``==``
as ``>=``, and ``lowest`` installs that lock back. Here, for the VM (Linux x86_64, glibc 2.35,
Python 3.12), with hashes (``vm_setup`` installs it with ``uv pip sync --require-hashes``):

1. ``maxtext[tpu-post-train]`` and MaxText's floors as direct requirements, ``--resolution
   lowest-direct``: every package MaxText floors is at its floor (jax 0.11.0, libtpu 0.0.44,
   ray 2.58.0 ...), except

   * floors that bound nothing, at or below the package's oldest release (``colorful>=0.0.0``,
     ``smart-open>=0.1.0``: ray's unbounded requirements, which MaxText's own lowest resolution took at
     their first release; ray cannot start with colorful 0.0.0), found by :func:`vacuous_floors`;
   * :data:`LIFTED_FLOORS`: floors the project does not take, each with its reason.

   Those, and every package MaxText does not name, get the newest release that fits.
2. everything: step 1's pins as constraints, the project's pins, pip and uv (newest that fit).

``requirements.lock`` is the laptop's (and CI's): MaxText with the packages of its ``tpu`` extra (the
pre-training stack: no vLLM, no torch), the project's pins and its test extra, resolved with the whole
VM lock as constraints. So every package both machines install has one version, the VM's: the
checkpoint Orbax writes on the laptop is read on the VM by the same Orbax, and ``doit preflight``
compiles with the VM's jax and libtpu. The ``tpu`` extra's own lower bounds (e.g. libtpu >= 0.0.46)
are above the ``tpu-post-train`` ones the tutorial installs (libtpu 0.0.44), so the laptop takes the
extra's package names and the VM's versions, not the extra's bounds (docs/decisions/toolchain.md).

``requirements-control.lock`` is the control plane's: what drives VMs and experiments (``doit vm_*``,
``dvc``, publish, the run report) without JAX, libtpu or MaxText's stack, so it installs on any laptop
(``make control``): the project's pins but MaxText, tunix and lm-eval, the libraries its code imports
that those brought (:data:`CONTROL_EXTRA`), resolved ``--universal`` (one file for Linux, macOS and
Windows) with the laptop lock's pins as constraints, and checked to resolve for each of
:data:`CONTROL_PLATFORMS`; plus MaxText itself without its dependencies, whose config files the machine
budget reads (``uv pip sync`` installs exactly the lock's lines, no dependency of them).

Versions come from ``pyproject.toml``: the one place for MaxText's version and the project's pins.
``--exclude-newer`` fixes the index as of :data:`INDEX_DATE`, so both resolutions are reproducible
while the index gets no new release dated before it (semver 3.2.0, uploaded 2026-11-26, came after the
locks were made). ``make lock-check`` (:func:`check`; not part of the test suite, which needs no
index) resolves both again and names what moved.

``tpu-post-train`` pins ``torch==2.11.0+cpu`` / ``torchvision==0.26.0+cpu``: builds only the PyTorch
index serves. They are overridden with the same versions from PyPI (CUDA builds that run on the CPU;
about 3 GB more on the VM's 200 GB disk), so everything resolves from PyPI alone and every file is
hash-pinned. What ``install_tpu_post_train_extra_deps`` adds afterwards (vLLM built for TPU,
tpu-inference, a tunix commit) comes from GitHub commits pinned in MaxText's own
``dependencies/extra_deps/post_train_github_deps.txt``, installed ``--no-deps``: not in this lock.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from mtpipe.pipeline.toolchain import lock_pins

ROOT = Path(__file__).resolve().parents[2]
VM_LOCK = ROOT / "requirements-vm.lock"
LAPTOP_LOCK = ROOT / "requirements.lock"
CONTROL_LOCK = ROOT / "requirements-control.lock"
# The project's pins the control plane leaves out (MaxText comes in without its dependencies), and what
# its code imports that they brought (at the laptop lock's versions).
CONTROL_LEFT_OUT = ("maxtext", "google-tunix", "lm-eval")
CONTROL_EXTRA = ("huggingface-hub", "matplotlib")
CONTROL_PLATFORMS = ("x86_64-manylinux_2_35", "aarch64-apple-darwin")   # Linux laptops and CI, Apple silicon
UV_VERSION = "0.13.9"        # resolves the locks, installs the laptop's, and installed on the VM (conf/vm.yaml)
PIP_VERSION = "26.3"         # MaxText's extra-deps installer runs `python -m pip install uv` in the venv
INDEX_DATE = "2026-12-01T00:00:00Z"
PLATFORM = "x86_64-manylinux_2_35"   # the VM image: Ubuntu 22.04 (glibc 2.35), x86_64; the laptop too
PYTHON = "3.12"
MAXTEXT_EXTRA = "tpu-post-train"     # the VM's (the tutorials')
LAPTOP_MAXTEXT_EXTRA = "tpu"         # the laptop takes this extra's package names at the VM's versions
VM_PACKAGES = ("dvc", "dvc-gs", "doit", "omegaconf", "lm-eval")  # from pyproject.toml, besides MaxText
UV_TOOL_DIR = ROOT / "work" / f"uv-{UV_VERSION}"
# MaxText's floors the VM lock does not take (the package then gets its newest release that fits).
LIFTED_FLOORS = {
    "grpcio": "google-api-core and google-auth deprecate grpcio < 1.83 (no post-quantum TLS) with a "
              "FutureWarning at every import, and announced it as their minimum from October 2026",
}
# Packages of the VM lock below their newest release although neither MaxText nor the project chose
# them: each is held back by a bound of the package named (which the lock's `# via` comments name).
HELD_BACK = {"chardet": {"mbstrdecoder"}, "flufl-lock": {"dvc"}, "typepy": {"pytablewriter"}}  # <7, <10, <2
# torch 2.11.0 pins its CUDA 13.0 stack, directly or through cuda-toolkit's own == pins.
TORCH_PINS = re.compile(r"nvidia-(?!ml-py$)|cuda-toolkit$")
RELOCK = ("To take the index as it is now: `make lock` (rewrites both locks), `make` (installs the new "
          "requirements.lock), then `dvc repro`: each stage's view records the versions of the tools it runs, so "
          "the stages whose tools moved rerun; commit the locks with dvc.lock, views/, metrics/ and plots/. "
          "Until then the committed locks still install as they are (every file is hash-pinned).")


def project_pins() -> dict[str, Requirement]:
    """pyproject.toml's dependencies by name (each pinned with ==)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: r for d in deps}


def suite_pins() -> list[str]:
    """pyproject.toml's ``test`` extra: what the test suite adds (on the laptop and in CI)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]


def maxtext_version() -> str:
    """MaxText's version, as pyproject.toml pins it (``maxtext==V``)."""
    (spec,) = project_pins()["maxtext"].specifier
    return spec.version


def vm_inputs() -> tuple[str, list[str]]:
    """(MaxText with the VM's extra, the rest of step 2) of the VM's resolution (see the module docstring)."""
    pins = project_pins()
    rest = [str(pins[name]) for name in VM_PACKAGES] + [f"pip=={PIP_VERSION}", f"uv=={UV_VERSION}"]
    return f"maxtext[{MAXTEXT_EXTRA}]=={maxtext_version()}", rest


def _maxtext_metadata() -> metadata.Distribution:
    """The installed MaxText, which must be pyproject.toml's version (its extras are read from it)."""
    dist = metadata.distribution("maxtext")
    if dist.version != maxtext_version():
        raise RuntimeError(f"installed maxtext {dist.version} != pyproject.toml's {maxtext_version()}: run `make`")
    return dist


def extra_requirements(extra: str) -> list[Requirement]:
    """MaxText's requirements under ``extra`` for the VM's platform."""
    env = {"extra": extra, "platform_machine": "x86_64", "sys_platform": "linux", "platform_system": "Linux",
           "python_version": PYTHON, "os_name": "posix", "implementation_name": "cpython"}
    return [req for text in _maxtext_metadata().requires or []
            if (req := Requirement(text)).marker and req.marker.evaluate(env)]


def maxtext_floors() -> dict[str, str]:
    """name (canonical) -> version of each ``name>=version`` requirement of MaxText's VM extra (MaxText's lock)."""
    return {canonicalize_name(req.name): spec.version for req in extra_requirements(MAXTEXT_EXTRA)
            for spec in req.specifier if spec.operator == ">="}


def torch_overrides() -> list[str]:
    """MaxText's ``+cpu`` pins (PyTorch's index only) as the same versions from PyPI."""
    out = []
    for req in extra_requirements(MAXTEXT_EXTRA):
        if "+" in str(req.specifier):
            (spec,) = req.specifier
            out.append(f"{req.name}=={spec.version.split('+')[0]}")
    return sorted(out)


def laptop_requirements() -> list[str]:
    """The laptop's inputs: MaxText, its ``tpu`` extra's package names, the project's pins and test
    extra, and the pip and uv that install it (``uv pip sync`` keeps the venv exactly the lock)."""
    names = sorted({req.name + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")
                    for req in extra_requirements(LAPTOP_MAXTEXT_EXTRA)})
    rest = [str(r) for name, r in project_pins().items() if name != "maxtext"]
    return [f"maxtext=={maxtext_version()}", *names, *rest, *suite_pins(), f"pip=={PIP_VERSION}", f"uv=={UV_VERSION}"]


def uv() -> Path:
    """uv at :data:`UV_VERSION` in a tool venv under work/ (installed from PyPI on first use)."""
    exe = UV_TOOL_DIR / "bin" / "uv"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(UV_TOOL_DIR)], check=True)
        subprocess.run([str(UV_TOOL_DIR / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        f"uv=={UV_VERSION}"], check=True)
    return exe


def uv_compile(hashes: bool = True, platform: str | None = PLATFORM) -> list[str]:
    """``uv pip compile`` for ``platform`` (the VM's; None: every platform, ``--universal``) and the index
    as of INDEX_DATE."""
    target = ["--python-platform", platform] if platform else ["--universal"]
    return [str(uv()), "pip", "compile", *target, "--python-version", PYTHON,
            "--exclude-newer", INDEX_DATE, "--index-url", "https://pypi.org/simple", "--no-config", "--quiet",
            "--no-header", *(["--generate-hashes"] if hashes else [])]


def releases(names: list[str], resolution: str) -> dict[str, str]:
    """Each package's oldest (``resolution="lowest"``) or newest (``"highest"``) release on the index as
    of INDEX_DATE that installs on the VM, each on its own (``--no-deps``; needs PyPI)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "names.in").write_text("\n".join(sorted(names)) + "\n")
        cmd = [*uv_compile(hashes=False), "names.in", "--no-deps", "--no-annotate", "--resolution", resolution]
        out = subprocess.run(cmd, check=True, cwd=tmp, stdout=subprocess.PIPE, text=True).stdout
    return lock_pins(out)


def vacuous_floors(floors: dict[str, str]) -> dict[str, str]:
    """The floors at or below their package's oldest release: they admit every release (needs PyPI)."""
    oldest = releases(list(floors), "lowest")
    return {name: floor for name, floor in floors.items() if Version(floor) <= Version(oldest[name])}


def _write(out: Path, header: list[str], body: str) -> None:
    text = "".join(f"# {line}\n" if line else "#\n" for line in header)
    out.write_text(text + re.sub(r"\n{3,}", "\n\n", body))


def compile_vm_lock(out: Path) -> None:
    """Resolve the VM lock into ``out`` (both steps; needs PyPI)."""
    maxtext, rest = vm_inputs()
    floors = maxtext_floors()
    untaken = vacuous_floors(floors) | {name: floors[name] for name in LIFTED_FLOORS}
    kept = [f"{name}>={floor}" for name, floor in sorted(floors.items()) if name not in untaken]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "overrides.txt").write_text("\n".join(torch_overrides()) + "\n")
        (t / "step1.in").write_text("\n".join([maxtext, *kept]) + "\n")
        (t / "step2.in").write_text("\n".join([maxtext, *rest]) + "\n")
        # Relative names (run in `t`): the lock's "# via" comments then name no temporary directory.
        uv_pip = [*uv_compile(hashes=False), "--override", "overrides.txt"]
        subprocess.run([*uv_pip, "step1.in", "--resolution", "lowest-direct", "--no-annotate", "-o", "step1.txt"],
                       check=True, cwd=t)
        subprocess.run([*uv_pip, "step2.in", "--constraint", "step1.txt", "--generate-hashes", "-o", "lock.txt"],
                       check=True, cwd=t)
        body = (t / "lock.txt").read_text()
    _write(out, vm_header_lines(untaken), body)


def compile_laptop_lock(out: Path, vm_lock: Path = VM_LOCK) -> None:
    """Resolve the laptop lock into ``out``, with every pin of ``vm_lock`` as a constraint (needs PyPI)."""
    pins = lock_pins(vm_lock.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "vm-pins.txt").write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
        (t / "laptop.in").write_text("\n".join(laptop_requirements()) + "\n")
        subprocess.run([*uv_compile(), "laptop.in", "--constraint", "vm-pins.txt", "-o", "lock.txt"],
                       check=True, cwd=t)
        body = (t / "lock.txt").read_text()
    _write(out, laptop_header_lines(), body)


def control_requirements() -> list[str]:
    """The control plane's inputs (see the module docstring), MaxText aside."""
    rest = [str(r) for name, r in project_pins().items() if name not in CONTROL_LEFT_OUT]
    return [*rest, *CONTROL_EXTRA, f"pip=={PIP_VERSION}", f"uv=={UV_VERSION}"]


def compile_control_lock(out: Path, laptop_lock: Path = LAPTOP_LOCK) -> None:
    """Resolve the control plane's lock into ``out`` with every pin of ``laptop_lock`` as a constraint,
    check that it resolves for each of CONTROL_PLATFORMS, and add MaxText without its dependencies
    (needs PyPI)."""
    pins = lock_pins(laptop_lock.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "laptop-pins.txt").write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
        (t / "control.in").write_text("\n".join(control_requirements()) + "\n")
        (t / "maxtext.in").write_text(f"maxtext=={maxtext_version()}\n")
        subprocess.run([*uv_compile(platform=None), "control.in", "--constraint", "laptop-pins.txt", "-o", "lock.txt"],
                       check=True, cwd=t)
        for platform in CONTROL_PLATFORMS:
            subprocess.run([*uv_compile(hashes=False, platform=platform), "control.in", "--constraint",
                            "laptop-pins.txt", "-o", f"{platform}.txt"], check=True, cwd=t)
        subprocess.run([*uv_compile(platform=None), "maxtext.in", "--no-deps", "-o", "maxtext.txt"], check=True, cwd=t)
        body = (t / "lock.txt").read_text() + (t / "maxtext.txt").read_text()
    _write(out, control_header_lines(), body)


def control_header_lines() -> list[str]:
    return [
        "The control plane's environment (doit vm_*, dvc, publish, the report: no JAX, libtpu or MaxText's",
        "stack), installed by `make control` into .venv-control with `uv pip sync`, on Linux or macOS.",
        "Generated by `make lock` (mtpipe/pipeline/requirement_locks.py); do not edit. Inputs, from pyproject.toml:",
        f"  {' '.join(control_requirements())}",
        "  constraints: every pin of requirements.lock (the laptop's versions)",
        f"  resolved --universal, checked for {' '.join(CONTROL_PLATFORMS)}; Python {PYTHON}, PyPI as of "
        f"{INDEX_DATE}, uv {UV_VERSION}",
        f"  and maxtext=={maxtext_version()} without its dependencies (its config files: the machine budget)",
        "",
    ]


def vm_header_lines(untaken: dict[str, str]) -> list[str]:
    """The VM lock's header; ``untaken``: MaxText's floors left out of step 1 (name -> floor)."""
    maxtext, rest = vm_inputs()
    vacuous = {name: floor for name, floor in untaken.items() if name not in LIFTED_FLOORS}
    return [
        "The TPU VM's environment, installed by `doit vm_setup` with `uv pip sync --require-hashes`.",
        "Generated by `make lock` (mtpipe/pipeline/requirement_locks.py); do not edit. Inputs, from pyproject.toml:",
        f"  step 1 (--resolution lowest-direct): {maxtext} and its floors (MaxText's lock), except",
        f"    floors at the package's oldest release: {' '.join(f'{n}>={v}' for n, v in sorted(vacuous.items()))}",
        f"    floors lifted (LIFTED_FLOORS): {' '.join(f'{n}>={untaken[n]}' for n in sorted(LIFTED_FLOORS))}",
        "    (those and the packages MaxText does not name: the newest release that fits)",
        f"  step 2 (step 1 as constraints): {' '.join(rest)}",
        f"  overrides: {' '.join(torch_overrides())}",
        f"  for {PLATFORM}, Python {PYTHON}, PyPI as of {INDEX_DATE}, uv {UV_VERSION}",
        "",
    ]


def laptop_header_lines() -> list[str]:
    rest = [str(r) for name, r in project_pins().items() if name != "maxtext"]
    return [
        "The laptop's (and CI's) environment, installed by `make` with uv.",
        "Generated by `make lock` (mtpipe/pipeline/requirement_locks.py); do not edit. Inputs, from pyproject.toml:",
        f"  maxtext=={maxtext_version()} with the package names of its [{LAPTOP_MAXTEXT_EXTRA}] extra",
        f"  {' '.join(rest)}",
        f"  test: {' '.join(suite_pins())}; pip=={PIP_VERSION} uv=={UV_VERSION}",
        "  constraints: every pin of requirements-vm.lock (one version of each package on both machines)",
        f"  for {PLATFORM}, Python {PYTHON}, PyPI as of {INDEX_DATE}, uv {UV_VERSION}",
        "",
    ]


def via(text: str) -> dict[str, set[str]]:
    """Package -> the packages that require it, from a lock's ``# via`` comments."""
    out: dict[str, set[str]] = {}
    name = None
    for line in text.splitlines():
        if m := re.match(r"([A-Za-z0-9_.\-]+)==", line):
            name = canonicalize_name(m[1])
            out[name] = set()
        elif name and (m := re.fullmatch(r"\s+#(?: via)?\s+([A-Za-z0-9_.\-]+)", line)):
            out[name].add(canonicalize_name(m[1]))
    return out


def free_packages(text: str) -> list[str]:
    """The VM lock's packages that neither MaxText floors (a floor that bounds nothing, or a lifted one,
    counts as none) nor the project pins: each should be at its newest release (needs PyPI)."""
    floors = maxtext_floors()
    untaken = vacuous_floors(floors).keys() | LIFTED_FLOORS.keys()
    maxtext, rest = vm_inputs()
    pinned = {canonicalize_name(Requirement(r).name) for r in [maxtext, *rest, *torch_overrides()]}
    return sorted(lock_pins(text).keys() - (floors.keys() - untaken) - pinned)


def behind(text: str, newest: dict[str, str]) -> dict[str, tuple[str, str]]:
    """name -> (pin, newest release) for each package of ``newest`` that the VM lock ``text`` pins below
    it, unless a package the lock names holds it back (:data:`HELD_BACK`, :data:`TORCH_PINS`)."""
    pins, requirers = lock_pins(text), via(text)
    held = {name: {"torch", "cuda-toolkit"} if TORCH_PINS.match(name) else HELD_BACK.get(name, set())
            for name in newest}
    return {name: (pins[name], version) for name, version in sorted(newest.items())
            if pins[name] != version and not held[name] & requirers[name]}


def lock_diff(committed: str, resolved: str) -> list[str]:
    """``name: committed -> resolved`` for each package whose pin differs (``-``: not in that lock), or one
    line when only hashes or comments differ (a file added to a release, say)."""
    old, new = lock_pins(committed), lock_pins(resolved)
    lines = [f"{name}: {old.get(name, '-')} -> {new.get(name, '-')}"
             for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]
    if not lines and committed != resolved:
        lines.append("the same versions, other hashes or comments")
    return lines


def report(sections: dict[str, list[str]]) -> str:
    """Each section with lines under its title and then how to relock; "" when every section is empty."""
    found = [f"{title}:\n" + "".join(f"  {line}\n" for line in lines) for title, lines in sections.items() if lines]
    return "".join(found) + RELOCK if found else ""


def check() -> int:
    """Resolve both locks again as ``make lock`` does, into a temporary directory, and apply the newest
    release rule to the committed VM lock (``make lock-check``; needs PyPI). Prints what moved and how
    to relock; returns 1 when something moved, else 0."""
    committed = VM_LOCK.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        vm, laptop, control = (Path(tmp) / lock.name for lock in (VM_LOCK, LAPTOP_LOCK, CONTROL_LOCK))
        compile_vm_lock(vm)
        compile_laptop_lock(laptop, vm_lock=vm)
        compile_control_lock(control, laptop_lock=laptop)
        sections = {
            f"{lock.name} (committed pin -> the index now)": lock_diff(lock.read_text(), new.read_text())
            for lock, new in ((VM_LOCK, vm), (LAPTOP_LOCK, laptop), (CONTROL_LOCK, control))}
    free = free_packages(committed)
    sections[f"{VM_LOCK.name}, below the newest release although nothing chose it (pin -> newest)"] = [
        f"{name}: {pin} -> {version}" for name, (pin, version) in behind(committed, releases(free, "highest")).items()]
    text = report(sections)
    print(text or f"the locks are what the index (PyPI as of {INDEX_DATE}) gives now")
    return 1 if text else 0


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the requirement locks (make lock), or check them (make lock-check)")
    parser.add_argument("--check", action="store_true", help="resolve again and compare; exit 1 if something moved")
    if parser.parse_args().check:
        sys.exit(check())
    compile_vm_lock(VM_LOCK)
    compile_laptop_lock(LAPTOP_LOCK)
    compile_control_lock(CONTROL_LOCK)
    print(f"wrote {', '.join(str(lock.relative_to(ROOT)) for lock in (VM_LOCK, LAPTOP_LOCK, CONTROL_LOCK))}")


if __name__ == "__main__":
    main()
