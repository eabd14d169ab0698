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
from mtpipe.pipeline.stage import WORK, Timer, open_stage, require, run_stage, write_json


def main(branch: str) -> None:
    stage, timer = open_stage("evaluate", branch), Timer()
    cfg, before = stage.view, stage.reads["before"]
    base = read_rows(require(before / "base.jsonl", "the base model's results (evaluate_base)"))
    warmup = read_rows(before / "warmup.jsonl") if (before / "warmup.jsonl").is_file() else []
    trained = score(cfg, stage.reads["hf"], stage.reads["dataset"], WORK / "evaluate" / f"{branch}-trained", stage.log)
    write_rows(stage.outs["scores"], trained)
    result = {"base": summary(cfg, base), "trained": summary(cfg, trained), "gain": gain(cfg, base, trained)}
    if warmup:
        result |= {"warmup": summary(cfg, warmup), "warmup_gain": gain(cfg, base, warmup),
                   "grpo_gain": gain(cfg, warmup, trained)}
    write_json(stage.metrics, result)
    print(f"  {branch}: {json.dumps(result['gain'])}")
    timer.record(branch, "evaluate")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
