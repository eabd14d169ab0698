"""What a MaxText process spends importing before it does anything, with and without the adapter's
deferred imports (mtpipe/maxtext/maxtext_adapter.py, patch 10).

    python benchmarks/bench_startup.py [--runs 3]

Each row imports one MaxText entry module in a fresh interpreter, `--runs` times, alternating
plain and deferred so that both see the same machine load; the table gives the median wall seconds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["maxtext.trainers.post_train.sft.train_sft", "maxtext.checkpoint_conversion.to_maxtext"]
DEFER = "from mtpipe.maxtext import maxtext_adapter; maxtext_adapter.defer_unused_imports(); "


def import_seconds(module: str, deferred: bool) -> float:
    """Wall seconds of `import module` in a new interpreter (the interpreter's own start included)."""
    code = (DEFER if deferred else "") + f"import {module}"
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True,
                   env={"JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE", "PATH": "/usr/bin:/bin"})
    return time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    import_seconds(MODULES[0], deferred=False)  # warm the page cache: the first import reads every file
    print("| module | plain import (s) | deferred (s) | ratio |")
    print("| --- | --- | --- | --- |")
    for module in MODULES:
        plain, deferred = [], []
        for _ in range(args.runs):
            plain.append(import_seconds(module, deferred=False))
            deferred.append(import_seconds(module, deferred=True))
        p, d = statistics.median(plain), statistics.median(deferred)
        print(f"| {module} | {p:.1f} | {d:.1f} | {d / p:.2f} |", flush=True)


if __name__ == "__main__":
    main()
