"""Where a run on the VM is, for `doit vm_status` from another terminal while `vm_run` runs.

Read over SSH from the checkout on the VM: the newest training progress file the runner rewrites
at each step (mtpipe.maxtext.progress: stage, step, loss, ETA) and the last stage that finished
(work/timings.jsonl, mtpipe.pipeline.stage.Timer). Reading them changes nothing on the VM.
"""

from __future__ import annotations

import json
import shlex
import time

from mtpipe.cloud.on_vm import ssh
from mtpipe.cloud.settings.vm_config import VmError
from mtpipe.maxtext import progress

# One line per file found: "progress <json>" and "finished <json>"; nothing when the VM has no run yet.
SCRIPT = ('cd "$HOME"/{remote_dir}/work 2>/dev/null || exit 0; '
          'newest=$(ls -t logs/*/*{suffix} 2>/dev/null | head -n 1); '
          'if [ -n "$newest" ]; then printf "progress "; head -n 1 "$newest"; fi; '
          'if [ -s timings.jsonl ]; then printf "finished "; tail -n 1 timings.jsonl; fi')


def run_lines(remote: ssh.Remote, remote_dir: str) -> list[str]:
    """The run's progress as `vm_status` prints it; a VM that SSH cannot reach says so in a line."""
    script = SCRIPT.format(remote_dir=shlex.quote(remote_dir), suffix=progress.SUFFIX)
    try:
        rc, out = ssh.run(remote, script, stream=False)
    except VmError as e:
        return [f"  run: not read ({e})"]
    found = {}
    for line in out.decode("utf-8", "replace").splitlines():
        kind, _, record = line.partition(" ")
        try:
            found[kind] = json.loads(record)
        except json.JSONDecodeError:
            continue
    if rc != 0 or not found:
        return ["  run: no training has reported a step on the VM yet"]
    lines = []
    if "progress" in found:
        lines.append(f"  training: {progress.describe(found['progress'], time.time())}")
    if "finished" in found:
        last = found["finished"]
        lines.append(f"  last stage finished: {last['stage']} in {last['wall_s']:.0f} s, at {last['at']}")
    return lines
