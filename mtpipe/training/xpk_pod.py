"""The pod's side of an xpk workload: ``python3 -m mtpipe.training.xpk_pod``, the start of its command.

mtpipe.training.xpk (this machine's side) submits the workload with the command
``python3 -m mtpipe.training.xpk_pod --run-dir URL [--fetch URL=DIR]... [--metrics FILE] -- COMMAND...``.
In each pod, :func:`main` copies the tokenizer into the container (Hugging Face's loaders and vLLM
read local directories only), runs the MaxText command, and on the first host mirrors its output and
MaxText's metrics file into the run directory (``RunDir.mirrored``), where this machine's side reads
them. It runs in the workload's image (mtpipe/training/image.py) and imports nothing of this
machine's side. docs/multihost.md has the setup, the costs and what is tested where.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

from mtpipe.maxtext.run_dir import RunDir, gcs

POD_DIR = "/tmp/mtpipe"    # in the container
LOG_DIR = "xpk-logs"       # in the run directory: one log per attempt of the first host


def is_first_host() -> bool:
    """Worker 0 of slice 0 (GKE sets TPU_WORKER_ID and, for several slices, MEGASCALE_SLICE_ID; a
    Pathways head pod has neither)."""
    return os.environ.get("TPU_WORKER_ID", "0") == "0" and os.environ.get("MEGASCALE_SLICE_ID", "0") == "0"


def main(argv: list[str]) -> int:
    """``--run-dir URL [--fetch URL=DIR]... [--metrics FILE] -- COMMAND...``: fetch, run, mirror.

    On the first host the log (this process's output, its own errors included) and the metrics
    file are mirrored into the run directory; every host prints the command's output as it comes."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python3 -m mtpipe.training.xpk_pod",
                                     description="The start of an xpk workload's command (mtpipe/training/xpk_pod.py).")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--fetch", action="append", default=[], metavar="URL=DIR")
    parser.add_argument("--metrics", type=Path)
    opts, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("no command after --")
    base, _, run_name = opts.run_dir.rpartition("/")
    scratch = Path(POD_DIR)
    log_file = scratch / LOG_DIR / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{socket.gethostname()}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as mirrors, open(log_file, "a", encoding="utf8") as log:
        def emit(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()
            log.write(text)
            log.flush()

        if is_first_host():
            mirrors.enter_context(RunDir(opts.run_dir, LOG_DIR, scratch).mirrored(log_file))
            if opts.metrics:
                mirrors.enter_context(RunDir(base, run_name, scratch).mirrored(opts.metrics))
        try:
            fetch(opts.fetch)
        except Exception:  # a missing object or a permission error: into the log the laptop reads
            emit(traceback.format_exc() + "# exit 1\n")
            return 1
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", bufsize=1)
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # preemption: MaxText gets the notice
        assert proc.stdout is not None
        for line in proc.stdout:
            emit(line)
        code = proc.wait()
        emit(f"# exit {code}\n")
    return code


def fetch(specs: list[str]) -> None:
    """Copy each ``URL=DIR`` from the bucket unless the directory exists (a restarted container may keep it)."""
    fs = gcs()
    for spec in specs:
        url, _, directory = spec.partition("=")
        if Path(directory).is_dir():
            continue
        partial = Path(f"{directory}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.parent.mkdir(parents=True, exist_ok=True)
        fs.get(url, str(partial), recursive=True)
        os.replace(partial, directory)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
