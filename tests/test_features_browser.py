"""The Features tab in headless Chromium, on the small random test SAE listed through $SLMVIZ_SAE_DIRS.

Picks the SAE (#feature-sae), shows a feature (#feature-id, #feature-show) and sees its page fill #feature-card
(statistics, density, contexts, logit effects, nearest features); clicks a nearest feature and sees its page;
shows the prompt's features, clicks a token and then one of its features; steers (#steer-run) and sees both
continuations. Saves assets/screenshot-features.png. Checks that nothing left the server and no error showed.
Does not check the numbers (tests/test_features_app.py compares them with the library).
"""

from __future__ import annotations

import re

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, TEST_SAE_NAME, app_server, write_test_sae
from test_browser import ASSETS, PLOT_TIMEOUT_MS, _no_error_toast, _only_the_server

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)

CARD_FEATURE = "document.querySelector('#feature-card .slmviz-feature-card')?.dataset.feature"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("saes")
    write_test_sae(root)
    with app_server(env={"SLMVIZ_SAE_DIRS": str(root)}) as url:
        yield url


def _card_shows(page, feature: int) -> None:
    page.wait_for_function(f"{CARD_FEATURE} === '{feature}' && document.querySelector('#feature-card')"
                           ".innerText.includes('Top activating contexts')", timeout=PLOT_TIMEOUT_MS)


def test_show_a_feature_click_through_its_neighbours_and_the_prompts_tokens_and_steer(page, server):
    page.get_by_role("tab", name="Features").click()
    page.click("#feature-sae input")
    page.get_by_role("option", name=re.compile(re.escape(TEST_SAE_NAME))).click()
    page.fill("#feature-id input", "5")
    page.click("#feature-show")
    _card_shows(page, 5)
    card = page.locator("#feature-card")
    assert "Logit effects" in card.inner_text() and "quantile band" in card.inner_text()

    neighbour = card.locator(".slmviz-feature-link").first  # the nearest feature by decoder cosine
    target = int(neighbour.get_attribute("data-feature"))
    neighbour.click()
    _card_shows(page, target)
    assert page.locator("#feature-id input").input_value() == str(target)

    page.click("#feature-prompt-run")  # the page's prompt: "The capital of France is"
    page.wait_for_selector("#feature-tokens .slmviz-feature-token", timeout=PLOT_TIMEOUT_MS)
    page.locator("#feature-tokens .slmviz-feature-token").nth(3).click()
    page.wait_for_function("document.querySelector('#feature-token-features').innerText.includes('position 3')",
                           timeout=60_000)
    feature = page.locator("#feature-token-features .slmviz-feature-link").first
    picked = int(feature.get_attribute("data-feature"))
    feature.click()
    _card_shows(page, picked)
    # the steering strength follows the feature opened by a click, not the first one shown
    page.wait_for_function(f"document.querySelector('#steer-note').innerText.includes(\"feature {picked}'s\")",
                           timeout=30_000)
    assert page.locator("#steer-feature input").input_value() == str(picked)

    page.click("#steer-run")  # at the strength set from the feature's own scale
    page.wait_for_function("document.querySelector('#steer-steered textarea').value.length > 0",
                           timeout=PLOT_TIMEOUT_MS)
    assert page.locator("#steer-default textarea").input_value()
    page.locator("#feature-card").scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    page.screenshot(path=str(ASSETS / "screenshot-features.png"), full_page=True)
    _no_error_toast(page)
    _only_the_server(page, server)
