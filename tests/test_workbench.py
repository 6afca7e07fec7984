"""The attribution-graph workbench (slmviz.graphs.workbench and slmviz.graphs.intervene): interventions, pins,
the subgraph and its scores, supernodes, labels, and the JSON's qParams / clerp.

Checked against references that share no code with what they check: the graph's own adjacency (an intervention in
constrained mode must move each logit by what the graph's linear model predicts, computed here from the edges), a
hand-written hook in a plain `trace(saes=...)` (free mode), a merged adjacency written out element by element and
the closed form w·((I - Â)⁻¹ - I) of influence (subgraph scores), and the scan's own top examples (labels).
Not covered here: the app (tests/test_workbench_app.py, tests/test_workbench_browser.py), cross-layer transcoders,
circuit-tracer's own viewer opening the JSON (bench/).
"""

from __future__ import annotations

import ast
import json
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import slmviz
from slmviz.features.labels import AUTO, in_context
from slmviz.features.sae import SAE
from slmviz.graphs.attribution import AttributionGraph, attribution_graph
from slmviz.graphs.derived import kept_adjacency, node_index, node_influence
from slmviz.graphs.intervene import InterventionError, ThresholdCrossed, intervene
from slmviz.graphs.subgraph import merged_adjacency, subgraph_scores
from slmviz.graphs.view import drawn_mask, graph_view
from slmviz.graphs.workbench import Workbench, WorkbenchError
from slmviz.plots.subgraph import workbench_figure

PROMPT = "w3 w5 w7 w9 w11 w4"
FAMILIES = ["llama_gqa", "llama_bias", "gemma3", "qwen3", "olmo2"]


def transcoder(model, layer: int, seed: int = 0, skip: bool = False, scale: float = 0.1) -> SAE:
    d = model.cfg.d_model
    return SAE.random(d, d, seed=seed, architecture="relu", skip=skip, scale=scale,
                      hook_name=f"blocks.{layer}.mlp.hook_in", hook_name_out=f"blocks.{layer}.hook_mlp_out")


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in FAMILIES}


@pytest.fixture(scope="module")
def graphs(models):
    """One graph per family over transcoders at every layer (skip transcoders on llama_bias), built once."""
    out = {}
    for arch, m in models.items():
        tcs = [transcoder(m, L, seed=L, skip=arch == "llama_bias") for L in range(m.cfg.n_layers)]
        out[arch] = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=64, progress=False)
    return out


def fresh(g: AttributionGraph) -> AttributionGraph:
    """The graph with no pins, supernodes or edited labels (module fixtures are shared between tests)."""
    g.clear_pins()
    g.user_labels.clear()
    return g


def demeaned_change(g, r) -> torch.Tensor:
    """What moved of each of the graph's logit targets: Δlogit - mean(Δlogit) (a target is a demeaned logit)."""
    m = g.model
    new, old = r.logits.double(), r.original.double()
    cap = m.cfg.final_logit_softcap
    if cap is not None:  # the graph's logits are before the softcap
        new, old = (torch.atanh(x / cap) * cap for x in (new, old))
    delta = new - old
    delta = delta - delta.mean()
    toks = g.nodes.loc[g.nodes["kind"] == "logit", "feature"].to_numpy()
    return delta[toks].float()


def linear_prediction(g, node: str) -> torch.Tensor:
    """Zeroing feature `node` in the graph's linear model: each later feature's activation moves by its incoming
    edges per unit of each source's activation times that source's move (in layer order: the sum over paths), and
    each logit target by its edges the same way."""
    nodes = g.nodes
    kinds = nodes["kind"].to_numpy()
    feats = np.nonzero(kinds == "feature")[0]
    logits = np.nonzero(kinds == "logit")[0]
    act = torch.tensor(nodes["activation"].to_numpy()[feats], dtype=torch.float64)
    per_unit = g.adjacency.double()[:, feats] / act[None, :]  # [n_nodes, n_feat]; features come in layer order
    i = int(np.nonzero(nodes["node_id"].to_numpy() == node)[0][0])
    move = torch.zeros(len(feats), dtype=torch.float64)
    move[i] = -act[i]
    layer = nodes["layer"].to_numpy()
    for j in np.argsort(layer[feats], kind="stable"):
        if layer[j] > layer[i]:
            move[j] = per_unit[j] @ move
    return (per_unit[logits] @ move).float()


def direct_prediction(g, node: str) -> torch.Tensor:
    i = int(np.nonzero(g.nodes["node_id"].to_numpy() == node)[0][0])
    logits = np.nonzero(g.nodes["kind"].to_numpy() == "logit")[0]
    return -g.adjacency[logits, i]


# --- interventions ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILIES)
def test_zeroing_a_last_layer_feature_moves_each_logit_by_exactly_its_edge(graphs, arch):
    """Constrained: the feature's edge into each logit target is what zeroing it moves that (demeaned) logit by,
    to fp32 rounding; tried on the three last-layer features at the last position with the largest edges."""
    g = graphs[arch]
    nodes = g.nodes
    last = nodes[(nodes["kind"] == "feature") & (nodes["layer"] == g.n_layers - 1)
                 & (nodes["position"] == len(g.tokens) - 1)]
    assert len(last) >= 3
    logits = np.nonzero(nodes["kind"].to_numpy() == "logit")[0]
    strength = g.adjacency[logits][:, last.index.to_numpy()].abs().sum(0).numpy().copy()
    for node in last["node_id"].to_numpy()[np.argsort(-strength)[:3]]:
        r = intervene(g, {node: 0})
        assert r.crossed == []  # nothing reads a last-layer feature but the logits
        got, expected = demeaned_change(g, r), direct_prediction(g, node)
        assert expected.abs().max() > 1e-3
        assert torch.allclose(got, expected, atol=2e-5 * max(1.0, float(r.original.abs().max())), rtol=0), \
            (node, (got - expected).abs().max())


@pytest.mark.parametrize("arch", FAMILIES)
def test_zeroing_an_earlier_feature_moves_each_logit_by_the_sum_over_paths(graphs, arch):
    """Constrained, a layer-0 feature: the logits move by the sum over paths through the later features' edges
    per unit of their activation (not by its direct edges alone), while no feature crosses its threshold. Tried on
    the layer-0 features whose paths through later features matter most, until one crosses nothing; every one
    that crosses nothing on the way must match too."""
    g = graphs[arch]
    nodes = g.nodes
    first = nodes[(nodes["kind"] == "feature") & (nodes["layer"] == 0)]["node_id"]
    predictions = {n: linear_prediction(g, n) for n in first}
    paths = {n: float((predictions[n] - direct_prediction(g, n)).abs().max()) for n in first}
    tried = 0
    for node in sorted(paths, key=lambda n: -paths[n]):
        r = intervene(g, {node: 0})
        if r.crossed:
            continue
        got, expected = demeaned_change(g, r), predictions[node]
        tol = 2e-5 * max(1.0, float(r.original.abs().max()))
        assert torch.allclose(got, expected, atol=tol, rtol=0), (node, (got - expected).abs().max())
        tried += 1
        if paths[node] > 10 * tol:
            return  # a feature whose paths through later features matter, and they are counted exactly
    pytest.fail(f"no layer-0 feature crossed nothing with paths that matter ({tried} crossed nothing)")


def test_a_feature_that_crosses_its_threshold_is_named(graphs):
    """Setting a layer-0 feature to 200x its activation turns later features on or off: the result names them, and
    g.intervene warns with their ids."""
    g = graphs["llama_gqa"]
    node = g.nodes[(g.nodes["kind"] == "feature") & (g.nodes["layer"] == 0)]["node_id"].iloc[-1]
    r = intervene(g, {node: "200x"})
    assert r.crossed and all(c.split()[0].startswith("1_") and c.split()[1] in ("on", "off") for c in r.crossed)
    with pytest.warns(ThresholdCrossed, match=r.crossed[0].split()[0]):
        logits = g.intervene({node: "200x"})
    assert logits.shape == (g.model.cfg.vocab_size,)
    assert torch.equal(logits, r.logits)


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3"])
def test_free_mode_equals_a_hand_written_hook_in_a_plain_trace(graphs, arch):
    """Free: the same logits as a trace of the graph's token ids with every transcoder spliced in and one hook
    fn setting hook_sae_acts_post at the node's position and feature."""
    g = graphs[arch]
    m = g.model
    row = g.nodes[g.nodes["kind"] == "feature"].iloc[len(g.nodes) // 7]
    saes = list(g.transcoders)

    def hook(x, name):
        x = x.clone()
        x[int(row.position), int(row.feature)] = 2 * float(row.activation)
        return x

    edit = {f"{row.hook}.hook_sae_acts_post": hook}
    expected = m.trace(g.input_ids, saes=saes, hooks=edit, names=[]).logits[-1]  # capture off, as intervene runs
    got = g.intervene({row.node_id: "2x"}, constrained=False)
    assert got.shape == (m.cfg.vocab_size,) and torch.equal(got, expected)
    # a trace capturing every hook computes attention through the explicit pattern: equal to float rounding
    captured = m.trace(g.input_ids, saes=saes, hooks=edit).logits[-1]
    assert torch.allclose(got, captured, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, m.logits(g.input_ids)[-1], atol=1e-4)  # the edit did move the logits
    r = intervene(g, {row.node_id: 2 * float(row.activation)}, constrained=False, continuation=3)
    assert torch.equal(r.logits, got)
    assert torch.equal(r.original, m.logits(g.input_ids)[-1])
    assert isinstance(r.continuation, str) and isinstance(r.original_continuation, str)
    top = r.top(5)
    assert list(top.columns) == ["rank", "token", "logit", "prob", "new token", "new logit", "new prob"]


def test_values_multiples_and_supernodes(graphs):
    """"0", "-1x", "2x" and numbers are activations; a supernode sets each of its feature members."""
    g = fresh(graphs["llama_gqa"])
    feats = g.nodes[g.nodes["kind"] == "feature"]
    a, b = feats["node_id"].iloc[3], feats["node_id"].iloc[9]
    act_a = float(feats["activation"].iloc[3])
    assert intervene(g, {a: "-1x"}).values == {a: pytest.approx(-act_a)}
    assert intervene(g, {a: "−1×"}).values == {a: pytest.approx(-act_a)}
    assert intervene(g, {a: 1.5}).values == {a: 1.5}
    g.supernode("pair", [a, b])
    assert set(intervene(g, {"pair": "0"}).values) == {a, b}
    both = intervene(g, {"pair": 0})
    assert torch.equal(both.logits, intervene(g, {a: 0, b: 0}).logits)


def test_bad_intervention_input_gets_a_clear_error(graphs):
    g = fresh(graphs["llama_gqa"])
    feat = g.nodes[g.nodes["kind"] == "feature"]["node_id"].iloc[0]
    error = g.nodes[g.nodes["kind"] == "error"]["node_id"].iloc[-1]
    for value in (float("nan"), float("inf"), "many", "nanx"):
        with pytest.raises(InterventionError, match="finite number|a number"):
            g.intervene({feat: value})
    with pytest.raises(InterventionError, match="error node; only feature nodes"):
        g.intervene({error: 0})
    with pytest.raises(WorkbenchError, match="not a node of this graph"):
        g.intervene({"9_9_99": 0})
    with pytest.raises(InterventionError, match="at least one"):
        g.intervene({})
    assert issubclass(InterventionError, ValueError) and issubclass(WorkbenchError, ValueError)


# --- pins, subgraph, supernodes ---------------------------------------------------------------------------------
def hand_graph() -> AttributionGraph:
    """2 layers x 2 positions: features f0, f1 at (layer 0, position 1) and f2 at (layer 1, position 1); error
    nodes e(L, p); embeddings E0, E1; one logit. Every weight chosen by hand."""
    rows = [("0_0_1", "feature", 0, 1, 0), ("0_1_1", "feature", 0, 1, 1), ("1_2_1", "feature", 1, 1, 2)]
    rows += [(f"0_{L}_{p}", "error", L, p, -1) for L in range(2) for p in range(2)]
    rows += [("E_5_0", "embedding", -1, 0, 5), ("E_6_1", "embedding", -1, 1, 6), ("3_7_1", "logit", 2, 1, 7)]
    nodes = pd.DataFrame([{"node_id": r[0], "kind": r[1], "layer": r[2], "position": r[3], "feature": r[4],
                           "activation": 1.0 if r[1] == "feature" else np.nan, "hook": "", "token": "t",
                           "probability": 1.0 if r[1] == "logit" else np.nan} for r in rows])
    n = len(nodes)
    a = torch.zeros(n, n)
    f0, f1, f2, e00, e01, e10, e11, E0, E1, logit = range(n)
    a[f0, E1], a[f0, E0], a[f0, e01] = 2.0, 1.0, 0.5
    a[f1, E1], a[f1, e00] = -1.0, 0.25
    a[f2, f0], a[f2, f1], a[f2, e01], a[f2, E1] = 3.0, 1.0, 0.5, 0.5
    a[logit, f2], a[logit, f0], a[logit, f1], a[logit, e11], a[logit, E1] = 2.0, 1.0, -0.5, 0.5, 0.25
    z = torch.zeros(n)
    return AttributionGraph(prompt="t t", tokens=["t", "t"], input_ids=[5, 6], nodes=nodes, adjacency=a, constant=z,
                            target_values=z, logit_probabilities=torch.tensor([1.0]), n_layers=2)


def scores_by_hand(a: np.ndarray, n_feat: int, n_err: int, n_tok: int) -> dict[str, float]:
    """circuit-tracer's compute_graph_scores written out: influence = w·((I - Â)⁻¹ - I), Â = row-normalised |A|."""
    norm = np.abs(a) / np.maximum(np.abs(a).sum(1, keepdims=True), 1e-10)
    w = np.zeros(len(a))
    w[-1] = 1.0
    influence = w @ (np.linalg.inv(np.eye(len(a)) - norm) - np.eye(len(a)))
    err = influence[n_feat:n_feat + n_err].sum()
    tok = influence[n_feat + n_err:n_feat + n_err + n_tok].sum()
    non_error = 1 - norm[:, n_feat:n_feat + n_err].sum(1)
    weights = influence + w
    return {"replacement": tok / (tok + err), "completeness": (non_error * weights).sum() / weights.sum()}


def test_subgraph_scores_are_neuronpedias_merge_rule_computed_by_hand():
    """Pinning f0 and f2: f1 (unpinned, at layer 0 position 1) merges into error node e(0, 1): its outgoing edges
    are added to that node's and its incoming ones dropped; the scores are the merged graph's."""
    g = hand_graph()
    a = g.adjacency.numpy().astype(np.float64)
    f0, f1, f2, e00, e01, e10, e11, E0, E1, logit = range(10)
    keep = [f0, f2, e00, e01, e10, e11, E0, E1, logit]
    merged = a.copy()
    merged[:, e01] += merged[:, f1]
    merged = merged[np.ix_(keep, keep)]
    assert merged[1, 3] == 0.5 + 1.0  # f2 <- e(0,1): its own 0.5 plus f1's 1.0
    assert merged[-1, 3] == -0.5  # logit <- e(0,1): f1's -0.5
    got_a, rows, n_feat = merged_adjacency(g, ["0_0_1", "1_2_1"])
    assert n_feat == 2 and rows.tolist() == keep
    np.testing.assert_allclose(got_a.numpy(), merged)
    expected = scores_by_hand(merged, 2, 4, 2)
    g.pin("0_0_1", "1_2_1")
    got = g.subgraph().scores
    assert got == pytest.approx(expected, abs=1e-6)
    assert subgraph_scores(g, ["0_0_1", "0_1_1", "1_2_1"]) == pytest.approx(g.scores(), abs=1e-6)  # all pinned
    none = a.copy()  # nothing pinned: every feature merged; only the token's direct edge to the logit is left
    none[:, e01] += none[:, f0] + none[:, f1]
    none[:, e11] += none[:, f2]
    none = none[np.ix_(keep[2:], keep[2:])]
    assert subgraph_scores(g, []) == pytest.approx(scores_by_hand(none, 0, 4, 2), abs=1e-6)


def test_supernode_edges_are_the_sums_of_their_members_edges():
    g = hand_graph()
    g.pin("0_0_1", "0_1_1", "1_2_1", "3_7_1", "E_6_1")
    g.supernode("layer0", ["0_0_1", "0_1_1"])
    sg = g.subgraph()
    assert sg.nodes["node_id"].tolist() == ["layer0", "1_2_1", "3_7_1", "E_6_1"]
    assert sg.nodes.set_index("node_id").loc["layer0", "kind"] == "supernode"
    w = {(s, t): v for s, t, v in sg.links.itertuples(index=False)}
    assert w[("layer0", "1_2_1")] == pytest.approx(3.0 + 1.0)
    assert w[("layer0", "3_7_1")] == pytest.approx(1.0 - 0.5)
    assert w[("E_6_1", "layer0")] == pytest.approx(2.0 - 1.0)
    assert w[("1_2_1", "3_7_1")] == pytest.approx(2.0)
    assert len(sg.plot().data) > 0


def test_pins_and_supernodes_and_their_bad_input(graphs):
    """Pin, unpin, pin the top n by influence, clear; every bad input is a WorkbenchError that changes nothing."""
    g = fresh(graphs["llama_gqa"])
    top = g.pin_top(3)
    assert len(top) == 3 and all(g.nodes.set_index("node_id").loc[n, "kind"] == "feature" for n in top)
    g.supernode("first two", top[:2])
    state = (list(g.pinned), [list(s) for s in g.supernodes])
    for bad in (lambda: g.pin(top[0], "nope"), lambda: g.supernode("", top), lambda: g.supernode("first two", top),
                lambda: g.supernode("empty", []), lambda: g.supernode("unknown", ["x_y_z"]),
                lambda: g.pin_top(0)):
        g.pin(top)  # pinned already: nothing changes
        with pytest.raises(WorkbenchError):
            bad()
        assert (g.pinned, g.supernodes) == state
    g.unpin(top[0])
    assert top[0] not in g.pinned and g.supernodes == [["first two", top[1]]]
    g.clear_pins()
    assert g.pinned == [] and g.supernodes == []
    empty = g.subgraph()  # nothing pinned: an empty subgraph, and a figure that says so
    assert len(empty.nodes) == 0 and len(empty.links) == 0 and "pin nodes" in empty.plot().layout.title.text
    pruned = g.prune(0.9, 0.98)
    pruned.pin(top[2])
    assert g.pinned == [top[2]]  # a pruned copy shares the workbench state


# --- JSON -------------------------------------------------------------------------------------------------------
def test_pins_supernodes_and_labels_survive_save_json_and_load(graphs, tmp_path):
    g = fresh(graphs["llama_gqa"])
    pruned = g.prune(0.95, 0.98)
    top = pruned.pin_top(4)
    pruned.supernode("group", top[:2])
    pruned.label(top[0], "says w30")
    path = pruned.save_json(tmp_path / "g.json")
    data = json.loads(path.read_text())
    assert set(data) == {"metadata", "qParams", "nodes", "links"}
    assert {"slug", "scan", "transcoder_list", "prompt_tokens", "prompt", "node_threshold",
            "schema_version"} <= set(data["metadata"])
    assert {"pinnedIds", "supernodes", "linkType", "clickedId", "sg_pos"} <= set(data["qParams"])
    for node in data["nodes"]:
        assert {"node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob", "is_target_logit", "run_idx",
                "reverse_ctx_idx", "jsNodeId", "clerp", "influence", "activation"} <= set(node)
    assert data["qParams"]["pinnedIds"] == top
    assert data["qParams"]["supernodes"] == [["group", *top[:2]]]
    clerps = {n["node_id"]: n["clerp"] for n in data["nodes"]}
    assert clerps[top[0]] == "says w30"
    assert all(c.startswith(AUTO) for n, c in clerps.items() if n in pruned.labels and n != top[0])

    g.clear_pins()
    g.user_labels.clear()
    g.load_json(path)
    assert g.pinned == top and g.supernodes == [["group", *top[:2]]]
    assert g.label(top[0]) == "says w30" and g.label(top[1]).startswith(AUTO)


def test_a_json_for_another_model_transcoder_set_or_prompt_is_refused_and_nothing_changes(graphs, tmp_path):
    g, other = fresh(graphs["llama_gqa"]), fresh(graphs["qwen3"])
    g.pin_top(2)
    data = g.to_json()
    state = (list(g.pinned), list(g.supernodes), dict(g.user_labels))
    bad_model = json.loads(json.dumps(data))
    bad_model["metadata"]["info"]["model"] = "another-model"
    bad_set = json.loads(json.dumps(data))
    bad_set["metadata"]["transcoder_list"] = ["other->set"]
    bad_prompt = json.loads(json.dumps(data))
    bad_prompt["metadata"]["prompt_tokens"] = ["w1"]
    bad_pin = json.loads(json.dumps(data))
    bad_pin["qParams"]["pinnedIds"] = ["99_1_1"]
    for bad, match in ((other.to_json(), "made for the model"), (bad_model, "made for the model"),
                       (bad_set, "made with the transcoders"), (bad_prompt, "another prompt"),
                       (bad_pin, "not a node"), ("{not json", "Could not read")):
        g.pin_top(2)
        with pytest.raises(WorkbenchError, match=match):
            g.load_json(bad)
        assert (g.pinned, g.supernodes, g.user_labels) == state


# --- labels -----------------------------------------------------------------------------------------------------
def test_labels_come_from_the_scan_and_promoted_tokens_are_deterministic_and_edits_win(models):
    """A feature's automatic label joins its scan's top example in context, its next distinct top token and the
    tokens W_dec·W_U promotes most; the same for the graph and the SAE, the same on a second call; an edited label
    wins over it."""
    m = models["llama_gqa"]
    tc = transcoder(m, 1, seed=5, scale=1.0)
    g = attribution_graph(PROMPT, transcoders=[tc], model=m, progress=False)
    docs = [" ".join(f"w{(7 * i + 3 * j) % 120}" for j in range(12)) for i in range(8)]
    s = slmviz.scan(docs, hooks=[f"{tc.hook_name_out}.hook_sae_acts_post"], top_k=5, model=m, saes=[tc],
                    progress=False)
    g.use_scans({1: s})
    labels = g.labels
    assert labels and all(v.startswith(AUTO) for v in labels.values())
    node = next(iter(labels))
    feature = int(node.split("_")[1])
    top = s.top_examples(f"{tc.hook_name_out}.hook_sae_acts_post", feature)
    fired = list(dict.fromkeys(t.strip() for t in top.loc[top.activation > 0, "token"]))[:2]
    fired[0] = in_context(top.loc[top.activation > 0, "context"].iat[0])  # the top example in a word of context
    promoted = tc.logit_effects(feature, k=2, model=m)
    promoted = promoted.loc[promoted.kind == "promoted", "token"].str.strip().tolist()
    assert labels[node] == f"{AUTO}{' / '.join(fired)} → {' / '.join(promoted)}"
    assert tc.label(feature, scan=s, model=m) == labels[node]
    assert fresh_labels(g) == labels  # deterministic: recomputed from nothing
    g.label(node, "my reading")
    assert g.labels[node] == "my reading" and g.label(node) == "my reading"
    other = [n for n in labels if n != node and n.split("_")[1] == node.split("_")[1]]
    assert all(g.labels[n] == "my reading" for n in other)  # a label belongs to the feature, at every position
    tc.labels[feature + 1 if feature + 1 < tc.d_sae else 0] = "sae edit"
    assert tc.label(feature + 1 if feature + 1 < tc.d_sae else 0) == "sae edit"
    g.label(node, "")
    assert g.labels[node] == labels[node]  # back to automatic
    with pytest.raises(WorkbenchError, match="only features have labels"):
        g.label(g.nodes[g.nodes["kind"] == "error"]["node_id"].iloc[-1], "x")


def fresh_labels(g):
    """g's labels made again on a copy with a new workbench holding g's scans only (no label made so far)."""
    again = replace(g, workbench=Workbench(scans=dict(g.workbench.scans)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return again.labels


def test_a_large_graph_draws_its_most_influential_nodes_first(graphs):
    """Over max_nodes kept nodes, the figure draws the most influential ones, plus every embedding, logit and pin."""
    g = fresh(graphs["llama_gqa"])
    pinned = g.nodes[g.nodes["kind"] == "feature"]["node_id"].iloc[-1]
    g.pin(pinned)
    drawn = drawn_mask(g, 60)
    kinds = g.nodes["kind"].to_numpy()
    assert drawn.sum() == 60 and drawn[np.isin(kinds, ["embedding", "logit"])].all()
    assert drawn[g.nodes.index[g.nodes["node_id"] == pinned][0]]
    influence = node_influence(g).numpy()
    rest = ~np.isin(kinds, ["embedding", "logit"])
    rest[g.nodes.index[g.nodes["node_id"] == pinned][0]] = False
    assert influence[drawn & rest].min() >= influence[~drawn & rest].max()
    fig = workbench_figure(graph_view(g, max_nodes=60))
    assert sum(len(t.customdata) for t in fig.data if t.customdata is not None) == 60
    assert "the top 60 of" in fig.layout.title.text
    g.clear_pins()


# --- the graph holds data, its workbench is one object, figures write nothing -------------------------------------
def test_the_workbench_is_one_object_that_pruned_copies_share_and_the_json_saves(graphs):
    """g.workbench holds every pin, supernode and edited label; a pruned copy carries the same object; a graph with
    a new, empty workbench gets an equal one back from the JSON (and a different object)."""
    g = fresh(graphs["llama_gqa"])
    p = g.prune(0.95, 0.98)
    assert p.workbench is g.workbench
    top = p.pin_top(2)
    p.supernode("both", top)
    p.label(top[0], "mine")
    row = g.nodes.iloc[node_index(g)[top[0]]]
    assert g.workbench == Workbench(pinned=top, supernodes=[["both", *top]],
                                    user_labels={f"{row.layer}_{row.feature}": "mine"})
    other = replace(g, workbench=Workbench())
    assert other.pinned == [] and other.labels[top[0]] != "mine"
    other.load_json(p.to_json())
    assert other.workbench == g.workbench and other.workbench is not g.workbench
    fresh(g)


def test_figures_and_reads_write_nothing_onto_the_graph(graphs):
    """Drawing a graph, its workbench view and its subgraph, and reading its labels, scores and JSON, leave every
    attribute of the graph the object it was: derived values go into the graph's own declared cache only. Not
    covered: what the figures look like (tests/test_workbench_app.py, tests/test_workbench_browser.py)."""
    g = fresh(graphs["llama_gqa"])
    p = g.prune(0.9, 0.98)
    p.pin_top(2)
    before = dict(vars(p))
    p.plot()
    workbench_figure(graph_view(p, p.labels, max_nodes=10))
    p.subgraph().plot()
    p.scores()
    p.to_json()
    assert set(vars(p)) == set(before)
    assert all(vars(p)[k] is v for k, v in before.items())
    fresh(g)


def test_derived_values_are_made_once_and_again_for_new_masks():
    g = hand_graph()
    assert node_index(g) is node_index(g) and node_influence(g) is node_influence(g)
    a = kept_adjacency(g)
    assert kept_adjacency(g) is a and a[:, 0].abs().sum() > 0 and a[0].abs().sum() > 0
    mask = g.node_mask.clone()
    mask[0] = False
    g.node_mask = mask
    b = kept_adjacency(g)
    assert b is not a and b[:, 0].abs().sum() == 0 and b[0].abs().sum() == 0


def test_a_colliding_id_names_the_layer_0_feature():
    """circuit-tracer's ids collide where layer-0 feature f meets the error node of layer L = f at one position: in
    hand_graph "0_1_1" is feature 1 of layer 0 at position 1 and the error node of layer 1 at position 1. The
    feature keeps the id (derived.first_rows), so a pin or a label names the feature."""
    g = hand_graph()
    ids = g.nodes["node_id"].tolist()
    assert ids.count("0_1_1") == 2 and ids.index("0_1_1") == 1 and g.nodes["kind"].iat[1] == "feature"
    assert node_index(g)["0_1_1"] == 1 and node_index(g)["0_0_1"] == 0
    g.pin("0_1_1")
    assert g.subgraph().nodes.set_index("node_id").loc["0_1_1", "kind"] == "feature"
    g.label("0_1_1", "the feature")
    assert g.user_labels == {"0_1": "the feature"}


def test_plots_import_nothing_from_graphs():
    """A figure draws what it is given: no module of slmviz.plots imports slmviz.graphs (at any depth), so no graph
    maths runs in a plot and no plot writes a cache onto a graph."""
    plots = Path(slmviz.__file__).parent / "plots"
    for path in sorted(plots.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                names = ["." * node.level + (node.module or "")]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            assert not any("graphs" in n.split(".") for n in names), (path.name, names)
