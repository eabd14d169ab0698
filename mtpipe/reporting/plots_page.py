"""The HTML template `dvc plots show` fills (`plots.html_template` in .dvc/config): DVC's default page
with vega, vega-lite and vega-embed inlined, so the page draws its plots with no network.

DVC's own template loads the three libraries from a CDN (dvc_render's ``VegaRenderer.SCRIPTS``,
put where the template says ``{scripts}``); this one has no ``{scripts}``, so nothing is loaded from
anywhere. The bundles are the npm releases' minified builds, committed beside the template
(plots/template/README.md: versions, licenses, how to update). After replacing one, rebuild:

    python -m mtpipe.reporting.plots_page
"""

from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "plots" / "template"
TEMPLATE = TEMPLATE_DIR / "index.html"
BUNDLES = ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js")   # in load order: vega-embed needs both

# DVC's page (dvc_render.html.PAGE_HTML) minus the CDN scripts. Plots render as SVG instead of
# vega-embed's default canvas: crisp at any zoom, and each mark is an element a test can count.
PAGE = """<!DOCTYPE html>
<html>
<head>
    {refresh_tag}
    <meta charset="utf-8">
    <title>DVC Plot</title>
%(scripts)s
    <script>
        const vegaEmbedCanvas = window.vegaEmbed;
        window.vegaEmbed = (el, spec, opts) => vegaEmbedCanvas(el, spec, {renderer: "svg", ...opts});
    </script>
    <style>
        table {
            border-spacing: 15px;
        }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def inline_script(bundle: str) -> str:
    """A bundle as an inline <script> element; refuses one that would end the element early."""
    if "</script" in bundle.lower():
        raise ValueError("the bundle holds '</script': it cannot be inlined as is")
    return f"    <script>\n{bundle}\n    </script>"


def template(bundle_dir: Path = TEMPLATE_DIR) -> str:
    """The template's text, from the bundles in ``bundle_dir``."""
    return PAGE % {"scripts": "\n".join(inline_script((bundle_dir / name).read_text()) for name in BUNDLES)}


if __name__ == "__main__":
    TEMPLATE.write_text(template())
    print(f"wrote {TEMPLATE}")
