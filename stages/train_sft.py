"""Stage train_sft: supervised fine-tuning with maxtext.trainers.post_train.sft.train_sft.

MaxText's run_name is derived from a digest of this stage's inputs (its resolved config, the
converted checkpoint, the data), and its run directory lives in work/ where DVC does not delete it:
a killed run with identical inputs resumes from its last checkpoint, changed inputs start clean.
On success the final model_params move into artifacts/sft/trained/ and the run directory goes.
Writes metrics/sft/train_sft.json (DVC metrics) and plots/sft/loss.csv (DVC plot).
Run: dvc repro train_sft   (or: python -m stages.train_sft)
"""

import os
import shutil

from mtpipe import commands, runner
from mtpipe.config import load_stage
from mtpipe.metrics import loss_curve, summarize_sft, write_csv
from mtpipe.stage import (JAX_CACHE, ROOT, WORK, Timer, artifact, atomic_dir, digest, log_path, require,
                          write_json, write_stamp)


def latest_checkpoint(run_dir) -> int | None:
    """Highest step with saved model params under ``run_dir/checkpoints``, if any."""
    steps = [int(p.parent.name) for p in (run_dir / "checkpoints").glob("*/model_params") if p.parent.name.isdigit()]
    return max(steps, default=None)


def main() -> None:
    cfg, timer = load_stage("sft", "train_sft"), Timer()
    converted, dataset, model = artifact("sft", "maxtext"), artifact("sft", "dataset"), artifact("sft", "model")
    run_digest = digest(cfg, converted, dataset)
    run_name = f"sft-{run_digest[:12]}"
    base = WORK / "train_sft"
    run_dir = base / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    resumed_from = latest_checkpoint(run_dir)
    if resumed_from is not None:
        print(f"  resuming {run_name}: MaxText restores its checkpoint at step {resumed_from}")
    metrics_file = run_dir / "metrics.jsonl"
    cmd = commands.train_sft(
        cfg, ckpt=converted / "0" / "items", data_dir=dataset / "files", tokenizer_dir=model / "files",
        base_output=base, run_name=run_name, metrics_file=metrics_file, jax_cache_dir=JAX_CACHE,
    )
    runner.run(cmd, log_path("sft", "train_sft"), total_steps=cfg.train_sft.steps)

    final_step = latest_checkpoint(run_dir)
    if final_step is None or final_step < cfg.train_sft.steps - 1:
        raise RuntimeError(f"train_sft wrote no final checkpoint in {run_dir}/checkpoints (found {final_step})")
    curve = loss_curve(require(metrics_file, "MaxText metrics_file"))
    with atomic_dir(artifact("sft", "trained")) as out:
        os.replace(run_dir / "checkpoints" / str(final_step) / "model_params", out / "model_params")
        write_stamp(out, "train_sft", run_digest, run_name=run_name, step=final_step)
    write_csv(ROOT / "plots" / "sft" / "loss.csv", curve)
    summary = summarize_sft(curve) | {"wall_s": timer.seconds(), "resumed_from_step": resumed_from or 0}
    write_json(ROOT / "metrics" / "sft" / "train_sft.json", summary)
    print(f"  loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} over {summary['steps']} steps")
    shutil.rmtree(run_dir)


if __name__ == "__main__":
    main()
