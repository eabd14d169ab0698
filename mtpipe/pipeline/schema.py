"""The typed schema of the configuration: every key, its type, its range, and what cannot go together.

One dataclass per section of a composed branch (``model``, ``dataset``, ``hardware`` from conf/, one
per stage from the preset and params.yaml). A field's type says what a value may be; an
``Annotated[..., Check(...)]`` adds its range, and ``Optional`` means ``null`` is allowed (null: the
key is not passed, MaxText uses its own default). A field without a default must be present; one with
a default (only in ``Source``, whose keys depend on ``kind``) may be left out.

:func:`check` walks a value against a dataclass, strictly: a string is never taken for a number, a
bool never for an int, unknown keys are errors. :func:`check_branch` then applies the rules that
involve several keys (:func:`combination_errors`). Every error is a :class:`ConfigError` naming the
key as params.yaml or the conf/ file spells it, with a fix. Ranges follow what MaxText 0.2.5
(``configs/types.py``, ``base.yml``, ``post_train/rl.yml``) and Tunix's GRPO accept; docs/decisions.md
("Config schema") gives the reasons.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Annotated, Any, Literal, Optional, Union, get_args, get_origin, get_type_hints

from mtpipe.errors import ConfigError


@dataclass(frozen=True)
class Check:
    """A range for a number (``ge``/``gt``/``le``/``lt``) or a pattern for a string.

    ``means`` replaces the generated description ("a positive integer"), ``why`` is added to the
    problem, ``fix`` replaces the generated fix, ``key`` replaces the key's name in errors.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    pattern: str | None = None
    means: str | None = None
    why: str | None = None
    fix: str | None = None
    key: str | None = None

    def admits(self, value: Any) -> bool:
        """Whether ``value`` (already of the right type) is in range."""
        if self.pattern is not None:
            return re.fullmatch(self.pattern, value) is not None
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def bounds(self) -> str:
        """The range in symbols: ``>= 1``, ``in (0, 1]``."""
        low = (self.ge, "[") if self.ge is not None else (self.gt, "(")
        high = (self.le, "]") if self.le is not None else (self.lt, ")")
        if low[0] is not None and high[0] is not None:
            return f"in {low[1]}{_num(low[0])}, {_num(high[0])}{high[1]}"
        if low[0] is not None:
            return f"{'>=' if self.ge is not None else '>'} {_num(low[0])}"
        if high[0] is not None:
            return f"{'<=' if self.le is not None else '<'} {_num(high[0])}"
        return ""


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# Shorthands for the ranges used below.
PositiveInt = Annotated[int, Check(ge=1)]
LearningRate = Annotated[float, Check(gt=0, le=1, why="0 learns nothing")]
CommitSha = Annotated[str, Check(pattern=r"[0-9a-f]{40}", means="a 40-hex commit sha",
                                 fix="pin the commit shown on the Hub's 'Files and versions' page")]


# ---- conf/model, conf/dataset, conf/hardware ------------------------------------------------------

@dataclass
class Source:
    """Where hf_download gets a model or dataset: a Hub repo at a commit, or a local directory."""

    kind: Literal["hub", "local"]
    repo_id: Optional[str] = None          # kind: hub
    revision: Optional[CommitSha] = None   # kind: hub; branch and tag names move
    path: Optional[str] = None             # kind: local
    allow_patterns: Optional[list[str]] = None
    splits: Optional[Union[str, list[str]]] = None  # datasets without allow_patterns (mtpipe.data.hub)
    subset: Optional[str] = None


@dataclass
class Model:
    name: str                              # the preset's file name (set by compose)
    maxtext_name: str                      # MaxText model_name for conversion and training
    export_name: str                       # model_name for to_huggingface
    source: Source
    maxtext_overrides: dict[str, Any]      # free-form MaxText keys (a tiny model's dims)


@dataclass
class Dataset:
    name: str
    source: Source
    schema: Literal["chat", "gsm8k"]       # what hf_download checks each row against
    hf_name: str                           # the Hub name MaxText sees (GSM8K answer extraction keys on it)
    train_files: str                       # glob inside the download
    eval_files: Optional[str]              # null: no held-out data
    train_split: str
    columns: list[str]


K8sName = Annotated[str, Check(pattern=r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?",
                                means="a lowercase name of at most 40 letters, digits and dashes (what xpk accepts)")]


@dataclass
class Xpk:
    """Where and how an xpk workload runs (``hardware.backend: xpk``, mtpipe/cloud/xpk.py).

    ``null`` in cluster, project, zone, docker_image (and reservation, with provisioning: reservation)
    is a placeholder: the training stage names it with the fix before it submits anything."""

    cluster: Optional[K8sName]             # the GKE cluster `xpk cluster create` made
    project: Optional[str]
    zone: Optional[str]
    docker_image: Optional[str]            # repository without tag, e.g. us-docker.pkg.dev/P/REPO/mtpipe
    tpu_type: str                          # xpk --tpu-type, e.g. v6e-32
    num_slices: PositiveInt
    max_restarts: Annotated[int, Check(ge=0, le=100, why="JobSet restarts after a failure or preemption")]
    priority: Literal["very-low", "low", "medium", "high", "very-high"]
    provisioning: Optional[Literal["reservation", "spot", "on-demand"]]  # null: the cluster's node pools decide
    reservation: Optional[str]             # provisioning: reservation
    pathways: bool                         # create-pathways also for SFT (GRPO always runs on Pathways)


@dataclass
class Hardware:
    name: str
    backend: Literal["local", "xpk"]       # local: MaxText runs here; xpk: a GKE workload (docs/multihost.md)
    processes: Annotated[int, Check(ge=1, le=16, why="JAX processes started on this machine")]
    env: dict[str, str]                    # exported for MaxText; environment values are strings
    maxtext_args: dict[str, Any]           # free-form MaxText keys
    xpk: Optional[Xpk] = None              # backend: xpk only


# ---- the per-stage sections of a preset (params.yaml overrides them) ------------------------------

@dataclass
class HfDownload:
    """No options: what to fetch is the model's and dataset's ``source``."""


@dataclass
class ToMaxtext:
    scan_layers: bool
    use_multimodal: bool
    lazy_load_tensors: bool
    checkpoint_storage: Literal["ocdbt", "plain"]  # plain: byte-reproducible; ocdbt: the tutorial's (random file names)


@dataclass
class TrainSft:
    """SFT of the sft branch. ``steps`` is top level in params.yaml (``dvc exp run -S steps=N``)."""

    steps: Annotated[int, Check(ge=1, key="steps", fix="set e.g. `dvc exp run -S steps=200`")]
    per_device_batch_size: PositiveInt
    max_target_length: Optional[Annotated[int, Check(ge=16, why="room for a chat template and an answer")]]
    learning_rate: Optional[LearningRate]
    num_epoch: Optional[PositiveInt]
    checkpoint_period: PositiveInt         # a killed run resumes from the last multiple of this
    eval_interval: Optional[Annotated[int, Check(ge=0, why="0 or null: no evaluation")]]
    eval_steps: Optional[Annotated[int, Check(ge=-1, why="-1: the whole eval split")]]
    profiler: Literal["", "xplane", "nsys"]
    extra_args: dict[str, Any]             # free-form MaxText keys


@dataclass
class WarmupTrainSft(TrainSft):
    """The rl branch's SFT warm-up: 0 steps skips it, and then its other keys may be null."""

    steps: Annotated[int, Check(ge=0, fix="0 starts GRPO from the converted model, "
                                          "N > 0 warms it up with N SFT steps")]
    per_device_batch_size: Optional[PositiveInt]
    checkpoint_period: Optional[PositiveInt]


@dataclass
class TrainRl:
    rollout_backend: Literal["cpu_jax", "vllm"]  # vllm: MaxText's (TPU); cpu_jax: mtpipe.maxtext.rollout_cpu
    chips_per_vm: PositiveInt
    num_batches: PositiveInt
    num_test_batches: PositiveInt
    batch_size: Optional[PositiveInt]
    num_generations: Optional[Annotated[int, Check(
        ge=2, why="GRPO's advantage compares each completion with the others of its prompt")]]
    rollout_data_parallelism: Annotated[int, Check(ge=-1, why="-1: as many as fit")]
    rollout_tensor_parallelism: Annotated[int, Check(ge=-1, why="-1: as many as fit")]
    grpo_beta: Optional[Annotated[float, Check(ge=0, why="the weight of a KL penalty")]]
    grpo_epsilon: Optional[Annotated[float, Check(gt=0, lt=1, why="the ratio is clipped to [1-e, 1+e]")]]
    learning_rate: Optional[LearningRate]
    max_prefill_predict_length: Optional[PositiveInt]
    max_target_length: Optional[PositiveInt]
    extra_args: dict[str, Any]


@dataclass
class ToHuggingface:
    scan_layers: bool
    use_multimodal: bool
    weight_dtype: Literal["float32", "bfloat16"]


# ---- a whole branch, and params.yaml ---------------------------------------------------------------

@dataclass
class SftStages:
    hf_download: HfDownload
    to_maxtext: ToMaxtext
    train_sft: TrainSft
    to_huggingface: ToHuggingface


@dataclass
class RlStages(SftStages):
    train_sft: WarmupTrainSft
    train_rl: TrainRl


@dataclass
class Parts:
    """A branch's model, dataset and hardware, as composed from conf/<group>/<name>.yaml."""

    model: Model
    dataset: Dataset
    hardware: Hardware


@dataclass
class PartNames:
    """How params.yaml picks a branch's preset and, optionally, other parts than the preset's."""

    preset: str
    model: Optional[str]
    dataset: Optional[str]
    hardware: Optional[str]


@dataclass
class SftBranch(SftStages, Parts):
    branch: str


@dataclass
class RlBranch(RlStages, Parts):
    branch: str


@dataclass
class SftParams(SftStages, PartNames):
    pass


@dataclass
class RlParams(RlStages, PartNames):
    pass


@dataclass
class Params:
    """params.yaml: every key may be null (keep the preset's value) or left out."""

    steps: Optional[Annotated[int, Check(ge=1, fix="set e.g. `dvc exp run -S steps=200`")]]
    sft: SftParams
    rl: RlParams


BRANCHES: dict[str, type[SftBranch] | type[RlBranch]] = {"sft": SftBranch, "rl": RlBranch}
GROUPS = ("model", "dataset", "hardware")


# MaxText's defaults (post_train/rl.yml) for the keys a combination rule needs when a preset says null.
# tests/test_schema.py checks them against the installed MaxText.
MAXTEXT_RL_DEFAULTS = {"max_prefill_predict_length": 256, "max_target_length": 1024}
MAXTEXT_SCAN_LAYERS_DEFAULT = True  # base.yml: what the trainers use unless told otherwise


# ---- the walker ------------------------------------------------------------------------------------

Fix = Callable[[str, str], str]  # (key as shown, requirement) -> the fix sentence


def check(schema: type, value: Any, key: str, fix: Fix, partial: bool = False) -> Any:
    """Check ``value`` (plain dicts and lists) against dataclass ``schema``; return the dataclass.

    ``partial`` is for params.yaml overrides: keys may be missing and null means "keep the preset's".
    Then nothing is built and None is returned.
    """
    if not isinstance(value, dict):
        raise ConfigError(key, f"is a section, got {value!r}", f"set its keys, e.g. {key}.<key>: ...")
    hints = get_type_hints(schema, include_extras=True)
    known = [f.name for f in fields(schema)]
    for name in value:
        if name not in known:
            raise ConfigError(_join(key, name), f"is not a key of {key or 'params.yaml'}",
                              f"use one of {known}, or fix the spelling" if known else "remove it")
    built = {}
    for f in fields(schema):
        sub = _join(key, f.name)
        if f.name not in value:
            if partial or f.default is not MISSING:
                built[f.name] = None if f.default is MISSING else f.default
                continue
            raise ConfigError(sub, "is missing", fix(sub, "to a value (null: MaxText's default, where allowed)"))
        built[f.name] = _check_value(hints[f.name], value[f.name], sub, fix, partial)
    return None if partial else schema(**built)


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _check_value(hint: Any, value: Any, key: str, fix: Fix, partial: bool) -> Any:
    if value is None and (partial or _allows_none(hint)):
        return None
    hint = _strip_none(hint)
    rule = Check()
    if get_origin(hint) is Annotated:
        hint, rule = get_args(hint)
    key = rule.key or key
    if is_dataclass(hint):
        return check(hint, value, key, fix, partial)
    if not _is_a(hint, value) or not rule.admits(value):
        wanted = rule.means or _describe(hint, rule)
        why = f" ({rule.why})" if rule.why else ""
        raise ConfigError(key, f"must be {wanted}{why}, got {value!r}",
                          rule.fix or fix(key, _requirement(hint, rule)))
    return value


def _allows_none(hint: Any) -> bool:
    return _is_union(hint) and type(None) in get_args(hint)


def _strip_none(hint: Any) -> Any:
    if not _allows_none(hint):
        return hint
    rest = [a for a in get_args(hint) if a is not type(None)]
    return rest[0] if len(rest) == 1 else Union[tuple(rest)]


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def _is_a(hint: Any, value: Any) -> bool:
    """Strict type test: no coercion, bool is not a number, int is a float."""
    if hint is Any:
        return True
    if _is_union(hint):
        return any(_is_a(arm, value) for arm in get_args(hint))
    if get_origin(hint) is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(hint))
    if get_origin(hint) is list:
        (item,) = get_args(hint)
        return isinstance(value, list) and all(_is_a(item, v) for v in value)
    if get_origin(hint) is dict:
        _, item = get_args(hint)
        return isinstance(value, dict) and all(isinstance(k, str) and _is_a(item, v) for k, v in value.items())
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any, rule: Check) -> str:
    """In words: "a positive integer", "a number in (0, 1]", "one of 'a', 'b'"."""
    bounds = rule.bounds()
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
        return " or ".join(_describe(arm, Check()) for arm in get_args(hint))
    if get_origin(hint) is list:
        return f"a list of {_describe(get_args(hint)[0], Check()).removeprefix('a ')}s"
    if get_origin(hint) is dict:
        return f"a mapping of names to {_describe(get_args(hint)[1], Check()).removeprefix('a ')}s"
    return hint.__name__


def _requirement(hint: Any, rule: Check) -> str:
    """What to set, as the fix says it: ``>= 1``, ``to one of 'a', 'b'``."""
    bounds = rule.bounds()
    return bounds if bounds else f"to {rule.means or _describe(hint, rule)}"


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
    if cfg.dataset.schema == "chat" and len(cfg.dataset.columns) != 1:
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
        if cfg.dataset.schema != "gsm8k":
            add("rl.dataset", f"{cfg.dataset.name} has schema {cfg.dataset.schema!r}, but train_rl reads "
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


def check_branch(composed: dict, preset: str) -> SftBranch:
    """Check a composed branch (plain dicts): every section's keys, types and ranges, then the combinations.

    Keys are named ``<branch>.<section>.<key>``; the fix says where to set them (params.yaml, or the
    conf/ file a model, dataset or hardware section comes from).
    """
    def fix_for(key: str, requirement: str) -> str:
        parts = key.split(".")
        if len(parts) > 2 and parts[1] in GROUPS:
            return f"set {'.'.join(parts[2:])} {requirement} in conf/{parts[1]}/{composed[parts[1]]['name']}.yaml"
        return f"set {key} {requirement} in params.yaml (or in conf/preset/{preset}.yaml)"

    branch = composed["branch"]
    cfg = check(BRANCHES[branch], composed, branch, fix_for)
    errors = combination_errors(cfg)
    if errors:
        raise errors[0]
    return cfg


def check_params(params: dict) -> None:
    """Check params.yaml's overrides by themselves, before they are merged into a preset."""
    check(Params, params, "", lambda key, req: f"set {key} {req} in params.yaml (null keeps the preset's value)",
          partial=True)
