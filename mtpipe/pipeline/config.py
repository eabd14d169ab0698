"""Configuration: params.yaml + OmegaConf presets in conf/, resolved once per stage.

A branch (``sft`` or ``rl``) names a preset in ``conf/preset/``. The preset composes a model, a
dataset and a hardware preset (its ``defaults:`` mapping; ``defaults.preset`` names a preset it
inherits) and holds one section per stage, with the keys that differ from the schema's defaults.
Values in ``params.yaml`` override the preset; ``null`` there keeps the preset's value. Every key is
checked against the typed schema in :mod:`mtpipe.pipeline.schema` (type, range, combinations), once:
:func:`compose` returns the validated branch.

The ``configure`` stage resolves everything and writes ``config/<branch>/<stage>.yaml``: exactly what
that stage reads, nothing more, plus the fingerprints of the code it runs (``code:``,
:mod:`mtpipe.pipeline.fingerprint`) and the versions of the tools it runs (``tools:``,
:mod:`mtpipe.pipeline.toolchain`). Each pipeline stage depends on its own file, so DVC reruns a
stage when, and only when, a value it reads, the behaviour of its code or a tool's version changes.
A stage loads its file with :func:`load_stage` as a typed, read-only view (:func:`view_model`: the
schema's models of its sections), so ``cfg.train_sft.steps`` is an int the schema checked.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from pydantic import create_model

from mtpipe.errors import ConfigError
from mtpipe.pipeline import fingerprint, schema, toolchain

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = ROOT / "conf"
RESOLVED_DIR = ROOT / "config"

# The sections of the composed branch config that each stage reads.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "hf_download": ("model", "dataset", "hf_download"),
    "to_maxtext": ("model", "to_maxtext"),
    "train_sft": ("model", "dataset", "hardware", "train_sft"),
    "train_rl": ("model", "dataset", "hardware", "train_rl"),
    "to_huggingface": ("model", "to_huggingface"),
    "evaluate_base": ("dataset", "evaluate"),
    "evaluate_warmup": ("model", "dataset", "to_huggingface", "evaluate"),  # exports the warm-up to score it
    "evaluate": ("dataset", "evaluate"),
}
# Keys of those sections outside a stage's address: the preset file names, and what the stage does not
# compute with (where and how patiently it runs) or does not read at all. configure writes them to
# config/run.yaml, which no stage depends on: a change there reruns configure and nothing else.
NAMES = ("model.name", "dataset.name", "hardware.name", "dataset.train_split")
XPK_PLACE = tuple(f"hardware.xpk.{key}" for key in (
    "cluster", "project", "zone", "docker_image", "max_restarts", "priority", "provisioning", "reservation"))
RUN_KEYS: dict[str, tuple[str, ...]] = {
    "hf_download": (*NAMES, "model.maxtext_name", "model.export_name", "model.maxtext_overrides",
                    "dataset.hf_name", "dataset.eval_files"),
    "to_maxtext": (*NAMES, "model.source", "model.export_name"),
    "train_sft": (*NAMES, "model.source", "model.export_name", "dataset.source", *XPK_PLACE),
    "train_rl": (*NAMES, "model.source", "model.export_name", "dataset.source", *XPK_PLACE),
    "to_huggingface": (*NAMES, "model.source", "model.maxtext_name"),
    "evaluate_base": (*NAMES, "dataset.source", "evaluate.server_timeout_s"),
    "evaluate_warmup": (*NAMES, "model.source", "model.maxtext_name", "dataset.source", "evaluate.server_timeout_s"),
    "evaluate": (*NAMES, "dataset.source", "evaluate.server_timeout_s"),
}
RUN_FILE = "config/run.yaml"
BRANCH_STAGES: dict[str, tuple[str, ...]] = {
    "sft": ("hf_download", "to_maxtext", "train_sft", "to_huggingface", "evaluate_base", "evaluate"),
    "rl": ("hf_download", "to_maxtext", "train_sft", "train_rl", "to_huggingface", "evaluate_base", "evaluate_warmup",
           "evaluate"),
}
# The stage outside the branches: make_embedded's view holds the twins it writes (each twin's
# conf/model/<twin>.yaml `maxtext_name` and sizes, :func:`mtpipe.data.embedded.twin_confs`), so a size
# edit reruns it and an `export_name` edit does not, and the embedded directories each branch's
# hf_download copies (``sources``): make_embedded hashes them into artifacts/<branch>/source.json, the
# one input hf_download@<branch> declares besides its view, so a twin no branch uses is in no address.
EMBEDDED_VIEW = ("embedded", "make_embedded")
EMBEDDED_DIR = "embedded"
# params.yaml keys that are not stage sections of a branch.
BRANCH_KEYS = ("preset", *schema.GROUPS)


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


def available(group: str) -> list[str]:
    """Names of the presets in ``conf/<group>/``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _load_named(group: str, name: Any, key: str) -> DictConfig:
    path = CONF_DIR / group / f"{name}.yaml"
    if not isinstance(name, str) or not path.is_file():
        raise ConfigError(
            key, f"unknown {group} preset {name!r}", f"use one of {available(group)} (files in conf/{group}/)"
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
    schema.check_params(OmegaConf.to_container(params, resolve=True))
    branch_params = params[branch]
    preset_name = branch_params.get("preset")
    preset = load_preset(preset_name, f"{branch}.preset")
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
    return schema.check_branch(OmegaConf.to_container(cfg, resolve=True), preset_name)


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


View = schema.Section  # what a stage reads: an instance of view_model(branch, stage)


@functools.cache
def view_model(branch: str, stage: str) -> type[View]:
    """The typed view of ``stage`` in ``branch``: the sections it reads, typed as the branch's model types
    them, the branch's name, ``code``, the fingerprints of its code, and ``tools``, the versions of its tools
    (make_embedded's view: ``twins``, name -> ``maxtext_name`` and ``maxtext_overrides``, and ``sources``,
    :func:`embedded_sources`, instead of sections)."""
    fields: dict[str, Any] = {"code": (dict[str, str], {}), "tools": (dict[str, str], {})}
    if (branch, stage) == EMBEDDED_VIEW:
        fields["twins"] = (dict[str, dict[str, Any]], ...)
        fields["sources"] = (dict[str, dict[str, str]], ...)
    else:
        sections = schema.BRANCHES[branch].model_fields
        fields |= {"branch": (str, ...)} | {s: (sections[s].annotation, ...) for s in STAGE_SECTIONS[stage]}
    return create_model(f"View_{branch}_{stage}", __base__=View, **fields)


def _view_tree(cfg: schema.SftBranch, stage: str) -> dict:
    """The sections of a composed branch that ``stage`` reads, as plain data (YAML's spelling of the keys)."""
    return {s: getattr(cfg, s).model_dump(by_alias=True) for s in STAGE_SECTIONS[stage] if hasattr(cfg, s)} \
        | {"branch": cfg.branch}


def split_run_keys(tree: dict, stage: str) -> dict:
    """Move the :data:`RUN_KEYS` of ``stage`` out of ``tree`` (a view as plain dicts); return them."""
    run: dict = {}
    for dotted in RUN_KEYS.get(stage, ()):
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


def with_run_keys(address: dict, run: dict) -> dict:
    """A stage's address view with its run keys put back: the whole view it reads."""
    out = dict(address)
    for key, value in run.items():
        out[key] = with_run_keys(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def stage_view(cfg: schema.SftBranch, stage: str) -> View:
    """The part of a composed branch that one stage reads, typed (without ``code``)."""
    return view_model(cfg.branch, stage).model_validate(_view_tree(cfg, stage))


def resolved_path(branch: str, stage: str, root: Path = ROOT) -> Path:
    """Where ``configure`` writes the view of ``stage`` in ``branch``."""
    return root / "config" / branch / f"{stage}.yaml"


def _write_if_changed(path: Path, text: str) -> None:
    """Write ``text`` atomically, leaving a file with that text as it is (bytes and mtime: DVC reruns nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not (path.is_file() and path.read_text() == text):
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(text)
        os.replace(tmp, path)


def write_resolved(composed: dict[str, schema.SftBranch], twins: dict[str, dict], root: Path = ROOT) -> list[Path]:
    """Write each stage's address view of the composed branches (:func:`compose_all`), make_embedded's view
    of the ``twins`` (:func:`mtpipe.data.embedded.twin_confs`: passed in, so that no stage's code
    fingerprint holds the generator) and the run keys of all of them (``config/run.yaml``)."""
    views = {(branch, stage): _view_tree(cfg, stage) for branch, cfg in composed.items()
             for stage in BRANCH_STAGES[branch]}
    views[EMBEDDED_VIEW] = {"twins": twins, "sources": embedded_sources(composed)}
    written, run = [], {}
    for (branch, stage), view in views.items():
        if keys := split_run_keys(view, stage):
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


def is_embedded(source: schema.Source) -> bool:
    """Whether a source is a directory make_embedded writes (``kind: local`` under embedded/)."""
    return source.kind == "local" and Path(source.path).parts[:1] == (EMBEDDED_DIR,)


def backends(view: dict) -> dict[str, str]:
    """The backends a view selects (:data:`mtpipe.pipeline.fingerprint.BACKEND_KEYS`): which of the
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
