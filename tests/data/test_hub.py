"""mtpipe.data.hub against a Hub-compatible server on 127.0.0.1, and mtpipe.data.datasets_check."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub import HfApi, constants, snapshot_download
from safetensors.numpy import load_file, save

from mtpipe.data.datasets_check import check_chat_rows, check_gsm8k_rows
from mtpipe.errors import ConfigError
from mtpipe.data.hub import fetch_dataset, fetch_model
from fakes.hf_server import HubServer, publish

TOKEN = "hf_test_secret_0123456789"
CHAT_OK = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def safetensors_bytes(value: float) -> bytes:
    return save({"model.embed_tokens.weight": np.full((4, 8), value, dtype=np.float32)})


def parquet_bytes(columns: dict[str, list]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue().to_pybytes()


def model_files(version: int) -> dict[str, bytes]:
    return {
        "config.json": json.dumps({"version": version}).encode(),
        "model.safetensors": safetensors_bytes(float(version)),
        "tokenizer.json": b'{"model": {}}',
        "tokenizer_config.json": b"{}",
        "chat_template.jinja": b"{{ messages }}",
        "README.md": b"# card",
        "pytorch_model.bin": b"\0" * 64,
        "original/consolidated.00.pth": b"\0" * 64,
    }


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A HubServer over an empty repo directory; HF_ENDPOINT points at it, HF_TOKEN is unset."""
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)  # no agent-registry request
    with HubServer(tmp_path / "hub") as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def hub_source(repo_id: str, revision: str, **extra) -> dict:
    return {"kind": "hub", "repo_id": repo_id, "revision": revision, **extra}


def test_model_pinned_revisions_give_their_own_content(hub: HubServer, tmp_path: Path) -> None:
    rev1 = publish(hub.root, "org/tiny", model_files(1))
    rev2 = publish(hub.root, "org/tiny", model_files(2))  # main now points here
    assert rev1 != rev2

    manifest = fetch_model(hub_source("org/tiny", rev1), tmp_path / "v1")
    fetch_model(hub_source("org/tiny", rev2), tmp_path / "v2")

    assert json.loads((tmp_path / "v1/config.json").read_text()) == {"version": 1}
    assert json.loads((tmp_path / "v2/config.json").read_text()) == {"version": 2}
    assert load_file(tmp_path / "v1/model.safetensors")["model.embed_tokens.weight"][0, 0] == 1.0
    assert load_file(tmp_path / "v2/model.safetensors")["model.embed_tokens.weight"][0, 0] == 2.0
    # default patterns: config, safetensors, tokenizer files, templates; no card, no torch weights
    got = sorted(p.relative_to(tmp_path / "v1").as_posix() for p in (tmp_path / "v1").rglob("*"))
    assert got == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert not (tmp_path / "v1.partial").exists()
    assert manifest["revision"] == rev1 and manifest["repo_id"] == "org/tiny"
    entry = next(f for f in manifest["files"] if f["path"] == "model.safetensors")
    data = (tmp_path / "v1/model.safetensors").read_bytes()
    assert entry["size"] == len(data)
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert all(r.path.split("?")[0].split("/")[-1] != "README.md" for r in hub.requests)


def test_allow_patterns_override_defaults(hub: HubServer, tmp_path: Path) -> None:
    rev = publish(hub.root, "org/tiny", model_files(1))
    manifest = fetch_model(hub_source("org/tiny", rev, allow_patterns=["config.json"]), tmp_path / "m")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["config.json"]
    assert [f["path"] for f in manifest["files"]] == ["config.json"]


def test_patterns_matching_nothing_fail_before_download(hub: HubServer, tmp_path: Path) -> None:
    rev = publish(hub.root, "org/tiny", model_files(1))
    with pytest.raises(ConfigError, match=r"^model.source.allow_patterns: no file of org/tiny"):
        fetch_model(hub_source("org/tiny", rev, allow_patterns=["*.gguf"]), tmp_path / "m")
    assert not (tmp_path / "m").exists()
    assert not any("/resolve/" in r.path for r in hub.requests)


def test_dataset_fetches_only_the_split_files(hub: HubServer, tmp_path: Path) -> None:
    train = parquet_bytes({"prompt": ["p0", "p1"], "messages": [CHAT_OK, CHAT_OK]})
    rev = publish(
        hub.root,
        "org/chat",
        {
            "data/train_sft-00000-of-00001.parquet": train,
            "data/test_sft-00000-of-00001.parquet": parquet_bytes({"messages": [CHAT_OK]}),
            "data/train_gen-00000-of-00001.parquet": parquet_bytes({"messages": [CHAT_OK]}),
            "README.md": b"# card",
        },
        repo_type="dataset",
    )
    manifest = fetch_dataset(hub_source("org/chat", rev, splits=["train_sft"]), tmp_path / "ds")

    assert [f["path"] for f in manifest["files"]] == ["data/train_sft-00000-of-00001.parquet"]
    assert (tmp_path / "ds/data/train_sft-00000-of-00001.parquet").read_bytes() == train
    assert not (tmp_path / "ds/.cache").exists()
    assert any(r.path.startswith("/datasets/org/chat/resolve/") for r in hub.requests)
    assert check_chat_rows([tmp_path / "ds/data/train_sft-00000-of-00001.parquet"]) == 2


def test_dataset_subset_selects_one_config_directory(hub: HubServer, tmp_path: Path) -> None:
    rows = {"question": ["1+1?"], "answer": ["2\n#### 2"]}
    rev = publish(
        hub.root,
        "org/math",
        {
            f"{cfg}/{split}-00000-of-00001.parquet": parquet_bytes(rows)
            for cfg in ("main", "socratic")
            for split in ("train", "test")
        },
        repo_type="dataset",
    )
    manifest = fetch_dataset(hub_source("org/math", rev, subset="main", splits=["train", "test"]), tmp_path / "ds")
    assert [f["path"] for f in manifest["files"]] == [
        "main/test-00000-of-00001.parquet",
        "main/train-00000-of-00001.parquet",
    ]


def test_dataset_without_splits_or_patterns_is_rejected(hub: HubServer, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^dataset.source.splits: .*Fix: set splits"):
        fetch_dataset(hub_source("org/chat", "a" * 40), tmp_path / "ds")
    assert hub.requests == []


def test_gated_repo_needs_hf_token(
    hub: HubServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, capfd
) -> None:
    rev = publish(hub.root, "org/gated", model_files(1))
    hub.gated["org/gated"] = TOKEN

    with pytest.raises(ConfigError) as err:
        fetch_model(hub_source("org/gated", rev), tmp_path / "m")
    assert str(err.value).startswith("HF_TOKEN: org/gated is gated or private (HTTP 401) and HF_TOKEN is not set")
    assert "export HF_TOKEN=..." in str(err.value) and "accept the license" in str(err.value)
    assert not (tmp_path / "m").exists()
    assert hub.requests and not any(r.authorized for r in hub.requests)

    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token")
    with pytest.raises(ConfigError, match=r"^HF_TOKEN: the token in HF_TOKEN lacks access to org/gated \(HTTP 403\)"):
        fetch_model(hub_source("org/gated", rev), tmp_path / "m")

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.requests.clear()
    with caplog.at_level(logging.DEBUG):
        manifest = fetch_model(hub_source("org/gated", rev), tmp_path / "m")
    assert json.loads((tmp_path / "m/config.json").read_text()) == {"version": 1}
    assert all(r.authorized for r in hub.requests)
    out, errs = capfd.readouterr()
    for text in (json.dumps(manifest), caplog.text, out, errs, str(err.value)):
        assert TOKEN not in text


def test_unknown_revision_names_revision(hub: HubServer, tmp_path: Path) -> None:
    publish(hub.root, "org/tiny", model_files(1))
    with pytest.raises(ConfigError, match=r"^model.source.revision: 0{40} is not a commit of org/tiny"):
        fetch_model(hub_source("org/tiny", "0" * 40), tmp_path / "m")


def test_non_sha_revision_rejected_before_any_request(hub: HubServer, tmp_path: Path) -> None:
    publish(hub.root, "org/tiny", model_files(1))
    for revision in ("main", "v1.0", "abc123", None):
        with pytest.raises(
            ConfigError, match=r"^model.source.revision: .* not a 40-character commit sha.*Fix: pin a full commit sha"
        ):
            fetch_model(hub_source("org/tiny", revision), tmp_path / "m")
    assert hub.requests == []


def test_corrupted_transfer_is_rejected_and_leaves_no_output(hub: HubServer, tmp_path: Path) -> None:
    rev = publish(hub.root, "org/tiny", model_files(1))
    hub.corrupt.add("model.safetensors")
    with pytest.raises(ConfigError, match=r"differ from the Hub listing: \['model.safetensors'\]"):
        fetch_model(hub_source("org/tiny", rev), tmp_path / "m")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


def test_interrupted_download_resumes_and_stale_files_go(hub: HubServer, tmp_path: Path) -> None:
    rev = publish(hub.root, "org/tiny", model_files(1))
    partial = tmp_path / "m.partial"
    # an interrupted run: the safetensors file arrived completely, then the process died
    snapshot_download("org/tiny", revision=rev, allow_patterns=["*.safetensors"], local_dir=partial, endpoint=hub.url)
    (partial / "leftover.safetensors").write_bytes(b"junk")  # from a run with other settings
    (partial / "config.json").write_text('{"version": 0}')  # stale, without download metadata
    hub.requests.clear()
    fetch_model(hub_source("org/tiny", rev), tmp_path / "m")
    assert not any(r.path.endswith("/model.safetensors") for r in hub.requests)  # not fetched again
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((tmp_path / "m/config.json").read_text()) == {"version": 1}


def test_local_source_copies_matching_files(tmp_path: Path) -> None:
    src = tmp_path / "embedded/gemma3-tiny"
    for name, data in model_files(3).items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(data)
    manifest = fetch_model({"kind": "local", "path": str(src)}, tmp_path / "m")
    assert sorted(f["path"] for f in manifest["files"]) == [
        "chat_template.jinja",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert manifest["path"] == str(src) and manifest["revision"] is None
    assert (tmp_path / "m/model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


def test_local_source_missing_names_path_and_make_embedded(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model.source.path: .*Fix: run `dvc repro make_embedded`"):
        fetch_model({"kind": "local", "path": str(tmp_path / "embedded/nope")}, tmp_path / "m")
    with pytest.raises(ConfigError, match=r"^model.source.kind: 'git' is not a source kind"):
        fetch_model({"kind": "git", "path": "x"}, tmp_path / "m")


def test_server_resolves_branches_like_the_hub(hub: HubServer) -> None:
    rev1 = publish(hub.root, "org/tiny", model_files(1))
    rev2 = publish(hub.root, "org/tiny", model_files(2))
    api = HfApi(endpoint=hub.url, token=False)
    assert api.model_info("org/tiny", revision="main").sha == rev2
    info = api.model_info("org/tiny", revision=rev1)
    assert info.sha == rev1 and "config.json" in [s.rfilename for s in info.siblings]


def write_parquet(path: Path, columns: dict[str, list]) -> Path:
    path.write_bytes(parquet_bytes(columns))
    return path


def test_chat_rows_bad_row_is_named(tmp_path: Path) -> None:
    bad_role = [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]
    no_assistant = [{"role": "user", "content": "hi"}]
    f = write_parquet(tmp_path / "train.parquet", {"messages": [CHAT_OK, CHAT_OK, bad_role]})
    with pytest.raises(ConfigError, match=r"train.parquet row 2 column 'messages': turn 1 has role 'bot'.*Fix: "):
        check_chat_rows([f])
    f = write_parquet(tmp_path / "train.parquet", {"messages": [CHAT_OK, no_assistant]})
    with pytest.raises(ConfigError, match=r"row 1 column 'messages': no assistant turn"):
        check_chat_rows([f])
    f = write_parquet(tmp_path / "train.parquet", {"text": ["x"]})
    with pytest.raises(ConfigError, match=r"column 'messages': the file has no such column \(it has \['text'\]\)"):
        check_chat_rows([f])
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(json.dumps({"messages": CHAT_OK}) + "\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(ConfigError, match=r"train.jsonl row 1 column 'messages': expected a non-empty list"):
        check_chat_rows([jsonl])


def test_gsm8k_rows(tmp_path: Path) -> None:
    good = write_parquet(
        tmp_path / "good.parquet", {"question": ["a?", "b?"], "answer": ["x\n#### 72", "y #### -1,000"]}
    )
    assert check_gsm8k_rows([good, good]) == 4
    bad = write_parquet(tmp_path / "bad.parquet", {"question": ["a?", "b?"], "answer": ["#### 3", "the answer is 4"]})
    with pytest.raises(
        ConfigError, match=r"bad.parquet row 1 column 'answer': the answer does not end with '#### <number>'"
    ):
        check_gsm8k_rows([bad])
