"""Shared fixtures, and the order tests run in.

The real pipeline runs once per test session, in a copy of the project. `make test` runs the suite
on two pytest-xdist workers (`-n 2 --dist loadgroup`): one builds that pipeline while the other runs
the tests that do not need it; the tests that do are grouped per file, each file on one worker, in a
copy of the built project of its own (docs/testing.md).

Fixtures used by several test files are defined here (`pipeline_run`, `pipeline_repo`,
`gcs_emulator`) or in the fixture modules named in `pytest_plugins` (tests/vm_world.py); the fakes
they start live in tests/fakes/ (docs/testing.md).
"""

import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from fakes.fake_compute import FakeCompute
from fakes.gcs_emulator import GcsEmulator, running_emulator, set_bucket_policy
from pipeline import CanaryEnv, ProcessWatch, copy_project, dvc, git, take_vm_code_path

pytest_plugins = ["vm_world"]  # the loopback VM world: local_env, world, project_world

CANARY_RECORD = "canary-run.json"  # beside the repo copy, outside every searched directory
FIRST_PIPELINE_FILE = "test_vm_recovery"  # the longest file of pipeline tests: started with the build
# the longest files (minutes) go first within their rank, so that no worker ends on a long one alone
LONGEST_FILES = ["test_vm_sweep", "test_conversion_roundtrip", "test_multihost", "test_invalidation", "test_vm_cycle"]


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
    on the code path of a TPU VM, with a canary HF_TOKEN (tests/pipeline/test_secrets.py searches for it).

    The result is committed, so tests that change things can go back with :func:`restore`.
    Under xdist the first worker that needs it builds it (the others wait for the lock) and each
    worker works in a copy of its own. Iterating on tests: MTPIPE_TEST_PIPELINE_REPO=<a copy made
    by an earlier test run> reuses it.
    """
    if os.environ.get("MTPIPE_TEST_PIPELINE_REPO"):
        repo = Path(os.environ["MTPIPE_TEST_PIPELINE_REPO"])
        restore(repo)
        return PipelineRun(repo, *CanaryEnv.load(repo.parent / CANARY_RECORD))
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return build_pipeline(tmp_path_factory.mktemp("pipeline"))
    shared = tmp_path_factory.getbasetemp().parent  # the same for every worker of this session
    with FileLock(shared / "pipeline.lock"):
        if not (shared / "pipeline" / CANARY_RECORD).exists():
            build_pipeline(shared / "pipeline")
    repo = tmp_path_factory.mktemp("pipeline") / "repo"
    shutil.copytree(shared / "pipeline" / "repo", repo, symlinks=True)
    dvc(repo, "checkout", "--relink")  # the copy's outputs are copies: links into its own cache, as after a repro
    restore(repo)
    return PipelineRun(repo, *CanaryEnv.load(shared / "pipeline" / CANARY_RECORD))


def build_pipeline(base: Path) -> PipelineRun:
    """Run the pipeline in a new copy of the project under `base` (see :func:`pipeline_run`)."""
    base.mkdir(parents=True, exist_ok=True)
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


@pytest.fixture(scope="module")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """One patched emulator per test module, storing objects under a temporary directory. Its bucket
    lets the fake Compute project's default service account (what the loopback VMs run as) use
    objects, so the identity check before spending passes (tests/cloud/checks/test_identity.py
    takes it away)."""
    with running_emulator(tmp_path_factory.mktemp("gcs-data")) as emulator:
        set_bucket_policy(emulator, [{"role": "roles/storage.objectAdmin",
                                      "members": [f"serviceAccount:{FakeCompute().default_service_account('proj-1')}"]}])
        yield emulator


def restore(repo: Path) -> None:
    """Back to the committed state of :func:`pipeline_repo`: files from git, outputs from DVC's cache."""
    git(repo, "reset", "-q", "--hard", "HEAD")
    dvc(repo, "checkout", "--force")
    status = dvc(repo, "status", "--json").stdout
    assert status.strip().splitlines()[-1] in ("{}", ""), status


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    """Group and order the tests for `--dist loadgroup --no-loadscope-reorder` (two workers).

    Each file of tests that use the shared pipeline is one xdist group (tests of one file share the
    repo's state). The first such group goes first, so one worker builds the pipeline at once; the
    slow tests that need no pipeline come next (the other worker runs them meanwhile), then the other
    pipeline groups, then the quick tests, which even out the end.
    """
    def uses_pipeline(item: pytest.Item) -> bool:
        return "pipeline_run" in getattr(item, "fixturenames", ())

    for item in items:
        if not uses_pipeline(item):
            continue
        item.add_marker(pytest.mark.shared_pipeline)  # what it costs: the shared build (the first user) or a copy
        item.add_marker(pytest.mark.slow)
        if not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(f"pipeline-{item.path.stem}"))

    def rank(item: pytest.Item) -> tuple[int, int, str]:
        long = LONGEST_FILES.index(item.path.stem) if item.path.stem in LONGEST_FILES else len(LONGEST_FILES)
        if uses_pipeline(item) and item.path.stem == FIRST_PIPELINE_FILE:
            return 0, long, item.path.name
        if item.get_closest_marker("xdist_group"):
            return 2, long, item.path.name
        return (1 if item.get_closest_marker("slow") else 3), long, item.path.name

    # stable: within a rank, files by name whatever their folder (a file moved between folders keeps its
    # place in the schedule), and each file's tests in their order
    items.sort(key=rank)


def model_servers(root: Path) -> dict[int, str]:
    """pid -> command line of each model server (``python -m mtpipe.evaluation.server``) serving a
    model from under ``root`` (the session's temporary directory: this session's servers only)."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "mtpipe.evaluation.server" in argv and any(arg.startswith(f"{root}{os.sep}") for arg in argv):
            found[int(cmdline.parent.name)] = " ".join(argv).strip()
    return found


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run when a model server a test started outlives the session, and kill it: orphaned, it
    would serve on for hours. Checked once, after every worker has ended (not in a worker)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    left = model_servers(session.config._tmp_path_factory.getbasetemp())
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        lines = "".join(f"\n  {pid}: {argv}" for pid, argv in left.items())
        session.config.get_terminal_writer().line(
            f"FAILED: model servers outlived the test session (killed now):{lines}", red=True, bold=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
