"""The rules that involve several keys: values that are each valid but cannot work together.

``configure`` checks a composed branch with :func:`check_branch`: the schema's keys, types and ranges
(:mod:`mtpipe.pipeline.schema`), then these rules; preflight and the VM checks compose through it too. A
stage only loads the view configure wrote (:mod:`mtpipe.pipeline.view`), so these rules are in no
stage's address but configure's: a new rule, or a reworded one, reruns no training.
"""

from __future__ import annotations

import math

from mtpipe.errors import ConfigError
from mtpipe.pipeline.schema import (BRANCHES, GROUPS, Fix, Params, RlBranch, SftBranch, TrainRl, partial,
                                    validate)

# MaxText's defaults (post_train/rl.yml) for the keys a combination rule needs when a preset says null.
# tests/pipeline/test_schema.py checks them against the installed MaxText.
MAXTEXT_RL_DEFAULTS = {"max_prefill_predict_length": 256, "max_target_length": 1024}
MAXTEXT_SCAN_LAYERS_DEFAULT = True  # base.yml: what the trainers use unless told otherwise


def combination_errors(cfg: SftBranch) -> list[ConfigError]:
    """Values that are each valid but cannot work together (docs/decisions/config.md).

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
    cfg = validate(BRANCHES[composed["branch"]], composed, composed["branch"], fix_for(composed, preset))
    if errors := combination_errors(cfg):
        raise errors[0]
    return cfg


def check_params(params: dict) -> None:
    """Check params.yaml's overrides by themselves, before they are merged into a preset."""
    validate(partial(Params), params, "", lambda key, req: f"set {key} {req} in params.yaml "
             "(null keeps the preset's value)")
