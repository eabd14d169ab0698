"""MaxText's model tables, looked up in one place.

MaxText keeps per model name a Hugging Face config (``HF_MODEL_CONFIGS``), the tensors' shapes
(``HF_SHAPE``) and its parameter mapping (``PARAM_MAPPING``) in ``maxtext.checkpoint_conversion.utils``,
and looks a name up as given and, for an "-Instruct" name, by its base name. The twins' generator
(mtpipe/data/embedded.py), the CPU forward's check (mtpipe/evaluation/cpu_backend.py) and the
converters' patches (mtpipe/maxtext/adapter/conversion.py) read them through this module.
"""

from __future__ import annotations

from typing import Any


def table_keys(model_name: str) -> list[str]:
    """The keys MaxText looks ``model_name`` up by: the name and, for an "-Instruct" name, the base name."""
    return sorted({model_name, model_name.replace("-Instruct", "")})


def hf_config(model_name: str) -> Any | None:
    """MaxText's Hugging Face config for ``model_name`` (the name's first key that has one), or None."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the table's import warns about configs of unrelated families
    try:
        from maxtext.checkpoint_conversion.utils.hf_model_configs import HF_MODEL_CONFIGS
    finally:
        hf_logging.set_verbosity(verbosity)
    return next((HF_MODEL_CONFIGS[key] for key in (model_name, model_name.replace("-Instruct", ""))
                 if key in HF_MODEL_CONFIGS), None)


def converted_tensors(model_name: str, hf_config_tree: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The Hugging Face tensors MaxText's conversion of ``model_name`` reads (``PARAM_MAPPING``, unscanned),
    with their shapes for a config of that model as a dict (``HF_SHAPE``)."""
    from maxtext.checkpoint_conversion.utils.hf_shape import HF_SHAPE
    from maxtext.checkpoint_conversion.utils.param_mapping import PARAM_MAPPING

    shapes = HF_SHAPE[model_name](hf_config_tree)
    read: set[str] = set()
    for hf in PARAM_MAPPING[model_name](hf_config_tree, None, scan_layers=False).values():
        read.update(hf if isinstance(hf, list) else [hf])
    return {name: tuple(shapes[name]) for name in sorted(read & set(shapes))}
