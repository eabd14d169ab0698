"""Score one model directory for a branch: serve it, run the branch's evaluation, stop the server.

The RL branch is scored on GSM8K with lm-eval (:mod:`mtpipe.evaluation.gsm8k`), the SFT branch by its
held-out loss (:mod:`mtpipe.evaluation.heldout`); both through the model server of
``evaluate.backend`` (:mod:`mtpipe.evaluation.serving`). The evaluate stages call :func:`score` for
the downloaded base model, the RL branch's warm-up and the exported trained model with the same
settings, so their scores compare problem by problem: each keeps one row per problem
(``scores/<branch>/``, :func:`write_rows`), and :func:`gain` pairs two models' rows.
"""

from __future__ import annotations

import json
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


def score(cfg: Any, model_dir: Path, dataset_dir: Path, work: Path, log: Path) -> list[dict[str, Any]]:
    """The branch's per-problem results of the model in ``model_dir`` (its own tokenizer and chat template)."""
    e = cfg.evaluate
    check_backend(cfg)
    files = datasets_check.dataset_files(cfg, dataset_dir, "eval_files")  # the pinned test split
    port = serving.free_port()
    command = serving.server_command(e.backend, model_dir, port, e)
    with serving.serving(command, port, log, e.server_timeout_s) as url:
        if cfg.dataset.row_schema == "gsm8k":
            return gsm8k.evaluate(url, model_dir, files, work, task=e.task, num_problems=e.num_problems,
                                  num_fewshot=e.num_fewshot, max_new_tokens=e.max_new_tokens)
        return heldout.evaluate(url, model_dir, files, column=cfg.dataset.columns[0], count=e.num_problems,
                                max_length=e.max_length)


def summary(cfg: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's score from its rows, with its 95% interval (accuracy in percent, or held-out loss)."""
    return gsm8k.scores(rows) if cfg.dataset.row_schema == "gsm8k" else heldout.scores(rows)


def gain(cfg: Any, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``after`` gained over ``before`` on the same problems, with its paired 95% interval
    (accuracy points for GSM8K, loss for held-out text)."""
    return gsm8k.gain(before, after) if cfg.dataset.row_schema == "gsm8k" else heldout.gain(before, after)


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Per-problem results as JSON lines (one problem per line, keys sorted: the same bytes each run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text("".join(json.dumps(row, sort_keys=True) + "\n" for row in rows))
    tmp.replace(path)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Rows written by :func:`write_rows`."""
    return [json.loads(line) for line in path.read_text().splitlines()]
