"""MaxText command lines, built from a stage's resolved config.

Each function returns a :class:`MaxTextCommand`: the MaxText module and its ``key=value`` arguments,
in the tutorial's order, followed by what the pipeline adds (local files instead of Hub names, the
shrunk dims of a tiny model, checkpointing and metrics). ``tests/test_tutorial_commands.py`` compares
them with the tutorials' commands argument by argument; docs/decisions.md explains each difference.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

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

    def argv(self) -> list[str]:
        """The child process: ``python -m mtpipe.launch <module> <args>``."""
        return [sys.executable, "-m", "mtpipe.launch", self.module, *self.args]

    def as_tutorial(self) -> str:
        """The command as a user would type it (``python3 -m <module> <args>``)."""
        return shlex.join(["python3", "-m", self.module, *self.args])


def fmt(value: Any) -> str:
    """Format a value the way MaxText's key=value parser reads it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(repr(v) for v in value) + "]"
    return str(value)


def kv(mapping: Mapping[str, Any]) -> list[str]:
    """``key=value`` for every non-null entry, in order."""
    plain = OmegaConf.to_container(mapping) if isinstance(mapping, DictConfig) else dict(mapping)
    return [f"{k}={fmt(v)}" for k, v in plain.items() if v is not None]


def _storage_flags(storage: str) -> list[str]:
    use = "1" if storage == "ocdbt" else "0"
    return [f"checkpoint_storage_use_zarr3={use}", f"checkpoint_storage_use_ocdbt={use}"]


def to_maxtext(cfg: DictConfig, hf_dir: Path, out_dir: Path) -> MaxTextCommand:
    """HF -> MaxText conversion of the downloaded checkpoint (runs on the host CPU, as in the tutorial)."""
    opts = cfg.to_maxtext
    args = [
        f"model_name={cfg.model.maxtext_name}",
        f"base_output_directory={out_dir}",
        f"scan_layers={opts.scan_layers}",
        f"use_multimodal={opts.use_multimodal}",
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        *_storage_flags(opts.checkpoint_storage),
        f"--lazy_load_tensors={opts.lazy_load_tensors}",
        f"--hf_model_path={hf_dir}",
        *kv(cfg.model.maxtext_overrides),
    ]
    return MaxTextCommand(TO_MAXTEXT, args, env={"JAX_PLATFORMS": "cpu"})


def train_sft(
    cfg: DictConfig, *, ckpt: Path, data_dir: Path, tokenizer_dir: Path, base_output: Path, run_name: str,
    metrics_file: Path, jax_cache_dir: Path,
) -> MaxTextCommand:
    """Supervised fine-tuning on the downloaded chat data (local parquet files, never the Hub)."""
    t, d = cfg.train_sft, cfg.dataset
    args = [
        f"run_name={run_name}",
        f"base_output_directory={base_output}",
        f"model_name={cfg.model.maxtext_name}",
        f"load_parameters_path={ckpt}",
        f"per_device_batch_size={t.per_device_batch_size}",
        f"steps={t.steps}",
        "hf_path=parquet",
        "train_split=train",
        f"train_data_columns={fmt(list(d.columns))}",
        *([f"profiler={t.profiler}"] if t.profiler else []),
        f"hf_train_files={data_dir / d.train_files}",
        f"tokenizer_path={tokenizer_dir}",
        *kv({
            "max_target_length": t.max_target_length,
            "learning_rate": t.learning_rate,
            "num_epoch": t.num_epoch,
            "checkpoint_period": t.checkpoint_period,
        }),
        *(_eval_args(t, d, data_dir)),
        f"metrics_file={metrics_file}",
        f"jax_cache_dir={jax_cache_dir}",
        *kv(cfg.hardware.maxtext_args),
        *kv(cfg.model.maxtext_overrides),
        *kv(t.extra_args),
    ]
    return MaxTextCommand(TRAIN_SFT, args, env=dict(cfg.hardware.env))


def _eval_args(t: DictConfig, d: DictConfig, data_dir: Path) -> list[str]:
    if not t.get("eval_interval") or not d.get("eval_files"):
        return []
    return [
        f"hf_eval_files={data_dir / d.eval_files}",
        "hf_eval_split=train",
        f"eval_data_columns={fmt(list(d.columns))}",
        f"eval_interval={t.eval_interval}",
        f"eval_steps={t.eval_steps}",
    ]


def to_huggingface(cfg: DictConfig, *, params: Path, hf_src_dir: Path, out_dir: Path) -> MaxTextCommand:
    """MaxText -> HF export of trained params, with the source's tokenizer files."""
    opts = cfg.to_huggingface
    args = [
        f"model_name={cfg.model.export_name}",
        f"load_parameters_path={params}",
        f"base_output_directory={out_dir}",
        f"scan_layers={opts.scan_layers}",
        f"use_multimodal={opts.use_multimodal}",
        f"weight_dtype={opts.weight_dtype}",
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        f"--hf_model_path={hf_src_dir}",
        *kv(cfg.model.maxtext_overrides),
    ]
    return MaxTextCommand(TO_HUGGINGFACE, args, env={"JAX_PLATFORMS": "cpu"})
