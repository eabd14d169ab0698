"""What a newcomer reads before the first run says what the code does: the one list of roles
(docs/roles.md) is the one vm_run checks, the self-delete is stated as the code sends it, the HBM and
the price of the SFT tutorial are the numbers preflight computes, and the small texts of the CLI
(doit list, --keep's help, the unknown-preset error) are whole and right."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

import dodo
from mtpipe.cloud.checks.gcp import caller, identity
from mtpipe.cloud.lifecycle.lines import creation_line
from mtpipe.cloud.settings import vm_config
from mtpipe.errors import ConfigError
from mtpipe.pipeline import config
from mtpipe.pipeline import generations

ROOT = Path(__file__).resolve().parents[2]
ROLES = ROOT / "docs" / "roles.md"
QUICKSTARTS = [ROOT / "docs" / "quickstart-sft.md", ROOT / "docs" / "quickstart-grpo.md"]
ROLE = re.compile(r"`(roles/[\w.]+)`")
pytestmark = [pytest.mark.docs, pytest.mark.first_run]


def tables(page: Path) -> list[list[str]]:
    """Each markdown table of ``page``: the roles its rows name, in order."""
    found: list[list[str]] = []
    previous = ""
    for line in page.read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            if not previous.startswith("|"):
                found.append([])
            found[-1] += ROLE.findall(line)
        previous = line
    return found


def test_the_roles_page_lists_the_roles_vm_run_checks_and_the_grant_it_names() -> None:
    everything_on = vm_config.load_config({"external_ip": False, "name": "n", "zone": "us-east5-b", "project": "p"})
    checked, setup, _ = tables(ROLES)
    tpu_route = everything_on.model_copy(update={"machine_type": "ct5lp-hightpu-8t", "route": "tpu_api"})
    asked_for = set(caller.permissions(everything_on, creates_rule=True).values()) | set(
        caller.permissions(tpu_route, creates_rule=True).values())   # both routes' (vm_config.route)
    assert sorted(checked) == sorted(asked_for), f"docs/roles.md's first table: {checked}; checks.caller: {asked_for}"
    grant = identity.grant_command(SimpleNamespace(bucket="b"), "sa@p.iam.gserviceaccount.com")
    assert re.search(r"--role=(\S+)", grant)[1] in setup and "roles/storage.admin" in setup
    named_by_the_checks = set(re.findall(r"roles/[\w.]*\w", (ROOT / "mtpipe/cloud/checks/gcp/caller.py").read_text()))
    assert named_by_the_checks <= set(ROLE.findall(ROLES.read_text())), named_by_the_checks


def test_readme_tpu_vm_and_the_quickstarts_link_the_roles_instead_of_listing_them() -> None:
    for path in (ROOT / "README.md", ROOT / "docs" / "tpu-vm.md", ROOT / "docs" / "quickstart-setup.md", *QUICKSTARTS):
        assert "roles.md)" in path.read_text(), f"{path.name} does not link docs/roles.md"
    readme_section = (ROOT / "README.md").read_text().split("## Run the tutorials on a TPU v6e-8")[1].split("\n## ")[0]
    assert "roles/" not in readme_section
    for page in QUICKSTARTS:
        assert "roles/" not in page.read_text()


def test_the_self_delete_is_stated_as_the_code_sends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """maxRunDuration is not known to hold for a reservation-bound VM (what vm_up prints): no page
    that tells a newcomer about the 4 hours promises it for the tutorials' reservation."""
    for key in ("MTPIPE_VM_CONFIG", "PROJECT", "ZONE", "RESERVATION", "NAME"):
        monkeypatch.delenv(key, raising=False)
    cfg = vm_config.load_config({"project": "p", "zone": "us-east5-b", "reservation": "r", "name": "n"})
    assert cfg.max_run_duration_s == 4 * 3600 and cfg.provisioning == "reservation"
    assert "not known to be honoured" in creation_line(cfg, "RESERVATION_BOUND")
    for path in (ROOT / "README.md", *QUICKSTARTS):
        text = " ".join(path.read_text().split())
        assert "at the latest" not in text and "4 h" in text, path.name
        assert re.search(r"not known to (be )?honou?r", text), f"{path.name} states the 4 hours as certain"


def test_the_v6e_hbm_and_the_sft_tutorial_price_are_the_ones_preflight_computes() -> None:
    gib = f"{generations.load()['v6e'].chip.hbm_gib:g} GiB"
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        assert "32 GiB" not in path.read_text(), f"{path.name}: a v6e chip offers {gib} (32 GB)"
    for page in QUICKSTARTS:
        assert gib in page.read_text()
    # the SFT tutorial's whole run as preflight forecasts it (docs/preflight.md)
    hours, usd = re.search(r"The SFT tutorial \(`--target=evaluate@sft`\): about ([\d.]+) h \([^)]*\), ([\d.]+) USD",
                           " ".join((ROOT / "docs" / "preflight.md").read_text().split())).groups()
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"{hours} h" in readme and f"{usd} USD" in readme, (hours, usd)
    assert "10.45 USD" not in readme


def test_doit_list_shows_each_task_in_one_whole_line() -> None:
    for name in dir(dodo):
        if name.startswith("task_"):
            first = getattr(dodo, name).__doc__.splitlines()[0]
            assert first.endswith((".", ")")) and len(first) <= 120, f"{name}: `doit list` shows {first!r}"


def test_keep_says_what_it_keeps_for_each_task() -> None:
    helps = {task: {p["name"]: p["help"] for p in getattr(dodo, f"task_{task}")()["params"]}["keep"]
             for task in ("vm_up", "vm_setup", "vm_run")}
    assert helps["vm_run"].startswith("keep the VM when the run ends, however it ends"), helps["vm_run"]
    assert helps["vm_up"] == helps["vm_setup"] == "keep the VM when this task fails or is interrupted"


def test_an_unknown_preset_is_named_once() -> None:
    with pytest.raises(ConfigError, match=r"unknown preset 'nope'\. Fix: use one of \[") as err:
        config._load_named("preset", "nope", "sft.preset")
    assert "preset preset" not in str(err.value)
    with pytest.raises(ConfigError, match="unknown model preset 'nope'"):
        config._load_named("model", "nope", "sft.model")


@pytest.mark.billing
def test_the_setup_page_enables_the_apis_and_names_the_quota_doit_check_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `gcloud services enable` line is what the APIs check requires of the tutorial's VM (a gs://
    DVC remote), and the quota named is the one the quota check reads for a v6e VM."""
    for key in ("MTPIPE_VM_CONFIG", "PROJECT", "ZONE", "RESERVATION", "NAME"):
        monkeypatch.delenv(key, raising=False)
    text = (ROOT / "docs" / "quickstart-setup.md").read_text()
    cfg = vm_config.load_config({"project": "my-project", "zone": "us-east5-b", "reservation": "r", "name": "n"})
    (enable,) = re.findall(r"^gcloud services enable (.*) --project=my-project$", text, re.MULTILINE)
    assert enable.split() == list(caller.services(cfg, uses_gcs=True)), enable
    quota = generations.of_machine_type(cfg.machine_type)[0].compute.quota
    flat = " ".join(text.split())
    assert f"`{quota.name}`" in flat and f'"{quota.title}"' in flat, quota
    assert all(f"{key}={value}" in flat for key, value in quota.dimensions.items()), quota
    assert "REPOSITORY_URL" not in text and flat.index("make control") < flat.index("`make`")


def _preflight_check_line() -> str:
    """What `doit check` says of the SFT tutorial's preflight, answered from the committed compile."""
    from mtpipe.cloud.checks import prerequisites
    cfg = vm_config.load_config({"project": "p", "zone": "us-east5-b", "reservation": "r", "name": "n"})
    return "ok  preflight: " + prerequisites._preflight(cfg, ROOT, [["sft.preset=gemma3-4b-ultrachat-v6e8"]])[0]


def _exp_show_row() -> str:
    """The metric cells of a row of the quickstart's `dvc exp show` (the committed run's metrics, in
    DVC's 5 significant digits): gain.loss_gain, trained.loss, gain.flexible_gain,
    trained.flexible_accuracy."""
    sft, rl = (json.loads((ROOT / "metrics" / branch / "evaluate.json").read_text()) for branch in ("sft", "rl"))
    cells = [sft["gain"]["loss_gain"], sft["trained"]["loss"], rl["gain"]["flexible_gain"],
             rl["trained"]["flexible_accuracy"]]
    return " | ".join(f"{value:.5g}" for value in cells)


# (doc, the figure it quotes from a tool's output, how the figure is made from what the tool reads)
FIGURES = [("docs/vm-checks.md", "ok  preflight: sft (gemma3-4b-ultrachat-v6e8) fits:", _preflight_check_line),
           ("docs/quickstart-sft.md", "| workspace | ", _exp_show_row)]


@pytest.mark.billing
@pytest.mark.parametrize(("doc", "quoted", "real"), FIGURES, ids=[f"{doc}:{quoted[:20]}" for doc, quoted, _ in FIGURES])
def test_a_figure_quoted_from_a_tool_is_what_the_tool_prints(
        doc: str, quoted: str, real: Callable[[], str], monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("MTPIPE_VM_CONFIG", "PROJECT", "ZONE", "RESERVATION", "NAME"):
        monkeypatch.delenv(key, raising=False)
    lines = [re.sub(r" +", " ", line) for line in (ROOT / doc).read_text().splitlines()]
    quoting = [line for line in lines if re.sub(r" +", " ", quoted) in line]
    assert quoting, f"{doc} no longer quotes {quoted!r}: update FIGURES"
    expected = re.sub(r" +", " ", real())   # a markdown table pads its cells
    for line in quoting:
        assert expected in line, f"{doc} quotes {line!r}; the tool prints {expected!r}"
    if doc.endswith("quickstart-sft.md"):   # every row of the sample holds the same numbers (the page says why)
        rows = [line for line in lines if line.startswith("| ") and "embedded-sft" in line]
        assert len(rows) == 5 and all(expected in row for row in rows), rows
        assert "| master " not in "\n".join(lines), "a clone's branch is main"
