"""Download the wheels the lent TPU chip's package index lacks (the pins marked `# carried` in
requirements-chip.txt) into .tpu-chip/wheels, for a run on the chip (docs/tpu-chip.md).

    python benchmarks/on_tpu/bundle.py        # on the laptop, with PyPI; safe to run twice

The chip's machine has Python 3.11 and no internet: everything else comes from its own index
(file:///opt/pypi/simple). About 45 MiB; a wheel already there is not downloaded again.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PINS = HERE / "requirements-chip.txt"
WHEELS = ROOT / ".tpu-chip" / "wheels"
CHIP_PYTHON = "3.11"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def carried() -> list[tuple[str, str]]:
    """(pin, how) of every `# carried` line: how is 'wheel', 'py3.12' (a pure-Python wheel whose
    metadata asks Python >= 3.12) or 'sdist' (built here into a pure-Python wheel)."""
    out = []
    for line in PINS.read_text().splitlines():
        pin, _, mark = line.partition("#")
        if m := re.match(r"\s*carried(?:, (py3\.12|sdist))?", mark):
            out.append((pin.strip(), m[1] or "wheel"))
    return out


def have(pin: str) -> bool:
    """A wheel of ``pin`` (name==version) is in WHEELS."""
    name, version = pin.split("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    return any(w.name.lower().startswith(f"{stem}-{version}-") for w in WHEELS.glob("*.whl"))


def fetch(pin: str, how: str) -> None:
    """Download (or build) one pinned wheel into WHEELS."""
    pip = [sys.executable, "-m", "pip"]
    if how == "sdist":
        cmd = [*pip, "wheel", "--quiet", "--no-deps", "-w", str(WHEELS), pin]
    else:
        python = "3.12" if how == "py3.12" else CHIP_PYTHON
        cmd = [*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(WHEELS),
               "--python-version", python, "--implementation", "cp",
               *[arg for p in PLATFORMS for arg in ("--platform", p)], pin]
    subprocess.run(cmd, check=True, env={"PIP_CONFIG_FILE": "/dev/null", "PATH": "/usr/bin:/bin"})


def main() -> None:
    WHEELS.mkdir(parents=True, exist_ok=True)
    pins = carried()
    for pin, how in pins:
        if not have(pin):
            print(f"  {pin} ({how})", flush=True)
            fetch(pin, how)
    missing = [pin for pin, _ in pins if not have(pin)]
    if missing:
        sys.exit(f"bundle.py: no wheel for {missing} in {WHEELS}")
    size = sum(w.stat().st_size for w in WHEELS.glob("*.whl"))
    print(f"{len(pins)} carried wheels in {WHEELS.relative_to(ROOT)} ({size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
