"""Held-out loss of a chat model: the SFT branch's score, for the base and the trained model alike.

Each test conversation (the branch's pinned test split, ``messages`` column) is rendered with the
model's own chat template, cut to ``max_length`` tokens, and sent to the model server
(:mod:`mtpipe.evaluation.serving`: vLLM on TPU, the numpy forward on the CPU) as an echoed prompt;
the score of a conversation is the mean negative log-likelihood of its tokens after the first. The score is the mean over conversations, with a 95% interval
from their spread. Base and trained model see the same tokens (the tokenizer is the base model's,
which the export copies), so their difference is the fine-tuning's effect on this text.

What it is not: a judge of answer quality (no reference model, no MT-Bench); a loss over assistant
tokens only (the whole conversation counts, template tokens included, which the models share).
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from mtpipe.evaluation.gsm8k import Z95
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
             max_length: int) -> dict[str, Any]:
    """Mean held-out loss of the served model over ``count`` test conversations."""
    from transformers import AutoTokenizer  # local import: transformers is slow to import

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    losses = []
    for messages in conversations(test_files, column, count):
        ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))[:max_length]
        if len(ids) >= 2:
            losses.append(conversation_loss(base_url, ids))
    if not losses:
        raise ValueError(f"no test conversation of {test_files} has two tokens: check the dataset's {column!r} column")
    mean, sd = float(np.mean(losses)), float(np.std(losses, ddof=1)) if len(losses) > 1 else 0.0
    se = sd / math.sqrt(len(losses))
    # rounded like the rest: the float64 forward's last bits follow the CPU's BLAS kernels, and the
    # base model's score should be the same bytes on every machine
    return {"conversations": len(losses), "loss": round(mean, 5), "loss_ci95": round(Z95 * se, 5),
            "loss_stderr": round(se, 8)}


def gain(base: dict[str, Any], trained: dict[str, Any]) -> dict[str, Any]:
    """base - trained loss (positive: the fine-tuned model fits the held-out text better), 95% interval
    from both standard errors (conservative, as :func:`mtpipe.evaluation.gsm8k.gain`)."""
    if base["conversations"] != trained["conversations"]:
        raise ValueError(f"base scored on {base['conversations']} conversations, trained on "
                         f"{trained['conversations']}: evaluate both with the same evaluate.num_problems")
    se = math.hypot(base["loss_stderr"], trained["loss_stderr"])
    return {"loss_gain": round(base["loss"] - trained["loss"], 5), "loss_gain_ci95": round(Z95 * se, 5)}
