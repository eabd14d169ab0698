"""The docs hold together: every relative link of README.md, docs/ and benchmarks/ reaches a file (and
a heading, when it names one), every project path the docs name exists, every `docs/....md` the code
names exists, and no page grows past what one reader reads at once (README 150 lines, a doc 400)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.docs, pytest.mark.house]

README_MAX_LINES = 150
DOC_MAX_LINES = 400
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
# A project file a doc names: a path under one of the project's own folders.
PROJECT_PATH = re.compile(r"(?<![\w./@:-])((?:mtpipe|stages|docs|conf|tests|benchmarks)/[\w./*<>{}+-]*[\w/*>}])")
PLACEHOLDER = re.compile(r"[*<{]|\.\.\.|(?:^|[/_.-])[xX](?:[/_.-]|$)")
CODE_DOC = re.compile(r"(?<![\w./-])docs/[\w./-]*\.md")
EXTERNAL = re.compile(r"(?:https?://|github\.com/|cloud\.google\.com/)\S*\s*$")


def docs() -> list[Path]:
    """README.md and every page under docs/ and benchmarks/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, repeated ones numbered as GitHub numbers them."""
    found: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            base = anchor = slug(match.group(1))
            n = 0
            while anchor in found:
                n += 1
                anchor = f"{base}-{n}"
            found.add(anchor)
    return found


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file, or whose heading, does not exist."""
    problems = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z][a-z+.-]*:", target):            # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.relative_to(ROOT)}: link ({target}): no such file {path}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{page.relative_to(ROOT)}: link ({target}): {path or page.name} has no heading #{anchor}")
    return problems


def missing_paths(text: str) -> list[str]:
    """The project paths ``text`` names that do not exist (placeholders such as <branch>, * or X left out)."""
    missing = []
    for path in PROJECT_PATH.findall(text):
        path = path.rstrip(".")
        if PLACEHOLDER.search(path) or (ROOT / path).exists():
            continue
        missing.append(path)
    return sorted(set(missing))


def report(problems: list[str]) -> str:
    return "\n".join(problems) + "\n\nA module that moved: `git log --stat --follow -- OLD_PATH` says where it went."


def test_every_relative_link_reaches_its_file_and_heading():
    problems = [problem for page in docs() for problem in broken_links(page)]
    assert not problems, report(problems)


def test_every_project_path_the_docs_name_exists():
    problems = [f"{page.relative_to(ROOT)}: names {path}, which does not exist"
                for page in docs() for path in missing_paths(page.read_text())]
    assert not problems, report(problems)


def code_files() -> list[Path]:
    files = [ROOT / "dodo.py", *[p for folder in ("mtpipe", "stages", "tests", "benchmarks")
                                 for p in sorted((ROOT / folder).rglob("*.py"))]]
    return [p for p in files if p != Path(__file__).resolve()]


def docs_named_by(files: list[Path]) -> list[str]:
    problems = []
    for path in files:
        for line in path.read_text().splitlines():
            for match in CODE_DOC.finditer(line):
                if EXTERNAL.search(line[:match.start()]):      # another project's docs/ (xpk's, Google's)
                    continue
                if not (ROOT / match.group()).is_file():
                    problems.append(f"{path.relative_to(ROOT)}: names {match.group()}, which does not exist")
    return problems


def test_every_doc_the_code_names_exists():
    problems = docs_named_by(code_files())
    assert not problems, report(problems)


def test_no_page_is_longer_than_one_reading():
    readme = len((ROOT / "README.md").read_text().splitlines())
    assert readme <= README_MAX_LINES, f"README.md has {readme} lines (at most {README_MAX_LINES}): move a section to docs/"
    long = {str(p.relative_to(ROOT)): n for p in docs()[1:] if (n := len(p.read_text().splitlines())) > DOC_MAX_LINES}
    assert not long, f"pages over {DOC_MAX_LINES} lines, split them by purpose: {long}"


def test_the_checker_finds_a_broken_link_a_broken_anchor_and_a_missing_path(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section: with `code`\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# Page\n\nSee [gone](gone.md), [a heading](other.md#no-such-heading) and\n"
                    "[the right one](other.md#a-section-with-code), [here](#page), `mtpipe/nowhere.py`,\n"
                    "`stages/<stage>.py` and [out](https://example.com/x.md).\n")
    problems = broken_links(page)
    assert problems == ["docs/page.md: link (gone.md): no such file gone.md",
                        "docs/page.md: link (other.md#no-such-heading): other.md has no heading #no-such-heading"]
    assert missing_paths(page.read_text()) == ["mtpipe/nowhere.py"]


def test_slugs_are_githubs():
    assert slug("Spot VMs: termination action DELETE, and vm_run replaces a lost VM") == \
        "spot-vms-termination-action-delete-and-vm_run-replaces-a-lost-vm"
    assert slug("`doit check`: every prerequisite at once") == "doit-check-every-prerequisite-at-once"
