"""Stage to_huggingface@<branch>: export the trained params as a standard Hugging Face directory.

Runs maxtext.checkpoint_conversion.to_huggingface (config.json, safetensors, the source's tokenizer
files) and checks the result before it replaces artifacts/<branch>/hf/.
Run: dvc repro to_huggingface@sft   (or: python -m stages.to_huggingface sft)
"""

import sys

from mtpipe.maxtext import conversion_commands, runner
from mtpipe.pipeline.stage import Timer, atomic_dir, open_stage, require, run_stage, size_mib, write_json, write_stamp


def main(branch: str) -> None:
    stage, timer = open_stage("to_huggingface", branch), Timer()
    cfg, trained, model = stage.view, stage.reads["trained"], stage.reads["model"]
    with atomic_dir(stage.outs["hf"]) as out:
        cmd = conversion_commands.to_huggingface(cfg, params=trained / "model_params", hf_src_dir=model / "files",
                                                 out_dir=out)
        runner.run(cmd, stage.log)
        require(out / "config.json", "exported config.json")
        if not list(out.glob("*.safetensors")):
            raise RuntimeError(f"no *.safetensors in {out}: to_huggingface wrote no weights")
        require(out / "tokenizer_config.json", "exported tokenizer")
        write_stamp(out, "to_huggingface")
        export_mib = size_mib(out)
    write_json(stage.metrics,
               {"export_mib": export_mib, "weight_dtype": cfg.to_huggingface.weight_dtype})
    timer.record(branch, "to_huggingface")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
