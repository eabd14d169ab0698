"""The typed schema of the configuration: every key, its type, its range, and what cannot go together.

One pydantic model per section of a composed branch (``model``, ``dataset``, ``hardware`` from conf/,
one per stage from the preset and params.yaml). A field's type says what a value may be; annotated_types
constraints in ``Annotated[...]`` (``Ge(1)``, ``Gt(0), Le(1)``) give its range, :class:`Words` how an
error describes it, and ``Optional`` means ``null`` is allowed (null: the key is not passed, MaxText uses
its own default). A field without a default must be present; one with a default may be left out of
a preset. A stage key that MaxText reads under its own name is marked :data:`MAXTEXT`; its default is
null (MaxText's own) or MaxText's value (tests/test_maxtext_keys.py checks them).

Every model is strict (a string is never taken for a number, a bool never for an int) and forbids
unknown keys. The rules that involve several keys (:func:`combination_errors`) are the branch models'
validator. :func:`validate` is the one place where pydantic's ``ValidationError`` becomes a
:class:`ConfigError` naming the key as params.yaml or the conf/ file spells it, with a fix. Ranges
follow what MaxText 0.2.5 (``configs/types.py``, ``base.yml``, ``post_train/rl.yml``) and Tunix's GRPO
accept; docs/decisions.md ("Config schema") gives the reasons.

Keys checked against MaxText's own pydantic types as well (:mod:`mtpipe.pipeline.maxtext_check`, MaxText's
``MaxTextConfig``, ``RLConfig`` for train_rl, a section's ``maxtext_config``): every key marked
:data:`MAXTEXT`, and every key of the free-form ``model.maxtext_overrides``, ``hardware.maxtext_args``
and ``extra_args`` that MaxText declares.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Optional, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError,
                      WrapValidator, create_model, model_validator)

from mtpipe.errors import ConfigError


@dataclass(frozen=True)
class Words:
    """How errors describe a key: ``means`` replaces the generated description ("a positive integer"),
    ``why`` is added to the problem, ``fix`` replaces the generated fix, ``key`` the key's name."""

    means: str | None = None
    why: str | None = None
    fix: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class MaxTextKey:
    """Marks a stage key that is passed to MaxText under its own name (``key=value``): the command builders
    (mtpipe/maxtext/commands.py) and the check against MaxText's own types (mtpipe/pipeline/maxtext_check.py)
    find it here, through :func:`maxtext_args`. Null is not passed: MaxText's default applies."""


MAXTEXT = MaxTextKey()


def _keep_int(value: Any, handler: Callable[[Any], Any]) -> Any:
    handler(value)  # checks it is a number in range; an int stays an int, as YAML wrote it
    return value


KEEP_INT = WrapValidator(_keep_int)

# Shorthands for the ranges used below.
PositiveInt = Annotated[int, Ge(1)]
LearningRate = Annotated[float, Gt(0), Le(1), KEEP_INT, Words(why="0 learns nothing")]
CommitSha = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{40}$"), Words(
    means="a 40-hex commit sha", fix="pin the commit shown on the Hub's 'Files and versions' page")]


class Section(BaseModel):
    """A section of the configuration: strict types, no unknown keys, read-only once built."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


# ---- conf/model, conf/dataset, conf/hardware ------------------------------------------------------

class Source(Section):
    """Where hf_download gets a model or dataset: a Hub repo at a commit, or a local directory."""

    kind: Literal["hub", "local"]
    repo_id: Optional[str] = None          # kind: hub
    revision: Optional[CommitSha] = None   # kind: hub; branch and tag names move
    path: Optional[str] = None             # kind: local
    allow_patterns: Optional[list[str]] = None
    splits: Optional[Union[str, list[str]]] = None  # datasets without allow_patterns (mtpipe.data.hub)
    subset: Optional[str] = None


class Model(Section):
    name: str                              # the preset's file name (set by compose)
    maxtext_name: str                      # MaxText model_name for conversion and training
    export_name: str                       # model_name for to_huggingface
    source: Source
    maxtext_overrides: dict[str, Any]      # free-form MaxText keys (a tiny model's dims)


class Dataset(Section):
    name: str
    source: Source
    row_schema: Literal["chat", "gsm8k"] = Field(alias="schema")  # what hf_download checks each row against
    hf_name: str                           # the Hub name MaxText sees (GSM8K answer extraction keys on it)
    train_files: str                       # glob inside the download
    eval_files: Optional[str]              # null: no held-out data
    train_split: str
    columns: list[str]


K8sName = Annotated[str, StringConstraints(pattern=r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"), Words(
    means="a lowercase name of at most 40 letters, digits and dashes (what xpk accepts)")]


class Xpk(Section):
    """Where and how an xpk workload runs (``hardware.backend: xpk``, mtpipe/cloud/xpk.py).

    ``null`` in cluster, project, zone, docker_image (and reservation, with provisioning: reservation)
    is a placeholder: the training stage names it with the fix before it submits anything."""

    cluster: Optional[K8sName]             # the GKE cluster `xpk cluster create-pathways` made
    project: Optional[str]
    zone: Optional[str]
    docker_image: Optional[str]            # repository without tag, e.g. us-docker.pkg.dev/P/REPO/mtpipe
    tpu_type: str                          # xpk --tpu-type, e.g. v6e-32
    num_slices: PositiveInt
    max_restarts: Annotated[int, Ge(0), Le(100), Words(why="JobSet restarts after a failure or preemption")]
    priority: Literal["very-low", "low", "medium", "high", "very-high"]
    provisioning: Optional[Literal["reservation", "spot", "on-demand"]]  # null: the cluster's node pools decide
    reservation: Optional[str]             # provisioning: reservation
    pathways: bool                         # create-pathways also for SFT (GRPO always runs on Pathways)


class Hardware(Section):
    name: str
    backend: Literal["local", "xpk"]       # local: MaxText runs here; xpk: a GKE workload (docs/multihost.md)
    processes: Annotated[int, Ge(1), Le(16), Words(why="JAX processes started on this machine")]
    env: dict[str, str]                    # exported for MaxText; environment values are strings
    maxtext_args: dict[str, Any]           # free-form MaxText keys
    xpk: Optional[Xpk] = None              # backend: xpk only


# ---- the per-stage sections of a preset (params.yaml overrides them) ------------------------------

class HfDownload(Section):
    """No options: what to fetch is the model's and dataset's ``source``."""


class ToMaxtext(Section):
    maxtext_config: ClassVar[str] = "MaxTextConfig"

    scan_layers: Annotated[bool, MAXTEXT] = True
    use_multimodal: Annotated[bool, MAXTEXT] = False
    lazy_load_tensors: bool = True         # torch-free numpy loader (the tutorial: false, which needs torch)
    checkpoint_storage: Literal["ocdbt", "plain"] = "plain"  # plain: byte-reproducible; ocdbt: the tutorial's (random file names)
    shards: Optional[PositiveInt] = None   # chunks per tensor (MaxText --simulated_cpu_devices_count; null: its 16)


class TrainSft(Section):
    """SFT of the sft branch. ``steps`` is top level in params.yaml (``dvc exp run -S steps=N``)."""

    maxtext_config: ClassVar[str] = "MaxTextConfig"

    steps: Annotated[int, Ge(1), MAXTEXT, Words(key="steps", fix="set e.g. `dvc exp run -S steps=200`")]
    per_device_batch_size: Annotated[PositiveInt, MAXTEXT]
    max_target_length: Annotated[Optional[Annotated[int, Ge(16), Words(
        why="room for a chat template and an answer")]], MAXTEXT] = None
    learning_rate: Annotated[Optional[LearningRate], MAXTEXT] = None
    num_epoch: Annotated[Optional[PositiveInt], MAXTEXT] = None
    checkpoint_period: Annotated[PositiveInt, MAXTEXT]  # a killed run resumes from the last multiple of this
    max_num_checkpoints_to_keep: Annotated[Optional[Annotated[int, Ge(1), Words(
        why="null: MaxText's default, every checkpoint; the latest is always kept, so a killed run resumes")]],
        MAXTEXT] = None
    eval_interval: Annotated[Optional[Annotated[int, Ge(0), Words(why="0 or null: no evaluation")]], MAXTEXT] = None
    eval_steps: Annotated[Optional[Annotated[int, Ge(-1), Words(why="-1: the whole eval split")]], MAXTEXT] = None
    profiler: Annotated[Literal["", "xplane", "nsys"], MAXTEXT] = ""
    extra_args: dict[str, Any] = {}        # free-form MaxText keys


class WarmupTrainSft(TrainSft):
    """The rl branch's SFT warm-up: 0 steps skips it, and then its other keys may be null."""

    steps: Annotated[int, Ge(0), MAXTEXT, Words(fix="0 starts GRPO from the converted model, "
                                                    "N > 0 warms it up with N SFT steps")]
    per_device_batch_size: Annotated[Optional[PositiveInt], MAXTEXT] = None
    checkpoint_period: Annotated[Optional[PositiveInt], MAXTEXT] = None


class TrainRl(Section):
    maxtext_config: ClassVar[str] = "RLConfig"

    rollout_backend: Literal["cpu_jax", "vllm"]  # vllm: MaxText's (TPU); cpu_jax: mtpipe.maxtext.rollout_cpu
    chips_per_vm: Annotated[PositiveInt, MAXTEXT]
    num_batches: Annotated[PositiveInt, MAXTEXT]
    num_test_batches: Annotated[PositiveInt, MAXTEXT]
    batch_size: Annotated[Optional[PositiveInt], MAXTEXT] = None
    num_generations: Annotated[Optional[Annotated[int, Ge(2), Words(
        why="GRPO's advantage compares each completion with the others of its prompt")]], MAXTEXT] = None
    rollout_data_parallelism: Annotated[int, Ge(-1), MAXTEXT, Words(why="-1: as many as fit")]
    rollout_tensor_parallelism: Annotated[int, Ge(-1), MAXTEXT, Words(why="-1: as many as fit")]
    grpo_beta: Annotated[Optional[Annotated[float, Ge(0), KEEP_INT, Words(
        why="the weight of a KL penalty")]], MAXTEXT] = None
    grpo_epsilon: Annotated[Optional[Annotated[float, Gt(0), Lt(1), KEEP_INT, Words(
        why="the ratio is clipped to [1-e, 1+e]")]], MAXTEXT] = None
    learning_rate: Annotated[Optional[LearningRate], MAXTEXT] = None
    max_prefill_predict_length: Annotated[Optional[PositiveInt], MAXTEXT] = None
    max_target_length: Annotated[Optional[PositiveInt], MAXTEXT] = None
    max_num_checkpoints_to_keep: Annotated[Optional[Annotated[int, Ge(1), Words(
        why="null: MaxText's rl.yml, 10; the latest is always kept, so a killed run resumes")]], MAXTEXT] = None
    extra_args: dict[str, Any] = {}


class ToHuggingface(Section):
    maxtext_config: ClassVar[str] = "MaxTextConfig"

    scan_layers: Annotated[bool, MAXTEXT] = True
    use_multimodal: Annotated[bool, MAXTEXT] = False
    weight_dtype: Annotated[Literal["float32", "bfloat16"], MAXTEXT] = "float32"


class Evaluate(Section):
    """The evaluate stages (mtpipe/evaluation): GSM8K through lm-eval (rl), held-out loss (sft)."""

    backend: Literal["cpu", "vllm"]        # the model server: ours (numpy, the CPU) | vLLM's (a TPU VM)
    # rl: lm-eval's gsm8k_cot_llama (how Llama 3.1 Instruct is scored) | gsm8k_rl_format (train_rl's
    # prompt and <answer> tags, the format a model trained by this branch answers in)
    task: Literal["gsm8k_cot_llama", "gsm8k_rl_format"] = "gsm8k_cot_llama"
    num_problems: Optional[PositiveInt] = None  # the first N test problems / conversations; null: all of them
    num_fewshot: Annotated[int, Ge(0)] = 0  # rl: few-shot examples as chat turns (gsm8k_cot_llama: 8)
    max_new_tokens: PositiveInt = 256       # rl: the longest answer generated (lm-eval's default)
    max_length: Annotated[int, Ge(16)]     # vLLM's --max-model-len; sft: conversations are cut to it
    tensor_parallel_size: PositiveInt = 1  # vllm: chips per model replica
    server_timeout_s: Annotated[float, Gt(0), KEEP_INT] = 600  # how long the server may take to load the model


# ---- a whole branch, and params.yaml ---------------------------------------------------------------

class SftStages(Section):
    hf_download: HfDownload = HfDownload()
    to_maxtext: ToMaxtext = ToMaxtext()
    train_sft: TrainSft
    to_huggingface: ToHuggingface = ToHuggingface()
    evaluate: Evaluate


class RlStages(SftStages):
    train_sft: WarmupTrainSft
    train_rl: TrainRl


class Parts(Section):
    """A branch's model, dataset and hardware, as composed from conf/<group>/<name>.yaml."""

    model: Model
    dataset: Dataset
    hardware: Hardware


class PartNames(Section):
    """How params.yaml picks a branch's preset and, optionally, other parts than the preset's."""

    preset: str
    model: Optional[str]
    dataset: Optional[str]
    hardware: Optional[str]


class SftBranch(SftStages, Parts):
    branch: str

    @model_validator(mode="after")
    def check_combinations(self) -> "SftBranch":
        return _first_combination_error(self)


class RlBranch(RlStages, Parts):
    branch: str

    @model_validator(mode="after")
    def check_combinations(self) -> "RlBranch":
        return _first_combination_error(self)


class SftParams(SftStages, PartNames):
    pass


class RlParams(RlStages, PartNames):
    pass


class Params(Section):
    """params.yaml; :func:`check_params` checks it with every key optional (null: keep the preset's value)."""

    steps: Optional[Annotated[int, Ge(1), Words(fix="set e.g. `dvc exp run -S steps=200`")]]
    sft: SftParams
    rl: RlParams


BRANCHES: dict[str, type[SftBranch] | type[RlBranch]] = {"sft": SftBranch, "rl": RlBranch}
GROUPS = ("model", "dataset", "hardware")


# MaxText's defaults (post_train/rl.yml) for the keys a combination rule needs when a preset says null.
# tests/test_schema.py checks them against the installed MaxText.
MAXTEXT_RL_DEFAULTS = {"max_prefill_predict_length": 256, "max_target_length": 1024}
MAXTEXT_SCAN_LAYERS_DEFAULT = True  # base.yml: what the trainers use unless told otherwise


# ---- pydantic's errors as ConfigErrors -------------------------------------------------------------

Fix = Callable[[str, str], str]  # (key as shown, requirement) -> the fix sentence


def validate[M: BaseModel](model: type[M], value: Any, key: str, fix: Fix) -> M:
    """``model`` built from ``value`` (plain dicts and lists); the first error as a ConfigError.

    ``key`` is the section's name as params.yaml spells it ('' for params.yaml itself)."""
    try:
        return model.model_validate(value)
    except ValidationError as err:
        raise _config_error(_first(err.errors()), model, value, key, fix) from None


def _first(errors: list[dict]) -> dict:
    """The error to report: pydantic's first, unless a section on its way to that key has an unknown
    key; then the outermost such unknown key (a misspelt key is fixed before the values under it)."""
    first = errors[0]

    def on_the_way(error: dict) -> bool:
        section = error["loc"][:-1]
        return first["loc"][:len(section)] == section

    unknown = [e for e in errors if e["type"] == "extra_forbidden" and on_the_way(e)]
    return min(unknown, key=lambda e: len(e["loc"]), default=first)


def _config_error(error: dict, model: type[BaseModel], value: Any, key: str, fix: Fix) -> ConfigError:
    """One pydantic error (its ``loc`` a path of keys) as the ConfigError for the key it is about."""
    if error["type"] == "value_error" and isinstance(error["ctx"]["error"], ConfigError):
        return error["ctx"]["error"]  # a combination rule's own error
    hint: Any = model
    for name in error["loc"]:  # down the sections; a field's type may add more (a union arm, a list index)
        section = _section(hint)
        if section is None or name not in _fields(section):
            break
        hint, key = _fields(section)[name], _join(key, name)
        value = value.get(name) if isinstance(value, dict) else None
    section = _section(hint)
    if error["type"] == "extra_forbidden":
        known = list(_fields(section))
        return ConfigError(_join(key, error["loc"][-1]), f"is not a key of {key or 'params.yaml'}",
                           f"use one of {known}, or fix the spelling" if known else "remove it")
    if error["type"] == "missing":
        return ConfigError(key, "is missing", fix(key, "to a value (null: MaxText's default, where allowed)"))
    if section is not None:
        return ConfigError(key, f"is a section, got {value!r}", f"set its keys, e.g. {key}.<key>: ...")
    base, meta = _split(hint)
    words = next((m for m in meta if isinstance(m, Words)), Words())
    key = words.key or key
    why = f" ({words.why})" if words.why else ""
    bounds = _bounds(meta)
    wanted = words.means or _describe(base, bounds)
    return ConfigError(key, f"must be {wanted}{why}, got {value!r}",
                       words.fix or fix(key, bounds or f"to {wanted}"))


@functools.cache
def _fields(model: type[BaseModel]) -> dict[str, Any]:
    """A model's keys as the YAML spells them (aliases), each with its full type hint."""
    return {f.alias or name: Annotated[f.annotation, *f.metadata] if f.metadata else f.annotation
            for name, f in model.model_fields.items()}


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, type(int | str))


def _strip_none(hint: Any) -> Any:
    if not (_is_union(hint) and type(None) in get_args(hint)):
        return hint
    rest = [a for a in get_args(hint) if a is not type(None)]
    return rest[0] if len(rest) == 1 else Union[tuple(rest)]


def _split(hint: Any) -> tuple[Any, tuple]:
    """(type, metadata) of a hint: ``Optional`` left out, nested ``Annotated`` layers' metadata together."""
    meta: tuple = ()
    while get_origin(hint := _strip_none(hint)) is Annotated:
        hint, *more = get_args(hint)
        meta += tuple(more)
    return hint, meta


def _section(hint: Any) -> type[BaseModel] | None:
    base = _split(hint)[0]
    return base if isinstance(base, type) and issubclass(base, BaseModel) else None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _bounds(meta: tuple) -> str:
    """The range in symbols: ``>= 1``, ``in (0, 1]``; '' for none."""
    c = {name: getattr(m, name) for m in meta if isinstance(m, (Ge, Gt, Le, Lt))
         for name in ("ge", "gt", "le", "lt") if hasattr(m, name)}
    low = (c["ge"], "[", ">=") if "ge" in c else (c["gt"], "(", ">") if "gt" in c else None
    high = (c["le"], "]", "<=") if "le" in c else (c["lt"], ")", "<") if "lt" in c else None
    if low and high:
        return f"in {low[1]}{_num(low[0])}, {_num(high[0])}{high[1]}"
    if low or high:
        bound = low or high
        return f"{bound[2]} {_num(bound[0])}"
    return ""


def _describe(hint: Any, bounds: str = "") -> str:
    """In words: "a positive integer", "a number in (0, 1]", "one of 'a', 'b'"."""
    if hint is int:
        return "a positive integer" if bounds == ">= 1" else f"an integer {bounds}".rstrip()
    if hint is float:
        return f"a number {bounds}".rstrip()
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    words = {bool: "true or false", str: "a string", Any: "any value"}
    if hint in words:
        return words[hint]
    if _is_union(hint):
        return " or ".join(_describe(_split(arm)[0]) for arm in get_args(hint))
    if get_origin(hint) is list:
        return f"a list of {_describe(_split(get_args(hint)[0])[0]).removeprefix('a ')}s"
    if get_origin(hint) is dict:
        return f"a mapping of names to {_describe(_split(get_args(hint)[1])[0]).removeprefix('a ')}s"
    return hint.__name__


@functools.cache
def partial(model: type[Section]) -> type[Section]:
    """``model`` with every key optional and null allowed, in its sections too: params.yaml's overrides."""
    def loose(hint: Any) -> Any:
        section = _section(hint)
        return Optional[partial(section) if section else hint]
    return create_model(f"Partial{model.__name__}", __base__=Section, **{
        name: (loose(_fields(model)[f.alias or name]), Field(None, alias=f.alias))
        for name, f in model.model_fields.items()})


# ---- the keys passed to MaxText -------------------------------------------------------------------------

@functools.cache
def maxtext_keys(section: type[Section]) -> tuple[str, ...]:
    """The keys of a stage's section marked :data:`MAXTEXT`, in the order they are declared."""
    return tuple(name for name, hint in _fields(section).items() if MAXTEXT in _split(hint)[1])


def maxtext_args(section: Section) -> dict[str, Any]:
    """The :func:`maxtext_keys` of a section with the values MaxText gets: a null or empty value (MaxText's
    own default, e.g. ``profiler: ""``) is left out."""
    return {key: value for key in maxtext_keys(type(section)) if (value := getattr(section, key)) not in (None, "")}


# ---- rules that involve several keys ---------------------------------------------------------------

def combination_errors(cfg: SftBranch) -> list[ConfigError]:
    """Values that are each valid but cannot work together (docs/decisions.md, "Config schema").

    In the order they are checked; :func:`check_branch` reports the first.
    """
    b, errors = cfg.branch, []
    model_file, data_file = f"conf/model/{cfg.model.name}.yaml", f"conf/dataset/{cfg.dataset.name}.yaml"

    def add(key: str, problem: str, fix: str) -> None:
        errors.append(ConfigError(key, problem, fix))

    # A Hub source is pinned to a commit; a local one needs its directory.
    for group, part, file in (("model", cfg.model, model_file), ("dataset", cfg.dataset, data_file)):
        src, key = part.source, f"{b}.{group}.source"
        if src.kind == "hub" and not src.repo_id:
            add(f"{key}.repo_id", "is missing for a kind: hub source", f"set source.repo_id: <org>/<name> in {file}")
        if src.kind == "hub" and src.revision is None:
            add(f"{key}.revision", "must be a 40-hex commit sha for a kind: hub source, got None",
                f"pin the commit shown on the Hub's 'Files and versions' page in {file}")
        if src.kind == "local" and not src.path:
            add(f"{key}.path", "is missing for a kind: local source", f"set source.path: <directory> in {file}")
    if cfg.dataset.row_schema == "chat" and len(cfg.dataset.columns) != 1:
        add(f"{b}.dataset.columns", f"is {cfg.dataset.columns}, but a chat dataset is one column of messages",
            f"set columns: [messages] in {data_file}")

    hw, hw_file = cfg.hardware, f"conf/hardware/{cfg.hardware.name}.yaml"
    if hw.processes > 1:  # several JAX processes on one machine: MaxText's CPU start-up (docs/multihost.md)
        if hw.backend != "local" or hw.env.get("JAX_PLATFORMS") != "cpu" or hw.maxtext_args.get("hardware") != "cpu" \
                or hw.maxtext_args.get("skip_jax_distributed_system") is not False:
            add(f"{b}.hardware.processes", f"is {hw.processes}, but only JAX on the CPU starts several processes on "
                "one machine (a TPU host runs one process for all its chips)",
                f"set processes: 1 in {hw_file}, or env JAX_PLATFORMS: cpu and maxtext_args hardware: cpu, "
                "skip_jax_distributed_system: false (as conf/hardware/cpu-2proc.yaml)")
        if isinstance(cfg, RlBranch):
            add(f"{b}.hardware", f"is {hw.name} ({hw.processes} processes), but the CPU rollout of train_rl runs in "
                "one process; multi-host GRPO is a Pathways workload on GKE",
                "set rl.hardware: cpu (or a v6e-* preset with backend: xpk on GKE)")

    hw, hw_file = cfg.hardware, f"conf/hardware/{cfg.hardware.name}.yaml"
    if hw.backend == "xpk" and hw.xpk is None:
        add(f"{b}.hardware.xpk", "is missing, but backend: xpk runs training as an xpk workload and needs its "
            "cluster, TPU type and image", f"add an xpk: section to {hw_file} (conf/hardware/v6e-32.yaml has one)")
    if hw.backend == "xpk" and hw.processes != 1:
        add(f"{b}.hardware.processes", f"is {hw.processes}, but on GKE each host of the slice runs one process",
            f"set processes: 1 in {hw_file}")

    # Conversion, training and export must agree on the parameter layout, or loading fails.
    trainers = [("train_sft", cfg.train_sft.extra_args)] if cfg.train_sft.steps > 0 else []
    if isinstance(cfg, RlBranch):
        trainers.append(("train_rl", cfg.train_rl.extra_args))
    for stage, extra_args in trainers:
        args = {**cfg.hardware.maxtext_args, **extra_args}
        train_scan = str(args.get("scan_layers", MAXTEXT_SCAN_LAYERS_DEFAULT)).lower() == "true"
        if cfg.to_maxtext.scan_layers != train_scan:
            add(f"{b}.to_maxtext.scan_layers", f"is {cfg.to_maxtext.scan_layers}, but {stage} runs with "
                f"scan_layers={train_scan} and could not load the converted checkpoint",
                f"set {b}.to_maxtext.scan_layers: {str(train_scan).lower()} in params.yaml")
    for option in ("scan_layers", "use_multimodal"):
        converted, exported = getattr(cfg.to_maxtext, option), getattr(cfg.to_huggingface, option)
        if converted != exported:
            add(f"{b}.to_huggingface.{option}", f"is {exported}, but the checkpoint was converted with "
                f"{option}={converted}: the export would look for parameters that are not there",
                f"set {b}.to_huggingface.{option}: {str(converted).lower()} in params.yaml, like {b}.to_maxtext")

    sft = cfg.train_sft
    steps_key = "steps" if b == "sft" else f"{b}.train_sft.steps"
    if sft.steps > 0:  # only the rl branch's warm-up may say 0 (skip); then these may be null
        for key in ("per_device_batch_size", "checkpoint_period"):
            if getattr(sft, key) is None:
                add(f"{b}.train_sft.{key}", f"must be a positive integer when {steps_key} > 0, got None",
                    f"set {b}.train_sft.{key} >= 1 in params.yaml, or {steps_key}: 0")
        if sft.eval_interval and cfg.dataset.eval_files is None:
            add(f"{b}.train_sft.eval_interval", f"asks for an evaluation every {sft.eval_interval} steps, but "
                f"dataset {cfg.dataset.name} has no eval_files",
                f"set {b}.train_sft.eval_interval: 0 in params.yaml, or eval_files in {data_file}")

    if isinstance(cfg, RlBranch):
        rl = cfg.train_rl
        if cfg.dataset.row_schema != "gsm8k":
            add("rl.dataset", f"{cfg.dataset.name} has schema {cfg.dataset.row_schema!r}, but train_rl reads "
                "question/answer rows and rewards the number after `####`",
                "set rl.dataset to a gsm8k-schema dataset (gsm8k, gsm8k-tiny)")
        elif cfg.dataset.hf_name != "openai/gsm8k":
            add("rl.dataset.hf_name", f"is {cfg.dataset.hf_name!r}, but MaxText takes the answer after `####` "
                "only for dataset_name openai/gsm8k: every answer reward would be 0",
                f"set hf_name: openai/gsm8k in {data_file}")
        if cfg.dataset.eval_files is None:
            add("rl.train_rl.num_test_batches", f"needs held-out prompts, but dataset {cfg.dataset.name} has no "
                "eval_files", f"set eval_files in {data_file}")
        prefill = rl.max_prefill_predict_length or MAXTEXT_RL_DEFAULTS["max_prefill_predict_length"]
        target = rl.max_target_length or MAXTEXT_RL_DEFAULTS["max_target_length"]
        if prefill >= target:
            add("rl.train_rl.max_target_length", f"is {target}, not more than max_prefill_predict_length "
                f"{prefill}: completions get max_target_length - max_prefill_predict_length tokens",
                "set rl.train_rl.max_target_length above rl.train_rl.max_prefill_predict_length (null means "
                "MaxText's {max_prefill_predict_length} and {max_target_length})".format(**MAXTEXT_RL_DEFAULTS))
        errors += _rollout_parallelism_errors(rl)
        if cfg.evaluate.task == "gsm8k_rl_format" and cfg.evaluate.num_fewshot:
            add("rl.evaluate.num_fewshot", f"is {cfg.evaluate.num_fewshot}, but task gsm8k_rl_format has no "
                "few-shot examples (train_rl's prompt is zero-shot)",
                "set rl.evaluate.num_fewshot: 0, or rl.evaluate.task: gsm8k_cot_llama")
        if rl.rollout_backend == "vllm" and cfg.hardware.env.get("JAX_PLATFORMS") == "cpu":
            add("rl.train_rl.rollout_backend", f"vllm needs a TPU, but hardware {cfg.hardware.name} runs JAX "
                "on the CPU", "set rl.train_rl.rollout_backend: cpu_jax, or rl.hardware: v6e-8 (on a TPU VM)")
    return errors


def _rollout_parallelism_errors(rl: TrainRl) -> list[ConfigError]:
    """MaxText's rule (get_rollout_kwargs_for_parallelism): the rollout's data x tensor x expert
    parallelism fills the sampler's chips (all chips_per_vm of one VM); at most one of them is -1."""
    ep = rl.extra_args.get("rollout_expert_parallelism", 1)
    sizes = {"rollout_data_parallelism": rl.rollout_data_parallelism,
             "rollout_tensor_parallelism": rl.rollout_tensor_parallelism}
    if not isinstance(ep, int) or isinstance(ep, bool):
        return []  # a free-form extra_args value: MaxText checks it
    auto = [k for k, v in {**sizes, "rollout_expert_parallelism": ep}.items() if v == -1]
    product = math.prod(v for v in (*sizes.values(), ep) if v != -1)
    key = "rl.train_rl.rollout_tensor_parallelism"
    fix = "set rl.train_rl.rollout_data_parallelism: 1 and rl.train_rl.rollout_tensor_parallelism: -1 " \
          "(one replica on all chips)"
    if len(auto) > 1:
        return [ConfigError(key, f"{' and '.join(auto)} are -1, but MaxText derives at most one of them", fix)]
    if auto and rl.chips_per_vm % product:
        return [ConfigError(key, f"the fixed parallelism {product} does not divide chips_per_vm "
                            f"{rl.chips_per_vm}, so {auto[0]} cannot be derived", fix)]
    if not auto and product != rl.chips_per_vm:
        return [ConfigError(key, f"data x tensor x expert parallelism is {product}, but the rollout runs on "
                            f"the VM's chips (chips_per_vm: {rl.chips_per_vm})", fix)]
    return []


def _first_combination_error[B: SftBranch](cfg: B) -> B:
    errors = combination_errors(cfg)
    if errors:
        raise errors[0]
    return cfg


def fix_for(composed: dict, preset: str) -> Fix:
    """Where to set a key of the composed branch: params.yaml, or the conf/ file its section comes from."""
    def fix(key: str, requirement: str) -> str:
        parts = key.split(".")
        if len(parts) > 2 and parts[1] in GROUPS:
            return f"set {'.'.join(parts[2:])} {requirement} in conf/{parts[1]}/{composed[parts[1]]['name']}.yaml"
        return f"set {key} {requirement} in params.yaml (or in conf/preset/{preset}.yaml)"
    return fix


def check_branch(composed: dict, preset: str) -> SftBranch:
    """Check a composed branch (plain dicts): every section's keys, types and ranges, then the combinations.

    Keys are named ``<branch>.<section>.<key>``; the fix says where to set them (:func:`fix_for`). The
    values passed to MaxText are checked against MaxText's own types by :mod:`mtpipe.pipeline.maxtext_check`
    (``configure``, preflight and the VM checks run it; a stage, which only loads its view, does not).
    """
    return validate(BRANCHES[composed["branch"]], composed, composed["branch"], fix_for(composed, preset))


def check_params(params: dict) -> None:
    """Check params.yaml's overrides by themselves, before they are merged into a preset."""
    validate(partial(Params), params, "", lambda key, req: f"set {key} {req} in params.yaml "
             "(null keeps the preset's value)")
