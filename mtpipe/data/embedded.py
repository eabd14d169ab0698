"""Generators of the embedded default: tiny models, their tokenizers, tiny datasets.

Everything here is deterministic (same bytes on every run) and needs no network:

* ``gemma3-tiny``: the architecture and Hub file layout of ``google/gemma-3-4b-it``
  (multimodal ``Gemma3Config``, legacy tensor names ``language_model.model.*``,
  ``vision_tower.vision_model.*``, ``multi_modal_projector.*``, two safetensors shards + index),
  shrunk to 8 text layers: one scanned MaxText block of 6 (5 local + 1 global) plus 2 unscanned
  remainder layers, the structure of the real 34-layer model (5 blocks + 4 remainder layers).
* ``llama3.1-tiny``: the architecture and layout of ``meta-llama/Llama-3.1-8B-Instruct``
  (llama3 rope scaling, untied embeddings, Llama 3 chat template), shrunk.

A twin (``write_twin``) is built from MaxText's own tables for its ``maxtext_name``
(``HF_MODEL_CONFIGS``, ``HF_SHAPE``, ``PARAM_MAPPING`` in ``maxtext.checkpoint_conversion.utils``)
with its sizes, ``maxtext_overrides``: both come from make_embedded's view (``twins``), which
configure copies from conf/model/<name>.yaml, the one place they are written. ``FAMILIES`` holds per
family only what MaxText cannot know (tokenizer, chat template, Hub layout, config fixes).
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
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mtpipe.data import maxtext_tables

TINY_VOCAB = 512
SEED = 20251129

GEMMA_SPECIALS = [
    "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>",
    "<start_of_image>", "<end_of_image>", "<image_soft_token>",
]  # fmt: skip
LLAMA_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
    "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
]  # fmt: skip

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

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

# ChatML as Qwen3 writes it, without its tool-calling and <think> blocks (as the Llama template above).
QWEN3_CHAT_TEMPLATE = """{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
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


def _ultrachat_row(rng: random.Random) -> dict[str, Any]:
    messages = []
    for _turn in range(rng.randint(1, 3)):
        question, answer = _chat_turn(rng)
        messages += [{"content": question, "role": "user"}, {"content": answer, "role": "assistant"}]
    prompt = messages[0]["content"]
    return {"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(), "messages": messages}


def _held_out(draw: Callable[[], dict[str, Any]], n: int, train: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """``n`` rows from ``draw`` whose ``key`` value is in no training row and in no other held-out row:
    a test split that is held out (the templates repeat, so plain draws would overlap the train split)."""
    seen, rows = {repr(row[key]) for row in train}, []
    while len(rows) < n:
        row = draw()
        if repr(row[key]) not in seen:
            seen.add(repr(row[key]))
            rows.append(row)
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
    train = [_ultrachat_row(rng) for _ in range(n_train)]
    test = _held_out(lambda: _ultrachat_row(rng), n_test, train, key="messages")
    for split, rows, shards in (("train_sft", train, 2), ("test_sft", test, 2)):
        per = -(-len(rows) // shards)
        for i in range(shards):
            _write_parquet(out / "data" / f"{split}-{i:05d}-of-{shards:05d}.parquet", rows[i * per:(i + 1) * per],
                           _ULTRACHAT_FEATURES)
    (out / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n    path: data/train_sft-*\n"
        "  - split: test_sft\n    path: data/test_sft-*\n---\n# ultrachat-tiny\n\nGenerated by mtpipe.data.embedded: "
        "templated multi-turn chats (arithmetic, capitals of made-up\ncountries, word reversal, letter counts) in the "
        "HuggingFaceH4/ultrachat_200k schema.\nNo test conversation occurs in the train split.\n"
    )


def write_gsm8k_tiny(out_dir: str | os.PathLike, n_train: int = 1000, n_test: int = 500) -> None:
    """GSM8K-shaped word problems: main/{train,test}-00000-of-00001.parquet. The test split is larger
    than GSM8K's share (500 problems, none in train): enough for a score on all of it to resolve a
    change of a few points; train_rl's eval samples 96 of them."""
    out = Path(out_dir)
    rng = random.Random(SEED + 2)
    train = [_gsm8k_row(rng) for _ in range(n_train)]
    for split, rows in (("train", train), ("test", _held_out(lambda: _gsm8k_row(rng), n_test, train, key="question"))):
        _write_parquet(out / "main" / f"{split}-00000-of-00001.parquet", rows, _GSM8K_FEATURES)
    (out / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n# gsm8k-tiny\n\nGenerated by mtpipe.data.embedded: small "
        "arithmetic word problems in the openai/gsm8k schema\n(config `main`; answers are short reasoning ending "
        "with `#### N`). No test question occurs in the train split.\n"
    )


# ----------------------------------------------------------------------------- tokenizer


def _corpus() -> list[str]:
    """Text the tokenizers are trained on: both tiny datasets, the GRPO system prompt, chat roles."""
    rng = random.Random(SEED + 3)
    texts = [m["content"] for row in [_ultrachat_row(rng) for _ in range(1500)] for m in row["messages"]]
    for _ in range(1500):
        row = _gsm8k_row(rng)
        texts += [row["question"], row["answer"]]
    texts += [RL_SYSTEM_PROMPT] * 300 + ["user\nmodel\nassistant\nsystem\n"] * 1000
    return texts


def build_tokenizer(specials: list[str], bos: str | None, eos: str, pad: str, unk: str | None, chat_template: str):
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
        add_bos_token=bos is not None,
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


@dataclass(frozen=True)
class Family:
    """What MaxText's tables cannot know about a twin: its tokenizer, chat template and Hub layout.

    ``config`` sets dotted keys of config.json over MaxText's table (``text_config.x``): token ids
    (keys ending ``_token_id`` or ``_token_index``, given as tokens) and the settings where the table
    departs from the real model's config.json. ``generation`` is generation_config.json, tokens alike.
    """

    specials: list[str]
    bos: str | None
    eos: str
    pad: str
    unk: str | None
    chat_template: str
    config: dict[str, Any]
    generation: dict[str, Any]
    hub_names: dict[str, str] = field(default_factory=dict)  # MaxText's HF name prefix -> the Hub's
    # Tensors MaxText's PARAM_MAPPING lists for the model that it does not have (a mapping shared by the
    # variants of a decoder, e.g. q_norm/k_norm where the model's MaxText config sets use_qk_norm: false).
    absent: tuple[str, ...] = ()  # parts of a tensor's name: "q_norm" drops model.layers.*.self_attn.q_norm.weight
    rms_norm_center: float = 1.0  # RMSNorm weights' centre: 0 where the model scales by (1 + w)
    seed: int = SEED


FAMILIES: dict[str, Family] = {
    "gemma3-tiny": Family(
        specials=GEMMA_SPECIALS, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        config={
            "text_config.pad_token_id": "<pad>", "text_config.bos_token_id": "<bos>",
            "text_config.eos_token_id": "<eos>", "eos_token_id": ["<eos>", "<end_of_turn>"],
            "boi_token_index": "<start_of_image>", "eoi_token_index": "<end_of_image>",
            "image_token_index": "<image_soft_token>",
            # google/gemma-3-4b-it takes Gemma3TextConfig's defaults here; MaxText's table does not.
            "text_config.hidden_activation": "gelu_pytorch_tanh",
            "text_config.max_position_embeddings": 131072,
            "text_config.rope_parameters.full_attention.rope_theta": 1_000_000.0,
            "text_config.cache_implementation": None,
            "text_config.sliding_window_pattern": None,
            # A minimal vision tower: MaxText trains the text model and copies these tensors as they are.
            "vision_config.hidden_size": 32, "vision_config.intermediate_size": 64,
            "vision_config.num_hidden_layers": 1, "vision_config.num_attention_heads": 2,
            "vision_config.image_size": 28, "mm_tokens_per_image": 4,
        },
        generation={
            "bos_token_id": "<bos>", "eos_token_id": ["<eos>", "<end_of_turn>"], "pad_token_id": "<pad>",
            "cache_implementation": "hybrid", "do_sample": True, "top_k": 64, "top_p": 0.95,
        },
        # google/gemma-3-4b-it keeps the legacy names MaxText's table has renamed.
        hub_names={"model.language_model.": "language_model.model.", "model.vision_tower.": "vision_tower.",
                   "model.multi_modal_projector.": "multi_modal_projector."},
        rms_norm_center=0.0,
        seed=SEED + 10,
    ),
    "llama3.1-tiny": Family(
        specials=LLAMA_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
        unk=None, chat_template=LLAMA31_CHAT_TEMPLATE,
        config={
            "bos_token_id": "<|begin_of_text|>", "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
            "architectures": ["LlamaForCausalLM"],
        },
        generation={
            "bos_token_id": "<|begin_of_text|>", "eos_token_id": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
            "pad_token_id": "<|finetune_right_pad_id|>", "do_sample": True, "temperature": 0.6, "top_p": 0.9,
        },
        seed=SEED + 20,
    ),
    "qwen3-tiny": Family(  # no BOS token; <|endoftext|> pads
        specials=QWEN_SPECIALS, bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        chat_template=QWEN3_CHAT_TEMPLATE,
        config={"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>", "architectures": ["Qwen3ForCausalLM"]},
        generation={
            "bos_token_id": "<|endoftext|>", "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
            "pad_token_id": "<|endoftext|>", "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
        },
        seed=SEED + 30,
    ),
}

# A twin's sizes: MaxText override key (conf/model/<name>-tiny.yaml) -> Hugging Face config key.
SIZE_KEYS = {
    "base_emb_dim": "hidden_size",
    "base_num_query_heads": "num_attention_heads",
    "base_num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "base_mlp_dim": "intermediate_size",
    "base_num_decoder_layers": "num_hidden_layers",
    "vocab_size": "vocab_size",
    "sliding_window_size": "sliding_window",
}


Twin = dict[str, Any]  # a twin's ``maxtext_name`` and ``maxtext_overrides`` (make_embedded's view: ``twins``)


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set a dotted key, or remove it where the value is None (a key the Hub's file does not have)."""
    *parents, key = dotted.split(".")
    for part in parents:
        tree = tree[part]
    if value is None:
        tree.pop(key, None)
    else:
        tree[key] = value


def _resolve_tokens(values: dict[str, Any], tokenizer) -> dict[str, Any]:
    """Token names under ``*_token_id`` / ``*_token_index`` keys replaced by their ids."""
    ids = tokenizer.convert_tokens_to_ids
    out = {}
    for key, value in values.items():
        if key.endswith(("_token_id", "_token_index")) and value is not None:
            value = [ids(v) for v in value] if isinstance(value, list) else ids(value)
        out[key] = value
    return out


def twin_config(name: str, twin: Twin, tokenizer):
    """The twin's Hugging Face config: MaxText's table for its model, its sizes, the family's keys."""
    family = FAMILIES[name]
    table = maxtext_tables.hf_config(twin["maxtext_name"])
    if table is None:
        raise ValueError(f"conf/model/{name}.yaml: MaxText has no Hugging Face config for maxtext_name "
                         f"{twin['maxtext_name']!r}")
    tree = table.to_dict()
    tree.pop("transformers_version", None)
    text = tree.get("text_config", tree)
    text.pop("layer_types", None)  # recomputed from the layer count
    full_head_dim = text.get("head_dim")  # None: the family derives it (Qwen 2), the twin's config sets it
    for key, value in twin["maxtext_overrides"].items():
        if key in SIZE_KEYS:
            text[SIZE_KEYS[key]] = value
        elif key != "override_model_config":
            raise ValueError(f"conf/model/{name}.yaml: maxtext_overrides.{key} has no Hugging Face twin; "
                             f"map it in SIZE_KEYS of mtpipe/data/embedded.py or drop it")
    if full_head_dim is not None and text.get("query_pre_attn_scalar") == full_head_dim:  # follows head_dim
        text["query_pre_attn_scalar"] = text["head_dim"]
    for key, value in _resolve_tokens(family.config, tokenizer).items():
        _set(tree, key, value)
    tree["dtype"] = "float32"
    return type(table).from_dict(tree)


# Parts of the model in the order they draw random values (see _draw_key).
_TOP_ORDER = ["embed_tokens", "norm", "lm_head", "patch_embedding", "position_embedding"]
_LAYER_ORDER = ["layer_norm1", "layer_norm2", "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "q_norm",
                "k_norm", "gate_proj", "up_proj", "down_proj", "fc1", "fc2", "input_layernorm",
                "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]


def _draw_key(name: str) -> tuple:
    """The order tensors draw from the random generator (it fixes the twins' bytes): the language
    model before the vision tower; embeddings and final norm, then layer by layer, then the rest;
    within a layer in _LAYER_ORDER; a weight before its bias."""
    tower = int("vision" in name or "multi_modal" in name)
    layer = re.search(r"\.layers\.(\d+)\.", name)
    part = name.rsplit(".", 2)[-2]
    if layer:
        return tower, 1, int(layer.group(1)), _LAYER_ORDER.index(part), name.endswith(".bias"), name
    if "post_layernorm" in name or "multi_modal_projector" in name:  # a vision tower's output side
        return tower, 2, 0, "multi_modal_projector" in name, name.endswith(".bias"), name
    return tower, 0, 0, _TOP_ORDER.index(part), name.endswith(".bias"), name


def twin_shapes(name: str, twin: Twin, cfg) -> dict[str, tuple[int, ...]]:
    """The tensors MaxText's conversion reads for the twin's model (PARAM_MAPPING), shaped by HF_SHAPE,
    under MaxText's Hugging Face names; a tied output table is not stored."""
    shapes = maxtext_tables.converted_tensors(twin["maxtext_name"], cfg.to_dict())
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return {n: shapes[n] for n in sorted(shapes, key=_draw_key) if n.rsplit(".", 2)[-2] not in FAMILIES[name].absent}


def twin_tensors(name: str, twin: Twin, cfg) -> dict[str, np.ndarray]:
    """Random float32 weights under the Hub's names: linear maps with std 1/sqrt(fan-in) (0.02 in a
    vision tower), RMSNorm weights on a grid around the family's centre, LayerNorm weights around 1."""
    family = FAMILIES[name]
    rng = np.random.default_rng(family.seed)
    shapes = twin_shapes(name, twin, cfg)
    w = {}
    for n, shape in shapes.items():
        vision = "vision" in n or "multi_modal" in n
        if "norm" in n and n.endswith(".weight"):
            layer_norm = n.removesuffix(".weight") + ".bias" in shapes
            w[n] = _on_grid(rng, shape, 1.0 if layer_norm else family.rms_norm_center)
        else:
            w[n] = _normal(rng, shape, 0.02 if vision or n.endswith(".bias") else shape[-1] ** -0.5)
    for old, new in family.hub_names.items():
        w = {new + n.removeprefix(old) if n.startswith(old) else n: t for n, t in w.items()}
    return w


def write_twin(name: str, twin: Twin, out_dir: str | os.PathLike) -> None:
    """The tiny twin ``name`` of ``twin["maxtext_name"]``: config, generation config, tokenizer, sharded
    safetensors, laid out as the real model on the Hub."""
    from transformers import GenerationConfig

    family = FAMILIES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family.specials, family.bos, family.eos, family.pad, family.unk, family.chat_template)
    cfg = twin_config(name, twin, tokenizer)
    if cfg.get_text_config().vocab_size != len(tokenizer):
        raise ValueError(f"conf/model/{name}.yaml: maxtext_overrides.vocab_size must be {len(tokenizer)}, "
                         f"the tiny tokenizer's size (TINY_VOCAB in mtpipe/data/embedded.py)")
    cfg.save_pretrained(out)
    GenerationConfig(**_resolve_tokens(family.generation, tokenizer)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    _save_sharded(out, twin_tensors(name, twin, cfg))


# The data sets make_embedded writes under embedded/, after the twins.
DATASETS: dict[str, Callable[[str | os.PathLike], None]] = {
    "ultrachat-tiny": write_ultrachat_tiny,
    "gsm8k-tiny": write_gsm8k_tiny,
}


def write_all(root: str | os.PathLike, twins: dict[str, Twin]) -> None:
    """Write root/<name> for every twin of ``twins`` (make_embedded's view: one per family of
    :data:`FAMILIES`), then for every data set of :data:`DATASETS`."""
    for name, twin in twins.items():
        write_twin(name, twin, Path(root) / name)
    for name, write in DATASETS.items():
        write(Path(root) / name)
