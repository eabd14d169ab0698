"""MaxText command lines, built from a stage's resolved config.

Each function returns a :class:`MaxTextCommand`: the MaxText module and its ``key=value`` arguments,
in the tutorial's order, followed by what the pipeline adds (local files instead of Hub names, the
shrunk dims of a tiny model, checkpointing and metrics). A stage's own keys that MaxText reads under
their own names are the schema's fields marked ``MAXTEXT`` (:func:`mtpipe.pipeline.schema.maxtext_args`):
a new one needs no change here. ``tests/test_tutorial_commands.py`` compares the commands with the
tutorials' argument by argument; docs/decisions.md explains each difference.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtpipe.pipeline.config import View
from mtpipe.pipeline.schema import maxtext_args

TO_MAXTEXT = "maxtext.checkpoint_conversion.to_maxtext"
TO_HUGGINGFACE = "maxtext.checkpoint_conversion.to_huggingface"
TRAIN_SFT = "maxtext.trainers.post_train.sft.train_sft"
TRAIN_RL = "maxtext.trainers.post_train.rl.train_rl"


@dataclass(frozen=True)
class MaxTextCommand:
    """One MaxText entry point, its arguments and the environment it runs in."""

    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    launcher: str = "mtpipe.maxtext.launch"  # applies mtpipe.maxtext.maxtext_adapter; train_rl on CPU: mtpipe.maxtext.launch_rl_cpu

    def argv(self) -> list[str]:
        """The child process: ``python -m <launcher> <module> <args>``."""
        return [sys.executable, "-m", self.launcher, self.module, *self.args]

    def as_tutorial(self) -> str:
        """The command as a user would type it (``python3 -m <module> <args>``)."""
        return shlex.join(["python3", "-m", self.module, *self.args])


def fmt(value: Any) -> str:
    """Format a value the way MaxText's key=value parser (YAML) reads it; booleans as the tutorials spell them."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(repr(v) for v in value) + "]"
    return str(value)


def kv(mapping: Mapping[str, Any]) -> list[str]:
    """``key=value`` for every non-null entry, in order."""
    return [f"{k}={fmt(v)}" for k, v in mapping.items() if v is not None]


def take(mapping: dict[str, Any], *keys: str) -> dict[str, Any]:
    """Remove ``keys`` from ``mapping`` (those it has) and return them in that order: arguments the
    tutorial places early."""
    return {k: mapping.pop(k) for k in keys if k in mapping}


def _storage_flags(storage: str) -> list[str]:
    """``ocdbt``: zarr3 + OCDBT (the tutorial's); ``plain``: one zarr array per tensor, file names
    that depend only on the tensors, so the same tensors give the same bytes (docs/decisions.md)."""
    use = "1" if storage == "ocdbt" else "0"
    return [f"checkpoint_storage_use_zarr3={use}", f"checkpoint_storage_use_ocdbt={use}"]


# Trained params are stage outputs too: written plain, an identical training gives identical bytes.
TRAINED_STORAGE = _storage_flags("plain")


def to_maxtext(cfg: View, hf_dir: Path, out_dir: Path) -> MaxTextCommand:
    """HF -> MaxText conversion of the downloaded checkpoint (runs on the host CPU, as in the tutorial)."""
    opts = cfg.to_maxtext
    args = [
        f"model_name={cfg.model.maxtext_name}",
        f"base_output_directory={out_dir}",
        *kv(maxtext_args(opts)),
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        *_storage_flags(opts.checkpoint_storage),
        f"--lazy_load_tensors={opts.lazy_load_tensors}",
        f"--hf_model_path={hf_dir}",
        *([f"--simulated_cpu_devices_count={opts.shards}"] if opts.shards else []),
        *kv(cfg.model.maxtext_overrides),
    ]
    return MaxTextCommand(TO_MAXTEXT, args, env={"JAX_PLATFORMS": "cpu"})


def train_sft(
    cfg: View, *, ckpt: Path, train_files: str, eval_files: str | None, columns: list[str],
    tokenizer_dir: Path, base_output: Path | str, run_name: str, metrics_file: Path, jax_cache_dir: Path,
) -> MaxTextCommand:
    """Supervised fine-tuning on local chat data (parquet files from hf_download, never the Hub)."""
    t, keys = cfg.train_sft, maxtext_args(cfg.train_sft)
    args = [
        f"run_name={run_name}",
        f"base_output_directory={base_output}",
        f"model_name={cfg.model.maxtext_name}",
        f"load_parameters_path={ckpt}",
        *kv(take(keys, "per_device_batch_size", "steps")),
        "hf_path=parquet",
        "train_split=train",
        f"train_data_columns={fmt(columns)}",
        *kv(take(keys, "profiler")),
        f"hf_train_files={train_files}",
        f"tokenizer_path={tokenizer_dir}",
        *kv(keys),
        *(_eval_files(eval_files, columns) if t.eval_interval and eval_files else []),
        *TRAINED_STORAGE,
        f"metrics_file={metrics_file}",
        f"jax_cache_dir={jax_cache_dir}",
        *kv(cfg.hardware.maxtext_args),
        *kv(cfg.model.maxtext_overrides),
        *kv(t.extra_args),
    ]
    return MaxTextCommand(TRAIN_SFT, args, env=dict(cfg.hardware.env))


def _eval_files(eval_files: str, columns: list[str]) -> list[str]:
    return [f"hf_eval_files={eval_files}", "hf_eval_split=train", f"eval_data_columns={fmt(columns)}"]


def train_rl(
    cfg: View, *, ckpt: Path, train_files: str, eval_files: str, tokenizer_dir: Path, base_output: Path | str,
    run_name: str, jax_cache_dir: Path,
) -> MaxTextCommand:
    """GRPO on local GSM8K-format parquet files; the rollout backend is chosen by ``rollout_backend``."""
    t = cfg.train_rl
    args = [
        f"model_name={cfg.model.maxtext_name}",
        f"load_parameters_path={ckpt}",
        f"run_name={run_name}",
        f"base_output_directory={base_output}",
        *kv(maxtext_args(t)),
        f"dataset_name={cfg.dataset.hf_name}",
        f"hf_train_files={train_files}",
        f"hf_eval_files={eval_files}",
        f"tokenizer_path={tokenizer_dir}",
        *TRAINED_STORAGE,
        f"jax_cache_dir={jax_cache_dir}",
        *kv(cfg.hardware.maxtext_args),
        *kv(cfg.model.maxtext_overrides),
        *kv(t.extra_args),
    ]
    launcher = {"cpu_jax": "mtpipe.maxtext.launch_rl_cpu", "vllm": "mtpipe.maxtext.launch"}[t.rollout_backend]
    return MaxTextCommand(TRAIN_RL, args, env=dict(cfg.hardware.env), launcher=launcher)


def to_huggingface(cfg: View, *, params: Path, hf_src_dir: Path, out_dir: Path) -> MaxTextCommand:
    """MaxText -> HF export of trained params, with the source's tokenizer files."""
    opts = cfg.to_huggingface
    args = [
        f"model_name={cfg.model.export_name}",
        f"load_parameters_path={params}",
        f"base_output_directory={out_dir}",
        *kv(maxtext_args(opts)),
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        f"--hf_model_path={hf_src_dir}",
        *kv(cfg.model.maxtext_overrides),
    ]
    return MaxTextCommand(TO_HUGGINGFACE, args, env={"JAX_PLATFORMS": "cpu"})
