"""`doit check` and the checks before spending as one run (mtpipe/cloud/checks/prerequisites.py): every
prerequisite of a TPU VM run checked at once, each failure listed with its fix, nothing created.

`doit` runs in process against the loopback world (tests/vm_world.py): the fake Compute API with
the Google APIs it serves (tests/fakes/fake_org.py: organisation policies, testIamPermissions), the
GCS emulator as the DVC remote and, where a preset downloads a gated model, the loopback Hub
(tests/fakes/hf_server.py, which answers huggingface_hub's auth check). No MaxText runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fakes import fake_gcloud
from fakes.hf_server import HubServer
from omegaconf import OmegaConf
from vm_world import Env, hub_with_tutorial_repos

from mtpipe.cloud.checks.gcp import access, caller, org_policies
from mtpipe.cloud.providers.gcp.google_apis import GoogleApis, Unknown
from mtpipe.cloud.settings import vm_state
from mtpipe.errors import ConfigError
from mtpipe.planning import preflight

pytestmark = [pytest.mark.checks, pytest.mark.first_run]
SFT_TUTORIAL = "--set=sft.preset=gemma3-4b-ultrachat-v6e8"
RUNNER = "runner@proj-1.iam.gserviceaccount.com"
# What a run that makes its own firewall rule asks testIamPermissions for.
EVERY_PERMISSION = {*caller.VM_PERMISSIONS, *caller.FIREWALL_PERMISSIONS, caller.ACT_AS,
                    "compute.subnetworks.useExternalIp", "compute.instances.osAdminLogin"}


def reads_only(w: Env) -> None:
    """The fake Compute API (and the APIs it serves) saw reads only: GETs and testIamPermissions,
    no insert, no enabled API, no imported key; no state file."""
    writes = [f"{r.method} {r.path}" for r in w.fake.requests
              if r.method != "GET" and not r.api_method.endswith("testIamPermissions")]
    assert writes == [] and not w.fake.instances and not w.fake.firewalls and not w.fake.org.keys
    assert not (w.repo / vm_state.STATE_FILE).exists()


def lines(out: str, status: str) -> list[str]:
    """The names of the checks `doit check` printed with ``status``."""
    prefix = f"mtpipe check: {status:>11}  "
    return [line.removeprefix(prefix).split(":", 1)[0] for line in out.splitlines() if line.startswith(prefix)]


def test_check_lists_five_failures_and_creates_nothing(world: Env) -> None:
    """No reservation, a mistyped preset, a missing permission, the TPU image's project not trusted
    and the zone outside the allowed locations: one `doit check` names all five with their fixes,
    says what it could not check because of them, and sends Compute nothing but reads."""
    w = world
    del w.env["RESERVATION"]
    w.fake.org.permissions = EVERY_PERMISSION - {"compute.instances.create"}
    w.fake.org.policies["compute.trustedImageProjects"] = [{"values": {"allowedValues": ["projects/ubuntu-os-cloud"]}}]
    w.fake.org.policies["gcp.resourceLocations"] = [{"values": {"allowedValues": ["in:eu-locations"]}}]
    start = time.monotonic()
    out = w.doit("check", "--set=sft.preset=gemma3-4b-ultrachat-v6e88", ok=False).stdout
    took = time.monotonic() - start
    assert lines(out, "FAILS") == ["RESERVATION", "presets", "permissions", "policy compute.trustedImageProjects",
                                   "policy gcp.resourceLocations"], out
    assert "RESERVATION: vm.reservation: is not set. Fix: export RESERVATION=..." in out
    assert "compute.instances.create (in roles/compute.instanceAdmin.v1)" in out
    assert "vm.image_project: the organisation policy constraints/compute.trustedImageProjects does not allow " \
           "images from projects/ubuntu-os-accelerator-images for project proj-1" in out
    assert "gcloud resource-manager org-policies allow compute.trustedImageProjects " \
           "projects/ubuntu-os-accelerator-images --project proj-1" in out
    assert "vm.zone: the organisation policy constraints/gcp.resourceLocations does not allow us-east5-b" in out
    assert "sft.preset" in out and "gemma3-4b-ultrachat-v6e88" in out
    assert set(lines(out, "not checked")) == {"reservation", "preflight"}   # needs RESERVATION, presets
    assert {"credentials", "Compute", "machine type", "network", "SSH route", "OS Login", "APIs", "DVC remote",
            "zones and quota", "policy compute.requireShieldedVm", "policy compute.requireOsLogin",
            "VM's service account", "Spot run"} <= set(lines(out, "ok")), out
    assert "5 FAILS" in out and "doit check: 5 of" in out
    reads_only(w)
    assert took < 60, f"doit check took {took:.0f} s"


def test_missing_settings_and_credentials_named_in_one_run(world: Env) -> None:
    """vm_up without PROJECT, ZONE and RESERVATION and with a credentials file that does not exist:
    one run names all four, before any request."""
    w = world
    for key in ("PROJECT", "ZONE", "RESERVATION"):
        del w.env[key]
    w.env["GOOGLE_APPLICATION_CREDENTIALS"] = str(w.repo.parent / "no-such-adc.json")
    out = w.doit("vm_up", ok=False).stdout
    assert "ChecksFailed: 4 checks failed; nothing was created:" in out, out
    for named in ("vm.project: is not set. Fix: export PROJECT=...", "vm.zone: is not set. Fix: export ZONE=...",
                  "vm.reservation: is not set. Fix: export RESERVATION=...",
                  "loading Google credentials: no usable Google credentials"):
        assert f"  - {named}" in out, out
    assert w.fake.requests == []


def test_trusted_image_policy_stops_before_the_insert_and_an_unreadable_policy_is_unknown(world: Env) -> None:
    """compute.trustedImageProjects enforced without the TPU image's project: vm_up stops before the
    insert naming the policy and the command that allows it. With the Organization Policy API off the
    policies cannot be read: `doit check` says unknown for each, never ok, and passes; a disabled API
    with `enable_apis: true` is what vm_up would enable, and `doit check` enables nothing."""
    w = world
    w.fake.org.policies["compute.trustedImageProjects"] = [{"values": {"allowedValues": ["is:projects/debian-cloud"]}}]
    out = w.doit("vm_up", ok=False).stdout
    assert "ConfigError: vm.image_project: the organisation policy constraints/compute.trustedImageProjects does " \
           "not allow images from projects/ubuntu-os-accelerator-images" in out, out
    assert "Fix: ask your organisation's policy administrator to allow it: gcloud resource-manager org-policies " \
           "allow compute.trustedImageProjects projects/ubuntu-os-accelerator-images --project proj-1" in out
    assert w.fake.inserts() == [] and not w.fake.instances
    w.fake.org.disabled |= {"orgpolicy.googleapis.com", "storage.googleapis.com"}
    w.configure(enable_apis=True)
    w.fake.requests.clear()
    out = w.doit("check").stdout
    assert "ok  APIs: vm_up enables storage.googleapis.com (enable_apis: true)" in out, out
    assert w.fake.org.enabled == []
    policies = ["policy compute.requireShieldedVm", "policy compute.trustedImageProjects",
                "policy gcp.resourceLocations", "policy compute.requireOsLogin"]
    assert lines(out, "unknown") == policies, out
    assert "could not read constraints/compute.trustedImageProjects" in out
    assert "gcloud services enable orgpolicy.googleapis.com --project proj-1" in out
    assert not set(policies) & set(lines(out, "ok"))
    reads_only(w)


def test_gated_repo_the_token_cannot_read_stops_before_the_insert(world: Env, tmp_path: Path) -> None:
    """HF_TOKEN is set, but its account was not granted the gated Gemma model: the Hub's auth check
    answers GatedRepo and vm_run stops before the insert, naming the repo and its license page, not
    the token. The granted token passes the same check."""
    w = world
    with HubServer(tmp_path / "hub") as hub:
        hub_with_tutorial_repos(hub)
        w.env["HF_ENDPOINT"] = hub.url
        out = w.doit("vm_run", SFT_TUTORIAL, ok=False).stdout
        assert "ConfigError: HF_TOKEN: the account of HF_TOKEN may not download the gated model " \
               "google/gemma-3-4b-it (the Hub's auth check answered 403" in out, out
        assert f"accept the license at {hub.url}/google/gemma-3-4b-it while logged in as the token's account" in out
        assert w.env["HF_TOKEN"] not in out
        nothing_inserted = w.fake.inserts() == [] and not w.fake.instances
        assert nothing_inserted and not (w.repo / vm_state.STATE_FILE).exists()
        assert any(r.path == "/api/models/google/gemma-3-4b-it/auth-check" and r.authorized for r in hub.requests)
        w.env["HF_TOKEN"] = hub.gated["google/gemma-3-4b-it"]
        out = w.doit("check", SFT_TUTORIAL).stdout
    assert "ok  Hub model google/gemma-3-4b-it: gated (manual); HF_TOKEN's account may download it" in out, out
    assert "ok  Hub dataset HuggingFaceH4/ultrachat_200k: not gated" in out
    # the tutorial preset's committed compile result (mtpipe/planning/compiled/): read, not compiled
    assert "ok  preflight: sft (gemma3-4b-ultrachat-v6e8) fits: " in out


def test_spot_refusal_comes_before_any_compile(world: Env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Spot run without a work bucket (conf/vm.yaml decides it) is refused by the checks before
    spending, before preflight would compile the step (minutes for a real preset: a batch size whose
    shapes nothing compiled yet)."""
    w = world
    compiled: list[str] = []
    monkeypatch.setattr(preflight, "compile_step", lambda module, *args: compiled.append(module))
    with HubServer(tmp_path / "hub") as hub:
        hub_with_tutorial_repos(hub)
        w.env.update(HF_ENDPOINT=hub.url, HF_TOKEN=hub.gated["google/gemma-3-4b-it"])
        out = w.doit("vm_run", "--provisioning=spot", SFT_TUTORIAL, "--set=sft.train_sft.per_device_batch_size=2",
                     ok=False).stdout
    assert "ConfigError: vm.run.env.MTPIPE_WORK_BUCKET: is not set for a Spot run" in out, out
    assert "no forecast: preflight has compiled no TPU branch's step yet" in out
    assert compiled == [] and "mtpipe preflight:" not in out
    assert w.fake.inserts() == [] and not w.fake.instances


def impersonated_adc(path: Path, email: str) -> Path:
    """An ADC file as `gcloud auth application-default login --impersonate-service-account EMAIL` writes."""
    path.write_text(json.dumps({
        "type": "impersonated_service_account", "delegates": [],
        "service_account_impersonation_url": "https://iamcredentials.googleapis.com/v1/projects/-/"
                                             f"serviceAccounts/{email}:generateAccessToken",
        "source_credentials": {"type": "authorized_user", "client_id": "id", "client_secret": "secret",
                               "refresh_token": "refresh"}}))
    return path


def test_two_step_verification_fix_is_impersonation_and_works_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """OS Login 2-step verification: the fix impersonates a service account (organisations made since
    May 2024 forbid its keys). Impersonated credentials are read as the service account (the OS Login
    account, exempt from 2-step verification), and so is gcloud impersonating it (the IAP tunnel's)."""
    monkeypatch.setenv("MTPIPE_COMPUTE_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(impersonated_adc(tmp_path / "adc.json", RUNNER)))
    assert GoogleApis().account() == RUNNER

    class TwoStep:
        def project_metadata(self) -> dict[str, str]:
            return {"enable-oslogin": "TRUE", "enable-oslogin-2fa": "TRUE"}

    cfg = OmegaConf.create({"project": "proj-1"})
    access.check_two_step(cfg, TwoStep(), RUNNER)   # a service account: passes
    with pytest.raises(ConfigError) as refused:
        access.check_two_step(cfg, TwoStep(), "me@example.com")
    assert "`gcloud config set auth/impersonate_service_account SA` and `gcloud auth application-default login " \
           "--impersonate-service-account SA`" in refused.value.fix
    assert "KEY.json" not in str(refused.value)
    monkeypatch.setenv("PATH", f"{fake_gcloud.install(tmp_path / 'bin')}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_GCLOUD_ACCOUNT", "me@example.com")
    monkeypatch.setenv("FAKE_GCLOUD_IMPERSONATE", RUNNER)
    assert access.gcloud_account("gcloud") == RUNNER


def test_user_credentials_without_a_quota_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """User ADC without a quota project fail the gcloud line with `set-quota-project`; with one, it is
    said with gcloud's account and project where SSH goes through IAP (the stand-in gcloud)."""
    adc = {"type": "authorized_user", "client_id": "id", "client_secret": "secret", "refresh_token": "refresh"}
    monkeypatch.setenv("MTPIPE_COMPUTE_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "adc.json"))
    (tmp_path / "adc.json").write_text(json.dumps(adc))
    cfg = OmegaConf.create({"project": "proj-1", "name": "mt-test", "zone": "us-east5-b", "external_ip": False,
                            "ssh": {"proxy_command": None, "port": 22}})   # SSH through IAP's tunnel
    with pytest.raises(ConfigError, match="Fix: gcloud auth application-default set-quota-project proj-1"):
        access.check_gcloud(cfg, GoogleApis())
    (tmp_path / "adc.json").write_text(json.dumps(adc | {"quota_project_id": "proj-1"}))
    monkeypatch.setenv("PATH", f"{fake_gcloud.install(tmp_path / 'bin')}:/usr/bin:/bin")
    monkeypatch.setenv("FAKE_GCLOUD_ACCOUNT", "me@example.com")
    monkeypatch.setenv("FAKE_GCLOUD_PROJECT", "other-project")
    assert access.check_gcloud(cfg, GoogleApis()) == ("ADC quota project proj-1; gcloud account me@example.com, "
                                                        "project other-project (mtpipe passes --project proj-1 to it)")


class Policies:
    """GoogleApis' effective_policy over fixed rules, as getEffectivePolicy answers them."""

    def __init__(self, rules: list[dict]) -> None:
        self.rules = rules

    def effective_policy(self, project: str, constraint: str) -> dict:
        return {"name": f"projects/{project}/policies/{constraint}", "spec": {"rules": self.rules}}


@pytest.mark.parametrize("rules, outcome", [
    ([], "not set"),
    ([{"values": {"allowedValues": ["in:us-locations"]}}], "allows us-east5-b"),
    ([{"values": {"allowedValues": ["is:us-east5"]}}], "allows us-east5-b"),
    ([{"values": {"allowedValues": ["in:europe-west4-locations"]}}], ConfigError),
    ([{"values": {"deniedValues": ["zones/us-east5-b"]}}], ConfigError),
    ([{"values": {"allowedValues": ["in:my-org-approved"]}}], Unknown),   # a group this check cannot expand
])
def test_resource_locations(rules: list[dict], outcome: str | type) -> None:
    cfg = OmegaConf.create({"project": "proj-1", "zone": "us-east5-b"})
    if isinstance(outcome, str):
        assert org_policies.check_locations(cfg, Policies(rules)) == outcome
    else:
        with pytest.raises(outcome):
            org_policies.check_locations(cfg, Policies(rules))
