"""Every patch MaxText 0.2.5 needs, in one place (see docs/maxtext-adapter.md).

``mtpipe.maxtext.launch`` calls :func:`apply` in the child process, before it runs the MaxText module.
The same code serves the real checkpoints (google/gemma-3-4b-it, Llama 3.1 8B) and their tiny
twins from ``mtpipe.data.embedded``: every patch is driven by the source checkpoint on disk.

Patches, for ``maxtext.checkpoint_conversion.to_maxtext`` and ``.to_huggingface``:

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

For ``maxtext.trainers.post_train.sft.train_sft`` and ``.rl.train_rl``:

7. ``honour_checkpoint_storage`` (monkeypatch): tunix's checkpoint manager saves ``model_params``
   and ``optimizer_state`` with OCDBT whatever MaxText's ``checkpoint_storage_use_ocdbt`` /
   ``_zarr3`` say (tunix turns OCDBT off for Pathways only). OCDBT names its data files at random,
   so two identical trainings gave different bytes; its handlers now get MaxText's two flags.

For ``maxtext.trainers.post_train.sft.train_sft``:

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

For ``maxtext.trainers.post_train.rl.train_rl``:

12. ``log_right_samples_per_prompt`` (monkeypatch, observation only): MaxText's eval logs totals
    (the share of samples right), from which pass@k cannot be computed. Each eval (before and
    after GRPO, and the intermediate ones) now also logs, just before MaxText's own summary line,
    how many of each prompt's samples were right (``EVAL_SAMPLES_LINE``); the scores are MaxText's
    own (``evaluate_rl.score_responses``), and what the eval returns is unchanged.
    ``mtpipe.pipeline.metrics.rl_eval`` turns the counts into pass@k.
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

For both converters:

10. ``collect_young_garbage`` (monkeypatch): the converters call ``gc.collect()`` after every tensor,
    to free its temporaries at once. A full collection walks every object of the process (JAX,
    MaxText and transformers imported: about 0.35 s here), so a 100-tensor checkpoint spent 35 s
    in the collector. ``gc.collect`` now collects the two young generations, which hold what the
    tensor just created; the process's long-lived objects are left to Python's own full
    collections. The converted bytes do not change.

For every module:

14. ``defer_vertex_ai_import`` (lazy import): MaxText imports Vertex AI's SDK
    (``google.cloud.aiplatform``, through ``maxtext.common.vertex_tensorboard``) in every trainer and
    converter process, for the Vertex TensorBoard uploader that runs only with
    ``use_vertex_tensorboard=True``: 2.5 s of each process's start on 2 cores. The SDK is now loaded
    on first use (``importlib.util.LazyLoader``): a run that uploads gets the same module.

For both trainers, after a successful run:

15. ``release_input_pipeline`` (post-processing): the Hugging Face datasets streaming iterator of a
    parquet input sleeps 5 s when it is closed (``datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN``,
    for Arrow threads that would otherwise outlive the interpreter), and a finished trainer closed it
    in the interpreter's final garbage collection: 5 s of every training's exit. It is now collected
    right after the run, while the interpreter is whole, with a grace of ``ARROW_GRACE_S``; an
    iterator still alive at exit keeps datasets' 5 s.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

TO_MAXTEXT = "maxtext.checkpoint_conversion.to_maxtext"
TO_HUGGINGFACE = "maxtext.checkpoint_conversion.to_huggingface"
TRAIN_SFT = "maxtext.trainers.post_train.sft.train_sft"
TRAINERS = (TRAIN_SFT, "maxtext.trainers.post_train.rl.train_rl")
HOLD_ENV = "MTPIPE_HOLD_AFTER_STEP"
STOPPED_STATUS = 128 + signal.SIGTERM  # the exit status of a run that SIGTERM stopped after its save
# Patch 12's log line; mtpipe.pipeline.metrics parses it (its own copy: an import would make every stage
# that launches MaxText depend on metrics.py's code; tests/test_metrics.py checks the two are equal)
EVAL_SAMPLES_LINE = "mtpipe eval: right samples per prompt:"
PRE_EVAL_FILE = "mtpipe_pre_eval.json"  # patch 16's record of a run's first eval, in its run directory

# transformers in-memory name prefix -> on-disk (legacy) prefix, for Gemma3ForConditionalGeneration.
GEMMA3_LEGACY_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)

_SECRET_KEYS = ("hf_access_token",)
# Tensors with one row per token: MaxText's vocabulary may be smaller than the source's (patch 6).
VOCABULARY_TENSORS = ("embed_tokens.weight", "lm_head.weight")
# What MaxText leaves out of a text-only (use_multimodal=False) export, copied from the source.
UNTRAINED_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class AdapterError(ValueError):
    """Bad launch arguments; the message names the key and the fix."""


@dataclass(frozen=True)
class ConversionArgs:
    """The arguments of a conversion run that the patches depend on."""

    model_name: str
    hf_model_path: Path
    output_dir: str | None
    loads_file_names: bool  # False only for to_maxtext's eager "transformers" loader (renames in memory)


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


def parse_conversion_args(module: str, argv: list[str]) -> ConversionArgs:
    """Read model_name, --hf_model_path and the output directory; fail early on bad values."""
    model_name = _arg_value(argv, "model_name")
    if not model_name:
        raise AdapterError(f"{module}: `model_name=` is required (e.g. model_name=gemma3-4b)")
    path = _arg_value(argv, "hf_model_path")
    if not path:
        raise AdapterError(
            f"{module}: `--hf_model_path=<dir>` is required: the local Hugging Face model directory "
            "(from hf_download) whose config.json describes the model"
        )
    hf_dir = Path(path)
    if not (hf_dir / "config.json").is_file():
        raise AdapterError(f"{module}: --hf_model_path={path} has no config.json: pass the downloaded model directory")
    eager = (_arg_value(argv, "lazy_load_tensors") or "true").lower() in ("false", "0", "no", "f", "n")
    by_transformers = eager and _arg_value(argv, "eager_load_method") == "transformers"
    return ConversionArgs(
        model_name=model_name,
        hf_model_path=hf_dir,
        output_dir=_arg_value(argv, "base_output_directory"),
        loads_file_names=not (module == TO_MAXTEXT and by_transformers),
    )


def _table_keys(model_name: str) -> list[str]:
    """MaxText looks tables up by the given name and, for "-Instruct" names, by the base name."""
    return sorted({model_name, model_name.replace("-Instruct", "")})


def use_source_config(model_name: str, hf_dir: Path) -> None:
    """Patch 1: MaxText's hard-coded HF config for `model_name` becomes the source's config.json."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from transformers import AutoConfig

    source = AutoConfig.from_pretrained(hf_dir)
    for key in _table_keys(model_name):
        HF_MODEL_CONFIGS[key] = source


def accept_padded_vocabulary(hf_dir: Path) -> dict[str, int]:
    """Patch 6: to_huggingface's MaxText config reports the source's vocabulary when MaxText's is smaller.

    Returns a dict that gets ``{"maxtext_vocab": n}`` when that happened (for :func:`restore_padded_rows`).
    """
    from maxtext.configs import pyconfig
    from transformers import AutoConfig

    source = AutoConfig.from_pretrained(hf_dir)
    source_vocab = getattr(source, "text_config", source).vocab_size
    initialize = pyconfig.initialize_pydantic
    padded: dict[str, int] = {}

    def initialize_with_source_vocabulary(*args, **kwargs):
        config = initialize(*args, **kwargs)
        if config.vocab_size < source_vocab:
            padded["maxtext_vocab"] = config.vocab_size
            return config.model_copy(update={"vocab_size": source_vocab})
        return config

    pyconfig.initialize_pydantic = initialize_with_source_vocabulary
    return padded


def restore_padded_rows(hf_dir: Path, output_dir: str | None, first_row: int | None) -> None:
    """After patch 6: rows from `first_row` on of the exported vocabulary tensors come from the source.

    MaxText's table ended before `first_row`; to_huggingface padded the rest with zeros. The shard
    holding such a tensor is rewritten with the source's rows (cast to the export's dtype).
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out = Path(output_dir) if output_dir and "://" not in output_dir else None
    if out is None or first_row is None:
        return
    source: dict[str, Path] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(shard, "numpy") as f:
            source |= {k: shard for k in f.keys()}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "numpy") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        padded = [k for k, t in tensors.items()
                  if k in source and k.endswith(VOCABULARY_TENSORS) and t.shape[0] > first_row]
        for name in padded:
            with safe_open(source[name], "numpy") as f:
                rows = f.get_slice(name)[first_row:]
            if rows.shape[0] != tensors[name].shape[0] - first_row:
                raise RuntimeError(f"{name}: the export has {tensors[name].shape[0]} rows, the source "
                                   f"{first_row + rows.shape[0]}")
            tensors[name][first_row:] = rows.astype(tensors[name].dtype)
        if padded:
            save_file(tensors, shard, metadata=metadata)


def checkpoint_tensor_names(hf_dir: Path) -> list[str]:
    """Tensor names in the safetensors of `hf_dir` (index file or single file; [] if none)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    single = hf_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="np") as f:
            return sorted(f.keys())
    return []


def to_legacy_gemma3_name(name: str) -> str:
    """`model.language_model.layers.0...` -> `language_model.model.layers.0...` (Hub file names)."""
    for new, legacy in GEMMA3_LEGACY_PREFIXES:
        if name.startswith(new):
            return legacy + name[len(new) :]
    return name


def _rename(value: Any, fn: Callable[[str], str]) -> Any:
    """Apply `fn` to every name in a mapping value (str, nested lists/tuples of str, or None)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_rename(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_rename(v, fn) for v in value)
    return value


def use_checkpoint_tensor_names(model_name: str, hf_dir: Path) -> bool:
    """Patch 2: for gemma3, map to the legacy on-disk names when the source files use them.

    A directory without weights (e.g. tokenizer only) gets the Hub layout, the legacy names.
    Returns whether the mapping was renamed.
    """
    from maxtext.checkpoint_conversion.utils import hf_shape, param_mapping

    gemma3 = param_mapping.GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING
    keys = [k for k in _table_keys(model_name) if param_mapping.PARAM_MAPPING.get(k) is gemma3]
    names = checkpoint_tensor_names(hf_dir)
    if not keys or (names and not any(n.startswith("language_model.model.") for n in names)):
        return False
    for key in keys:
        mapping_fn, shape_fn = param_mapping.PARAM_MAPPING[key], hf_shape.HF_SHAPE[key]

        def legacy_mapping(*args, _fn=mapping_fn, **kwargs):
            return {mt: _rename(hf, to_legacy_gemma3_name) for mt, hf in _fn(*args, **kwargs).items()}

        def legacy_shapes(*args, _fn=shape_fn, **kwargs):
            return {to_legacy_gemma3_name(hf): shape for hf, shape in _fn(*args, **kwargs).items()}

        param_mapping.PARAM_MAPPING[key] = legacy_mapping
        hf_shape.HF_SHAPE[key] = legacy_shapes
    return True


def copy_generation_config(hf_dir: Path, output_dir: str | None) -> None:
    """Post-processing 3: give the export the source's generation_config.json (stop tokens)."""
    src = hf_dir / "generation_config.json"
    if not src.is_file() or not output_dir or "://" in output_dir:
        return
    dst = Path(output_dir) / "generation_config.json"
    if Path(output_dir).is_dir() and not dst.exists():
        shutil.copyfile(src, dst)


def copy_source_config(hf_dir: Path, output_dir: str | None) -> None:
    """Post-processing 5: the export's config.json becomes the source's file, byte for byte."""
    from transformers import AutoConfig

    out = Path(output_dir) if output_dir and "://" not in output_dir else None
    if out is None or not (out / "config.json").is_file():
        return
    written, source = (AutoConfig.from_pretrained(d).to_dict() for d in (out, hf_dir))
    differs = sorted(k for k in written.keys() | source.keys()
                     if k not in ("transformers_version", "_name_or_path") and written.get(k) != source.get(k))
    if differs:  # e.g. --override_model_architecture: the export is not the source's architecture
        raise RuntimeError(f"to_huggingface wrote a config.json that differs from the source's in {differs}")
    shutil.copyfile(hf_dir / "config.json", out / "config.json")


def copy_untouched_tensors(hf_dir: Path, output_dir: str | None) -> None:
    """Post-processing 4: add the source tensors the export lacks, as a sharded checkpoint."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out = Path(output_dir) if output_dir and "://" not in output_dir else None
    if out is None or not (out / "model.safetensors").is_file():
        return
    with safe_open(out / "model.safetensors", "numpy") as f:
        exported = set(f.keys())
        metadata = f.metadata()
    missing: dict[str, Any] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(shard, "numpy") as f:
            missing |= {k: f.get_tensor(k) for k in f.keys() if k not in exported}
    lost = sorted(k for k in missing if not k.startswith(UNTRAINED_PREFIXES))
    if lost:  # a language-model tensor MaxText did not export must not come back untrained
        raise RuntimeError(f"to_huggingface exported no {lost[:3]} (+{len(lost) - 3} more)" if len(lost) > 3
                           else f"to_huggingface exported no {lost}")
    if not missing:
        return
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file(missing, out / names[1], metadata=metadata)
    (out / "model.safetensors").rename(out / names[0])
    weight_map = {k: names[0] for k in exported} | {k: names[1] for k in missing}
    size = sum((out / n).stat().st_size for n in names)
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


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


def collect_young_garbage() -> None:
    """Patch 10: ``gc.collect()`` without a generation collects generations 0 and 1 only."""
    import gc

    collect = gc.collect

    def collect_young(generation: int = 1) -> int:
        return collect(generation)

    gc.collect = collect_young


VERTEX_AI = "google.cloud.aiplatform"
ARROW_GRACE_S = 0.5  # patch 15: Arrow's read-ahead threads end in milliseconds on a local parquet file


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


def release_input_pipeline() -> None:
    """Patch 15: collect the finished run's garbage (its closed data iterators) now, each iterator's
    sleep for Arrow's threads held to ARROW_GRACE_S; datasets' own value is restored afterwards."""
    import gc
    import sys

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
    """Patch MaxText for `module` run with `argv`; return the post-processing step to run on success."""
    reject_secrets(argv)
    defer_vertex_ai_import()
    if module in TRAINERS:
        honour_checkpoint_storage(argv)
    if module == TRAIN_SFT:
        hold_after = hold_after_step()
        keep_checkpoints(argv)
        resume_data_position()
        stop_on_sigterm(hold_after)
    elif module in TRAINERS:
        hold_after_checkpoint(hold_after_step())
        log_right_samples_per_prompt()
        keep_the_first_pre_eval()
        grade_without_polling()
    if module in TRAINERS:
        return release_input_pipeline
    if module not in (TO_MAXTEXT, TO_HUGGINGFACE):
        return lambda: None
    args = parse_conversion_args(module, argv)
    collect_young_garbage()
    use_source_config(args.model_name, args.hf_model_path)
    if args.loads_file_names:
        use_checkpoint_tensor_names(args.model_name, args.hf_model_path)
    if module == TO_HUGGINGFACE:
        padded = accept_padded_vocabulary(args.hf_model_path)

        def finish() -> None:
            copy_generation_config(args.hf_model_path, args.output_dir)
            copy_source_config(args.hf_model_path, args.output_dir)
            restore_padded_rows(args.hf_model_path, args.output_dir, padded.get("maxtext_vocab"))
            copy_untouched_tensors(args.hf_model_path, args.output_dir)
        return finish
    return lambda: None
