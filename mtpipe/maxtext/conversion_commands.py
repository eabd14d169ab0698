"""The converters' MaxText command lines (HF -> MaxText, MaxText -> HF), built from a stage's resolved
config and launched through :mod:`mtpipe.maxtext.adapter.conversion` (the conversion patches)."""

from __future__ import annotations

from pathlib import Path

from mtpipe.maxtext.commands import TO_HUGGINGFACE, TO_MAXTEXT, MaxTextCommand, kv, storage_flags
from mtpipe.pipeline.view import View
from mtpipe.pipeline.schema import maxtext_args

LAUNCHER = "mtpipe.maxtext.adapter.conversion"


def to_maxtext(cfg: View, hf_dir: Path, out_dir: Path) -> MaxTextCommand:
    """HF -> MaxText conversion of the downloaded checkpoint (runs on the host CPU, as in the tutorial)."""
    opts = cfg.to_maxtext
    args = [
        f"model_name={cfg.model.maxtext_name}",
        f"base_output_directory={out_dir}",
        *kv(maxtext_args(opts)),
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        *storage_flags(opts.checkpoint_storage),
        f"--lazy_load_tensors={opts.lazy_load_tensors}",
        f"--hf_model_path={hf_dir}",
        *([f"--simulated_cpu_devices_count={opts.shards}"] if opts.shards else []),
        *kv(cfg.model.maxtext_overrides),
    ]
    return MaxTextCommand(TO_MAXTEXT, args, env={"JAX_PLATFORMS": "cpu"}, launcher=LAUNCHER)


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
    return MaxTextCommand(TO_HUGGINGFACE, args, env={"JAX_PLATFORMS": "cpu"}, launcher=LAUNCHER)
