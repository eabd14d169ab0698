"""Stage to_maxtext@<branch>: convert the downloaded HF checkpoint to MaxText format (scanned layers).

Runs maxtext.checkpoint_conversion.to_maxtext on the host CPU, as the tutorial does, and checks that
it wrote an orbax checkpoint at artifacts/<branch>/maxtext/0/items. The same model gives the same
bytes (plain storage, Orbax's timestamps removed), so a rerun leaves every later stage up to date.
Run: dvc repro to_maxtext@sft   (or: python -m stages.to_maxtext sft)
"""

import sys

from mtpipe.maxtext import conversion_commands, runner
from mtpipe.maxtext.checkpoints import normalise_orbax_metadata
from mtpipe.pipeline.stage import Timer, atomic_dir, open_stage, require, run_stage, size_mib, write_json, write_stamp


def main(branch: str) -> None:
    stage, timer = open_stage("to_maxtext", branch), Timer()
    with atomic_dir(stage.outs["maxtext"]) as out:
        cmd = conversion_commands.to_maxtext(stage.view, hf_dir=stage.reads["model"] / "files", out_dir=out)
        runner.run(cmd, stage.log)
        require(out / "0" / "items", "MaxText checkpoint 0/items")
        normalise_orbax_metadata(out)
        write_stamp(out, "to_maxtext")
        checkpoint_mib = size_mib(out)
    write_json(stage.metrics, {"checkpoint_mib": checkpoint_mib})
    timer.record(branch, "to_maxtext")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
