"""The tutorial presets render the tutorials' MaxText commands, argument by argument.

The reference commands are copied verbatim from Google's tutorials (shell variables kept). Every
difference the pipeline makes is listed here with its reason (docs/decisions/maxtext.md has the long form);
anything else that differs fails the test.
"""

import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mtpipe.maxtext import commands, conversion_commands, training_commands


import families
from mtpipe.pipeline import config

TUTORIAL_TO_MAXTEXT = """python3 -m maxtext.checkpoint_conversion.to_maxtext model_name="${MODEL_NAME}" \
  hf_access_token="${HF_TOKEN}" base_output_directory="${MODEL_CHECKPOINT_DIRECTORY}" \
  scan_layers=True use_multimodal=False hardware=cpu skip_jax_distributed_system=true \
  checkpoint_storage_use_zarr3=1 checkpoint_storage_use_ocdbt=1 \
  --lazy_load_tensors="${LAZY_LOAD_TENSORS}" """
TUTORIAL_TRAIN_SFT = """python3 -m maxtext.trainers.post_train.sft.train_sft run_name="${RUN_NAME}" \
  base_output_directory="${BASE_OUTPUT_DIRECTORY}" model_name=gemma3-4b \
  load_parameters_path="${MAXTEXT_CKPT_PATH}" per_device_batch_size=1 steps=1000 \
  hf_path=HuggingFaceH4/ultrachat_200k train_split=train_sft \
  train_data_columns="['messages']" profiler=xplane"""
TUTORIAL_TO_HF = """python3 -m maxtext.checkpoint_conversion.to_huggingface model_name=gemma3-4b \
  load_parameters_path="${POST_TRAIN_PATH}" base_output_directory="${HF_EXPORT}" \
  scan_layers=True use_multimodal=False weight_dtype=bfloat16"""
TUTORIAL_TRAIN_RL = """python3 -m maxtext.trainers.post_train.rl.train_rl model_name=llama3.1-8b-Instruct \
  load_parameters_path="${MAXTEXT_CKPT_PATH}" run_name="${RUN_NAME}" \
  base_output_directory="${BASE_OUTPUT_DIRECTORY}" chips_per_vm=8 num_batches=50 \
  num_test_batches=10 rollout_data_parallelism=1 rollout_tensor_parallelism=-1"""
TUTORIAL_RL_TO_HF = """python3 -m maxtext.checkpoint_conversion.to_huggingface model_name=llama3.1-8b \
  load_parameters_path="${POST_TRAIN_PATH}" base_output_directory="${HF_EXPORT}" \
  scan_layers=True use_multimodal=False weight_dtype=bfloat16"""
TUTORIAL_ENV = {
    "TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_WORKER_ID": "0", "TPU_NAME": "@hostname", "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost", "TPU_TOPOLOGY": "2x4", "TPU_CHIPS_PER_HOST_BOUNDS": "2,4,1",
    "TPU_HOST_BOUNDS": "1,1,1",
}
# Paths the pipeline chooses, standing for the tutorial's shell variables.
PATHS = {
    "${MODEL_NAME}": "gemma3-4b", "${MODEL_CHECKPOINT_DIRECTORY}": "/ckpt", "${RUN_NAME}": "run",
    "${BASE_OUTPUT_DIRECTORY}": "/out", "${MAXTEXT_CKPT_PATH}": "/ckpt/0/items", "${POST_TRAIN_PATH}": "/params",
    "${HF_EXPORT}": "/hf", "${LAZY_LOAD_TENSORS}": "False",
}
# Tutorial argument -> what the pipeline passes instead (None: dropped), and why.
REPLACED = {
    # The token never goes on a command line (it shows in `ps` and logs): hf_download fetched the
    # pinned revision with HF_TOKEN from the environment, and the converter reads that directory.
    "hf_access_token": None,
    # Lazy loading reads safetensors with numpy: no torch needed and less host memory.
    "--lazy_load_tensors": "True",
    # MaxText cannot pin a dataset revision: training reads the pinned parquet files hf_download wrote.
    "hf_path": "parquet",
    "train_split": "train",
    # Plain zarr (the tutorial's Pathways setting) instead of OCDBT: OCDBT names its data files at
    # random, so the same model would give new bytes and new DVC hashes on every conversion.
    "checkpoint_storage_use_zarr3": "0",
    "checkpoint_storage_use_ocdbt": "0",
}
STORAGE = ("checkpoint_storage_use_zarr3", "checkpoint_storage_use_ocdbt")
# What the pipeline adds, and why.
ADDED = {
    "to_maxtext": {"--hf_model_path"},  # the pinned local download
    "train_sft": {
        "hf_train_files", "tokenizer_path",  # the pinned local download (data, tokenizer)
        "checkpoint_period",                 # intermediate checkpoints make a killed run resumable
        "max_num_checkpoints_to_keep",       # the latest only: the run directory fits the VM (preflight's budget)
        "metrics_file",                      # per-step loss for the DVC plot and metrics
        "jax_cache_dir",                     # the compile cache lives in work/, not ~/jax_cache
        *STORAGE,                            # plain zarr: the trained params are reproducible bytes
    },
    # tokenizer files from the pinned download; the export runs on the host CPU in one process, like
    # to_maxtext in the tutorial (without these MaxText tries a multi-host JAX setup on a CPU)
    "to_huggingface": {"--hf_model_path", "hardware", "skip_jax_distributed_system"},
    "train_rl": {
        "hf_train_files", "hf_eval_files", "tokenizer_path",  # the pinned local download
        "dataset_name",  # openai/gsm8k: MaxText's `#### N` answer extraction keys on this name
        "checkpoint_period",  # every 10 batches: a Spot preemption loses at most ~5 min
        "max_num_checkpoints_to_keep",  # the latest only (rl.yml: 10): the run directory fits the VM
        "jax_cache_dir",
        *STORAGE,
    },
}


def parse(command: str) -> tuple[str, dict[str, str]]:
    words = shlex.split(command)
    assert words[:2] == ["python3", "-m"]
    args = {}
    for word in words[3:]:
        for var, value in PATHS.items():
            word = word.replace(var, value)
        key, _, value = word.partition("=")
        args[key] = value
    return words[2], args


def tutorial_cfg(branch: str = "sft") -> dict:
    params = OmegaConf.create({"steps": None, "sft": {"preset": "gemma3-4b-ultrachat-v6e8"},
                               "rl": {"preset": "llama3.1-8b-gsm8k-v6e8"}})
    cfg = config.compose(branch, params)
    return {stage: config.stage_view(cfg, stage) for stage in config.BRANCH_STAGES[branch]}


def sft_command(cfg) -> commands.MaxTextCommand:
    return training_commands.train_sft(cfg, ckpt=Path("/ckpt/0/items"), train_files="/data/*.parquet", eval_files=None,
                                       columns=["messages"], tokenizer_dir=Path("/src"), base_output=Path("/out"),
                                       run_name="run", metrics_file=Path("/m.jsonl"), jax_cache_dir=Path("/cache"))


def rl_command(cfg) -> commands.MaxTextCommand:
    return training_commands.train_rl(cfg, ckpt=Path("/ckpt/0/items"), train_files="/d/train.parquet",
                                      eval_files="/d/test.parquet", tokenizer_dir=Path("/src"), base_output=Path("/out"),
                                      run_name="run", jax_cache_dir=Path("/cache"))


def compare(stage: str, tutorial: str, ours: commands.MaxTextCommand) -> None:
    module, expected = parse(tutorial)
    got_module, got = parse(ours.as_tutorial())
    assert got_module == module
    for key, value in expected.items():
        if key in REPLACED:
            assert got.get(key) == REPLACED[key], key
        else:
            assert got.get(key) == value, f"{stage}: {key}={got.get(key)!r}, tutorial has {value!r}"
    order = [k for k in got if k in expected]
    assert order == [k for k in expected if k in got], "tutorial arguments keep the tutorial's order"
    assert set(got) - set(expected) == ADDED[stage]


def test_to_maxtext_matches_tutorial():
    cfg = tutorial_cfg()["to_maxtext"]
    cmd = conversion_commands.to_maxtext(cfg, hf_dir=Path("/src"), out_dir=Path("/ckpt"))
    compare("to_maxtext", TUTORIAL_TO_MAXTEXT, cmd)
    assert cmd.launcher == "mtpipe.maxtext.adapter.conversion"


def test_train_sft_matches_tutorial():
    cmd = sft_command(tutorial_cfg()["train_sft"])
    compare("train_sft", TUTORIAL_TRAIN_SFT, cmd)
    assert cmd.env == TUTORIAL_ENV
    assert cmd.launcher == "mtpipe.maxtext.adapter.training"


def test_to_huggingface_matches_tutorial():
    cfg = tutorial_cfg()["to_huggingface"]
    cmd = conversion_commands.to_huggingface(cfg, params=Path("/params"), hf_src_dir=Path("/src"), out_dir=Path("/hf"))
    compare("to_huggingface", TUTORIAL_TO_HF, cmd)
    assert cmd.launcher == "mtpipe.maxtext.adapter.conversion"


def test_tutorial_preset_pins_model_and_data():
    cfg = tutorial_cfg()["hf_download"]
    assert cfg.model.source.repo_id == "google/gemma-3-4b-it"
    assert cfg.dataset.source.repo_id == "HuggingFaceH4/ultrachat_200k"
    assert len(cfg.model.source.revision) == 40 and len(cfg.dataset.source.revision) == 40


def test_rl_to_maxtext_uses_the_instruct_model():
    cfg = tutorial_cfg("rl")["to_maxtext"]
    cmd = conversion_commands.to_maxtext(cfg, hf_dir=Path("/src"), out_dir=Path("/ckpt"))
    compare("to_maxtext", TUTORIAL_TO_MAXTEXT.replace("${MODEL_NAME}", "llama3.1-8b-Instruct"), cmd)


def test_train_rl_matches_tutorial():
    cfgs = tutorial_cfg("rl")
    cmd = rl_command(cfgs["train_rl"])
    compare("train_rl", TUTORIAL_TRAIN_RL, cmd)
    assert cmd.env == TUTORIAL_ENV
    assert cmd.launcher == "mtpipe.maxtext.adapter.training", "the tutorial preset keeps MaxText's vLLM rollout"
    assert cfgs["train_sft"].train_sft.steps == 0, "the tutorial has no SFT warm-up"


def test_rl_export_uses_the_base_model_name():
    cfg = tutorial_cfg("rl")["to_huggingface"]
    cmd = conversion_commands.to_huggingface(cfg, params=Path("/params"), hf_src_dir=Path("/src"), out_dir=Path("/hf"))
    compare("to_huggingface", TUTORIAL_RL_TO_HF, cmd)


def test_embedded_rl_uses_the_cpu_rollout_backend():
    cmd = rl_command(config.stage_view(config.compose("rl", families.load_params()), "train_rl"))
    assert cmd.launcher == "mtpipe.maxtext.launch_rl_cpu"
    assert cmd.argv()[1:4] == ["-m", "mtpipe.maxtext.launch_rl_cpu", commands.TRAIN_RL]


@pytest.mark.parametrize("branch", ["sft", "rl"])
def test_no_secret_on_any_command_line(branch, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secretsecretsecret")
    cfgs = tutorial_cfg(branch)
    cmds = [
        conversion_commands.to_maxtext(cfgs["to_maxtext"], hf_dir=Path("/s"), out_dir=Path("/o")),
        sft_command(cfgs["train_sft"]) if branch == "sft" else rl_command(cfgs["train_rl"]),
        conversion_commands.to_huggingface(cfgs["to_huggingface"], params=Path("/p"), hf_src_dir=Path("/s"),
                                           out_dir=Path("/o")),
    ]
    for cmd in cmds:
        assert not any("hf_secret" in a or "hf_access_token" in a for a in cmd.argv())
