"""`doit why STAGE` (mtpipe/pipeline/why.py): after each kind of edit it names what moved in the stage's
address (a params key, a module's function, a tool version) or says that nothing did and by which rule;
and the `dvc commit` it prints keeps the outputs: `dvc status` is clean after it and nothing reruns.

No MaxText runs: the project is copied with a placeholder for every output, and dvc.lock records that
copy as it is (configure run, every stage committed), so each edit is the only thing that moved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import restore
from mtpipe.pipeline.toolchain import lock_pins
from pipeline import ROOT, copy_project, dvc, env, git, ran_stages

pytestmark = [pytest.mark.house, pytest.mark.xdist_group("why-copy")]  # one worker builds the recorded copy

STAGE = "train_sft@sft"
CODE_RULE = "comments and layout (the parser drops them), docstrings, and the text of messages"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the project whose dvc.lock records it as it is: its views as configure writes them,
    every output a placeholder, every stage committed (`dvc status` clean)."""
    from dvc.repo import Repo

    repo = copy_project(tmp_path_factory.mktemp("why") / "repo", test_params=False)
    subprocess.run([sys.executable, "-m", "stages.configure"], cwd=repo, env=run_env(repo), check=True,
                   capture_output=True)
    with Repo(str(repo)) as project:
        outs = [out.def_path for stage in project.index.stages for out in stage.outs]
    for out in map(repo.joinpath, outs):
        if not out.exists():  # a directory output gets one file, a file output ("x.json") one line
            path = out / "placeholder" if not out.suffix else out
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("{}\n")
    dvc(repo, "commit", "--force")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "recorded as it is")
    assert stale(repo) == {}
    return repo


def run_env(repo: Path) -> dict[str, str]:
    return env() | {"PYTHONPATH": str(repo)}


def stale(repo: Path) -> dict:
    out = dvc(repo, "status", "--json").stdout.strip().splitlines()
    return json.loads(out[-1]) if out else {}


def why(repo: Path, stage: str = STAGE) -> str:
    """`doit why STAGE` in ``repo``: its output (it exits 0)."""
    proc = subprocess.run([sys.executable, "-m", "doit", "why", stage], cwd=repo, env=run_env(repo),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} is not in {path}: update the test"
    path.write_text(text.replace(old, new))


@pytest.fixture
def clean(repo: Path):
    """The recorded copy, put back after the test."""
    yield repo
    restore(repo)


def test_a_params_edit_is_named_with_its_key_and_values(clean: Path):
    params = yaml.safe_load((clean / "params.yaml").read_text())
    params["sft"]["train_sft"]["learning_rate"] = 0.0005
    (clean / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = why(clean)
    assert f"`dvc repro` reruns {STAGE} (configure first" in out, out
    assert "value  train_sft.learning_rate: 0.001 -> 0.0005" in out
    assert "params.yaml sft.train_sft.learning_rate: null -> 0.0005" in out
    assert 'values (mtpipe/pipeline/config.py): "Each pipeline stage depends on its own file' in out
    assert f"Cost: {STAGE} trains (hardware preset cpu" in out
    assert "After it (each reruns when its inputs' bytes move): evaluate@sft, to_huggingface@sft" in out
    assert "dvc commit" not in out, "a moved value is another recipe: no advice to keep the output"
    dvc(clean, "repro", "configure")  # now DVC calls it changed: the same answer, the params from the old record
    out = why(clean)
    assert "dvc status: deps views/sft/train_sft.yaml modified" in out, out
    assert f"`dvc repro` reruns {STAGE}.\n" in out
    assert "params.yaml sft.train_sft.learning_rate: null -> 0.0005" in out


def test_a_comment_edit_in_a_module_it_runs_reruns_nothing_and_says_why(clean: Path):
    edit(clean / "mtpipe" / "pipeline" / "stage.py", "\ndef run_stage(", "\n# a comment\ndef run_stage(")
    out = why(clean)
    assert f"Its view is the one dvc.lock recorded: no edit of params, conf/, code or tools reruns {STAGE}" in out, out
    assert "mtpipe/pipeline/stage.py: edited, same fingerprint" in out
    assert f'code (mtpipe/pipeline/fingerprint.py): "A fingerprint is' in out and CODE_RULE in out
    assert "What moved" not in out and "dvc commit" not in out


def test_a_changed_line_of_code_is_named_with_its_module_and_function(clean: Path):
    edit(clean / "stages" / "train_sft.py", "list(d.columns)", "list(d.columns)[:1]")
    out = why(clean)
    assert f"`dvc repro` reruns {STAGE}" in out, out
    assert "code   stages/train_sft.py: chat_files\n" in out
    assert "The same edits also move the view of: train_sft@rl (code)" in out
    assert CODE_RULE in out


def test_a_tool_version_bump_is_named_with_both_versions(clean: Path):
    lock = clean / "requirements.lock"
    version = lock_pins(lock.read_text())["jax"]
    edit(lock, f"\njax=={version} ", f"\njax=={version}.1 ")
    out = why(clean)
    assert f"`dvc repro` reruns {STAGE}" in out, out
    assert f"tool   jax: {version} -> {version}.1 (requirements.lock)" in out
    assert 'tools (mtpipe/pipeline/toolchain.py): "The packages are the toolchain packages' in out


def test_dvc_commit_keeps_the_outputs_and_reruns_nothing(clean: Path):
    """A rename the user judges behaviour-free: the command `why` prints records the new address, the
    outputs stay as they are, `dvc status` is clean and `dvc repro` has nothing to run."""
    lock_before = yaml.safe_load((clean / "dvc.lock").read_text())["stages"]
    edit(clean / "stages" / "train_sft.py", "train = run_dir", "train_parquet = run_dir")
    edit(clean / "stages" / "train_sft.py", "), train)", "), train_parquet)")
    edit(clean / "stages" / "train_sft.py", "str(train),", "str(train_parquet),")
    out = why(clean)
    keep = [line.strip() for line in out.splitlines() if "dvc commit" in line]
    assert keep == [f"dvc repro configure && dvc commit --force {STAGE} train_sft@rl"], out
    subprocess.run(["bash", "-c", keep[0]], cwd=clean, env=run_env(clean), check=True, capture_output=True)
    assert stale(clean) == {}
    assert ran_stages(dvc(clean, "repro", "--dry").stdout) == set()
    lock_after = yaml.safe_load((clean / "dvc.lock").read_text())["stages"]
    for stage in (STAGE, "train_sft@rl"):
        assert lock_after[stage]["outs"] == lock_before[stage]["outs"]
        assert lock_after[stage]["deps"] != lock_before[stage]["deps"], "the new address is recorded"


PARTS = '''"""A module."""

LIMIT = 3


def load(path, retries=2):
    """Load."""
    if retries < 0:
        raise ValueError("retries must not be negative")
    return open(path).read()


class Reader:
    kind = "text"

    def read(self, path):
        return load(path)
'''


@pytest.mark.parametrize(("old", "new", "moved"), [
    ("    return open(path)", "    # read it all\n    return open(path)", []),
    ('"retries must not be negative"', '"retries: at least 0"', []),
    ("retries=2", "retries=3", ["load"]),
    ("return load(path)", "return load(path, 0)", ["Reader.read"]),
    ('kind = "text"', 'kind = "bytes"', ["Reader"]),
    ("LIMIT = 3", "LIMIT = 4", ["module level"]),
], ids=["comment", "message", "default", "method", "class_attribute", "constant"])
def test_the_parts_an_edit_moved_are_named(old: str, new: str, moved: list[str]):
    """fingerprint.part_fingerprints, which `why` compares to name the functions an edit moved: the
    fingerprint's own normalisation, part by part."""
    from mtpipe.pipeline.fingerprint import part_fingerprints, source_fingerprint

    assert old in PARTS
    before, after = part_fingerprints(PARTS), part_fingerprints(PARTS.replace(old, new))
    assert [name for name in before if before[name] != after[name]] == moved
    assert (source_fingerprint(PARTS) != source_fingerprint(PARTS.replace(old, new))) == bool(moved)


def test_a_name_that_is_no_stage_stops_at_once_naming_the_stages():
    proc = subprocess.run([sys.executable, "-m", "mtpipe.pipeline.why", "train_sft"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "mtpipe: train_sft: is not a stage with a view. Fix: name one of make_embedded, " in proc.stderr
    assert "train_sft@sft, train_sft@rl" in proc.stderr and "train_rl," in proc.stderr
