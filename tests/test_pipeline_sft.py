"""The SFT branch on the embedded default, end to end through `dvc repro` and real MaxText."""

import csv
import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from transformers import AutoConfig, AutoTokenizer

from pipeline import dvc, ran_stages

pytestmark = pytest.mark.slow


def test_every_sft_stage_ran_the_real_tool(pipeline_repo):
    log = (pipeline_repo / "work" / "first_repro.log").read_text()
    assert {"configure", "make_embedded", "hf_download@sft", "to_maxtext@sft", "train_sft",
            "to_huggingface@sft"} <= ran_stages(log)
    assert "$ python3 -m maxtext.trainers.post_train.sft.train_sft" in log
    assert (pipeline_repo / "artifacts/sft/maxtext/0/items/manifest.ocdbt").is_file()
    assert (pipeline_repo / "artifacts/sft/trained/model_params").is_dir()


def test_sft_learns(pipeline_repo):
    metrics = json.loads((pipeline_repo / "metrics/sft/train_sft.json").read_text())
    rows = list(csv.DictReader(open(pipeline_repo / "plots/sft/loss.csv")))
    assert len(rows) == metrics["steps"] >= 100
    assert metrics["loss_last5_mean"] < 0.5 * metrics["loss_first5_mean"], metrics
    assert metrics["eval_loss_last"] < metrics["eval_loss_first"], metrics


def test_export_is_a_standard_hf_directory(pipeline_repo):
    hf, src = pipeline_repo / "artifacts/sft/hf", pipeline_repo / "artifacts/sft/model/files"
    got, want = AutoConfig.from_pretrained(hf), AutoConfig.from_pretrained(src)
    assert got.to_dict()["text_config"] == want.to_dict()["text_config"]
    tok = AutoTokenizer.from_pretrained(hf)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<start_of_turn>user" in text
    exported = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    source = {k: v for f in src.glob("*.safetensors") for k, v in load_file(f).items()}
    text_keys = {k for k in source if k.startswith("language_model.")}
    assert set(exported) == text_keys
    assert all(exported[k].shape == source[k].shape for k in text_keys)
    changed = [k for k in text_keys if not np.array_equal(exported[k], source[k])]
    assert len(changed) > 0.9 * len(text_keys), "training changed (almost) every tensor"


def test_dvc_metrics_and_plots_show(pipeline_repo):
    shown = json.loads(dvc(pipeline_repo, "metrics", "show", "--json").stdout)
    flat = json.dumps(shown)
    assert "loss_last" in flat and "wall_s" in flat
    out = pipeline_repo / "work" / "plots"
    dvc(pipeline_repo, "plots", "show", "--out", str(out))
    html = (out / "index.html").read_text()
    assert "loss.csv" in html
