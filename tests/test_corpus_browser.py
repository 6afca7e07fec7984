"""The Corpus tab in headless Chromium, on a scan of a small slice of the bundled corpus (24 verses).

Opening the tab computes the scan once (cached in a temporary $SLMVIZ_SCAN_CACHE), shows coloured strips
and a histogram; changing the feature redraws them; clicking a strip puts its verse in the prompt box;
a second page load reads the cached scan instead of scanning again; picking Gemma makes the tab show
Gemma's hooks and scan. Does not check the numbers (the
scan tests do) nor the default 1000-verse size (README, "Corpus scans").
"""

from __future__ import annotations

import re

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, REPO, app_server, quiet_context

from app.scans import corpus_docs

pytestmark = pytest.mark.browser

TIMEOUT_MS = 240_000
DOCS = 24

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)


@pytest.fixture(scope="module")
def scan_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("scans")


@pytest.fixture(scope="module")
def server(scan_cache):
    with app_server(env={"SLMVIZ_SCAN_CACHE": str(scan_cache), "SLMVIZ_CORPUS_DOCS": str(DOCS)}) as url:
        yield url


def _open_corpus_tab(browser, server):
    context = quiet_context(browser, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(server)
    page.wait_for_selector("#prompt textarea")
    page.get_by_role("tab", name="Corpus").click()
    page.wait_for_selector("#corpus-examples .slmviz-corpus-strip", timeout=TIMEOUT_MS)
    page.wait_for_function("document.querySelectorAll('#corpus-histogram .js-plotly-plot').length >= 1",
                           timeout=TIMEOUT_MS)
    return context, page


def test_corpus_tab_shows_coloured_top_contexts_and_a_histogram_and_a_click_loads_the_verse(browser, server,
                                                                                           scan_cache):
    context, page = _open_corpus_tab(browser, server)
    strips = page.locator("#corpus-examples .slmviz-corpus-strip")
    assert strips.count() == 10
    assert "rgba(255,140,0" in strips.first.inner_html()  # coloured by activation
    assert re.search(rf"Scan of {DOCS} verses", page.locator("#corpus-status").inner_text())
    assert len(list(scan_cache.iterdir())) == 1  # computed once and cached

    first = strips.first.inner_text()
    page.fill("#corpus-feature input", "5")
    page.click("#corpus-show")
    page.wait_for_function(f"!document.querySelector('#corpus-examples').innerText.startsWith({first[:40]!r})",
                           timeout=60_000)

    page.fill("#prompt textarea", "")
    strips.nth(1).click()
    page.wait_for_function("document.querySelector('#prompt textarea').value.length > 10", timeout=60_000)
    verse = page.locator("#prompt textarea").input_value()
    assert verse in corpus_docs(DOCS) and page.locator(".toast-body.error").count() == 0
    page.wait_for_timeout(300)
    page.screenshot(path=str(REPO / "assets" / "screenshot-corpus.png"), full_page=True)
    context.close()

    context, page = _open_corpus_tab(browser, server)  # a second visitor: the cached scan, at once
    assert len(list(scan_cache.iterdir())) == 1
    context.close()


def test_the_corpus_tab_follows_the_session_model(browser, server):
    """Pick Gemma: the tab offers Gemma's hooks (18 layers: blocks 4 and 9) and Load the scan shows Gemma's own
    scan of the same verses, while the page's first model keeps its cached scan."""
    context, page = _open_corpus_tab(browser, server)
    page.click("#model-picker input")
    page.get_by_role("option", name=re.compile("gemma-3-270m")).click()
    page.wait_for_function(
        "document.querySelector('#model-status').innerText.includes('Model: gemma-3-270m (gemma3_text')",
        timeout=TIMEOUT_MS)
    page.wait_for_function("document.querySelector('#corpus-status').innerText.includes('Model changed')",
                           timeout=60_000)
    page.click("#corpus-load")
    page.wait_for_function("document.querySelector('#corpus-status').innerText.includes('blocks.4.mlp.hook_post')",
                           timeout=TIMEOUT_MS)
    page.wait_for_selector("#corpus-examples .slmviz-corpus-strip", timeout=60_000)
    assert page.locator("#corpus-examples .slmviz-corpus-strip").count() == 10
    assert page.locator("#corpus-hook input").input_value() == "blocks.4.mlp.hook_post"
    assert page.locator(".toast-body.error").count() == 0
    context.close()
