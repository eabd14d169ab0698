"""The tiny twins come from MaxText's own tables and the sizes in conf/model/<name>-tiny.yaml (through
make_embedded's view).

mtpipe/data/embedded.py holds per family only what MaxText cannot know (tokenizer, chat template,
Hub layout, the few keys where MaxText's table departs from the real model's config.json); these
tests check each of those claims against MaxText, the yaml, the Hub fixtures and dvc.lock.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from mtpipe.data import embedded
from mtpipe.pipeline import config
from mtpipe.reporting.report import flatten

pytestmark = pytest.mark.families

ROOT = Path(__file__).resolve().parents[2]
TWINS = sorted(embedded.FAMILIES)
CONFS = config.twin_confs(TWINS)  # what configure writes into make_embedded's view
MISSING = object()


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("twins")
    for name in TWINS:
        embedded.write_twin(name, CONFS[name], root / name)
    return root


def _text_prefix(tree: dict) -> str:
    return "text_config." if "text_config" in tree else ""


def _hub_fixture(name: str) -> Path | None:
    """tests/fixtures/<repo> of the full-size model the twin copies (same maxtext_name), if there is one."""
    for path in sorted((ROOT / "conf" / "model").glob("*.yaml")):
        conf = yaml.safe_load(path.read_text())
        if path.stem != name and conf["maxtext_name"] == CONFS[name]["maxtext_name"]:
            fixture = ROOT / "tests" / "fixtures" / conf["source"]["repo_id"].split("/")[1]
            return fixture if fixture.is_dir() else None
    return None


@pytest.mark.parametrize("name", TWINS)
def test_config_sizes_are_the_yaml_s(twins, name):
    tree = json.loads((twins / name / "config.json").read_text())
    text = tree.get("text_config", tree)
    sizes = {k: v for k, v in CONFS[name]["maxtext_overrides"].items() if k != "override_model_config"}
    assert sizes, f"conf/model/{name}.yaml has no sizes"
    assert {k: text[embedded.SIZE_KEYS[k]] for k in sizes} == sizes
    assert len(text.get("layer_types", [0] * text["num_hidden_layers"])) == text["num_hidden_layers"]


@pytest.mark.parametrize("name", TWINS)
def test_config_is_maxtexts_table_but_for_sizes_and_the_family_keys(twins, name):
    """Every key of config.json is MaxText's value for the twin's maxtext_name, except the yaml's
    sizes (and what follows from them) and the keys the family names in embedded.FAMILIES."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from transformers import AutoConfig

    table = flatten(HF_MODEL_CONFIGS[CONFS[name]["maxtext_name"]].to_dict())
    twin = flatten(AutoConfig.from_pretrained(twins / name).to_dict())
    text = _text_prefix(json.loads((twins / name / "config.json").read_text()))
    allowed = {text + k for k in (*embedded.SIZE_KEYS.values(), "layer_types", "query_pre_attn_scalar")}
    allowed |= set(embedded.FAMILIES[name].config) | {"dtype", "transformers_version", "_name_or_path"}
    differing = {k for k in table.keys() | twin.keys() if table.get(k, MISSING) != twin.get(k, MISSING)}
    assert differing <= allowed, f"not from MaxText's table: {sorted(differing - allowed)}"


@pytest.mark.parametrize("name", [n for n in TWINS if _hub_fixture(n)])
def test_twin_matches_the_real_model_but_for_sizes_and_tokens(twins, name):
    """The twin's text config is the real model's (tests/fixtures, from the Hub) but for sizes and
    token ids, and it stores the same tensors (up to the layer count) under the same names."""
    from transformers import AutoConfig

    fixture = _hub_fixture(name)
    real = flatten(AutoConfig.from_pretrained(fixture).get_text_config().to_dict())
    twin = flatten(AutoConfig.from_pretrained(twins / name).get_text_config().to_dict())
    ignored = {*embedded.SIZE_KEYS.values(), "layer_types", "query_pre_attn_scalar", "dtype",
               "transformers_version", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id"}
    differing = {k for k in real.keys() | twin.keys() if real.get(k, MISSING) != twin.get(k, MISSING)}
    assert differing <= ignored, {k: (real.get(k), twin.get(k)) for k in differing - ignored}

    def layer_free(names):
        return {re.sub(r"\.layers\.\d+\.", ".layers.N.", n) for n in names}

    index = json.loads((twins / name / "model.safetensors.index.json").read_text())
    hub = json.loads((fixture / "tensors.json").read_text())["tensors"]
    assert layer_free(index["weight_map"]) == layer_free(hub)


@pytest.mark.parametrize("name", TWINS)
def test_tokenizer_has_the_family_s_specials(twins, name):
    """A BOS token is prepended only where the family has one (Qwen3 has none)."""
    from transformers import AutoTokenizer

    family, tok = embedded.FAMILIES[name], AutoTokenizer.from_pretrained(twins / name)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (family.bos, family.eos, family.pad)
    assert len(tok) == embedded.TINY_VOCAB
    ids = tok("What is 2 plus 3?").input_ids
    assert (ids[0] == tok.bos_token_id) == (family.bos is not None)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert all(t in tok.get_vocab() for t in family.specials) and "hi" in prompt


def _resized(name: str, **sizes: int) -> dict:
    return {**CONFS[name], "maxtext_overrides": {**CONFS[name]["maxtext_overrides"], **sizes}}


def test_unknown_override_key_is_refused():
    with pytest.raises(ValueError, match=r"maxtext_overrides\.rope_max_timescale .*SIZE_KEYS"):
        embedded.twin_config("llama3.1-tiny", _resized("llama3.1-tiny", rope_max_timescale=10), tokenizer=None)


@pytest.mark.address
def test_make_embedded_writes_the_twins_its_view_names(tmp_path, monkeypatch):
    """The twins' sizes come from make_embedded's view (configure's copy of conf/model/*-tiny.yaml), not
    from conf/ again; a view whose twins are not the families stops the stage before it writes."""
    from mtpipe.errors import ConfigError
    from stages import make_embedded

    view = make_embedded.load_stage("embedded", "make_embedded")
    assert view.twins == CONFS
    monkeypatch.setattr(embedded, "DATASETS", {})
    resized = {"llama3.1-tiny": _resized("llama3.1-tiny", base_mlp_dim=128)}
    embedded.write_all(tmp_path / "some", resized)
    assert json.loads((tmp_path / "some" / "llama3.1-tiny" / "config.json").read_text())["intermediate_size"] == 128
    monkeypatch.setattr(make_embedded, "load_stage", lambda *_: view.model_copy(update={"twins": resized}))
    with pytest.raises(ConfigError, match=r"make_embedded\.yaml twins: names \['llama3.1-tiny'\], not the families"):
        make_embedded.main(str(tmp_path / "embedded"))
    assert not (tmp_path / "embedded").exists()


def test_write_all_reproduces_the_embedded_dir_dvc_lock_records(tmp_path):
    """The bytes the committed pipeline results were made from: write_all's output has the
    directory hash dvc.lock records for make_embedded's `embedded` output."""
    from dvc.fs import LocalFileSystem
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.db import HashFileDB

    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    recorded = next(o["md5"] for o in lock["stages"]["make_embedded"]["outs"] if o["path"] == "embedded")
    embedded.write_all(tmp_path / "embedded", CONFS)
    fs = LocalFileSystem()
    _, _, obj = build(HashFileDB(fs, str(tmp_path / "odb")), str(tmp_path / "embedded"), fs, "md5")
    assert obj.hash_info.value == recorded
