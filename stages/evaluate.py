"""Stage evaluate@<branch>: the exported model's score beside the base model's, and the gain.

Serves the export (artifacts/<branch>/hf) and scores it with the settings of evaluate_base@<branch>
(mtpipe.evaluation.scoring), then writes metrics/<branch>/evaluate.json: base, trained and gain with
its 95% interval, which `dvc exp show` compares across experiments. RL: GSM8K accuracy in percent
(lm-eval's gsm8k_cot_llama, flexible and strict answer extraction); SFT: held-out loss (lower is
better; gain = base - trained).
Run: dvc repro evaluate@rl   (or: python -m stages.evaluate rl)
"""

import json
import sys

from mtpipe.evaluation.scoring import gain, score
from mtpipe.pipeline.config import load_stage
from mtpipe.pipeline.stage import ROOT, WORK, Timer, artifact, log_path, require, run_stage, write_json


def main(branch: str) -> None:
    cfg, timer = load_stage(branch, "evaluate"), Timer()
    base = json.loads(require(ROOT / "metrics" / branch / "evaluate_base.json", "the base model's score")
                      .read_text())["base"]
    trained = score(cfg, artifact(branch, "hf"), artifact(branch, "dataset"), WORK / "evaluate" / f"{branch}-trained",
                    log_path(branch, "evaluate"))
    result = {"base": base, "trained": trained, "gain": gain(cfg, base, trained)}
    write_json(ROOT / "metrics" / branch / "evaluate.json", result)
    print(f"  {branch}: {json.dumps(result['gain'])}")
    timer.record(branch, "evaluate")


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
