"""Stage to_maxtext@<branch>: convert the downloaded HF checkpoint to MaxText format (scanned layers).

Runs maxtext.checkpoint_conversion.to_maxtext on the host CPU, as the tutorial does, and checks that
it wrote an orbax checkpoint at artifacts/<branch>/maxtext/0/items.
Run: dvc repro to_maxtext@sft   (or: python -m stages.to_maxtext sft)
"""

import sys

from mtpipe import commands, runner
from mtpipe.config import load_stage
from mtpipe.stage import (
    ROOT, artifact, atomic_dir, digest, log_path, require, run_stage, Timer, write_json, write_stamp)


def main(branch: str) -> None:
    cfg, timer = load_stage(branch, "to_maxtext"), Timer()
    model = artifact(branch, "model")
    with atomic_dir(artifact(branch, "maxtext")) as out:
        cmd = commands.to_maxtext(cfg, hf_dir=model / "files", out_dir=out)
        runner.run(cmd, log_path(branch, "to_maxtext"))
        require(out / "0" / "items", "MaxText checkpoint 0/items")
        write_stamp(out, "to_maxtext", digest(cfg, model))
    write_json(ROOT / "metrics" / branch / "to_maxtext.json", {"wall_s": timer.seconds()})


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
