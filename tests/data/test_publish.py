"""`doit publish`: an experiment's export from the DVC remote to the loopback Hub, with its model card.

The repo is a small DVC project with the layout the publish reads (the resolved views, dvc.lock with
to_huggingface@rl's export, the evaluate metrics, the plots): its one stage copies a tiny Llama twin
into artifacts/rl/hf, and `dvc exp run` makes the experiment. The Hub is tests/fakes/hf_server.py
with its write endpoints; huggingface_hub's own client does the upload."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fakes.hf_server import HubServer
from mtpipe.pipeline import config
from pipeline import env, files_containing
import families

pytestmark = pytest.mark.evaluate_publish

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_writecanary" + "Q" * 24
STAGE = """stages:
  to_huggingface:
    foreach: [rl]
    do:
      cmd: python -c "import shutil; shutil.copytree('model', 'artifacts/rl/hf')"
      deps: [model]
      outs: [artifacts/rl/hf]
"""


def sh(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=repo, env=env(), capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A DVC project with one experiment, ``exp-pub``, whose export is in a local DVC remote."""
    repo = tmp_path_factory.mktemp("publish") / "repo"
    families.twins()["llama3.1-tiny"].write(repo / "model")
    views = {"hf_download": {"model": {"name": "llama3.1-8b-instruct", "source": {
                 "kind": "hub", "repo_id": "meta-llama/Llama-3.1-8B-Instruct", "revision": "0e9e39f" + "0" * 33}},
                 "dataset": {"name": "gsm8k", "hf_name": "openai/gsm8k"}},
             "evaluate": {"evaluate": {"num_fewshot": 8}},
             "train_rl": {"hardware": {"name": "v6e-8"}}}
    run = {}  # as configure writes them: each address view, and the keys no output depends on
    for stage, view in views.items():
        run[stage] = config.split_run_keys(view, "rl", stage)
        (repo / "views" / "rl").mkdir(parents=True, exist_ok=True)
        (repo / "views" / "rl" / f"{stage}.yaml").write_text(yaml.safe_dump(view))
    assert run["hf_download"]["model"]["name"] and run["train_rl"]["hardware"]["name"]  # the card reads both
    (repo / config.RUN_FILE).write_text(yaml.safe_dump({"rl": run}))
    score = {"problems": 1319, "flexible_accuracy": 80.0, "flexible_ci95": 2.2, "strict_accuracy": 75.0,
             "strict_ci95": 2.3}
    (repo / "metrics" / "rl").mkdir(parents=True)
    (repo / "metrics" / "rl" / "evaluate.json").write_text(json.dumps({
        "base": score | {"flexible_accuracy": 76.0}, "trained": score,
        "gain": {"flexible_gain": 4.0, "flexible_gain_ci95": 3.1, "strict_gain": 0.0, "strict_gain_ci95": 3.2}}))
    (repo / "plots" / "rl").mkdir(parents=True)
    (repo / "plots" / "rl" / "train_sft.csv").write_text("step,loss\n1,6.8\n2,5.1\n3,4.0\n")
    (repo / "plots" / "rl" / "train_rl.csv").write_text("step,reward_mean,kl\n1,0.1,0.0\n2,0.3,0.01\n")
    (repo / "params.yaml").write_text("steps: null\nrl:\n  preset: llama3.1-8b-gsm8k-v6e8\n  train_rl:\n"
                                      "    num_batches: 60\n    grpo_beta: null\n")
    (repo / "dvc.yaml").write_text(STAGE)
    sh(repo, "git", "init", "-q")
    sh(repo, "dvc", "init", "-q")
    sh(repo, "dvc", "remote", "add", "-d", "store", str(repo.parent / "remote"))
    (repo / ".gitignore").write_text("/model\n")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "project")
    sh(repo, "dvc", "exp", "run", "-n", "exp-pub")
    return repo


def doit_publish(repo: Path, hub: HubServer, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    run_env = {**env(), "HF_ENDPOINT": hub.url, "PYTHONPATH": str(ROOT)}
    for key in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        run_env.pop(key, None)
    if token:
        run_env["HF_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "doit", "-f", str(ROOT / "dodo.py"), "-d", str(repo), "publish",
                           *args], cwd=repo, env=run_env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_an_experiment_not_in_the_remote_is_refused(project: Path, tmp_path: Path):
    sh(project, "dvc", "remote", "add", "-f", "-d", "empty", str(tmp_path / "empty"))  # a remote without it
    try:
        with HubServer(tmp_path / "hub", write_token=TOKEN) as hub:
            proc = doit_publish(project, hub, "--exp", "exp-pub", "--repo", "org/tiny-grpo")
    finally:
        sh(project, "dvc", "remote", "default", "store")
    assert proc.returncode != 0 and "not in the DVC remote" in proc.stdout + proc.stderr
    assert "dvc exp push" in proc.stdout + proc.stderr
    assert not [r for r in hub.requests if r.method in ("POST", "PUT")], "nothing may reach the Hub"


@pytest.mark.slow
def test_publish_uploads_the_export_with_its_card_once(project: Path, tmp_path: Path):
    from huggingface_hub import ModelCard

    sh(project, "dvc", "push", "-q")
    with HubServer(tmp_path / "hub", write_token=TOKEN) as hub:
        first = doit_publish(project, hub, "--exp", "exp-pub", "--repo", "org/tiny-grpo")
        assert first.returncode == 0, first.stdout + first.stderr
        commits = hub.commits("org/tiny-grpo")
        assert len(commits) == 2 and "published experiment exp-pub" in first.stdout  # repo creation + upload
        snapshot = tmp_path / "hub" / "models" / "org" / "tiny-grpo" / commits[-1]
        # the weights, config and tokenizer are the experiment's export, byte for byte
        export = sorted(p.relative_to(project / "model").as_posix() for p in (project / "model").rglob("*") if p.is_file())
        for name in export:
            assert hashlib.sha256((snapshot / name).read_bytes()).digest() == \
                hashlib.sha256((project / "model" / name).read_bytes()).digest(), name
        assert (tmp_path / "hub" / "models" / "org" / "tiny-grpo" / "private").read_text() == "True"
        card = ModelCard.load(snapshot / "README.md")
        assert card.data.base_model == "meta-llama/Llama-3.1-8B-Instruct"
        assert card.data.base_model_relation == "finetune" and card.data.datasets == ["openai/gsm8k"]
        assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
        assert card.data.license == "other"  # the tiny twin has no card of its own
        (result,) = card.data.eval_results
        assert (result.metric_type, result.metric_value, result.dataset_type) == ("exact_match", 80.0, "openai/gsm8k")
        commit = sh(project, "git", "rev-parse", "refs/exps/" + exp_ref(project)).stdout.strip()
        assert commit in card.text and '"rl.train_rl.num_batches": 60' in card.text and "v6e-8" in card.text
        assert "0e9e39f" in card.text and (snapshot / "training_curves.png").stat().st_size > 1000
        # a second publish of the same experiment makes no commit
        second = doit_publish(project, hub, "--exp", "exp-pub", "--repo", "org/tiny-grpo")
        assert second.returncode == 0 and "nothing to commit" in second.stdout, second.stdout + second.stderr
        assert hub.commits("org/tiny-grpo") == commits
        # the write token reached the Hub's API as a header only (the presigned LFS uploads carry none),
        # and is in no file of the Hub, the repo or the remote
        assert all(r.authorized for r in hub.requests if r.method == "POST")
        assert not any(r.authorized for r in hub.requests if r.method == "PUT")
        found = files_containing(TOKEN, [tmp_path / "hub", project, project.parent / "remote"])
        assert found["found"] == [] and found["files"] > 20, found


def test_without_a_token_nothing_is_sent(project: Path, tmp_path: Path):
    with HubServer(tmp_path / "hub", write_token=TOKEN) as hub:
        proc = doit_publish(project, hub, "--exp", "exp-pub", "--repo", "org/x", token=None)
    assert proc.returncode != 0 and "HF_TOKEN: is not set" in proc.stdout + proc.stderr and not hub.requests


def exp_ref(repo: Path) -> str:
    """The ref path of exp-pub under refs/exps/."""
    refs = sh(repo, "git", "for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
    (ref,) = [r for r in refs if r.endswith("/exp-pub")]
    return ref.removeprefix("refs/exps/")


def test_the_card_needs_no_network(project: Path, monkeypatch: pytest.MonkeyPatch):
    """Building the card reads git and DVC only (the Hub is contacted for the upload alone)."""
    from mtpipe.data import publish

    monkeypatch.setitem(os.environ, "HF_HUB_OFFLINE", "1")
    commit = publish.experiment_commit(project, "exp-pub")
    text = publish.model_card(project, commit, "rl", "org/tiny-grpo", "exp-pub", "llama3.1")
    assert text.startswith("---\n") and "license: llama3.1" in text and "| GSM8K flexible (%) | 76.0" in text
    # the branch is named by its last training method; the hardware is that stage's (views/rl/train_rl.yaml)
    assert "by the GRPO branch" in text and "- hardware: `v6e-8`" in text
    assert "  - `to_huggingface@rl`: `artifacts/rl/hf`" in text   # the lineage: the branch's stages in dvc.lock


def test_the_curves_are_the_training_methods_records(project: Path, monkeypatch: pytest.MonkeyPatch):
    """One panel per training stage of the branch, titled with its stage and method, drawing the curves
    its record names that its plots file holds (the warm-up's file has no eval_loss); same bytes twice."""
    from matplotlib.axes import Axes

    from mtpipe.data import publish

    drawn: list[str] = []
    plot, set_title = Axes.plot, Axes.set_title
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **kw: drawn.append(kw["label"]) or plot(ax, *a, **kw))
    monkeypatch.setattr(Axes, "set_title", lambda ax, title, *a, **kw: drawn.append(title) or set_title(ax, title, *a, **kw))
    commit = publish.experiment_commit(project, "exp-pub")
    png = publish.curves_png(project, commit, "rl")
    assert png.startswith(b"\x89PNG") and png == publish.curves_png(project, commit, "rl")
    assert drawn == ["loss", "train_sft@rl (SFT)", "reward_mean", "kl", "train_rl (GRPO)"] * 2
