"""The config schema (mtpipe/pipeline/schema.py): for each section of params.yaml, a wrong type, an out-of-range
value and an impossible combination stop `configure`, naming the key; every shipped preset passes."""

import shutil
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from mtpipe.data import embedded
from mtpipe.pipeline import config, maxtext_check, rules, schema, view
from mtpipe.errors import ConfigError
import families

pytestmark = pytest.mark.vm_experiments

TUTORIAL_RL = {"preset": "llama3.1-8b-gsm8k-v6e8"}


def compose(branch: str, overrides: dict):
    """Compose ``branch`` from params.yaml with ``overrides`` merged in (as a user would edit it)."""
    return maxtext_check.compose_checked(branch, OmegaConf.merge(families.load_params(), overrides))


def rejected(branch: str, overrides: dict) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        compose(branch, overrides)
    return err.value


# (overrides, the key the error names, a word of the problem). One row per section and kind of error.
CASES = {
    # top-level steps
    "steps/type": ({"steps": "ten"}, "steps", "positive integer"),
    "steps/bool": ({"steps": True}, "steps", "positive integer"),
    "steps/range": ({"steps": 0}, "steps", "positive integer"),
    "params/unknown-key": ({"step": 100}, "step", "not a key of params.yaml"),
    # preset / model / dataset / hardware names
    "names/type": ({"sft": {"model": 5}}, "sft.model", "must be a string"),
    "names/range": ({"sft": {"hardware": "v9-8"}}, "sft.hardware", "unknown hardware preset"),
    "names/combination-chat-data-for-grpo": ({"rl": {"dataset": "ultrachat-tiny"}}, "rl.dataset", "question/answer"),
    "names/combination-vllm-on-cpu": ({"rl": {**TUTORIAL_RL, "hardware": "cpu"}}, "rl.train_rl.rollout_backend",
                                      "vllm needs a TPU"),
    # sft.train_sft
    "sft.train_sft/type": ({"sft": {"train_sft": {"learning_rate": "1e-3"}}}, "sft.train_sft.learning_rate",
                           "a number in (0, 1]"),
    "sft.train_sft/range-lr": ({"sft": {"train_sft": {"learning_rate": 2.0}}}, "sft.train_sft.learning_rate",
                               "a number in (0, 1]"),
    "sft.train_sft/range-batch": ({"sft": {"train_sft": {"per_device_batch_size": 0}}},
                                  "sft.train_sft.per_device_batch_size", "positive integer"),
    "sft.train_sft/range-length": ({"sft": {"train_sft": {"max_target_length": 8}}}, "sft.train_sft.max_target_length",
                                   ">= 16"),
    "sft.train_sft/range-profiler": ({"sft": {"train_sft": {"profiler": "perfetto"}}}, "sft.train_sft.profiler",
                                     "'xplane'"),
    "sft.train_sft/combination-scan": ({"sft": {"train_sft": {"extra_args": {"scan_layers": False}}}},
                                       "sft.to_maxtext.scan_layers", "train_sft runs with scan_layers=False"),
    "sft.train_sft/maxtext-type": ({"sft": {"train_sft": {"extra_args": {"remat_policy": 5}}}},
                                   "sft.train_sft.extra_args.remat_policy", "MaxText's MaxTextConfig refuses"),
    "rl.train_rl/maxtext-type": ({"rl": {"train_rl": {"extra_args": {"hardware": "abacus"}}}},
                                  "rl.train_rl.extra_args.hardware", "MaxText's RLConfig refuses for hardware"),
    "sft.train_sft/unknown-key": ({"sft": {"train_sft": {"learnig_rate": 1e-3}}}, "sft.train_sft.learnig_rate",
                                  "not a key"),
    # sft.to_maxtext and sft.hf_download
    "sft.to_maxtext/type": ({"sft": {"to_maxtext": {"lazy_load_tensors": "true"}}},
                            "sft.to_maxtext.lazy_load_tensors", "true or false"),
    "sft.to_maxtext/range": ({"sft": {"to_maxtext": {"checkpoint_storage": "zarr"}}},
                             "sft.to_maxtext.checkpoint_storage", "'ocdbt', 'plain'"),
    "sft.to_maxtext/combination": ({"sft": {"to_maxtext": {"scan_layers": False},
                                            "to_huggingface": {"scan_layers": False}}},
                                   "sft.to_maxtext.scan_layers", "could not load the converted checkpoint"),
    "sft.hf_download/type": ({"sft": {"hf_download": 5}}, "sft.hf_download", "is a section"),
    "sft.hf_download/unknown-key": ({"sft": {"hf_download": {"revision": "main"}}}, "sft.hf_download.revision",
                                    "not a key"),
    # sft.to_huggingface
    "sft.to_huggingface/type": ({"sft": {"to_huggingface": {"weight_dtype": 16}}}, "sft.to_huggingface.weight_dtype",
                                "'bfloat16'"),
    "sft.to_huggingface/range": ({"sft": {"to_huggingface": {"weight_dtype": "fp8"}}},
                                 "sft.to_huggingface.weight_dtype", "'bfloat16'"),
    "sft.to_huggingface/combination": ({"sft": {"to_huggingface": {"scan_layers": False}}},
                                       "sft.to_huggingface.scan_layers", "converted with scan_layers=True"),
    # rl.train_sft (the warm-up)
    "rl.train_sft/type": ({"rl": {"train_sft": {"steps": "400"}}}, "rl.train_sft.steps", "integer >= 0"),
    "rl.train_sft/range": ({"rl": {"train_sft": {"steps": -1}}}, "rl.train_sft.steps", "integer >= 0"),
    "rl.train_sft/combination": ({"rl": {**TUTORIAL_RL, "train_sft": {"steps": 10}}},
                                 "rl.train_sft.per_device_batch_size", "when rl.train_sft.steps > 0"),
    # rl.train_rl
    "rl.train_rl/type": ({"rl": {"train_rl": {"num_batches": "16"}}}, "rl.train_rl.num_batches", "positive integer"),
    "rl.train_rl/type-backend": ({"rl": {"train_rl": {"rollout_backend": "sglang"}}}, "rl.train_rl.rollout_backend",
                                 "'cpu_jax', 'vllm'"),
    "rl.train_rl/range-generations": ({"rl": {"train_rl": {"num_generations": 1}}}, "rl.train_rl.num_generations",
                                      "integer >= 2"),
    "rl.train_rl/range-epsilon": ({"rl": {"train_rl": {"grpo_epsilon": 1.0}}}, "rl.train_rl.grpo_epsilon",
                                  "in (0, 1)"),
    "rl.train_rl/range-beta": ({"rl": {"train_rl": {"grpo_beta": -0.1}}}, "rl.train_rl.grpo_beta", ">= 0"),
    "rl.train_rl/range-lr": ({"rl": {"train_rl": {"learning_rate": 0}}}, "rl.train_rl.learning_rate", "(0, 1]"),
    "rl.train_rl/combination-lengths": ({"rl": {"train_rl": {"max_target_length": 160}}},
                                        "rl.train_rl.max_target_length", "not more than max_prefill_predict_length"),
    "rl.train_rl/combination-lengths-default": ({"rl": {**TUTORIAL_RL, "train_rl": {"max_target_length": 200}}},
                                                "rl.train_rl.max_target_length", "max_prefill_predict_length 256"),
    "rl.train_rl/combination-parallelism": ({"rl": {"train_rl": {"rollout_tensor_parallelism": 2}}},
                                            "rl.train_rl.rollout_tensor_parallelism", "chips_per_vm: 1"),
    "rl.train_rl/combination-two-auto": ({"rl": {**TUTORIAL_RL, "train_rl": {"rollout_data_parallelism": -1}}},
                                         "rl.train_rl.rollout_tensor_parallelism", "at most one"),
    "rl.train_rl/combination-vllm-cpu": ({"rl": {"train_rl": {"rollout_backend": "vllm"}}},
                                         "rl.train_rl.rollout_backend", "vllm needs a TPU"),
    # rl.evaluate
    "rl.evaluate/range-task": ({"rl": {"evaluate": {"task": "gsm8k"}}}, "rl.evaluate.task", "'gsm8k_rl_format'"),
    "rl.evaluate/combination-fewshot": ({"rl": {"evaluate": {"num_fewshot": 8}}}, "rl.evaluate.num_fewshot",
                                        "gsm8k_rl_format has no few-shot examples"),
    # rl.to_maxtext, rl.to_huggingface
    "rl.to_maxtext/type": ({"rl": {"to_maxtext": {"scan_layers": 1}}}, "rl.to_maxtext.scan_layers", "true or false"),
    "rl.to_huggingface/type": ({"rl": {"to_huggingface": {"use_multimodal": "no"}}},
                               "rl.to_huggingface.use_multimodal", "true or false"),
    "rl.to_huggingface/range": ({"rl": {"to_huggingface": {"weight_dtype": "float16"}}},
                                "rl.to_huggingface.weight_dtype", "'float32'"),
    "rl.to_huggingface/combination": ({"rl": {"to_huggingface": {"use_multimodal": True}}},
                                      "rl.to_huggingface.use_multimodal", "converted with use_multimodal=False"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_value_is_rejected_naming_the_key(case):
    overrides, key, problem = CASES[case]
    branch = "rl" if "rl" in overrides else "sft"
    err = rejected(branch, overrides)
    assert (err.key, problem in str(err)) == (key, True), str(err)
    assert err.fix


def test_a_range_error_says_what_to_set():
    err = rejected("rl", {"rl": {"train_rl": {"num_generations": 1}}})
    assert str(err) == (
        "rl.train_rl.num_generations: must be an integer >= 2 (GRPO's advantage compares each completion with "
        "the others of its prompt), got 1. Fix: set rl.train_rl.num_generations >= 2 in params.yaml "
        "(null keeps the preset's value)")


@pytest.mark.parametrize("preset", config.available("preset"))
def test_every_shipped_preset_passes(preset):
    branch = "rl" if "train_rl" in config.load_preset(preset, "preset") else "sft"
    cfg = compose(branch, {branch: {"preset": preset}})
    assert cfg.branch == branch
    assert isinstance(rules.check_branch(cfg.model_dump(by_alias=True), preset), schema.BRANCHES[branch])


def test_both_tutorial_presets_resolve_together(tmp_path):
    params = OmegaConf.merge(families.load_params(), {"sft": {"preset": "gemma3-4b-ultrachat-v6e8"}, "rl": TUTORIAL_RL})
    written = config.write_resolved(config.compose_all(params), config.twin_confs(embedded.FAMILIES), tmp_path)
    assert yaml.safe_load((tmp_path / "views" / "rl" / "train_rl.yaml").read_text())["train_rl"]["chips_per_vm"] == 8
    assert len(written) == 16  # 14 stage views, make_embedded's view and views/run.yaml


def test_dvc_set_values_keep_their_types(tmp_path):
    """`dvc exp run -S key=value` writes YAML values through Hydra's parser: ints stay ints, floats floats."""
    from dvc.utils.hydra import apply_overrides

    params = tmp_path / "params.yaml"
    params.write_text(families.committed_params_text())
    apply_overrides(params, ["steps=2000", "sft.train_sft.learning_rate=5e-4", "rl.train_rl.grpo_beta=0",
                             "rl.train_rl.num_generations=4", "sft.to_huggingface.weight_dtype=bfloat16"])
    p = config.load_params(params)
    sft, rl = config.compose("sft", p), config.compose("rl", p)
    assert (sft.train_sft.steps, sft.train_sft.learning_rate) == (2000, 5e-4)
    assert sft.to_huggingface.weight_dtype == "bfloat16"
    assert (rl.train_rl.grpo_beta, rl.train_rl.num_generations) == (0, 4)
    apply_overrides(params, ["steps='2000'"])  # quoted: a string, which is not a number
    with pytest.raises(ConfigError, match=r"^steps: must be a positive integer, got '2000'"):
        config.compose("sft", config.load_params(params))


@pytest.fixture
def conf(tmp_path, monkeypatch) -> Path:
    """A writable copy of conf/ that compose reads instead of the real one."""
    shutil.copytree(config.CONF_DIR, tmp_path / "conf")
    monkeypatch.setattr(config, "CONF_DIR", tmp_path / "conf")
    return tmp_path / "conf"


def edit(path: Path, change) -> None:
    data = yaml.safe_load(path.read_text())
    change(data)
    path.write_text(yaml.safe_dump(data))


@pytest.mark.parametrize(("file", "change", "overrides", "key", "problem", "fix"), [
    ("model/gemma3-tiny.yaml", lambda d: d["source"].update(kind="git"), {}, "sft.model.source.kind",
     "'hub', 'local'", "conf/model/gemma3-tiny.yaml"),
    ("model/gemma3-4b.yaml", lambda d: d["source"].pop("revision"), {"sft": {"preset": "gemma3-4b-ultrachat-v6e8"}},
     "sft.model.source.revision", "40-hex commit sha", "conf/model/gemma3-4b.yaml"),
    ("model/gemma3-tiny.yaml", lambda d: d.update(maxtext_overrides=[64]), {}, "sft.model.maxtext_overrides",
     "a mapping", "conf/model/gemma3-tiny.yaml"),
    ("hardware/cpu.yaml", lambda d: d["env"].update(DECOUPLE_GCLOUD=True), {}, "sft.hardware.env",
     "a mapping of names to strings", "conf/hardware/cpu.yaml"),
    ("dataset/ultrachat-tiny.yaml", lambda d: d.update(eval_files=None), {}, "sft.train_sft.eval_interval",
     "no eval_files", "eval_interval: 0"),
    ("dataset/gsm8k-tiny.yaml", lambda d: d.update(hf_name="my/gsm8k"), {"rl": {}}, "rl.dataset.hf_name",
     "every answer reward would be 0", "conf/dataset/gsm8k-tiny.yaml"),
    ("dataset/gsm8k-tiny.yaml", lambda d: d.update(eval_files=None), {"rl": {}}, "rl.train_rl.num_test_batches",
     "no eval_files", "conf/dataset/gsm8k-tiny.yaml"),
    ("preset/embedded-sft.yaml", lambda d: d["train_sft"].pop("checkpoint_period"), {}, "sft.train_sft.checkpoint_period",
     "is missing", "conf/preset/embedded-sft.yaml"),
    ("preset/embedded-sft.yaml", lambda d: d.update(train_rl={}), {}, "sft.preset", "a preset of the rl branch",
     "remove train_rl from conf/preset/embedded-sft.yaml"),
])
def test_bad_conf_file_is_rejected_naming_the_key_and_file(conf, file, change, overrides, key, problem, fix):
    edit(conf / file, change)
    err = rejected("rl" if "rl" in overrides else "sft", overrides)
    assert (err.key, problem in str(err), fix in err.fix) == (key, True, True), str(err)


def test_maxtext_defaults_the_schema_relies_on():
    """The defaults a combination rule assumes for null keys are the installed MaxText's."""
    from importlib.util import find_spec

    configs = Path(find_spec("maxtext").submodule_search_locations[0]) / "configs"
    rl = yaml.safe_load((configs / "post_train" / "rl.yml").read_text())
    base = yaml.safe_load((configs / "base.yml").read_text())
    assert {k: rl[k] for k in rules.MAXTEXT_RL_DEFAULTS} == rules.MAXTEXT_RL_DEFAULTS
    assert base["scan_layers"] is rules.MAXTEXT_SCAN_LAYERS_DEFAULT
    assert rl["rl"]["num_generations"] >= 2 and 0 < rl["rl"]["grpo_epsilon"] < 1 and rl["rl"]["grpo_beta"] >= 0


def test_dvc_repro_stops_at_configure(tmp_path):
    """A bad params.yaml fails `dvc repro` in `configure`, within seconds, before any other stage runs."""
    from pipeline import copy_project, dvc, ran_stages

    repo = copy_project(tmp_path / "repo")
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("num_generations: null", "num_generations: 1", 1))
    start = time.monotonic()
    proc = dvc(repo, "repro", check=False, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert ran_stages(proc.stdout) == {"configure"}, proc.stdout
    assert "configure: rl.train_rl.num_generations: must be an integer >= 2" in proc.stdout
    assert not (repo / "artifacts").exists() and not (repo / "embedded").exists()
    assert elapsed < 60, f"dvc repro took {elapsed:.0f} s to reject params.yaml"


@pytest.mark.address
def test_each_read_by_mark_names_stages_that_read_its_section():
    """A key's ReadBy mark names stages whose view holds its section (a misspelt stage would make the key
    a run key of every stage), and the marks give each stage the run keys configure writes."""
    readers: dict[type, set[str]] = {}
    for branch, model in schema.BRANCHES.items():
        for stage in config.BRANCH_STAGES[branch]:
            for section in view.STAGE_SECTIONS[stage]:
                readers.setdefault(model.model_fields[section].annotation, set()).add(stage)
    readers[schema.Xpk] = readers[schema.Hardware]
    marked = 0
    for section, stages in readers.items():
        for name, field in section.model_fields.items():
            for mark in (m for m in field.metadata if isinstance(m, schema.ReadBy)):
                marked += 1
                assert set(mark.stages) <= stages, f"{section.__name__}.{name}: {mark.stages} vs {stages}"
    assert marked >= 15
    assert schema.run_keys(schema.Model, "hf_download") == ("name", "maxtext_name", "export_name", "maxtext_overrides")
    assert schema.run_keys(schema.Hardware, "train_sft")[:2] == ("name", "xpk.cluster")
    assert "source" in schema.run_keys(schema.Dataset, "evaluate") and "hf_name" not in schema.run_keys(
        schema.Dataset, "evaluate")
