"""Only what changed reruns, judged from DVC's own output on the real embedded pipeline.

A change to params.yaml is resolved by `configure` into the per-stage views; `dvc status` then names
the stages whose inputs changed. One real `dvc exp run -S steps=N` shows the same thing end to end.
"""

import json
import time

import pytest
import yaml

from conftest import restore
from mtpipe.pipeline.toolchain import lock_pins
from pipeline import dvc, git, ran_stages, reproduced_stages

pytestmark = pytest.mark.slow


def stale(repo) -> set[str]:
    """Stages `dvc status` reports as changed."""
    out = dvc(repo, "status", "--json").stdout.strip().splitlines()
    return set(json.loads(out[-1])) if out else set()  # warnings, if any, come before the JSON


def edit_params(repo, change) -> None:
    path = repo / "params.yaml"
    params = yaml.safe_load(path.read_text())
    change(params)
    path.write_text(yaml.safe_dump(params, sort_keys=False))


def test_noop_repro_runs_no_stage(pipeline_repo):
    out = dvc(pipeline_repo, "repro").stdout
    assert ran_stages(out) == set(), out
    assert stale(pipeline_repo) == set()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda p: p.update(steps=7), {"train_sft@sft"}),
        (lambda p: p["sft"]["train_sft"].update(learning_rate=5e-4), {"train_sft@sft"}),
        (lambda p: p["sft"]["to_huggingface"].update(weight_dtype="bfloat16"), {"to_huggingface@sft"}),
        # another source: the download reruns; what reads the data reruns only if its bytes differ; the
        # generator writes the branch's manifest of embedded files again (now without a dataset)
        (lambda p: p["sft"].update(dataset="ultrachat-200k"), {"hf_download@sft", "make_embedded"}),
        (lambda p: p["sft"].update(to_maxtext={"checkpoint_storage": "ocdbt"}), {"to_maxtext@sft"}),
        (lambda p: p["rl"]["train_rl"].update(num_batches=9), {"train_rl"}),
        (lambda p: p["sft"].update(evaluate={"server_timeout_s": 600}), set()),  # views/run.yaml only
    ],
    ids=["steps", "learning_rate", "export_dtype", "dataset_source", "conversion_option", "rl_batches",
         "server_timeout"],
)
def test_a_param_reruns_exactly_the_stages_that_read_it(pipeline_repo, change, expected):
    try:
        edit_params(pipeline_repo, change)
        dvc(pipeline_repo, "repro", "configure")
        assert stale(pipeline_repo) == expected
    finally:
        restore(pipeline_repo)


def edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}: update the test"
    path.write_text(text.replace(old, new, 1))


@pytest.mark.environment
def test_a_tool_version_reruns_exactly_the_stages_that_run_it(pipeline_repo):
    """A new tensorstore (Orbax's storage layer) in requirements.lock: configure reruns, then exactly
    the stages that run MaxText are stale, the generator of the embedded default included (it reads
    MaxText's model tables, and a stage's tools are its packages' whole requirement closure), the
    warm-up's evaluation, which exports it with MaxText, and the RL branch's other evaluations, whose
    task is train_rl's format, read from MaxText's rl.yml; the downloads and the SFT branch's
    evaluations, which never load MaxText, are not."""
    lock = pipeline_repo / "requirements.lock"
    try:
        version = lock_pins(lock.read_text())["tensorstore"]
        edit(lock, f"\ntensorstore=={version} ", "\ntensorstore==9.9.9 ")
        assert stale(pipeline_repo) == {"configure"}
        dvc(pipeline_repo, "repro", "configure")
        assert stale(pipeline_repo) == {f"{stage}@{branch}" for stage in ("to_maxtext", "train_sft", "to_huggingface")
                                        for branch in ("sft", "rl")} | {"train_rl", "make_embedded", "evaluate_warmup",
                                                                         "evaluate_base@rl", "evaluate@rl"}
    finally:
        restore(pipeline_repo)


@pytest.mark.architecture
def test_comments_docstrings_and_error_messages_rerun_only_configure(pipeline_repo):
    """Edits that cannot change a result, in a module every stage runs: `dvc status` names the
    change (configure's deps), and `dvc repro` reruns configure and nothing else."""
    stage_py = pipeline_repo / "mtpipe" / "pipeline" / "stage.py"
    try:
        edit(stage_py, '"""Fail loudly when a tool did not produce what it should have."""',
             '"""Stop the stage when a tool did not produce its output."""  # a reworded docstring')
        edit(stage_py, '(the MaxText command did not produce it)")', '(MaxText did not write it)")')
        with open(stage_py, "a") as f:
            f.write("\n# touched by a test\n")
        assert stale(pipeline_repo) == {"configure"}
        out = dvc(pipeline_repo, "repro").stdout
        assert ran_stages(out) == {"configure"}, out
        assert stale(pipeline_repo) == set()
        assert not git(pipeline_repo, "status", "--porcelain", "views"), "a resolved view changed"
    finally:
        restore(pipeline_repo)


@pytest.mark.architecture
@pytest.mark.parametrize(
    ("path", "old", "new", "expected"),
    [
        ("stages/train_sft.py", '"  steps: 0, no warm-up"', '"  steps: 0: no warm-up"', {"train_sft@sft", "train_sft@rl"}),
        ("stages/to_maxtext.py", "\n\n\ndef ", "\n\n\nTOUCHED = 1\n\n\ndef ", {"to_maxtext@sft", "to_maxtext@rl"}),
        ("mtpipe/maxtext/training_logs.py", 'LOSS = "learning/loss"', 'LOSS = "learning/total_loss"',
         {"train_sft@sft", "train_sft@rl", "train_rl"}),
        ("mtpipe/data/hub.py", '"*.txt", "*.jinja")', '"*.jinja")', {"hf_download@sft", "hf_download@rl"}),
    ],
    ids=["stage_script", "stage_module_constant", "shared_module_default", "download_default"],
)
def test_a_code_change_reruns_the_stages_that_run_it(pipeline_repo, path, old, new, expected):
    """A change of behaviour (a default, a constant) moves the module's fingerprint in the views of
    exactly the stages that run it."""
    try:
        edit(pipeline_repo / path, old, new)
        assert stale(pipeline_repo) == {"configure"}
        dvc(pipeline_repo, "repro", "configure")
        assert stale(pipeline_repo) == expected
    finally:
        restore(pipeline_repo)



def test_exp_run_steps_as_typed_reruns_only_training_export_and_evaluation(pipeline_repo):
    """The base model's score (evaluate_base@sft) is not computed again: only the trained one's."""
    steps = 6  # a short run (the queued sweep's too: one compile of the step for both tests)
    assert json.loads((pipeline_repo / "metrics/sft/train_sft.json").read_text())["steps"] != steps
    try:
        out = dvc(pipeline_repo, "exp", "run", "-S", f"steps={steps}").stdout
        assert reproduced_stages(out) == {"configure", "train_sft@sft", "to_huggingface@sft", "evaluate@sft"}, out
        metrics = json.loads((pipeline_repo / "metrics/sft/train_sft.json").read_text())
        assert metrics["steps"] == steps
        shown = dvc(pipeline_repo, "exp", "show", "--json").stdout
        assert "loss_last" in shown
    finally:
        restore(pipeline_repo)


def test_queued_sweep_runs_and_exp_show_lists_final_losses(pipeline_repo):
    """`dvc exp run --queue -S ... train_sft@sft` twice, `dvc queue start`, then `dvc exp show` has
    each final loss (the training is the target: the export and its score add nothing to a queue)."""
    try:
        for steps in (4, 6):  # a few steps: what is checked is the queue, not the training
            dvc(pipeline_repo, "exp", "run", "--queue", "-S", f"steps={steps}", "train_sft@sft")
        dvc(pipeline_repo, "queue", "start", "--jobs", "1")
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            status = dvc(pipeline_repo, "queue", "status").stdout
            if "Queued" not in status and "Running" not in status:
                break
            time.sleep(5)
        assert "Failed" not in status, dvc(pipeline_repo, "queue", "logs", "--help", check=False).stdout + status
        rows = json.loads(dvc(pipeline_repo, "exp", "show", "--json").stdout)
        found = {}
        for baseline in rows:
            for exp in (baseline.get("experiments") or []):
                for rev in exp.get("revs", []):
                    data = rev.get("data", {})
                    steps = data.get("params", {}).get("params.yaml", {}).get("data", {}).get("steps")
                    loss = data.get("metrics", {}).get("metrics/sft/train_sft.json", {}).get("data", {})
                    if steps in (4, 6) and "loss_last" in loss:
                        found[steps] = loss
        assert set(found) == {4, 6}, rows
        assert found[4]["steps"] == 4 and found[6]["steps"] == 6
    finally:
        restore(pipeline_repo)
