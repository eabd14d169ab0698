"""The converters' patches (1-6 and 10; the index is in :mod:`mtpipe.maxtext.adapter`), and their
child entry point:

    python -m mtpipe.maxtext.adapter.conversion maxtext.checkpoint_conversion.to_maxtext model_name=... \
        --hf_model_path=...

Arguments after the module name are passed to it unchanged (as its sys.argv[1:]); :func:`apply` patches
MaxText first and :mod:`mtpipe.maxtext.launch` runs the module, then the post-processing.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mtpipe.data import maxtext_tables
from mtpipe.maxtext import launch
from mtpipe.maxtext.adapter import (CONVERTERS, TO_HUGGINGFACE, TO_MAXTEXT, TRAINERS, AdapterError, _arg_value,
                                    defer_vertex_ai_import, reject_secrets)

# transformers in-memory name prefix -> on-disk (legacy) prefix, for Gemma3ForConditionalGeneration.
GEMMA3_LEGACY_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)

# Tensors with one row per token: MaxText's vocabulary may be smaller than the source's (patch 6).
VOCABULARY_TENSORS = ("embed_tokens.weight", "lm_head.weight")
# What MaxText leaves out of a text-only (use_multimodal=False) export, copied from the source.
UNTRAINED_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True)
class ConversionArgs:
    """The arguments of a conversion run that the patches depend on."""

    model_name: str
    hf_model_path: Path
    output_dir: str | None
    loads_file_names: bool  # False only for to_maxtext's eager "transformers" loader (renames in memory)


def parse_conversion_args(module: str, argv: list[str]) -> ConversionArgs:
    """Read model_name, --hf_model_path and the output directory; fail early on bad values."""
    model_name = _arg_value(argv, "model_name")
    if not model_name:
        raise AdapterError(f"{module}: `model_name=` is required (e.g. model_name=gemma3-4b)")
    path = _arg_value(argv, "hf_model_path")
    if not path:
        raise AdapterError(
            f"{module}: `--hf_model_path=<dir>` is required: the local Hugging Face model directory "
            "(from hf_download) whose config.json describes the model"
        )
    hf_dir = Path(path)
    if not (hf_dir / "config.json").is_file():
        raise AdapterError(f"{module}: --hf_model_path={path} has no config.json: pass the downloaded model directory")
    eager = (_arg_value(argv, "lazy_load_tensors") or "true").lower() in ("false", "0", "no", "f", "n")
    by_transformers = eager and _arg_value(argv, "eager_load_method") == "transformers"
    return ConversionArgs(
        model_name=model_name,
        hf_model_path=hf_dir,
        output_dir=_arg_value(argv, "base_output_directory"),
        loads_file_names=not (module == TO_MAXTEXT and by_transformers),
    )


def use_source_config(model_name: str, hf_dir: Path) -> None:
    """Patch 1: MaxText's hard-coded HF config for `model_name` becomes the source's config.json."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    from transformers import AutoConfig

    source = AutoConfig.from_pretrained(hf_dir)
    for key in maxtext_tables.table_keys(model_name):
        HF_MODEL_CONFIGS[key] = source


def accept_padded_vocabulary(hf_dir: Path) -> dict[str, int]:
    """Patch 6: to_huggingface's MaxText config reports the source's vocabulary when MaxText's is smaller.

    Returns a dict that gets ``{"maxtext_vocab": n}`` when that happened (for :func:`restore_padded_rows`).
    """
    from maxtext.configs import pyconfig
    from transformers import AutoConfig

    source = AutoConfig.from_pretrained(hf_dir)
    source_vocab = getattr(source, "text_config", source).vocab_size
    initialize = pyconfig.initialize_pydantic
    padded: dict[str, int] = {}

    def initialize_with_source_vocabulary(*args, **kwargs):
        config = initialize(*args, **kwargs)
        if config.vocab_size < source_vocab:
            padded["maxtext_vocab"] = config.vocab_size
            return config.model_copy(update={"vocab_size": source_vocab})
        return config

    pyconfig.initialize_pydantic = initialize_with_source_vocabulary
    return padded


def restore_padded_rows(hf_dir: Path, output_dir: str | None, first_row: int | None) -> None:
    """After patch 6: rows from `first_row` on of the exported vocabulary tensors come from the source.

    MaxText's table ended before `first_row`; to_huggingface padded the rest with zeros. The shard
    holding such a tensor is rewritten with the source's rows (cast to the export's dtype).
    """
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out = Path(output_dir) if output_dir and "://" not in output_dir else None
    if out is None or first_row is None:
        return
    source: dict[str, Path] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(shard, "numpy") as f:
            source |= {k: shard for k in f.keys()}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "numpy") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        padded = [k for k, t in tensors.items()
                  if k in source and k.endswith(VOCABULARY_TENSORS) and t.shape[0] > first_row]
        for name in padded:
            with safe_open(source[name], "numpy") as f:
                rows = f.get_slice(name)[first_row:]
            if rows.shape[0] != tensors[name].shape[0] - first_row:
                raise RuntimeError(f"{name}: the export has {tensors[name].shape[0]} rows, the source "
                                   f"{first_row + rows.shape[0]}")
            tensors[name][first_row:] = rows.astype(tensors[name].dtype)
        if padded:
            save_file(tensors, shard, metadata=metadata)


def checkpoint_tensor_names(hf_dir: Path) -> list[str]:
    """Tensor names in the safetensors of `hf_dir` (index file or single file; [] if none)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    single = hf_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="np") as f:
            return sorted(f.keys())
    return []


def to_legacy_gemma3_name(name: str) -> str:
    """`model.language_model.layers.0...` -> `language_model.model.layers.0...` (Hub file names)."""
    for new, legacy in GEMMA3_LEGACY_PREFIXES:
        if name.startswith(new):
            return legacy + name[len(new) :]
    return name


def _rename(value: Any, fn: Callable[[str], str]) -> Any:
    """Apply `fn` to every name in a mapping value (str, nested lists/tuples of str, or None)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, list):
        return [_rename(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_rename(v, fn) for v in value)
    return value


def use_checkpoint_tensor_names(model_name: str, hf_dir: Path) -> bool:
    """Patch 2: for gemma3, map to the legacy on-disk names when the source files use them.

    A directory without weights (e.g. tokenizer only) gets the Hub layout, the legacy names.
    Returns whether the mapping was renamed.
    """
    from maxtext.checkpoint_conversion.utils import hf_shape, param_mapping

    gemma3 = param_mapping.GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING
    keys = [k for k in maxtext_tables.table_keys(model_name) if param_mapping.PARAM_MAPPING.get(k) is gemma3]
    names = checkpoint_tensor_names(hf_dir)
    if not keys or (names and not any(n.startswith("language_model.model.") for n in names)):
        return False
    for key in keys:
        mapping_fn, shape_fn = param_mapping.PARAM_MAPPING[key], hf_shape.HF_SHAPE[key]

        def legacy_mapping(*args, _fn=mapping_fn, **kwargs):
            return {mt: _rename(hf, to_legacy_gemma3_name) for mt, hf in _fn(*args, **kwargs).items()}

        def legacy_shapes(*args, _fn=shape_fn, **kwargs):
            return {to_legacy_gemma3_name(hf): shape for hf, shape in _fn(*args, **kwargs).items()}

        param_mapping.PARAM_MAPPING[key] = legacy_mapping
        hf_shape.HF_SHAPE[key] = legacy_shapes
    return True


def copy_generation_config(hf_dir: Path, output_dir: str | None) -> None:
    """Post-processing 3: give the export the source's generation_config.json (stop tokens)."""
    src = hf_dir / "generation_config.json"
    if not src.is_file() or not output_dir or "://" in output_dir:
        return
    dst = Path(output_dir) / "generation_config.json"
    if Path(output_dir).is_dir() and not dst.exists():
        shutil.copyfile(src, dst)


def copy_source_config(hf_dir: Path, output_dir: str | None) -> None:
    """Post-processing 5: the export's config.json becomes the source's file, byte for byte."""
    from transformers import AutoConfig

    out = Path(output_dir) if output_dir and "://" not in output_dir else None
    if out is None or not (out / "config.json").is_file():
        return
    written, source = (AutoConfig.from_pretrained(d).to_dict() for d in (out, hf_dir))
    differs = sorted(k for k in written.keys() | source.keys()
                     if k not in ("transformers_version", "_name_or_path") and written.get(k) != source.get(k))
    if differs:  # e.g. --override_model_architecture: the export is not the source's architecture
        raise RuntimeError(f"to_huggingface wrote a config.json that differs from the source's in {differs}")
    shutil.copyfile(hf_dir / "config.json", out / "config.json")


def copy_untouched_tensors(hf_dir: Path, output_dir: str | None) -> None:
    """Post-processing 4: add the source tensors the export lacks, as a sharded checkpoint."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out = Path(output_dir) if output_dir and "://" not in output_dir else None
    if out is None or not (out / "model.safetensors").is_file():
        return
    with safe_open(out / "model.safetensors", "numpy") as f:
        exported = set(f.keys())
        metadata = f.metadata()
    missing: dict[str, Any] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(shard, "numpy") as f:
            missing |= {k: f.get_tensor(k) for k in f.keys() if k not in exported}
    lost = sorted(k for k in missing if not k.startswith(UNTRAINED_PREFIXES))
    if lost:  # a language-model tensor MaxText did not export must not come back untrained
        raise RuntimeError(f"to_huggingface exported no {lost[:3]} (+{len(lost) - 3} more)" if len(lost) > 3
                           else f"to_huggingface exported no {lost}")
    if not missing:
        return
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file(missing, out / names[1], metadata=metadata)
    (out / "model.safetensors").rename(out / names[0])
    weight_map = {k: names[0] for k in exported} | {k: names[1] for k in missing}
    size = sum((out / n).stat().st_size for n in names)
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def collect_young_garbage() -> None:
    """Patch 10: ``gc.collect()`` without a generation collects generations 0 and 1 only."""
    import gc

    collect = gc.collect

    def collect_young(generation: int = 1) -> int:
        return collect(generation)

    gc.collect = collect_young


def apply(module: str, argv: list[str]) -> Callable[[], None]:
    """Patch MaxText for converter `module` run with `argv`; return the post-processing step to run on
    success. Another MaxText module gets the shared patches only; a trainer is refused."""
    reject_secrets(argv)
    defer_vertex_ai_import()
    if module in TRAINERS:
        raise AdapterError(f"{module} is a trainer: launch it with `python -m mtpipe.maxtext.adapter.training`")
    if module not in CONVERTERS:
        return lambda: None
    args = parse_conversion_args(module, argv)
    collect_young_garbage()
    use_source_config(args.model_name, args.hf_model_path)
    if args.loads_file_names:
        use_checkpoint_tensor_names(args.model_name, args.hf_model_path)
    if module == TO_HUGGINGFACE:
        padded = accept_padded_vocabulary(args.hf_model_path)

        def finish() -> None:
            copy_generation_config(args.hf_model_path, args.output_dir)
            copy_source_config(args.hf_model_path, args.output_dir)
            restore_padded_rows(args.hf_model_path, args.output_dir, padded.get("maxtext_vocab"))
            copy_untouched_tensors(args.hf_model_path, args.output_dir)
        return finish
    return lambda: None


if __name__ == "__main__":
    sys.exit(launch.main(apply))
