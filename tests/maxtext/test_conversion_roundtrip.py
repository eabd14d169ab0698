"""HF -> MaxText -> HF through `python -m mtpipe.maxtext.adapter.conversion` keeps every text tensor bit-exact.

The slow tests run the real MaxText converters (to_maxtext with lazy, torch-free loading; then
to_huggingface) on the tiny twins; the fast ones check the adapter and launcher on their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import maxtext_forward
from families import TWINS, twins
from mtpipe.evaluation import numpy_forward

from mtpipe.maxtext.adapter import conversion
ROOT = Path(__file__).resolve().parents[2]
JAX_CACHE = ROOT / "work" / "jax_cache"
VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Every tiny twin (tests/families.py), in root/<name>."""
    root = tmp_path_factory.mktemp("models")
    for twin in twins().values():
        twin.write(root / twin.name)
    return root


def model_args(name: str) -> list[str]:
    twin = twins()[name]
    values = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in twin.overrides.items()}
    return [f"model_name={twin.maxtext_name}", *(f"{k}={v}" for k, v in values.items())]


def to_maxtext_args(name: str, hf_dir: Path, out: Path) -> list[str]:
    return [
        *model_args(name), f"base_output_directory={out}", "scan_layers=True", "use_multimodal=False",
        "hardware=cpu", "skip_jax_distributed_system=true", "checkpoint_storage_use_zarr3=1",
        "checkpoint_storage_use_ocdbt=1", f"jax_cache_dir={JAX_CACHE}", f"--hf_model_path={hf_dir}",
        "--lazy_load_tensors=True",
    ]  # fmt: skip


def to_huggingface_args(name: str, hf_dir: Path, items: Path, out: Path) -> list[str]:
    return [
        *model_args(name), f"load_parameters_path={items}", f"base_output_directory={out}", "scan_layers=True",
        "use_multimodal=False", "weight_dtype=float32", "hardware=cpu", "skip_jax_distributed_system=true",
        f"jax_cache_dir={JAX_CACHE}", f"--hf_model_path={hf_dir}",
    ]  # fmt: skip


def launch(module: str, args: list[str], log: Path) -> tuple[int, float, str]:
    """Run `python -m mtpipe.maxtext.adapter.conversion module args` as MaxText runs on CPU; return status,
    seconds, output."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DECOUPLE_GCLOUD": "TRUE"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mtpipe.maxtext.adapter.conversion", module, *args],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log.write_text(proc.stdout)
    return proc.returncode, time.monotonic() - start, proc.stdout


def read_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.slow
@pytest.mark.families
@pytest.mark.parametrize("name", TWINS)
def test_round_trip_is_bit_exact(models, tmp_path, name, record_property):
    from transformers import AutoConfig, AutoTokenizer

    src = models / name
    mt, hf = tmp_path / "maxtext", tmp_path / "hf"
    rc, t1, out = launch(conversion.TO_MAXTEXT, to_maxtext_args(name, src, mt), tmp_path / "to_maxtext.log")
    assert rc == 0, out[-3000:]
    assert (mt / "0" / "items").is_dir()
    items = mt / "0" / "items"
    rc, t2, out = launch(conversion.TO_HUGGINGFACE, to_huggingface_args(name, src, items, hf), tmp_path / "to_hf.log")
    assert rc == 0, out[-3000:]
    record_property("to_maxtext_s", round(t1, 1))
    record_property("to_huggingface_s", round(t2, 1))
    print(f"\n{name}: to_maxtext {t1:.1f} s, to_huggingface {t2:.1f} s")

    # Every tensor comes back bit-exact: the language model through MaxText, the (untrained) vision
    # tower copied from the source by the adapter, so the export is a complete checkpoint.
    source, export = read_tensors(src), read_tensors(hf)
    assert set(export) == set(source)
    multimodal = "vision_config" in json.loads((src / "config.json").read_text())
    assert any(k.startswith(VISION_PREFIXES) for k in source) == multimodal
    for key, want in source.items():
        got = export[key]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), key
        assert got.tobytes() == want.tobytes(), f"{key}: max |diff| {np.abs(got - want).max()}"

    # MaxText's own forward of the converted checkpoint equals an independent numpy forward of the
    # source (docs/logit-check.md; 100 tokens, past gemma3's 64-token sliding window).
    twin = twins()[name]
    ids = np.random.default_rng(0).integers(4, twin.overrides["vocab_size"], size=100)
    ours = maxtext_forward.logits(items, twin.maxtext_name, ids, maxtext_forward.as_args(twin.overrides))
    ref = numpy_forward.logits(src, ids, match_maxtext=True)
    assert ref.std() > 0.1
    diff = float(np.abs(ours - ref).max())
    print(f"{name}: max |MaxText - numpy| = {diff:.2e} (logit std {ref.std():.2f})")
    assert diff < 2e-5

    # MaxText wrote the source model's config (not its built-in table), and transformers loads it.
    assert json.loads((hf / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    cfg = AutoConfig.from_pretrained(hf)
    assert type(cfg) is type(AutoConfig.from_pretrained(src))
    if cfg.model_type == "gemma3":
        assert cfg.text_config.rope_parameters["full_attention"]["rope_theta"] == 1e6
        assert cfg.text_config.hidden_activation == "gelu_pytorch_tanh"
    assert json.loads((hf / "generation_config.json").read_text()) == json.loads((src / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.chat_template == AutoTokenizer.from_pretrained(src).chat_template and len(tok) == twin.overrides["vocab_size"]


def test_gemma3_mapping_uses_the_checkpoint_names(models, monkeypatch):
    """After the patches, every name and shape MaxText asks for is the one in the Hub-layout files."""
    from maxtext.checkpoint_conversion.utils import hf_model_configs, hf_shape, param_mapping

    key = "gemma3-4b"
    monkeypatch.setitem(hf_model_configs.HF_MODEL_CONFIGS, key, hf_model_configs.HF_MODEL_CONFIGS[key])
    monkeypatch.setitem(param_mapping.PARAM_MAPPING, key, param_mapping.PARAM_MAPPING[key])
    monkeypatch.setitem(hf_shape.HF_SHAPE, key, hf_shape.HF_SHAPE[key])
    src = models / "gemma3-tiny"
    conversion.use_source_config(key, src)
    assert conversion.use_checkpoint_tensor_names(key, src)

    cfg = hf_model_configs.HF_MODEL_CONFIGS[key].to_dict()
    tensors = read_tensors(src)
    shapes = hf_shape.HF_SHAPE[key](cfg)
    assert {n: list(a.shape) for n, a in tensors.items()} == {n: list(shapes[n]) for n in tensors if n in shapes}
    for scan in (True, False):
        names: list[str] = []
        for value in param_mapping.PARAM_MAPPING[key](cfg, None, scan).values():
            names += value if isinstance(value, list) else [value]
        assert set(names) == set(tensors)
    # 8 layers: one scanned block of 6 plus 2 unscanned remainder layers (the real model: 5 blocks + 4).
    scanned = param_mapping.PARAM_MAPPING[key](cfg, None, True)
    down = "language_model.model.layers.{}.mlp.down_proj.weight"
    assert scanned["params-decoder-layers-layers_5-mlp-wo-kernel"] == [down.format(5)]
    assert scanned["params-decoder-layers_remainder-layers_1-mlp-wo-kernel"] == down.format(7)


def test_gemma3_mapping_kept_for_in_memory_names(tmp_path, monkeypatch):
    """A checkpoint saved with transformers' in-memory names needs no renaming."""
    from maxtext.checkpoint_conversion.utils import param_mapping

    monkeypatch.setitem(param_mapping.PARAM_MAPPING, "gemma3-4b", param_mapping.PARAM_MAPPING["gemma3-4b"])
    save_file({"model.language_model.norm.weight": np.zeros(4, np.float32)}, str(tmp_path / "model.safetensors"))
    assert not conversion.use_checkpoint_tensor_names("gemma3-4b", tmp_path)
    assert param_mapping.PARAM_MAPPING["gemma3-4b"] is param_mapping.GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING


def test_launch_refuses_a_token_in_argv_without_echoing_it(models):
    secret = "hf_NotARealTokenButSecret123"
    args = ["model_name=gemma3-4b", f"hf_access_token={secret}", f"--hf_model_path={models / 'gemma3-tiny'}"]
    proc = subprocess.run([sys.executable, "-m", "mtpipe.maxtext.adapter.conversion", conversion.TO_MAXTEXT, *args],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2
    assert "hf_access_token" in proc.stderr and "HF_TOKEN" in proc.stderr
    assert secret not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model_name=gemma3-4b"], "--hf_model_path"),
        (["--hf_model_path=/nonexistent/dir"], "model_name="),
        (["model_name=gemma3-4b", "--hf_model_path", "/nonexistent/dir"], "has no config.json"),
    ],
)
def test_launch_fails_early_on_bad_conversion_args(args, message):
    proc = subprocess.run([sys.executable, "-m", "mtpipe.maxtext.adapter.conversion", conversion.TO_HUGGINGFACE, *args],
                          cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and message in proc.stderr


def test_launch_exits_with_the_module_status(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("x = 1\n")
    bad.write_text("def broken(:\n")
    run = lambda f: subprocess.run([sys.executable, "-m", "mtpipe.maxtext.adapter.conversion", "py_compile", str(f)],  # noqa: E731
                                   cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert run(good).returncode == 0
    failed = run(bad)
    assert failed.returncode == 1 and "SyntaxError" in failed.stderr


@pytest.mark.parametrize(("launcher", "module"), [
    ("mtpipe.maxtext.adapter.conversion", "maxtext.trainers.post_train.sft.train_sft"),
    ("mtpipe.maxtext.adapter.training", conversion.TO_MAXTEXT),
])
def test_each_adapter_refuses_the_other_kinds_module(launcher, module):
    """A command launched with the other kind's patches stops before MaxText starts, naming its module."""
    proc = subprocess.run([sys.executable, "-m", launcher, module, "model_name=gemma3-4b"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 2 and module in proc.stderr


# google/gemma-3-4b-it's config.json as published on the Hub (transformers 4.50 format).
GEMMA_3_4B_IT_CONFIG = ROOT / "tests" / "fixtures" / "gemma-3-4b-it" / "config.json"


def test_the_same_patches_serve_the_real_gemma_3_4b(tmp_path, monkeypatch):
    """With the published 4B config (no weights here), the table and names follow the real model."""
    from maxtext.checkpoint_conversion.utils import hf_model_configs, hf_shape, param_mapping

    key = "gemma3-4b"
    for table in (hf_model_configs.HF_MODEL_CONFIGS, param_mapping.PARAM_MAPPING, hf_shape.HF_SHAPE):
        monkeypatch.setitem(table, key, table[key])
    (tmp_path / "config.json").write_text(GEMMA_3_4B_IT_CONFIG.read_text())
    conversion.use_source_config(key, tmp_path)
    assert conversion.use_checkpoint_tensor_names(key, tmp_path)  # no weights: the Hub's legacy names

    text = hf_model_configs.HF_MODEL_CONFIGS[key].text_config
    assert text.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert text.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert text.hidden_activation == "gelu_pytorch_tanh" and text.vocab_size == 262208
    mapping = param_mapping.PARAM_MAPPING[key](hf_model_configs.HF_MODEL_CONFIGS[key].to_dict(), None, True)
    assert mapping["params-decoder-layers_remainder-layers_3-mlp-wo-kernel"] == "language_model.model.layers.33.mlp.down_proj.weight"
    assert mapping["params-decoder-layers-layers_0-mlp-wo-kernel"][-1] == "language_model.model.layers.24.mlp.down_proj.weight"


def test_export_config_is_the_source_file_only_for_the_same_model(tmp_path):
    """Patch 5: the source's config.json replaces MaxText's re-serialized one; another model stops the run."""
    from transformers import AutoConfig

    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    (src / "config.json").write_text(GEMMA_3_4B_IT_CONFIG.read_text())
    AutoConfig.from_pretrained(src).save_pretrained(out)  # what MaxText writes: transformers 5's format
    assert "rope_scaling" not in json.loads((out / "config.json").read_text())["text_config"]
    conversion.copy_source_config(src, str(out))
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()

    other = AutoConfig.from_pretrained(src)
    other.text_config.sliding_window = 512
    other.save_pretrained(out)
    with pytest.raises(RuntimeError, match="text_config"):
        conversion.copy_source_config(src, str(out))


def test_padded_vocabulary_rows_come_back_from_the_source(tmp_path):
    """Patch 6: rows MaxText's table lacked (to_huggingface pads them with zeros) are the source's again."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    rng = np.random.default_rng(0)
    embed, other = rng.standard_normal((10, 4)).astype(np.float32), rng.standard_normal((10, 4)).astype(np.float32)
    name = "language_model.model.embed_tokens.weight"
    save_file({name: embed, "x.q_proj.weight": other}, str(src / "model.safetensors"))
    trained = embed + 1
    trained[8:] = 0  # MaxText had 8 rows; to_huggingface padded 2 with zeros
    save_file({name: trained, "x.q_proj.weight": other * 0}, str(out / "model.safetensors"), metadata={"format": "pt"})
    conversion.restore_padded_rows(src, str(out), 8)
    got = load_file(str(out / "model.safetensors"))
    np.testing.assert_array_equal(got[name][:8], embed[:8] + 1)  # trained rows untouched
    np.testing.assert_array_equal(got[name][8:], embed[8:])  # the source's rows
    np.testing.assert_array_equal(got["x.q_proj.weight"], other * 0)  # not a vocabulary tensor
    conversion.restore_padded_rows(src, str(out), None)  # no padding: nothing to do


def test_the_converters_collect_young_garbage_only(models):
    """Patch 10, as `apply` sets it up for a converter (in a child process: it replaces gc.collect):
    a bare gc.collect() frees the cycles made since the last collection, and leaves older ones to a
    full collection."""
    code = f"""
import gc, weakref
from mtpipe.maxtext.adapter import conversion

class Node: pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

conversion.apply(conversion.TO_MAXTEXT, ["model_name=llama3.1-8b", "--hf_model_path={models / 'llama3.1-tiny'}"])
old = cycle()
gc.collect(2)  # a full collection when asked for: `old` is alive, so it moves to the oldest generation
old_ref = weakref.ref(old)
del old
young = cycle()
young_ref = weakref.ref(young)
del young
gc.collect()
print(young_ref() is None, old_ref() is None)
gc.collect(2)
print(old_ref() is None)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split()[-3:] == ["True", "False", "True"], out
