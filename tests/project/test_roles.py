"""Every IAM role the docs, conf/ and mtpipe/ name (in a fix, a requirement, a table of what a role
grants) is one of Google's predefined roles: tests/fixtures/gcp/predefined-roles.txt, the names
`gcloud iam roles list` gives (its header says where and when they were taken)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PREDEFINED = ROOT / "tests" / "fixtures" / "gcp" / "predefined-roles.txt"
# A predefined role's name (a custom one is projects/P/roles/X or organizations/O/roles/X).
ROLE = re.compile(r"(?<![\w/.-])roles/[A-Za-z][\w.]*\w")
pytestmark = [pytest.mark.docs, pytest.mark.first_request]


def named_roles(paths: list[Path]) -> dict[str, list[str]]:
    """role -> the files (relative to the repo) that name it."""
    found: dict[str, list[str]] = {}
    for path in paths:
        for role in sorted(set(ROLE.findall(path.read_text()))):
            found.setdefault(role, []).append(str(path.relative_to(ROOT)))
    return found


def project_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "dodo.py", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "conf").rglob("*.yaml")), *sorted((ROOT / "mtpipe").rglob("*.py"))]


def predefined() -> set[str]:
    return {line.strip() for line in PREDEFINED.read_text().splitlines() if line.startswith("roles/")}


def test_the_list_says_where_it_comes_from() -> None:
    header = [line for line in PREDEFINED.read_text().splitlines() if line.startswith("#")]
    assert any("Source: github.com/darkbitio/gcp-iam-role-permissions" in line for line in header), header
    assert any(re.search(r"commit [0-9a-f]{40} \(\d{4}-\d{2}-\d{2}\)", line) for line in header), header
    assert {"roles/owner", "roles/compute.instanceAdmin.v1", "roles/iap.tunnelResourceAccessor"} <= predefined()


def test_every_role_named_exists() -> None:
    named = named_roles(project_files())
    assert {"roles/compute.instanceAdmin.v1", "roles/iam.serviceAccountUser"} <= set(named), sorted(named)
    unknown = {role: files for role, files in named.items() if role not in predefined()}
    assert not unknown, f"roles that Google does not define (fix the docs or code): {unknown}"


def test_a_made_up_role_is_found() -> None:
    """The scan sees a role in prose, in backquotes and at a sentence's end, and skips custom roles."""
    text = ("grant `roles/compute.madeUp` or roles/storage.objectAdmin. A custom one: projects/p/roles/dvcWriter, "
            "organizations/1/roles/x.")
    found = set(ROLE.findall(text))
    assert found == {"roles/compute.madeUp", "roles/storage.objectAdmin"}
    assert found - predefined() == {"roles/compute.madeUp"}
