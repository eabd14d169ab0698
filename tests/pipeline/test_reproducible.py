"""Identical inputs give identical bytes: a forced rerun leaves dvc.lock as it was.

`dvc repro -f TARGET` reruns TARGET and every stage above it. When each of them writes the same
bytes again, DVC records the same hashes, `dvc.lock` does not change and nothing downstream is
stale: the early cutoff that makes a refactor, a second machine or a forced rerun free.
"""

import pytest

from conftest import restore
from pipeline import dvc, ran_stages

pytestmark = [pytest.mark.slow, pytest.mark.reproducible]


def test_forced_rerun_gives_identical_outputs(pipeline_repo):
    """`-f to_maxtext@sft` reruns the SFT branch's download and conversion and the stages before them
    (configure, the generator of the embedded default), `-f -s to_huggingface@sft` the export alone:
    each must write the bytes it wrote before. The training between them is rerun on identical inputs by
    tests/pipeline/test_content_address.py (another checkpoint period, the same params) and the resume tests."""
    lock = (pipeline_repo / "dvc.lock").read_text()
    try:
        ran = ran_stages(dvc(pipeline_repo, "repro", "-f", "to_maxtext@sft").stdout)
        assert {"configure", "make_embedded", "hf_download@sft", "to_maxtext@sft"} <= set(ran), ran
        ran = ran_stages(dvc(pipeline_repo, "repro", "-f", "-s", "to_huggingface@sft").stdout)
        assert ran == {"to_huggingface@sft"}, ran
        assert (pipeline_repo / "dvc.lock").read_text() == lock, "a forced rerun changed dvc.lock"
        assert dvc(pipeline_repo, "status", "--json").stdout.strip().splitlines()[-1] == "{}"
    finally:
        restore(pipeline_repo)


def test_no_artifact_holds_the_checkouts_path(pipeline_repo):
    """Outputs must not depend on where the repository is: a conversion or training on the VM (or
    in a work bucket) must give the bytes it gives here. Orbax writes its own path into each
    commit_success.txt; mtpipe.maxtext.checkpoints.normalise_orbax_metadata cuts it."""
    where = str(pipeline_repo.resolve()).encode()
    files = [f for f in (pipeline_repo / "artifacts").rglob("*") if f.is_file()]
    markers = [f for f in files if f.name == "commit_success.txt"]
    assert len(markers) >= 4, markers  # conversions (step + item) and trained params: really searched
    assert [str(f) for f in files if where in f.read_bytes()] == []
