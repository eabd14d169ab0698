"""Configuration: params.yaml + OmegaConf presets in conf/, resolved once per stage.

A branch (``sft`` or ``rl``) names a preset in ``conf/preset/``. The preset composes a model, a
dataset and a hardware preset (its ``defaults:`` mapping; ``defaults.preset`` names a preset it
inherits) and holds one section per stage, with the keys that differ from the schema's defaults.
Values in ``params.yaml`` override the preset; ``null`` there keeps the preset's value. Every key is
checked against the typed schema in :mod:`mtpipe.pipeline.schema` (type, range) and the rules of
:mod:`mtpipe.pipeline.rules` (combinations), once: :func:`compose` returns the validated branch.

The ``configure`` stage resolves everything and writes ``views/<branch>/<stage>.yaml``: exactly what
that stage reads, nothing more, plus the fingerprints of the code it runs (``code:``,
:mod:`mtpipe.pipeline.fingerprint`) and the versions of the tools it runs (``tools:``,
:mod:`mtpipe.pipeline.toolchain`). Each pipeline stage depends on its own file, so DVC reruns a
stage when, and only when, a value it reads, the behaviour of its code or a tool's version changes.
This module runs in ``configure`` (and in the laptop's planning); a stage loads its file with
:func:`mtpipe.pipeline.view.load_stage` and runs none of the code here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mtpipe.errors import ConfigError
from mtpipe.pipeline import fingerprint, rules, schema, toolchain
from mtpipe.pipeline.stage import is_embedded
from mtpipe.pipeline.stage_table import BRANCH_STAGES, RUN_FILE, STAGE_SECTIONS
from mtpipe.pipeline.view import EMBEDDED_VIEW, ROOT, backends, load_yaml, resolved_path, view_model

CONF_DIR = ROOT / "conf"

# make_embedded's view (view.EMBEDDED_VIEW) holds the twins it writes (each twin's conf/model/<twin>.yaml
# `maxtext_name` and sizes, :func:`twin_confs`), so a size edit reruns it and an
# `export_name` edit does not, and the embedded directories each branch's hf_download copies
# (``sources``): make_embedded hashes them into artifacts/<branch>/source.json, the one input
# hf_download@<branch> declares besides its view, so a twin no branch uses is in no address.
# params.yaml keys that are not stage sections of a branch.
BRANCH_KEYS = ("preset", *schema.GROUPS)


def available(group: str) -> list[str]:
    """Names of the presets in ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _load_named(group: str, name: Any, key: str) -> DictConfig:
    path = CONF_DIR / group / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        raise ConfigError(   # "unknown preset 'x'", "unknown model preset 'x'"
            key, f"unknown {'preset' if group == 'preset' else f'{group} preset'} {name!r}",
            f"use one of {available(group)} (files in conf/{group}/)",
        )
    return load_yaml(path)


def compose(branch: str, params: DictConfig) -> schema.SftBranch:
    """Compose one branch: its preset's parts, the preset, then non-null params overrides; checked once.

    params.yaml is checked against the schema (mtpipe/pipeline/schema.py) before the merge, the composed
    branch after it, so every error names the key and says where to fix it. The result is the branch's
    typed model (:class:`~mtpipe.pipeline.schema.SftBranch` or ``RlBranch``), schema defaults filled in.
    """
    if branch not in params or not isinstance(params[branch], DictConfig):
        raise ConfigError(branch, "missing section in params.yaml", f"restore the `{branch}:` section from git")
    rules.check_params(OmegaConf.to_container(params, resolve=True))
    branch_params = params[branch]
    preset_name = branch_params.get("preset")
    preset = load_preset(preset_name, f"{branch}.preset")
    _refuse_other_branch(preset, preset_name, branch)
    defaults = preset.pop("defaults", {})
    parts = {}
    for group in schema.GROUPS:
        name = branch_params.get(group) or defaults.get(group)
        parts[group] = _load_named(group, name, f"{branch}.{group}")
        parts[group].name = name
    overrides = _drop_nulls({k: v for k, v in OmegaConf.to_container(branch_params).items()
                             if k not in BRANCH_KEYS})
    cfg = OmegaConf.merge(OmegaConf.create(parts), preset, overrides)
    if branch == "sft" and params.get("steps") is not None:
        cfg.train_sft.steps = params.steps
    cfg.branch = branch
    reject_secrets(cfg, branch)
    return rules.check_branch(OmegaConf.to_container(cfg, resolve=True), preset_name)


def _refuse_other_branch(preset: DictConfig, name: str, branch: str) -> None:
    """A preset with a stage section only another branch has (an RL preset's train_rl as sft.preset) is
    that branch's: the error names the branch key to use, not the section the user never typed."""
    for other, stages in BRANCH_STAGES.items():
        foreign = sorted(set(preset) & set(stages) - set(BRANCH_STAGES[branch]))
        if other != branch and foreign:
            raise ConfigError(f"{branch}.preset", f"{name!r} has {', '.join(foreign)}: a preset of the {other} "
                              f"branch, whose stages {branch} does not run",
                              f"use {other}.preset={name} (or one of the {branch} presets), or remove "
                              f"{', '.join(foreign)} from conf/preset/{name}.yaml")


def compose_all(params: DictConfig) -> dict[str, schema.SftBranch]:
    """Every branch, composed and checked (:func:`compose`)."""
    return {branch: compose(branch, params) for branch in BRANCH_STAGES}


def load_preset(name: Any, key: str, heirs: tuple[str, ...] = ()) -> DictConfig:
    """``conf/preset/<name>.yaml`` over the preset it inherits (``defaults: {preset: <parent>}``), merged key
    by key, its ``defaults`` mapping too: conf/preset/*-v6e32.yaml are their v6e-8 presets on other hardware."""
    preset = _load_named("preset", name, key)
    parent = preset.get("defaults", {}).get("preset")
    if parent is None:
        return preset
    where = f"conf/preset/{name}.yaml"
    if parent in (name, *heirs):
        raise ConfigError(f"{where} defaults.preset", f"inherits from itself ({' -> '.join((*heirs, name, parent))})",
                          "make the chain of defaults.preset end at a preset without one")
    merged = OmegaConf.merge(load_preset(parent, f"{where} defaults.preset", (*heirs, name)), preset)
    merged.defaults.pop("preset")
    return merged


def _drop_nulls(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _drop_nulls(v) for k, v in tree.items() if v is not None and _drop_nulls(v) != {}}
    return tree


TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{20,}")


def reject_secrets(tree: Any, key: str) -> None:
    """Tokens never go into params, presets or resolved views (they end up in git and dvc.lock)."""
    if isinstance(tree, DictConfig):
        for k, v in tree.items():
            if k == "hf_access_token":
                raise ConfigError(f"{key}.{k}", "a token in the config would be written to git, dvc.lock and argv",
                                  "remove it and `export HF_TOKEN=...` instead")
            reject_secrets(v, f"{key}.{k}")
    elif isinstance(tree, str) and TOKEN_LIKE.search(tree):
        raise ConfigError(key, "looks like a Hugging Face token", "remove it and `export HF_TOKEN=...` instead")


def load_params(path: Path = ROOT / "params.yaml") -> DictConfig:
    """Read params.yaml."""
    if not path.is_file():
        raise ConfigError("params.yaml", "not found", "run from the repository root, or restore it from git")
    return load_yaml(path)


def _view_tree(cfg: schema.SftBranch, stage: str) -> dict:
    """The sections of a composed branch that ``stage`` reads, as plain data (YAML's spelling of the keys)."""
    return {s: getattr(cfg, s).model_dump(by_alias=True) for s in STAGE_SECTIONS[stage] if hasattr(cfg, s)} \
        | {"branch": cfg.branch}


def split_run_keys(tree: dict, branch: str, stage: str) -> dict:
    """Move the run keys of ``stage`` out of ``tree`` (its view as plain dicts) and return them: the keys of
    its sections that it does not compute with, as the schema marks them (:class:`~mtpipe.pipeline.schema.ReadBy`)."""
    run: dict = {}
    sections = schema.BRANCHES[branch].model_fields if branch in schema.BRANCHES else {}
    for dotted in (f"{section}.{key}" for section in STAGE_SECTIONS.get(stage, ())
                   for key in schema.run_keys(sections[section].annotation, stage)):
        *parents, key = dotted.split(".")
        src, dst = tree, run
        for name in parents:
            if not isinstance(src.get(name), dict):
                break
            src, dst = src[name], dst.setdefault(name, {})
        else:
            if key in src:
                dst[key] = src.pop(key)
    return run


def stage_view(cfg: schema.SftBranch, stage: str) -> schema.Section:
    """The part of a composed branch that one stage reads, typed (without ``code``)."""
    return view_model(cfg.branch, stage).model_validate(_view_tree(cfg, stage))


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` atomically, leaving a file with that text as it is (bytes and mtime: DVC reruns nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.is_file() and path.read_text() == text):
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(text)
        os.replace(tmp, path)


def write_resolved(composed: dict[str, schema.SftBranch], twins: dict[str, dict], root: Path = ROOT) -> list[Path]:
    """Write each stage's address view of the composed branches (:func:`compose_all`), make_embedded's view
    of the ``twins`` (:func:`twin_confs` of the embedded families) and the run keys of all of them (``views/run.yaml``)."""
    views = {(branch, stage): _view_tree(cfg, stage) for branch, cfg in composed.items()
             for stage in BRANCH_STAGES[branch]}
    views[EMBEDDED_VIEW] = {"twins": twins, "sources": embedded_sources(composed)}
    written, run = [], {}
    for (branch, stage), view in views.items():
        if keys := split_run_keys(view, branch, stage):
            run.setdefault(branch, {})[stage] = keys
        view["code"] = fingerprint.stage_code(stage, backends=backends(view))
        view["tools"] = toolchain.stage_tools(stage, backends=backends(view))
        path = resolved_path(branch, stage, root)
        _write_if_changed(path, OmegaConf.to_yaml(OmegaConf.create(view), sort_keys=True))
        written.append(path)
    _write_if_changed(root / RUN_FILE, OmegaConf.to_yaml(OmegaConf.create(run), sort_keys=True))
    return [*written, root / RUN_FILE]


def embedded_sources(composed: dict[str, schema.SftBranch]) -> dict[str, dict[str, str]]:
    """Per branch, the directories under embedded/ its hf_download copies: ``{"model": "embedded/gemma3-tiny",
    "dataset": ...}``; a Hub source (or a local one elsewhere) has no entry, so a branch on the Hub reads
    nothing make_embedded writes."""
    return {branch: {role: src.path for role, src in (("model", cfg.model.source), ("dataset", cfg.dataset.source))
                     if is_embedded(src)}
            for branch, cfg in composed.items()}


def twin_confs(names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """What the bytes of the embedded twins ``names`` depend on in conf/: each one's ``maxtext_name`` and
    ``maxtext_overrides`` from conf/model/<name>.yaml (make_embedded's view, ``twins``)."""
    confs = {name: OmegaConf.to_container(load_yaml(CONF_DIR / "model" / f"{name}.yaml")) for name in names}
    return {name: {key: conf[key] for key in ("maxtext_name", "maxtext_overrides")} for name, conf in confs.items()}
