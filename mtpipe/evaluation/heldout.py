"""Held-out loss of a chat model: the SFT branch's score, for the base and the trained model alike.

Each test conversation (the branch's pinned test split, ``messages`` column) is rendered with the
model's own chat template, cut to ``max_length`` tokens, and sent to the model server
(:mod:`mtpipe.evaluation.serving`: vLLM on TPU, the numpy forward on the CPU) as an echoed prompt;
the score of a conversation is the mean negative log-likelihood of its tokens after the first. The score is the mean over conversations, with a 95% interval
from their spread; two models' losses on the same conversations compare pairwise (:func:`gain`). Base and trained model see the same tokens (the tokenizer is the base model's,
which the export copies), so their difference is the fine-tuning's effect on this text.

What it is not: a judge of answer quality (no reference model, no MT-Bench); a loss over assistant
tokens only (the whole conversation counts, template tokens included, which the models share).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from mtpipe.pipeline.stats import mean_ci
from mtpipe.evaluation.serving import SERVED_NAME, open_loopback


def conversations(test_files: list[Path], column: str, count: int | None) -> list[list[dict[str, str]]]:
    """The first ``count`` conversations (None: all) of the test split."""
    rows: list[list[dict[str, str]]] = []
    for path in sorted(test_files):
        rows += pq.read_table(path, columns=[column]).column(column).to_pylist()
    return rows[:count] if count is not None else rows


def conversation_loss(base_url: str, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] given the tokens before each, from the server."""
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    request = urllib.request.Request(base_url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with open_loopback(request, timeout=600) as resp:
        logprobs = json.load(resp)["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    return -float(np.mean(logprobs))


def evaluate(base_url: str, tokenizer_dir: Path, test_files: list[Path], *, column: str, count: int | None,
             max_length: int) -> list[dict[str, Any]]:
    """The held-out loss of the served model on each of ``count`` test conversations (None: all):
    ``{"problem": index in the test split, "loss"}``, those under two tokens left out."""
    from transformers import AutoTokenizer  # local import: transformers is slow to import

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for index, messages in enumerate(conversations(test_files, column, count)):
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))[:max_length]
        if len(ids) >= 2:
            # rounded: the float64 forward's last bits follow the CPU's BLAS kernels, and the base
            # model's score should be the same bytes on every machine
            rows.append({"problem": index, "loss": round(conversation_loss(base_url, ids), 6)})
    if not rows:
        raise ValueError(f"no test conversation of {test_files} has two tokens: check the dataset's {column!r} column")
    return rows


def scores(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean held-out loss over the conversations, with its 95% interval from their spread."""
    mean, ci, se = mean_ci([row["loss"] for row in rows])
    return {"conversations": len(rows), "loss": round(mean, 5), "loss_ci95": round(ci, 5), "loss_stderr": round(se, 8)}


def gain(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """before - after loss (positive: the later model fits the held-out text better), with the 95%
    interval of the paired difference (the same conversations)."""
    if [r["problem"] for r in before] != [r["problem"] for r in after]:
        raise ValueError(f"scored on different conversations ({len(before)} and {len(after)}): evaluate both "
                         "with the same test split and evaluate.num_problems")
    mean, ci, _ = mean_ci([b["loss"] - a["loss"] for a, b in zip(after, before)])
    return {"loss_gain": round(mean, 5), "loss_gain_ci95": round(ci, 5)}
