"""Logit checks: the independent numpy forward (mtpipe/evaluation/numpy_forward.py) against itself and MaxText.

Fast tests check properties of the numpy forward that do not need MaxText (causality, GQA grouping,
the sliding-window receptive field). The slow tests take each tiny twin from mtpipe.data.embedded through
the real converters (HF -> to_maxtext -> to_huggingface) and require

* MaxText's forward of the converted checkpoint == the numpy forward of the HF source, and
* the numpy forward of the export == the numpy forward of the source,

on a sequence longer than Gemma 3's sliding window. See docs/logit-check.md for the tolerances.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from mtpipe.evaluation import numpy_forward
from mtpipe.data import embedded

SEQ_LEN = 100  # > the tiny Gemma 3's sliding window (64), so local layers really are local

TWINS: dict[str, Callable[[str | os.PathLike], None]] = {
    "gemma3-tiny": embedded.write_gemma3_tiny,
    "llama3.1-tiny": embedded.write_llama31_tiny,
}


@pytest.fixture(scope="module", params=sorted(TWINS))
def twin(request, tmp_path_factory) -> tuple[str, Path]:
    """(name, directory) of a tiny twin written by mtpipe.data.embedded."""
    out = tmp_path_factory.mktemp(request.param) / "hf"
    TWINS[request.param](out)
    return request.param, out


def _tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, embedded.TINY_VOCAB, SEQ_LEN)


def _rewrite(src: Path, dst: Path, edit_config: Callable[[dict], None], edit_tensors: Callable[[dict], None]) -> Path:
    """Copy a model dir with an edited config.json and tensors (written as one model.safetensors)."""
    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    edit_config(config)
    (dst / "config.json").write_text(json.dumps(config))
    w = numpy_forward.Weights(src)
    tensors = {n: w.raw(n) for n in w.names()}
    edit_tensors(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


# ----------------------------------------------------------------------------- numpy forward alone


def test_forward_is_causal(twin):
    """Changing the last tokens changes their logits and leaves every earlier position untouched."""
    _, hf_dir = twin
    ids = _tokens()
    changed = ids.copy()
    changed[80:] = (changed[80:] + 1) % embedded.TINY_VOCAB
    a, b = numpy_forward.logits(hf_dir, ids), numpy_forward.logits(hf_dir, changed)
    assert a.shape == (SEQ_LEN, embedded.TINY_VOCAB)
    np.testing.assert_allclose(a[:80], b[:80], rtol=0, atol=1e-12)
    assert np.abs(a[80:] - b[80:]).min(axis=-1).max() > 1e-6


def test_gqa_equals_mha_with_repeated_kv(twin, tmp_path):
    """GQA == the MHA model whose k/v heads are repeated as transformers' repeat_kv does."""
    _, hf_dir = twin
    text = _text_config(json.loads((hf_dir / "config.json").read_text()))
    heads, kv_heads, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    assert kv_heads < heads, "the twin must use grouped-query attention for this test to mean anything"

    def to_mha(config: dict) -> None:
        _text_config(config)["num_key_value_heads"] = heads

    def repeat_kv(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight"))]:
            w = tensors[name].reshape(kv_heads, d, -1)
            tensors[name] = np.repeat(w, heads // kv_heads, axis=0).reshape(heads * d, -1)

    mha = _rewrite(hf_dir, tmp_path / "mha", to_mha, repeat_kv)
    ids = _tokens(1)
    np.testing.assert_allclose(numpy_forward.logits(mha, ids), numpy_forward.logits(hf_dir, ids), rtol=0, atol=1e-10)


def test_sliding_window_limits_receptive_field(tmp_path):
    """With every Gemma 3 layer local (window w, L layers) token 0 reaches positions < 1 + L*(w-1) only."""
    src = tmp_path / "gemma3"
    embedded.write_gemma3_tiny(src)
    window = 4

    def all_local(config: dict) -> None:
        text = config["text_config"]
        text["sliding_window"] = window
        text["layer_types"] = ["sliding_attention"] * text["num_hidden_layers"]

    local = _rewrite(src, tmp_path / "local", all_local, lambda tensors: None)
    layers = json.loads((src / "config.json").read_text())["text_config"]["num_hidden_layers"]
    reach = 1 + layers * (window - 1)
    ids = _tokens(2)
    changed = ids.copy()
    changed[0] = (changed[0] + 1) % embedded.TINY_VOCAB
    diff = np.abs(numpy_forward.logits(local, ids) - numpy_forward.logits(local, changed)).max(axis=-1)
    assert diff[reach - 1] > 1e-9
    assert diff[reach:].max() == 0.0
    # The real layer pattern (a global layer after every 5 local ones) lets token 0 reach the end.
    full = np.abs(numpy_forward.logits(src, ids) - numpy_forward.logits(src, changed)).max(axis=-1)
    assert full[-1] > 1e-9


def test_unknown_architecture_fails_early(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type='bert'"):
        numpy_forward.logits(tmp_path, [1, 2, 3])


# MaxText against this reference: tests/test_conversion_roundtrip.py (the converted tiny twins,
# untrained) and tests/test_pipeline_{sft,rl}.py (the pipeline's trained, exported models).
