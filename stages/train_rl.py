"""Stage train_rl: GRPO with maxtext.trainers.post_train.rl.train_rl on GSM8K-format data.

Starts from the RL branch's SFT warm-up when it ran (rl.train_sft.steps > 0), else from the
converted checkpoint. The rollout backend is `rl.train_rl.rollout_backend`: vllm on a TPU VM (as
MaxText ships it), cpu_jax elsewhere (mtpipe.maxtext.rollout_cpu samples with the actor in JAX).
The run directory lives in work/ or the MTPIPE_WORK_BUCKET bucket under a run name that is its recipe's digest, as
for train_sft (mtpipe.maxtext.run_dir).
Writes artifacts/rl/trained/model_params, metrics/rl/train_rl.json (reward and eval accuracy before
and after GRPO, pass@k for k up to the eval's samples per prompt: mtpipe.maxtext.training_logs.rl_eval, and
each pass@k's gain with the 95% interval of its per-prompt differences: rl_eval_gain)
and plots/rl/train_rl.csv (reward per function, KL, loss per step).
Run: dvc repro train_rl   (or: python -m stages.train_rl)
"""

from pathlib import Path

from mtpipe.training.backend import run_training
from mtpipe.data import gsm8k_chat
from mtpipe.errors import ConfigError
from mtpipe.maxtext import training_commands
from mtpipe.maxtext.run_dir import run_dir, run_name
from mtpipe.maxtext.training_logs import missing_steps, read_tensorboard, rl_curve, rl_eval, rl_eval_gain, write_csv
from mtpipe.pipeline.stage import JAX_CACHE, Timer, atomic_dir, open_stage, read_stamp, run_stage, write_json, write_stamp


def check_rollout_backend(backend: str, runs_here: bool) -> None:
    """Fail before MaxText starts when the backend cannot run on this machine (an xpk workload
    runs in the image, which has vLLM)."""
    from importlib.util import find_spec

    missing = [m for m in ("vllm", "tpu_inference") if runs_here and backend == "vllm" and find_spec(m) is None]
    if missing:
        raise ConfigError("rl.train_rl.rollout_backend", f"vllm needs {' and '.join(missing)}, not installed here",
                          "run on a TPU VM set up by `doit vm_setup`, or set rollout_backend: cpu_jax")


def check_prompt_budget(cfg, files: Path, tokenizer_dir: Path) -> None:
    """Say how many prompts train_rl will drop for exceeding the prompt budget; fail if all are."""
    budget = cfg.train_rl.max_prefill_predict_length
    if budget is None:
        return
    for split in ("train_files", "eval_files"):
        lengths = gsm8k_chat.prompt_lengths(sorted(files.glob(getattr(cfg.dataset, split))), tokenizer_dir)
        if not lengths:
            raise ConfigError(f"rl.dataset.{split}", f"no rows in files matching {getattr(cfg.dataset, split)!r}",
                              f"fix conf/dataset/{cfg.dataset.name}.yaml")
        dropped = sum(n > budget for n in lengths)
        print(f"  {split}: {len(lengths) - dropped} of {len(lengths)} prompts fit max_prefill_predict_length="
              f"{budget} (longest {max(lengths)} tokens); train_rl drops the other {dropped}")
        if dropped == len(lengths):
            raise ConfigError("rl.train_rl.max_prefill_predict_length", f"all {len(lengths)} {split} prompts are "
                              f"longer than {budget} tokens", f"raise it to at least {min(lengths)}")


def main() -> None:
    stage, timer = open_stage("train_rl", "rl"), Timer()
    cfg = stage.view
    check_rollout_backend(cfg.train_rl.rollout_backend, runs_here=cfg.hardware.backend == "local")
    converted, warmup, dataset, model = (stage.reads[name] for name in ("maxtext", "warmup", "dataset", "model"))
    start = warmup / "model_params" if not read_stamp(warmup).get("skipped") else converted / "0" / "items"
    run = run_dir("train_rl", run_name("train_rl", "rl"))
    with run.leased():  # one holder: another machine with this recipe stops here, naming it
        resumed_from = run.latest_checkpoint("checkpoints/actor")
        if resumed_from is not None:
            print(f"  {run.url}: an earlier run left actor checkpoints up to step {resumed_from}")
        files = dataset / "files"
        check_prompt_budget(cfg, files, model / "files")
        cmd = training_commands.train_rl(
            cfg, ckpt=start, train_files=str(files / cfg.dataset.train_files),
            eval_files=str(files / cfg.dataset.eval_files),
            tokenizer_dir=model / "files", base_output=run.base, run_name=run.run_name, jax_cache_dir=JAX_CACHE,
        )
        print(f"  GRPO from {'the SFT warm-up' if start.parent == warmup else 'the converted model'}")
        run_training(cfg, cmd, stage.log, total_steps=cfg.train_rl.num_batches)

        final_step = run.latest_checkpoint("checkpoints/actor")
        if final_step is None or final_step < cfg.train_rl.num_batches:
            raise RuntimeError(f"train_rl wrote no final actor checkpoint under {run.url}/checkpoints/actor"
                               f" (found {final_step}, expected {cfg.train_rl.num_batches})")
        curve = rl_curve(read_tensorboard(f"{run.url}/tensorboard"))
        if lost := missing_steps([row for row in curve if "reward_mean" in row], first=1):
            print(f"  warning: the reward curve has no rows for steps {lost}: a run stopped (killed, preempted) "
                  "before tensorboardX flushed them (every 120 s); the plot has a gap there")
        this_run = stage.log.read_text(errors="replace").split(f"$ {cmd.as_tutorial()}")[-1]
        evals = rl_eval(this_run)
        if cfg.train_rl.num_test_batches and set(evals) != {"pre", "post"}:
            raise RuntimeError(f"train_rl logged no eval before and after GRPO (found {sorted(evals)})")
        with atomic_dir(stage.outs["trained"]) as out:
            run.take(f"checkpoints/actor/{final_step}/model_params", out / "model_params")
            write_stamp(out, "train_rl", step=final_step)
        write_csv(stage.plots, curve)
        rewards = [r["reward_mean"] for r in curve if "reward_mean" in r]
        summary = {
            "steps": final_step, "resumed_from_step": resumed_from or 0,
            "reward_first": rewards[0], "reward_last": rewards[-1],
            **{f"eval_{when}_{key}": value for when, row in evals.items() for key, value in row.items()},
            **{f"eval_gain_{key}": value for key, value in rl_eval_gain(this_run).items()},
        }
        write_json(stage.metrics, summary)
        timer.record("rl", "train_rl")
        acc = {w: evals[w]["accuracy"] for w in evals}
        print(f"  reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; eval accuracy before/after: {acc}")
        run.remove()


if __name__ == "__main__":
    run_stage(main)
