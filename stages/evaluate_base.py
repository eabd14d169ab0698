"""Stage evaluate_base@<branch>: the untrained base model's score, once, cached like any stage.

Serves the downloaded model (artifacts/<branch>/model/files) and scores it as evaluate@<branch>
scores the trained one (mtpipe.evaluation.scoring): GSM8K through lm-eval for rl, held-out loss for
sft. Writes metrics/<branch>/evaluate_base.json and each problem's result, scores/<branch>/before/base.jsonl;
reruns only when the base model, the test data or the evaluation settings change, not when training does.
Run: dvc repro evaluate_base@rl   (or: python -m stages.evaluate_base rl)
"""

import sys

from mtpipe.evaluation.scoring import score, summary, write_rows
from mtpipe.pipeline.view import load_stage
from mtpipe.pipeline.stage import ROOT, WORK, Timer, artifact, log_path, run_stage, scores_path, write_json


def main(branch: str) -> None:
    cfg, timer = load_stage(branch, "evaluate_base"), Timer()
    rows = score(cfg, artifact(branch, "model") / "files", artifact(branch, "dataset"),
                 WORK / "evaluate" / f"{branch}-base", log_path(branch, "evaluate_base"))
    write_rows(scores_path(branch, "base"), rows)
    write_json(ROOT / "metrics" / branch / "evaluate_base.json", {"base": summary(cfg, rows)})
    timer.record(branch, "evaluate_base")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
