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
import re
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from families import TWINS, twins
from mtpipe.evaluation import numpy_forward
from mtpipe.data import embedded
import families

SEQ_LEN = 100  # > the tiny Gemma 3's sliding window (64), so local layers really are local


@pytest.fixture(scope="module", params=TWINS)
def twin(request, tmp_path_factory) -> tuple[str, Path]:
    """(name, directory) of every tiny twin (tests/families.py), written by mtpipe.data.embedded."""
    out = tmp_path_factory.mktemp(request.param) / "hf"
    twins()[request.param].write(out)
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
    families.twins()["gemma3-tiny"].write(src)
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


# ----------------------------------------------------------------------------- a family from flags alone


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama") / "hf"
    families.twins()["llama3.1-tiny"].write(out)
    return out


def _as_qwen3(src: Path, dst: Path, *, tied: bool = False, edit_tensors: Callable[[dict], None] = lambda t: None) -> Path:
    """The Llama twin as a Qwen 3 checkpoint: q/k norms per layer (weights near 1), a tiny eps, optionally tied."""
    rng = np.random.default_rng(3)

    def to_qwen3(config: dict) -> None:
        config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], rms_norm_eps=1e-12,
                      tie_word_embeddings=tied)

    def add_qk_norms(tensors: dict) -> None:
        d = tensors["model.layers.0.self_attn.k_proj.weight"].shape[0] // 2  # 2 kv heads
        for i in range(4):
            for name in ("q_norm", "k_norm"):
                tensors[f"model.layers.{i}.self_attn.{name}.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        if tied:
            del tensors["lm_head.weight"]
        edit_tensors(tensors)

    return _rewrite(src, dst, to_qwen3, add_qk_norms)


def _scale_qk(factor: float) -> Callable[[dict], None]:
    def scale(tensors: dict) -> None:
        for name in [n for n in tensors if n.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight"))]:
            tensors[name] = tensors[name] * np.float32(factor)
    return scale


@pytest.mark.families
def test_qwen3_normalises_query_and_key_heads(llama_dir, tmp_path):
    """Qwen 3 is Llama plus an RMSNorm over each q and k head (qwen3:Qwen3Attention), served from the config
    alone: its logits do not move when q_proj and k_proj are scaled, while Llama's (no such norm) do."""
    ids = _tokens(4)
    qwen3 = numpy_forward.logits(_as_qwen3(llama_dir, tmp_path / "q"), ids)
    scaled = numpy_forward.logits(_as_qwen3(llama_dir, tmp_path / "q8", edit_tensors=_scale_qk(8.0)), ids)
    np.testing.assert_allclose(scaled, qwen3, rtol=0, atol=1e-9)
    llama_scaled = _rewrite(llama_dir, tmp_path / "l8", lambda config: None, _scale_qk(8.0))
    assert np.abs(numpy_forward.logits(llama_scaled, ids) - numpy_forward.logits(llama_dir, ids)).max() > 1e-3


@pytest.mark.families
def test_a_tied_table_is_rounded_to_bfloat16_as_maxtext_does_for_any_family(llama_dir, tmp_path):
    """match_maxtext: a tied non-Gemma table is cast to bfloat16 (MaxText attend_on_embedding; no logit
    normalisation): it changes the logits of a float32 table, and nothing when the table is bf16 already."""
    ids = _tokens(5)
    tied = _as_qwen3(llama_dir, tmp_path / "tied", tied=True)
    plain, rounded = numpy_forward.logits(tied, ids), numpy_forward.logits(tied, ids, match_maxtext=True)
    assert np.abs(plain - rounded).max() > 1e-4

    def to_bf16(tensors: dict) -> None:
        name = "model.embed_tokens.weight"
        tensors[name] = tensors[name].astype(ml_dtypes.bfloat16).astype(np.float32)

    on_grid = _as_qwen3(llama_dir, tmp_path / "bf16", tied=True, edit_tensors=to_bf16)
    np.testing.assert_array_equal(numpy_forward.logits(on_grid, ids, match_maxtext=True),
                                  numpy_forward.logits(on_grid, ids))


@pytest.mark.families
@pytest.mark.parametrize(("edit", "problem"), [
    ({"model_type": "mixtral"}, "model_type='mixtral': only gemma3, gemma3_text, llama, qwen3 are supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                          "original_max_position_embeddings": 32768}}, "rope_type 'yarn' is not implemented"),
    ({"hidden_act": "relu"}, "activation 'relu' is not implemented"),
])  # fmt: skip
def test_a_config_the_forward_cannot_serve_is_refused_naming_the_key(llama_dir, tmp_path, edit, problem):
    """numpy_forward.unsupported (also what configure asks, mtpipe/evaluation/cpu_backend.py) names the key."""
    from transformers import AutoConfig

    config = json.loads((llama_dir / "config.json").read_text()) | {"model_type": "qwen3"} | edit
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert any(problem in p for p in numpy_forward.unsupported(AutoConfig.from_pretrained(tmp_path)))
    with pytest.raises(ValueError, match=re.escape(problem.split(":")[0])):
        numpy_forward.Model(tmp_path)


# MaxText against this reference: tests/maxtext/test_conversion_roundtrip.py (the converted tiny twins,
# untrained) and tests/pipeline/test_pipeline_{sft,rl}.py (the pipeline's trained, exported models).
