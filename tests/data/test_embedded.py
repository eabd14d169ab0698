"""The embedded default: deterministic, real Hub layouts, learnable data, working tokenizers."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from families import TWINS, twins
from mtpipe.data import embedded
from mtpipe.pipeline import config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def emb(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("embedded")
    embedded.write_all(root, config.twin_confs(embedded.FAMILIES))
    return root


def _load(emb: Path, name: str, *config: str):
    """A generated dataset through datasets, with a cache of this session's own: datasets names the
    cache of a local dataset directory by its README, not its files' contents, so a shared cache
    would serve the data an earlier version generated."""
    import datasets

    return datasets.load_dataset(str(emb / name), *config, cache_dir=str(emb.parent / "datasets-cache"))


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _tensors(model_dir: Path) -> dict[str, np.ndarray]:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(index.values())):
        out.update(load_file(str(model_dir / shard)))
    assert set(out) == set(index), "index and shards disagree"
    return out


def test_generators_are_deterministic(emb, tmp_path):
    embedded.write_all(tmp_path, config.twin_confs(embedded.FAMILIES))
    first, second = _hashes(emb), _hashes(tmp_path)
    assert len(first) >= 20
    assert first == second


def test_make_embedded_stage_is_atomic(tmp_path):
    out = tmp_path / "embedded"
    stale = tmp_path / "embedded.partial"
    stale.mkdir()
    (stale / "junk").write_text("left by an interrupted run")
    subprocess.run([sys.executable, "-m", "stages.make_embedded", str(out)], check=True, cwd=ROOT)
    assert sorted(p.name for p in out.iterdir()) == sorted([*embedded.FAMILIES, *embedded.DATASETS])
    assert not stale.exists()


def test_gemma3_tiny_has_the_gemma_3_4b_it_layout(emb):
    from transformers import AutoConfig

    d = emb / "gemma3-tiny"
    cfg = AutoConfig.from_pretrained(d)
    assert type(cfg).__name__ == "Gemma3Config" and cfg.architectures == ["Gemma3ForConditionalGeneration"]
    t = cfg.text_config
    # One scanned MaxText block (5 local + 1 global) and 2 remainder layers, like the real 34 (5 x 6 + 4).
    assert t.num_hidden_layers == 8
    assert t.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert t.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert t.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert (t.hidden_activation, t.query_pre_attn_scalar, t.sliding_window) == ("gelu_pytorch_tanh", t.head_dim, 64)
    assert cfg.tie_word_embeddings and t.vocab_size == embedded.TINY_VOCAB
    w = _tensors(d)
    assert not any(n.startswith(("model.", "lm_head")) for n in w)
    assert {n.split(".")[0] for n in w} == {"language_model", "vision_tower", "multi_modal_projector"}
    assert w["language_model.model.embed_tokens.weight"].shape == (t.vocab_size, t.hidden_size)
    assert w["language_model.model.layers.7.self_attn.k_norm.weight"].shape == (t.head_dim,)
    assert not any(n.startswith("language_model.model.layers.8.") for n in w)
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.out_proj.bias" in w
    assert all(a.dtype == np.float32 for a in w.values())
    norms = [a for n, a in w.items() if n.startswith("language_model") and re.search(r"norm\.weight$", n)]
    assert len(norms) == 8 * 6 + 1 and all(np.array_equal(a * 4096, np.round(a * 4096)) for a in norms)
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 5]  # <eos>, <end_of_turn>


def test_llama31_tiny_has_the_llama_3_1_layout(emb):
    from transformers import AutoConfig

    d = emb / "llama3.1-tiny"
    cfg = AutoConfig.from_pretrained(d)
    assert type(cfg).__name__ == "LlamaConfig" and not cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.rope_parameters["rope_theta"] == 5e5
    w = _tensors(d)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(w)
    assert len([n for n in w if n.startswith("model.layers.")]) == 9 * cfg.num_hidden_layers


@pytest.mark.families
@pytest.mark.parametrize("name", TWINS)
def test_maxtext_overrides_match_the_config(emb, name):
    """conf/model/<name>.yaml's shrunk dims are the written twin's."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(emb / name)
    t = getattr(cfg, "text_config", cfg)
    o = twins()[name].overrides
    assert o["override_model_config"] is True
    assert (o["base_emb_dim"], o["base_mlp_dim"], o["head_dim"]) == (t.hidden_size, t.intermediate_size, t.head_dim)
    assert (o["base_num_query_heads"], o["base_num_kv_heads"]) == (t.num_attention_heads, t.num_key_value_heads)
    assert (o["base_num_decoder_layers"], o["vocab_size"]) == (t.num_hidden_layers, t.vocab_size)
    assert o.get("sliding_window_size", 0) == (getattr(t, "sliding_window", None) or 0)


def test_ultrachat_tiny_schema_and_structure(emb):
    ds = _load(emb, "ultrachat-tiny")
    assert set(ds) == {"train_sft", "test_sft"} and 1000 <= ds["train_sft"].num_rows <= 5000
    feats = ds["train_sft"].features
    assert list(feats) == ["prompt", "prompt_id", "messages"]
    assert set(feats["messages"].feature) == {"content", "role"}
    turns = 0
    for row in ds["train_sft"]:
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        assert row["prompt"] == row["messages"][0]["content"]
        assert row["prompt_id"] == hashlib.sha256(row["prompt"].encode()).hexdigest()
        turns = max(turns, len(roles) // 2)
    assert turns >= 2  # multi-turn


def test_gsm8k_tiny_schema_and_answers(emb):
    ds = _load(emb, "gsm8k-tiny", "main")
    assert set(ds) == {"train", "test"} and list(ds["train"].features) == ["question", "answer"]
    for row in list(ds["train"]) + list(ds["test"]):
        reasoning, final = row["answer"].rsplit("\n#### ", 1)
        calcs = re.findall(r"<<([0-9+\-*]+)=(\d+)>>", reasoning)
        assert calcs and all(eval(expr) == int(res) for expr, res in calcs)  # noqa: S307 (digits and + - * only)
        assert int(final) == int(calcs[-1][1])


@pytest.mark.scores
def test_no_held_out_question_or_conversation_occurs_in_training(emb):
    """The generated test splits are held out: no GSM8K question and no UltraChat conversation of a
    test split is in its train split (or twice in the test split), read back with datasets."""
    gsm8k, chats = _load(emb, "gsm8k-tiny", "main"), _load(emb, "ultrachat-tiny")
    for train, test in ((gsm8k["train"]["question"], gsm8k["test"]["question"]),
                        ([json.dumps(c) for c in chats["train_sft"]["messages"]],
                         [json.dumps(c) for c in chats["test_sft"]["messages"]])):
        assert len(test) >= 100 and len(set(test)) == len(test)
        assert not set(test) & set(train)


@pytest.mark.scores
def test_split_overlap_counts_held_out_rows_found_in_training(tmp_path):
    """hf_download's count: held-out rows equal to a training row, compared whole (every turn of a
    conversation), duplicates within the held-out split each counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mtpipe.data.datasets_check import split_overlap

    def turns(*texts):
        return [{"role": role, "content": text} for text in texts for role in ("user", "assistant")]

    pq.write_table(pa.table({"messages": [turns("a"), turns("a", "b")], "question": ["q1", "q2"]}), tmp_path / "train.parquet")
    pq.write_table(pa.table({"messages": [turns("a", "b"), turns("b"), turns("a", "b")], "question": ["q2", "q3", "q1"]}),
                   tmp_path / "test.parquet")
    files = [tmp_path / "train.parquet"], [tmp_path / "test.parquet"]
    assert split_overlap(*files, "messages") == {"eval_rows": 3, "eval_rows_in_train": 2}
    assert split_overlap(*files, "question") == {"eval_rows": 3, "eval_rows_in_train": 2}


@pytest.mark.scores
def test_a_split_glob_that_matches_nothing_names_its_key_and_the_fix(tmp_path):
    """hf_download (train and held-out files) and the evaluate stages find a split's files the same way."""
    from types import SimpleNamespace

    from mtpipe.data.datasets_check import dataset_files
    from mtpipe.errors import ConfigError

    (tmp_path / "files" / "main").mkdir(parents=True)
    (tmp_path / "files" / "main" / "train-0.parquet").write_bytes(b"")
    cfg = SimpleNamespace(dataset=SimpleNamespace(name="gsm8k-tiny", train_files="main/train-*.parquet",
                                                  eval_files="main/test-*.parquet"))
    assert dataset_files(cfg, tmp_path, "train_files") == [tmp_path / "files" / "main" / "train-0.parquet"]
    with pytest.raises(ConfigError, match=r"dataset\.eval_files.*'main/test-\*\.parquet'.*conf/dataset/gsm8k-tiny\.yaml"):
        dataset_files(cfg, tmp_path, "eval_files")


# The real models' templates rendered (a twin carries its family's template verbatim); a new family's
# twin gets the checks below without one.
CHAT_RENDERED = {
    "gemma3-tiny": "<bos><start_of_turn>user\nWhat is 2 plus 3?<end_of_turn>\n<start_of_turn>model\n"
                   "2 plus 3 is 5.<end_of_turn>\n<start_of_turn>user\nThanks<end_of_turn>\n<start_of_turn>model\n",
    "llama3.1-tiny": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 2 plus 3?<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\n2 plus 3 is 5.<|eot_id|>"
                     "<|start_header_id|>user<|end_header_id|>\n\nThanks<|eot_id|>"
                     "<|start_header_id|>assistant<|end_header_id|>\n\n",
}  # fmt: skip


@pytest.mark.families
@pytest.mark.parametrize("name", TWINS)
def test_tokenizer_chat_template_and_round_trip(emb, name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(emb / name)
    assert len(tok) == twins()[name].overrides["vocab_size"] and tok.pad_token_id is not None
    chat = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == CHAT_RENDERED.get(name, text)
    at = 0
    for turn in chat:  # every turn's content, in order, and a generation prompt after the last
        at = text.index(turn["content"], at) + len(turn["content"])
    assert len(text) > at
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 2  # the trained merges compress the chat format
    plain = 'Reverse the word "lantern". Ana has 12 coins.\n#### 7 é'
    assert tok.decode(tok(plain, add_special_tokens=False)["input_ids"]) == plain
    # A BOS token (Gemma, Llama) starts every encoding; a tokenizer without one (Qwen 3) adds nothing in front.
    with_specials, without = tok(plain)["input_ids"], tok(plain, add_special_tokens=False)["input_ids"]
    if tok.bos_token_id is None:
        assert with_specials[: len(without)] == without
    else:
        assert with_specials[0] == tok.bos_token_id and with_specials[1 : len(without) + 1] == without


@pytest.mark.families
@pytest.mark.parametrize("name", TWINS)
def test_maxtext_sft_masking_finds_completions(emb, name):
    """MaxText's SFT splits each turn into prompt/completion with the template; it must find the split."""
    from transformers import AutoTokenizer

    from maxtext.input_pipeline.input_pipeline_utils import apply_chat_template

    tok = AutoTokenizer.from_pretrained(emb / name, add_bos_token=False, add_eos_token=False)
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."}] * 2
    out = apply_chat_template({"messages": msgs}, tok, "messages")
    assert out["is_prompt"] == [True, False, True, False]
    assert out["messages"][1].startswith("2 plus 3 is 5.")
