"""What a stage reads: its resolved view, ``views/<branch>/<stage>.yaml``, typed and checked.

``configure`` (:mod:`mtpipe.pipeline.config`) composes params.yaml and conf/ and writes one view per
stage: the sections the stage reads, minus its run keys (views/run.yaml), plus ``code:`` and
``tools:``, the fingerprints of the code it runs and the versions of its tools. A stage loads its view
with :func:`load_stage`. This module is all of the configuration code a stage runs; composition,
presets and the schema's cross-key rules (:mod:`mtpipe.pipeline.rules`) run in ``configure`` only, so
they are in no other stage's address.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from pydantic import create_model

from mtpipe.errors import ConfigError
from mtpipe.pipeline import fingerprint, schema, toolchain
from mtpipe.pipeline.stage_table import EMBEDDED, RUN_FILE, STAGE_SECTIONS, VIEW

ROOT = Path(__file__).resolve().parents[2]
# The stage outside the branches: make_embedded's view holds the twins it writes and the embedded
# directories each branch's hf_download copies (:func:`mtpipe.pipeline.config.embedded_sources`).
EMBEDDED_VIEW = (EMBEDDED, "make_embedded")

View = schema.Section  # what a stage reads: an instance of view_model(branch, stage)


def load_yaml(path: Path) -> DictConfig:
    """Load one YAML file as a DictConfig."""
    try:
        cfg = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ConfigError(str(path), f"is not valid YAML ({str(err).splitlines()[0]})",
                          "fix the syntax, or restore the file from git") from None
    if not isinstance(cfg, DictConfig):
        raise ConfigError(str(path), "is not a mapping", "write it as `key: value` lines")
    return cfg


@functools.cache
def view_model(branch: str, stage: str) -> type[View]:
    """The typed view of ``stage`` in ``branch``: the sections it reads, typed as the branch's model types
    them, the branch's name, ``code``, the fingerprints of its code, and ``tools``, the versions of its tools
    (make_embedded's view: ``twins``, name -> ``maxtext_name`` and ``maxtext_overrides``, and ``sources``,
    the embedded directories each branch copies, instead of sections)."""
    fields: dict[str, Any] = {"code": (dict[str, str], {}), "tools": (dict[str, str], {})}
    if (branch, stage) == EMBEDDED_VIEW:
        fields["twins"] = (dict[str, dict[str, Any]], ...)
        fields["sources"] = (dict[str, dict[str, str]], ...)
    else:
        sections = schema.BRANCHES[branch].model_fields
        fields |= {"branch": (str, ...)} | {s: (sections[s].annotation, ...) for s in STAGE_SECTIONS[stage]}
    return create_model(f"View_{branch}_{stage}", __base__=View, **fields)


def with_run_keys(address: dict, run: dict) -> dict:
    """A stage's address view with its run keys put back: the whole view it reads."""
    out = dict(address)
    for key, value in run.items():
        out[key] = with_run_keys(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def resolved_path(branch: str, stage: str, root: Path = ROOT) -> Path:
    """Where ``configure`` writes the view of ``stage`` in ``branch``."""
    return root / VIEW.format(branch=branch, stage=stage)


def backends(view: dict) -> dict[str, str]:
    """The backends a view selects (:data:`mtpipe.pipeline.fingerprint.BACKEND_MODULES`): which of the
    optional modules the stage runs."""
    out = {}
    for dotted in fingerprint.BACKEND_MODULES:
        node: Any = view
        for name in dotted.split("."):
            node = node.get(name) if isinstance(node, dict) else getattr(node, name, None)
        if node is not None:
            out[dotted] = node
    return out


def load_stage(branch: str, stage: str, root: Path = ROOT) -> View:
    """Load the resolved view a stage reads (written by the ``configure`` stage), typed and read-only.

    Fails when the view's code fingerprints are not those of the code about to run (``configure``
    did not run after an edit), or its tool versions not those installed (an environment other than
    the lock's), so no output is recorded under another code's or another toolchain's address."""
    path, run_path = resolved_path(branch, stage, root), root / RUN_FILE
    name = str(path.relative_to(root))
    if not path.is_file() or not run_path.is_file():
        raise ConfigError(name if not path.is_file() else RUN_FILE, "not found", "run `dvc repro configure` first")
    address = OmegaConf.to_container(load_yaml(path))
    run = (OmegaConf.to_container(load_yaml(run_path)).get(branch) or {}).get(stage) or {}
    cfg = schema.validate(view_model(branch, stage), with_run_keys(address, run), name,
                          lambda key, requirement: "run `dvc repro configure` (it rewrites the file)")
    recorded, running = cfg.code, fingerprint.stage_code(stage, backends=backends(address))
    if recorded != running:
        moved = sorted(m for m in recorded.keys() | running.keys() if recorded.get(m) != running.get(m))
        raise ConfigError(name, f"was written for other code (changed: {', '.join(moved)})",
                          "run `dvc repro` (it reruns configure first), or `dvc repro configure`")
    if moved := toolchain.installed_mismatches(cfg.tools):
        raise ConfigError(name, f"records other tool versions than installed ({'; '.join(moved)})",
                          "install the lock (`make`), or `dvc repro configure` after `make lock`")
    return cfg
