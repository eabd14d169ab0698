"""Child-process entry: patch MaxText, run one of its modules as __main__, exit with its status.

    python -m mtpipe.maxtext.launch maxtext.checkpoint_conversion.to_maxtext model_name=... --hf_model_path=...

Arguments after the module name are passed to it unchanged (as its sys.argv[1:]). Nothing here
prints argv; secrets come from the environment only (see mtpipe.maxtext.maxtext_adapter.reject_secrets).
"""

from __future__ import annotations

import runpy
import sys

from mtpipe.maxtext import maxtext_adapter


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


def main(argv: list[str] | None = None) -> int:
    """Apply the adapter's patches, run the module, then the adapter's post-processing if it succeeded."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m mtpipe.maxtext.launch <maxtext.module> [args...]", file=sys.stderr)
        return 2
    module, args = argv[0], argv[1:]
    try:
        finish = maxtext_adapter.apply(module, args)
    except maxtext_adapter.AdapterError as exc:
        print(f"mtpipe.maxtext.launch: error: {exc}", file=sys.stderr)
        return 2
    status = run_module(module, args)
    if status == 0 and (stopped := maxtext_adapter.stopped_status()) is not None:
        return stopped  # SIGTERM: the run saved its checkpoint but did not finish
    if status == 0:
        finish()
    return status


if __name__ == "__main__":
    sys.exit(main())
