"""A new user's first mistakes, all named in one run, each with where its value came from
(mtpipe/cloud/settings/vm_config.py ``load_config``, mtpipe/cloud/checks/prerequisites.py): bad values from
the environment, `--set` and the VM config file; `--rehearse` with nothing set; a DVC remote nobody answers.

`doit` runs in process against the loopback world (tests/vm_world.py: the fake Compute API, the GCS
emulator as the DVC remote).
"""

from __future__ import annotations

import shutil
import time

import pytest
from vm_world import ROOT, Env, sh

from mtpipe.cloud.checks.project import check_remote_writable, composed_branches
from mtpipe.errors import ConfigError

pytestmark = [pytest.mark.billing, pytest.mark.checks]


def fails(out: str) -> list[str]:
    """The FAILS lines `doit check` printed, without their prefix."""
    prefix = "mtpipe check:       FAILS  "
    return [line.removeprefix(prefix) for line in out.splitlines() if line.startswith(prefix)]


def test_five_bad_values_from_three_sources_are_named_in_one_run(world: Env) -> None:
    """A zone given as a region and a name with capitals (the environment), a preset typo (`--set`), an SSH
    range and a label that are not ones (the VM config file): one `doit check` lists all five, each with
    its source, and asks Compute nothing."""
    w = world
    w.env.update(ZONE="us-east5", NAME="Mt_Test")
    w.configure(firewall__source_ranges=["my-laptop"], labels={"Team": "ml"})
    out = w.doit("check", "--set=sft.preset=gemma3-4b-ultrachat-v6e88", ok=False).stdout
    failed = fails(out)
    assert len(failed) == 5, out
    overlay = f"(from {w.config} ($MTPIPE_VM_CONFIG))"
    for expected in ("vm.zone: 'us-east5' is not a zone name (from ZONE in the environment)",
                     "vm.name: 'Mt_Test' is not a Compute resource name",
                     f"vm.firewall.source_ranges: 'my-laptop' is not an address range {overlay}",
                     "vm.labels.Team: Team='ml' is not a Compute label"):
        assert any(expected in line for line in failed), (expected, out)
    assert any(line.startswith("VM config: vm.labels.Team") and line.split(". Fix:")[0].endswith(overlay)
               for line in failed), out
    assert any("(from NAME in the environment)" in line for line in failed if "vm.name" in line)
    (preset,) = [line for line in failed if line.startswith("presets:")]
    assert "gemma3-4b-ultrachat-v6e88" in preset and "sft.preset" in preset, preset
    assert "not checked  the other checks: needs VM config" in out
    assert w.fake.requests == []


def test_rehearse_with_nothing_set_names_every_missing_value(world: Env) -> None:
    """No PROJECT, ZONE or RESERVATION and no usable credentials: `doit check --rehearse` and `doit vm_run
    --rehearse` each name all three in one run (the rehearsal is Spot: no reservation needed)."""
    w = world
    shutil.copy(ROOT / "conf" / "hardware" / "v6e-1.yaml", w.repo / "conf" / "hardware")   # the one-chip preset
    for key in ("PROJECT", "ZONE", "RESERVATION"):
        del w.env[key]
    w.env["GOOGLE_APPLICATION_CREDENTIALS"] = str(w.repo.parent / "no-such-adc.json")
    out = w.doit("check", "--rehearse", ok=False).stdout
    assert [line.split(":", 1)[0] for line in fails(out)] == ["PROJECT", "ZONE", "credentials"], out
    assert "not checked  DVC remote: needs credentials" in out
    out = w.doit("vm_run", "--rehearse", ok=False).stdout
    assert "ChecksFailed: 3 checks failed; nothing was created:" in out, out
    for named in ("vm.project: is not set", "vm.zone: is not set", "loading Google credentials: no usable Google"):
        assert f"  - {named}" in out, out
    assert w.fake.requests == []


def test_an_unreachable_bucket_costs_seconds_and_one_line(world: Env) -> None:
    """The DVC remote's endpoint answers nothing: the write probe fails within 10 s in one line, and `doit
    check` prints no traceback."""
    w = world
    config = w.repo / ".dvc" / "config"
    endpoint = next(line.split("=", 1)[1].strip() for line in config.read_text().splitlines() if "endpointurl" in line)
    config.write_text(config.read_text().replace(endpoint, "http://127.0.0.1:9"))
    sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "dead endpoint"], w.repo, w.env)
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        check_remote_writable(w.repo, 60)
    took = time.monotonic() - start
    assert took <= 10 and "cannot reach http://127.0.0.1:9" in str(refused.value) and "\n" not in str(refused.value)
    proc = w.doit("check", ok=False)
    (line,) = [x for x in proc.stdout.splitlines() if "DVC remote:" in x]
    assert "FAILS  DVC remote: remote.gcs.url:" in line and "cannot reach http://127.0.0.1:9" in line, proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_an_rl_preset_given_as_sft_preset_says_use_rl_preset() -> None:
    """The RL preset on the SFT branch is named as such, with the key to use, not by its train_rl section."""
    with pytest.raises(ConfigError) as refused:
        composed_branches(ROOT, ["sft.preset=embedded-rl"])
    assert refused.value.key == "sft.preset" and "use rl.preset=embedded-rl" in refused.value.fix
    assert "sft.train_rl" not in str(refused.value)
