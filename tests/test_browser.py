"""The app's page in headless Chromium: type, Run, see the plots, break the model, stream text.

Records every request the page makes: none may leave the server it came from (no CDN fonts, scripts,
analytics). Saves the screenshots README uses into assets/. Does not check plot contents
(tests/test_plots.py and tests/test_app.py do).
"""

from __future__ import annotations

import re

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, REPO, origin

from slmviz.variants import PRESETS

pytestmark = pytest.mark.browser
PAGE_HEIGHT = 1000

ASSETS = REPO / "assets"
PLOT_TIMEOUT_MS = 180_000
PROMPT = "When Mary and John went to the store, John gave a drink to"

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)


def _plot(page, elem_id: str, count: int = 1) -> None:
    page.wait_for_function(
        f"document.querySelectorAll('#{elem_id} .js-plotly-plot').length >= {count}", timeout=PLOT_TIMEOUT_MS)


def _no_error_toast(page) -> None:
    errors = page.locator(".toast-body.error")
    assert errors.count() == 0, errors.first.inner_text()


def _only_the_server(page, server: str) -> None:
    allowed = {origin(server), "data", "blob", "about"}
    assert page.hosts - allowed == set(), f"requests left the server: {sorted(page.hosts - allowed)}"


def test_run_break_it_generate_and_the_gemma_picker_on_one_page_from_the_server_only(page, server):
    """One page through the Run tabs, Break it, Generate and a switch to Gemma, in turn (each new page costs Chromium
    a few CPU-seconds, bench/results/notes.md); no error toast, and no request leaves the server."""
    run_renders_attention_residual_and_logit_lens(page)
    break_it_switches_a_variant_and_renders_the_comparison(page)
    generate_streams_text_and_an_empty_prompt_shows_a_readable_warning(page)
    the_model_picker_switches_to_gemma_and_break_it_offers_its_presets(page)  # last: it changes the page's model
    _no_error_toast(page)
    _only_the_server(page, server)


def run_renders_attention_residual_and_logit_lens(page) -> None:
    page.click("#examples input")  # pick the example prompt rather than typing it
    page.get_by_role("option", name=re.compile(re.escape(PROMPT))).click()
    page.wait_for_function(f"document.querySelector('#prompt textarea').value === {PROMPT!r}", timeout=30_000)
    page.click("#run")
    _plot(page, "attention-plot")
    # every figure keeps plotly's modebar "download plot as PNG" button
    assert page.locator("#attention-plot .modebar-btn[data-title^='Download plot']").count() == 1
    page.wait_for_selector("#tokens .slmviz-tokens")
    assert page.locator("#tokens .slmviz-tokens > span").count() > 5
    page.wait_for_timeout(500)  # let plotly finish laying out before the screenshot
    page.screenshot(path=str(ASSETS / "screenshot-run.png"), full_page=True)
    page.get_by_role("tab", name="Residual stream").click()
    _plot(page, "residual-plot")
    page.get_by_role("tab", name="Logit lens").click()
    _plot(page, "logit-lens-plot")
    page.wait_for_timeout(500)
    page.locator("#logit-lens-plot").screenshot(path=str(ASSETS / "screenshot-logit-lens.png"))
    page.get_by_role("tab", name="Next token").click()
    # the indirect object: SmolLM2 ranks " Mary" among its top next tokens here
    page.wait_for_function("document.querySelector('#next-token').innerText.includes('␣Mary')", timeout=30_000)
    _no_error_toast(page)


def break_it_switches_a_variant_and_renders_the_comparison(page) -> None:
    page.fill("#prompt textarea", PROMPT)
    page.get_by_role("tab", name="Break it").click()
    page.click("#variant-preset input")
    page.get_by_role("option", name="gqa_tile", exact=True).click()
    page.wait_for_function(
        "document.querySelector('#variant-description').innerText.includes('gqa_tile')", timeout=30_000)
    assert PRESETS["gqa_tile"].description[:40] in page.locator("#variant-description").inner_text()
    page.click("#compare")
    _plot(page, "variant-diff", count=5)
    page.wait_for_function(
        "document.querySelectorAll('#variant-diff textarea')[1].value.length > 0", timeout=PLOT_TIMEOUT_MS)
    page.wait_for_timeout(500)
    page.screenshot(path=str(ASSETS / "screenshot-break-it.png"), full_page=True)
    _no_error_toast(page)


def generate_streams_text_and_an_empty_prompt_shows_a_readable_warning(page) -> None:
    page.fill("#prompt textarea", "Once upon a time")
    page.get_by_role("tab", name="Generate").click()
    page.click("#generate")
    page.wait_for_function("document.querySelector('#generate-faithful textarea').value.length > 20",
                           timeout=PLOT_TIMEOUT_MS)
    page.fill("#prompt textarea", "")
    page.click("#run")
    toast = page.locator(".toast-body.warning")  # a person's mistake is a warning, not an error (issue 52)
    toast.first.wait_for(timeout=60_000)
    assert "empty" in toast.first.inner_text() and "Traceback" not in toast.first.inner_text()


def the_model_picker_switches_to_gemma_and_break_it_offers_its_presets(page) -> None:
    """Pick Gemma: the status line names it, the attention grid shows 4 heads under one KV head with the layer
    marked sliding, and the Break-it presets are Gemma's (no_norm_offset offered, gqa_tile not)."""
    page.click("#model-picker input")
    page.get_by_role("option", name=re.compile("gemma-3-270m")).click()
    # while it loads, the status line shows the progress ("Loading gemma-3-270m ... 90%"), then the model
    page.wait_for_function(
        "document.querySelector('#model-status').innerText.includes('Model: gemma-3-270m (gemma3_text')",
        timeout=PLOT_TIMEOUT_MS)
    page.fill("#prompt textarea", "The capital of France is")
    page.click("#run")
    page.get_by_role("tab", name="Attention").click()  # an earlier step may have left another tab open
    page.wait_for_function(
        "(document.querySelector('#attention-plot .gtitle') || {}).textContent?.includes('all 4 heads')",
        timeout=PLOT_TIMEOUT_MS)
    assert "(sliding)" in page.locator("#attention-plot .gtitle").text_content()  # an SVG <text>, not HTML
    # drawn while its tab was hidden, the figure is laid out again at the tab's width: wait for that, for the
    # screenshot. Plotly lays a figure out again on a window's resize; once in a CI run (1 in 5 today) the tab's
    # showing did not, and the figure kept its hidden width for 30 s: each poll that finds it narrow sends one.
    page.wait_for_function("""() => { const svg = document.querySelector('#attention-plot .main-svg');
        const wide = svg && svg.getBoundingClientRect().width > 0.9 * document.querySelector('#attention-plot')
            .getBoundingClientRect().width;
        if (!wide) window.dispatchEvent(new Event('resize'));
        return wide; }""", timeout=30_000, polling=500)
    page.wait_for_timeout(500)
    page.locator("#attention-plot").screenshot(path=str(ASSETS / "screenshot-gemma-attention.png"))
    page.get_by_role("tab", name="Break it").click()
    page.click("#variant-preset input")
    options = page.get_by_role("option")
    options.first.wait_for(timeout=30_000)
    names = [options.nth(i).inner_text().strip() for i in range(options.count())]
    assert "no_norm_offset" in names and "gqa_tile" not in names
    page.keyboard.press("Escape")
    _no_error_toast(page)
