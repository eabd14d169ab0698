"""Shared fixtures. The real pipeline runs once per test session, in a copy of the project."""

import os
from pathlib import Path

import pytest

from pipeline import copy_project, dvc, git


@pytest.fixture(scope="session")
def pipeline_repo(tmp_path_factory) -> Path:
    """A copy of the project where `dvc repro` ran the whole embedded default once (real MaxText).

    The result is committed, so tests that change things can go back with :func:`restore`.
    Iterating on tests: MTPIPE_TEST_PIPELINE_REPO=<a copy made by an earlier session> reuses it.
    """
    if os.environ.get("MTPIPE_TEST_PIPELINE_REPO"):
        repo = Path(os.environ["MTPIPE_TEST_PIPELINE_REPO"])
        restore(repo)
        return repo
    repo = copy_project(tmp_path_factory.mktemp("pipeline") / "repo")
    result = dvc(repo, "repro")
    (repo / "work" / "first_repro.log").write_text(result.stdout)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pipeline ran")
    return repo


def restore(repo: Path) -> None:
    """Back to the committed state of :func:`pipeline_repo`: files from git, outputs from DVC's cache."""
    git(repo, "reset", "-q", "--hard", "HEAD")
    dvc(repo, "checkout", "--force")
    status = dvc(repo, "status", "--json").stdout
    assert status.strip().splitlines()[-1] in ("{}", ""), status
