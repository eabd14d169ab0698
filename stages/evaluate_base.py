"""Stage evaluate_base@<branch>: the untrained base model's score, once, cached like any stage.

Serves the downloaded model (artifacts/<branch>/model/files) and scores it as evaluate@<branch>
scores the trained one (mtpipe.evaluation.scoring): GSM8K through lm-eval for rl, held-out loss for
sft. Writes metrics/<branch>/evaluate_base.json and each problem's result, scores/<branch>/before/base.jsonl;
reruns only when the base model, the test data or the evaluation settings change, not when training does.
Run: dvc repro evaluate_base@rl   (or: python -m stages.evaluate_base rl)
"""

import sys

from mtpipe.evaluation.scoring import score, summary, write_rows
from mtpipe.pipeline.stage import WORK, Timer, open_stage, run_stage, write_json


def main(branch: str) -> None:
    stage, timer = open_stage("evaluate_base", branch), Timer()
    cfg = stage.view
    rows = score(cfg, stage.reads["model"] / "files", stage.reads["dataset"], WORK / "evaluate" / f"{branch}-base",
                 stage.log)
    write_rows(stage.outs["scores"], rows)
    write_json(stage.metrics, {"base": summary(cfg, rows)})
    timer.record(branch, "evaluate_base")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
