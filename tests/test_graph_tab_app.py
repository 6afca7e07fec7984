"""The Graph tab over HTTP (gradio_client against a real server of the tiny model with two tiny transcoders): the
readable figure carries the pruned graph for the page's sliders and is drawn from it; head loadings of an edge that
crosses positions and the QK pairs of a head are the library's; bad input is a readable error and the graph and
its workbench state are kept. Also the one-build-per-model rule of the transcoder-set builds.

Does not cover: the page itself (tests/test_graph_tab_browser.py moves the sliders and clicks a node), the numbers
of QK attribution and head loadings (tests/test_qk.py, tests/test_head_loadings.py).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import test_workbench_app
from app_helpers import app_server
from gradio_client import Client
from gradio_client.exceptions import AppError
from test_transcoder_sets_app import RECIPE as SET_RECIPE

import slmviz
from app.saes import scan_source, unreadable_scan
from app.tabs.graph_readable import CHAR_PX, KEEP_DEFAULT, META_KEY, MIN_WEIGHT_DEFAULT, draw, graph_payload
from app.transcoder_sets import KIND, QUICK, TranscoderSets
from slmviz.features.load import load_sae
from slmviz.features.prepared_scans import load_set_scan, set_scan_dir
from slmviz.graphs.derived import kept_adjacency, node_index
from slmviz.training.prepare import RECIPES

pytestmark = pytest.mark.app

# the workbench tests' fixtures: the tiny model, its two random transcoders and a server of them
tiny_folder, tiny, transcoders, tiny_server = (test_workbench_app.tiny_folder, test_workbench_app.tiny,
                                               test_workbench_app.transcoders, test_workbench_app.tiny_server)

PROMPT = "w3 w5 w7 w9"
NAMES = ["tc_l0", "tc_l1"]


@pytest.fixture(scope="module")
def graph(tiny, transcoders):
    """The server's graph, built in this process (unpruned)."""
    tcs = [load_sae(transcoders / name, model=tiny) for name in NAMES]
    return slmviz.attribution_graph(PROMPT, transcoders=tcs, model=tiny, progress=False)


def built(server) -> Client:
    client = Client(server, verbose=False)
    client.predict(PROMPT, NAMES, 0.95, 0.98, api_name="/graph_attribution")
    return client


def figure(client) -> dict:
    plot, _ = client.predict(0.95, 0.98, api_name="/workbench_views")
    return json.loads(plot["plot"])


def crossing_edge(graph) -> tuple[str, str]:
    """The largest kept edge of the pruned graph from a feature to a later position's feature or logit."""
    p = graph.prune(0.95, 0.98)
    a = kept_adjacency(p)
    nodes = p.nodes
    kinds, pos, ids = nodes["kind"].to_numpy(), nodes["position"].to_numpy(), nodes["node_id"].to_numpy()
    dst, src = np.nonzero(a.numpy())
    ok = [(abs(float(a[d, s])), ids[s], ids[d]) for d, s in zip(dst, src, strict=True)
          if kinds[s] == "feature" and kinds[d] in ("feature", "logit") and pos[s] < pos[d]]
    assert ok, "the tiny graph has no edge across positions"
    _, source, target = max(ok)
    return source, target


def test_the_figure_carries_the_pruned_graph_and_is_drawn_from_it(tiny_server, graph):
    """Every kept node is sent with its place and influence rank (embeddings and logits always drawn), the edges
    are the kept adjacency's, and the traces are `draw` at the sliders' first values."""
    fig = figure(built(tiny_server))
    g = fig["layout"]["meta"][META_KEY]
    p = graph.prune(0.95, 0.98)
    kept = p.kept_nodes
    assert sorted(g["ids"]) == sorted(kept["node_id"])
    kinds = dict(zip(g["ids"], g["kind"], strict=True))
    ranks = dict(zip(g["ids"], g["rank"], strict=True))
    assert all((ranks[i] == -1) == (kinds[i] in ("embedding", "logit")) for i in g["ids"])
    # (circuit-tracer's error id "0_{layer}_{pos}" can equal a layer-0 feature's "0_{feature}_{pos}": an id that
    # names two nodes is left out of the checks by id below)
    counts = p.nodes["node_id"].value_counts()
    twice = set(counts[counts > 1].index)
    # ranks follow the pruned graph's influence (smallest cumulative influence = most influential)
    ranked = sorted((r, i) for i, r in ranks.items() if r >= 0 and i not in twice)
    influence = p.influence.numpy()
    index = node_index(p)
    order = [influence[index[i]] for _, i in ranked]
    assert order == sorted(order)
    # y: embeddings at 0, layer L at L + 1, logits on top; the node's token position
    for i, k, position, y in zip(g["ids"], g["kind"], g["position"], g["y"], strict=True):
        if i in twice:
            continue
        row = p.nodes.iloc[index[i]]
        assert y == {"embedding": 0, "logit": p.n_layers + 1}.get(k, int(row.layer) + 1)
        assert position == int(row.position)
    a = kept_adjacency(p)
    for s, d, w in zip(g["src"], g["dst"], g["w"], strict=True):
        if g["ids"][s] not in twice and g["ids"][d] not in twice:
            assert w == pytest.approx(float(a[index[g["ids"][d]], index[g["ids"][s]]]), rel=1e-4, abs=1e-6)
    assert len(g["w"]) == int((a != 0).sum())
    assert fig["data"] == json.loads(json.dumps(draw(g, KEEP_DEFAULT, MIN_WEIGHT_DEFAULT)))
    # fewer nodes kept: the top ones by rank, and only edges among them at least the weight asked
    few = draw(g, 3, 0.5)
    shown = {c[0] for t in few if t["mode"] == "markers" and t["name"] not in ("pinned", "focus")
             for c in t["customdata"]}
    assert shown == {i for i in g["ids"] if ranks[i] < 3}
    lines = [t for t in few if t["name"] in ("edges +", "edges −")]
    assert sum(len(t["x"]) // 3 for t in lines) == sum(
        1 for s, d, w in zip(g["src"], g["dst"], g["w"], strict=True)
        if ranks[g["ids"][s]] < 3 and ranks[g["ids"][d]] < 3 and abs(w) >= 0.5 * g["wmax"])


def test_head_loadings_of_an_edge_and_the_qk_pairs_of_a_head(tiny_server, graph):
    client = built(tiny_server)
    source, target = crossing_edge(graph)
    table, said = client.predict(f"{source} -> {target}", api_name="/graph_head_loadings")
    expected = graph.head_loadings(source, target)
    assert [row[:2] for row in table["data"]] == expected[["layer", "head"]].values.tolist()
    np.testing.assert_allclose([row[2] for row in table["data"]], expected["weight"], atol=1e-4)  # 4 places shown
    assert source in said and target in said and f"{expected.attrs['edge']:+.4g}" in said
    layer, head = table["data"][0][:2]
    index = node_index(graph)
    query = int(graph.nodes["position"].iat[index[target]])
    key = int(graph.nodes["position"].iat[index[source]])
    pairs, heat, said, *entry = client.predict(layer, head, query, key, "", api_name="/graph_qk")
    qk = graph.qk(layer, head, query, key)
    rows = qk.pairs.head(len(pairs["data"]))
    assert [r[2:4] for r in pairs["data"]] == rows[["query_node", "key_node"]].values.tolist()
    np.testing.assert_allclose([r[4] for r in pairs["data"]], rows["contribution"], atol=1e-4)
    assert f"{qk.score:.4g}" in said and json.loads(heat["plot"])["data"][0]["type"] == "heatmap"
    assert entry == [layer, head, query, key]
    title = json.loads(heat["plot"])["layout"]["title"]["text"]
    lines = [re.sub(r"<[^>]+>", "", line) for line in title.split("<br>")]
    assert len(lines) == 2 and max(map(len, lines)) < 90  # two short lines (the browser test measures them)


def test_qk_pairs_without_a_head_take_the_strongest_head_of_the_edge_or_ask_for_one(tiny_server, graph):
    """Issue 52: QK pairs pressed before a head is chosen scored layer 0 head 0 against position 0. Now, with the
    head's boxes empty, it takes the strongest head of the typed edge (its head loadings' largest |weight|, the
    target's position as query, the source's as key), says so, and shows the entry it scored; with no edge typed
    either it asks for a head."""
    client = built(tiny_server)
    source, target = crossing_edge(graph)
    loadings = graph.head_loadings(source, target)
    best = loadings.iloc[int(loadings["weight"].abs().to_numpy().argmax())]
    index = node_index(graph)
    query = int(graph.nodes["position"].iat[index[target]])
    key = int(graph.nodes["position"].iat[index[source]])
    pairs, _, said, *entry = client.predict(None, None, -1, 0, f"{source} -> {target}", api_name="/graph_qk")
    assert entry == [int(best["layer"]), int(best["head"]), query, key]
    assert f"the strongest head of {source} -> {target}" in said
    qk = graph.qk(*entry)
    assert [r[2:4] for r in pairs["data"]] == qk.pairs.head(len(pairs["data"]))[["query_node", "key_node"]
                                                                                 ].values.tolist()
    with pytest.raises(AppError, match="Choose a head first"):
        client.predict(None, None, -1, 0, "", api_name="/graph_qk")


def test_bad_attention_input_is_a_readable_error_and_keeps_the_graph(tiny_server, graph, tiny):
    client = built(tiny_server)
    before = figure(client)
    first, second = crossing_edge(graph)
    for args, message in [((tiny.cfg.n_layers, 0, -1, 0), "layer .* out of range"),
                          ((0, tiny.cfg.n_heads, -1, 0), "head .* out of range"),
                          ((0, 0, 1, 3), "after query"),
                          ((0, 0, 99, 0), "out of range")]:
        with pytest.raises(AppError, match=message):
            client.predict(*args, "", api_name="/graph_qk")
    for edge, message in [("no_such -> node", "not a node|no node"), (f"{second} -> {first}", "comes after|cannot"),
                          ("just one", "source -> target")]:
        with pytest.raises(AppError, match=message):
            client.predict(edge, api_name="/graph_head_loadings")
    assert figure(client) == before  # the graph and its workbench state kept


def test_a_card_names_the_text_its_contexts_come_from():
    """Without a prepared scan a card's contexts are the bundled verses, and it says why; a prepared scan that
    cannot be read is named with the reason (the graph still draws: the set loads without it)."""
    entry = SimpleNamespace(key="a transcoder's weights")
    assert scan_source(entry, ["a verse"] * 3) == ("from 3 verses of the bundled King James Bible: it has no prepared "
                                                   "scan")
    unreadable_scan(entry, "OSError: truncated file")
    said = scan_source(entry, ["a verse"])
    assert "could not be read (OSError: truncated file)" in said and "slmviz prepare --transcoders" in said


def test_one_transcoder_set_build_per_model_at_a_time():
    """A build of the other kind while one runs is refused, naming the one running; the same kind joins it."""
    sets = TranscoderSets(ctx=None, saes=None)
    model = SimpleNamespace(name="m", path="p", cfg=SimpleNamespace(n_layers=2))
    release = threading.Event()
    job = sets._start(model, KIND, lambda report: release.wait(30), who="a")
    try:
        assert sets._start(model, KIND, lambda report: None, who="b") is job
        with pytest.raises(ValueError, match="full set: 2 per-layer transcoders of m is being built now"):
            sets._start(model, QUICK, lambda report: None, who="b")
    finally:
        release.set()
    job.done.wait(30)
    quick = sets._start(model, QUICK, lambda report: "done", who="b")  # once it is done, the other kind starts
    assert quick.done.wait(30) and quick.result == "done"


QUICK_READY = any(kind == QUICK for _, kind in RECIPES)  # the library prepares a quick set (training.prepare)


@pytest.mark.skipif(not QUICK_READY, reason="this slmviz has no plt-quick recipe (training.prepare.RECIPES) yet")
def test_the_quick_set_is_built_from_the_tab_then_ticked_and_used(tiny_folder, tiny, tmp_path):
    """With no set prepared the tab offers the quick build; built (a tiny recipe from $SLMVIZ_SET_RECIPE), the quick
    set is ticked alone and the graph over it shows its scores."""
    env = {"SLMVIZ_CACHE": str(tmp_path), "SLMVIZ_SET_RECIPE": json.dumps(SET_RECIPE)}
    with app_server(env=env, model=str(tiny_folder), allow_local_models=True) as url:
        client = Client(url, verbose=False)
        names, status, *_ = client.predict(api_name="/graph_build_quick")
        label = f"quick set: {tiny.cfg.n_layers} per-layer transcoders"
        assert names["value"] == [label] and "Built" in status
        _, _, _, status = client.predict(PROMPT, [label], 1.0, 1.0, api_name="/graph_attribution")
        assert "Replacement score" in status and label in status


SET_LABEL, QUICK_LABEL = "full set: 2 per-layer transcoders", "quick set: 2 per-layer transcoders"


@pytest.fixture(scope="module")
def damaged_scan_server(tiny_folder, tiny, tmp_path_factory):
    """The app on the tiny model with its full and quick sets prepared (in this process, a tiny recipe, into a cache
    of its own): the full set's scan damaged (scan.safetensors truncated), the quick set's scan removed. Yields
    (url, cache)."""
    from slmviz.training.prepare import prepare_transcoders

    cache = tmp_path_factory.mktemp("damaged-scan-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLMVIZ_CACHE", str(cache))
        for kind, tokens in [(KIND, 2_000), (QUICK, 1_500)]:  # other weights: each coder's card scan is its own
            prepare_transcoders(tiny, kind, progress=False, **{**SET_RECIPE, "tokens": tokens})
            assert load_set_scan(tiny, kind) is not None
        weights = set_scan_dir(tiny, KIND) / "scan.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        shutil.rmtree(set_scan_dir(tiny, QUICK))
    env = {"SLMVIZ_CACHE": str(cache), "SLMVIZ_SET_RECIPE": json.dumps(SET_RECIPE)}
    with app_server(env=env, model=str(tiny_folder), allow_local_models=True) as url:
        yield url, cache


def first_node(table: dict) -> str:
    layer, feature, position = table["data"][0][:3]
    return f"{layer}_{feature}_{position}"


def rebuild_offered(client: Client, label: str) -> str:
    """The rebuild panel's status line for the ticked set: empty exactly when its button is hidden (ScanRebuild.panel;
    gradio_client does not return a button's visibility, tests/test_graph_tab_browser.py sees the button)."""
    return client.predict([label], api_name="/graph_rebuild_scan_offer")


def test_a_missing_or_damaged_set_scan_is_said_and_rebuilt_from_the_tab_keeping_the_graph(damaged_scan_server, tiny):
    """The full set's damaged scan: the graph draws, the card says the scan could not be read and the rebuild panel
    shows; pressing it writes the scan again, the same card then reads it (saying it was rebuilt) and the panel
    hides, the graph with its pins and supernode kept. The quick set's missing scan alike. Pressed with no
    set ticked, it is a readable error."""
    url, cache = damaged_scan_server
    client = Client(url, verbose=False)
    with pytest.raises(AppError, match="Tick a prepared transcoder set"):
        client.predict([], api_name="/graph_rebuild_scan")  # no set ticked
    for label, kind, problem in [(SET_LABEL, KIND, "its prepared scan could not be read (SafetensorError"),
                                 (QUICK_LABEL, QUICK, "it has no prepared scan")]:
        _, table, _, status = client.predict(PROMPT, [label], 1.0, 1.0, api_name="/graph_attribution")
        assert "Replacement score" in status and table["data"]  # the graph draws without the scan
        node = first_node(table)
        card, _ = client.predict(node, 1.0, 1.0, api_name="/workbench_card")
        assert problem in card and "No feature scan yet" in card, card
        said = rebuild_offered(client, label)
        assert problem in said and label in said
        client.predict(node, 1.0, 1.0, api_name="/workbench_pin")
        _, sub_status, _ = client.predict("story", "", 1.0, 1.0, api_name="/workbench_supernode")
        assert "story" in sub_status
        said = client.predict([label], api_name="/graph_rebuild_scan")
        assert f"Rebuilt the scan of the {label}: {len(SET_RECIPE['corpus'])} documents" in said
        card, _ = client.predict(node, 1.0, 1.0, api_name="/workbench_card")
        assert (f"from the scan prepared with it, rebuilt since the server started: {len(SET_RECIPE['corpus'])} "
                "documents of its own corpus") in card and "Top activating contexts" in card
        assert rebuild_offered(client, label) == ""
        _, path = client.predict(1.0, 1.0, api_name="/workbench_views")  # the graph, its pins and supernode kept
        q = json.loads(Path(path).read_text())["qParams"]
        assert node in q["pinnedIds"] and any(group[0] == "story" for group in q["supernodes"])
        with pytest.MonkeyPatch.context() as mp:  # written whole on disk: the library reads it
            mp.setenv("SLMVIZ_CACHE", str(cache))
            scanned, docs = load_set_scan(tiny, kind)
            assert docs == SET_RECIPE["corpus"] and len(scanned.hooks) == 2
            assert [p.name for p in set_scan_dir(tiny, kind).parent.iterdir() if "scan" in p.name] == ["scan"]


def test_the_drawing_gives_each_marker_and_label_its_own_room(graph):
    """Markers of one row never overlap, and each label's room (after its marker) holds no other marker and stays
    inside the drawing."""
    p = graph.prune(0.95, 0.98)
    labels = {i: "a feature label" for i, k in zip(p.nodes["node_id"], p.nodes["kind"], strict=True)
              if k == "feature"}
    g = graph_payload(p, labels)
    traces = {t["name"]: t for t in draw(g, KEEP_DEFAULT, MIN_WEIGHT_DEFAULT)}
    rows: dict[float, list[float]] = {}
    for kind in ("embedding", "feature", "error", "logit"):
        for x, y in zip(traces[kind]["x"], traces[kind]["y"], strict=True):
            rows.setdefault(y, []).append(x)
    for xs in rows.values():
        xs.sort()
        assert all(b - a >= g["slot"] - 1e-9 for a, b in zip(xs, xs[1:], strict=False))
    tokens, bars = traces["tokens"], traces["columns"]
    right = 2 * tokens["x"][-1] - bars["x"][-3]  # the last column's centre and left edge: its right edge
    said = traces["labels"]
    assert said["x"], "nothing labelled"
    for x, y, text in zip(said["x"], said["y"], said["text"], strict=True):
        end = x + CHAR_PX * len(text)
        assert end <= right
        assert not [m for m in rows[y] if x < m < end + g["slot"] / 2], (text, x, rows[y])


def test_the_summary_is_the_librarys_with_each_group_checked(tiny_server, graph):
    """Issue 51: #graph-summary draws the pruned graph's GraphSummary (its groups as boxes, the logits beyond the
    three most probable left to the full graph), each feature group's box with its checked effect, measured in a
    free run and predicted by the graph, as GraphSummary.check gives them."""
    from app.tabs.graph_summary import drawn_groups, effect_line

    client = built(tiny_server)
    drawing, said = client.predict(0.95, 0.98, api_name="/graph_summary")
    s = graph.prune(0.95, 0.98).summarize(max_groups=12)
    checked = s.check()
    target = repr(checked.attrs["target_token"])
    shown = drawn_groups(s.groups)
    assert drawing.count("class='graph-summary-box'") == len(shown)
    for name in shown["name"]:
        assert f"data-group='{html.escape(name, quote=True)}'" in drawing
    for name in s.feature_groups["name"]:
        line = effect_line(checked, name, target)
        assert html.escape(line) in drawing or html.escape(effect_line(checked, name, "")) in drawing, line
    assert f"{len(s.feature_groups)} feature groups" in said and f"{s.coverage:.0%}" in said
    assert html.escape(target) in said


def test_the_summarys_groups_become_supernodes_on_request_and_the_persons_pins_stay(tiny_server, graph, tmp_path):
    """Issue 51: #graph-summary-apply makes the summary's feature groups the workbench's supernodes (the JSON
    carries them), next to a pin the person made first, which stays theirs."""
    client = Client(tiny_server, verbose=False)
    with pytest.raises(AppError, match="Build the attribution graph first"):
        client.predict(api_name="/graph_summary_apply")
    client = built(tiny_server)
    client.predict(0.95, 0.98, api_name="/graph_summary")
    s = graph.prune(0.95, 0.98).summarize(max_groups=12, apply=False)
    mine = s.feature_groups["members"].iloc[0][0]
    client.predict(mine, 0.95, 0.98, api_name="/workbench_pin")
    said = client.predict(api_name="/graph_summary_apply")
    assert f"{len(s.feature_groups)} feature groups are supernodes" in said
    _, path = client.predict(0.95, 0.98, api_name="/workbench_views")
    data = json.loads(Path(path).read_text())
    assert [sn[0] for sn in data["qParams"]["supernodes"]] == list(s.feature_groups["name"])
    assert mine in data["qParams"]["pinnedIds"]
    assert data["slmviz_summary"]["auto_pinned"] and mine not in data["slmviz_summary"]["auto_pinned"]


def test_the_old_api_names_answer_for_one_release(tiny_server):
    """Issue 51: the circuit_* names still answer beside the graph_* ones."""
    client = Client(tiny_server, verbose=False)
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/graph_attribution", "/graph_prune", "/graph_feature", "/graph_summary", "/graph_attribution_cancel",
            "/circuit_attribution", "/circuit_prune", "/circuit_feature", "/circuit_attribution_cancel"} <= names
    *_, status = client.predict(PROMPT, NAMES, 0.95, 0.98, api_name="/circuit_attribution")
    assert "Pruned to" in status
    _, _, _, again = client.predict(0.9, 0.98, api_name="/circuit_prune")
    assert "Pruned to 0.9" in again


def test_the_gallery_is_the_measured_one_and_the_answer_line_says_when_there_is_no_answer(graph):
    """The gallery's prompts and probabilities are bench/studies/graph_gallery.py's (app/graph_gallery.json), each
    answered right; the answer line beside the graph names the top token and warns when it is a function word or
    an unsure guess (the tiny model's top token has p ≈ 0.01)."""
    from app.tabs.graph_attribution import GALLERY, answer_line, gallery_samples

    data = json.loads(GALLERY.read_text(encoding="utf-8"))
    assert len(data["SmolLM2-135M-Instruct"]) >= 5
    samples, labels = gallery_samples(SimpleNamespace(name="SmolLM2-135M-Instruct"))
    first = data["SmolLM2-135M-Instruct"][0]
    assert samples[0] == [first["prompt"]] and f"(p {first['p']:.2f})" in labels[0]
    assert gallery_samples(SimpleNamespace(name="no such model")) == ([], [])
    line = answer_line(graph)
    logits = graph.nodes[graph.nodes["kind"] == "logit"].sort_values("probability", ascending=False)
    assert repr(str(logits["token"].iloc[0])) in line and "Note:" in line and "unsure" in line
    assert f"starting with {graph.tokens[0]!r}" in line


def test_summary_boxes_never_overlap_and_the_logits_sit_just_above_the_rest():
    """The summary's boxes (app/tabs/graph_summary.place): none overlaps another, the tokens are lowest, and the
    logits sit just above the highest feature box rather than at the top of an empty span."""
    import pandas as pd

    from app.tabs.graph_summary import GAP, box_size, place

    rng = np.random.default_rng(0)
    rows = [{"name": f"tok {p}", "kind": "embedding", "layers": [-1], "positions": [p], "influence": 0.01}
            for p in range(6)]
    rows += [{"name": f"g{i}", "kind": "features", "layers": sorted(rng.integers(0, 30, 3).tolist()),
              "positions": sorted(rng.integers(0, 6, 2).tolist()), "influence": float(rng.random())}
             for i in range(12)]
    rows += [{"name": f"logit {i}", "kind": "logit", "layers": [30], "positions": [5], "influence": 0.5 - i / 10}
             for i in range(3)]
    groups = pd.DataFrame(rows)
    at, height = place(groups, 6, 30, 1240)
    boxes = {r.name: (*at[r.name], *box_size(r.kind)) for r in groups.itertuples()}
    names = list(boxes)
    for i, a in enumerate(names):
        x, y, w, h = boxes[a]
        assert x >= 0 and x + w <= 1240 and y >= 0 and y + h <= height
        for b in names[i + 1:]:
            bx, by, bw, bh = boxes[b]
            assert x + w <= bx or bx + bw <= x or y + h <= by or by + bh <= y, (a, b)
    kinds = dict(zip(groups.name, groups.kind, strict=True))
    top_feature = min(boxes[n][1] for n in names if kinds[n] == "features")  # y grows downward on the page
    lowest_logit = max(boxes[n][1] + boxes[n][3] for n in names if kinds[n] == "logit")
    assert lowest_logit <= top_feature and top_feature - lowest_logit <= 3 * GAP + 1
    assert all(boxes[n][1] > top_feature for n in names if kinds[n] == "embedding")


def test_a_graph_over_a_set_with_a_finished_deep_scan_shows_its_labels_and_scores(damaged_scan_server, tiny):
    """A set whose deep scan is done (its LabelTable on disk, written here by hand with known labels and scores): a
    graph built over it in the tab gives each feature's card the deep label and its measured score, as
    `g.use_labels` would; before this, the tab's graphs never read the deep labels ("no score")."""
    import pandas as pd

    from slmviz.features.deep_scan import LabelTable
    from slmviz.features.prepared_scans import deep_scan_dir
    from slmviz.hooks import layer_hook_name

    url, cache = damaged_scan_server
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLMVIZ_CACHE", str(cache))
        folder = deep_scan_dir(tiny, KIND)
    folder.mkdir(parents=True, exist_ok=True)
    layers, features = np.meshgrid(np.arange(tiny.cfg.n_layers), np.arange(8192), indexing="ij")
    frame = pd.DataFrame({"layer": layers.ravel(), "feature": features.ravel()})
    frame["hook"] = [layer_hook_name(int(L), "mlp.hook_in") for L in frame.layer]
    frame["label"] = [f"deep{L}x{f} / w5 (+3)" for L, f in zip(frame.layer, frame.feature, strict=True)]
    frame["tokens"] = [[5] for _ in range(len(frame))]
    frame["score"] = 0.5 + frame.feature / 20_000
    frame["baseline"] = 0.5
    LabelTable(frame, {"tokens": 1_000_000, "heldout_tokens": 1_000}).save(folder)
    client = Client(url, verbose=False)
    _, table, _, _ = client.predict(PROMPT, [SET_LABEL], 1.0, 1.0, api_name="/graph_attribution")
    layer, feature = (int(x) for x in table["data"][0][:2])
    card, _ = client.predict(first_node(table), 1.0, 1.0, api_name="/workbench_card")
    assert f"deep{layer}x{feature} / w5 (+3)" in html.unescape(card), card
    assert f"score {0.5 + feature / 20_000:.2f}" in card and "no score" not in card, card
