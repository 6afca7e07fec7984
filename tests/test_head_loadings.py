"""Head loadings (slmviz.graphs.head_loadings): the part of an attribution graph's edge that flows through each
attention head's output.

Checked by brute force, sharing nothing with the forward-mode / backward product: the edge is measured as a finite
difference of the target in the graph's linear model written out as a constrained forward (tests/test_qk.py's
frozen_run: the model with every transcoder spliced, patterns, norm scales, error terms and every feature's
activation held at the prompt's), with the source's write removed or not; a head's loading is that edge minus the
same edge with the head's output (attn.hook_result) zeroed, and its one-hop part the edge with every other head
zeroed. Not covered here: bf16 models, the GPU (tests/test_cuda.py), SmolLM2's real set (bench/studies).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_qk import PROMPT, coders_of, frozen_run, transcoders, zeroing

import slmviz
from slmviz.graphs.attribution import attribution_graph
from slmviz.graphs.frozen import AttributionGraphError
from slmviz.graphs.head_loadings import HeadLoadingsError, head_loadings
from slmviz.graphs.workbench import WorkbenchError
from slmviz.replacement.clt import CrossLayerTranscoder


@pytest.fixture(scope="module")
def graphs(tiny_dirs):
    cache = {}

    def get(arch: str, clt: bool = False):
        if (arch, clt) not in cache:
            m = slmviz.load(tiny_dirs[arch])
            ts = CrossLayerTranscoder.random(m.cfg.n_layers, m.cfg.d_model, 40, seed=4, architecture="relu",
                                             skip=True) if clt else transcoders(m, every_layer=True, seed=20)
            cache[arch, clt] = attribution_graph(PROMPT, transcoders=ts, model=m, progress=False)
        return cache[arch, clt]
    return get


def node(g, kind: str, layer: int | None = None, position: int | None = None, rank: int = 0) -> str:
    n = g.nodes
    sel = n["kind"] == kind
    if layer is not None:
        sel &= n["layer"] == layer
    if position is not None:
        sel &= n["position"] == position
    return n.loc[sel, "node_id"].iat[rank]


def target_value(g, target: str, heads_zeroed: list[tuple[int, int]], edits: dict) -> float:
    """The target (a feature's pre-activation minus b_enc, or a logit minus the mean logit) in frozen_run with the
    heads' outputs zeroed and `edits` applied."""
    row = g.nodes[g.nodes["node_id"] == target].iloc[0]
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads_zeroed:
        by_layer.setdefault(layer, []).append(head)

    def zero_heads(heads):
        def fn(x, name):
            x = x.clone()
            x[:, heads] = 0  # [pos, h, d_model]
            return x
        return fn

    hooks = dict(edits)
    for layer, heads in by_layer.items():
        hooks[f"blocks.{layer}.attn.hook_result"] = zero_heads(heads)
    if row.kind == "feature":
        name = f"blocks.{int(row.layer)}.mlp.hook_in"
        t = frozen_run(g, [name], hooks)
        coder = coders_of(g)[int(row.layer)]
        w_enc = coder.W_enc.detach()
        return float(t[name][int(row.position)] @ w_enc[:, int(row.feature)])
    t = frozen_run(g, [], hooks)
    last = t.logits[-1]
    return float(last[int(row.feature)] - last.mean())


GAIN = 1000.0  # the source's write is scaled by this and the difference divided by it: float rounding then scales
# with the source's own effect, not with everything else the target holds


def edge_by_difference(g, source: str, target: str, heads_zeroed: list[tuple[int, int]]) -> float:
    """(target with the source's write x GAIN - target without it) / GAIN: the edge, in a linear model."""
    kind = g.nodes.loc[g.nodes["node_id"] == source, "kind"].iat[0]
    return (target_value(g, target, heads_zeroed, zeroing(g, kind, source, GAIN))
            - target_value(g, target, heads_zeroed, zeroing(g, kind, source, 0.0))) / GAIN


def check_against_brute_force(g, source: str, target: str) -> None:
    hl = head_loadings(g, source, target)
    cfg = g.model.cfg
    every = [(layer, head) for layer in range(cfg.n_layers) for head in range(cfg.n_heads)]
    edge = edge_by_difference(g, source, target, [])
    size = max(abs(edge), float(hl["weight"].abs().max()), 1e-3)
    assert hl.attrs["edge"] == pytest.approx(edge, abs=2e-5 * size)
    assert hl.attrs["recomputed_edge"] == pytest.approx(hl.attrs["edge"], abs=2e-5 * size)
    assert len(hl) == len(every) and (hl["weight"] != 0).any()
    for layer, head, weight, one_hop in hl[["layer", "head", "weight", "one_hop"]].itertuples(index=False):
        without = edge_by_difference(g, source, target, [(layer, head)])
        alone = edge_by_difference(g, source, target, [x for x in every if x != (layer, head)])
        assert weight == pytest.approx(edge - without, abs=2e-5 * size), (layer, head)
        assert one_hop == pytest.approx(alone, abs=2e-5 * size), (layer, head)


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_bias", "gemma3", "qwen3", "olmo2"])
def test_each_heads_loading_is_the_edge_minus_the_edge_without_that_head(graphs, arch):
    """An embedding -> last-layer feature edge (paths through one head and through two), on every head: the loading
    is the finite-difference edge minus the same with that head's output zeroed, and one_hop the edge with every
    other head zeroed."""
    g = graphs(arch)
    last = g.model.cfg.n_layers - 1
    n_pos = len(g.input_ids)
    check_against_brute_force(g, node(g, "embedding", position=n_pos - 4), node(g, "feature", last, n_pos - 1))


def test_a_feature_to_logit_edge_and_a_cross_layer_transcoders_edge_match_the_brute_force(graphs):
    g = graphs("llama_gqa")
    n_pos = len(g.input_ids)
    check_against_brute_force(g, node(g, "feature", 0, n_pos - 3), node(g, "logit"))
    check_against_brute_force(g, node(g, "error", 0, n_pos - 2), node(g, "feature", 1, n_pos - 1))
    c = graphs("llama_gqa", clt=True)  # a layer-0 feature writes both layers: its edge sums over both writes
    check_against_brute_force(c, node(c, "feature", 0, 2), node(c, "logit"))


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3"])
def test_loadings_sum_to_the_edge_where_every_path_is_one_hop(graphs, arch):
    """A target one layer above its source (an embedding into a layer-0 feature, a layer-L feature into a layer-L+1
    one): every path uses exactly one head, so the loadings sum to the edge and multi_head is 0."""
    g = graphs(arch)
    n_pos = len(g.input_ids)
    # (inside Gemma's sliding window of 4 at layer 0)
    for source, target in ((node(g, "embedding", position=n_pos - 3), node(g, "feature", 0, n_pos - 1)),
                           (node(g, "feature", 0, 3), node(g, "feature", 1, n_pos - 2))):
        hl = head_loadings(g, source, target)
        edge = hl.attrs["edge"]
        assert edge != 0
        assert hl["weight"].sum() == pytest.approx(edge, abs=1e-5 * abs(edge) + 1e-7)
        assert np.allclose(hl["weight"], hl["one_hop"], rtol=0, atol=1e-5 * abs(edge) + 1e-7)
        assert abs(hl.attrs["multi_head"]) <= 1e-5 * abs(edge) + 1e-7


def test_the_multi_head_share_is_what_paths_through_two_heads_carry(graphs):
    """In a two-layer model a path passes one head or two, so Σ loadings − edge (each two-head path counted twice,
    once too many) equals the edge minus its one-hop part (multi_head): two different computations."""
    g = graphs("llama_gqa")
    n_pos = len(g.input_ids)
    hl = head_loadings(g, node(g, "embedding", position=1), node(g, "feature", 1, n_pos - 1))
    assert g.model.cfg.n_layers == 2 and abs(hl.attrs["multi_head"]) > 1e-3 * abs(hl.attrs["edge"])
    assert hl.attrs["through_heads"] - hl.attrs["edge"] == pytest.approx(hl.attrs["multi_head"], abs=1e-4)
    assert hl.attrs["multi_head_share"] == pytest.approx(hl.attrs["multi_head"] / hl.attrs["edge"])
    assert list(hl.columns) == ["layer", "head", "weight", "one_hop"]
    assert (np.diff(hl["weight"].abs().to_numpy()) <= 0).all()


def test_bad_edges_get_a_clear_error_and_leave_the_graph_as_it_was(graphs):
    g = graphs("llama_gqa")
    n_pos = len(g.input_ids)
    g.pin(node(g, "logit"))
    g.supernode("s", [node(g, "feature", 0, 2)])
    before = (list(g.pinned), [list(s) for s in g.supernodes], dict(g.user_labels))
    feature = node(g, "feature", 1, n_pos - 1)
    cases = [((node(g, "feature", 0, 3), node(g, "feature", 1, 3)), HeadLoadingsError, "stays at position 3"),
             ((node(g, "feature", 0, n_pos - 1), node(g, "feature", 1, 2)), HeadLoadingsError, "comes after"),
             ((node(g, "feature", 1, 1), node(g, "feature", 0, n_pos - 1)), HeadLoadingsError, "no edge"),
             ((node(g, "logit"), feature), HeadLoadingsError, "logit node"),
             ((node(g, "embedding", position=0), node(g, "embedding", position=2)), HeadLoadingsError,
              "embedding node"),
             (("9_9_9", feature), WorkbenchError, "not a node")]
    for (source, target), error, words in cases:
        with pytest.raises(error, match=words):
            head_loadings(g, source, target)
        assert issubclass(error, AttributionGraphError)
    assert (list(g.pinned), [list(s) for s in g.supernodes], dict(g.user_labels)) == before
    g.clear_pins()


def test_a_graph_without_its_model_is_refused(graphs):
    g = graphs("llama_gqa")
    bare = g.prune()
    bare.model = None
    with pytest.raises(HeadLoadingsError, match="does not hold its model"):
        head_loadings(bare, node(g, "embedding", position=1), node(g, "logit"))


def test_the_graph_method_is_the_function(graphs):
    g = graphs("llama_gqa")
    n_pos = len(g.input_ids)
    source, target = node(g, "embedding", position=2), node(g, "feature", 1, n_pos - 1)
    a, b = g.head_loadings(source, target), head_loadings(g, source, target)
    assert a.equals(b) and a.attrs == b.attrs
