"""Identical inputs give identical bytes: a forced rerun leaves dvc.lock as it was (issue 10).

`dvc repro -f TARGET` reruns TARGET and every stage above it. When each of them writes the same
bytes again, DVC records the same hashes, `dvc.lock` does not change and nothing downstream is
stale: the early cutoff that makes a refactor, a second machine or a forced rerun free.
"""

import pytest

from conftest import restore
from pipeline import dvc, ran_stages

pytestmark = [pytest.mark.slow, pytest.mark.reproducible]


@pytest.mark.parametrize("target", ["to_maxtext@sft", "to_huggingface@sft"])
def test_forced_rerun_gives_identical_outputs(pipeline_repo, target):
    lock = (pipeline_repo / "dvc.lock").read_text()
    try:
        ran = ran_stages(dvc(pipeline_repo, "repro", "-f", target).stdout)
        assert target in ran and "to_maxtext@sft" in ran, ran
        assert (pipeline_repo / "dvc.lock").read_text() == lock, f"`dvc repro -f {target}` changed dvc.lock"
        assert dvc(pipeline_repo, "status", "--json").stdout.strip().splitlines()[-1] == "{}"
    finally:
        restore(pipeline_repo)
