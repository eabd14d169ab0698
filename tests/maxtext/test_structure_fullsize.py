"""Full-size structure check: the real checkpoints through the project's conversion path, no weights.

Every full-size model with a fixture (tests/fixtures/<model>/: the Hub's config.json and the tensor
inventory of its safetensors, see tests/fixtures/README.md; found by tests/families.py, with a shipped
preset that converts it) goes through what `to_maxtext` and `to_huggingface` run for the
tutorial presets (mtpipe.maxtext.conversion_commands builds the arguments, mtpipe.maxtext.adapter.conversion
patches MaxText as in the converters' child process), with MaxText's own mapping, hook and stacking functions evaluated under
`jax.eval_shape`: shapes and dtypes only, nothing is allocated or downloaded. It checks that

* every source tensor is read exactly once (text model; the vision tower is copied unchanged),
* every parameter of MaxText's abstract model is produced with MaxText's shape,
* the export has exactly the source's tensor names, shapes and dtypes, and
* the exported config.json is the real one (every key transformers and vLLM read).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from families import REAL_MODELS, RealModel, real_models
from mtpipe.data import maxtext_tables
from mtpipe.maxtext import commands, conversion_commands
from mtpipe.maxtext.adapter import conversion as adapter
from mtpipe.pipeline import config

pytestmark = [pytest.mark.preflight, pytest.mark.slow, pytest.mark.families]

FIXTURES = Path(__file__).parents[1] / "fixtures"
VISION_PREFIXES = adapter.UNTRAINED_PREFIXES


@dataclass
class Conversion:
    """What the abstract conversion read and wrote, in both directions."""

    source: dict[str, tuple[str, tuple[int, ...]]]  # HF name -> (dtype, shape), from the fixture
    maxtext_shapes: dict[str, tuple[int, ...]]  # MaxText's abstract model
    maxtext_vocab: int
    reads: Counter = field(default_factory=Counter)  # HF name -> times read by to_maxtext
    produced: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # MaxText key -> (dtype, shape)
    exported: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # HF name -> (dtype, shape)
    exported_config: Path | None = None


def hub_dir_without_weights(model: RealModel, out: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Lay out the model as hf_download would (config.json + index), without the safetensors."""
    inventory = json.loads((FIXTURES / model.fixture / "tensors.json").read_text())
    dtypes = {"BF16": "bfloat16", "F32": "float32"}  # safetensors header names -> numpy/JAX names
    source = {name: (dtypes[dtype], tuple(shape)) for name, (dtype, shape) in inventory["tensors"].items()}
    assert sum(math.prod(s) for _, s in source.values()) * 2 == inventory["total_size"]  # BF16: 2 bytes
    out.mkdir(parents=True)
    (out / "config.json").write_text((FIXTURES / model.fixture / "config.json").read_text())
    index = {"metadata": {"total_size": inventory["total_size"]},
             "weight_map": {name: "model-00001-of-00001.safetensors" for name in sorted(source)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return source


def stage_args(model: RealModel, hf_dir: Path, out: Path) -> tuple[commands.MaxTextCommand, commands.MaxTextCommand]:
    """The tutorial preset's to_maxtext and to_huggingface commands, as the pipeline builds them."""
    params = OmegaConf.create({"steps": None, model.branch: {"preset": model.preset}})
    cfg = config.compose(model.branch, params)
    to_mt = conversion_commands.to_maxtext(config.stage_view(cfg, "to_maxtext"), hf_dir=hf_dir, out_dir=out / "maxtext")
    to_hf = conversion_commands.to_huggingface(config.stage_view(cfg, "to_huggingface"), params=out / "params",
                                               hf_src_dir=hf_dir, out_dir=out / "hf")
    return to_mt, to_hf


def maxtext_argv(cmd: commands.MaxTextCommand) -> list[str]:
    """The key=value arguments MaxText's config reads (the converters strip their own --flags first)."""
    return [cmd.module, *(a for a in cmd.args if not a.startswith("--"))]


def to_maxtext_abstract(cmd: commands.MaxTextCommand, hf_dir: Path, conv: Conversion, mp: pytest.MonkeyPatch) -> None:
    """to_maxtext's main loop (checkpoint_conversion/to_maxtext.py `main`) with abstract tensors."""
    import jax
    import jax.numpy as jnp

    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.checkpoint_conversion.utils.utils import validate_and_filter_param_map_keys
    from maxtext.configs import pyconfig

    mt_config = pyconfig.initialize(maxtext_argv(cmd))
    key = mt_config.model_name
    hf_config = HF_MODEL_CONFIGS[key].to_dict()
    param_map = PARAM_MAPPING[key](hf_config, mt_config, mt_config.scan_layers)
    hooks = HOOK_FNS[key](hf_config, mt_config, mt_config.scan_layers, saving_to_hf=False)
    loader = to_maxtext.LazyHFLoader(str(hf_dir), None)  # reads the index; no shard is opened here
    mp.setattr(to_maxtext, "np", jnp)  # its stacking helpers use np.stack / np.moveaxis: traceable as jnp

    abstract_dict = {k: (i, shape) for i, (k, shape) in enumerate(conv.maxtext_shapes.items())}
    for mt_key in validate_and_filter_param_map_keys(param_map.keys(), set(conv.maxtext_shapes)):
        hf_keys = param_map[mt_key]
        _, target_shape = to_maxtext._get_maxtext_indices_and_shapes(mt_key, abstract_dict)
        names = [n for n in jax.tree.leaves(hf_keys) if n is not None]

        def build(*tensors, _names=names, _hf_keys=hf_keys, _mt_key=mt_key, _shape=target_shape):
            by_name = dict(zip(_names, tensors))

            def get(name: str):
                assert to_maxtext.resolve_scale_key(name, loader.shard_map) in loader.shard_map, name
                conv.reads[name] += 1
                return by_name[name]

            load = to_maxtext._get_hf_loading_function(_hf_keys, get, hooks.get(_mt_key), _shape, mt_config, _mt_key)
            return load()

        structs = [jax.ShapeDtypeStruct(conv.source[n][1], conv.source[n][0]) for n in names]
        out = jax.eval_shape(build, *structs)
        conv.produced[mt_key] = (str(out.dtype), tuple(out.shape))


def to_huggingface_abstract(cmd: commands.MaxTextCommand, conv: Conversion, mp: pytest.MonkeyPatch) -> None:
    """to_huggingface's weight transformation (`_transform_weights_to_full_model`) with abstract tensors."""
    import jax

    from maxtext.checkpoint_conversion import to_huggingface
    from maxtext.checkpoint_conversion.utils import utils as conversion_utils
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from maxtext.configs import pyconfig

    mt_config = pyconfig.initialize_pydantic(maxtext_argv(cmd))
    key = mt_config.model_name
    hf_config_obj = HF_MODEL_CONFIGS[key]
    to_huggingface._validate_or_update_architecture(hf_config_obj, mt_config, override=False)
    maps = to_huggingface._get_model_mappings(key, mt_config.scan_layers, hf_config_obj.to_dict(), mt_config)
    keys = conversion_utils.validate_and_filter_param_map_keys(maps["param_mapping"], set(conv.produced))
    if not mt_config.use_multimodal:
        keys = [k for k in keys if "vision_encoder" not in k]
    # The device-to-host copy at the end becomes a plain cast (the same dtype, no gather).
    mp.setattr(conversion_utils, "convert_jax_weight_to_numpy", lambda w, dtype=None: w.astype(dtype or w.dtype))

    for mt_key in keys:
        def export(weight, _mt_key=mt_key):
            return dict(conversion_utils.process_maxtext_param(
                _mt_key, weight, maps["param_mapping"], maps["hook_fn_mapping"], maps["shape_mapping"], mt_config))

        dtype, shape = conv.produced[mt_key]
        for name, out in jax.eval_shape(export, jax.ShapeDtypeStruct(shape, dtype)).items():
            assert name not in conv.exported, f"{name} exported twice"
            conv.exported[name] = (str(out.dtype), tuple(out.shape))

    # config.json: written by MaxText's own writer, then the adapter's post-processing, as in a run.
    out_dir = Path(next(a.split("=", 1)[1] for a in cmd.args if a.startswith("base_output_directory=")))
    out_dir.mkdir(parents=True)
    conversion_utils.save_config_file(hf_config_obj, str(out_dir), str(out_dir), "config.json")
    conv.exported_config = out_dir / "config.json"


def abstract_model_shapes(cmd: commands.MaxTextCommand) -> tuple[dict[str, tuple[int, ...]], int]:
    """MaxText's parameters (key -> shape) for the command's model: `get_maxtext_model_info`, abstract."""
    from maxtext.checkpoint_conversion import to_maxtext
    from maxtext.configs import pyconfig

    mt_config = pyconfig.initialize(maxtext_argv(cmd))
    info, _ = to_maxtext.get_maxtext_model_info(mt_config)
    return {k: tuple(shape) for k, (_, shape) in info.items()}, mt_config.vocab_size


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def conversion(request, tmp_path_factory) -> tuple[RealModel, Conversion]:
    model = real_models()[request.param]
    tmp = tmp_path_factory.mktemp(model.fixture)
    hf_dir = tmp / "files"
    source = hub_dir_without_weights(model, hf_dir)
    to_mt, to_hf = stage_args(model, hf_dir, tmp)
    with pytest.MonkeyPatch.context() as mp:
        # MaxText in this process: on the CPU, Google Cloud stubbed. Only while the fixture runs: the
        # pipeline runs later tests start from this worker must not inherit DECOUPLE_GCLOUD (it sent
        # test_secrets' canary runs down the laptop's code path, without their tensorboard config dump).
        mp.setenv("JAX_PLATFORMS", "cpu")
        mp.setenv("DECOUPLE_GCLOUD", "TRUE")
        from maxtext.checkpoint_conversion.utils import hf_model_configs, hf_shape, param_mapping
        from maxtext.configs import pyconfig

        # The adapter patches MaxText's tables in place (as in the child process of a run): restore them after.
        for name in {arg.split("=", 1)[1] for arg in (*to_mt.args, *to_hf.args) if arg.startswith("model_name=")}:
            for key in maxtext_tables.table_keys(name):
                for table in (hf_model_configs.HF_MODEL_CONFIGS, param_mapping.PARAM_MAPPING, hf_shape.HF_SHAPE):
                    mp.setitem(table, key, table[key])
        mp.setattr(pyconfig, "initialize_pydantic", pyconfig.initialize_pydantic)
        adapter.apply(to_mt.module, to_mt.args)
        shapes, vocab = abstract_model_shapes(to_mt)
        conv = Conversion(source=source, maxtext_shapes=shapes, maxtext_vocab=vocab)
        to_maxtext_abstract(to_mt, hf_dir, conv, mp)
        finish = adapter.apply(to_hf.module, to_hf.args)
        to_huggingface_abstract(to_hf, conv, mp)
        finish()
    return model, conv


def test_every_source_tensor_is_read_once(conversion):
    _, conv = conversion
    text = {n for n in conv.source if not n.startswith(VISION_PREFIXES)}
    assert set(conv.reads) == text
    assert set(conv.reads.values()) == {1}


def test_every_maxtext_parameter_is_produced_with_its_shape(conversion):
    _, conv = conversion
    assert set(conv.produced) == set(conv.maxtext_shapes)
    for key, (_, shape) in conv.produced.items():
        assert shape == conv.maxtext_shapes[key], key
    assert {dtype for dtype, _ in conv.produced.values()} == {"bfloat16"}


def test_the_export_has_the_source_names_shapes_and_dtypes(conversion):
    """MaxText exports the language model; the adapter copies the (untrained) vision tower unchanged."""
    _, conv = conversion
    text = {n: v for n, v in conv.source.items() if not n.startswith(VISION_PREFIXES)}
    assert conv.exported == text


@pytest.mark.parametrize("conversion", ["gemma-3-4b-it"], indirect=True)
def test_gemma3_keeps_its_layer_blocks_and_vocabulary(conversion):
    _, conv = conversion
    # 34 layers = 5 scanned blocks of 6 (5 local + 1 global) + 4 unscanned remainder layers.
    assert conv.maxtext_shapes["params-decoder-layers-layers_0-mlp-wo-kernel"] == (10240, 5, 2560)
    remainder = {k.split("-")[3] for k in conv.maxtext_shapes if "layers_remainder" in k}
    assert remainder == {f"layers_{i}" for i in range(4)}
    # MaxText's table has 262144 rows, the Hub's 262208: to_maxtext drops the last 64 rows (the image
    # soft token and padding), to_huggingface pads them back (docs/maxtext-adapter.md, patch 6).
    assert conv.maxtext_vocab == 262144
    assert conv.maxtext_shapes["params-token_embedder-embedding"] == (262144, 2560)
    assert conv.exported["language_model.model.embed_tokens.weight"][1] == (262208, 2560)


# What transformers (and vLLM, through it) reads from the export, against the published models.
EXPECTED_TEXT_CONFIG = {
    "gemma-3-4b-it": {
        "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 262208, "sliding_window": 1024,
        "query_pre_attn_scalar": 256, "head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
        "num_hidden_layers": 34, "hidden_size": 2560, "intermediate_size": 10240,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 5 + ["sliding_attention"] * 4,
    },
    "Llama-3.1-8B-Instruct": {
        "vocab_size": 128256, "tie_word_embeddings": False, "head_dim": 128, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    },
}  # fmt: skip


def test_the_exported_config_is_the_real_one(conversion):
    """The file itself: every key an older reader looks at (rope_scaling, rope_theta, torch_dtype) is kept."""
    model, conv = conversion
    real = FIXTURES / model.fixture / "config.json"
    assert json.loads(conv.exported_config.read_text()) == json.loads(real.read_text())


@pytest.mark.parametrize("conversion", sorted(EXPECTED_TEXT_CONFIG), indirect=True)
def test_transformers_reads_the_published_values_from_the_export(conversion):
    """The values a family's published model card states, as transformers reads them from the export."""
    from transformers import AutoConfig

    model, conv = conversion
    exported = AutoConfig.from_pretrained(conv.exported_config.parent)
    text = getattr(exported, "text_config", exported)
    assert {k: getattr(text, k) for k in EXPECTED_TEXT_CONFIG[model.fixture]} == EXPECTED_TEXT_CONFIG[model.fixture]
