"""Every patch MaxText 0.2.5 needs, indexed here (see docs/maxtext-adapter.md).

The converters' patches are in :mod:`mtpipe.maxtext.adapter.conversion`, the trainers' in
:mod:`mtpipe.maxtext.adapter.training`, and what both use is here: argument reading, the secrets check
and patch 14. Each of the two modules is the child entry point of its commands, for example

    python -m mtpipe.maxtext.adapter.conversion maxtext.checkpoint_conversion.to_maxtext model_name=...

and its ``apply`` patches MaxText before :mod:`mtpipe.maxtext.launch` runs the MaxText module. A stage's
code, and so its address, holds only the patches of the commands it runs. The same code serves the real
checkpoints (google/gemma-3-4b-it, Llama 3.1 8B) and their tiny twins from ``mtpipe.data.embedded``:
every patch is driven by the source checkpoint on disk.

For ``maxtext.checkpoint_conversion.to_maxtext`` and ``.to_huggingface`` (conversion.py):

1. ``use_source_config`` (monkeypatch): ``HF_MODEL_CONFIGS[model_name]`` becomes the source's
   ``config.json``. MaxText takes the architecture from that hard-coded table, so shrunk models
   fail without it, and the 4B export got a wrong config.json (global rope theta 1e4, "gelu").
2. ``use_checkpoint_tensor_names`` (monkeypatch, gemma3 only): MaxText's gemma3 mapping uses the
   in-memory transformers names (``model.language_model.*``) while the files on the Hub use the
   legacy names (``language_model.model.*``); the torch-free lazy loader reads the files, so the
   mapping (and the export's names) follow the names found in the source checkpoint.
3. ``copy_generation_config`` (post-processing, to_huggingface): MaxText writes no
   ``generation_config.json``; without it the export does not stop at ``<end_of_turn>``/``<|eot_id|>``.
4. ``copy_untouched_tensors`` (post-processing, to_huggingface): with ``use_multimodal=False``
   MaxText converts and trains the language model only and exports no vision tower, yet the
   exported config is the multimodal one, so transformers would fill the tower with random
   weights. The source's tensors that the export lacks (vision tower, projector) were never
   trained: they are copied unchanged into a second shard, making the export a complete model.
5. ``copy_source_config`` (post-processing, to_huggingface): MaxText writes the config (patch 1's
   source config) re-serialized by the installed transformers 5, which drops the keys of a file
   written by transformers 4 (the Hub's ``rope_scaling``, ``rope_theta``, ``torch_dtype``) that
   transformers 4 and vLLM read. Training does not change the architecture, so the export gets the
   source's file itself, after checking that both describe the same model.
6. ``accept_padded_vocabulary`` (monkeypatch, to_huggingface): MaxText's gemma3-4b has 262144
   embedding rows, the Hub's model 262208. to_huggingface's architecture check accepts a MaxText
   vocabulary only when it is at least the source's, and stops the real 4B export; yet its gemma3
   embedding hook pads the missing rows (with zeros) to the source's shape. The check is shown the
   source's vocabulary size when MaxText's is smaller; nothing else in to_huggingface reads it.
   After the run (``restore_padded_rows``), the padded rows, which MaxText never had and so never
   trained (the image soft token and padding), are copied back from the source.

For ``maxtext.trainers.post_train.sft.train_sft`` and ``.rl.train_rl`` (training.py):

7. ``honour_checkpoint_storage`` (monkeypatch): tunix's checkpoint manager saves ``model_params``
   and ``optimizer_state`` with OCDBT whatever MaxText's ``checkpoint_storage_use_ocdbt`` /
   ``_zarr3`` say (tunix turns OCDBT off for Pathways only). OCDBT names its data files at random,
   so two identical trainings gave different bytes; its handlers now get MaxText's two flags.

For ``maxtext.trainers.post_train.sft.train_sft`` (training.py):

8. ``resume_data_position`` (monkeypatch): a resumed run restores params, optimizer state and step
   from its checkpoint, but MaxText's data hooks start the data again from the first batch (tunix
   skips trained batches only without data hooks). The hooks now skip, once, the batches the
   restored steps trained (each process its own shard), and every eval scores the eval batches the
   first one read, so a resumed run is the uninterrupted run, evals included.
9. ``stop_on_sigterm`` (signal handler + monkeypatch): on SIGTERM (a Spot VM's preemption notice)
   the step in flight ends, every process agrees on the last step, and tunix's own end of training
   runs: it writes the last loss row and saves a checkpoint at that step. The process then exits
   with 128 + SIGTERM. ``MTPIPE_HOLD_AFTER_STEP=N`` (tests) instead holds the run after step N's
   checkpoint is committed and its loss row written, until it is killed: a kill point that does
   not depend on the machine's speed. train_rl gets the same hold (``hold_after_checkpoint``);
   tunix's GRPO learner already fast-forwards its data on resume.
11. ``keep_checkpoints`` (monkeypatch): MaxText's SFT trainer builds tunix's checkpoint options
    from ``checkpoint_period`` alone, so ``max_num_checkpoints_to_keep`` (which train_rl passes on)
    was ignored and every checkpoint stayed on disk. tunix's checkpoint manager now gets it as
    Orbax's ``max_to_keep``; Orbax deletes the older steps only after the newer one is committed,
    so the latest complete checkpoint is always there to resume from.

For ``maxtext.trainers.post_train.rl.train_rl`` (training.py):

12. ``log_right_samples_per_prompt`` (monkeypatch, observation only): MaxText's eval logs totals
    (the share of samples right), from which pass@k cannot be computed. Each eval (before and
    after GRPO, and the intermediate ones) now also logs, just before MaxText's own summary line,
    how many of each prompt's samples were right (``EVAL_SAMPLES_LINE``); the scores are MaxText's
    own (``evaluate_rl.score_responses``), and what the eval returns is unchanged.
    ``mtpipe.maxtext.training_logs.rl_eval`` turns the counts into pass@k.
16. ``keep_the_first_pre_eval`` (monkeypatch): train_rl evaluates the policy before GRPO in every
    process it starts, so a resumed run scored the restored actor, not the warm-up, as "before GRPO".
    The first eval of a run now saves its result and per-prompt counts in the run directory (local or
    bucket, ``PRE_EVAL_FILE``), and the first eval of a resumed process returns and logs that record
    instead of evaluating (no rollouts spent on it). The rollout's eval passes repeat modulo
    ``num_eval_passes``, so the eval after GRPO draws what the uninterrupted run's drew.
13. ``grade_without_polling`` (monkeypatch): MaxText's math-verify pool polls its jobs and sleeps
    0.1 s between polls, so every grading call took at least 0.1 s however fast its answers were
    graded: 0.1-0.3 s of each GRPO step, and at least 77 s of each embedded eval, whose reward is
    graded one sample per call (768 calls). The call now waits on its jobs' results until the same
    deadline (``math_verify_timeout`` across the batch): the same scores, the same pool, the same
    timeout and teardown of a stuck pool, no sleep.

For both converters (conversion.py):

10. ``collect_young_garbage`` (monkeypatch): the converters call ``gc.collect()`` after every tensor,
    to free its temporaries at once. A full collection walks every object of the process (JAX,
    MaxText and transformers imported: about 0.35 s here), so a 100-tensor checkpoint spent 35 s
    in the collector. ``gc.collect`` now collects the two young generations, which hold what the
    tensor just created; the process's long-lived objects are left to Python's own full
    collections. The converted bytes do not change.

For every module (this file; both ``apply`` functions call it first):

14. ``defer_vertex_ai_import`` (lazy import): MaxText imports Vertex AI's SDK
    (``google.cloud.aiplatform``, through ``maxtext.common.vertex_tensorboard``) in every trainer and
    converter process, for the Vertex TensorBoard uploader that runs only with
    ``use_vertex_tensorboard=True``: 2.5 s of each process's start on 2 cores. The SDK is now loaded
    on first use (``importlib.util.LazyLoader``): a run that uploads gets the same module.

For both trainers, after a successful run (training.py):

15. ``release_input_pipeline`` (post-processing): the Hugging Face datasets streaming iterator of a
    parquet input sleeps 5 s when it is closed (``datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN``,
    for Arrow threads that would otherwise outlive the interpreter), and a finished trainer closed it
    in the interpreter's final garbage collection: 5 s of every training's exit. It is now collected
    right after the run, while the interpreter is whole, with a grace of ``ARROW_GRACE_S``; an
    iterator still alive at exit keeps datasets' 5 s.
"""

from __future__ import annotations

from mtpipe.maxtext.commands import TO_HUGGINGFACE, TO_MAXTEXT
from mtpipe.pipeline.trainers import MODULES as TRAINERS

CONVERTERS = (TO_MAXTEXT, TO_HUGGINGFACE)
_SECRET_KEYS = ("hf_access_token",)
VERTEX_AI = "google.cloud.aiplatform"


class AdapterError(ValueError):
    """Bad launch arguments; the message names the key and the fix."""


def _arg_value(argv: list[str], key: str) -> str | None:
    """Value of `key` given as `key=v`, `--key=v` or `--key v` (the last one wins, as in MaxText)."""
    value = None
    for i, arg in enumerate(argv):
        for form in (f"{key}=", f"--{key}="):
            if arg.startswith(form):
                value = arg[len(form) :]
        if arg == f"--{key}" and i + 1 < len(argv):
            value = argv[i + 1]
    return value


def reject_secrets(argv: list[str]) -> None:
    """Secrets belong in the environment (HF_TOKEN), never in argv (visible in `ps` and logs)."""
    for key in _SECRET_KEYS:
        if any(a.startswith((f"{key}=", f"--{key}")) for a in argv):
            raise AdapterError(f"`{key}` must not be passed on the command line: export HF_TOKEN instead")


def defer_vertex_ai_import() -> None:
    """Patch 14: ``google.cloud.aiplatform`` is executed on its first attribute access, not on import."""
    import importlib.util
    import sys

    if VERTEX_AI in sys.modules:
        return
    spec = importlib.util.find_spec(VERTEX_AI)
    if spec is None or spec.loader is None:
        return  # not installed: MaxText's own import reports it
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[VERTEX_AI] = module
    spec.loader.exec_module(module)
    setattr(sys.modules["google.cloud"], "aiplatform", module)
