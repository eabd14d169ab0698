"""The tutorial pages, docs/quickstart-sft.md and docs/quickstart-grpo.md: short, complete, and their
commands run in order against the fakes (the Compute API, the loopback VM, the GCS emulator, gcloud).

What the run changes, each for a stated reason (SUBSTITUTIONS, NOT_RUN): the placeholders become the
fakes' names; the tutorial presets become the embedded ones (a 4B or 8B model does not train on this
machine); `doit vm_run` gets `--yes` (no terminal to answer on: tests/test_lifecycle.py asks); the
new bucket gets the emulator's endpoint and, as if the pipeline had run before, the shared pipeline's
outputs (building it on the loopback VM from nothing would take minutes, and the shared build proves it).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from fakes import fake_gcloud
from fakes.gcs_emulator import GcsEmulator
from vm_world import ROOT, Env, assert_deleted, loopback_world, sh

pytestmark = pytest.mark.first_hour
PAGES = {"sft": ROOT / "docs" / "quickstart-sft.md", "rl": ROOT / "docs" / "quickstart-grpo.md"}
TUTORIAL = {"sft": "gemma3-4b-ultrachat-v6e8", "rl": "llama3.1-8b-gsm8k-v6e8"}
TUTORIAL_EXP = {"sft": "sft-tutorial", "rl": "grpo-tutorial"}
NOT_RUN = {   # command prefix -> why the test does not type it
    "git clone": "the test runs in a clone of the project already",
    "make": "the environment is the one running the tests",
    "source .venv/bin/activate": "the environment's bin/ is first on PATH",
    "gcloud auth application-default login": "a browser sign-in: the fakes take anonymous credentials",
}


def commands(page: Path) -> list[str]:
    """The command lines of a page's bash blocks, comments and continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), re.DOTALL)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@pytest.mark.parametrize("branch", PAGES)
def test_a_page_holds_every_step_from_a_fresh_laptop_to_a_deleted_vm(branch: str) -> None:
    page = PAGES[branch]
    assert len(page.read_text().splitlines()) <= 120, f"{page.name} is longer than a page"
    typed = "\n".join(commands(page))
    for step in ("gcloud storage buckets create gs://", "gcloud storage buckets add-iam-policy-binding",
                 "dvc remote add -d", "export HF_TOKEN=", f"doit preflight --set={branch}.preset={TUTORIAL[branch]}",
                 f"doit vm_run --set={branch}.preset={TUTORIAL[branch]} --target=evaluate@{branch}",
                 "dvc exp show", "dvc plots diff", f"dvc pull artifacts/{branch}/hf",
                 "python -m mtpipe.reporting.report", "doit vm_down"):
        assert step in typed, f"{page.name} lacks `{step}`"
    assert "What can still cost money" in page.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("branch", PAGES)
def test_the_commands_of_a_page_run_in_order_against_the_fakes(
        branch: str, tmp_path: Path, gcs_emulator: GcsEmulator, local_env: dict[str, str],
        pipeline_repo: Path) -> None:
    repo, bucket = tmp_path / "mtpipe", f"quickstart-{branch}"
    sh(["git", "clone", "-q", str(pipeline_repo), str(repo)], tmp_path, local_env)
    with loopback_world(tmp_path, repo, local_env) as w:
        w.env.update(PATH=f"{fake_gcloud.install(tmp_path / 'bin')}:{ROOT / '.venv' / 'bin'}:/usr/bin:/bin",
                     FAKE_GCS_ENDPOINT=gcs_emulator.endpoint, PYTHONPATH=str(repo),
                     **{f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
                        for what, value in (("NAME", "t"), ("EMAIL", "t@t"))})
        substitutions = {"MY_BUCKET": bucket, "my-project": "proj-1",
                         "my-v6e8-reservation": "v6e-res", f"NAME=mtpipe-{'sft' if branch == 'sft' else 'grpo'}":
                         "NAME=mt-test", "PROJECT_NUMBER": w.fake.project_numbers["proj-1"],
                         "HF_TOKEN=hf_...": f"HF_TOKEN={w.env['HF_TOKEN']}", TUTORIAL[branch]: f"embedded-{branch}",
                         "doit vm_run": "doit vm_run --yes"}
        out = {}
        for line in commands(PAGES[branch]):
            if any(line.startswith(prefix) for prefix in NOT_RUN):
                continue
            for old, new in substitutions.items():
                line = line.replace(old, new)
            if line.startswith("export "):
                w.env.update(word.split("=", 1) for word in shlex.split(line)[1:])
                continue
            if line.startswith("git commit"):   # the emulator's endpoint, which a real bucket does not need
                for key, value in (("endpointurl", gcs_emulator.endpoint), ("allow_anonymous_login", "true")):
                    sh([sys.executable, "-m", "dvc", "remote", "modify", "gcs", key, value], repo, w.env)
                seed_remote(pipeline_repo, bucket, gcs_emulator, w.env)
            proc = subprocess.run(["bash", "-c", line], cwd=repo, env=w.env, capture_output=True, text=True,
                                  timeout=900)
            # DVC's exp apply writes the experiment's git files, then stops at the outputs the local cache
            # lacks (the page says so): the next line pulls the one the page wants
            missing = (line.startswith("dvc exp apply") and proc.returncode == 255
                       and "Is your cache up to date?" in proc.stderr)
            assert proc.returncode == 0 or missing, f"{line}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
            out[line.split(" --")[0]] = proc.stdout + proc.stderr
        check_what_the_page_promised(w, branch, out, bucket, gcs_emulator)


def seed_remote(pipeline_repo: Path, bucket: str, emulator: GcsEmulator, env: dict[str, str]) -> None:
    """The new bucket holds the shared pipeline's outputs, as after an earlier run pushed them."""
    config_local = pipeline_repo / ".dvc" / "config.local"
    assert not config_local.exists()
    dvc = [sys.executable, "-m", "dvc"]
    try:
        sh([*dvc, "remote", "add", "--local", "seed", f"gs://{bucket}/mtpipe"], pipeline_repo, env)
        sh([*dvc, "remote", "modify", "--local", "seed", "endpointurl", emulator.endpoint], pipeline_repo, env)
        sh([*dvc, "remote", "modify", "--local", "seed", "allow_anonymous_login", "true"], pipeline_repo, env)
        sh([*dvc, "push", "-q", "-r", "seed"], pipeline_repo, env)
    finally:
        config_local.unlink(missing_ok=True)


def check_what_the_page_promised(w: Env, branch: str, out: dict[str, str], bucket: str,
                                 emulator: GcsEmulator) -> None:
    """The bucket, the binding, the run, the results and nothing left of the VM."""
    with_account = f"serviceAccount:{w.fake.default_service_account('proj-1')}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    policy = json.loads(opener.open(f"{emulator.endpoint}/storage/v1/b/{bucket}/iam", timeout=10).read())
    assert {"role": "roles/storage.objectAdmin", "members": [with_account]} in policy["bindings"]
    run = out["doit vm_run"]
    assert "about to create ct6e-standard-8t VM mt-test" in run and f"experiment {TUTORIAL_EXP[branch]}" in run
    assert "VM mt-test: deleted" in run, run[-3000:]
    assert TUTORIAL_EXP[branch] in out["dvc exp show"]
    assert (w.repo / "dvc_plots" / "index.html").is_file()
    assert (w.repo / "artifacts" / branch / "hf" / "config.json").is_file()
    assert not (w.repo / "artifacts" / branch / "trained").exists(), "more than the export was pulled"
    assert (w.repo / "reports" / "latest" / "README.md").is_file()
    assert_deleted(w)

