"""The Patch tab in headless Chromium: run the example sweep, see the heatmap, click a cell, see its patched run.

Also checks that the per-head heatmap and the logit-attribution bars follow, and that the page made no request
off the server. Saves assets/screenshot-patch.png for the README. Does not check the numbers (tests/test_patch_app.py
compares them with the library).
"""

from __future__ import annotations

import re

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM
from test_browser import ASSETS, PLOT_TIMEOUT_MS, _no_error_toast, _only_the_server

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)


def test_run_a_sweep_see_the_heatmap_and_click_a_cell(page, server):
    page.get_by_role("tab", name="Patch").click()
    page.wait_for_selector("#patch-clean textarea")
    assert "John gave" in page.locator("#patch-clean textarea").input_value()
    assert "Mary gave" in page.locator("#patch-corrupted textarea").input_value()
    page.click("#patch-run")
    page.wait_for_function("document.querySelector('#patch-status').innerText.includes('Done in')",
                           timeout=PLOT_TIMEOUT_MS)
    page.wait_for_selector("#patch-plot .js-plotly-plot .nsewdrag")
    assert "Activation patching: resid_pre" in page.locator("#patch-plot").inner_text()

    # click near the top right of the heatmap: the last layers at the last positions
    drag = page.locator("#patch-plot .nsewdrag").first
    box = drag.bounding_box()
    page.wait_for_timeout(1000)  # the click handler is attached a moment after the plot is drawn
    page.mouse.click(box["x"] + box["width"] * 0.97, box["y"] + box["height"] * 0.03)
    page.wait_for_function(
        "/^\\d+, \\d+, -1$/.test(document.querySelector('#patch-cell textarea, #patch-cell input').value)",
        timeout=30_000)
    page.wait_for_function("document.querySelector('#patch-cell-text').innerText.includes('Patched')",
                           timeout=PLOT_TIMEOUT_MS)
    assert re.search(r"layer \d+, position \d+", page.locator("#patch-cell-text").inner_text())
    assert "Mary" in page.locator("#patch-cell-top").inner_text()

    # the per-head heatmap and the attribution bars follow the sweep
    page.wait_for_selector("#patch-heads-plot .js-plotly-plot", timeout=PLOT_TIMEOUT_MS)
    page.wait_for_selector("#patch-dla-plot .js-plotly-plot", timeout=PLOT_TIMEOUT_MS)
    assert "Direct logit attribution" in page.locator("#patch-dla-plot").inner_text()
    page.wait_for_timeout(500)
    page.screenshot(path=str(ASSETS / "screenshot-patch.png"), full_page=True)
    _no_error_toast(page)
    _only_the_server(page, server)
