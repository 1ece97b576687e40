"""The offline page `dvc plots show` fills: the committed libraries are what their banners say."""
import re

import pytest

from stages.metrics import plots_page
from tests.conftest import ROOT

PAGE = ROOT / ".dvc" / "plots" / "offline.html"


def test_committed_page_inlines_the_vendored_builds_unchanged():
    page = PAGE.read_text()
    libs = plots_page.inlined(page)
    assert list(libs) == list(plots_page.BUILDS)  # load order: vega, vega-lite, then vega-embed
    for name, lib in libs.items():
        assert lib["actual"] == lib["sha256"], f"{name}: inlined code differs from the build it names; run make vega"
    pinned = re.search(r"^VEGA := (.*)$", (ROOT / "Makefile").read_text(), flags=re.M)[1].split()
    assert pinned == [f"{name}@{lib['version']}" for name, lib in libs.items()], "make vega would vendor others"
    assert "{plot_divs}" in page and "{scripts}" not in page  # {scripts} would add DVC's CDN script tags
    assert not re.search(r"<script[^>]+src=", page) and "sourceMappingURL" not in page
    assert "plots/offline.html" in (ROOT / ".dvc" / "config").read_text()


def test_render_page_checks_its_inputs():
    with pytest.raises(ValueError, match=r"missing builds of \['vega-embed'\]"):
        plots_page.render_page({"vega": ("5", "var a;"), "vega-lite": ("5", "var b;")})
    with pytest.raises(ValueError, match="cannot be inlined"):
        plots_page.script("vega", "5", 'x = "</script>";')
    page = plots_page.render_page({n: ("1.0.0", f"var {n.replace('-', '_')} = 1;") for n in plots_page.BUILDS})
    assert {n: lib["actual"] == lib["sha256"] for n, lib in plots_page.inlined(page).items()} == {
        n: True for n in plots_page.BUILDS}
