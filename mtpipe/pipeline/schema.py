"""The typed schema of the configuration: every key, its type, its range, and what cannot go together.

One pydantic model per section of a composed branch (``model``, ``dataset``, ``hardware`` from conf/,
one per stage from the preset and params.yaml). A field's type says what a value may be; annotated_types
constraints in ``Annotated[...]`` (``Ge(1)``, ``Gt(0), Le(1)``) give its range, :class:`Words` how an
error describes it, and ``Optional`` means ``null`` is allowed (null: the key is not passed, MaxText uses
its own default). A field without a default must be present; one with a default may be left out of
a preset. A stage key that MaxText reads under its own name is marked :data:`MAXTEXT`; its default is
null (MaxText's own) or MaxText's value (tests/pipeline/test_maxtext_keys.py checks them). A key that only some of
the stages reading its section compute with is marked :class:`ReadBy`: the others get it as a run key.

Every model is strict (a string is never taken for a number, a bool never for an int) and forbids
unknown keys. The rules that involve several keys are :mod:`mtpipe.pipeline.rules` (``configure``
runs them, a stage does not). :func:`validate` is the one place where pydantic's ``ValidationError`` becomes a
:class:`ConfigError` naming the key as params.yaml or the conf/ file spells it, with a fix. Ranges
follow what MaxText 0.2.5 (``configs/types.py``, ``base.yml``, ``post_train/rl.yml``) and Tunix's GRPO
accept; docs/decisions/config.md gives the reasons.

Keys checked against MaxText's own pydantic types as well (:mod:`mtpipe.pipeline.maxtext_check`, MaxText's
``MaxTextConfig``, ``RLConfig`` for train_rl, a section's ``maxtext_config``): every key marked
:data:`MAXTEXT`, and every key of the free-form ``model.maxtext_overrides``, ``hardware.maxtext_args``
and ``extra_args`` that MaxText declares.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Optional, Union, get_args, get_origin

from annotated_types import Ge, Gt, Le, Lt
from pydantic import (BaseModel, ConfigDict, Field, StringConstraints, ValidationError,
                      WrapValidator, create_model)

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
    (mtpipe/maxtext/conversion_commands.py, training_commands.py) and the check against MaxText's own types
    (mtpipe/pipeline/maxtext_check.py) find it here, through :func:`maxtext_args`. Null is not passed:
    MaxText's default applies."""


MAXTEXT = MaxTextKey()


@dataclass(frozen=True)
class ReadBy:
    """Marks a key only the stages named compute with (:func:`read_by`): it is in their addresses only. Any
    other stage whose view holds the key's section gets it from views/run.yaml, which no stage depends
    on, so a change to it reruns none of them. :data:`RUN` (no stage) marks a key that only names a preset
    or says where and how patiently a stage runs. A key without a mark is in the address of every stage
    that reads its section (mtpipe/pipeline/view.py ``STAGE_SECTIONS``)."""

    stages: tuple[str, ...]


def read_by(*stages: str) -> ReadBy:
    """The mark of a key that only ``stages`` compute with."""
    return ReadBy(stages)


RUN = ReadBy(())


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
    name: Annotated[str, RUN]              # the preset's file name (set by compose)
    # MaxText model_name for conversion and training
    maxtext_name: Annotated[str, read_by("to_maxtext", "train_sft", "train_rl")]
    export_name: Annotated[str, read_by("to_huggingface", "evaluate_warmup")]  # model_name for to_huggingface
    source: Annotated[Source, read_by("hf_download")]
    # free-form MaxText keys (a tiny model's dims)
    maxtext_overrides: Annotated[dict[str, Any], read_by(
        "to_maxtext", "train_sft", "train_rl", "to_huggingface", "evaluate_warmup")]


AFTER_DOWNLOAD = read_by("train_sft", "train_rl", "evaluate_base", "evaluate_warmup", "evaluate")


class Dataset(Section):
    name: Annotated[str, RUN]
    source: Annotated[Source, read_by("hf_download")]
    row_schema: Literal["chat", "gsm8k"] = Field(alias="schema")  # what hf_download checks each row against
    # the Hub name MaxText sees (GSM8K answer extraction keys on it)
    hf_name: Annotated[str, AFTER_DOWNLOAD]
    train_files: str                       # glob inside the download
    eval_files: Annotated[Optional[str], AFTER_DOWNLOAD]  # null: no held-out data
    train_split: Annotated[str, RUN]
    columns: list[str]


K8sName = Annotated[str, StringConstraints(pattern=r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"), Words(
    means="a lowercase name of at most 40 letters, digits and dashes (what xpk accepts)")]


class Xpk(Section):
    """Where and how an xpk workload runs (``hardware.backend: xpk``, mtpipe/training/xpk.py).

    ``null`` in cluster, project, zone, docker_image (and reservation, with provisioning: reservation)
    is a placeholder: the training stage names it with the fix before it submits anything."""

    cluster: Annotated[Optional[K8sName], RUN]  # the GKE cluster `xpk cluster create-pathways` made
    project: Annotated[Optional[str], RUN]
    zone: Annotated[Optional[str], RUN]
    docker_image: Annotated[Optional[str], RUN]  # repository without tag, e.g. us-docker.pkg.dev/P/REPO/mtpipe
    tpu_type: str                          # xpk --tpu-type, e.g. v6e-32
    num_slices: PositiveInt
    max_restarts: Annotated[int, Ge(0), Le(100), RUN, Words(why="JobSet restarts after a failure or preemption")]
    priority: Annotated[Literal["very-low", "low", "medium", "high", "very-high"], RUN]
    # null: the cluster's node pools decide
    provisioning: Annotated[Optional[Literal["reservation", "spot", "on-demand"]], RUN]
    reservation: Annotated[Optional[str], RUN]  # provisioning: reservation
    pathways: bool                         # create-pathways also for SFT (GRPO always runs on Pathways)


class Hardware(Section):
    name: Annotated[str, RUN]
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
    server_timeout_s: Annotated[float, Gt(0), KEEP_INT, RUN] = 600  # how long the server may take to load the model


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


class RlBranch(RlStages, Parts):
    branch: str


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


@functools.cache
def run_keys(model: type[Section], stage: str) -> tuple[str, ...]:
    """The keys of ``model`` (dotted, its sections' keys too) that ``stage`` does not compute with: those
    marked :class:`ReadBy` without naming it."""
    out: list[str] = []
    for name, hint in _fields(model).items():
        marks = [m for m in _split(hint)[1] if isinstance(m, ReadBy)]
        if marks and stage not in marks[0].stages:
            out.append(name)
        elif not marks and (section := _section(hint)) is not None:
            out += [f"{name}.{key}" for key in run_keys(section, stage)]
    return tuple(out)
