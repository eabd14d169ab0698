"""Values passed to MaxText, checked against MaxText's own pydantic types (maxtext/configs/types.py).

Importing MaxText's types imports JAX (seconds), and a check that runs MaxText's code makes MaxText one
of the tools of whatever runs it (mtpipe/pipeline/toolchain.py). So the check lives here, apart from
the schema that every stage loads its view with: ``configure``, ``doit preflight`` and the VM checks
run it (:func:`compose_checked`) before anything is spent; a stage, which only loads its checked
view, does not, and its address names only the tools it runs.
"""

from __future__ import annotations

import functools

from typing import Annotated

from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, TypeAdapter, ValidationError

from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, schema
from mtpipe.pipeline.schema import Fix, SftBranch


# The MaxText config class (maxtext/configs/types.py) each stage's command line is read into, and the
# stage's keys passed to MaxText under their own names (commands.py; lazy_load_tensors and
# checkpoint_storage become other flags).
MAXTEXT_KEYS: dict[str, tuple[str, tuple[str, ...]]] = {
    "to_maxtext": ("MaxTextConfig", ("scan_layers", "use_multimodal")),
    "train_sft": ("MaxTextConfig", ("steps", "per_device_batch_size", "max_target_length", "learning_rate",
                                    "num_epoch", "checkpoint_period", "max_num_checkpoints_to_keep", "eval_interval",
                                    "eval_steps", "profiler")),
    "train_rl": ("RLConfig", ("chips_per_vm", "num_batches", "num_test_batches", "batch_size", "num_generations",
                              "rollout_data_parallelism", "rollout_tensor_parallelism", "grpo_beta",
                              "grpo_epsilon", "learning_rate", "max_prefill_predict_length", "max_target_length",
                              "max_num_checkpoints_to_keep")),
    "to_huggingface": ("MaxTextConfig", ("scan_layers", "use_multimodal", "weight_dtype")),
}
# The free-form MaxText mappings each stage passes on, every key as it is.
MAXTEXT_MAPPINGS: dict[str, tuple[str, ...]] = {
    "to_maxtext": ("model.maxtext_overrides",),
    "train_sft": ("hardware.maxtext_args", "model.maxtext_overrides", "train_sft.extra_args"),
    "train_rl": ("hardware.maxtext_args", "model.maxtext_overrides", "train_rl.extra_args"),
    "to_huggingface": ("model.maxtext_overrides",),
}


@functools.cache
def maxtext_types(config: str) -> dict[str, list[TypeAdapter]]:
    """The type (with its constraints) of every key MaxText's ``config`` class declares, by the flat key
    its command line takes: RLConfig routes ``num_generations`` into ``rl.num_generations``, so a key
    may have several. Importing MaxText's types imports JAX (seconds): only ``configure`` does."""
    from maxtext.configs import types

    found: dict[str, list[TypeAdapter]] = {}
    for name, f in getattr(types, config).model_fields.items():
        nested = f.annotation if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) else None
        for key, field in (nested.model_fields if nested else {name: f}).items():
            hint = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
            found.setdefault(key, []).append(TypeAdapter(hint))
    return found


def maxtext_errors(cfg: SftBranch, fix: Fix) -> list[ConfigError]:
    """Values passed to MaxText that MaxText's own types refuse: the keys of :data:`MAXTEXT_KEYS` and
    every key of :data:`MAXTEXT_MAPPINGS` that MaxText declares, each as MaxText reads it (not strictly:
    its command line is text). The schema's own ranges are as strict or stricter; this catches the
    free-form keys and a MaxText whose types became stricter."""
    errors = []
    for stage, (config_class, keys) in MAXTEXT_KEYS.items():
        section = getattr(cfg, stage, None)
        if section is None or (stage == "train_sft" and section.steps == 0):  # a skipped warm-up passes nothing
            continue
        given = {f"{cfg.branch}.{stage}.{k}": (k, getattr(section, k)) for k in keys}
        for mapping in MAXTEXT_MAPPINGS[stage]:
            group, name = mapping.split(".")
            given |= {f"{cfg.branch}.{mapping}.{k}": (k, v) for k, v in getattr(getattr(cfg, group), name).items()}
        for key, (name, value) in given.items():
            for adapter in maxtext_types(config_class).get(name, []) if value is not None else []:
                try:
                    adapter.validate_python(value)
                except ValidationError as err:
                    errors.append(ConfigError(key, f"is {value!r}, which MaxText's {config_class} refuses for {name} "
                                              f"({err.errors()[0]['msg']})", fix(key, "to a value MaxText accepts")))
    return errors


def check(cfg: DictConfig, preset: str) -> None:
    """Raise the first value of a composed branch (of ``preset``) that MaxText's own types refuse."""
    composed = OmegaConf.to_container(cfg, resolve=True)
    fix = schema.fix_for(composed, preset)
    errors = maxtext_errors(schema.validate(schema.BRANCHES[cfg.branch], composed, cfg.branch, fix), fix)
    if errors:
        raise errors[0]


def compose_checked(branch: str, params: DictConfig) -> DictConfig:
    """:func:`mtpipe.pipeline.config.compose`, then :func:`check`."""
    cfg = config.compose(branch, params)
    check(cfg, params[branch].preset)
    return cfg
