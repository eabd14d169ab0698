"""The two pinned environments and how they are made (``make lock``): one toolchain for both.

``requirements-vm.lock`` is the TPU VM's environment, resolved the way the tutorial installs it::

    uv pip install "maxtext[tpu-post-train]==V" --resolution=lowest   # MaxText's own lower bounds
    uv pip install dvc==.. dvc-gs==.. omegaconf==.. doit==..           # the rest, keeping step 1

here for the VM (Linux x86_64, glibc 2.35, Python 3.12), with hashes; ``vm_setup`` installs it with
``uv pip sync --require-hashes`` (conf/vm.yaml ``setup:``):

1. ``maxtext[tpu-post-train]`` at the lowest versions its bounds allow (the versions MaxText tested);
2. everything: step 1's pins as constraints, the project's pins, pip and uv (newest that fit).

``requirements.lock`` is the laptop's (and CI's): MaxText with the packages of its ``tpu`` extra (the
pre-training stack: no vLLM, no torch), the project's pins and its test extra, resolved with the whole
VM lock as constraints. So every package both machines install has one version, the VM's: the
checkpoint Orbax writes on the laptop is read on the VM by the same Orbax, and ``doit preflight``
compiles with the VM's jax and libtpu. The ``tpu`` extra's own lower bounds (e.g. libtpu >= 0.0.46)
are above the ``tpu-post-train`` ones the tutorial installs (libtpu 0.0.44), so the laptop takes the
extra's package names and the VM's versions, not the extra's bounds (docs/decisions.md).

Versions come from ``pyproject.toml``: the one place for MaxText's version and the project's pins.
``--exclude-newer`` fixes the index as of :data:`INDEX_DATE`, so both resolutions are reproducible
(tests/test_vm_lock.py and tests/test_toolchain.py resolve them again and compare).

``tpu-post-train`` pins ``torch==2.11.0+cpu`` / ``torchvision==0.26.0+cpu``: builds only the PyTorch
index serves. They are overridden with the same versions from PyPI (CUDA builds that run on the CPU;
about 3 GB more on the VM's 200 GB disk), so everything resolves from PyPI alone and every file is
hash-pinned. What ``install_tpu_post_train_extra_deps`` adds afterwards (vLLM built for TPU,
tpu-inference, a tunix commit) comes from GitHub commits pinned in MaxText's own
``dependencies/extra_deps/post_train_github_deps.txt``, installed ``--no-deps``: not in this lock.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from mtpipe.pipeline.toolchain import lock_pins

ROOT = Path(__file__).resolve().parents[2]
VM_LOCK = ROOT / "requirements-vm.lock"
LAPTOP_LOCK = ROOT / "requirements.lock"
UV_VERSION = "0.13.9"        # resolves the locks, installs the laptop's, and installed on the VM (conf/vm.yaml)
PIP_VERSION = "26.3"         # MaxText's extra-deps installer runs `python -m pip install uv` in the venv
INDEX_DATE = "2026-12-01T00:00:00Z"
PLATFORM = "x86_64-manylinux_2_35"   # the VM image: Ubuntu 22.04 (glibc 2.35), x86_64; the laptop too
PYTHON = "3.12"
MAXTEXT_EXTRA = "tpu-post-train"     # the VM's (the tutorials')
LAPTOP_MAXTEXT_EXTRA = "tpu"         # the laptop takes this extra's package names at the VM's versions
VM_PACKAGES = ("dvc", "dvc-gs", "doit", "omegaconf", "lm-eval")  # from pyproject.toml, besides MaxText
UV_TOOL_DIR = ROOT / "work" / f"uv-{UV_VERSION}"


def project_pins() -> dict[str, Requirement]:
    """pyproject.toml's dependencies by name (each pinned with ==)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: r for d in deps}


def test_pins() -> list[str]:
    """pyproject.toml's ``test`` extra (the laptop's and CI's)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]


def maxtext_version() -> str:
    """MaxText's version, as pyproject.toml pins it (``maxtext==V``)."""
    (spec,) = project_pins()["maxtext"].specifier
    return spec.version


def requirements() -> tuple[list[str], list[str]]:
    """(step 1, step 2) inputs of the VM's resolution (see the module docstring)."""
    pins = project_pins()
    maxtext = f"maxtext[{MAXTEXT_EXTRA}]=={maxtext_version()}"
    rest = [str(pins[name]) for name in VM_PACKAGES] + [f"pip=={PIP_VERSION}", f"uv=={UV_VERSION}"]
    return [maxtext], [maxtext, *rest]


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
    return [f"maxtext=={maxtext_version()}", *names, *rest, *test_pins(), f"pip=={PIP_VERSION}", f"uv=={UV_VERSION}"]


def uv() -> Path:
    """uv at :data:`UV_VERSION` in a tool venv under work/ (installed from PyPI on first use)."""
    exe = UV_TOOL_DIR / "bin" / "uv"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(UV_TOOL_DIR)], check=True)
        subprocess.run([str(UV_TOOL_DIR / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        f"uv=={UV_VERSION}"], check=True)
    return exe


def _uv_compile(tmp: Path) -> list[str]:
    """``uv pip compile`` for the VM's platform and the index as of INDEX_DATE (run in ``tmp``)."""
    return [str(uv()), "pip", "compile", "--python-platform", PLATFORM, "--python-version", PYTHON,
            "--exclude-newer", INDEX_DATE, "--index-url", "https://pypi.org/simple", "--no-config", "--quiet",
            "--no-header", "--generate-hashes"]


def _write(out: Path, header: list[str], body: str) -> None:
    text = "".join(f"# {line}\n" if line else "#\n" for line in header)
    out.write_text(text + re.sub(r"\n{3,}", "\n\n", body))


def compile_vm_lock(out: Path) -> None:
    """Resolve the VM lock into ``out`` (both steps; needs PyPI)."""
    step1, step2 = requirements()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "overrides.txt").write_text("\n".join(torch_overrides()) + "\n")
        (t / "step1.in").write_text("\n".join(step1) + "\n")
        (t / "step2.in").write_text("\n".join(step2) + "\n")
        # Relative names (run in `t`): the lock's "# via" comments then name no temporary directory.
        uv_pip = [*_uv_compile(t), "--override", "overrides.txt"]
        uv_pip.remove("--generate-hashes")
        subprocess.run([*uv_pip, "step1.in", "--resolution", "lowest", "--no-annotate", "-o", "step1.txt"],
                       check=True, cwd=t)
        subprocess.run([*uv_pip, "step2.in", "--constraint", "step1.txt", "--generate-hashes", "-o", "lock.txt"],
                       check=True, cwd=t)
        body = (t / "lock.txt").read_text()
    _write(out, vm_header_lines(), body)


def compile_laptop_lock(out: Path, vm_lock: Path = VM_LOCK) -> None:
    """Resolve the laptop lock into ``out``, with every pin of ``vm_lock`` as a constraint (needs PyPI)."""
    pins = lock_pins(vm_lock.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "vm-pins.txt").write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
        (t / "laptop.in").write_text("\n".join(laptop_requirements()) + "\n")
        subprocess.run([*_uv_compile(t), "laptop.in", "--constraint", "vm-pins.txt", "-o", "lock.txt"],
                       check=True, cwd=t)
        body = (t / "lock.txt").read_text()
    _write(out, laptop_header_lines(), body)


def vm_header_lines() -> list[str]:
    step1, step2 = requirements()
    return [
        "The TPU VM's environment, installed by `doit vm_setup` with `uv pip sync --require-hashes`.",
        "Generated by `make lock` (mtpipe/cloud/locks.py); do not edit. Inputs, from pyproject.toml:",
        f"  step 1 (--resolution lowest): {' '.join(step1)}",
        f"  step 2 (step 1 as constraints): {' '.join(step2[1:])}",
        f"  overrides: {' '.join(torch_overrides())}",
        f"  for {PLATFORM}, Python {PYTHON}, PyPI as of {INDEX_DATE}, uv {UV_VERSION}",
        "",
    ]


def laptop_header_lines() -> list[str]:
    rest = [str(r) for name, r in project_pins().items() if name != "maxtext"]
    return [
        "The laptop's (and CI's) environment, installed by `make` with uv.",
        "Generated by `make lock` (mtpipe/cloud/locks.py); do not edit. Inputs, from pyproject.toml:",
        f"  maxtext=={maxtext_version()} with the package names of its [{LAPTOP_MAXTEXT_EXTRA}] extra",
        f"  {' '.join(rest)}",
        f"  test: {' '.join(test_pins())}; pip=={PIP_VERSION} uv=={UV_VERSION}",
        "  constraints: every pin of requirements-vm.lock (one version of each package on both machines)",
        f"  for {PLATFORM}, Python {PYTHON}, PyPI as of {INDEX_DATE}, uv {UV_VERSION}",
        "",
    ]


def main() -> None:
    compile_vm_lock(VM_LOCK)
    compile_laptop_lock(LAPTOP_LOCK)
    print(f"wrote {VM_LOCK.relative_to(ROOT)} and {LAPTOP_LOCK.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
