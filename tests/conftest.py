"""Shared fixtures. The real pipeline runs once per test session, in a copy of the project."""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline import CanaryEnv, ProcessWatch, copy_project, dvc, git, take_vm_code_path

CANARY_RECORD = "canary-run.json"  # beside the repo copy, outside every searched directory


@dataclass
class PipelineRun:
    """The pipeline run shared by the session: its repo, the canary token it ran with (HF_TOKEN, a
    fresh HOME and TMPDIR, MaxText not decoupled from Google Cloud) and what /proc showed meanwhile."""

    repo: Path
    canary: CanaryEnv
    findings: dict  # CanaryEnv.search() right after the run, before any test changed the repo


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory) -> PipelineRun:
    """A copy of the project where `dvc repro` ran the whole embedded default once (real MaxText),
    on the code path of a TPU VM, with a canary HF_TOKEN (tests/test_secrets.py searches for it).

    The result is committed, so tests that change things can go back with :func:`restore`.
    Iterating on tests: MTPIPE_TEST_PIPELINE_REPO=<a copy made by an earlier session> reuses it.
    """
    if os.environ.get("MTPIPE_TEST_PIPELINE_REPO"):
        repo = Path(os.environ["MTPIPE_TEST_PIPELINE_REPO"])
        restore(repo)
        return PipelineRun(repo, *CanaryEnv.load(repo.parent / CANARY_RECORD))
    base = tmp_path_factory.mktemp("pipeline")
    repo = copy_project(base / "repo")
    take_vm_code_path(repo)
    canary = CanaryEnv.create(base)
    with ProcessWatch(canary.canary, canary.marker) as watch:
        result = dvc(repo, "repro", extra_env=canary.env(), timeout=3600)
    (repo / "work" / "first_repro.log").write_text(result.stdout)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pipeline ran")
    findings = canary.search(repo, watch)
    canary.save(base / CANARY_RECORD, findings)
    return PipelineRun(repo, canary, findings)


@pytest.fixture(scope="session")
def pipeline_repo(pipeline_run: PipelineRun) -> Path:
    """The repo of :func:`pipeline_run`."""
    return pipeline_run.repo


def restore(repo: Path) -> None:
    """Back to the committed state of :func:`pipeline_repo`: files from git, outputs from DVC's cache."""
    git(repo, "reset", "-q", "--hard", "HEAD")
    dvc(repo, "checkout", "--force")
    status = dvc(repo, "status", "--json").stdout
    assert status.strip().splitlines()[-1] in ("{}", ""), status
