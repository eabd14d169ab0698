"""`dvc plots show` writes a page that draws every plot with no network: the template in
plots/template/ (`plots.html_template` in .dvc/config) inlines vega, vega-lite and vega-embed.
Checked in headless Chromium with every request outside the page refused; DVC's default page, whose
libraries come from a CDN, draws nothing there (so the network really is off)."""

import csv
import sys
import shutil
import subprocess
from pathlib import Path

import lxml.html
import pytest
import yaml

from mtpipe.reporting import plots_page

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.explains

# the flags that work in a container as root, with nothing but the page's own file reachable
OFFLINE_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]


def plots_repo(tmp: Path, html_template: bool) -> Path:
    """A DVC repo (no git) with the project's dvc.yaml, plots/ and .dvc/config; without the
    template setting when ``html_template`` is false (DVC's default page)."""
    repo = tmp / ("template" if html_template else "default")
    (repo / ".dvc").mkdir(parents=True)
    shutil.copy(ROOT / "dvc.yaml", repo)
    shutil.copytree(ROOT / "plots", repo / "plots")
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    dvc = [str(Path(sys.executable).parent / "dvc"), "config"]
    subprocess.run([*dvc, "core.no_scm", "true"], cwd=repo, check=True)
    if not html_template:
        subprocess.run([*dvc, "--unset", "plots.html_template"], cwd=repo, check=True)
    return repo


def rendered_dom(repo: Path) -> lxml.html.HtmlElement:
    """`dvc plots show` in ``repo``, then the page's DOM after Chromium ran its scripts offline."""
    assert CHROMIUM.exists(), "no /usr/bin/chromium: `make test` installs it (apt-get install chromium)"
    dvc = str(Path(sys.executable).parent / "dvc")
    subprocess.run([dvc, "plots", "show", "--out", "page"], cwd=repo, check=True, capture_output=True)
    page = repo / "page" / "index.html"
    dom = subprocess.run([str(CHROMIUM), *OFFLINE_FLAGS, f"--user-data-dir={repo / 'chromium-profile'}",
                          "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    return lxml.html.fromstring(dom)


def expected_points() -> dict[str, int]:
    """Each plot's element id (as DVC names it) -> the rows of its CSV, which its lines must join."""
    rows = {path.relative_to(ROOT).as_posix(): sum(1 for _ in csv.DictReader(path.open()))
            for path in (ROOT / "plots").rglob("*.csv")}
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    points = {}
    for definition in spec["plots"]:          # top-level plots: id from the title
        (title, props), = definition.items()
        (csv_path,) = props["y"]
        points[title.replace(" ", "_")] = rows[csv_path]
    for stage in spec["stages"].values():      # stage plots: id from the file's path
        for entry in stage.get("do", stage).get("plots", []):
            (path,) = entry
            for branch in ("sft", "rl"):
                name = path.replace("${key}", branch).replace("${item}", branch)
                if name in rows:
                    points[name.replace("/", "_").replace(".", "_")] = rows[name]
    return points


def test_template_inlines_the_vendored_bundles():
    assert plots_page.TEMPLATE.read_text() == plots_page.template(), \
        "plots/template/index.html is not built from the bundles beside it: python -m mtpipe.reporting.plots_page"
    assert "cdn" not in plots_page.PAGE.lower() and "{scripts}" not in plots_page.TEMPLATE.read_text()


@pytest.mark.slow
def test_every_plot_draws_its_lines_with_no_network(tmp_path):
    dom = rendered_dom(plots_repo(tmp_path, html_template=True))
    expected = expected_points()
    assert len(expected) == 7
    drawn = {}
    for div in dom.xpath("//body/div[@id]"):
        lines = div.xpath('.//g[contains(@class, "mark-line")]/path/@d')
        drawn[div.get("id")] = max((d.count("L") + 1 for d in lines), default=0)
    assert drawn == expected, "each plot's longest line should join every row of its CSV"


def test_dvc_default_page_draws_nothing_offline(tmp_path):
    """The control: DVC's CDN page in the same browser draws no mark, so the check above is offline."""
    dom = rendered_dom(plots_repo(tmp_path, html_template=False))
    assert len(dom.xpath("//body/div[@id]")) == 7
    assert not dom.xpath('//*[contains(@class, "role-mark")]')
