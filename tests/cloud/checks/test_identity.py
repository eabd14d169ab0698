"""Identity before spending (mtpipe/cloud/checks/gcp/identity.py): the VM runs as its service account and
from the DVC config of the commit vm_run ships, so both are checked before anything is created.

`doit vm_up` / `doit vm_run` run in process against the loopback world (tests/vm_world.py: the fake
Compute API, the GCS emulator as the DVC remote, an sshd as the VM), with the fake IAM reads
(tests/fakes/fake_iam.py: Resource Manager and IAM, judged by their discovery documents) and the
VM's metadata server (tests/fakes/fake_metadata.py). The emulator holds requests made with the
VM's token to the bucket's IAM policy, as GCS does. Each scenario ends before the insert with the
fix in the message, or, where only the VM can tell, within a minute of SSH being ready with the VM
and its firewall rule deleted before any setup.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fakes.fake_iam import FakeIam, running_fake_iam
from fakes.fake_metadata import FakeMetadata, running_metadata
from fakes.gcs_emulator import GCS_TEST_ENV, GcsEmulator, create_bucket, set_bucket_policy
from vm_world import Env, assert_deleted, sh

from mtpipe.cloud.checks.gcp import identity
from mtpipe.cloud.providers.gcp.google_apis import Unknown
from mtpipe.cloud.settings import vm_config, vm_state
from mtpipe.errors import ConfigError

pytestmark = [pytest.mark.checks, pytest.mark.first_contact]

DEFAULT_SA = "1234-compute@developer.gserviceaccount.com"   # fake Compute: proj-1 is project 1234
WORK_BUCKET = "mtpipe-work"
# What GCS gives a new bucket: the project's basic role holders as legacy bucket/object roles.
BUCKET_DEFAULTS = [{"role": "roles/storage.legacyBucketOwner", "members": ["projectEditor:proj-1", "projectOwner:proj-1"]},
                   {"role": "roles/storage.legacyBucketReader", "members": ["projectViewer:proj-1"]}]


@pytest.fixture
def iw(world: Env, gcs_emulator: GcsEmulator) -> Iterator[tuple[Env, FakeIam, FakeMetadata]]:
    """The loopback world with the IAM reads and the VM's metadata server; the default bucket
    grants the VM's account nothing beyond GCS's defaults, its project's policy nothing."""
    def vm_account() -> str | None:
        instance = world.instance()
        email = instance["serviceAccounts"][0]["email"] if instance else None
        return DEFAULT_SA if email == "default" else email

    set_bucket_policy(gcs_emulator, BUCKET_DEFAULTS)
    create_bucket(gcs_emulator, WORK_BUCKET)
    set_bucket_policy(gcs_emulator, BUCKET_DEFAULTS, WORK_BUCKET)
    with running_fake_iam() as iam, running_metadata(FakeMetadata(vm_account)) as metadata:
        world.env[identity.IAM_ENDPOINT_ENV] = iam.url
        world.configure(run__env={**GCS_TEST_ENV, "GCE_METADATA_HOST": metadata.host})
        yield world, iam, metadata


def remote_url(w: Env) -> str:
    return f"gs://mtpipe-test/{w.repo.parent.name}"


def nothing_created(w: Env) -> None:
    assert w.fake.inserts() == [] and w.fake.calls("POST", "/global/firewalls") == [] and not w.fake.firewalls
    assert not (w.repo / vm_state.STATE_FILE).exists()


def commit(w: Env, message: str) -> None:
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", message], w.repo, w.env)


def uncommit_remote(w: Env) -> str:
    """HEAD's .dvc/config loses its remote; returns the text it had."""
    config = w.repo / ".dvc" / "config"
    text = config.read_text()
    config.write_text("[core]\n    analytics = false\n")
    commit(w, "no remote")
    return text


# ---------------------------------------------------------------- the remote that is shipped


def test_remote_only_in_config_local_is_refused(iw) -> None:
    w, _, _ = iw
    text = uncommit_remote(w)
    (w.repo / ".dvc" / "config.local").write_text(text.replace("analytics = false\n", ""))
    out = w.doit("vm_up", ok=False).stdout
    assert (f"core.remote: the default DVC remote gcs ({remote_url(w)}) is only in .dvc/config.local; vm_run "
            "ships HEAD, whose .dvc/config has none, so `dvc pull` on the VM would fail with 'no remote'") in out
    assert f"Fix: `dvc remote add -d gcs {remote_url(w)}` (without --local) and `git commit .dvc/config`" in out
    nothing_created(w)


def test_remote_only_in_an_uncommitted_edit_is_refused(iw) -> None:
    w, _, _ = iw
    text = uncommit_remote(w)
    (w.repo / ".dvc" / "config").write_text(text)
    out = w.doit("vm_run", ok=False).stdout
    assert "is only in an uncommitted edit of .dvc/config" in out and "`git commit .dvc/config`" in out
    nothing_created(w)


def test_laptop_remote_other_than_the_shipped_one_is_refused(iw) -> None:
    w, _, _ = iw
    (w.repo / ".dvc" / "config.local").write_text("['remote \"gcs\"']\n    url = gs://mtpipe-test/elsewhere\n")
    out = w.doit("vm_up", ok=False).stdout
    assert ("core.remote: this checkout's default DVC remote is gcs (gs://mtpipe-test/elsewhere, from "
            f".dvc/config.local) but vm_run ships gcs ({remote_url(w)}, HEAD's .dvc/config)") in out
    nothing_created(w)


# ---------------------------------------------------------------- proven from the laptop


def test_default_service_account_without_object_create_is_refused(iw, gcs_emulator: GcsEmulator) -> None:
    w, iam, _ = iw
    set_bucket_policy(gcs_emulator, [*BUCKET_DEFAULTS, {"role": "roles/storage.objectViewer",
                                                        "members": [f"serviceAccount:{DEFAULT_SA}"]}])
    iam.grant("projects/1234", "roles/compute.admin", "user:me@example.com")
    out = w.doit("vm_up", ok=False).stdout
    assert (f"vm.service_account: the VM would run as {DEFAULT_SA}, which may not write {remote_url(w)} "
            "(remote.gcs.url): no allow policy on the bucket, its project, folders or organization grants it "
            "storage.objects.create") in out
    assert (f"Fix: `gcloud storage buckets add-iam-policy-binding gs://mtpipe-test "
            f"--member=serviceAccount:{DEFAULT_SA} --role=roles/storage.objectAdmin`") in out
    nothing_created(w)
    assert w.fake.calls("GET", "/compute/v1/projects/proj-1")   # "default" resolved by Compute
    assert ("POST", "/v3/projects/1234:getIamPolicy") in iam.requests
    assert ("POST", "/v3/organizations/1:getIamPolicy") in iam.requests


def test_work_bucket_without_delete_is_refused(iw, gcs_emulator: GcsEmulator) -> None:
    w, iam, _ = iw
    w.configure(run__env={**GCS_TEST_ENV, "MTPIPE_WORK_BUCKET": f"gs://{WORK_BUCKET}/work",
                          "STORAGE_EMULATOR_HOST": gcs_emulator.endpoint})
    for role in ("roles/storage.objectCreator", "roles/storage.objectViewer"):   # the remote needs no more
        iam.grant("projects/1234", role, f"serviceAccount:{DEFAULT_SA}")
    out = w.doit("vm_run", ok=False).stdout
    assert (f"the VM would run as {DEFAULT_SA}, which may not delete gs://{WORK_BUCKET}/work "
            "(vm.run.env.MTPIPE_WORK_BUCKET)") in out
    assert f"gs://{WORK_BUCKET} --member=serviceAccount:{DEFAULT_SA}" in out
    nothing_created(w)


def _check(w: Env, **values: object) -> list[identity.Target]:
    """check_identity in this process, with doit's environment and conf/vm.yaml's ``values``."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in w.env.items():
            mp.setenv(key, value)
        return identity.check_identity(vm_config.load_config(values), w.repo)


def test_grants_the_laptop_can_prove(iw, gcs_emulator: GcsEmulator) -> None:
    """Project editor (roles/editor on the bucket's project, through the bucket's projectEditor
    member too), a custom role read with IAM, a dedicated service account named by email."""
    w, iam, _ = iw
    iam.grant("projects/1234", "roles/editor", f"serviceAccount:{DEFAULT_SA}")
    assert _check(w) == []
    iam.policies.clear()
    iam.roles["projects/proj-1/roles/dvcWriter"] = ["storage.objects.create", "storage.objects.get",
                                                    "storage.objects.list", "storage.buckets.get"]
    set_bucket_policy(gcs_emulator, [*BUCKET_DEFAULTS, {"role": "projects/proj-1/roles/dvcWriter",
                                                        "members": [f"serviceAccount:{DEFAULT_SA}"]}])
    assert _check(w) == []
    assert ("GET", "/v1/projects/proj-1/roles/dvcWriter") in iam.requests
    runner = "runner@proj-1.iam.gserviceaccount.com"
    with pytest.raises(ConfigError, match=f"the VM would run as {runner}, which may not write/read/list"):
        _check(w, service_account=runner)
    with pytest.raises(ConfigError, match="vm.service_account: 'me' is neither `default` nor"):
        _check(w, service_account="me")


def test_what_the_laptop_cannot_read_goes_to_the_vm(iw, gcs_emulator: GcsEmulator) -> None:
    w, iam, _ = iw
    set_bucket_policy(gcs_emulator, [*BUCKET_DEFAULTS, {"role": "roles/storage.objectAdmin",
                                                        "members": ["group:ml@example.com"]}])
    iam.unreadable.add("projects/1234")
    wanted = _check(w)
    assert [t.url for t in wanted] == [remote_url(w)]


# ---------------------------------------------------------------- only the VM can tell


def test_vm_probe_refuses_within_a_minute_of_ssh_and_deletes_the_vm(iw, gcs_emulator: GcsEmulator) -> None:
    """A group holds the role and the project's policy is unreadable: the laptop cannot tell, the VM
    (whose account is not in the group) is refused by GCS; deleted before any setup."""
    w, iam, metadata = iw
    set_bucket_policy(gcs_emulator, [*BUCKET_DEFAULTS, {"role": "roles/storage.objectAdmin",
                                                        "members": ["group:ml@example.com"]}])
    iam.unreadable.add("projects/1234")
    started = time.monotonic()
    out = w.doit("vm_run", ok=False).stdout
    after_ssh = out.split("ready at", 1)
    assert len(after_ssh) == 2, out
    assert "cannot prove from here that the VM's service account" in out and "group:ml@example.com" in out
    assert (f"vm.service_account: from the VM, its service account {DEFAULT_SA} may not write {remote_url(w)} "
            "(remote.gcs.url): GCS answered 403 to storage.objects.create") in out
    assert f"gcloud storage buckets add-iam-policy-binding gs://mtpipe-test --member=serviceAccount:{DEFAULT_SA}" in out
    assert time.monotonic() - started < 60
    assert len(w.fake.inserts()) == 1
    assert_deleted(w)
    assert not (w.sshd.home / "setup-count").exists()   # no setup minute was spent
    assert any(p.endswith("/token") for p in metadata.requests)


def test_vm_probe_passes_and_the_run_goes_on(iw, gcs_emulator: GcsEmulator) -> None:
    """A conditional grant: the laptop cannot evaluate it, the VM is allowed; the setup follows."""
    w, iam, _ = iw
    set_bucket_policy(gcs_emulator, [*BUCKET_DEFAULTS, {
        "role": "roles/storage.objectAdmin", "members": [f"serviceAccount:{DEFAULT_SA}"],
        "condition": {"title": "dvc", "expression": 'resource.name.startsWith("projects/_/buckets/mtpipe-test")'}}])
    out = w.doit("vm_up").stdout
    assert "is granted under a condition" in out
    assert f"the VM's service account {DEFAULT_SA} may use {remote_url(w)}" in out
    assert w.instance() is not None
    w.doit("vm_down")
    assert w.instance() is None and not w.fake.firewalls


def test_vm_without_a_token_is_deleted(iw, gcs_emulator: GcsEmulator) -> None:
    """The metadata server has no service account for the VM: no probe can pass, nor could `dvc pull`."""
    w, iam, metadata = iw
    set_bucket_policy(gcs_emulator, [*BUCKET_DEFAULTS, {"role": "roles/storage.objectAdmin",
                                                        "members": ["group:ml@example.com"]}])
    iam.unreadable.add("projects/1234")
    metadata.email = lambda: None
    out = w.doit("vm_up", ok=False).stdout
    assert "the VM got no token for a service account from its metadata server" in out
    assert_deleted(w)


@pytest.mark.billing
def test_the_tpu_nodes_account_may_delete_it(fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """The TPU API route's node deletes itself when idle with its service account's token: doit check
    finds that account (service_account: default: the project's Compute default one) holding
    tpu.nodes.delete through a role bound on the project, and says unknown, with the grant to make, where
    the project's policy shows none or cannot be read (folders, the organisation and groups are not read)."""
    cfg = vm_config.load_config({"machine_type": "ct5lp-hightpu-8t", "boot_disk_type": "pd-balanced"})
    with running_fake_iam() as iam:
        monkeypatch.setenv(identity.IAM_ENDPOINT_ENV, iam.url)
        iam.roles["roles/tpu.admin"] = ["tpu.nodes.create", "tpu.nodes.delete"]
        iam.roles["roles/tpu.viewer"] = ["tpu.nodes.get"]
        iam.grant("projects/1234", "roles/tpu.viewer", f"serviceAccount:{DEFAULT_SA}")
        with pytest.raises(Unknown, match=f"grants {DEFAULT_SA} no role read here with tpu.nodes.delete.*"
                           f"add-iam-policy-binding proj-1 --member serviceAccount:{DEFAULT_SA} --role roles/tpu.admin"):
            identity.check_node_self_delete(cfg)
        iam.grant("projects/1234", "roles/tpu.admin", f"serviceAccount:{DEFAULT_SA}")
        assert identity.check_node_self_delete(cfg) == (f"{DEFAULT_SA} may delete its node and queued resource "
                                                        "(tpu.nodes.delete through roles/tpu.admin on proj-1)")
        iam.unreadable.add("projects/1234")
        with pytest.raises(Unknown, match="the IAM policy of project proj-1 could not be read here"):
            identity.check_node_self_delete(cfg)
