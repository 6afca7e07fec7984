"""The Graph tab in headless Chromium, on the tiny model with two tiny transcoders: it says which transcoders it uses
and, once built, their scores (#graph-set); the two sliders redraw the graph in the page without a request, and the
page's drawing (DRAW_JS) is the server's (`draw`) at any slider values; clicking a node shows its card; the QK
table appears for a chosen head and the head loadings for a chosen edge. Then, on SmolLM2 with the best transcoders
the cache has, the screenshots of the Graph tab in assets/.

Does not check the numbers (tests/test_graph_tab_app.py compares them with the library).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import test_graph_tab_app
import test_workbench_app
from app_helpers import CHROMIUM, NO_CHROMIUM, recording_page
from playwright.sync_api import expect
from test_browser import ASSETS
from test_graph_tab_app import crossing_edge
from test_workbench_browser import click_feature_node

from app.tabs.graph_readable import DRAW_JS, KEEP_DEFAULT, META_KEY, MIN_WEIGHT_DEFAULT, draw

pytestmark = pytest.mark.browser

# the workbench tests' fixtures (the tiny model, its two random transcoders, a server of them) and the graph
tiny_folder, tiny, transcoders, tiny_server = (test_workbench_app.tiny_folder, test_workbench_app.tiny,
                                               test_workbench_app.transcoders, test_workbench_app.tiny_server)
graph = test_graph_tab_app.graph
damaged_scan_server, SET_LABEL = test_graph_tab_app.damaged_scan_server, test_graph_tab_app.SET_LABEL

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)

PROMPT = "w3 w5 w7 w9"
NAMES = ["tc_l0", "tc_l1"]
TIMEOUT_MS = 120_000


def build(page) -> None:
    page.get_by_role("tab", name="Graph").click()
    page.wait_for_selector("#graph-prompt textarea")
    assert "Uses tc_l0, tc_l1" in page.locator("#graph-set").inner_text()
    page.fill("#graph-prompt textarea", PROMPT)
    page.click("#graph-build")
    page.wait_for_function("document.querySelector('#graph-set').innerText.includes('replacement score')",
                           timeout=TIMEOUT_MS)
    page.wait_for_selector("#graph-plot .js-plotly-plot .nsewdrag", timeout=TIMEOUT_MS)


def plotted(page) -> dict:
    """The figure in #graph-plot: its traces (the points each holds) and the graph in its layout.meta."""
    return page.evaluate(f"""() => {{
        const div = document.querySelector('#graph-plot .js-plotly-plot');
        return {{meta: div.layout.meta.{META_KEY},
                 points: div.data.map((t) => [t.name, (t.x || []).length])}};
    }}""")


def points(traces: list[dict]) -> list:
    return [[t["name"], len(t["x"])] for t in traces]


def move(page, slider: str, value: float) -> None:
    page.locator(f"#{slider} input[type=range]").fill(str(value))


def test_one_built_graph_sliders_a_card_hover_labels_head_loadings_and_qk(browser, tiny_server, graph):
    """On one page and one build of the tiny graph (each costs Chromium a few CPU-seconds, bench/results/notes.md),
    in turn: the sliders redraw in the page and a click shows the card; hovering picks out a node's edges and no two
    labels overlap; an edge's head loadings, then the QK table of its head, and a bad layer kept out."""
    with recording_page(browser, tiny_server, height=1400) as page:
        build(page)
        sliders_redraw_in_the_page_and_a_click_shows_the_card(page, tiny_server)
        hovering_a_node_picks_out_its_edges_and_no_two_labels_overlap(page)
        head_loadings_for_an_edge_then_the_qk_table_for_its_head(page, graph)


def sliders_redraw_in_the_page_and_a_click_shows_the_card(page, url: str) -> None:
    """The page's drawing is the server's (DRAW_JS == draw) at the sliders' first values and at others; the sliders
    redraw without a request; a click on a feature node shows its card; no host but the server's is contacted."""
    assert "completeness" in page.locator("#graph-set").inner_text()
    first = plotted(page)
    g = first["meta"]
    # the page's drawing is the server's, at the sliders' first values and at others
    for keep, weight in [(KEEP_DEFAULT, MIN_WEIGHT_DEFAULT), (3, 0.5), (10, 0.0)]:
        js = page.evaluate(f"(g) => ({DRAW_JS})(g, {keep}, {weight})", g)
        assert json.loads(json.dumps(js)) == json.loads(json.dumps(draw(g, keep, weight)))
    assert first["points"] == points(draw(g, KEEP_DEFAULT, MIN_WEIGHT_DEFAULT))
    # the sliders redraw without a request to the server
    requests = []
    page.on("request", lambda r: requests.append(r.url))
    for slider, value, expected in [("graph-keep-nodes", 10, draw(g, 10, MIN_WEIGHT_DEFAULT)),
                                    ("graph-min-weight", 0.5, draw(g, 10, 0.5))]:
        move(page, slider, value)
        page.wait_for_function("(want) => JSON.stringify(document.querySelector('#graph-plot .js-plotly-plot')"
                               ".data.map((t) => [t.name, (t.x || []).length])) === JSON.stringify(want)",
                               arg=points(expected), timeout=10_000)
    assert not [u for u in requests if "/queue/" in u or "/run/" in u], requests
    # a click on a feature node shows its card
    move(page, "graph-keep-nodes", KEEP_DEFAULT)
    click_feature_node(page)
    page.wait_for_function("document.querySelector('#graph-node-card').innerText.includes('feature')",
                           timeout=60_000)
    errors = page.locator(".toast-body.error")
    assert errors.count() == 0, errors.first.inner_text()
    assert page.hosts <= {url.split("//")[1].rstrip("/")}


def head_loadings_for_an_edge_then_the_qk_table_for_its_head(page, graph) -> None:
    source, target = crossing_edge(graph)
    page.fill("#graph-edge textarea", f"{source} -> {target}")
    page.click("#graph-head-loadings-run")
    page.wait_for_selector("#graph-head-loadings [data-testid=cell-0-0]", timeout=TIMEOUT_MS)
    page.locator("#graph-head-loadings [data-testid=cell-0-0]").click()  # the head: fills layer, head, positions
    page.wait_for_function("document.querySelector('#graph-qk-key input').value !== '0' || "
                           "document.querySelector('#graph-qk-query input').value !== '-1'", timeout=30_000)
    page.click("#graph-qk")
    page.wait_for_selector("#graph-qk-result [data-testid=cell-0-0]", timeout=TIMEOUT_MS)
    page.wait_for_selector("#graph-qk-plot .js-plotly-plot", timeout=TIMEOUT_MS)
    assert "pattern" in page.locator("#graph-qk-status").inner_text()
    # the heat map's title inside its plot (issue 52: it was clipped at the right edge)
    page.wait_for_selector("#graph-qk-plot .gtitle", timeout=30_000)
    inside = page.evaluate("""() => {
        const svg = document.querySelector('#graph-qk-plot .main-svg').getBoundingClientRect();
        const t = document.querySelector('#graph-qk-plot .gtitle').getBoundingClientRect();
        return [t.left >= svg.left - 1, t.right <= svg.right + 1, t.top >= svg.top - 1, t.width > 0];
    }""")
    assert inside == [True, True, True, True], inside
    # bad input: a warning, the table and the heat map kept, and the status says what went wrong (issue 52)
    a_mistake_warns_and_its_status_says_not_done(page, "#graph-qk-layer input", "99", "#graph-qk", "out of range",
                                                 "#graph-qk-status")
    assert page.locator("#graph-qk-result [data-testid=cell-0-0]").count() == 1
    assert page.locator("#graph-qk-plot .js-plotly-plot").count() == 1
    assert page.locator(".toast-body.error").count() == 0


def a_mistake_warns_and_its_status_says_not_done(page, field: str, value: str, button: str, says: str,
                                                 status: str) -> None:
    """`value` typed into `field` and `button` pressed: a warning toast saying `says`, and `status` says 'Not done'."""
    page.fill(field, value)
    page.click(button)
    page.wait_for_selector(".toast-body.warning", timeout=30_000)
    assert says in page.locator(".toast-body.warning").first.inner_text()
    page.wait_for_function(f"document.querySelector({status!r}).innerText.includes('Not done')", timeout=30_000)


REBUILD_SCREENSHOT = Path(tempfile.gettempdir()) / "slmviz-rebuild-scan.png"  # looked at by hand, not kept


def test_a_damaged_set_scan_shows_the_rebuild_button_beside_the_card_and_rebuilding_hides_it(browser,
                                                                                             damaged_scan_server):
    """The full set (ticked) has a damaged scan: once its graph is built the Rebuild button and its status show
    beside the node card, which says the scan could not be read; pressing it rebuilds the scan, the card is drawn
    again from it and the button hides, the graph still there."""
    url, _ = damaged_scan_server
    with recording_page(browser, url, height=1400) as page:
        page.get_by_role("tab", name="Graph").click()
        page.wait_for_selector("#graph-prompt textarea")
        expect(page.get_by_label(SET_LABEL)).to_be_checked(timeout=60_000)  # once the page load's refresh ran
        assert not page.locator("#graph-rebuild-scan").is_visible()  # the set is not loaded yet: nothing known
        page.fill("#graph-prompt textarea", PROMPT)
        for slider in ("graph-node-threshold", "graph-edge-threshold"):  # the random set's features: keep all
            move(page, slider, 1.0)
        page.click("#graph-build")
        page.wait_for_selector("#graph-plot .js-plotly-plot .nsewdrag", timeout=TIMEOUT_MS)
        page.wait_for_selector("#graph-rebuild-scan", state="visible", timeout=30_000)
        assert "could not be read" in page.locator("#graph-rebuild-scan-status").inner_text()
        click_feature_node(page)
        page.wait_for_function("document.querySelector('#graph-node-card').innerText.includes('could not be read')",
                               timeout=60_000)
        page.mouse.move(5, 5)
        page.locator("#graph-rebuild-scan").scroll_into_view_if_needed()
        page.screenshot(path=str(REBUILD_SCREENSHOT))
        page.click("#graph-rebuild-scan")
        page.wait_for_function("document.querySelector('#graph-node-card').innerText.includes('rebuilt since')",
                               timeout=TIMEOUT_MS)
        assert "Rebuilt the scan" in page.locator("#graph-rebuild-scan-status").inner_text()
        assert not page.locator("#graph-rebuild-scan").is_visible()
        assert "Top activating contexts" in page.locator("#graph-node-card").inner_text()
        assert page.locator("#graph-plot .js-plotly-plot .nsewdrag").count() == 1
        errors = page.locator(".toast-body.error")
        assert errors.count() == 0, errors.first.inner_text()


SCREENSHOT_PROMPT = "The capital of France is"  # the gallery's first: SmolLM2 answers " Paris" (p 0.75)
CROSSING_EDGE_JS = """() => {
    // the strongest drawn edge from a feature to a later position's feature or logit
    const g = document.querySelector('#graph-plot .js-plotly-plot').layout.meta.slmviz_graph;
    let best = null;
    for (let e = 0; e < g.src.length; e++) {
        const s = g.src[e], d = g.dst[e];
        const ok = g.kind[s] === 'feature' && (g.kind[d] === 'feature' || g.kind[d] === 'logit')
            && g.position[s] < g.position[d];
        if (ok && (best === null || Math.abs(g.w[e]) > Math.abs(g.w[best]))) best = e;
    }
    return best === null ? null : g.ids[g.src[best]] + ' -> ' + g.ids[g.dst[best]];
}"""


def test_the_graph_tab_on_smollm2_for_the_screenshots(browser, server):
    """SmolLM2 with the best transcoders this cache has (the tab's own choice): the summary, the full graph (no two
    labels overlapping at any of several slider settings; a node hovered), a node's card, an edge's head loadings
    and its head's QK pairs; saves assets/screenshot-graph-summary.png, screenshot-graph.png,
    screenshot-graph-card.png and screenshot-graph-qk.png."""
    with recording_page(browser, server, height=1400) as page:
        page.get_by_role("tab", name="Graph").click()
        page.wait_for_selector("#graph-prompt textarea")
        page.fill("#graph-prompt textarea", SCREENSHOT_PROMPT)
        page.click("#graph-build")
        page.wait_for_function("document.querySelector('#graph-set').innerText.includes('replacement score')",
                               timeout=600_000)
        # a prepared set's graph (thousands of nodes) is drawn after its summary's job starts: minutes when busy
        page.wait_for_selector("#graph-plot .js-plotly-plot .nsewdrag", timeout=600_000)
        page.wait_for_selector("#graph-summary .graph-summary-box", timeout=600_000)
        page.wait_for_timeout(1500)  # the sliders' values applied to the server's figure
        page.mouse.move(5, 5)
        scroll = page.evaluate("window.scrollY")
        top = page.locator("#graph-answer").bounding_box()["y"] + scroll
        end = page.locator("#graph-summary-status").bounding_box()
        bottom = end["y"] + scroll + end["height"]
        page.screenshot(path=str(ASSETS / "screenshot-graph-summary.png"), full_page=True,
                        clip={"x": 0, "y": top - 10, "width": 1400, "height": bottom - top + 20})
        n = len(plotted(page)["meta"]["ids"])
        shown = labels_never_overlap(page, [(1000, 0.02), (200, 0.05), (n, 0.0), (KEEP_DEFAULT, MIN_WEIGHT_DEFAULT)])
        assert shown[-1] >= 8, shown  # at the first view most labels show
        page.locator("#graph-plot .js-plotly-plot").scroll_into_view_if_needed()
        at = page.evaluate("""() => {
            const div = document.querySelector('#graph-plot .js-plotly-plot');
            const t = div.data.find((t) => t.name === 'feature' && t.x.length);
            const xa = div._fullLayout.xaxis, ya = div._fullLayout.yaxis, box = div.getBoundingClientRect();
            return {x: box.left + xa._offset + xa.l2p(t.x[0]), y: box.top + ya._offset + ya.l2p(t.y[0])};
        }""")
        page.mouse.move(at["x"], at["y"])
        page.wait_for_function("""() => document.querySelector('#graph-plot .js-plotly-plot').data
            .some((t) => t.name === 'highlight nodes' && t.x.length)""", timeout=10_000)
        page.wait_for_timeout(500)
        scroll = page.evaluate("window.scrollY")
        plot = page.locator("#graph-plot").bounding_box()
        page.screenshot(path=str(ASSETS / "screenshot-graph.png"), full_page=True,
                        clip={"x": 0, "y": plot["y"] + scroll - 6, "width": 1400, "height": plot["height"] + 12})
        page.mouse.move(5, 5)
        click_feature_node(page)
        page.wait_for_function("document.querySelector('#graph-node-card').innerText.includes('Strongest incoming')",
                               timeout=60_000)
        page.mouse.move(5, 5)
        page.locator("#graph-node-card").scroll_into_view_if_needed()
        page.locator("#graph-node-card").screenshot(path=str(ASSETS / "screenshot-graph-card.png"))
        edge = page.evaluate(CROSSING_EDGE_JS)
        assert edge, "no drawn edge crosses positions"
        page.fill("#graph-edge textarea", edge)
        page.click("#graph-head-loadings-run")
        page.wait_for_selector("#graph-head-loadings [data-testid=cell-0-0]", timeout=TIMEOUT_MS)
        page.locator("#graph-head-loadings [data-testid=cell-0-0]").click()
        page.wait_for_timeout(1500)
        page.click("#graph-qk")
        page.wait_for_selector("#graph-qk-result [data-testid=cell-0-0]", timeout=TIMEOUT_MS)
        page.wait_for_selector("#graph-qk-plot .js-plotly-plot", timeout=TIMEOUT_MS)
        page.mouse.move(5, 5)
        page.wait_for_timeout(800)
        start = page.locator("#graph-edge").bounding_box()["y"] + page.evaluate("window.scrollY")
        end = page.locator("#graph-qk-result").bounding_box()
        end = end["y"] + page.evaluate("window.scrollY") + end["height"]
        page.screenshot(path=str(ASSETS / "screenshot-graph-qk.png"), full_page=True,
                        clip={"x": 0, "y": start - 10, "width": 1400, "height": end - start + 20})
        errors = page.locator(".toast-body.error")
        assert errors.count() == 0, errors.first.inner_text()


# what a person sees of the full graph's labels: every drawn label's box on the page (those the page left off, and
# their nodes' hover text, excepted)
LABEL_BOXES_JS = """(id) => Array.from(document.querySelectorAll('#' + id + ' g.textpoint text'))
    .filter((t) => getComputedStyle(t).display !== 'none' && t.textContent.trim())
    .map((t) => { const r = t.getBoundingClientRect();
                  return [t.textContent, r.left, r.top, r.right, r.bottom]; })"""


def overlapping(boxes: list) -> list:
    """The pairs of label boxes that overlap (by more than half a pixel: anti-aliasing)."""
    return [(a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:]
            if a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5 and a[2] < b[4] - 0.5 and b[2] < a[4] - 0.5]


def labels_never_overlap(page, settings: list[tuple[float, float]]) -> list[int]:
    """At each (nodes drawn, smallest edge) of the sliders: no two drawn labels overlap; returns how many show."""
    shown = []
    for keep, weight in settings:
        move(page, "graph-keep-nodes", keep)
        move(page, "graph-min-weight", weight)
        page.wait_for_timeout(700)  # the redraw, then the page's label pass after it
        boxes = page.evaluate(LABEL_BOXES_JS, "graph-plot")
        assert not overlapping(boxes), (keep, weight, overlapping(boxes)[:5])
        shown.append(len(boxes))
    return shown


def test_nothing_shows_before_a_graph_then_the_summary_first_a_box_opens_its_nodes_and_a_bad_prompt_keeps_them(
        browser, tiny_server):
    """Issue 51: before a graph exists the page shows no empty panel; once built, the summary's boxes show, and
    clicking a feature group's box selects its members and draws them ringed in the full graph with their edges
    picked out (the rest dimmed). Then issue 52's empty prompt on the same page (one page and one build: each costs
    Chromium a few CPU-seconds, bench/results/notes.md)."""
    with recording_page(browser, tiny_server, height=1400) as page:
        page.get_by_role("tab", name="Graph").click()
        page.wait_for_selector("#graph-prompt textarea")
        for panel in ("#graph-results", "#graph-summary", "#graph-plot", "#graph-table", "#graph-all-edges"):
            assert not page.locator(panel).is_visible(), panel
        assert page.locator("#graph-gallery").is_visible()
        build(page)
        page.wait_for_selector("#graph-summary .graph-summary-box", timeout=TIMEOUT_MS)
        assert "feature groups" in page.locator("#graph-summary-status").inner_text()
        box = page.locator("#graph-summary .graph-summary-box[data-kind=features]").first
        name = box.get_attribute("data-group")
        box.click()
        page.wait_for_function("document.querySelector('#graph-summary-status').innerText.includes('ringed')",
                               timeout=60_000)
        members = page.locator("#graph-node textarea, #graph-node input").first.input_value().split(", ")
        assert members and all(members)
        page.wait_for_function("""() => {
            const div = document.querySelector('#graph-plot .js-plotly-plot');
            const ring = div && div.data.find((t) => t.name === 'focus');
            return ring && ring.x.length && div.data.some((t) => t.name === 'highlight nodes');
        }""", timeout=60_000)
        focus = page.evaluate("""() => document.querySelector('#graph-plot .js-plotly-plot').layout.meta
            .slmviz_graph.ids.filter((_, i) => document.querySelector('#graph-plot .js-plotly-plot')
            .layout.meta.slmviz_graph.focus[i])""")
        assert set(focus) == set(members), name  # (an error node's id can equal a feature's: sets)
        assert page.locator(".toast-body.error").count() == 0
        a_bad_prompt_is_a_warning_and_the_graph_and_its_panels_stay(page)


def hovering_a_node_picks_out_its_edges_and_no_two_labels_overlap(page) -> None:
    """Issue 51: hovering a node adds its edges (and their end nodes' rings) on top and dims every other trace; the
    labels drawn (logits, features, the tokens under the columns) never overlap at any slider setting. The real
    prompt's labels are checked the same way in the SmolLM2 screenshot test."""
    page.wait_for_timeout(1500)
    g = plotted(page)["meta"]
    assert labels_never_overlap(page, [(10, 0.0), (50, 0.05), (200, 0.0), (len(g["ids"]), 0.5)])
    move(page, "graph-keep-nodes", len(g["ids"]))
    move(page, "graph-min-weight", 0)
    page.wait_for_timeout(700)
    page.locator("#graph-plot .js-plotly-plot").scroll_into_view_if_needed()
    at = page.evaluate("""() => {
        const div = document.querySelector('#graph-plot .js-plotly-plot');
        const t = div.data.find((t) => t.name === 'feature' && t.x.length);
        const xa = div._fullLayout.xaxis, ya = div._fullLayout.yaxis, box = div.getBoundingClientRect();
        return {x: box.left + xa._offset + xa.l2p(t.x[0]), y: box.top + ya._offset + ya.l2p(t.y[0]),
                id: t.customdata[0][0]};
    }""")
    page.mouse.move(at["x"], at["y"])
    page.wait_for_function("""() => document.querySelector('#graph-plot .js-plotly-plot').data
        .some((t) => t.name === 'highlight nodes' && t.x.length)""", timeout=10_000)
    seen = page.evaluate("""() => document.querySelector('#graph-plot .js-plotly-plot').data
        .map((t) => [t.name, (t.x || []).filter((v) => v !== null).length, t.opacity])""")
    hovered = page.evaluate("() => document.querySelector('#graph-plot .js-plotly-plot')._slmvizShown")
    assert hovered  # the node under the mouse (plotly's closest point)
    edges = [(s, d) for s, d in zip(g["src"], g["dst"], strict=True) if hovered in (g["ids"][s], g["ids"][d])]
    picked = sum(n for name, n, _ in seen if name in ("highlight +", "highlight −")) // 2
    assert picked == len(edges) > 0, (picked, len(edges))
    dimmed = {name: op for name, _, op in seen if name in ("edges +", "edges −", "feature", "error", "logit")}
    assert dimmed and all(op is not None and op < 0.2 for op in dimmed.values()), dimmed
    page.mouse.move(5, 5)  # away: the highlight goes, the opacities come back
    page.wait_for_function("""() => !document.querySelector('#graph-plot .js-plotly-plot').data
        .some((t) => t.name.startsWith('highlight'))""", timeout=10_000)


def a_bad_prompt_is_a_warning_and_the_graph_and_its_panels_stay(page) -> None:
    """Issue 52: an empty prompt after a graph is built: a warning toast, no error badge, the status says what went
    wrong (no stale 'Running'), and the summary, the full graph and the table show what they showed."""
    page.wait_for_selector("#graph-summary .graph-summary-box", timeout=TIMEOUT_MS)
    before = page.evaluate("() => document.querySelector('#graph-plot .js-plotly-plot').layout.meta"
                           ".slmviz_graph.ids.length")
    a_mistake_warns_and_its_status_says_not_done(page, "#graph-prompt textarea", "", "#graph-build", "empty",
                                                 "#graph-status")
    assert "Running" not in page.locator("#graph-status").inner_text()
    assert page.locator(".toast-body.error").count() == 0
    assert page.locator("#graph-summary .graph-summary-box").count() > 0
    assert page.evaluate("() => document.querySelector('#graph-plot .js-plotly-plot').layout.meta"
                         ".slmviz_graph.ids.length") == before
    assert page.locator("#graph-features [data-testid=cell-0-0]").count() == 1
