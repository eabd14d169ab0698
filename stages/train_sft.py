"""Stage train_sft@<branch>: supervised fine-tuning with maxtext.trainers.post_train.sft.train_sft.

SFT branch: the tutorial's fine-tuning on chat data. RL branch: an optional warm-up before GRPO on
the GSM8K rows rewritten as conversations in train_rl's own prompt format (mtpipe.data.gsm8k_chat);
`rl.train_sft.steps: 0` skips it and GRPO starts from the converted model.

MaxText's run_name is derived from this stage's recipe (its resolved view and the content digests of
the converted checkpoint, the data and the model), and its run directory lives where DVC does not delete
it: work/, or the bucket MTPIPE_WORK_BUCKET names (mtpipe.maxtext.run_dir). A killed run with the same
recipe resumes from its last checkpoint (from the bucket: on any machine), another recipe starts clean.
The output holds the params and their step only, so a run with other checkpoint periods, or a resumed
one, gives the same bytes.
On success the final model_params become the stage's output and the run directory goes.
Writes metrics/<branch>/train_sft.json (DVC metrics) and plots/<branch>/train_sft.csv (loss plot).
Run: dvc repro train_sft@sft   (or: python -m stages.train_sft sft)
"""

import sys
from pathlib import Path

from mtpipe.training.backend import run_training
from mtpipe.data import gsm8k_chat
from mtpipe.maxtext import training_commands
from mtpipe.maxtext.run_dir import MIRROR_EVERY_S, run_dir, run_name
from mtpipe.maxtext.training_logs import loss_curve, missing_steps, summarize_sft, tokens_per_s_median, write_csv
from mtpipe.pipeline.stage import JAX_CACHE, Timer, atomic_dir, open_stage, require, run_stage, write_json, write_stamp


def chat_files(cfg, dataset: Path, run_dir: Path) -> tuple[str, str | None, list[str]]:
    """(train glob, eval glob or None, columns) of chat data MaxText's SFT trainer reads."""
    d, files = cfg.dataset, dataset / "files"
    eval_glob = str(files / d.eval_files) if d.eval_files and list(files.glob(d.eval_files)) else None
    if d.row_schema == "chat":
        return str(files / d.train_files), eval_glob, list(d.columns)
    train = run_dir / "chat" / "train.parquet"
    gsm8k_chat.write_chat_parquet(sorted(files.glob(d.train_files)), train)
    if eval_glob:
        gsm8k_chat.write_chat_parquet(sorted(files.glob(d.eval_files)), run_dir / "chat" / "eval.parquet")
        eval_glob = str(run_dir / "chat" / "eval.parquet")
    return str(train), eval_glob, ["messages"]


def main(branch: str) -> None:
    stage, timer = open_stage("train_sft", branch), Timer()  # its output: the SFT branch's final model, the RL
    cfg, metrics_path, plot_path = stage.view, stage.metrics, stage.plots  # branch's warm start
    if cfg.train_sft.steps == 0:  # RL branch without warm-up: train_rl starts from the conversion
        with atomic_dir(stage.outs["trained"]) as out:
            write_stamp(out, "train_sft", skipped=True)
        write_csv(plot_path, [{"step": 0, "loss": None}])
        write_json(metrics_path, {"steps": 0})
        timer.record(branch, "train_sft")
        print("  steps: 0, no warm-up")
        return
    converted, dataset, model = (stage.reads[name] for name in ("maxtext", "dataset", "model"))
    run = run_dir("train_sft", run_name("train_sft", branch))
    with run.leased():  # one holder: another machine with this recipe stops here, naming it
        run.scratch.mkdir(parents=True, exist_ok=True)
        resumed_from = run.latest_checkpoint()
        if resumed_from is not None:
            print(f"  resuming {run.url}: MaxText restores its checkpoint at step {resumed_from}")
        train_files, eval_files, columns = chat_files(cfg, dataset, run.scratch)
        metrics_file = run.scratch / "metrics.jsonl"
        cmd = training_commands.train_sft(
            cfg, ckpt=converted / "0" / "items", train_files=train_files, eval_files=eval_files, columns=columns,
            tokenizer_dir=model / "files", base_output=run.base, run_name=run.run_name, metrics_file=metrics_file,
            jax_cache_dir=JAX_CACHE,
        )
        with run.mirrored(metrics_file):
            run_training(cfg, cmd, stage.log, total_steps=cfg.train_sft.steps)

        final_step = run.latest_checkpoint()
        if final_step is None or final_step < cfg.train_sft.steps - 1:
            raise RuntimeError(f"train_sft wrote no final checkpoint in {run.url}/checkpoints (found {final_step})")
        curve = loss_curve(require(metrics_file, "MaxText metrics_file"))
        if lost := missing_steps(curve):
            print(f"  warning: the loss curve has no rows for steps {lost}: a run stopped (killed, preempted) after "
                  f"their checkpoint but before their rows were written, or mirrored to the bucket (every "
                  f"{MIRROR_EVERY_S:.0f} s); the plot has a gap there")
        with atomic_dir(stage.outs["trained"]) as out:
            run.take(f"checkpoints/{final_step}/model_params", out / "model_params")
            write_stamp(out, "train_sft", step=final_step)
        write_csv(plot_path, curve)
        summary = summarize_sft(curve) | {"resumed_from_step": resumed_from or 0}
        timer.record(branch, "train_sft", tokens_per_s=tokens_per_s_median(metrics_file))
        write_json(metrics_path, summary)
        print(f"  loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f} over {summary['steps']} steps")
        run.remove()


if __name__ == "__main__":
    run_stage(main, sys.argv[1])
