"""One declaration per key: a schema field marked ``MAXTEXT`` reaches MaxText's command line, the check
against MaxText's own types and the stage's view; presets inherit instead of copying."""

import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from mtpipe.errors import ConfigError
from mtpipe.maxtext import commands, training_commands
from mtpipe.pipeline import config, schema

import families

pytestmark = pytest.mark.content_address

# What a user adds to pass MaxText's warmup_steps_fraction: one line in the schema, one in params.yaml.
NEW_FIELD = "    warmup_steps_fraction: Annotated[Optional[float], MAXTEXT] = None\n"
SHOW = """
import sys
from pathlib import Path
from mtpipe.errors import ConfigError
from mtpipe.maxtext import training_commands
from mtpipe.pipeline import config, maxtext_check
try:
    cfg = maxtext_check.compose_checked("sft", config.load_params())
except ConfigError as err:
    sys.exit(str(err))
cmd = training_commands.train_sft(config.stage_view(cfg, "train_sft"), ckpt=Path("/c"), train_files="/t",
                                  eval_files=None, columns=["messages"], tokenizer_dir=Path("/s"), base_output="/o",
                                  run_name="r", metrics_file=Path("/m"), jax_cache_dir=Path("/j"))
print(" ".join(cmd.args))
"""


@pytest.mark.slow
def test_adding_a_maxtext_key_is_one_line_in_the_schema(tmp_path):
    """In a copy of the project: the field, then params.yaml; configure writes it into train_sft's view,
    the command passes it, and MaxText's own type refuses an out-of-range value, naming the key."""
    from pipeline import copy_project

    repo = copy_project(tmp_path / "repo")
    schema_py = repo / "mtpipe" / "pipeline" / "schema.py"
    text = schema_py.read_text()
    anchor = "    num_epoch: Annotated[Optional[PositiveInt], MAXTEXT] = None\n"
    assert anchor in text
    schema_py.write_text(text.replace(anchor, anchor + NEW_FIELD, 1))
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace(
        "    learning_rate: null\n", "    learning_rate: null\n    warmup_steps_fraction: 0.25\n", 1))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=repo, capture_output=True, text=True, timeout=300)

    shown = run("-c", SHOW)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "warmup_steps_fraction=0.25" in shown.stdout.split()
    configured = run("-m", "stages.configure")
    assert configured.returncode == 0, configured.stderr[-2000:]
    view = yaml.safe_load((repo / "views" / "sft" / "train_sft.yaml").read_text())
    assert view["train_sft"]["warmup_steps_fraction"] == 0.25
    changed = subprocess.run(["git", "status", "--porcelain", "--", "mtpipe", "stages", "conf", "params.yaml"],
                             cwd=repo, capture_output=True, text=True, check=True).stdout.split("\n")
    assert sorted(line[3:] for line in changed if line) == ["mtpipe/pipeline/schema.py", "params.yaml"]

    params.write_text(params.read_text().replace("warmup_steps_fraction: 0.25", "warmup_steps_fraction: 1.5"))
    refused = run("-c", SHOW)
    assert refused.returncode == 1
    assert refused.stderr.startswith("sft.train_sft.warmup_steps_fraction: is 1.5, which MaxText's MaxTextConfig "
                                     "refuses"), refused.stderr


def test_every_marked_key_is_a_key_of_maxtext_and_every_stage_key_reaches_the_command():
    """The marked keys exist in the MaxText config class their stage runs; the tutorial commands carry them all."""
    from mtpipe.pipeline.maxtext_check import maxtext_types

    cfg = config.compose("rl", OmegaConf.merge(families.load_params(), {"rl": {"preset": "llama3.1-8b-gsm8k-v6e8"}}))
    for stage in ("to_maxtext", "train_sft", "train_rl", "to_huggingface"):
        section = getattr(cfg, stage)
        keys = schema.maxtext_keys(type(section))
        assert keys and not set(keys) - set(maxtext_types(section.maxtext_config)), stage
    args = dict(a.split("=", 1) for a in training_commands.train_rl(
        config.stage_view(cfg, "train_rl"), ckpt="/c", train_files="/t", eval_files="/e", tokenizer_dir="/s",
        base_output="/o", run_name="r", jax_cache_dir="/j").args)
    assert {k: args[k] for k in schema.maxtext_args(cfg.train_rl)} == {
        k: commands.fmt(v) for k, v in schema.maxtext_args(cfg.train_rl).items()}


def test_schema_defaults_of_maxtext_keys_are_maxtexts():
    """A marked key with a default other than null defaults to what MaxText itself would use."""
    from maxtext.configs import types

    for section in (schema.ToMaxtext, schema.TrainSft, schema.TrainRl, schema.ToHuggingface):
        fields = getattr(types, section.maxtext_config).model_fields
        for key in schema.maxtext_keys(section):
            default = section.model_fields[key].default
            if default not in (None, ...) and not section.model_fields[key].is_required():
                assert fields[key].default == default, (section.__name__, key)


def test_a_preset_inherits_its_parent(tmp_path, monkeypatch):
    """v6e-32 presets are their v6e-8 presets with other hardware and the keys they set; a cycle is refused."""
    params = families.load_params()
    for child, parent in (("gemma3-4b-ultrachat-v6e32", "gemma3-4b-ultrachat-v6e8"),
                          ("llama3.1-8b-gsm8k-v6e32", "llama3.1-8b-gsm8k-v6e8")):
        branch = "rl" if "gsm8k" in child else "sft"
        a, b = (config.compose(branch, OmegaConf.merge(params, {branch: {"preset": p}})).model_dump()
                for p in (child, parent))
        differ = {f"{s}.{k}" for s in a if isinstance(a[s], dict) and s != "hardware" for k in a[s] if a[s][k] != b[s][k]}
        rl_layout = {"train_rl.chips_per_vm", "train_rl.rollout_data_parallelism", "train_rl.rollout_tensor_parallelism"}
        assert (a["hardware"]["name"], b["hardware"]["name"]) == ("v6e-32", "v6e-8")
        assert differ == (rl_layout if branch == "rl" else set()), child

    presets = tmp_path / "preset"
    presets.mkdir()
    (presets / "a.yaml").write_text("defaults: {preset: b}\n")
    (presets / "b.yaml").write_text("defaults: {preset: a}\n")
    monkeypatch.setattr(config, "CONF_DIR", tmp_path)
    with pytest.raises(ConfigError, match=r"inherits from itself \(a -> b -> a\)"):
        config.load_preset("a", "sft.preset")
