"""The training methods, one record each: what every tool that runs, budgets, forecasts or reports a
training stage needs to know of it, so none of them branches on a stage's name.

A record names its stage (a row of :mod:`mtpipe.pipeline.stage_table`, which says what the stage reads
and writes), MaxText's module and config file, the keys of its section that count its steps, size its
checkpoints and decide the HBM a step needs, the curves its model card draws, and whether each step
samples completions before it trains (GRPO's rollout: the compile shapes its batch for it, the forecast
adds it, the runner reads its step lines). Its command builder is in :mod:`mtpipe.maxtext.training_commands`,
with :func:`~mtpipe.maxtext.training_commands.placeholder_command`, the command preflight compiles and the
machine budget reads. This module imports nothing (the adapter's child processes read it), and it sits
in ``pipeline``, beside the stage table, so that every package can read it (``data``'s model card too).
docs/extending.md, "A training stage", lists what a new method takes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Trainer:
    """One training method, as the stage that runs it and the tools around it see it."""

    stage: str                        # the stage (mtpipe/pipeline/stage_table.py) and its view's section
    module: str                       # MaxText's module, run as ``python -m``
    method: str                       # what people call it: a title, a model card's sentence
    config_file: str                  # MaxText's config file for the module, under maxtext/configs/
    steps_key: str                    # the section's key that counts the steps the run trains
    memory_keys: tuple[str, ...]      # the section's keys that decide the HBM a step needs (params.yaml's spelling)
    checkpoint_keys: tuple[str, ...]  # the section's keys that size its run directory (checkpoints kept, period)
    curves: tuple[str, ...]           # the columns of its plots file the model card draws (those it has)
    rollout: bool = False             # each step samples completions first (GRPO)


SFT = Trainer(
    stage="train_sft", module="maxtext.trainers.post_train.sft.train_sft", method="SFT",
    config_file="post_train/sft.yml", steps_key="steps",
    memory_keys=("per_device_batch_size", "max_target_length", "extra_args.remat_policy"),
    checkpoint_keys=("max_num_checkpoints_to_keep", "checkpoint_period"), curves=("loss", "eval_loss"))
GRPO = Trainer(
    stage="train_rl", module="maxtext.trainers.post_train.rl.train_rl", method="GRPO",
    config_file="post_train/rl.yml", steps_key="num_batches",
    memory_keys=("batch_size", "num_generations", "max_target_length", "extra_args.remat_policy",
                 "extra_args.hbm_utilization_vllm"),
    checkpoint_keys=("max_num_checkpoints_to_keep", "extra_args.checkpoint_period"),
    curves=("reward_mean", "kl"), rollout=True)
TRAINERS = (SFT, GRPO)   # in the order a branch runs them
MODULES = tuple(t.module for t in TRAINERS)
BY_STAGE = {t.stage: t for t in TRAINERS}
BY_MODULE = {t.module: t for t in TRAINERS}


def of_branch(stages: tuple[str, ...]) -> Trainer:
    """The method a branch of these stages is for: its last training stage (sft: SFT; rl: GRPO after
    the SFT warm-up), the one preflight compiles."""
    return [BY_STAGE[s] for s in stages if s in BY_STAGE][-1]


def in_branch(stages: tuple[str, ...]) -> tuple[Trainer, ...]:
    """The methods a branch of these stages runs, in order."""
    return tuple(BY_STAGE[s] for s in stages if s in BY_STAGE)
