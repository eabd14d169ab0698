"""The trainers' patches (7-9, 11-13, 15 and 16; the index is in :mod:`mtpipe.maxtext.adapter`), and
their child entry point:

    python -m mtpipe.maxtext.adapter.training maxtext.trainers.post_train.sft.train_sft run_name=... ...

Arguments after the module name are passed to it unchanged (as its sys.argv[1:]); :func:`apply` patches
MaxText first and :mod:`mtpipe.maxtext.launch` runs the module, then the post-processing, and exits with
:data:`STOPPED_STATUS` when SIGTERM stopped the training. GRPO with the cpu_jax rollout applies the same
patches through :mod:`mtpipe.maxtext.launch_rl_cpu`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import types
from typing import Any, Callable

from mtpipe.maxtext import launch
from mtpipe.maxtext.log_protocol import EVAL_SAMPLES_LINE  # patch 12's log line
from mtpipe.maxtext.adapter import (CONVERTERS, TRAINERS, AdapterError, _arg_value, defer_vertex_ai_import,
                                    reject_secrets)
from mtpipe.pipeline.trainers import SFT

HOLD_ENV = "MTPIPE_HOLD_AFTER_STEP"
STOPPED_STATUS = 128 + signal.SIGTERM  # the exit status of a run that SIGTERM stopped after its save
PRE_EVAL_FILE = "mtpipe_pre_eval.json"  # patch 16's record of a run's first eval, in its run directory
ARROW_GRACE_S = 0.5  # patch 15: Arrow's read-ahead threads end in milliseconds on a local parquet file


def honour_checkpoint_storage(argv: list[str]) -> None:
    """Patch 7: tunix's checkpoint manager writes with MaxText's checkpoint_storage_use_* flags."""
    import orbax.checkpoint as ocp
    from tunix.sft import checkpoint_manager

    def flag(key: str) -> bool:
        value = _arg_value(argv, key)
        return True if value is None else value.lower() in ("1", "true")

    storage = {"use_ocdbt": flag("checkpoint_storage_use_ocdbt"), "use_zarr3": flag("checkpoint_storage_use_zarr3")}

    def handler(*args: Any, **kwargs: Any) -> ocp.PyTreeCheckpointHandler:
        return ocp.PyTreeCheckpointHandler(*args, **(storage | kwargs))  # Orbax's registry keys on the class

    orbax_for_tunix = types.ModuleType(ocp.__name__)  # a copy of the module: MaxText's own saves are untouched
    orbax_for_tunix.__dict__.update(vars(ocp), PyTreeCheckpointHandler=handler)
    checkpoint_manager.ocp = orbax_for_tunix


def resume_data_position() -> None:
    """Patch 8: on its first batch, a resumed run skips the batches its restored steps trained. Every
    eval scores the batches the first eval read (MaxText's eval iterator keeps a history-dependent
    position across evals), and a resumed run evaluates only at the uninterrupted run's eval steps
    (tunix also evaluates whenever train() starts)."""
    from maxtext.trainers.post_train import hooks
    from tunix.sft import peft_trainer

    load, load_eval = hooks.BaseDataHooks.load_next_train_batch, hooks.BaseDataHooks.load_next_eval_batch
    run_eval = peft_trainer.PeftTrainer._run_eval

    def load_after_trained_batches(self: Any, train_ctx: Any) -> Any:
        if not getattr(self, "_mtpipe_resumed", False):
            self._mtpipe_resumed = True
            if train_ctx.iter_steps:  # batches = steps x gradient accumulation, this process's shard
                start = time.monotonic()
                for _ in range(train_ctx.iter_steps):
                    self.train_data_loader.load_next_batch_pre_sharding()
                print(f"mtpipe: resumed at step {train_ctx.train_steps}: skipped the {train_ctx.iter_steps} "
                      f"batches it trained ({time.monotonic() - start:.1f} s)", flush=True)
        return load(self, train_ctx)

    def run_eval_on_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        step, every = self.train_steps, self.config.eval_every_n_steps
        resumed_start = step and not self.__dict__.get("_mtpipe_evaluated")
        self._mtpipe_evaluated = True
        if resumed_start and (every <= 0 or step % every):
            return None  # the uninterrupted run has no eval at this step
        return run_eval(self, *args, **kwargs)

    def load_eval_batches_of_the_first_eval(self: Any, train_ctx: Any) -> Any:
        batches = self.__dict__.setdefault("_mtpipe_eval_batches", [])
        if not self.__dict__.get("_mtpipe_eval_set"):  # the first eval reads the held-out data
            batch = load_eval(self, train_ctx)
            if batch is None:
                self._mtpipe_eval_set = True
            else:
                batches.append(batch)
            return batch
        index = int(train_ctx.training_hooks.eval_metadata["eval_step_count"])
        self.eval_batch = batches[index] if index < len(batches) else None  # MaxText's hooks read it
        return self.eval_batch

    hooks.BaseDataHooks.load_next_train_batch = load_after_trained_batches
    hooks.BaseDataHooks.load_next_eval_batch = load_eval_batches_of_the_first_eval
    peft_trainer.PeftTrainer._run_eval = run_eval_on_schedule


class _Stop:
    """SIGTERM's request to stop, and the step the run stopped after."""

    signalled = threading.Event()
    after_step: int | None = None


def _any_process_signalled() -> bool:
    """Whether SIGTERM reached any JAX process: all of them must stop after the same step."""
    import jax

    if jax.process_count() == 1:
        return _Stop.signalled.is_set()
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(_Stop.signalled.is_set()))))


def hold_after_step() -> int | None:
    """MTPIPE_HOLD_AFTER_STEP as a step number (None when unset)."""
    value = os.environ.get(HOLD_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise AdapterError(f"{HOLD_ENV}={value!r}: give a step number >= 1, or unset it")
    return int(value)


def _hold(train_ctx: Any, step: int) -> None:
    """Make step `step` durable (its loss row, its checkpoint), then wait for a signal (tests kill here)."""
    train_ctx._write_train_metrics()  # tunix writes a step's row when the next one ends
    train_ctx.checkpoint_manager._checkpoint_manager.wait_until_finished()
    print(f"mtpipe: holding after step {step} ({HOLD_ENV}): its checkpoint and loss row are written", flush=True)
    while not _Stop.signalled.wait(1.0):
        pass


def stop_on_sigterm(hold_after: int | None) -> None:
    """Patch 9: SIGTERM ends the run after the step in flight; tunix then saves that step."""
    from maxtext.trainers.post_train import hooks

    signal.signal(signal.SIGTERM, lambda *_: _Stop.signalled.set())
    load = hooks.BaseDataHooks.load_next_train_batch

    def load_unless_stopped(self: Any, train_ctx: Any) -> Any:
        first = self.__dict__.setdefault("_mtpipe_first_step", train_ctx.train_steps)
        if hold_after is not None and train_ctx.train_steps == hold_after > first:
            _hold(train_ctx, hold_after)
        if _any_process_signalled():
            _Stop.after_step = train_ctx.train_steps
            print(f"mtpipe: SIGTERM: stopping after step {train_ctx.train_steps}; saving its checkpoint",
                  flush=True)
            return None  # tunix's loop ends; its close() writes the last loss row and saves this step
        return load(self, train_ctx)

    hooks.BaseDataHooks.load_next_train_batch = load_unless_stopped


def hold_after_checkpoint(hold_after: int | None) -> None:
    """train_rl's MTPIPE_HOLD_AFTER_STEP: hold once the actor's checkpoint of that step is committed."""
    if hold_after is None:
        return
    from tunix.sft import checkpoint_manager

    save = checkpoint_manager.CheckpointManager.save

    def save_then_hold(self: Any, step: int, *args: Any, **kwargs: Any) -> bool:
        saved = save(self, step, *args, **kwargs)
        if saved and step == hold_after:
            self._checkpoint_manager.wait_until_finished()
            print(f"mtpipe: holding after step {step} ({HOLD_ENV}): its checkpoint is written", flush=True)
            signal.pause()
        return saved

    checkpoint_manager.CheckpointManager.save = save_then_hold


def log_right_samples_per_prompt() -> None:
    """Patch 12: each train_rl eval logs its prompts' right-sample counts (``c/n`` each) for pass@k.

    Patched before train_rl is imported: it takes ``evaluate`` by name from ``evaluate_rl``.
    """
    import multiprocessing.pool  # noqa: F401  (MaxText's utils_rl needs it imported first)

    from maxtext.trainers.post_train.rl import evaluate_rl
    from maxtext.utils import max_logging

    score, evaluate = evaluate_rl.score_responses, evaluate_rl.evaluate
    counts: list[str] = []

    def score_and_count(tmvp_config: Any, question: str, responses: list[str], answers: list[str]) -> tuple:
        result = score(tmvp_config, question, responses, answers)
        if len(responses) == 1 or getattr(tmvp_config, "eval_mode", "pass") == "pass_at_1":
            right = round(float(result[0]) * len(responses))  # pass_at_1: the share of samples right
        else:  # "pass" / "maj" give one verdict per prompt: score each sample alone
            right = sum(bool(score(tmvp_config, question, [r], answers)[0]) for r in responses)
        counts.append(f"{right}/{len(responses)}")
        return result

    def evaluate_and_log(*args: Any, **kwargs: Any) -> tuple:
        counts.clear()
        result = evaluate(*args, **kwargs)
        evaluate_and_log.counts_line = f"{EVAL_SAMPLES_LINE} {' '.join(counts)}"
        max_logging.warning(evaluate_and_log.counts_line)
        return result

    evaluate_rl.score_responses, evaluate_rl.evaluate = score_and_count, evaluate_and_log


def keep_the_first_pre_eval() -> None:
    """Patch 16: a run's eval before GRPO is its first process's, however often the run resumed.

    Applied after patch 12 (whose counts line it saves) and before train_rl is imported."""
    import fsspec
    from maxtext.trainers.post_train.rl import evaluate_rl
    from maxtext.utils import max_logging

    evaluate, calls = evaluate_rl.evaluate, []

    def first_eval_of_the_run(tmvp_config: Any, *args: Any, **kwargs: Any) -> tuple:
        calls.append(1)
        if len(calls) > 1:
            return evaluate(tmvp_config, *args, **kwargs)
        url = f"{tmvp_config.base_output_directory}/{tmvp_config.run_name}/{PRE_EVAL_FILE}"
        fs, path = fsspec.core.url_to_fs(url)
        if fs.exists(path):
            saved = json.loads(fs.cat_file(path))
            max_logging.warning(f"mtpipe: the eval before GRPO is this run's first, saved in {url}")
            max_logging.warning(saved["counts_line"])
            return tuple(saved["result"]), []
        result, responses = evaluate(tmvp_config, *args, **kwargs)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        record = {"result": list(result), "counts_line": getattr(evaluate, "counts_line", "")}
        fs.pipe_file(f"{path}.partial", json.dumps(record).encode())
        fs.mv(f"{path}.partial", path)
        return result, responses

    evaluate_rl.evaluate = first_eval_of_the_run


def grade_without_polling() -> None:
    """Patch 13: ``math_verify_pool`` waits on its jobs instead of polling them every 0.1 s.

    Patched where train_rl's reward code calls it (``utils_rl`` imports it by name)."""
    import multiprocessing
    import multiprocessing.pool  # noqa: F401  (MaxText's math_verify_pool needs it imported first)

    from maxtext.trainers.post_train.rl import math_verify_pool as mvp
    from maxtext.trainers.post_train.rl import utils_rl

    def math_verify_pool(trainer_config: Any, items: list, scores: list[float], timeout: float = 300,
                         num_procs: int | None = None, log_fn: Callable[[str], None] | None = None) -> list[float]:
        if not items:
            return scores
        cpus = multiprocessing.cpu_count()
        procs = min(mvp._DEFAULT_MAX_PROCS, cpus) if num_procs is None else max(1, min(num_procs, cpus))
        pool = mvp._get_pool(procs)
        jobs = [(idx, pool.apply_async(mvp.verify_math_worker, (golds, predictions)))
                for idx, golds, predictions in items]
        deadline, graded, late = time.time() + timeout, 0, 0
        for idx, job in jobs:
            job.wait(max(0.0, deadline - time.time()))
            if not job.ready():
                late += 1
                continue
            try:
                if job.get(0) > 0.0:
                    scores[idx] = max(scores[idx], trainer_config.reward_exact_answer)
                graded += 1
            except Exception as exc:  # pylint: disable=broad-exception-caught  (MaxText's own handling)
                if log_fn:
                    log_fn(f"math_verify_pool failed ({exc}) for idx: {idx}")
        if log_fn:
            log_fn(f"math_verify_pool: Processed {graded}/{len(items)} items ({late} timed out).")
        if late:
            mvp._shutdown_pool()
        return scores

    mvp.math_verify_pool = utils_rl.math_verify_pool = math_verify_pool


def keep_checkpoints(argv: list[str]) -> None:
    """Patch 11: tunix's checkpoint manager keeps ``max_num_checkpoints_to_keep`` steps (Orbax's
    ``max_to_keep``). Patched in tunix, which MaxText imports: train_sft itself runs as __main__, a
    copy of its module that a patch of ``train_sft.get_tunix_config`` would not reach."""
    import dataclasses

    from tunix.sft import checkpoint_manager

    value = _arg_value(argv, "max_num_checkpoints_to_keep")
    if value is None or value.lower() in ("none", "null", ""):
        return
    kept = int(value)
    init = checkpoint_manager.CheckpointManager.__init__

    def init_keeping(self: Any, root_directory: str | None = None, options: Any = None) -> None:
        if options is not None:
            options = dataclasses.replace(options, max_to_keep=kept)
        init(self, root_directory, options)

    checkpoint_manager.CheckpointManager.__init__ = init_keeping


def release_input_pipeline() -> None:
    """Patch 15: collect the finished run's garbage (its closed data iterators) now, each iterator's
    sleep for Arrow's threads held to ARROW_GRACE_S; datasets' own value is restored afterwards."""
    import gc

    config = getattr(sys.modules.get("datasets"), "config", None)
    if config is None:
        return  # the run read no Hugging Face dataset
    grace = config.SLEEP_TIME_ON_THREADS_SHUTDOWN
    config.SLEEP_TIME_ON_THREADS_SHUTDOWN = min(grace, ARROW_GRACE_S)
    try:
        gc.collect()
    finally:
        config.SLEEP_TIME_ON_THREADS_SHUTDOWN = grace


def stopped_status() -> int | None:
    """STOPPED_STATUS when SIGTERM stopped the training before its last step, else None."""
    return STOPPED_STATUS if _Stop.after_step is not None else None


def apply(module: str, argv: list[str]) -> Callable[[], None]:
    """Patch MaxText for trainer `module` run with `argv`; return the post-processing step to run on
    success. Another MaxText module gets the shared patches only; a converter is refused."""
    reject_secrets(argv)
    defer_vertex_ai_import()
    if module in CONVERTERS:
        raise AdapterError(f"{module} is a converter: launch it with `python -m mtpipe.maxtext.adapter.conversion`")
    if module not in TRAINERS:
        return lambda: None
    honour_checkpoint_storage(argv)
    if module == SFT.module:
        hold_after = hold_after_step()
        keep_checkpoints(argv)
        resume_data_position()
        stop_on_sigterm(hold_after)
    else:
        hold_after_checkpoint(hold_after_step())
        log_right_samples_per_prompt()
        keep_the_first_pre_eval()
        grade_without_polling()
    return release_input_pipeline


if __name__ == "__main__":
    sys.exit(launch.main(apply, stopped_status=stopped_status))
