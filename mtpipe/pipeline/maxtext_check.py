"""Values passed to MaxText, checked against MaxText's own pydantic types (maxtext/configs/types.py).

Importing MaxText's types imports JAX (seconds), and a check that runs MaxText's code makes MaxText one
of the tools of whatever runs it (mtpipe/pipeline/toolchain.py). So the check lives here, apart from
the schema that every stage loads its view with: ``configure``, ``doit preflight`` and the VM checks
run it (:func:`compose_checked`) before anything is spent; a stage, which only loads its checked
view, does not, and its address names only the tools it runs.
"""

from __future__ import annotations

import functools
import importlib.util

from typing import Annotated

from omegaconf import DictConfig
from pydantic import BaseModel, TypeAdapter, ValidationError

from mtpipe.errors import ConfigError
from mtpipe.pipeline import config, rules, schema
from mtpipe.pipeline.schema import Fix, SftBranch
from mtpipe.pipeline.stage_table import MAXTEXT_MAPPINGS


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
    """Values passed to MaxText that MaxText's own types refuse: each stage's keys marked ``MAXTEXT`` in the
    schema (:func:`mtpipe.pipeline.schema.maxtext_keys`) and every key of :data:`MAXTEXT_MAPPINGS` that
    MaxText declares, each as MaxText reads it (not strictly: its command line is text). The schema's own
    ranges are as strict or stricter; this catches the free-form keys and a MaxText whose types became stricter."""
    errors = []
    for stage, mappings in MAXTEXT_MAPPINGS.items():
        section = getattr(cfg, stage, None)
        if section is None or (stage == "train_sft" and section.steps == 0):  # a skipped warm-up passes nothing
            continue
        given = {f"{cfg.branch}.{stage}.{k}": (k, v) for k, v in schema.maxtext_args(section).items()}
        for mapping in mappings:
            group, name = mapping.split(".")
            given |= {f"{cfg.branch}.{mapping}.{k}": (k, v) for k, v in getattr(getattr(cfg, group), name).items()}
        config_class = section.maxtext_config
        for key, (name, value) in given.items():
            for adapter in maxtext_types(config_class).get(name, []) if value is not None else []:
                try:
                    adapter.validate_python(value)
                except ValidationError as err:
                    errors.append(ConfigError(key, f"is {value!r}, which MaxText's {config_class} refuses for {name} "
                                              f"({err.errors()[0]['msg']})", fix(key, "to a value MaxText accepts")))
    return errors


def installed() -> bool:
    """Whether MaxText is importable here: not in the control plane's light environment
    (requirements-control.lock), where the VM's configure, its first stage, checks the values instead."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in ("maxtext", "jax"))
    except ImportError:
        return False


def check(cfg: SftBranch, preset: str) -> None:
    """Raise the first value of a composed branch (of ``preset``) that MaxText's own types refuse (none
    where MaxText is not :func:`installed`)."""
    if not installed():
        return
    errors = maxtext_errors(cfg, rules.fix_for(cfg.model_dump(by_alias=True), preset))
    if errors:
        raise errors[0]


def compose_checked(branch: str, params: DictConfig) -> SftBranch:
    """:func:`mtpipe.pipeline.config.compose`, then :func:`check`."""
    cfg = config.compose(branch, params)
    check(cfg, params[branch].preset)
    return cfg
