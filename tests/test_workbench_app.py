"""The attribution-graph workbench over HTTP (gradio_client against a real server of the tiny model with two tiny
transcoders): node cards, pins and the subgraph, supernodes in the downloaded JSON, labels, loading a JSON back,
interventions, and bad input that is a readable error and loses nothing.

The numbers are the library's (tests/test_workbench.py checks those): here the same calls are made in this process
and compared. Does not cover: the page itself (tests/test_workbench_browser.py clicks through it).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
from app_helpers import app_server
from conftest import build_tiny_model
from gradio_client import Client, handle_file
from gradio_client.exceptions import AppError

import slmviz
from slmviz import SAE
from slmviz.features.load import load_sae
from slmviz.graphs.intervene import intervene
from slmviz.model_api import load_folder

pytestmark = pytest.mark.app

PROMPT = "w3 w5 w7 w9"
NAMES = ["tc_l0", "tc_l1"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("workbench-app") / "tiny", "llama_gqa", seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_folder(tiny_folder)


@pytest.fixture(scope="module")
def transcoders(tiny_folder, tiny):
    """The Circuits tab tests' transcoders: random, at layers 0 and 1, offered through $SLMVIZ_SAE_DIRS."""
    root = tiny_folder.parent / "transcoders"
    d = tiny.cfg.d_model
    for layer in (0, 1):
        SAE.random(d, d, seed=layer, architecture="relu", hook_name=f"blocks.{layer}.mlp.hook_in",
                   hook_name_out=f"blocks.{layer}.hook_mlp_out").save(root / f"tc_l{layer}")
    return root


@pytest.fixture(scope="module")
def tiny_server(tiny_folder, transcoders):
    with app_server(env={"SLMVIZ_SAE_DIRS": str(transcoders)}, model=str(tiny_folder),
                    allow_local_models=True) as url:
        yield url


@pytest.fixture(scope="module")
def graph(tiny, transcoders):
    """The same graph in this process, pruned as the app prunes it by default."""
    tcs = [load_sae(transcoders / name, model=tiny) for name in NAMES]
    return slmviz.attribution_graph(PROMPT, transcoders=tcs, model=tiny, progress=False).prune(0.95, 0.98)


def built(server) -> Client:
    client = Client(server, verbose=False)
    client.predict(PROMPT, NAMES, 0.95, 0.98, api_name="/graph_attribution")
    return client


def views(client, result) -> dict:
    """A change's subgraph, status and table, then the graph plot and the JSON that /workbench_views redraws after
    it (chained in the page)."""
    sub_plot, status, table = result[:3]
    graph_plot, path = client.predict(0.95, 0.98, api_name="/workbench_views")
    return {"graph": json.loads(graph_plot["plot"]), "subgraph": json.loads(sub_plot["plot"]), "status": status,
            "table": table["data"], "json": json.loads(Path(path).read_text(encoding="utf-8"))}


def test_the_workbench_endpoints_are_named(tiny_server):
    names = set(Client(tiny_server, verbose=False).view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/workbench_card", "/workbench_pin", "/workbench_clear", "/workbench_pin_top", "/workbench_supernode",
            "/workbench_label", "/workbench_load", "/workbench_intervene", "/workbench_views"} <= names


def test_cards_pins_subgraph_supernode_and_labels_match_the_library(tiny_server, graph):
    client = built(tiny_server)
    from slmviz.graphs.workbench import top_features

    top = top_features(graph, 3)
    # a feature's card: kind, position, activation, label, logit effects, its edges
    card, label = client.predict(top[0], 0.95, 0.98, api_name="/workbench_card")
    assert top[0] in card and "activation" in card and "Logit effects, promoted" in card
    assert "Strongest incoming edges" in card and "Strongest outgoing edges" in card
    assert label == graph.label(top[0]) and label.startswith("[auto] ")
    # an error node's card: its norm and the transcoder that misses it
    features = set(graph.nodes.loc[graph.nodes.kind == "feature", "node_id"])
    # (circuit-tracer's error id "0_{layer}_{pos}" can equal a layer-0 feature's "0_{feature}_{pos}": the feature
    # keeps it, so the card of such an error node is not reachable by id; pick one that is)
    error = [n for n in graph.kept_nodes.loc[graph.kept_nodes.kind == "error", "node_id"] if n not in features][-1]
    card, _ = client.predict(error, 0.95, 0.98, api_name="/workbench_card")
    assert "Norm" in card and "tc_l" in card and "misses" in card
    # pin three: the subgraph shows three, with the library's scores
    for node in top:
        got = views(client, client.predict(node, 0.95, 0.98, api_name="/workbench_pin"))
    graph.clear_pins()
    graph.pin(*top)
    sg = graph.subgraph()
    assert len(sg.nodes) == 3
    shown = [t for t in got["subgraph"]["data"] if t.get("mode") == "markers+text"]
    assert sum(len(t["customdata"]) for t in shown) == 3
    assert f"{sg.scores['replacement']:.3f}" in got["status"] and f"{sg.scores['completeness']:.3f}" in got["status"]
    assert got["json"]["qParams"]["pinnedIds"] == top
    # a supernode of the first two: in the downloaded JSON, one node in the subgraph
    got = views(client, client.predict("story", "", 0.95, 0.98, api_name="/workbench_supernode"))
    assert got["json"]["qParams"]["supernodes"] == [["story", *top]]
    graph.supernode("story")
    assert graph.subgraph().nodes["node_id"].tolist() == ["story"]
    # an edited label: in the table, the card and the JSON's clerp
    *got, card = client.predict(top[1], "says w4", 0.95, 0.98, api_name="/workbench_label")
    got = views(client, got)
    assert "says w4" in card
    assert {n["node_id"]: n["clerp"] for n in got["json"]["nodes"]}[top[1]] == "says w4"
    assert [r for r in got["table"] if r[0] == top[1]][0][5] == "says w4"
    graph.clear_pins()


def test_interventions_show_one_table_of_the_top_tokens_with_their_change(tiny_server, graph):
    """Issue 52: one table, not two side by side: each top token (of the run before or after) with its
    probability and logit before and after, and the change of each."""
    client = built(tiny_server)
    from slmviz.graphs.workbench import top_features

    (node,) = top_features(graph, 1)
    result = client.predict("", node, "0", 0, "constrained", api_name="/workbench_intervene")
    assert result.count("<table") == 1 and "<th>change</th>" in result and "<th>logit change</th>" in result
    assert "Greedy continuation, original" in result and "with the edit" in result
    expected = intervene(graph, {node: 0}, constrained=True)
    p0, p1 = expected.original.softmax(-1), expected.logits.softmax(-1)
    top = expected.top(3)
    for token, prob in zip(top["new token"], top["new prob"], strict=True):
        assert f"{prob:.3f}" in result and html.escape(repr(token)) in result
    for tid in p1.topk(3).indices.tolist():  # each row's change is the new probability less the old
        change = float(p1[tid] - p0[tid])
        assert f"{change:+.3f}".replace("-", "−") in result
    free = client.predict(node, "", "number", 1.5, "free", api_name="/workbench_intervene")
    assert f"{node} = 1.5" in free and "(free" in free


def test_bad_input_is_a_readable_error_and_keeps_the_state(tiny_server, graph, tmp_path):
    client = built(tiny_server)
    from slmviz.graphs.workbench import top_features

    top = top_features(graph, 2)
    state = views(client, client.predict(top[0], 0.95, 0.98, api_name="/workbench_pin"))
    client.predict("kept", top[0], 0.95, 0.98, api_name="/workbench_supernode")
    before = views(client, client.predict(top[1], "mine", 0.95, 0.98, api_name="/workbench_label")[:3])["json"]
    assert before["qParams"]["supernodes"] == [["kept", top[0]]]
    bad = [
        (("9_9_99", 0.95, 0.98), "/workbench_pin", "not a node of this graph"),
        (("", "", 0.95, 0.98), "/workbench_supernode", "needs a name"),
        (("kept", top[1], 0.95, 0.98), "/workbench_supernode", "already a supernode named"),
        (("empty", "nope_1_2", 0.95, 0.98), "/workbench_supernode", "not a node"),
        (("", top[0], "number", None, "constrained"), "/workbench_intervene", "Type the number"),
        ((graph.nodes.loc[graph.nodes.kind == "embedding", "node_id"].iloc[1], "", "0", 0, "free"),
         "/workbench_intervene", "only feature nodes"),
        ((0, 0.95, 0.98), "/workbench_pin_top", "at least 1|less than minimum value 1"),
    ]
    for args, api, match in bad:
        with pytest.raises(AppError, match=match):
            client.predict(*args, api_name=api)
    unchanged = views(client, client.predict(top[1], "mine", 0.95, 0.98, api_name="/workbench_label")[:3])["json"]
    assert unchanged["qParams"] == before["qParams"]
    # a JSON of another prompt (same model and transcoders) is refused too
    other = tmp_path / "other.json"
    other_json = json.loads(json.dumps(before))
    other_json["metadata"]["prompt_tokens"] = ["w1"]
    other.write_text(json.dumps(other_json))
    with pytest.raises(AppError, match="another prompt"):
        client.predict(handle_file(str(other)), 0.95, 0.98, api_name="/workbench_load")
    wrong_model = tmp_path / "model.json"
    other_json = json.loads(json.dumps(before))
    other_json["metadata"]["info"]["model"] = "SmolLM2-135M-Instruct"
    wrong_model.write_text(json.dumps(other_json))
    with pytest.raises(AppError, match="made for the model"):
        client.predict(handle_file(str(wrong_model)), 0.95, 0.98, api_name="/workbench_load")
    unchanged = views(client, client.predict(top[1], "mine", 0.95, 0.98, api_name="/workbench_label")[:3])["json"]
    assert unchanged["qParams"] == before["qParams"]
    after = views(client, client.predict(0.95, 0.98, api_name="/workbench_clear"))  # clear: then load the good one back
    assert after["json"]["qParams"]["pinnedIds"] == []
    saved = tmp_path / "good.json"
    saved.write_text(json.dumps(before))
    loaded = views(client, client.predict(handle_file(str(saved)), 0.95, 0.98, api_name="/workbench_load"))["json"]
    assert loaded["qParams"] == before["qParams"]
    assert {n["node_id"]: n["clerp"] for n in loaded["nodes"]}[top[1]] == "mine"
    assert state["json"]["qParams"]["pinnedIds"] == [top[0]]
