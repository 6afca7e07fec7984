"""The attribution-graph workbench in headless Chromium: click a node and its card appears; pin three and the
subgraph shows three; make a supernode and the downloaded JSON holds it; zero the top feature and the new top
logits appear beside the old. On the tiny model and the Circuits tests' tiny transcoders; then once on SmolLM2 with
its bundled transcoder for the screenshot in assets/.

Does not check the numbers (tests/test_workbench_app.py compares them with the library).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, app_server, recording_page, tick_one_bundled_transcoder
from conftest import build_tiny_model
from test_browser import ASSETS, PLOT_TIMEOUT_MS, _no_error_toast, _only_the_server

from slmviz import SAE

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)

PAGE_HEIGHT = 1400


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("workbench-browser") / "tiny", "llama_gqa", seed=3)
    root = folder.parent / "transcoders"
    for layer in (0, 1):
        SAE.random(64, 64, seed=layer, architecture="relu", hook_name=f"blocks.{layer}.mlp.hook_in",
                   hook_name_out=f"blocks.{layer}.hook_mlp_out").save(root / f"tc_l{layer}")
    with app_server(env={"SLMVIZ_SAE_DIRS": str(root)}, model=str(folder), allow_local_models=True) as url:
        yield url


def build_graph(page, prompt: str) -> None:
    page.get_by_role("tab", name="Graph").click()
    page.wait_for_selector("#graph-prompt textarea")
    page.fill("#graph-prompt textarea", prompt)
    page.click("#graph-build")
    page.wait_for_function("document.querySelector('#graph-status').innerText.includes('Pruned to')",
                           timeout=PLOT_TIMEOUT_MS)
    page.wait_for_selector("#graph-plot .js-plotly-plot .nsewdrag", timeout=PLOT_TIMEOUT_MS)
    page.wait_for_selector("#graph-table [data-testid=cell-0-0]", timeout=PLOT_TIMEOUT_MS)


def click_feature_node(page) -> None:
    """Click the first point of the graph plot's 'feature' trace (the click handler is attached shortly after the
    plot is drawn) where plotly's axes place it on the page: SVG markers and WebGL ones (a graph of over GL_FROM
    nodes, which has no SVG point to find) alike."""
    page.wait_for_timeout(1000)
    page.locator("#graph-plot .js-plotly-plot").scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    at = page.evaluate("""() => {
        const div = document.querySelector('#graph-plot .js-plotly-plot');
        const t = div.data.find((t) => t.name === 'feature' && t.x.length);
        const xa = div._fullLayout.xaxis, ya = div._fullLayout.yaxis, box = div.getBoundingClientRect();
        return {x: box.left + xa._offset + xa.l2p(t.x[0]), y: box.top + ya._offset + ya.l2p(t.y[0])};
    }""")
    page.mouse.click(at["x"], at["y"])


def pin_rows(page, rows: range) -> None:
    for row in rows:
        page.locator(f"#graph-table [data-testid=cell-{row}-0]").click()
        page.wait_for_function(
            f"document.querySelector('#graph-node textarea, #graph-node input').value === "
            f"document.querySelector('#graph-table [data-testid=cell-{row}-0]').innerText.trim()", timeout=60_000)
        page.click("#graph-pin")
        page.wait_for_function(
            f"document.querySelector('#graph-subgraph-status').innerText.includes('{row + 1} pinned nodes')",
            timeout=60_000)


def subgraph_points(page) -> int:
    return page.evaluate("""() => {
        const div = document.querySelector('#graph-subgraph .js-plotly-plot');
        return div.data.filter((t) => t.mode === 'markers+text').reduce((n, t) => n + t.customdata.length, 0);
    }""")


def downloaded_json(page) -> dict:
    href = page.locator("#graph-json a").first.get_attribute("href")
    url = href if href.startswith("http") else page.url.rstrip("/") + "/" + href.lstrip("/")
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def test_card_pins_subgraph_supernode_json_and_an_intervention(browser, tiny_server):
    with recording_page(browser, tiny_server, height=PAGE_HEIGHT) as page:
        build_graph(page, "w3 w5 w7 w9")
        # click a node: its card
        click_feature_node(page)
        page.wait_for_function("document.querySelector('#graph-node-card').innerText.includes('Strongest incoming')",
                               timeout=60_000)
        assert "feature" in page.locator("#graph-node-card").inner_text()
        assert "activation" in page.locator("#graph-node-card").inner_text()
        # pin three from the table: the subgraph shows three
        pin_rows(page, range(3))
        page.wait_for_timeout(500)
        assert subgraph_points(page) == 3
        # a supernode of the three: the downloaded JSON holds it
        page.fill("#graph-supernode-name input, #graph-supernode-name textarea", "story")
        before = page.locator("#graph-json a").first.get_attribute("href")
        page.click("#graph-supernode-add")
        page.wait_for_function("document.querySelector('#graph-subgraph-status').innerText.includes('story')",
                               timeout=60_000)
        # the JSON is written afresh for each edit: under load its link arrives after the status line
        page.wait_for_function("(b) => { const a = document.querySelector('#graph-json a');"
                               " return a && a.getAttribute('href') !== b; }", arg=before, timeout=60_000)
        data = downloaded_json(page)
        assert [s[0] for s in data["qParams"]["supernodes"]] == ["story"]
        assert len(data["qParams"]["supernodes"][0]) == 4 and len(data["qParams"]["pinnedIds"]) == 3
        assert subgraph_points(page) == 1
        # zero the top feature (the table's first row): the new top logits beside the old
        page.locator("#graph-table [data-testid=cell-0-0]").click()
        page.wait_for_timeout(500)
        page.click("#graph-intervene")
        page.wait_for_function(
            "document.querySelector('#graph-intervention-result').innerText.includes('logit change')",
            timeout=PLOT_TIMEOUT_MS)
        result = page.locator("#graph-intervention-result").inner_text()
        assert "new prob" in result and "Greedy continuation, original" in result
        _no_error_toast(page)
        # bad input: a warning, and the pins, the subgraph and the intervention's result stay (issue 52)
        page.fill("#graph-node textarea, #graph-node input", "9_9_99")
        page.click("#graph-pin")
        toast = page.locator(".toast-body.warning")
        toast.first.wait_for(timeout=60_000)
        assert "not a node of this graph" in toast.first.inner_text()
        assert "3 pinned nodes" in page.locator("#graph-subgraph-status").inner_text()
        assert page.locator("#graph-subgraph .js-plotly-plot").count() == 1
        assert "logit change" in page.locator("#graph-intervention-result").inner_text()
        assert page.locator(".toast-body.error").count() == 0
        _only_the_server(page, tiny_server)


def test_the_workbench_on_smollm2_for_the_screenshot(browser, server):
    """SmolLM2 with one bundled transcoder: pin the top 6 features (and the top logit), group two, zero the top
    feature; the screenshot
    assets/screenshot-workbench.png shows the graph, the card, the subgraph and the intervention."""
    with recording_page(browser, server, height=PAGE_HEIGHT) as page:
        page.get_by_role("tab", name="Graph").click()
        page.wait_for_selector("#graph-transcoders")
        tick_one_bundled_transcoder(page)
        build_graph(page, "The capital of France is")
        page.fill("#graph-pin-top-n input", "6")
        page.click("#graph-pin-top")
        page.wait_for_function("document.querySelector('#graph-subgraph-status').innerText.includes('7 pinned')",
                               timeout=60_000)
        ids = page.evaluate("""() => [0, 1].map((r) =>
            document.querySelector(`#graph-table [data-testid=cell-${r}-0]`).innerText.trim())""")
        page.fill("#graph-supernode-name input, #graph-supernode-name textarea", "top two")
        page.fill("#graph-supernode-members input, #graph-supernode-members textarea", ", ".join(ids))
        page.click("#graph-supernode-add")
        page.wait_for_function("document.querySelector('#graph-subgraph-status').innerText.includes('top two')",
                               timeout=60_000)
        page.locator("#graph-table [data-testid=cell-0-0]").click()
        page.wait_for_function("document.querySelector('#graph-node-card').innerText.includes('Strongest incoming')",
                               timeout=60_000)
        page.click("#graph-intervene")
        page.wait_for_function(
            "document.querySelector('#graph-intervention-result').innerText.includes('logit change')",
            timeout=PLOT_TIMEOUT_MS)
        page.mouse.move(5, 5)
        page.wait_for_timeout(800)
        page.locator("#graph-plot").scroll_into_view_if_needed()
        top = page.locator("#graph-plot").bounding_box()["y"] + page.evaluate("window.scrollY")
        bottom = page.locator("#graph-intervention-result").bounding_box()["y"] + page.evaluate("window.scrollY") \
            + page.locator("#graph-intervention-result").bounding_box()["height"]
        page.screenshot(path=str(ASSETS / "screenshot-workbench.png"), full_page=True,
                        clip={"x": 0, "y": top - 10, "width": 1400, "height": bottom - top + 20})
        _no_error_toast(page)
        _only_the_server(page, server)
