"""The Circuits tab in headless Chromium: run EAP on the example IOI pair, see the graph beside the faithfulness curve,
move the top-n slider, select an edge in the table and see its exact patches; a bad pair shows an error and keeps
the last circuit. Run is disabled while its job runs, and back after.

Saves assets/screenshot-circuits.png for the docs. Does not check the numbers (tests/test_circuits_app.py compares
them with the library).
"""

from __future__ import annotations

import re

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, tick_one_bundled_transcoder
from playwright.sync_api import expect
from test_browser import ASSETS, PLOT_TIMEOUT_MS, _no_error_toast, _only_the_server
from test_graph_tab_browser import overlapping
from test_polish_app import ASSETS as SHOTS  # the polish screenshots' folder: assets/ only when asked

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)


def test_a_circuit_then_an_attribution_graph_on_one_page_from_the_server_only(page, server):
    """The Circuits tab, then the Graph tab, on one page (each new page costs Chromium a few CPU-seconds,
    bench/results/notes.md); no error toast, and no request leaves the server."""
    run_see_the_graph_and_the_curve_and_select_an_edge(page)
    close_the_toasts(page)  # the bad pair's warning would lie over the next screenshot
    build_an_attribution_graph_and_click_a_feature_to_open_its_page(page)
    _no_error_toast(page)
    _only_the_server(page, server)


def close_the_toasts(page) -> None:
    while page.locator(".toast-close").count():
        page.locator(".toast-close").first.click()
        page.wait_for_timeout(300)  # its closing transition


def run_see_the_graph_and_the_curve_and_select_an_edge(page) -> None:
    page.get_by_role("tab", name="Circuits").click()
    page.wait_for_selector("#circuit-clean textarea")
    assert "John gave" in page.locator("#circuit-clean textarea").input_value()
    assert "Mary gave" in page.locator("#circuit-corrupted textarea").input_value()
    run = page.locator("#circuit-run")
    run.click()
    expect(run).to_be_disabled(timeout=30_000)  # while its job runs (app.shared.busy_while)...
    assert "Scored in" not in page.locator("#circuit-status").inner_text()  # ...not only once it has ended
    page.wait_for_function("document.querySelector('#circuit-status').innerText.includes('Scored in')",
                           timeout=PLOT_TIMEOUT_MS)
    expect(run).to_be_enabled(timeout=60_000)  # and back once it has (the second run below needs it)
    page.wait_for_selector("#circuit-graph .js-plotly-plot .nsewdrag")
    page.wait_for_selector("#circuit-faithfulness .js-plotly-plot .nsewdrag")
    assert "Top 30 of 70651 edges (eap)" in page.locator("#circuit-graph").inner_text()
    assert "80 %:" in page.locator("#circuit-faithfulness").inner_text()
    assert "smallest circuit found to recover 80 %" in page.locator("#circuit-status").inner_text()
    # issue 52: the graph takes the whole row (not a column beside the curve), every node is labelled, the MLPs on
    # a row of their own (tests/test_polish_app.py checks the rows in the figure), and the task's name is not cut
    graph = page.locator("#circuit-graph").bounding_box()
    row = page.locator("#circuit-status").bounding_box()
    assert graph["width"] >= 0.95 * row["width"]
    labels = page.locator("#circuit-graph .textpoint text")
    named = [labels.nth(i).text_content() or "" for i in range(labels.count())]
    assert named and all(re.fullmatch(r"input|logits|m\d+|a\d+\.h\d+", name) for name in named), named
    assert page.locator("#circuit-task input").evaluate("e => e.scrollWidth <= e.clientWidth + 1")
    ticks = page.evaluate("""() => Array.from(document.querySelectorAll('#circuit-graph .xtick text')).map((t) => {
        const r = t.getBoundingClientRect(); return [t.textContent, r.left, r.top, r.right, r.bottom]; })""")
    assert len(ticks) > 2 and not overlapping(ticks), overlapping(ticks)  # "input" clear of "L0" (they touched)
    page.locator("#circuit-graph").screenshot(path=str(SHOTS / "circuits-graph.png"))

    # select the first edge of the table: its exact patches, alone and as the circuit without it
    page.locator("#circuit-edges [data-testid=cell-0-1]").click()
    page.wait_for_function("document.querySelector('#circuit-edge-text').innerText.includes('Alone')",
                           timeout=PLOT_TIMEOUT_MS)
    assert "->" in page.locator("#circuit-edge textarea, #circuit-edge input").first.input_value()
    assert "without this edge" in page.locator("#circuit-edge-table").inner_text()
    page.wait_for_timeout(500)
    page.screenshot(path=str(ASSETS / "screenshot-circuits.png"), full_page=True)
    _no_error_toast(page)

    # a pair of unequal lengths: an error toast, and the last circuit stays
    page.fill("#circuit-corrupted textarea", "When Mary went to the store, Mary gave a drink to")
    page.click("#circuit-run")
    toast = page.locator(".toast-body.warning")  # a person's mistake is a warning (issue 52)
    toast.first.wait_for(timeout=60_000)
    assert "same number of tokens" in toast.first.inner_text()
    assert "Top 30 of 70651 edges" in page.locator("#circuit-graph").inner_text()


def build_an_attribution_graph_and_click_a_feature_to_open_its_page(page) -> None:
    page.get_by_role("tab", name="Graph").click()
    page.wait_for_selector("#graph-prompt textarea")
    tick_one_bundled_transcoder(page)
    page.click("#graph-build")
    page.wait_for_function("document.querySelector('#graph-status').innerText.includes('Pruned to')",
                           timeout=PLOT_TIMEOUT_MS)
    page.wait_for_selector("#graph-all-edges .js-plotly-plot .nsewdrag")
    assert "Attribution graph" in page.locator("#graph-all-edges").inner_text()
    assert "transcoder_l" in page.locator("#graph-features").inner_text()
    assert page.locator("#graph-pruned-json a").count() >= 1  # the JSON to download

    # click a feature node of the plot: its id fills #graph-feature-node and its page (the Features card) opens
    page.wait_for_timeout(1000)  # the click handler is attached a moment after the plot is drawn
    point = page.evaluate_handle("""() => {
        const div = document.querySelector('#graph-all-edges .js-plotly-plot');
        const i = div.data.findIndex((t) => t.name === 'feature');
        return document.querySelectorAll('#graph-all-edges .scatterlayer .trace')[i].querySelector('path.point');
    }""").as_element()
    point.scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    box = point.bounding_box()
    page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.wait_for_function(
        "/^\\d+_\\d+$/.test(document.querySelector('#graph-feature-node textarea, #graph-feature-node input').value)",
        timeout=60_000)
    page.wait_for_function("document.querySelector('#graph-feature-card').innerText.includes('transcoder_l')",
                           timeout=PLOT_TIMEOUT_MS)
    page.wait_for_function(  # the corpus contexts, once that transcoder's feature scan has run
        "document.querySelector('#graph-feature-card').innerText.includes('Top activating contexts')",
        timeout=PLOT_TIMEOUT_MS)
    page.mouse.move(5, 5)  # no hover label over the graph in the screenshot
    page.wait_for_timeout(500)
    page.locator("#graph-all-edges").screenshot(path=str(ASSETS / "screenshot-attribution.png"))
