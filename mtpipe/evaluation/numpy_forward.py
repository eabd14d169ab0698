"""An independent float64 numpy forward pass of Gemma 3 (text) and Llama 3.1 Hugging Face checkpoints.

It reads `config.json` with transformers' own config classes (no torch needed), so defaults and legacy
keys (`rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) mean exactly what they mean to
transformers, and `*.safetensors` with the numpy backend. The math re-implements transformers 5.12
`models/gemma3/modeling_gemma3.py` and `models/llama/modeling_llama.py` (cited below as gemma3:<class>
and llama:<class>) in float64, so it serves as the ground truth an exported directory is checked against.

    logits(hf_dir, token_ids) -> np.ndarray of shape (len(token_ids), vocab_size)
    Model(hf_dir).generate(prompt_ids, max_new_tokens, stop_ids)  # greedy, with a KV cache

The tests use it as the ground truth; the evaluate stage serves exported models with it on the CPU
(mtpipe/evaluation/server.py). The KV cache changes no number: a cached step computes exactly what the
full forward computes for that position (tests/test_evaluate.py compares them:
test_cached_decoding_is_greedy_decoding_of_the_full_forward).

`match_maxtext=True` adds the one deliberate rounding MaxText applies and transformers does not (see
`_output_table`), so MaxText's float32 forward can be compared with a tight tolerance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes  # also registers bfloat16 with numpy, so safetensors can read BF16 tensors
import numpy as np
from safetensors import safe_open
from scipy.special import erf

# Where the Gemma 3 language model's tensors live, by checkpoint layout (first match wins).
_GEMMA3_PREFIXES = (
    "language_model.model.",  # Hub on-disk layout of Gemma3ForConditionalGeneration (google/gemma-3-4b-it)
    "model.language_model.",  # transformers 5 in-memory names (what MaxText's to_huggingface writes)
    "model.",  # text-only Gemma3ForCausalLM
)
_GEMMA3_LM_HEADS = ("language_model.lm_head.weight", "lm_head.weight")


class Weights:
    """Lazy float64 view of every tensor in a directory's `*.safetensors` files (one layer at a time)."""

    def __init__(self, hf_dir: Path) -> None:
        self._loaded: dict[str, np.ndarray] = {}
        files = sorted(hf_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {hf_dir}: export the model weights first")
        self._where: dict[str, Path] = {}
        for f in files:
            with safe_open(f, framework="np") as h:
                self._where.update({k: f for k in h.keys()})

    def names(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype."""
        if name not in self._where:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint")
        with safe_open(self._where[name], framework="np") as h:
            return h.get_tensor(name)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._loaded:  # tiny models only: the float64 copy stays in memory
            self._loaded[name] = self.raw(name).astype(np.float64)
        return self._loaded[name]


# ----------------------------------------------------------------------------- building blocks


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def gemma_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """gemma3:Gemma3RMSNorm: normalise, then scale by (1 + w)."""
    return _rms(x, eps) * (1.0 + w)


def llama_rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """llama:LlamaRMSNorm: normalise, then scale by w."""
    return _rms(x, eps) * w


def activation(name: str, x: np.ndarray) -> np.ndarray:
    """transformers.activations.ACT2FN for the activations these models use."""
    if name == "gelu_pytorch_tanh":  # GELUTanh: torch gelu(approximate="tanh")
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if name == "gelu":  # GELUActivation: exact erf gelu
        return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    raise ValueError(f"activation {name!r} (config key hidden_act / hidden_activation) is not implemented here")


def inv_freq(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """modeling_rope_utils: default, linear and llama3 inverse frequencies for one rope_parameters dict."""
    kind = rope.get("rope_type", "default")
    freq = 1.0 / (float(rope["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if kind == "default":
        return freq
    if kind == "linear":  # _compute_linear_scaling_rope_parameters
        return freq / float(rope["factor"])
    if kind == "llama3":  # _compute_llama3_parameters
        factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        scaled = np.where(wavelen > old_len / low, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} (config key rope_parameters) is not implemented here")


def apply_rope(x: np.ndarray, freq: np.ndarray, start: int = 0) -> np.ndarray:
    """apply_rotary_pos_emb with rotate_half on x of shape (heads, seq, head_dim), positions start.. ."""
    angles = np.arange(start, start + x.shape[1], dtype=np.float64)[:, None] * freq[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, axis=-1)
    sin = np.concatenate([np.sin(angles)] * 2, axis=-1)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scaling: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> np.ndarray:
    """eager_attention_forward with a causal (optionally sliding-window) mask; GQA without copying kv.

    q: (heads, seq, d), the last ``seq`` positions of k, v: (kv_heads, seq_kv, d) (a KV cache holds
    the earlier ones). Query head h reads kv head h // (heads // kv_heads), which is what repeat_kv's
    expand+reshape produces. Returns (seq, heads * d).
    """
    heads, seq, d = q.shape
    kv_heads, seq_kv = k.shape[0], k.shape[1]
    groups = q.reshape(kv_heads, heads // kv_heads, seq, d)
    scores = np.einsum("gnqd,gkd->gnqk", groups, k) * scaling
    if softcap is not None:
        scores = np.tanh(scores / softcap) * softcap
    qi, ki = np.arange(seq_kv - seq, seq_kv)[:, None], np.arange(seq_kv)[None, :]
    allowed = ki <= qi
    if sliding_window is not None:  # masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window
        allowed &= ki > qi - sliding_window
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("gnqk,gkd->gnqd", probs, v).reshape(heads, seq, d)
    return out.transpose(1, 0, 2).reshape(seq, heads * d)


def _linear(x: np.ndarray, w: Weights, name: str) -> np.ndarray:
    """nn.Linear: x @ W.T (+ b when the checkpoint has one)."""
    y = x @ w[f"{name}.weight"].T
    return y + w[f"{name}.bias"] if f"{name}.bias" in w else y


def _heads(x: np.ndarray, d: int) -> np.ndarray:
    """(seq, n*d) -> (n, seq, d)."""
    return x.reshape(x.shape[0], -1, d).transpose(1, 0, 2)


def _mlp(x: np.ndarray, w: Weights, p: str, act: str) -> np.ndarray:
    """Gemma3MLP / LlamaMLP: down(act(gate(x)) * up(x))."""
    return _linear(activation(act, _linear(x, w, f"{p}gate_proj")) * _linear(x, w, f"{p}up_proj"), w, f"{p}down_proj")


# ----------------------------------------------------------------------------- configs


def _config(hf_dir: Path) -> Any:
    from transformers import AutoConfig  # local import: transformers is slow to import

    return AutoConfig.from_pretrained(hf_dir)


def _round(x: np.ndarray | float, dtype: str) -> np.ndarray:
    """x rounded to a (possibly bfloat16) dtype, returned as float64."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return np.asarray(x, dtype=np.float64).astype(np_dtype).astype(np.float64)


def _model_dtype(cfg: Any, stored: np.ndarray) -> str:
    """The dtype transformers builds the model in: config `dtype` (from_pretrained dtype="auto"), else stored."""
    for c in (cfg, getattr(cfg, "text_config", None)):
        dtype = getattr(c, "dtype", None)
        if dtype is not None:
            return str(dtype).removeprefix("torch.")
    return "bfloat16" if stored.dtype == ml_dtypes.bfloat16 else str(stored.dtype)


# ----------------------------------------------------------------------------- models


def _cached(cache: list | None, i: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Layer ``i``'s keys and values so far, with ``k``, ``v`` appended (no cache: just ``k``, ``v``)."""
    if cache is None:
        return k, v
    if len(cache) <= i:
        cache.append((k, v))
    else:
        cache[i] = (np.concatenate([cache[i][0], k], axis=1), np.concatenate([cache[i][1], v], axis=1))
    return cache[i]


def _gemma3(cfg: Any, w: Weights, ids: np.ndarray, match_maxtext: bool, cache: list | None = None,
            start: int = 0) -> np.ndarray:
    text = cfg.text_config if cfg.model_type == "gemma3" else cfg
    if text.use_bidirectional_attention:
        raise ValueError("text_config.use_bidirectional_attention=true is not implemented here")
    prefix = next((p for p in _GEMMA3_PREFIXES if f"{p}embed_tokens.weight" in w), None)
    if prefix is None:
        raise KeyError(f"no Gemma 3 embed_tokens.weight under any of {_GEMMA3_PREFIXES}")
    eps, d = text.rms_norm_eps, text.head_dim

    # gemma3:Gemma3TextScaledWordEmbedding: weight * sqrt(hidden) cast to the weight (model) dtype.
    embed_raw = w.raw(f"{prefix}embed_tokens.weight")
    scale = float(_round(text.hidden_size**0.5, _model_dtype(cfg, embed_raw)))
    embed = embed_raw.astype(np.float64)
    h = embed[ids] * scale

    # gemma3:Gemma3RotaryEmbedding: one rope_parameters entry per layer type.
    freqs = {t: inv_freq(text.rope_parameters[t], d) for t in set(text.layer_types)}
    for i, layer_type in enumerate(text.layer_types[: text.num_hidden_layers]):
        p = f"{prefix}layers.{i}."
        # gemma3:Gemma3Attention
        x = gemma_rmsnorm(h, w[f"{p}input_layernorm.weight"], eps)
        q = gemma_rmsnorm(_heads(_linear(x, w, f"{p}self_attn.q_proj"), d), w[f"{p}self_attn.q_norm.weight"], eps)
        k = gemma_rmsnorm(_heads(_linear(x, w, f"{p}self_attn.k_proj"), d), w[f"{p}self_attn.k_norm.weight"], eps)
        v = _heads(_linear(x, w, f"{p}self_attn.v_proj"), d)
        q, k = apply_rope(q, freqs[layer_type], start), apply_rope(k, freqs[layer_type], start)
        k, v = _cached(cache, i, k, v)
        window = text.sliding_window if layer_type == "sliding_attention" else None
        a = attention(q, k, v, text.query_pre_attn_scalar**-0.5, window, text.attn_logit_softcapping)
        # gemma3:Gemma3DecoderLayer: sandwich norms around attention and MLP
        h = h + gemma_rmsnorm(_linear(a, w, f"{p}self_attn.o_proj"), w[f"{p}post_attention_layernorm.weight"], eps)
        x = _mlp(gemma_rmsnorm(h, w[f"{p}pre_feedforward_layernorm.weight"], eps), w, f"{p}mlp.", text.hidden_activation)
        h = h + gemma_rmsnorm(x, w[f"{p}post_feedforward_layernorm.weight"], eps)
    h = gemma_rmsnorm(h, w[f"{prefix}norm.weight"], eps)

    # Tying follows the top-level config (modeling_utils.get_expanded_tied_weights_keys).
    if cfg.tie_word_embeddings:
        table = _output_table(embed, scale, text.hidden_size) if match_maxtext else embed
    else:
        head = next((n for n in _GEMMA3_LM_HEADS if n in w), None)
        if head is None:
            raise KeyError(f"tie_word_embeddings=false but none of {_GEMMA3_LM_HEADS} is in the checkpoint")
        table = w[head]
    out = h @ table.T
    if text.final_logit_softcapping is not None:  # gemma3:Gemma3ForCausalLM.forward
        out = np.tanh(out / text.final_logit_softcapping) * text.final_logit_softcapping
    return out


def _output_table(embed: np.ndarray, scale: float, hidden: int) -> np.ndarray:
    """The tied output table as MaxText uses it, as float64.

    MaxText stores the Gemma embedding pre-multiplied by bf16(sqrt(hidden)) (checkpoint_conversion/utils/
    param_mapping.py pad_and_scale_embedding), casts the table to bfloat16 for the logits
    (layers/embeddings.py attend_on_embedding) and divides the logits by the exact sqrt(hidden)
    (layers/nnx_decoders.py, normalize_embedding_logits). With hidden a power of 4 this is just bf16(embed).
    """
    return _round(embed * scale, "bfloat16") / math.sqrt(hidden)


def _llama(cfg: Any, w: Weights, ids: np.ndarray, cache: list | None = None, start: int = 0) -> np.ndarray:
    eps = cfg.rms_norm_eps
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads  # llama:LlamaAttention
    freq = inv_freq(cfg.rope_parameters, d)  # llama:LlamaRotaryEmbedding (attention_scaling is 1 for llama3)
    h = w["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        # llama:LlamaDecoderLayer: pre-norm attention and MLP with residuals
        x = llama_rmsnorm(h, w[f"{p}input_layernorm.weight"], eps)
        q = apply_rope(_heads(_linear(x, w, f"{p}self_attn.q_proj"), d), freq, start)
        k = apply_rope(_heads(_linear(x, w, f"{p}self_attn.k_proj"), d), freq, start)
        k, v = _cached(cache, i, k, _heads(_linear(x, w, f"{p}self_attn.v_proj"), d))
        h = h + _linear(attention(q, k, v, d**-0.5), w, f"{p}self_attn.o_proj")
        h = h + _mlp(llama_rmsnorm(h, w[f"{p}post_attention_layernorm.weight"], eps), w, f"{p}mlp.", cfg.hidden_act)
    h = llama_rmsnorm(h, w["model.norm.weight"], eps)
    # llama:LlamaForCausalLM: lm_head, tied to embed_tokens when tie_word_embeddings
    return h @ w["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"].T


class Model:
    """A Gemma 3 or Llama 3.1 Hugging Face directory, loaded once: logits and greedy generation."""

    def __init__(self, hf_dir: str | Path, *, match_maxtext: bool = False) -> None:
        hf_dir = Path(hf_dir)
        self.model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
        if self.model_type not in ("gemma3", "gemma3_text", "llama"):
            raise ValueError(f"{hf_dir}/config.json model_type={self.model_type!r}: only gemma3, gemma3_text and "
                             "llama are supported")
        self.cfg, self.weights, self.match_maxtext = _config(hf_dir), Weights(hf_dir), match_maxtext

    def forward(self, ids: np.ndarray, cache: list | None = None, start: int = 0) -> np.ndarray:
        """Logits of positions start.. for ``ids``; ``cache`` (a list, filled here) holds earlier positions."""
        if self.model_type == "llama":
            return _llama(self.cfg, self.weights, ids, cache, start)
        return _gemma3(self.cfg, self.weights, ids, self.match_maxtext, cache, start)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float64 logits, shape (len(token_ids), vocab), for one sequence."""
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence of ints")
        return self.forward(ids)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of ``prompt_ids`` (at most ``max_new_tokens``, ending at a stop id)."""
        cache: list = []
        out: list[int] = []
        last = self.forward(np.asarray(prompt_ids, dtype=np.int64), cache)[-1]
        for step in range(max_new_tokens):
            token = int(np.argmax(last))
            out.append(token)
            if token in stop_ids:
                break
            last = self.forward(np.asarray([token]), cache, start=len(prompt_ids) + step)[-1]
        return out


def logits(hf_dir: str | Path, token_ids: Sequence[int], *, match_maxtext: bool = False) -> np.ndarray:
    """float64 logits, shape (len(token_ids), vocab), of the HF model in `hf_dir` for one sequence.

    match_maxtext: for a tied Gemma 3, use the output table as MaxText rounds it (`_output_table`).
    """
    return Model(hf_dir, match_maxtext=match_maxtext).logits(token_ids)
