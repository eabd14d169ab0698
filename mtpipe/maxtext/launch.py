"""What the child-process entry points of the adapter (:mod:`mtpipe.maxtext.adapter.conversion`,
:mod:`mtpipe.maxtext.adapter.training`) do: patch MaxText, run one of its modules as __main__, exit
with its status.

    python -m mtpipe.maxtext.adapter.conversion maxtext.checkpoint_conversion.to_maxtext model_name=... \
        --hf_model_path=...

Arguments after the module name are passed to it unchanged (as its sys.argv[1:]). Nothing here
prints argv; secrets come from the environment only (see mtpipe.maxtext.adapter.reject_secrets).
"""

from __future__ import annotations

import gc
import runpy
import sys
from typing import Callable

from mtpipe.maxtext.adapter import AdapterError


def _exit_status(code: object) -> int:
    """The status Python itself would exit with for `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_module(module: str, args: list[str]) -> int:
    """Run `module` as __main__ with sys.argv = [module, *args]; return its exit status."""
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return _exit_status(exc.code)
    return 0


def main(apply: Callable[[str, list[str]], Callable[[], None]], argv: list[str] | None = None,
         stopped_status: Callable[[], int | None] = lambda: None) -> int:
    """Patch MaxText with `apply`, run the module, then the post-processing `apply` returned if it
    succeeded; a run that SIGTERM stopped after its save exits with `stopped_status()` instead.

    The heap is frozen (`gc.freeze`) twice: after the patches' imports, so that the collector's full
    passes during the run skip JAX's, tunix's and transformers' modules, and after the run, so that the
    interpreter's exit frees the modules by their reference counts without a full collection over
    them (docs/testing.md)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m mtpipe.maxtext.adapter.{conversion,training} <maxtext.module> [args...]",
              file=sys.stderr)
        return 2
    module, args = argv[0], argv[1:]
    try:
        finish = apply(module, args)
    except AdapterError as exc:
        print(f"mtpipe.maxtext.adapter: error: {exc}", file=sys.stderr)
        return 2
    gc.freeze()  # what is imported by now lives as long as the process: no full collection scans it again
    status = run_module(module, args)
    stopped = stopped_status() if status == 0 else None  # SIGTERM: the run saved its checkpoint, not finished
    if status == 0 and stopped is None:
        finish()
    gc.freeze()  # the run is over: the interpreter's exit does not collect its heap (3-4 s of CPU)
    return status if stopped is None else stopped
