"""Stage evaluate_warmup: the RL branch's SFT warm-up scored as the base and the GRPO result are.

Exports the warm-up (artifacts/rl/warmup) to a Hugging Face directory under work/ with MaxText's
to_huggingface, as to_huggingface@rl exports the GRPO result, scores it (mtpipe.evaluation.scoring)
and deletes the export. Writes metrics/rl/evaluate_warmup.json and each problem's result,
scores/rl/before/warmup.jsonl, which evaluate@rl pairs with the base's and the trained model's to
show what the warm-up and GRPO each added. Without a warm-up (`rl.train_sft.steps: 0`, the
tutorial) GRPO starts from the base: the warm-up's score is null and its results file empty.
Run: dvc repro evaluate_warmup   (or: python -m stages.evaluate_warmup)
"""

import shutil

from mtpipe.evaluation.scoring import score, summary, write_rows
from mtpipe.maxtext import conversion_commands, runner
from mtpipe.pipeline.stage import WORK, Timer, log_path, open_stage, read_stamp, require, run_stage, write_json


def main() -> None:
    stage, timer = open_stage("evaluate_warmup", "rl"), Timer()
    cfg, warmup, model = stage.view, stage.reads["warmup"], stage.reads["model"]
    rows = []
    if not read_stamp(warmup).get("skipped"):
        export = WORK / "evaluate" / "rl-warmup-hf"
        shutil.rmtree(export, ignore_errors=True)
        try:
            cmd = conversion_commands.to_huggingface(cfg, params=warmup / "model_params", hf_src_dir=model / "files",
                                                     out_dir=export)
            runner.run(cmd, log_path("rl", "evaluate_warmup_export"))
            require(export / "config.json", "the warm-up's exported config.json")
            rows = score(cfg, export, stage.reads["dataset"], WORK / "evaluate" / "rl-warmup", stage.log)
        finally:
            shutil.rmtree(export, ignore_errors=True)
    write_rows(stage.outs["scores"], rows)
    write_json(stage.metrics, {"warmup": summary(cfg, rows) if rows else None})
    timer.record("rl", "evaluate_warmup")


if __name__ == "__main__":
    run_stage(main)
