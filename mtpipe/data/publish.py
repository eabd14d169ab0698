"""`doit publish`: an experiment's exported model to the Hugging Face Hub, with a card of its lineage.

    doit publish --exp NAME --repo ORG/NAME [--branch rl|sft] [--public]

1. The experiment (a DVC experiment, ``dvc exp show``; or a git revision) is resolved to its commit.
2. Its export (artifacts/<branch>/hf in that commit's dvc.lock) is read from the DVC remote, never
   from the local cache: what is published is what anyone can pull again. An output missing from the
   remote stops the publish, naming it (``dvc push`` / ``dvc exp push`` first).
3. A model card is generated (:func:`model_card`): the metadata the Hub reads (``base_model`` with its
   pinned revision, ``base_model_relation: finetune``, ``datasets``, ``license``, ``library_name``,
   ``pipeline_tag``, the evaluate stage's scores as ``model-index``) and the lineage (the git commit,
   each stage's output hashes from dvc.lock, the params that differ from the preset, the hardware,
   the loss and reward curves as a picture).
4. One commit uploads everything (``HfApi.create_commit``), to a private repo unless ``--public``.
   When the repo already holds exactly these files, nothing is committed.

The write token is ``HF_TOKEN`` from the environment of this process only (never a file, a log or
an argument). Uploads use the Hub's LFS protocol (Xet disabled for the upload): one protocol the
tests' loopback Hub speaks too.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from mtpipe.errors import ConfigError
from mtpipe.pipeline.stage_table import BRANCH_STAGES, BRANCHES, BY_NAME, address
from mtpipe.pipeline.trainers import in_branch, of_branch
from mtpipe.pipeline.view import RUN_FILE, with_run_keys

CARD = "README.md"
CURVES = "training_curves.png"
EXPORT_STAGE = "to_huggingface@{branch}"


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout


def experiment_commit(root: Path, exp: str) -> str:
    """The commit of experiment ``exp`` (its DVC ref ``refs/exps/.../<exp>``), or of a git revision."""
    refs = git(root, "for-each-ref", "--format=%(refname) %(objectname)", "refs/exps").split("\n")
    found = [line.split()[1] for line in refs if line and line.split()[0].rsplit("/", 1)[-1] == exp]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ConfigError("--exp", f"{exp!r} names {len(found)} experiments", "pass the experiment's commit instead")
    try:
        return git(root, "rev-parse", "--verify", f"{exp}^{{commit}}").strip()
    except subprocess.CalledProcessError:
        raise ConfigError("--exp", f"no experiment or revision {exp!r}", "see `dvc exp show` for the names") from None


def at(root: Path, commit: str, path: str) -> str:
    """A file's text in ``commit``."""
    return git(root, "show", f"{commit}:{path}")


def stage_outputs(lock: dict, stage: str) -> list[dict]:
    if stage not in lock.get("stages", {}):
        raise ConfigError("--exp", f"its dvc.lock has no stage {stage}", f"run `dvc exp run` up to {stage} first")
    return lock["stages"][stage].get("outs", [])


def remote_files(root: Path, directory_md5: str) -> tuple[Any, list[dict]]:
    """The default DVC remote's object store and the listing of the directory object ``directory_md5``;
    ConfigError naming what the remote lacks."""
    from dvc.repo import Repo

    odb = Repo(str(root)).cloud.get_remote_odb(hash_name="md5")
    if not odb.exists(directory_md5):
        raise ConfigError("--exp", f"the export's directory object {directory_md5} is not in the DVC remote",
                          "push the experiment's outputs first (`dvc exp push origin NAME`, or `dvc push`)")
    listing = json.loads(odb.fs.cat_file(odb.oid_to_path(directory_md5)))
    missing = [entry["relpath"] for entry in listing if not odb.exists(entry["md5"])]
    if missing:
        raise ConfigError("--exp", f"{len(missing)} export files are not in the DVC remote ({', '.join(missing[:3])})",
                          "push the experiment's outputs first (`dvc exp push origin NAME`, or `dvc push`)")
    return odb, listing


def fetch_export(root: Path, commit: str, branch: str, dest: Path) -> list[str]:
    """Download the export of ``commit`` from the DVC remote into ``dest``, each file's md5 checked."""
    lock = yaml.safe_load(at(root, commit, "dvc.lock"))
    (out,) = [o for o in stage_outputs(lock, EXPORT_STAGE.format(branch=branch)) if o["path"] == f"artifacts/{branch}/hf"]
    odb, listing = remote_files(root, out["md5"])
    for entry in listing:
        target = dest / entry["relpath"]
        target.parent.mkdir(parents=True, exist_ok=True)
        odb.fs.get_file(odb.oid_to_path(entry["md5"]), str(target))
        if hashlib.md5(target.read_bytes()).hexdigest() != entry["md5"]:
            raise RuntimeError(f"{entry['relpath']}: the remote's copy does not match its md5 {entry['md5']}")
    return sorted(entry["relpath"] for entry in listing)


def curves_png(root: Path, commit: str, branch: str) -> bytes:
    """The curves of each training stage of ``branch`` in ``commit`` (its record's ``curves``, those its
    plots file holds), one panel per stage, as one PNG (fixed metadata: same bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    trainers = in_branch(BRANCH_STAGES[branch])
    fig, axes = plt.subplots(1, len(trainers), figsize=(5 * len(trainers), 3.2), squeeze=False)
    for ax, trainer in zip(axes[0], trainers):
        stage = BY_NAME[trainer.stage]
        rows = list(csv.DictReader(io.StringIO(at(root, commit, stage.path(stage.plots, branch)))))
        for column in trainer.curves:
            points = [(int(r["step"]), float(r[column])) for r in rows if r.get(column)]
            if points:
                ax.plot(*zip(*points), label=column)
        ax.set_title(f"{stage.address(branch)} ({trainer.method})")
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _view(root: Path, commit: str, branch: str, stage: str) -> dict:
    """What ``stage`` read in ``commit``: its address view with its run keys (views/run.yaml)."""
    run = yaml.safe_load(at(root, commit, RUN_FILE)) or {}
    return with_run_keys(yaml.safe_load(at(root, commit, BY_NAME[stage].view(branch))),
                         (run.get(branch) or {}).get(stage) or {})


def changed_params(root: Path, commit: str, branch: str) -> dict[str, Any]:
    """The params.yaml values of ``branch`` in ``commit`` that override its preset (non-null ones)."""
    params = yaml.safe_load(at(root, commit, "params.yaml"))

    def flat(tree: Any, prefix: str) -> dict[str, Any]:
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}.{key}").items()}
        return {prefix: tree} if tree is not None else {}
    out = flat(params.get(branch, {}), branch)
    if branch == "sft" and params.get("steps") is not None:
        out["steps"] = params["steps"]
    return out


def model_card(root: Path, commit: str, branch: str, repo_id: str, exp: str, base_license: str) -> str:
    """The card's text: Hub metadata, then scores and lineage."""
    from huggingface_hub import EvalResult, ModelCardData

    download = _view(root, commit, branch, "hf_download")
    model, dataset = download["model"], download["dataset"]
    source = model["source"]
    base = source.get("repo_id") or model["name"]
    scores = json.loads(at(root, commit, f"metrics/{branch}/evaluate.json"))
    evaluate = _view(root, commit, branch, "evaluate")["evaluate"]
    if branch == "rl":
        label = (f"GSM8K exact match, flexible extraction (lm-eval {evaluate.get('task', 'gsm8k_cot_llama')}, "
                 f"{evaluate['num_fewshot']}-shot, "
                 f"{scores['trained']['problems']} problems)")
        results = [EvalResult(task_type="text-generation", dataset_type=dataset["hf_name"], dataset_name="GSM8K",
                              metric_type="exact_match", metric_value=scores["trained"]["flexible_accuracy"],
                              metric_name=label)]
        table = [("GSM8K flexible (%)", "flexible_accuracy", "flexible_ci95", "flexible_gain", "flexible_gain_ci95"),
                 ("GSM8K strict (%)", "strict_accuracy", "strict_ci95", "strict_gain", "strict_gain_ci95")]
    else:
        results = [EvalResult(task_type="text-generation", dataset_type=dataset["hf_name"], dataset_name="held-out",
                              metric_type="loss", metric_value=scores["trained"]["loss"],
                              metric_name=f"held-out loss ({scores['trained']['conversations']} test conversations)")]
        table = [("held-out loss", "loss", "loss_ci95", "loss_gain", "loss_gain_ci95")]
    data = ModelCardData(
        base_model=base, base_model_relation="finetune", datasets=[dataset["hf_name"]], license=base_license,
        library_name="transformers", pipeline_tag="text-generation", tags=["mtpipe", "maxtext", branch],
        model_name=repo_id.split("/")[-1], eval_results=results)
    lock = yaml.safe_load(at(root, commit, "dvc.lock"))
    files = git(root, "ls-tree", "-r", "--name-only", commit).split("\n")
    hardware = next((_view(root, commit, branch, t.stage)["hardware"]["name"]   # the branch's last training stage
                     for t in reversed(in_branch(BRANCH_STAGES[branch]))
                     if BY_NAME[t.stage].view(branch) in files), "?")
    addresses = {address(stage, branch) for stage in BRANCH_STAGES[branch]}
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {repo_id.split('/')[-1]}", "",
        f"Fine-tuned from [{base}](https://huggingface.co/{base}) (revision `{source.get('revision', 'local')}`) "
        f"by the {of_branch(BRANCH_STAGES[branch]).method} branch of an mtpipe pipeline (MaxText on Cloud TPU), "
        f"experiment `{exp}`.", "",
        "## Evaluation", "", "| score | base | trained | gain (95% interval) |", "| --- | --- | --- | --- |",
        *[f"| {name} | {scores['base'][v]} +/- {scores['base'][ci]} | {scores['trained'][v]} +/- "
          f"{scores['trained'][ci]} | {scores['gain'][g]} +/- {scores['gain'][gci]} |" for name, v, ci, g, gci in table],
        "", "## Lineage", "",
        f"- git commit: `{commit}`", f"- hardware: `{hardware}`",
        f"- params that differ from the preset: `{json.dumps(changed_params(root, commit, branch), sort_keys=True)}`",
        "- outputs (dvc.lock md5):", "",
        *[f"  - `{name}`: " + ", ".join(f"`{o['path']}` {o.get('md5', '?')}" for o in stage.get("outs", []))
          for name, stage in sorted(lock["stages"].items()) if name in addresses],
        "", f"![training curves]({CURVES})", "",
    ]
    return "\n".join(lines)


def base_license(export: Path) -> str:
    """The base model's license, as its own card states it (the export copies no card: ``other``)."""
    card = export / CARD
    if card.is_file():
        from huggingface_hub import ModelCard

        return ModelCard.load(card).data.license or "other"
    return "other"


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def unchanged(api: Any, repo_id: str, files: dict[str, Path]) -> bool:
    """Does the repo hold exactly ``files`` (besides .gitattributes)? Compared by the Hub's own hashes."""
    remote = {e.path: e for e in api.list_repo_tree(repo_id, recursive=True) if hasattr(e, "blob_id")}
    remote.pop(".gitattributes", None)
    if set(remote) != set(files):
        return False
    for path, local in files.items():
        data, entry = local.read_bytes(), remote[path]
        same = entry.lfs.sha256 == hashlib.sha256(data).hexdigest() if entry.lfs else \
            entry.blob_id == _git_blob_sha1(data)
        if not same:
            return False
    return True


def publish(root: Path, exp: str, repo_id: str, branch: str = "rl", private: bool = True,
            endpoint: str | None = None) -> str:
    """Publish experiment ``exp``'s export of ``branch`` to ``repo_id``; returns what was done."""
    token = os.environ.get("HF_TOKEN")
    if not token:
        raise ConfigError("HF_TOKEN", "is not set", "export HF_TOKEN=<a write token> (https://huggingface.co/settings/tokens)")
    if branch not in BRANCHES:
        raise ConfigError("--branch", f"{branch!r} is not {' or '.join(BRANCHES)}",
                          "pass " + " or ".join(f"--branch={b}" for b in BRANCHES))
    commit = experiment_commit(root, exp)
    from huggingface_hub import CommitOperationAdd, HfApi, constants

    constants.HF_HUB_DISABLE_XET = True  # read by huggingface_hub at each upload; its env var only at import

    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "export"
        names = fetch_export(root, commit, branch, export)
        (export / CARD).write_text(model_card(root, commit, branch, repo_id, exp, base_license(export)))
        (export / CURVES).write_bytes(curves_png(root, commit, branch))
        files = {name: export / name for name in [*names, CARD, CURVES]}
        api = HfApi(endpoint=endpoint, token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        if unchanged(api, repo_id, files):
            return f"{repo_id} already holds experiment {exp} ({commit[:12]}): nothing to commit"
        info = api.create_commit(repo_id, [CommitOperationAdd(name, str(path)) for name, path in files.items()],
                                 commit_message=f"mtpipe: experiment {exp} ({branch}, git {commit[:12]})")
    return f"published experiment {exp} to {info.commit_url}"
