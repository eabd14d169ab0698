"""An independent float64 numpy forward pass of Gemma 3 (text), Llama 3.x and Qwen 3 Hugging Face checkpoints.

It reads `config.json` with transformers' own config classes (no torch needed), so defaults and legacy
keys (`rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`) mean exactly what they mean to
transformers, and `*.safetensors` with the numpy backend. The math re-implements transformers 5.12
`models/gemma3/modeling_gemma3.py` and `models/llama/modeling_llama.py` (cited below as gemma3:<class>
and llama:<class>) in float64, so it serves as the ground truth an exported directory is checked against.
One decoder serves every family: what a family's modeling file fixes in code is an :class:`Architecture`
in :data:`ARCHITECTURES` (norm offset, scaled embedding, q/k norms, sandwich norms, tensor names); the
rest is read from the config (rope type and scaling per layer type, sliding window, activation,
softcapping, tied output table). :func:`unsupported` says why a config cannot be served.

    logits(hf_dir, token_ids) -> np.ndarray of shape (len(token_ids), vocab_size)
    Model(hf_dir).generate(prompt_ids, max_new_tokens, stop_ids)  # greedy, with a KV cache

The tests use it as the ground truth; the evaluate stage serves exported models with it on the CPU
(mtpipe/evaluation/server.py). The KV cache changes no number: a cached step computes exactly what the
full forward computes for that position (tests/evaluation/test_evaluate.py compares them:
test_cached_decoding_is_greedy_decoding_of_the_full_forward).

`match_maxtext=True` adds the one deliberate rounding MaxText applies and transformers does not (see
`_output_table`), so MaxText's float32 forward can be compared with a tight tolerance.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ml_dtypes  # also registers bfloat16 with numpy, so safetensors can read BF16 tensors
import numpy as np
from safetensors import safe_open
from scipy.special import erf

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


ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu")  # what activation implements


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


# ----------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Architecture:
    """What a family's transformers modeling file fixes in code; everything else is read from config.json.

    A Llama-like family is one entry of :data:`ARCHITECTURES` (Qwen 3 is Llama with q/k norms); a family
    whose layers compute something else (mixture of experts, another attention) needs forward code here.
    """

    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): 1 in gemma3:Gemma3RMSNorm, 0 in llama:LlamaRMSNorm
    scaled_embedding: bool = False  # gemma3:Gemma3TextScaledWordEmbedding: embeddings times sqrt(hidden)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rope (gemma3:, qwen3:Qwen3Attention)
    sandwich_norms: bool = False  # gemma3:Gemma3DecoderLayer: norms after attention and MLP too
    prefixes: tuple[str, ...] = ("model.",)  # where the language model's tensors live (first match wins)
    lm_heads: tuple[str, ...] = ("lm_head.weight",)  # an untied output table, first match wins


_LLAMA = Architecture()
_GEMMA3 = Architecture(
    norm_offset=1.0, scaled_embedding=True, qk_norm=True, sandwich_norms=True,
    prefixes=(
        "language_model.model.",  # Hub on-disk layout of Gemma3ForConditionalGeneration (google/gemma-3-4b-it)
        "model.language_model.",  # transformers 5 in-memory names (what MaxText's to_huggingface writes)
        "model.",  # text-only Gemma3ForCausalLM
    ),
    lm_heads=("language_model.lm_head.weight", "lm_head.weight"),
)  # fmt: skip

# The families this forward serves, by config.json `model_type`. A new Llama-like family is one line here.
ARCHITECTURES: dict[str, Architecture] = {
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    "llama": _LLAMA,
    "qwen3": replace(_LLAMA, qk_norm=True),  # qwen3:Qwen3Attention: q_norm/k_norm (Qwen3RMSNorm: w) on head_dim
}
ROPE_TYPES = ("default", "linear", "llama3")  # what inv_freq implements
LAYER_TYPES = ("full_attention", "sliding_attention")


def _text(cfg: Any) -> Any:
    """The language model's config: `text_config` of a multimodal config, else the config itself."""
    return getattr(cfg, "text_config", None) or cfg


def _activation_name(text: Any) -> str:
    return getattr(text, "hidden_activation", None) or text.hidden_act  # gemma3 spells it hidden_activation


def _layer_types(text: Any) -> list[str]:
    """Each layer's attention kind (configs without `layer_types` have global layers only)."""
    return list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)


def _rope_parameters(text: Any, layer_type: str) -> dict[str, Any]:
    """One layer type's rope_parameters (gemma3 keys them by layer type; others have one for all layers)."""
    rope = text.rope_parameters
    return rope[layer_type] if layer_type in rope else rope


def unsupported(cfg: Any) -> list[str]:
    """Why this forward cannot serve a transformers config (its config.json keys); empty if it can."""
    if cfg.model_type not in ARCHITECTURES:
        return [f"model_type={cfg.model_type!r}: only {', '.join(sorted(ARCHITECTURES))} are supported"]
    text = _text(cfg)
    problems = []
    if getattr(text, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=true is not implemented here")
    if getattr(text, "sliding_window", None) and not getattr(text, "layer_types", None):
        problems.append(f"sliding_window={text.sliding_window} without layer_types is not implemented here")
    for layer_type in dict.fromkeys(_layer_types(text)):
        if layer_type not in LAYER_TYPES:
            problems.append(f"layer_types entry {layer_type!r} is not implemented here (only {', '.join(LAYER_TYPES)})")
        elif (kind := _rope_parameters(text, layer_type).get("rope_type", "default")) not in ROPE_TYPES:
            problems.append(f"rope_type {kind!r} is not implemented here (only {', '.join(ROPE_TYPES)})")
    if (act := _activation_name(text)) not in ACTIVATIONS:
        problems.append(f"activation {act!r} is not implemented here (only {', '.join(ACTIVATIONS)})")
    return problems


def _forward(cfg: Any, arch: Architecture, w: Weights, ids: np.ndarray, match_maxtext: bool,
             cache: list | None = None, start: int = 0) -> np.ndarray:
    """The decoder of gemma3:Gemma3ForCausalLM / llama:LlamaForCausalLM, switched by ``arch`` and the config."""
    text = _text(cfg)
    prefix = next((p for p in arch.prefixes if f"{p}embed_tokens.weight" in w), None)
    if prefix is None:
        raise KeyError(f"no embed_tokens.weight under any of {arch.prefixes}")
    eps, offset = text.rms_norm_eps, arch.norm_offset
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads  # llama:LlamaAttention

    def norm(x: np.ndarray, name: str) -> np.ndarray:  # gemma3:Gemma3RMSNorm (1 + w) / llama:LlamaRMSNorm (w)
        return _rms(x, eps) * (offset + w[name])

    embed_raw = w.raw(f"{prefix}embed_tokens.weight")
    embed = embed_raw.astype(np.float64)
    # gemma3:Gemma3TextScaledWordEmbedding: weight * sqrt(hidden) cast to the weight (model) dtype.
    scale = float(_round(text.hidden_size**0.5, _model_dtype(cfg, embed_raw))) if arch.scaled_embedding else 1.0
    h = embed[ids] * scale if arch.scaled_embedding else embed[ids]

    layer_types = _layer_types(text)
    # gemma3:Gemma3RotaryEmbedding / llama:LlamaRotaryEmbedding (attention_scaling is 1 for these rope types)
    freqs = {t: inv_freq(_rope_parameters(text, t), d) for t in set(layer_types)}
    scaling = (getattr(text, "query_pre_attn_scalar", None) or d) ** -0.5
    softcap = getattr(text, "attn_logit_softcapping", None)
    act = _activation_name(text)
    for i, layer_type in enumerate(layer_types[: text.num_hidden_layers]):
        p = f"{prefix}layers.{i}."
        x = norm(h, f"{p}input_layernorm.weight")
        q = _heads(_linear(x, w, f"{p}self_attn.q_proj"), d)
        k = _heads(_linear(x, w, f"{p}self_attn.k_proj"), d)
        if arch.qk_norm:
            q, k = norm(q, f"{p}self_attn.q_norm.weight"), norm(k, f"{p}self_attn.k_norm.weight")
        q, k = apply_rope(q, freqs[layer_type], start), apply_rope(k, freqs[layer_type], start)
        k, v = _cached(cache, i, k, _heads(_linear(x, w, f"{p}self_attn.v_proj"), d))
        window = text.sliding_window if layer_type == "sliding_attention" else None
        a = _linear(attention(q, k, v, scaling, window, softcap), w, f"{p}self_attn.o_proj")
        if arch.sandwich_norms:  # gemma3:Gemma3DecoderLayer: sandwich norms around attention and MLP
            h = h + norm(a, f"{p}post_attention_layernorm.weight")
            x = _mlp(norm(h, f"{p}pre_feedforward_layernorm.weight"), w, f"{p}mlp.", act)
            h = h + norm(x, f"{p}post_feedforward_layernorm.weight")
        else:  # llama:LlamaDecoderLayer: pre-norm attention and MLP with residuals
            h = h + a
            h = h + _mlp(norm(h, f"{p}post_attention_layernorm.weight"), w, f"{p}mlp.", act)
    h = norm(h, f"{prefix}norm.weight")

    # Tying follows the top-level config (modeling_utils.get_expanded_tied_weights_keys).
    if cfg.tie_word_embeddings:
        table = _output_table(embed, scale, text.hidden_size, arch.scaled_embedding) if match_maxtext else embed
    else:
        head = next((n for n in arch.lm_heads if n in w), None)
        if head is None:
            raise KeyError(f"tie_word_embeddings=false but none of {arch.lm_heads} is in the checkpoint")
        table = w[head]
    out = h @ table.T
    if (cap := getattr(text, "final_logit_softcapping", None)) is not None:  # gemma3:Gemma3ForCausalLM.forward
        out = np.tanh(out / cap) * cap
    return out


def _output_table(embed: np.ndarray, scale: float, hidden: int, scaled_embedding: bool) -> np.ndarray:
    """A tied output table as MaxText uses it, as float64.

    MaxText casts any tied table to bfloat16 for the logits (layers/embeddings.py attend_on_embedding).
    For Gemma it stores the embedding pre-multiplied by bf16(sqrt(hidden)) (checkpoint_conversion/utils/
    param_mapping.py pad_and_scale_embedding) and divides the logits by the exact sqrt(hidden)
    (layers/nnx_decoders.py, normalize_embedding_logits); with hidden a power of 4 this is just bf16(embed).
    Other families (Qwen 3, Llama 3.2) set normalize_embedding_logits: false: bf16(embed).
    """
    if scaled_embedding:
        return _round(embed * scale, "bfloat16") / math.sqrt(hidden)
    return _round(embed, "bfloat16")


class Model:
    """A Hugging Face directory of a family in :data:`ARCHITECTURES`, loaded once: logits and greedy generation."""

    def __init__(self, hf_dir: str | Path, *, match_maxtext: bool = False) -> None:
        hf_dir = Path(hf_dir)
        model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
        if model_type not in ARCHITECTURES:  # before transformers is asked to read an unknown config
            raise ValueError(f"{hf_dir}/config.json model_type={model_type!r}: only "
                             f"{', '.join(sorted(ARCHITECTURES))} are supported")
        self.cfg = _config(hf_dir)
        if problems := unsupported(self.cfg):
            raise ValueError(f"{hf_dir}/config.json: {'; '.join(problems)}")
        self.arch, self.weights, self.match_maxtext = ARCHITECTURES[model_type], Weights(hf_dir), match_maxtext

    def forward(self, ids: np.ndarray, cache: list | None = None, start: int = 0) -> np.ndarray:
        """Logits of positions start.. for ``ids``; ``cache`` (a list, filled here) holds earlier positions."""
        return _forward(self.cfg, self.arch, self.weights, ids, self.match_maxtext, cache, start)

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

    match_maxtext: for a tied output table, use it as MaxText rounds it (`_output_table`).
    """
    return Model(hf_dir, match_maxtext=match_maxtext).logits(token_ids)
