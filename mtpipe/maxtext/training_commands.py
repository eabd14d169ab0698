"""The trainers' MaxText command lines (SFT, GRPO), built from a stage's resolved config and launched
through :mod:`mtpipe.maxtext.adapter.training` (the training patches); GRPO with the cpu_jax rollout
through :mod:`mtpipe.maxtext.launch_rl_cpu`, which applies the same patches. :func:`placeholder_command`
is a trainer's command with placeholder paths: what preflight compiles and the machine budget reads."""

from __future__ import annotations

from pathlib import Path

from mtpipe.maxtext.commands import MaxTextCommand, fmt, kv, storage_flags, take
from mtpipe.pipeline.trainers import GRPO, SFT, Trainer
from mtpipe.pipeline.view import View
from mtpipe.pipeline.schema import maxtext_args

LAUNCHER = "mtpipe.maxtext.adapter.training"
# Trained params are stage outputs too: written plain, an identical training gives identical bytes.
TRAINED_STORAGE = storage_flags("plain")
PLACEHOLDER = "/mtpipe-preflight-path"  # the start of every path of a placeholder command: opened by no one


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
    return MaxTextCommand(SFT.module, args, env=dict(cfg.hardware.env), launcher=LAUNCHER)


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
    launcher = {"cpu_jax": "mtpipe.maxtext.launch_rl_cpu", "vllm": LAUNCHER}[t.rollout_backend]
    return MaxTextCommand(GRPO.module, args, env=dict(cfg.hardware.env), launcher=launcher)


def placeholder_command(cfg: View, trainer: Trainer) -> MaxTextCommand:
    """The command ``trainer``'s stage runs for ``cfg``, every path a placeholder under :data:`PLACEHOLDER`:
    its shapes, dtypes and checkpoint keys are the stage's own (what preflight compiles, what the machine
    budget reads), its files none."""
    p = Path(PLACEHOLDER)
    paths = {"ckpt": p / "ckpt", "train_files": f"{p}/train", "eval_files": f"{p}/eval", "tokenizer_dir": p / "tokenizer",
             "base_output": p / "out", "run_name": f"{PLACEHOLDER}-run", "jax_cache_dir": p / "jax_cache"}
    if trainer == SFT:
        return train_sft(cfg, columns=list(cfg.dataset.columns), metrics_file=p / "metrics", **paths)
    return train_rl(cfg, **paths)
