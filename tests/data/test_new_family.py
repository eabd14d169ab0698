"""Model families end to end, in one copy of the project with tiny step counts.

* A family the project does not ship, added as docs/extending.md says ("A model family"): Qwen 2.5
  (MaxText's qwen2.5-1.5b: Llama with q/k/v biases and tied embeddings). Its twin's yaml, its
  `Family` entry (tokenizer and chat template) and one line in the CPU forward's ARCHITECTURES; then
  the suite parametrizes over it without edits, and its SFT branch runs through evaluate.
* The shipped Qwen 3 twin through both branches (SFT, and GRPO with the CPU rollout) to evaluate.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from families import committed_params_text
from pipeline import copy_project, dvc, env, git, ran_stages

# One worker runs the file: its tests share one project copy (and embedded/, built once).
pytestmark = [pytest.mark.families, pytest.mark.slow, pytest.mark.xdist_group("new-family-copy")]

NEW = "qwen2.5-tiny"
SHIPPED = "qwen3-tiny"  # a shipped twin: every test parametrized with it must also be with NEW

# Step 2 of docs/extending.md: conf/model/<name>-tiny.yaml, a copy of conf/model/llama3.1-tiny.yaml.
MODEL_YAML = """\
# A tiny twin of Qwen/Qwen2.5-1.5B-Instruct (q/k/v biases, tied embeddings), written by make_embedded.
maxtext_name: qwen2.5-1.5b
export_name: qwen2.5-1.5b
source:
  kind: local
  path: embedded/qwen2.5-tiny
  allow_patterns: ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
maxtext_overrides:
  override_model_config: true
  base_emb_dim: 64
  base_num_query_heads: 4
  base_num_kv_heads: 2
  head_dim: 16
  base_mlp_dim: 256
  base_num_decoder_layers: 4
  vocab_size: 512
"""

# Its Family in mtpipe/data/embedded.py: tokenizer, ChatML template (Qwen 2.5's, without its tool
# and default-system blocks), token ids; MaxText's Qwen mapping lists q/k norms, which Qwen 2 lacks.
FAMILY = '''\
    "qwen2.5-tiny": Family(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], bos=None, eos="<|im_end|>",
        pad="<|endoftext|>", unk=None,
        chat_template=(
            "{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\\\n' + message['content'] | trim + '<|im_end|>\\\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\\\n' }}{%- endif %}"
        ),
        config={"bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>",
                "architectures": ["Qwen2ForCausalLM"]},
        generation={"bos_token_id": "<|endoftext|>", "eos_token_id": ["<|im_end|>", "<|endoftext|>"],
                    "pad_token_id": "<|endoftext|>", "do_sample": True, "temperature": 0.7, "top_p": 0.8},
        absent=("q_norm", "k_norm"),
        seed=SEED + 40,
    ),
'''
# Step 4: the CPU forward serves it (Qwen2Attention is LlamaAttention with biases, which _linear adds).
ARCHITECTURE = '    "qwen2": _LLAMA,  # qwen2:Qwen2Attention: q/k/v biases, read when the checkpoint has them\n'


def _insert_after(path: Path, anchor: str, text: str) -> None:
    source = path.read_text()
    assert source.count(anchor) == 1, f"{path}: {anchor!r} is no longer there once: update this test"
    path.write_text(source.replace(anchor, anchor + text))


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of the project with the new family added (sharing the checkout's JAX compile cache)."""
    repo = copy_project(tmp_path_factory.mktemp("families") / "repo")
    (repo / "conf" / "model" / f"{NEW}.yaml").write_text(MODEL_YAML)
    _insert_after(repo / "mtpipe" / "data" / "embedded.py", "FAMILIES: dict[str, Family] = {\n", FAMILY)
    _insert_after(repo / "mtpipe" / "evaluation" / "numpy_forward.py", '    "llama": _LLAMA,\n', ARCHITECTURE)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "a new model family")
    return repo


def _pytest(repo: Path, *args: str) -> subprocess.CompletedProcess:
    """pytest in ``repo`` with ``args`` only: the outer run's PYTEST_ADDOPTS (`-v` turns `--collect-only -q`
    into a tree of nodes) stays out."""
    nested = {k: v for k, v in env().items() if k != "PYTEST_ADDOPTS"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                          cwd=repo, env=nested, capture_output=True, text=True, timeout=900)


def _set_params(repo: Path, values: dict[str, object]) -> None:
    """params.yaml: the committed one with dotted ``values`` set (as `dvc exp run -S` would)."""
    params = yaml.safe_load(committed_params_text())
    for dotted, value in values.items():
        *parents, key = dotted.split(".")
        tree = params
        for part in parents:
            tree = tree.setdefault(part, {})
        tree[key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _finite_numbers(tree: object) -> list[float]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _finite_numbers(v)]
    assert isinstance(tree, (int, float)) and math.isfinite(tree), tree
    return [float(tree)]


def _metrics(repo: Path, branch: str) -> dict:
    result = json.loads((repo / "metrics" / branch / "evaluate.json").read_text())
    assert set(result) == {"base", "trained", "gain"}, result
    _finite_numbers(result)
    return result


def _sft_params(model: str) -> dict[str, object]:
    """The SFT branch on ``model`` with tiny settings: 10 steps, no eval passes, 4 test conversations."""
    return {"steps": 10, "sft.model": model, "sft.train_sft.checkpoint_period": 10,
            "sft.train_sft.eval_interval": 0, "sft.evaluate.num_problems": 4}


def test_the_tests_parametrize_over_the_new_family_without_edits(project):
    """Every test parametrized with a shipped twin is collected with the new one too (the conversion round
    trip with its logit check, the numpy forward, tokenizer and structure tests), and the quick ones pass."""
    collected = _pytest(project, "--collect-only", "-q")
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    ids = set(re.findall(r"^(tests/\S+::\S+)$", collected.stdout, re.M))
    shipped = {i for i in ids if f"[{SHIPPED}" in i or f"-{SHIPPED}" in i}
    assert {i.replace(SHIPPED, NEW) for i in shipped} <= ids, sorted({i.replace(SHIPPED, NEW) for i in shipped} - ids)
    for expected in ("tests/maxtext/test_conversion_roundtrip.py::test_round_trip_is_bit_exact",
                     "tests/data/test_embedded_twins.py::test_config_sizes_are_the_yaml_s"):
        assert f"{expected}[{NEW}]" in ids, expected

    quick = _pytest(project, "-q", "-m", "families and not slow", "-k", NEW)
    assert quick.returncode == 0, quick.stdout[-4000:]
    assert re.search(r"(\d+) passed", quick.stdout) and " failed" not in quick.stdout, quick.stdout[-2000:]


def test_the_new_family_runs_the_sft_branch_through_evaluate(project):
    _set_params(project, _sft_params(NEW))
    out = dvc(project, "repro", "evaluate@sft").stdout
    assert {"make_embedded", "to_maxtext@sft", "train_sft@sft", "to_huggingface@sft", "evaluate@sft"} <= ran_stages(out)
    exported = json.loads((project / "artifacts" / "sft" / "hf" / "config.json").read_text())
    assert exported["model_type"] == "qwen2" and exported["tie_word_embeddings"] is True
    result = _metrics(project, "sft")
    assert result["trained"]["conversations"] == result["base"]["conversations"] == 4
    assert result["trained"]["loss"] < result["base"]["loss"], result  # 10 steps at lr 1e-3 already learn


def test_qwen3_runs_both_branches_through_evaluate(project):
    """SFT, and the RL branch (GRPO with the CPU rollout, no warm-up) on the Qwen 3 twin (no BOS token)."""
    _set_params(project, {
        **_sft_params(SHIPPED), "rl.model": SHIPPED, "rl.train_sft.steps": 0,
        "rl.train_rl.num_batches": 2, "rl.train_rl.num_test_batches": 1, "rl.train_rl.batch_size": 2,
        "rl.train_rl.num_generations": 2, "rl.train_rl.extra_args": {"eval_batch_size": 2},
        "rl.evaluate.num_problems": 2, "rl.evaluate.max_new_tokens": 32,
    })
    out = dvc(project, "repro", "evaluate@sft", "evaluate@rl").stdout
    assert {"train_sft@sft", "train_rl", "to_huggingface@rl", "evaluate@sft", "evaluate@rl"} <= ran_stages(out)
    for branch in ("sft", "rl"):
        exported = json.loads((project / "artifacts" / branch / "hf" / "config.json").read_text())
        assert exported["model_type"] == "qwen3", branch
    sft = _metrics(project, "sft")
    assert sft["trained"]["loss"] < sft["base"]["loss"], sft
    rl = _metrics(project, "rl")
    assert rl["trained"]["problems"] == rl["base"]["problems"] == 2
    assert 0 <= rl["trained"]["flexible_accuracy"] <= 100
    train_rl = json.loads((project / "metrics" / "rl" / "train_rl.json").read_text())
    assert train_rl["steps"] == 2 and train_rl["eval_post_total"] == 2, train_rl
