"""The TPU VM's pinned environment: ``requirements-vm.lock`` and how it is made (``make lock-vm``).

The VM runs the tutorials' environment. The tutorial installs it in two steps::

    uv pip install "maxtext[tpu-post-train]==V" --resolution=lowest   # MaxText's own lower bounds
    uv pip install dvc==.. dvc-gs==.. omegaconf==.. doit==..           # the rest, keeping step 1

The lock is resolved here the same way, for the VM (Linux x86_64, glibc 2.35, Python 3.12), with
hashes, and ``vm_setup`` installs it with ``uv pip sync --require-hashes`` (conf/vm.yaml ``setup:``):

1. ``maxtext[tpu-post-train]`` at the lowest versions its bounds allow (the versions MaxText tested);
2. everything: step 1's pins as constraints, the project's pins, pip and uv (newest that fit).

Versions come from ``pyproject.toml``: the one place for MaxText's version and the project's pins,
for the laptop and the VM alike. ``--exclude-newer`` fixes the index as of :data:`INDEX_DATE`, so the
resolution is reproducible (tests/test_vm_lock.py resolves it again and compares).

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

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements-vm.lock"
UV_VERSION = "0.13.9"        # resolves the lock, and installed on the VM (conf/vm.yaml, and in the lock)
PIP_VERSION = "26.3"         # MaxText's extra-deps installer runs `python -m pip install uv` in the venv
INDEX_DATE = "2026-12-01T00:00:00Z"
PLATFORM = "x86_64-manylinux_2_35"   # the VM image: Ubuntu 22.04 (glibc 2.35), x86_64
PYTHON = "3.12"
MAXTEXT_EXTRA = "tpu-post-train"
VM_PACKAGES = ("dvc", "dvc-gs", "doit", "omegaconf")  # from pyproject.toml, besides MaxText
UV_TOOL_DIR = ROOT / "work" / f"uv-{UV_VERSION}"


def project_pins() -> dict[str, Requirement]:
    """pyproject.toml's dependencies by name (each pinned with ==)."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name: r for d in deps}


def maxtext_version() -> str:
    """MaxText's version, as pyproject.toml pins it (``maxtext[tpu]==V``)."""
    (spec,) = project_pins()["maxtext"].specifier
    return spec.version


def requirements() -> tuple[list[str], list[str]]:
    """(step 1, step 2) inputs of the resolution (see the module docstring)."""
    pins = project_pins()
    maxtext = f"maxtext[{MAXTEXT_EXTRA}]=={maxtext_version()}"
    rest = [str(pins[name]) for name in VM_PACKAGES] + [f"pip=={PIP_VERSION}", f"uv=={UV_VERSION}"]
    return [maxtext], [maxtext, *rest]


def torch_overrides() -> list[str]:
    """MaxText's ``+cpu`` pins (PyTorch's index only) as the same versions from PyPI.

    Read from the installed MaxText's metadata, which the laptop environment pins to the same version.
    """
    dist = metadata.distribution("maxtext")
    if dist.version != maxtext_version():
        raise RuntimeError(f"installed maxtext {dist.version} != pyproject.toml's {maxtext_version()}: run `make`")
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker and req.marker.evaluate({"extra": MAXTEXT_EXTRA}) and "+" in str(req.specifier):
            (spec,) = req.specifier
            out.append(f"{req.name}=={spec.version.split('+')[0]}")
    return sorted(out)


def uv() -> Path:
    """uv at :data:`UV_VERSION` in a tool venv under work/ (installed from PyPI on first use)."""
    exe = UV_TOOL_DIR / "bin" / "uv"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(UV_TOOL_DIR)], check=True)
        subprocess.run([str(UV_TOOL_DIR / "bin" / "python"), "-m", "pip", "install", "--quiet",
                        f"uv=={UV_VERSION}"], check=True)
    return exe


def compile_lock(out: Path) -> None:
    """Resolve the VM lock into `out` (both steps; needs PyPI)."""
    common = ["--python-platform", PLATFORM, "--python-version", PYTHON, "--exclude-newer", INDEX_DATE,
              "--index-url", "https://pypi.org/simple", "--no-config", "--quiet"]
    step1, step2 = requirements()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "overrides.txt").write_text("\n".join(torch_overrides()) + "\n")
        (t / "step1.in").write_text("\n".join(step1) + "\n")
        (t / "step2.in").write_text("\n".join(step2) + "\n")
        # Relative names (run in `t`): the lock's "# via" comments then name no temporary directory.
        uv_pip = [str(uv()), "pip", "compile", *common, "--override", "overrides.txt"]
        subprocess.run([*uv_pip, "step1.in", "--resolution", "lowest", "--no-header", "--no-annotate",
                        "-o", "step1.txt"], check=True, cwd=t)
        subprocess.run([*uv_pip, "step2.in", "--constraint", "step1.txt", "--generate-hashes", "--no-header",
                        "-o", "lock.txt"], check=True, cwd=t)
        body = (t / "lock.txt").read_text()
    header = "".join(f"# {line}\n" if line else "#\n" for line in header_lines())
    out.write_text(header + re.sub(r"\n{3,}", "\n\n", body))


def header_lines() -> list[str]:
    step1, step2 = requirements()
    return [
        "The TPU VM's environment, installed by `doit vm_setup` with `uv pip sync --require-hashes`.",
        "Generated by `make lock-vm` (mtpipe/cloud/vm_lock.py); do not edit. Inputs, from pyproject.toml:",
        f"  step 1 (--resolution lowest): {' '.join(step1)}",
        f"  step 2 (step 1 as constraints): {' '.join(step2[1:])}",
        f"  overrides: {' '.join(torch_overrides())}",
        f"  for {PLATFORM}, Python {PYTHON}, PyPI as of {INDEX_DATE}, uv {UV_VERSION}",
        "",
    ]


def main() -> None:
    compile_lock(LOCK)
    print(f"wrote {LOCK.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
