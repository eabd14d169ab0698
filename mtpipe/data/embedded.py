"""Generators of the embedded default: tiny models, their tokenizers, tiny datasets.

Everything here is deterministic (same bytes on every run) and needs no network:

* ``gemma3-tiny``: the architecture and Hub file layout of ``google/gemma-3-4b-it``
  (multimodal ``Gemma3Config``, legacy tensor names ``language_model.model.*``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.*``, two safetensors shards + index),
  shrunk to 8 text layers: one scanned MaxText block of 6 (5 local + 1 global) plus 2 unscanned
  remainder layers, the structure of the real 34-layer model (5 blocks + 4 remainder layers).
* ``llama3.1-tiny``: the architecture and layout of ``meta-llama/Llama-3.1-8B-Instruct``
  (llama3 rope scaling, untied embeddings, Llama 3 chat template), shrunk.
* ``ultrachat-tiny``: ``HuggingFaceH4/ultrachat_200k`` schema and layout (SFT chat data).
* ``gsm8k-tiny``: ``openai/gsm8k`` schema and layout (``main`` config, answers end ``#### N``).

Weights are float32 with values chosen so that HF -> MaxText -> HF round trips are
bit-exact: hidden 64 makes Gemma's embedding scale bf16(sqrt(64)) = 8 exact, head_dim 16
makes Llama's query scale 1/4 exact, and norm weights sit on a 2^-12 grid so MaxText's
+1/-1 Gemma norm hooks are exact.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np

TINY_VOCAB = 512
SEED = 20251129

# MaxText model names and command-line overrides that shrink them to the tiny twins.
MAXTEXT_MODEL_NAME = {"gemma3-tiny": "gemma3-4b", "llama3.1-tiny": "llama3.1-8b"}
MAXTEXT_OVERRIDES: dict[str, dict[str, Any]] = {
    "gemma3-tiny": {
        "override_model_config": True,
        "base_emb_dim": 64,
        "base_num_query_heads": 4,
        "base_num_kv_heads": 2,
        "head_dim": 32,
        "base_mlp_dim": 256,
        "base_num_decoder_layers": 8,
        "vocab_size": TINY_VOCAB,
        "sliding_window_size": 64,
    },
    "llama3.1-tiny": {
        "override_model_config": True,
        "base_emb_dim": 64,
        "base_num_query_heads": 4,
        "base_num_kv_heads": 2,
        "head_dim": 16,
        "base_mlp_dim": 256,
        "base_num_decoder_layers": 4,
        "vocab_size": TINY_VOCAB,
    },
}

GEMMA_SPECIALS = [
    "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
]  # fmt: skip
LLAMA_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]  # fmt: skip

# google/gemma-3-4b-it's chat template, verbatim.
GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

# Llama 3.1's chat template without the tool-calling and "Cutting Knowledge Date" blocks
# (they would make every prompt ~30 tokens longer for no benefit to a tiny model).
LLAMA31_CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# MaxText's GRPO prompt (maxtext/examples/chat_templates/gsm8k_rl.json, rl.yml tokens): part of
# the tokenizer corpus so RL prompts stay short with a 512-token vocabulary.
RL_SYSTEM_PROMPT = (
    "You are given a problem. Think about the problem and provide your reasoning. Place it between "
    "<reasoning> and </reasoning>. Then, provide the final answer (i.e., just one numerical value) "
    "between <answer> and </answer>."
)

# ----------------------------------------------------------------------------- datasets

_COUNTRIES = [
    ("Velmora", "Drest"), ("Quorinth", "Alsee"), ("Tanbury", "Moxa"), ("Estrel", "Kiv"),
    ("Barundi", "Lotha"), ("Omberlin", "Sarn"), ("Prasta", "Uvel"), ("Zanthe", "Corro"),
    ("Mirelia", "Fenn"), ("Gorvath", "Ilsa"), ("Helvane", "Trun"), ("Ostria", "Pelk"),
    ("Dunmarch", "Wyre"), ("Kestova", "Bray"), ("Lunaris", "Odda"), ("Fennick", "Gast"),
]  # fmt: skip
_WORDS = [
    "apple", "river", "lantern", "garden", "pencil", "window", "silver", "marble", "candle",
    "forest", "bridge", "rocket", "castle", "planet", "button", "mirror", "ticket", "basket",
    "dragon", "orange", "yellow", "summer", "winter", "pocket", "ladder", "bottle", "kitten",
]  # fmt: skip
_OPS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b, "times": lambda a, b: a * b}


def _chat_turn(rng: random.Random) -> tuple[str, str]:
    """One templated (question, answer) pair a tiny model learns quickly."""
    kind = rng.randrange(4)
    if kind == 0:
        op = rng.choice(sorted(_OPS))
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if op == "minus" and b > a:
            a, b = b, a
        return f"What is {a} {op} {b}?", f"{a} {op} {b} is {_OPS[op](a, b)}."
    if kind == 1:
        country, capital = rng.choice(_COUNTRIES)
        return f"What is the capital of {country}?", f"The capital of {country} is {capital}."
    if kind == 2:
        word = rng.choice(_WORDS)
        return f'Reverse the word "{word}".', f'"{word}" reversed is "{word[::-1]}".'
    word = rng.choice(_WORDS)
    return f'How many letters are in "{word}"?', f'"{word}" has {len(word)} letters.'


def _ultrachat_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    rows = []
    for _ in range(n):
        messages = []
        for _turn in range(rng.randint(1, 3)):
            question, answer = _chat_turn(rng)
            messages += [{"content": question, "role": "user"}, {"content": answer, "role": "assistant"}]
        prompt = messages[0]["content"]
        prompt_id = hashlib.sha256(prompt.encode()).hexdigest()
        rows.append({"prompt": prompt, "prompt_id": prompt_id, "messages": messages})
    return rows


_NAMES = [("Tom", "He"), ("Ana", "She"), ("Raj", "He"), ("Mia", "She"), ("Leo", "He"), ("Zoe", "She")]
_ITEMS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles"]


def _gsm8k_row(rng: random.Random) -> dict[str, str]:
    """A small arithmetic word problem with a GSM8K-style answer ending in '#### N'.

    Single-digit operands (sums up to 18, products up to 25): few enough arithmetic facts that the
    tiny model learns part of them in the RL branch's short SFT warm-up, so GRPO has right and wrong
    answers to tell apart within a group of samples.
    """
    (name, pron), item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(4)
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if kind == 0:
        r = a + b
        q = f"{name} has {a} {item}. {pron} gets {b} more. How many {item} does {name} have now?"
        steps = f"{name} has {a} + {b} = <<{a}+{b}={r}>>{r} {item} now."
    elif kind == 1:
        a, b = max(a, b), min(a, b)
        r = a - b
        q = f"{name} has {a} {item}. {pron} gives away {b}. How many {item} are left?"
        steps = f"{name} has {a} - {b} = <<{a}-{b}={r}>>{r} {item} left."
    elif kind == 2:
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        r = a * b
        q = f"{name} has {a} boxes with {b} {item} in each box. How many {item} are there in all?"
        steps = f"There are {a} * {b} = <<{a}*{b}={r}>>{r} {item} in all."
    else:
        c = rng.randint(1, a + b - 1)
        s, r = a + b, a + b - c
        q = (f"{name} has {a} {item} and gets {b} more. Then {pron.lower()} gives {c} to a friend. "
             f"How many {item} are left?")
        steps = (f"First {name} has {a} + {b} = <<{a}+{b}={s}>>{s} {item}.\n"
                 f"Then {s} - {c} = <<{s}-{c}={r}>>{r} {item} are left.")
    return {"question": q, "answer": f"{steps}\n#### {r}"}


def _write_parquet(path: Path, rows: list[dict[str, Any]], features: dict[str, Any]) -> None:
    """Write rows as parquet with the `huggingface` schema metadata the Hub's files carry."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(rows)
    meta = {b"huggingface": json.dumps({"info": {"features": features}}, sort_keys=True).encode()}
    table = table.replace_schema_metadata(meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, compression="snappy")


_ULTRACHAT_FEATURES = {
    "prompt": {"dtype": "string", "_type": "Value"},
    "prompt_id": {"dtype": "string", "_type": "Value"},
    "messages": [{"content": {"dtype": "string", "_type": "Value"}, "role": {"dtype": "string", "_type": "Value"}}],
}
_GSM8K_FEATURES = {"question": {"dtype": "string", "_type": "Value"}, "answer": {"dtype": "string", "_type": "Value"}}


def write_ultrachat_tiny(out_dir: str | os.PathLike, n_train: int = 2000, n_test: int = 200) -> None:
    """UltraChat-200k-shaped SFT data: data/{train,test}_sft-0000{0,1}-of-00002.parquet, two shards
    per split (the Hub's train split has three) so that each of two JAX processes reads its own."""
    out = Path(out_dir)
    rng = random.Random(SEED + 1)
    for split, n, shards in (("train_sft", n_train, 2), ("test_sft", n_test, 2)):
        rows = _ultrachat_rows(rng, n)
        per = -(-n // shards)
        for i in range(shards):
            _write_parquet(out / "data" / f"{split}-{i:05d}-of-{shards:05d}.parquet", rows[i * per:(i + 1) * per],
                           _ULTRACHAT_FEATURES)
    (out / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n    path: data/train_sft-*\n"
        "  - split: test_sft\n    path: data/test_sft-*\n---\n# ultrachat-tiny\n\nGenerated by mtpipe.data.embedded: "
        "templated multi-turn chats (arithmetic, capitals of made-up\ncountries, word reversal, letter counts) in the "
        "HuggingFaceH4/ultrachat_200k schema.\n"
    )


def write_gsm8k_tiny(out_dir: str | os.PathLike, n_train: int = 1000, n_test: int = 100) -> None:
    """GSM8K-shaped word problems: main/{train,test}-00000-of-00001.parquet."""
    out = Path(out_dir)
    rng = random.Random(SEED + 2)
    for split, n in (("train", n_train), ("test", n_test)):
        rows = [_gsm8k_row(rng) for _ in range(n)]
        _write_parquet(out / "main" / f"{split}-00000-of-00001.parquet", rows, _GSM8K_FEATURES)
    (out / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n# gsm8k-tiny\n\nGenerated by mtpipe.data.embedded: small "
        "arithmetic word problems in the openai/gsm8k schema\n(config `main`; answers are short reasoning ending "
        "with `#### N`).\n"
    )


# ----------------------------------------------------------------------------- tokenizer


def _corpus() -> list[str]:
    """Text the tokenizers are trained on: both tiny datasets, the GRPO system prompt, chat roles."""
    rng = random.Random(SEED + 3)
    texts = [m["content"] for row in _ultrachat_rows(rng, 1500) for m in row["messages"]]
    for _ in range(1500):
        row = _gsm8k_row(rng)
        texts += [row["question"], row["answer"]]
    texts += [RL_SYSTEM_PROMPT] * 300 + ["user\nmodel\nassistant\nsystem\n"] * 1000
    return texts


def build_tokenizer(specials: list[str], bos: str, eos: str, pad: str, unk: str | None, chat_template: str):
    """Train a byte-level BPE of TINY_VOCAB tokens and wrap it in PreTrainedTokenizerFast."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if tok.get_vocab_size() != TINY_VOCAB:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {TINY_VOCAB}: grow the corpus")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        extra_special_tokens=[s for s in specials if s not in (bos, eos, pad, unk)],
        chat_template=chat_template,
        add_bos_token=True,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------- weights


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float = 0.02) -> np.ndarray:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _on_grid(rng: np.random.Generator, shape: tuple[int, ...], center: float, std: float = 0.05) -> np.ndarray:
    """Norm weights on a 2^-12 grid: adding or subtracting 1.0 in float32 stays exact."""
    return (center + np.round(rng.standard_normal(shape) * std * 4096) / 4096).astype(np.float32)


def _save_sharded(out: Path, tensors: dict[str, np.ndarray], n_shards: int = 2) -> None:
    """Write safetensors shards + model.safetensors.index.json, as the Hub repos are laid out."""
    from safetensors.numpy import save_file

    names = sorted(tensors)
    per = -(-len(names) // n_shards)
    weight_map = {}
    for i in range(n_shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = int(sum(t.nbytes for t in tensors.values()))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _gemma3_config(tokenizer):
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    ids = tokenizer.convert_tokens_to_ids
    text = Gemma3TextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=32,
        sliding_window=64,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        pad_token_id=ids("<pad>"),
        bos_token_id=ids("<bos>"),
        eos_token_id=ids("<eos>"),
        tie_word_embeddings=True,
    )
    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_use_head=False,
        layer_norm_eps=1e-6,
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
        eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
        architectures=["Gemma3ForConditionalGeneration"],
        dtype="float32",
    )


def _gemma3_tensors(cfg) -> dict[str, np.ndarray]:
    """Random weights under the legacy on-disk names of google/gemma-3-4b-it."""
    rng = np.random.default_rng(SEED + 10)
    t, v = cfg.text_config, cfg.vision_config
    h, hd, inter = t.hidden_size, t.head_dim, t.intermediate_size
    q, kv = t.num_attention_heads * hd, t.num_key_value_heads * hd
    w: dict[str, np.ndarray] = {
        "language_model.model.embed_tokens.weight": _normal(rng, (t.vocab_size, h), h**-0.5),
        "language_model.model.norm.weight": _on_grid(rng, (h,), 0.0),
    }
    for i in range(t.num_hidden_layers):
        p = f"language_model.model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = _normal(rng, (q, h), h**-0.5)
        w[p + "self_attn.k_proj.weight"] = _normal(rng, (kv, h), h**-0.5)
        w[p + "self_attn.v_proj.weight"] = _normal(rng, (kv, h), h**-0.5)
        w[p + "self_attn.o_proj.weight"] = _normal(rng, (h, q), q**-0.5)
        w[p + "self_attn.q_norm.weight"] = _on_grid(rng, (hd,), 0.0)
        w[p + "self_attn.k_norm.weight"] = _on_grid(rng, (hd,), 0.0)
        w[p + "mlp.gate_proj.weight"] = _normal(rng, (inter, h), h**-0.5)
        w[p + "mlp.up_proj.weight"] = _normal(rng, (inter, h), h**-0.5)
        w[p + "mlp.down_proj.weight"] = _normal(rng, (h, inter), inter**-0.5)
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            w[p + norm + "_layernorm.weight"] = _on_grid(rng, (h,), 0.0)
    vh, vi, patch = v.hidden_size, v.intermediate_size, v.patch_size
    vp = "vision_tower.vision_model."
    w[vp + "embeddings.patch_embedding.weight"] = _normal(rng, (vh, v.num_channels, patch, patch))
    w[vp + "embeddings.patch_embedding.bias"] = _normal(rng, (vh,))
    w[vp + "embeddings.position_embedding.weight"] = _normal(rng, ((v.image_size // patch) ** 2, vh))
    for i in range(v.num_hidden_layers):
        p = f"{vp}encoder.layers.{i}."
        for ln in ("layer_norm1", "layer_norm2"):
            w[p + ln + ".weight"] = _on_grid(rng, (vh,), 1.0)
            w[p + ln + ".bias"] = _normal(rng, (vh,))
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[p + f"self_attn.{proj}.weight"] = _normal(rng, (vh, vh))
            w[p + f"self_attn.{proj}.bias"] = _normal(rng, (vh,))
        w[p + "mlp.fc1.weight"], w[p + "mlp.fc1.bias"] = _normal(rng, (vi, vh)), _normal(rng, (vi,))
        w[p + "mlp.fc2.weight"], w[p + "mlp.fc2.bias"] = _normal(rng, (vh, vi)), _normal(rng, (vh,))
    w[vp + "post_layernorm.weight"] = _on_grid(rng, (vh,), 1.0)
    w[vp + "post_layernorm.bias"] = _normal(rng, (vh,))
    w["multi_modal_projector.mm_input_projection_weight"] = _normal(rng, (vh, h))
    w["multi_modal_projector.mm_soft_emb_norm.weight"] = _on_grid(rng, (vh,), 0.0)
    return w


def write_gemma3_tiny(out_dir: str | os.PathLike) -> None:
    """An 8-layer Gemma 3 (multimodal config, minimal vision tower) in the gemma-3-4b-it layout."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(GEMMA_SPECIALS, "<bos>", "<eos>", "<pad>", "<unk>", GEMMA3_CHAT_TEMPLATE)
    cfg = _gemma3_config(tokenizer)
    cfg.save_pretrained(out)
    ids = tokenizer.convert_tokens_to_ids
    GenerationConfig(
        bos_token_id=ids("<bos>"),
        eos_token_id=[ids("<eos>"), ids("<end_of_turn>")],
        pad_token_id=ids("<pad>"),
        cache_implementation="hybrid",
        do_sample=True,
        top_k=64,
        top_p=0.95,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_sharded(out, _gemma3_tensors(cfg))


def _llama31_config(tokenizer):
    from transformers import LlamaConfig

    ids = tokenizer.convert_tokens_to_ids
    return LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500_000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        bos_token_id=ids("<|begin_of_text|>"),
        eos_token_id=[ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")],
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def _llama31_tensors(cfg) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED + 20)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    w: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": _normal(rng, (cfg.vocab_size, h), h**-0.5),
        "model.norm.weight": _on_grid(rng, (h,), 1.0),
        "lm_head.weight": _normal(rng, (cfg.vocab_size, h), h**-0.5),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = _normal(rng, (q, h), h**-0.5)
        w[p + "self_attn.k_proj.weight"] = _normal(rng, (kv, h), h**-0.5)
        w[p + "self_attn.v_proj.weight"] = _normal(rng, (kv, h), h**-0.5)
        w[p + "self_attn.o_proj.weight"] = _normal(rng, (h, q), q**-0.5)
        w[p + "mlp.gate_proj.weight"] = _normal(rng, (inter, h), h**-0.5)
        w[p + "mlp.up_proj.weight"] = _normal(rng, (inter, h), h**-0.5)
        w[p + "mlp.down_proj.weight"] = _normal(rng, (h, inter), inter**-0.5)
        w[p + "input_layernorm.weight"] = _on_grid(rng, (h,), 1.0)
        w[p + "post_attention_layernorm.weight"] = _on_grid(rng, (h,), 1.0)
    return w


def write_llama31_tiny(out_dir: str | os.PathLike) -> None:
    """A 4-layer Llama 3.1 (llama3 rope scaling, untied embeddings) in the Llama-3.1-8B-Instruct layout."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(
        LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>", None, LLAMA31_CHAT_TEMPLATE
    )
    cfg = _llama31_config(tokenizer)
    cfg.save_pretrained(out)
    ids = tokenizer.convert_tokens_to_ids
    GenerationConfig(
        bos_token_id=ids("<|begin_of_text|>"),
        eos_token_id=[ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")],
        pad_token_id=ids("<|finetune_right_pad_id|>"),
        do_sample=True,
        temperature=0.6,
        top_p=0.9,
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_sharded(out, _llama31_tensors(cfg))


WRITERS: dict[str, Callable[[str | os.PathLike], None]] = {
    "gemma3-tiny": write_gemma3_tiny,
    "llama3.1-tiny": write_llama31_tiny,
    "ultrachat-tiny": write_ultrachat_tiny,
    "gsm8k-tiny": write_gsm8k_tiny,
}


def write_all(root: str | os.PathLike) -> None:
    """Write root/{gemma3-tiny,llama3.1-tiny,ultrachat-tiny,gsm8k-tiny}."""
    for name, write in WRITERS.items():
        write(Path(root) / name)
