"""The tutorial pages, docs/quickstart-setup.md (once), then docs/quickstart-sft.md and
docs/quickstart-grpo.md: short, complete, and their commands run in that order, in one repository,
against the fakes (the Compute API, the loopback VM, the GCS emulator, gcloud), as a newcomer who
does both tutorials runs them: no step fails the second time, and the second tutorial runs on the
VM the first one kept.

What the run changes, each for a stated reason (SUBSTITUTIONS, NOT_RUN, SKIPPED): the placeholders
become the fakes' names; the tutorial presets become the embedded ones (a 4B or 8B model does not
train on this machine); `doit vm_run` gets `--yes` (no terminal to answer on: tests/cloud/lifecycle/test_lifecycle.py
asks); the new bucket gets the emulator's endpoint and, as if the pipeline had run before, the shared
pipeline's outputs (building it on the loopback VM from nothing would take minutes, and the shared
build proves it).
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
from fakes.hf_server import HubServer
from vm_world import (ONE_CHIP, ROOT, Env, assert_deleted, assert_rehearsed, hub_with_tutorial_repos, loopback_world, sh,
                      tpu_stand_in)

pytestmark = [pytest.mark.docs, pytest.mark.first_hour, pytest.mark.first_run]
SETUP = ROOT / "docs" / "quickstart-setup.md"
PAGES = {"sft": ROOT / "docs" / "quickstart-sft.md", "rl": ROOT / "docs" / "quickstart-grpo.md"}
TUTORIAL = {"sft": "gemma3-4b-ultrachat-v6e8", "rl": "llama3.1-8b-gsm8k-v6e8"}
TUTORIAL_EXP = {"sft": "sft-tutorial", "rl": "grpo-tutorial"}
NOT_RUN = {   # command prefix -> why the test does not type it
    "make": "the environment is the one running the tests, its bin/ first on PATH",
}
# (page, section heading's start) -> why the test skips that section's commands: what the page says
SKIPPED = {("sft", "6. Teardown"): "the GRPO quickstart follows: the SFT page says to skip its teardown then",
           ("rl", "3. Rehearse"): "the SFT quickstart came first: the GRPO page says to skip its rehearsal then"}
BUCKET = "quickstart"


def sections(page: Path) -> list[tuple[str, str]]:
    """(section heading, command line) for each command line of a page's bash blocks, comments and
    continuation lines joined."""
    found, parts = [], re.split(r"^## (.*)$", page.read_text(), flags=re.MULTILINE)
    for heading, body in zip(["", *parts[1::2]], parts[::2]):   # the text before the first heading: ""
        for block in re.findall(r"```bash\n(.*?)```", body, re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("  #")[0].strip()
                if line and not line.startswith("#"):
                    found.append((heading, line))
    return found


def commands(page: Path) -> list[str]:
    """The command lines of a page's bash blocks."""
    return [line for _, line in sections(page)]


def test_the_setup_page_holds_what_a_new_user_types_once() -> None:
    typed = commands(SETUP)
    ordered = ["gcloud auth login", "gcloud config set project my-project", "gcloud auth application-default login",
               "gcloud auth application-default set-quota-project my-project", "gcloud services enable",
               "gcloud storage buckets create gs://",
               "gcloud storage buckets add-iam-policy-binding", "dvc remote add -d", "git commit"]
    at = [next((i for i, line in enumerate(typed) if line.startswith(step)), -1) for step in ordered]
    assert -1 not in at and at == sorted(at), f"{SETUP.name}: {dict(zip(ordered, at))}"
    assert "(roles.md)" in SETUP.read_text()


def test_the_setup_is_once_because_gcloud_refuses_it_twice(tmp_path: Path, gcs_emulator: GcsEmulator) -> None:
    """Why the setup is a page of its own (docs/decisions/cloud-vm.md): a bucket that exists is not created
    again, and the quota project needs the ADC sign-in before it."""
    env = {"PATH": f"{fake_gcloud.install(tmp_path / 'bin')}:/usr/bin:/bin", "CLOUDSDK_CONFIG": str(tmp_path / "cfg"),
           "FAKE_GCS_ENDPOINT": gcs_emulator.endpoint}

    def gcloud(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["gcloud", *args], env=env, capture_output=True, text=True, timeout=60)

    assert "have not been set up" in gcloud("auth", "application-default", "set-quota-project", "proj-1").stderr
    create = ("storage", "buckets", "create", "gs://twice", "--project=proj-1")
    assert gcloud(*create).returncode == 0
    again = gcloud(*create)
    assert again.returncode == 1 and "HTTPError 409" in again.stderr, again.stderr


@pytest.mark.parametrize("branch", PAGES)
def test_a_page_holds_every_step_from_a_fresh_laptop_to_a_deleted_vm(branch: str) -> None:
    page = PAGES[branch]
    text = page.read_text()
    assert len(text.splitlines()) <= 120, f"{page.name} is longer than a page"
    typed = commands(page)
    for step in ("export HF_TOKEN=", f"doit preflight --set={branch}.preset={TUTORIAL[branch]}",
                 f"doit vm_run --set={branch}.preset={TUTORIAL[branch]} --target=evaluate@{branch}",
                 "dvc exp show", "dvc plots diff", f"dvc pull artifacts/{branch}/hf",
                 "python -m mtpipe.reporting.report", "doit vm_down"):
        assert any(step in line for line in typed), f"{page.name} lacks `{step}`"
    first_paid = next(line for line in typed if line.startswith("doit vm_"))
    assert first_paid == "doit vm_run --rehearse", f"{page.name}: the first paid step is `{first_paid}`"
    for link in ("(quickstart-setup.md)", "(roles.md)", "(maxtext-adapter.md)"):
        assert link in text, f"{page.name} does not link {link}"
    assert "roles/" not in text, "the roles are docs/roles.md's"
    teardown = " ".join(text.split("## 6. Teardown")[1].split())
    for said in ("What else can cost money", "The reservation bills on after the VM is deleted",
                 "gcloud compute reservations delete my-v6e8-reservation", "cannot be cancelled and ends at its end time"):
        assert said in teardown, f"{page.name}'s teardown does not say: {said}"


@pytest.mark.slow
@pytest.mark.rehearsal
@pytest.mark.secrets
def test_the_setup_and_both_quickstarts_run_in_order_against_the_fakes(
        tmp_path: Path, gcs_emulator: GcsEmulator, local_env: dict[str, str], pipeline_repo: Path) -> None:
    repo = tmp_path / "mtpipe"
    sh(["git", "clone", "-q", str(pipeline_repo), str(repo)], tmp_path, local_env)
    with loopback_world(tmp_path, repo, local_env) as w, HubServer(tmp_path / "hub") as hub:
        tpu_stand_in(w)   # the rehearsal's TPU check on a VM whose JAX has the CPU only
        hub_with_tutorial_repos(hub)   # the rehearsal's Hub download
        w.configure(run__env__HF_ENDPOINT=hub.url)
        w.env.update(PATH=f"{fake_gcloud.install(tmp_path / 'bin')}:{ROOT / '.venv' / 'bin'}:/usr/bin:/bin",
                     HF_ENDPOINT=hub.url,
                     FAKE_GCS_ENDPOINT=gcs_emulator.endpoint, PYTHONPATH=str(repo),
                     CLOUDSDK_CONFIG=str(tmp_path / "gcloud-config"),
                     **{f"GIT_{who}_{what}": value for who in ("AUTHOR", "COMMITTER")
                        for what, value in (("NAME", "t"), ("EMAIL", "t@t"))})
        substitutions = {"MY_BUCKET": BUCKET, "my-project": "proj-1", "my-v6e8-reservation": "v6e-res",
                         "NAME=mtpipe-tutorial": "NAME=mt-test", "PROJECT_NUMBER": w.fake.project_numbers["proj-1"],
                         "HF_TOKEN=hf_...": f"HF_TOKEN={w.env['HF_TOKEN']}", "doit vm_run": "doit vm_run --yes",
                         **{TUTORIAL[branch]: f"embedded-{branch}" for branch in PAGES}}
        out: dict[tuple[str, str], str] = {}
        for name, page in (("setup", SETUP), *PAGES.items()):   # in one repo, one after the other
            for heading, line in sections(page):
                if any(line.startswith(prefix) for prefix in NOT_RUN) or \
                        any(name == skip_page and heading.startswith(skip) for skip_page, skip in SKIPPED):
                    continue
                for old, new in substitutions.items():
                    line = line.replace(old, new)
                out[name, line] = run(line, w, pipeline_repo, gcs_emulator)
        check_what_the_pages_promised(w, out, gcs_emulator)
    for (page, heading), why in SKIPPED.items():
        assert "Skip this section" in PAGES[page].read_text().split(f"## {heading}")[1].split("```")[0], why


def run(line: str, w: Env, pipeline_repo: Path, emulator: GcsEmulator) -> str:
    """One command line of a page in the repo, as a shell runs it; its output."""
    if line.startswith("export "):
        w.env.update(word.split("=", 1) for word in shlex.split(line)[1:])
        return ""
    if line.startswith("git commit"):   # the emulator's endpoint, which a real bucket does not need
        for key, value in (("endpointurl", emulator.endpoint), ("allow_anonymous_login", "true")):
            sh([sys.executable, "-m", "dvc", "remote", "modify", "gcs", key, value], w.repo, w.env)
        seed_remote(pipeline_repo, BUCKET, emulator, w.env)
    proc = subprocess.run(["bash", "-c", line], cwd=w.repo, env=w.env, capture_output=True, text=True, timeout=900)
    # DVC's exp apply writes the experiment's git files, then stops at the outputs the local cache
    # lacks (the page says so): the next line pulls the one the page wants
    missing = (line.startswith("dvc exp apply") and proc.returncode == 255
               and "Is your cache up to date?" in proc.stderr)
    assert proc.returncode == 0 or missing, f"{line}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


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


def output(out: dict[tuple[str, str], str], page: str, start: str) -> str:
    """What the one command of ``page`` that starts with ``start`` printed."""
    (found,) = [text for (name, line), text in out.items() if name == page and line.startswith(start)]
    return found


def check_what_the_pages_promised(w: Env, out: dict[tuple[str, str], str], emulator: GcsEmulator) -> None:
    """The sign-ins, the bucket and its binding, the rehearsal (the suite's one: it trains both
    branches' first steps on the loopback VM), each tutorial's run and results, one VM for both runs,
    and nothing left of any VM."""
    signed_in = json.loads((Path(w.env["CLOUDSDK_CONFIG"]) / "fake-gcloud.json").read_text())
    assert signed_in == {"account": "newcomer@example.com", "project": "proj-1",
                         "adc_account": "newcomer@example.com", "adc_quota_project": "proj-1"}, signed_in
    with_account = f"serviceAccount:{w.fake.default_service_account('proj-1')}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    policy = json.loads(opener.open(f"{emulator.endpoint}/storage/v1/b/{BUCKET}/iam", timeout=10).read())
    assert {"role": "roles/storage.objectAdmin", "members": [with_account]} in policy["bindings"]
    rehearsed, real = (r.json() for r in w.fake.inserts()[:2])   # the rehearsal's VM, then the SFT run's
    assert_rehearsed(w, output(out, "sft", "doit vm_run --yes --rehearse"), rehearsed, real, usd_per_hour=1.215)
    for branch in PAGES:
        run = output(out, branch, f"doit vm_run --yes --set={branch}.preset")
        assert f"experiment {TUTORIAL_EXP[branch]}" in run, run[-3000:]
        assert TUTORIAL_EXP[branch] in output(out, branch, "dvc exp show")
        assert (w.repo / "artifacts" / branch / "hf" / "config.json").is_file()
        assert not (w.repo / "artifacts" / branch / "trained").exists(), "more than the export was pulled"
    sft_run, rl_run = (output(out, b, f"doit vm_run --yes --set={b}.preset") for b in PAGES)
    assert "about to create ct6e-standard-8t VM mt-test" in sft_run and "keeps running (--keep)" in sft_run
    assert "about to create" not in rl_run and "VM mt-test: deleted" in rl_run, rl_run[-3000:]
    machines = [r.json()["machineType"].rsplit("/", 1)[1] for r in w.fake.inserts()]
    assert machines == [ONE_CHIP, "ct6e-standard-8t"], f"the GRPO run did not use the SFT run's VM: {machines}"
    assert (w.repo / "dvc_plots" / "index.html").is_file()
    assert (w.repo / "reports" / "latest" / "README.md").is_file()
    assert_deleted(w)
