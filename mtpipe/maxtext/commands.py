"""MaxText command lines: what the converters' and the trainers' builders share.

A builder turns a stage's resolved config into a :class:`MaxTextCommand`: the MaxText module and its
``key=value`` arguments, in the tutorial's order, followed by what the pipeline adds (local files
instead of Hub names, the shrunk dims of a tiny model, checkpointing and metrics), and the launcher
that patches MaxText for it. The converters' builders are in :mod:`mtpipe.maxtext.conversion_commands`,
the trainers' in :mod:`mtpipe.maxtext.training_commands`: a stage's code holds only the builders and
patches of the commands it runs. A stage's own keys that MaxText reads under their own names are the
schema's fields marked ``MAXTEXT`` (:func:`mtpipe.pipeline.schema.maxtext_args`): a new one needs no
change to the builders. ``tests/maxtext/test_tutorial_commands.py`` compares the commands with the tutorials'
argument by argument; docs/decisions/maxtext.md explains each difference.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mtpipe.pipeline.trainers import GRPO, SFT

TO_MAXTEXT = "maxtext.checkpoint_conversion.to_maxtext"
TO_HUGGINGFACE = "maxtext.checkpoint_conversion.to_huggingface"
TRAIN_SFT = SFT.module   # the trainers' modules are named in their records (mtpipe.pipeline.trainers)
TRAIN_RL = GRPO.module


@dataclass(frozen=True)
class MaxTextCommand:
    """One MaxText entry point, its arguments and the environment it runs in."""

    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # the child's entry point: the adapter of the command's kind, or train_rl's CPU launcher
    launcher: str = field(kw_only=True)

    def argv(self) -> list[str]:
        """The child process: ``python -m <launcher> <module> <args>``."""
        return [sys.executable, "-m", self.launcher, self.module, *self.args]

    def as_tutorial(self) -> str:
        """The command as a user would type it (``python3 -m <module> <args>``)."""
        return shlex.join(["python3", "-m", self.module, *self.args])


def fmt(value: Any) -> str:
    """Format a value the way MaxText's key=value parser (YAML) reads it; booleans as the tutorials spell them."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(repr(v) for v in value) + "]"
    return str(value)


def kv(mapping: Mapping[str, Any]) -> list[str]:
    """``key=value`` for every non-null entry, in order."""
    return [f"{k}={fmt(v)}" for k, v in mapping.items() if v is not None]


def take(mapping: dict[str, Any], *keys: str) -> dict[str, Any]:
    """Remove ``keys`` from ``mapping`` (those it has) and return them in that order: arguments the
    tutorial places early."""
    return {k: mapping.pop(k) for k in keys if k in mapping}


def storage_flags(storage: str) -> list[str]:
    """``ocdbt``: zarr3 + OCDBT (the tutorial's); ``plain``: one zarr array per tensor, file names
    that depend only on the tensors, so the same tensors give the same bytes (docs/decisions/content-address.md)."""
    use = "1" if storage == "ocdbt" else "0"
    return [f"checkpoint_storage_use_zarr3={use}", f"checkpoint_storage_use_ocdbt={use}"]
