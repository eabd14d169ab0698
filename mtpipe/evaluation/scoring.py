"""Score one model directory for a branch: serve it, run the branch's evaluation, stop the server.

The RL branch is scored on GSM8K with lm-eval (:mod:`mtpipe.evaluation.gsm8k`), the SFT branch by its
held-out loss (:mod:`mtpipe.evaluation.heldout`); both through the model server of
``evaluate.backend`` (:mod:`mtpipe.evaluation.serving`). The stages evaluate_base and evaluate call
:func:`score` for the downloaded base model and for the exported trained model with the same
settings, so their scores compare.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

from mtpipe.data import datasets_check
from mtpipe.errors import ConfigError
from mtpipe.evaluation import gsm8k, heldout, serving


def check_backend(cfg: Any) -> None:
    """Fail before any server starts when the backend cannot run here."""
    if cfg.evaluate.backend == "vllm" and find_spec("vllm") is None:
        raise ConfigError(f"{cfg.branch}.evaluate.backend", "vllm is not installed here",
                          f"run on a TPU VM set up by `doit vm_setup` (doit vm_run --target=evaluate@{cfg.branch}), "
                          "or set backend: cpu for a tiny model")


def score(cfg: Any, model_dir: Path, dataset_dir: Path, work: Path, log: Path) -> dict[str, Any]:
    """The branch's scores of the model in ``model_dir`` (its own tokenizer and chat template)."""
    e = cfg.evaluate
    check_backend(cfg)
    files = datasets_check.dataset_files(cfg, dataset_dir, "eval_files")  # the pinned test split
    port = serving.free_port()
    command = serving.server_command(e.backend, model_dir, port, e)
    with serving.serving(command, port, log, e.server_timeout_s) as url:
        if cfg.dataset.row_schema == "gsm8k":
            return gsm8k.evaluate(url, model_dir, files, work, num_problems=e.num_problems,
                                  num_fewshot=e.num_fewshot, max_new_tokens=e.max_new_tokens)
        return heldout.evaluate(url, model_dir, files, column=cfg.dataset.columns[0], count=e.num_problems,
                                max_length=e.max_length)


def gain(cfg: Any, base: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """trained vs base, with its 95% interval (accuracy points for GSM8K, loss for held-out text)."""
    return gsm8k.gain(base, trained) if cfg.dataset.row_schema == "gsm8k" else heldout.gain(base, trained)
