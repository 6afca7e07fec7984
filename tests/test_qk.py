"""QK attribution (slmviz.graphs.qk): an attention score split over pairs of an attribution graph's nodes.

Checked against computations that share nothing with the decomposition's backward: the model's own run
(hook_attn_scores, hook_rot_q, hook_rot_k of a plain trace) and a constrained forward written out here as
graphs/intervene.py runs it (the model with every transcoder spliced, attention patterns, norm scales, error terms
and the MLP outputs of layers without a transcoder at the prompt's values) with, beyond it, every feature's
activation held, so that the run is the graph's linear model (its edges are direct effects). Zeroing a node there
and reading hook_attn_scores gives the causal check; zeroing every node gives the bias node's own propagation.
Not covered here: bf16 models, the GPU (tests/test_cuda.py), the worked example's figures (bench/studies).
"""

from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest
import torch

import slmviz
from slmviz.features.sae import SAE
from slmviz.graphs.attribution import attribution_graph
from slmviz.graphs.frozen import AttributionGraphError, frozen_names
from slmviz.graphs.qk import OTHER_PAIRS, QKAttributionError, qk_attribution
from slmviz.replacement.clt import CrossLayerTranscoder

PROMPT = [1, 3, 5, 7, 9, 11, 4, 8]  # token ids, starting with the tiny tokenizer's special w1 (no other is prepended)
# GQA, MHA, MQA, Qwen2's q/k biases (and LLaMA's attention_bias), an explicit head_dim, a sliding window, the
# QK-norm families (Qwen3 per head, OLMo-2 per projection), Gemma's scaling, norms and RoPE bases, RoPE scalings.
ARCHS = ["llama_gqa", "llama_mha", "llama_mqa_tied", "llama_bias", "llama_head_dim", "llama3", "qwen2",
         "mistral_window", "gemma3", "qwen3", "olmo2"]


def transcoders(model, skip: bool = True, every_layer: bool = False, seed: int = 0) -> list[SAE]:
    """Random relu transcoders at every layer but the last (all error there), or at every layer."""
    d, n = model.cfg.d_model, model.cfg.n_layers
    return [SAE.random(d, d, seed=seed + L, architecture="relu", skip=skip, hook_name=f"blocks.{L}.mlp.hook_in",
                       hook_name_out=f"blocks.{L}.hook_mlp_out") for L in range(n if every_layer else n - 1)]


@pytest.fixture(scope="module")
def models():
    """The tiny models loaded so far, {arch: model} (load fills it)."""
    return {}


def load(models, tiny_dirs, arch):
    if arch not in models:
        models[arch] = slmviz.load(tiny_dirs[arch])
    return models[arch]


@pytest.fixture(scope="module")
def graphs(models, tiny_dirs):
    """One graph per family, built once: {arch: graph}."""
    cache = {}

    def get(arch: str, every_layer: bool = False):
        if (arch, every_layer) not in cache:
            m = load(models, tiny_dirs, arch)
            cache[arch, every_layer] = attribution_graph(PROMPT, transcoders=transcoders(m, every_layer=every_layer),
                                                         model=m, progress=False)
        return cache[arch, every_layer]
    return get


def unmasked_entries(model, n_pos: int, k: int, seed: int) -> list[tuple[int, int, int, int]]:
    """k random (layer, head, query, key) entries with key <= query (inside a sliding window where there is one)."""
    rng = random.Random(seed)
    cfg = model.cfg
    out = []
    while len(out) < k:
        layer, head = rng.randrange(cfg.n_layers), rng.randrange(cfg.n_heads)
        query = rng.randrange(1, n_pos)
        key = rng.randrange(0, query + 1)
        window = cfg.sliding_window if cfg.layer_type(layer) == "sliding_attention" else None
        if window is None or query - key < window:
            out.append((layer, head, query, key))
    return out


# --- the graph's linear model, written out as intervene.py's constrained run -----------------------------------
def coders_of(graph) -> dict:
    ts = graph.transcoders
    return dict(getattr(ts, "coders", ts))


def frozen_run(graph, names: list[str], edits: dict | None = None):
    """The model's own forward (model.trace, every transcoder spliced) with intervene.py's constrained freezing and
    every feature's activation held at the prompt's; `edits` {hook name: fn(x, name)} run after the freezing. A trace
    of `names`."""
    m = graph.model
    coders = coders_of(graph)
    saes = list(coders.values())
    acts = [f"{sae.hook_name_out}.hook_sae_acts_post" for sae in saes]
    held = [*frozen_names(m.hook_names), *[f"{sae.hook_name_out}.hook_sae_error" for sae in saes],
            *[f"blocks.{L}.hook_mlp_out" for L in range(m.cfg.n_layers) if L not in coders], *acts]
    ids = torch.tensor(graph.input_ids)
    with torch.inference_mode():
        before = m.trace(ids, saes=saes, names=held)
        keep = {n: before[n].clone() for n in held}
        hooks: dict = {n: [lambda x, name: keep[name]] for n in held}
        for n, fn in (edits or {}).items():
            hooks.setdefault(n, []).append(fn)
        return m.trace(ids, saes=saes, names=names, hooks=hooks)


def zeroing(graph, kind: str, node_id: str, factor: float = 0.0, merged: bool = False) -> dict:
    """The edit that removes one node's write in frozen_run (or multiplies it by `factor`): a feature's activation,
    an error term, an embedding. (By kind and id: a layer-0 feature's id 0_f_p can be an error node's 0_L_p too, as
    in circuit-tracer.) `merged`: an error node stands for the features the graph does not keep at its layer and
    position too (a QK attribution's error nodes), so those features' activations go with it."""
    nodes = graph.nodes
    row = nodes[(nodes["node_id"] == node_id) & (nodes["kind"] == kind)].iloc[0]
    pos, layer = int(row.position), int(row.layer)

    def at(index, keep=()):
        def fn(x, name):
            x = x.clone()
            if keep is None:
                x[index] = x[index] * factor
            else:  # every feature at the position but the kept ones
                scaled = x[index] * factor
                scaled[list(keep)] = x[index][list(keep)]
                x[index] = scaled
            return x
        return fn

    if kind == "embedding":
        return {"hook_embed": at(pos, None)}
    coders = coders_of(graph)
    if kind == "error":
        if layer not in coders:
            return {f"blocks.{layer}.hook_mlp_out": at(pos, None)}
        out = {f"{coders[layer].hook_name_out}.hook_sae_error": at(pos, None)}
        if merged:
            kept = graph.kept_nodes
            keep = kept.loc[(kept["kind"] == "feature") & (kept["layer"] == layer) & (kept["position"] == pos),
                            "feature"].astype(int).tolist()
            out[f"{coders[layer].hook_name_out}.hook_sae_acts_post"] = at(pos, keep)
        return out
    return {f"{coders[layer].hook_name_out}.hook_sae_acts_post": at((pos, int(row.feature)), None)}


def tolerance(qk, *values: float) -> float:
    """fp32 rounding of a score whose vectors have the norms of the query and key vectors (and of `values`)."""
    size = qk.scale * float(qk.query_vectors.sum(0).norm() * qk.key_vectors.sum(0).norm())
    return 3e-5 * (size + sum(abs(v) for v in values)) + 1e-6


# --- exactness -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_pairs_sum_to_the_models_own_attention_score(graphs, arch):
    """For random heads and entries of every family, the pairs' contributions sum to the model's own
    hook_attn_scores (fp32 rounding), and each side's vectors sum to the model's own hook_rot_q / hook_rot_k at
    that position: RoPE at each side's position, the QK-norm, GQA's KV head and the score's scale are the model's."""
    g = graphs(arch)
    m = g.model
    n_pos = len(g.input_ids)
    entries = unmasked_entries(m, n_pos, 3, seed=len(arch))
    for layer, head, query, key in entries:
        qk = qk_attribution(g, layer=layer, head=head, query=query, key=key)
        names = [f"blocks.{layer}.attn.hook_{x}" for x in ("attn_scores", "pattern", "rot_q", "rot_k")]
        t = m.trace(torch.tensor(g.input_ids), names=names)
        assert qk.score == t[names[0]][head, query, key].item() and qk.pattern == t[names[1]][head, query, key].item()
        total = qk.pairs["contribution"].sum()
        assert abs(total - qk.score) <= tolerance(qk), (arch, layer, head, query, key, total, qk.score)
        assert total == pytest.approx(qk.linear_score, rel=1e-9, abs=1e-9)
        kv = head // (m.cfg.n_heads // m.cfg.n_kv_heads)
        assert qk.kv_head == kv
        for vectors, want in ((qk.query_vectors, t[names[2]][query, head]), (qk.key_vectors, t[names[3]][key, kv])):
            assert torch.allclose(vectors.sum(0).float(), want, atol=2e-5 * float(want.abs().max()) + 1e-6)
        # each side sums to the score too, and nodes at later positions have no part in it
        assert qk.query_side["contribution"].sum() == pytest.approx(total, rel=1e-9, abs=1e-9)
        assert qk.key_side["contribution"].sum() == pytest.approx(total, rel=1e-9, abs=1e-9)
        assert (qk.query_side["position"] <= query).all() and (qk.key_side["position"] <= key).all()
        assert set(qk.query_side["kind"]) <= {"feature", "error", "embedding", "bias"}
        assert not (qk.query_side["layer"] >= layer).any() and not (qk.key_side["layer"] >= layer).any()


def test_a_cross_layer_transcoders_graph_splits_its_scores_exactly(models, tiny_dirs):
    """A CLT (features writing every later layer) gives the same identity; its writes count towards one node."""
    m = load(models, tiny_dirs, "llama_gqa")
    clt = CrossLayerTranscoder.random(m.cfg.n_layers, m.cfg.d_model, 48, seed=3, architecture="relu", skip=True)
    g = attribution_graph(PROMPT, transcoders=clt, model=m, progress=False)
    qk = qk_attribution(g, layer=1, head=2, query=-1, key=3)
    assert abs(qk.pairs["contribution"].sum() - qk.score) <= tolerance(qk)
    check_zeroing(g, qk, side_nodes(qk.query_side, "feature", 2) + side_nodes(qk.key_side, "error", 1))


# --- causal: zeroing a node in the constrained model --------------------------------------------------------------
def check_zeroing(g, qk, nodes: list[tuple[str, str]]) -> None:
    """Zeroing each node (kind, node_id) in frozen_run moves hook_attn_scores by −(its query-side sum + its key-side
    sum) + its pair with itself."""
    name = f"blocks.{qk.layer}.attn.hook_attn_scores"
    base = frozen_run(g, [name])[name][qk.head, qk.query, qk.key].item()
    index = {(k, n): i for i, (k, n) in enumerate(zip(qk.nodes["kind"], qk.nodes["node_id"], strict=True))}
    q_side, k_side = (dict(zip(zip(side["kind"], side["node"], strict=True), side["contribution"], strict=True))
                      for side in (qk.query_side, qk.key_side))
    assert nodes
    for kind, nid in nodes:
        assert kind != "bias"
        i = index[kind, nid]
        self_pair = qk.scale * float(qk.query_vectors[i] @ qk.key_vectors[i])
        predicted = -(q_side.get((kind, nid), 0.0) + k_side.get((kind, nid), 0.0)) + self_pair
        moved = frozen_run(g, [name], zeroing(g, kind, nid, merged=True))[name][qk.head, qk.query, qk.key].item()
        moved -= base
        assert abs(moved - predicted) <= tolerance(qk, moved), (kind, nid, moved, predicted)


def side_nodes(side, kind: str, n: int) -> list[tuple[str, str]]:
    return [(kind, nid) for nid in side.loc[side["kind"] == kind, "node"].head(n)]


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2", "gemma3", "qwen3", "olmo2"])
def test_zeroing_a_node_moves_the_score_by_exactly_its_bilinear_terms(graphs, arch):
    """Features, errors and embeddings on both sides (one at the key's own position, which is on both sides)."""
    g = graphs(arch)
    layer = g.model.cfg.n_layers - 1
    query, key = len(g.input_ids) - 1, 3
    if g.model.cfg.layer_type(layer) == "sliding_attention":
        key = query - 2
    qk = qk_attribution(g, layer=layer, head=1, query=query, key=key)
    picks = [node for side in (qk.query_side, qk.key_side) for kind in ("feature", "error", "embedding")
             for node in side_nodes(side, kind, 2)]
    at_key = qk.nodes[(qk.nodes["kind"] == "feature") & (qk.nodes["position"] == key)]
    picks.append(("feature", at_key["node_id"].iat[0]))  # a node on both sides: its pair with itself counts
    check_zeroing(g, qk, list(dict.fromkeys(picks)))


def test_the_bias_node_is_what_the_biases_alone_propagate(graphs):
    """The bias node's vectors (the whole minus every node, as computed) equal the query and key vectors of the
    constrained run with every node removed (embeddings, every feature's activation and every error term zeroed, at
    every position), and the (bias, bias) pair is that run's own hook_attn_scores. On a family with attention and MLP
    biases and a layer without a transcoder. Position 0's features and error, which the graph (zero_bos) leaves out
    of its edges, are in the error nodes at position 0 (sources.score_sources), not in the bias."""
    g = graphs("llama_bias")
    m = g.model
    layer, head, query, key = 1, 3, len(g.input_ids) - 1, 0  # the key at the attention sink
    qk = qk_attribution(g, layer=layer, head=head, query=query, key=key)

    def zeros(x, name):
        return torch.zeros_like(x)

    coders = coders_of(g)
    edits = {"hook_embed": zeros}
    for L in range(m.cfg.n_layers):
        if L in coders:
            edits[f"{coders[L].hook_name_out}.hook_sae_acts_post"] = zeros
            edits[f"{coders[L].hook_name_out}.hook_sae_error"] = zeros
        else:
            edits[f"blocks.{L}.hook_mlp_out"] = zeros
    assert len(coders) < m.cfg.n_layers and g.zero_bos
    names = [f"blocks.{layer}.attn.hook_{x}" for x in ("attn_scores", "rot_q", "rot_k")]
    t = frozen_run(g, names, edits)
    kinds = qk.nodes["kind"].to_numpy()
    bias = int(np.nonzero(kinds == "bias")[0][0])
    assert torch.allclose(qk.query_vectors[bias].float(), t[names[1]][query, head], atol=1e-5, rtol=1e-4)
    assert torch.allclose(qk.key_vectors[bias].float(), t[names[2]][key, qk.kv_head], atol=1e-5, rtol=1e-4)
    pair = qk.pairs[(qk.pairs["query_node"] == "bias") & (qk.pairs["key_node"] == "bias")]["contribution"].item()
    assert pair == pytest.approx(t[names[0]][head, query, key].item(), rel=1e-4, abs=1e-5)
    assert qk.query_vectors[bias].abs().max() > 1e-3  # the biases are there to see
    # position 0's error node carries what the graph's edges leave out there
    at_zero = (kinds == "error") & (qk.nodes["position"].to_numpy() == 0) & (qk.nodes["layer"].to_numpy() == 0)
    row = int(np.nonzero(at_zero)[0][0])
    assert qk.key_vectors[row].abs().max() > 1e-4
    column = g.nodes.index[(g.nodes["kind"] == "error") & (g.nodes["layer"] == 0) & (g.nodes["position"] == 0)][0]
    assert (g.adjacency[:, column] == 0).all()


# --- pruned graphs: merged features --------------------------------------------------------------------------------
def test_pruned_features_merge_into_the_error_node_of_their_layer_and_position(graphs):
    """On a pruned graph, each error node's vector is its own plus those of the features the graph dropped at its
    layer and position (full=True lists them); kept features keep theirs; the sum is the same; labels are the
    graph's."""
    g = graphs("llama_gqa", every_layer=True).prune(node_threshold=0.9, edge_threshold=0.98)
    kept = set(g.kept_nodes.loc[g.kept_nodes["kind"] == "feature", "node_id"])
    merged = qk_attribution(g, layer=1, head=0, query=-1, key=2)
    full = qk_attribution(g, layer=1, head=0, query=-1, key=2, full=True)
    assert merged.pairs["contribution"].sum() == pytest.approx(full.pairs["contribution"].sum(), rel=1e-9, abs=1e-9)
    # a layer-0 feature's id 0_f_p can be an error node's 0_L_p too (circuit-tracer's ids): compare kinds as well
    is_feature = full.nodes["kind"] == "feature"
    dropped = full.nodes[is_feature & ~full.nodes["node_id"].isin(kept)]
    merged_features = merged.nodes.loc[merged.nodes["kind"] == "feature", "node_id"]
    assert len(dropped) and not merged_features.isin(dropped["node_id"]).any()
    assert set(merged_features) == set(full.nodes.loc[is_feature, "node_id"]) & kept
    for vectors_m, vectors_f in ((merged.query_vectors, full.query_vectors), (merged.key_vectors, full.key_vectors)):
        at_m = {n: i for i, n in enumerate(merged.nodes["node_id"]) if merged.nodes["kind"].iat[i] != "feature"}
        at_f = {n: i for i, n in enumerate(full.nodes["node_id"]) if full.nodes["kind"].iat[i] != "feature"}
        for L in range(g.n_layers):
            for p in range(len(g.input_ids)):
                nid = f"0_{L}_{p}"
                group = torch.tensor(dropped[(dropped["layer"] == L) & (dropped["position"] == p)].index.to_list(),
                                     dtype=torch.long)
                want = vectors_f[at_f[nid]] + vectors_f[group].sum(0)
                assert torch.allclose(vectors_m[at_m[nid]], want, atol=1e-5 * float(want.abs().max()) + 1e-7)
    labels = g.labels
    sides = pd.concat([merged.query_side, merged.key_side])
    feats = sides[sides["kind"] == "feature"]
    assert len(feats) and all(labels[n] == lab for n, lab in zip(feats["node"], feats["label"], strict=True))


def test_a_long_pair_list_keeps_its_largest_and_sums_the_rest_in_one_row(graphs):
    """max_pairs lists the largest |contribution| first, in order, and one OTHER_PAIRS row holds the others' sum."""
    g = graphs("llama_gqa")
    everything = qk_attribution(g, layer=1, head=1, query=-1, key=4, max_pairs=None)
    short = qk_attribution(g, layer=1, head=1, query=-1, key=4, max_pairs=25)
    assert len(everything.pairs) == len(everything.query_side) * len(everything.key_side)
    assert len(short.pairs) == 26 and short.pairs["query_node"].iat[-1] == OTHER_PAIRS
    top = everything.pairs.head(25)
    assert np.allclose(short.pairs["contribution"].to_numpy()[:25], top["contribution"].to_numpy(), rtol=0, atol=0)
    assert short.pairs["contribution"].sum() == pytest.approx(everything.pairs["contribution"].sum(), abs=1e-9)
    magnitudes = np.abs(everything.pairs["contribution"].to_numpy())
    assert (np.diff(magnitudes) <= 0).all()


# --- bad input ----------------------------------------------------------------------------------------------------
def test_bad_entries_get_a_clear_error_and_leave_the_graph_as_it_was(graphs):
    g = graphs("mistral_window")
    n_pos, cfg = len(g.input_ids), g.model.cfg
    g.pin(g.nodes["node_id"].iat[0])
    before = (list(g.pinned), [list(s) for s in g.supernodes], dict(g.user_labels))
    cases = [(dict(layer=cfg.n_layers, head=0, query=-1, key=0), "layer"),
             (dict(layer=0, head=cfg.n_heads, query=-1, key=0), "head"),
             (dict(layer=0, head=0, query=n_pos, key=0), "query position"),
             (dict(layer=0, head=0, query=-1, key=-n_pos - 1), "key position"),
             (dict(layer=0, head=0, query=2, key=4), "after query"),
             (dict(layer=0, head=0, query=n_pos - 1, key=0), "sliding-window"),
             (dict(layer=0.5, head=0, query=-1, key=0), "whole number")]
    for kwargs, words in cases:
        with pytest.raises(QKAttributionError, match=words):
            qk_attribution(g, **kwargs)
    assert issubclass(QKAttributionError, AttributionGraphError)
    with pytest.raises(QKAttributionError, match="max_pairs"):
        qk_attribution(g, layer=0, head=0, query=-1, key=-1, max_pairs=0)
    assert (list(g.pinned), [list(s) for s in g.supernodes], dict(g.user_labels)) == before
    g.clear_pins()


# --- the figure and the JSON record ---------------------------------------------------------------------------------
def test_the_heat_map_draws_each_pair_among_the_largest_nodes_of_each_side(graphs):
    g = graphs("qwen3")
    qk = qk_attribution(g, layer=1, head=3, query=-1, key=2, max_pairs=None)
    fig = qk.plot(n=5)
    z = np.array(fig.data[0].z)
    assert z.shape == (5, 5) and fig.data[0].type == "heatmap"
    pairs = {(a, b, c, d): v for a, b, c, d, v in qk.pairs[["query_kind", "query_node", "key_kind", "key_node",
                                                            "contribution"]].itertuples(index=False)}
    q_top, k_top = qk.query_side.head(5), qk.key_side.head(5)
    for i, (qk_kind, q_node) in enumerate(zip(q_top["kind"], q_top["node"], strict=True)):
        for j, (k_kind, k_node) in enumerate(zip(k_top["kind"], k_top["node"], strict=True)):
            assert z[i, j] == pytest.approx(pairs[qk_kind, q_node, k_kind, k_node], rel=1e-9, abs=1e-12)
    assert str(qk.query) in fig.layout.title.text and f"{qk.score:.3f}" in fig.layout.title.text
    assert all(q_node in label for q_node, label in zip(q_top["node"], fig.data[0].y, strict=True))


def test_the_json_record_holds_the_entry_its_scores_and_the_top_rows(graphs):
    import json

    g = graphs("llama_gqa")
    qk = qk_attribution(g, layer=1, head=0, query=-1, key=1)
    record = json.loads(json.dumps(qk.to_json(n=4)))
    assert (record["layer"], record["head"], record["query"], record["key"]) == (1, 0, len(g.input_ids) - 1, 1)
    assert record["score"] == pytest.approx(qk.score, abs=1e-6) and len(record["pairs"]) == 4
    assert [r["query_node"] for r in record["pairs"]] == qk.pairs["query_node"].head(4).tolist()
    assert [r["node"] for r in record["key_side"]] == qk.key_side["node"].head(4).tolist()


@pytest.mark.slow
def test_smollm2_with_the_bundled_pair_splits_a_real_heads_score_exactly(model):
    """The real thing: SmolLM2 with transcoder_l6 and transcoder_l9 (every other layer all error), a head of a
    late layer looking from the last position back at " France": the pairs sum to the model's own score, and
    zeroing the strongest layer-6 feature of the query side in the constrained forward moves it as predicted."""
    tcs = [slmviz.load_sae(name, model=model) for name in ("transcoder_l6", "transcoder_l9")]
    g = attribution_graph("The capital of France is", transcoders=tcs, model=model, progress=False).prune()
    key = g.tokens.index(" France")
    qk = qk_attribution(g, layer=12, head=4, query=-1, key=key)
    assert abs(qk.pairs["contribution"].sum() - qk.score) <= tolerance(qk)
    assert {"feature", "error", "embedding", "bias"} <= set(qk.query_side["kind"])
    features = qk.query_side[(qk.query_side["kind"] == "feature") & (qk.query_side["layer"] == 6)]
    check_zeroing(g, qk, [("feature", features["node"].iat[0])])


def test_a_graph_without_its_model_or_with_a_changed_set_is_refused(graphs):
    g = graphs("llama_gqa")
    bare = g.prune()
    bare.model = None
    with pytest.raises(QKAttributionError, match="does not hold its model"):
        qk_attribution(bare, layer=0, head=0, query=-1, key=0)
    other = g.prune()
    other.transcoders = transcoders(g.model, seed=99)  # another set: the graph's features are not its active ones
    with pytest.raises(AttributionGraphError, match="set changed since the graph was built"):
        qk_attribution(other, layer=1, head=0, query=-1, key=0)


def test_the_graph_method_records_what_was_looked_at_and_the_json_carries_it(graphs, tmp_path):
    """g.qk is qk_attribution; the workbench keeps one record per attention entry (a pruned copy shares it); the graph
    JSON carries the records in its extra field and otherwise keeps circuit-tracer's keys; loading the JSON back
    restores them, and a malformed field is refused with the graph left as it was."""
    import json

    from slmviz.graphs.workbench import QK_FIELD, WorkbenchError

    g = graphs("qwen2")
    p = g.prune()
    assert QK_FIELD not in p.to_json()
    a = p.qk(layer=1, head=2, query=-1, key=3)
    b = qk_attribution(p, layer=1, head=2, query=-1, key=3)
    assert a.pairs.equals(b.pairs) and a.score == b.score
    p.qk(layer=1, head=2, query=-1, key=3)  # the same entry again: one record
    g.qk(layer=0, head=1, query=5, key=5)  # the unpruned graph shares the workbench
    data = json.loads(json.dumps(p.to_json()))
    assert list(data) == ["metadata", "qParams", "nodes", "links", QK_FIELD]
    assert [(r["layer"], r["head"], r["query"], r["key"]) for r in data[QK_FIELD]] == [(1, 2, len(p.input_ids) - 1, 3),
                                                                                       (0, 1, 5, 5)]
    assert data[QK_FIELD][0]["pairs"][0]["query_node"] == a.pairs["query_node"].iat[0]
    path = p.save_json(tmp_path / "g.json")
    g.workbench.qk.clear()
    g.load_json(path)
    assert [r["key"] for r in g.workbench.qk] == [3, 5]
    broken = json.loads(path.read_text())
    broken[QK_FIELD] = [{"layer": 1}]
    with pytest.raises(WorkbenchError, match=QK_FIELD):
        g.load_json(broken)
    assert len(g.workbench.qk) == 2
    g.workbench.qk.clear()


def test_a_capped_graphs_unchosen_features_merge_too(models, tiny_dirs):
    """With max_feature_nodes the graph holds only the most influential features; the others are active all the
    same, so they merge into their error nodes (full=True lists them, not in the graph), and the split stays exact."""
    m = load(models, tiny_dirs, "gemma3")
    g = attribution_graph(PROMPT, transcoders=transcoders(m), model=m, progress=False, max_feature_nodes=12)
    assert g.n_features == 12
    merged = qk_attribution(g, layer=2, head=0, query=-1, key=len(g.input_ids) - 3)
    full = qk_attribution(g, layer=2, head=0, query=-1, key=len(g.input_ids) - 3, full=True)
    assert abs(merged.pairs["contribution"].sum() - merged.score) <= tolerance(merged)
    assert merged.pairs["contribution"].sum() == pytest.approx(full.pairs["contribution"].sum(), rel=1e-9, abs=1e-9)
    features = full.nodes[full.nodes["kind"] == "feature"]
    assert len(features) > 12 and int(features["in_graph"].sum()) == 12
    assert (merged.nodes["kind"] == "feature").sum() == 12
