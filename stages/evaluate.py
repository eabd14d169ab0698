"""Stage evaluate@<branch>: the exported model's score beside those of the models before it, and the gains.

Serves the export (artifacts/<branch>/hf) and scores it with the settings of evaluate_base@<branch>
(mtpipe.evaluation.scoring), then pairs its per-problem results with those in scores/<branch>/before/
(the base's, and on the RL branch the warm-up's) and writes metrics/<branch>/evaluate.json: each model's
score and each gain with its paired 95% interval, which `dvc exp show` compares across experiments:
`gain` is the whole branch's (trained - base); on the RL branch with a warm-up also `warmup_gain`
(warm-up - base) and `grpo_gain` (trained - warm-up). RL: GSM8K accuracy in percent (lm-eval, the task
`evaluate.task` names; flexible and strict answer extraction); SFT: held-out loss (lower is better;
gain = before - after).
Run: dvc repro evaluate@rl   (or: python -m stages.evaluate rl)
"""

import json
import sys

from mtpipe.evaluation.scoring import gain, read_rows, score, summary, write_rows
from mtpipe.pipeline.view import load_stage
from mtpipe.pipeline.stage import ROOT, WORK, Timer, artifact, log_path, require, run_stage, scores_path, write_json


def main(branch: str) -> None:
    cfg, timer = load_stage(branch, "evaluate"), Timer()
    base = read_rows(require(scores_path(branch, "base"), "the base model's results (evaluate_base)"))
    warmup = read_rows(scores_path(branch, "warmup")) if scores_path(branch, "warmup").is_file() else []
    trained = score(cfg, artifact(branch, "hf"), artifact(branch, "dataset"), WORK / "evaluate" / f"{branch}-trained",
                    log_path(branch, "evaluate"))
    write_rows(scores_path(branch, "trained"), trained)
    result = {"base": summary(cfg, base), "trained": summary(cfg, trained), "gain": gain(cfg, base, trained)}
    if warmup:
        result |= {"warmup": summary(cfg, warmup), "warmup_gain": gain(cfg, base, warmup),
                   "grpo_gain": gain(cfg, warmup, trained)}
    write_json(ROOT / "metrics" / branch / "evaluate.json", result)
    print(f"  {branch}: {json.dumps(result['gain'])}")
    timer.record(branch, "evaluate")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
