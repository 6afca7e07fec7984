"""Issue 52's small breaks and its errors that keep your work, pinned as a visitor meets them: through gradio_client
where it is data, in headless Chromium where it is what a person sees. One server (SmolLM2, the test SAE listed) for
the whole module.

Covers: the logit lens's cells escaped once; byte tokens as <0xF0>; RoPE base <= 1 refused in the app's words (empty:
the checkpoint's own); a continuation that stops at end-of-text saying so; the Break-it verdict's numbers; the Run
tab's beginning-of-sequence note; the Corpus tab's every layer, scanned on demand; the Features card's label,
density axes and steering default; the Circuits graph's rows and labels (as drawn in the page: its width, labels and
task name, tests/test_circuits_browser.py, on that module's one EAP run); a user's mistake as one log line and a
warning that keeps the panels; an out-of-range number put back to its last valid value; no stale "Ablating...".
Screenshots (looked at by hand) go to $SLMVIZ_SCREENSHOTS (assets/ for the repository's).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, TEST_SAE_NAME, app_process, write_test_sae
from gradio_client import Client
from gradio_client.exceptions import AppError

from app.shared import EXAMPLE_CLEAN
from app.tabs.features import STEER_SCALE
from app.variant_fields import VARIANT_FIELDS
from slmviz import plots
from slmviz.plots.circuits import MLP_ROW, node_position

pytestmark = pytest.mark.app

# The screenshots, looked at by hand: into the temporary folder, or assets/ with SLMVIZ_SCREENSHOTS=assets (how the
# repository's were made), so a test run leaves the checkout as it was
ASSETS = Path(os.environ.get("SLMVIZ_SCREENSHOTS") or tempfile.gettempdir()).resolve()
QUOTES = 'He said "yes", she said "no", and they said "'  # the lens predicts `␣"` in many cells
RUN_REST = [False, 1, "all", ["pre", "mid", "post"], False, False, True]  # /run after the prompt: chat .. first token
PAGE_HEIGHT = 1100


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, the server's log file): the app on SmolLM2 with the test SAE listed."""
    root = tmp_path_factory.mktemp("polish-saes")
    write_test_sae(root)
    with app_process(env={"SLMVIZ_SAE_DIRS": str(root)}) as (proc, url):
        yield url, Path(os.readlink(f"/proc/{proc.pid}/fd/1"))


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture()
def client(server):
    return Client(server, verbose=False)


def fields(client: Client, preset: str) -> list:
    """The Break-it field widgets' values for `preset` (the /preset endpoint fills them)."""
    *values, _ = client.predict(preset, api_name="/preset")
    return values


# --- data, through gradio_client ---------------------------------------------------------------------------------
def test_the_logit_lens_shows_each_token_once_escaped_once(client, model):
    client.predict(QUOTES, *RUN_REST, api_name="/run")
    lens = json.loads(client.predict(api_name="/logit_lens")["plot"])
    cells = [c for row in lens["data"][0]["text"] for c in row]
    assert any(c == '␣"' for c in cells)  # the quote token, as plotly shows it (it reads &amp; &lt; &gt; back)
    assert not any(entity in c for c in cells for entity in ("&quot;", "&#x27;", "&amp;"))
    expected = plots.logit_lens(model.trace(QUOTES)).data[0].text
    assert cells == [c for row in expected for c in row]


def test_byte_tokens_show_their_bytes(client):
    tokens, *_ = client.predict("I love 🐍 and 日本語", *RUN_REST, api_name="/run")
    assert "�" not in tokens and "0xF0" in tokens and "0x9F" in tokens


def test_the_run_tab_says_how_the_ids_begin(client):
    *_, status = client.predict(EXAMPLE_CLEAN, *RUN_REST, api_name="/run")
    assert "no beginning-of-sequence token is added" in status and "position 0 is the prompt's first token" in status
    *_, status = client.predict(EXAMPLE_CLEAN, True, *RUN_REST[1:], api_name="/run")
    assert "position 0 is the chat template's first token `<|im_start|>`" in status, status


def test_rope_base_at_or_below_one_is_refused_and_empty_is_the_checkpoints_own(client):
    values = fields(client, "faithful")
    at = VARIANT_FIELDS.index("rope_theta")
    for bad in (0, -5, 1):
        values[at] = bad
        with pytest.raises(AppError, match=r"RoPE base must be a number above 1, or empty for the checkpoint's own "
                                           rf"base; got {bad}"):
            client.predict(EXAMPLE_CLEAN, False, *values, 1, "0", 4, api_name="/compare")
    values[at] = None
    verdict, *_ = client.predict(EXAMPLE_CLEAN, False, *values, 1, "0", 4, api_name="/compare")
    assert verdict.startswith("**Verdict: nothing changed.**")


def test_the_verdict_gives_kl_top1_agreement_and_the_first_layer_that_differs(client):
    verdict, *_ = client.predict(EXAMPLE_CLEAN, False, *fields(client, "rope_interleaved"), 1, "0", 4,
                                 api_name="/compare")
    found = re.search(r"KL\(faithful ‖ variant\) \*\*([\d.e+-]+) nats\*\* at the last position \(mean ([\d.e+-]+) "
                      r"over (\d+) positions\); top-1 agreement \*\*(\d+)/(\d+)\*\* positions \((\d+)%\); the residual "
                      r"stream first differs by more than 1% \(relative L2, after a block\) at \*\*layer (\d+)\*\*",
                      verdict)
    assert found, verdict
    kl_last, kl_mean = float(found[1]), float(found[2])
    assert kl_last > 0 and kl_mean > 0 and int(found[4]) < int(found[5]) == int(found[3]) and int(found[7]) == 0
    assert "**rope_interleaved**" in verdict  # the preset's description follows the numbers


def test_a_continuation_that_stops_at_end_of_text_says_so(client):
    faithful, _ = client.predict("Say only the word hello.", True, *fields(client, "faithful"), 40, 0, 0, 0,
                                 api_name="/generate")
    assert re.search(r"\[stopped at end-of-text: the next token was <\|im_end\|> after \d+ tokens\]$", faithful)


def test_the_corpus_tab_offers_every_layer_and_scans_one_on_demand(client):
    status, hook, *_ = client.predict("blocks.20.mlp.hook_post", False, api_name="/corpus_hook")
    assert hook["value"] == "blocks.20.mlp.hook_post" and "**blocks.20.mlp.hook_post**" in status
    choices = [c[0] if isinstance(c, list | tuple) else c for c in hook["choices"]]
    assert {f"blocks.{layer}.mlp.hook_post" for layer in range(30)} <= set(choices)


def test_the_features_card_carries_its_label_and_density_axes_and_steering_scales_by_it(client):
    _, card = client.predict(TEST_SAE_NAME, 3, api_name="/feature_show")
    assert 'class="slmviz-feature-label"' in card and "<b>Label:</b> [auto]" in card
    assert "slmviz-feature-density-x" in card and "activation (log-spaced bins)" in card and ">tokens<" in card
    strength, note = client.predict(TEST_SAE_NAME, 3, api_name="/steer_scale")
    strength = strength["value"] if isinstance(strength, dict) else strength  # an update of the slider
    top = float(re.search(r"largest activation over the scanned corpus \(([\d.e+-]+)\)", note)[1])
    assert strength == pytest.approx(round(STEER_SCALE * top, 1)) and f"{STEER_SCALE:g} ×" in note


def test_the_circuits_graph_draws_the_mlp_on_its_own_row_and_names_its_nodes():
    """The figure (slmviz.plots.circuits): every MLP on the MLP row, apart from every head's; the edges' nodes named."""
    heads = {node_position(f"a{layer}.h{h}", 30, 9, 3)[1] for layer in range(30) for h in range(9)}
    assert node_position("m4", 30, 9, 3)[1] == MLP_ROW and MLP_ROW not in heads


def test_a_users_mistake_is_one_log_line_and_a_real_fault_keeps_its_traceback(client, served):
    _, log = served
    before = log.read_text()
    with pytest.raises(AppError, match="The prompt is empty"):
        client.predict("", *RUN_REST, api_name="/run")
    time.sleep(0.5)
    new = log.read_text()[len(before):]
    assert "user mistake in run: The prompt is empty" in new and "Traceback" not in new


# --- what a person sees, in Chromium -----------------------------------------------------------------------------
browser_only = [pytest.mark.browser, pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)]


def run_the_prompt(page, prompt: str = EXAMPLE_CLEAN) -> None:
    page.wait_for_selector("#prompt textarea", timeout=120_000)
    page.fill("#prompt textarea", prompt)
    page.click("#run")
    page.wait_for_selector("#attention-plot .js-plotly-plot", timeout=120_000)


def an_empty_prompt_warns_and_every_panel_keeps_its_content(page, tokens: str) -> None:
    """After a run (`tokens`: its token strip): an empty prompt is a warning, and every panel keeps its content."""
    page.fill("#prompt textarea", "")
    page.click("#run")
    page.wait_for_selector(".toast-body", timeout=30_000)
    toast = page.locator(".toast-body").first
    assert "The prompt is empty" in toast.inner_text() and "warning" in (toast.get_attribute("class") or "")
    time.sleep(1)
    assert page.locator("#attention-plot .js-plotly-plot").is_visible() and page.inner_text("#tokens") == tokens
    shown_errors = "() => Array.from(document.querySelectorAll('[data-testid=status-tracker] .error'))" \
                   ".filter(e => e.getClientRects().length > 0).length"
    assert page.evaluate(shown_errors) == 0  # no white "Error" panel over the outputs
    page.screenshot(path=str(Path(tempfile.gettempdir()) / "slmviz-error-keeps-work.png"))  # looked at by hand


@dataclass(frozen=True)
class Mistake:
    """A bad value typed into a field of a folded section of a tab: the warning in the app's words, then the page put
    right (`righted`: a JS condition that becomes true), with no stale `stale` text left in the element `where`."""

    tab: str
    fold: str  # the section's title, opened first
    field: str
    value: str
    press: str | None  # the button that sends it; None: leaving the field does (app.shared.guard_number)
    says: str
    righted: str
    where: str | None = None
    stale: str | None = None


MISTAKES = {
    # the RoPE base's own check puts the box back to its last valid value (empty: the checkpoint's own)
    "rope-base": Mistake("Break it", "Fields (a preset fills them", "#variant-rope_theta input", "-5", None,
                         "RoPE base must be a number above 1, or empty for the checkpoint's own base; got -5",
                         "document.querySelector('#variant-rope_theta input').value === ''"),
    # a head past the layer's 9: the library's message, and no "Ablating..." left under it
    "ablated-head": Mistake("Patch", "Ablation: knock out heads or neurons",
                            "#patch-ablate-heads textarea, #patch-ablate-heads input", "3.12", "#patch-ablate",
                            "head 12 is out of range 0..8",
                            "document.querySelector('#patch-ablate-status').innerText.includes('Not ablated')",
                            "#patch-ablate-status", "Ablating..."),
}


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
@pytest.mark.parametrize("mistake", MISTAKES.values(), ids=MISTAKES.keys())
def test_a_mistake_warns_in_the_apps_words_and_the_page_is_put_right(page, mistake):
    page.wait_for_selector("#prompt textarea", timeout=120_000)
    page.get_by_role("tab", name=mistake.tab).click()
    page.get_by_text(mistake.fold).click()
    box = page.locator(mistake.field)
    for _ in range(20):  # the section's fields mount as it opens, and a mount clears what was typed a moment before
        box.fill(mistake.value)
        if box.input_value() == mistake.value:
            break
        page.wait_for_timeout(250)
    if mistake.press:
        page.click(mistake.press)
    else:
        box.blur()
    page.wait_for_selector(".toast-body", timeout=60_000)
    said = page.locator(".toast-body").first.inner_text()
    assert mistake.says in said, said
    page.wait_for_function(f"() => {mistake.righted}", timeout=30_000)
    if mistake.stale:
        assert mistake.stale not in page.inner_text(mistake.where)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_the_break_it_verdict_in_numbers_then_an_empty_prompt_keeps_every_panel(page):
    """One page and one run for both (each new page costs Chromium a few CPU-seconds, bench/results/notes.md)."""
    run_the_prompt(page)
    tokens = page.inner_text("#tokens")
    page.get_by_role("tab", name="Break it").click()
    page.click("#compare")
    page.wait_for_selector("#variant-verdict :text('top-1 agreement')", timeout=180_000)
    page.wait_for_selector("#kl-plot .js-plotly-plot", timeout=60_000)
    page.locator("#variant-diff").screenshot(path=str(ASSETS / "break-it-verdict.png"))
    assert "KL(faithful ‖ variant)" in page.inner_text("#variant-verdict")
    page.get_by_role("tab", name="Attention").click()
    an_empty_prompt_warns_and_every_panel_keeps_its_content(page, tokens)


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_the_features_card_shows_its_label_and_axes(page):
    page.wait_for_selector("#prompt textarea", timeout=120_000)
    page.get_by_role("tab", name="Features").click()
    page.fill("#feature-id input", "3")
    page.click("#feature-show")
    page.wait_for_selector("#feature-card .slmviz-feature-density-x", timeout=180_000)
    assert "Label:" in page.inner_text("#feature-card .slmviz-feature-label")
    page.wait_for_selector("#steer-note :text('largest activation')", timeout=30_000)
    page.locator("#feature-card").screenshot(path=str(ASSETS / "features-card.png"))
