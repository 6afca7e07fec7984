"""Attribution graphs over transcoder features (slmviz.attribution_graph, circuit-tracer's semantics).

Checked against references that do not share the graph's backward-injection code: the model's own logits and
mlp.hook_in values (a plain forward), the frozen replacement model run forward with one node removed (linearity),
a hand-written formula for the embedding -> layer-0 feature edges (attention with its pattern frozen), the closed
form w·((I - Â)⁻¹ - I) of influence, and circuit-tracer 0.5.0's JSON field lists (frontend/graph_models.py).
Not covered here: agreement with circuit-tracer's own numbers (bench/peers/attribution_graph_circuit_tracer.py records
that), cross-layer transcoders (tests/test_clt.py), bf16 models.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import slmviz
from slmviz.features.sae import SAE
from slmviz.graphs.attribution import AttributionGraphError, attribution_graph, partial_influences
from slmviz.graphs.frozen import frozen_forward, prompt_state
from slmviz.graphs.prune import (
    RowNormalizedAbs,
    compute_influence,
    find_threshold,
    graph_scores,
    mean_path_length,
    normalize_matrix,
)

PROMPT = "w3 w5 w7 w9 w11 w4"


def transcoder(model, layer: int, seed: int = 0, skip: bool = False, architecture: str = "relu", **kw) -> SAE:
    d = model.cfg.d_model
    return SAE.random(d, d, seed=seed, architecture=architecture, skip=skip, hook_name=f"blocks.{layer}.mlp.hook_in",
                      hook_name_out=f"blocks.{layer}.hook_mlp_out", **kw)


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in ("llama_gqa", "llama_bias", "gemma3", "qwen3", "olmo2")}


def targets_from_a_plain_forward(model, graph):
    """Each target's value from the model's own forward: W_enc[:, f] · mlp.hook_in for features (b_enc excluded,
    as in the graph), logit - mean(logits) at the last position for logits."""
    ids = torch.tensor(graph.input_ids)
    names = [f"blocks.{L}.mlp.hook_in" for L in range(model.cfg.n_layers)]
    t = model.trace(ids, names=names)
    out = torch.zeros(len(graph.nodes))
    kinds = graph.nodes["kind"].to_numpy()
    encoders = graph._encoders  # set by the test below: {layer: W_enc}
    for i in np.nonzero(kinds == "feature")[0]:
        row = graph.nodes.iloc[i]
        out[i] = t[f"blocks.{row.layer}.mlp.hook_in"][row.position] @ encoders[row.layer][:, row.feature]
    last = t.logits[-1]
    for i in np.nonzero(kinds == "logit")[0]:
        out[i] = last[graph.nodes.iloc[i].feature] - last.mean()
    return out


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_bias", "gemma3", "qwen3", "olmo2"])
@pytest.mark.parametrize("skip", [False, True])
def test_the_graphs_linear_model_reproduces_the_logits_and_feature_inputs(models, arch, skip):
    """Σ over every node's edge (errors and embeddings included) + the bias constant = each target's value from a
    plain forward, within fp32 rounding; and the frozen replacement model, run forward unedited, gives the logits."""
    m = models[arch]
    tcs = [transcoder(m, L, seed=L, skip=skip) for L in range(m.cfg.n_layers - 1)]  # the last layer: all error
    g = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=16)
    g._encoders = {int(tc.hook_name.split(".")[1]): tc.W_enc.detach() for tc in tcs}
    expected = targets_from_a_plain_forward(m, g)
    is_target = torch.tensor(g.nodes["kind"].isin(["feature", "logit"]).to_numpy())
    got = g.adjacency.sum(1) + g.constant
    scale = expected[is_target].abs().max()
    assert torch.allclose(got[is_target], expected[is_target], atol=2e-5 * scale, rtol=0), \
        (got - expected)[is_target].abs().max()
    assert g.n_features > 0 and (g.adjacency[~is_target] == 0).all()  # errors and embeddings are never targets

    state = prompt_state(m, torch.tensor(g.input_ids))
    by_layer = {L: tc for L, tc in enumerate(tcs)}
    zeros = [torch.zeros(1, len(g.input_ids), m.cfg.d_model) for _ in range(m.cfg.n_layers)]
    _, normed = frozen_forward(m, state, by_layer, state.embed[None], zeros)
    logits = normed[0] @ m.decoder.params.unembed.T
    assert torch.allclose(logits, m.logits(torch.tensor(g.input_ids)), atol=1e-4, rtol=1e-5)


def test_a_gemma_scope_2_transcoder_all_set_gives_an_exact_graph(models, tmp_path):
    """Gemma Scope 2's `transcoder_all` layout (an affine JumpReLU transcoder folder for every layer, no config.json,
    as the hub serves it) loads through load_sae onto every layer of a Gemma 3 and gives a graph with features at
    every layer whose linear model reproduces the logits and the features' inputs."""
    from test_sae_io import gemma_scope_folder

    m = models["gemma3"]
    tcs = [slmviz.load_sae(gemma_scope_folder(tmp_path, m, "transcoder", L, config=False, affine=True, seed=L,
                                              every_layer=True)[0], model=m) for L in range(m.cfg.n_layers)]
    assert all(tc.W_skip is not None and tc.architecture == "jumprelu" for tc in tcs)
    g = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=16)
    g._encoders = {L: tc.W_enc.detach() for L, tc in enumerate(tcs)}
    expected = targets_from_a_plain_forward(m, g)
    is_target = torch.tensor(g.nodes["kind"].isin(["feature", "logit"]).to_numpy())
    got = g.adjacency.sum(1) + g.constant
    assert torch.allclose(got[is_target], expected[is_target], atol=2e-5 * expected[is_target].abs().max(), rtol=0)
    assert set(g.nodes.loc[g.nodes["kind"] == "feature", "layer"]) == set(range(m.cfg.n_layers))


def removed(g, state, i, n_layers, d_model, f_vecs):
    """(embed, deltas) of the replacement model with node i removed."""
    n_pos = len(g.input_ids)
    embed = state.embed[None].clone()
    deltas = [torch.zeros(1, n_pos, d_model) for _ in range(n_layers)]
    row = g.nodes.iloc[i]
    if row.kind == "embedding":
        embed[0, row.position] = 0
    elif row.kind == "error":
        deltas[row.layer][0, row.position] = -g._errors[row.layer][row.position]
    else:
        deltas[row.layer][0, row.position] = -f_vecs[i]
    return embed, deltas


@pytest.mark.parametrize("arch,skip", [("llama_gqa", True), ("gemma3", False), ("llama_bias", True)])
def test_removing_a_node_changes_each_target_by_exactly_its_edge_weights(models, arch, skip):
    """Zeroing one feature (its decoder vector leaves the MLP output), one error or one embedding in the frozen
    linear model moves every target by minus that node's column of the adjacency: edge weights are direct effects."""
    m = models[arch]
    n_layers, d = m.cfg.n_layers, m.cfg.d_model
    tcs = [transcoder(m, L, seed=10 + L, skip=skip) for L in range(n_layers)]
    g = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=32)
    ids = torch.tensor(g.input_ids)
    state = prompt_state(m, ids)
    by_layer = {L: tc for L, tc in enumerate(tcs)}
    with torch.no_grad():
        g._errors = [state.mlp_out[L] - tcs[L](state.mlp_in[L]) for L in range(n_layers)]
    kinds = g.nodes["kind"].to_numpy()
    feats = np.nonzero(kinds == "feature")[0]
    f_vecs = {int(i): g.nodes.iloc[i].activation * tcs[g.nodes.iloc[i].layer].W_dec.detach()[g.nodes.iloc[i].feature]
              for i in feats}
    layer0 = [i for i in feats if g.nodes.iloc[i].layer == 0]
    errors = np.nonzero((kinds == "error") & (g.nodes["layer"].to_numpy() == 0) & (g.nodes["position"] > 0))[0]
    chosen = [*layer0[:3], *layer0[-2:], *errors[:2], *np.nonzero(kinds == "embedding")[0][-2:]]

    def targets(embed, deltas):
        mlp_in, normed = frozen_forward(m, state, by_layer, embed, deltas)
        out = torch.zeros(len(g.nodes))
        for i in feats:
            row = g.nodes.iloc[i]
            out[i] = mlp_in[row.layer][0, row.position] @ tcs[row.layer].W_enc.detach()[:, row.feature]
        last = normed[0, -1] @ m.decoder.params.unembed.T
        for i in np.nonzero(kinds == "logit")[0]:
            out[i] = last[g.nodes.iloc[i].feature] - last.mean()
        return out

    with torch.no_grad():
        base = targets(state.embed[None], [torch.zeros(1, len(ids), d) for _ in range(n_layers)])
        for i in chosen:
            change = targets(*removed(g, state, i, n_layers, d, f_vecs)) - base
            column = g.adjacency[:, i]
            assert column.abs().max() > 0, g.nodes.iloc[i]
            scale = max(float(base.abs().max()), float(column.abs().max()), 1.0)
            assert torch.allclose(change, -column, atol=2e-5 * scale, rtol=0), \
                (g.nodes.iloc[i], (change + column).abs().max())


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3"])
def test_vmapped_backward_equals_batch_copies_of_the_prompt(models, arch):
    """The default (one forward, backward vmapped over targets) gives circuit-tracer's way's numbers (batch_size
    copies of the prompt forward), for a batch size that splits the targets unevenly."""
    m = models[arch]
    tcs = [transcoder(m, L, seed=20 + L, skip=True) for L in range(m.cfg.n_layers)]
    a = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=13)
    b = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=13, vmap=False)
    assert a.nodes.equals(b.nodes)
    assert torch.allclose(a.adjacency, b.adjacency, atol=1e-5 * float(b.adjacency.abs().max()), rtol=0)


class Stop(Exception):
    """What a progress callable raises to stop the graph (the app's JobCancelled stands for any such)."""


@pytest.mark.parametrize("vmap", [True, False])
def test_progress_counts_every_target_and_a_raising_callable_stops_the_graph(models, vmap):
    """progress(update) after each backward batch: done grows to total = logits + features (the adjacency rows
    attributed); reporting changes no number. A callable that raises stops the computation at that batch, the
    exception propagates as it is, and the frames it unwound keep nothing large alive (the adjacency, the
    autograd graph) once raised."""
    m = models["llama_gqa"]
    tcs = [transcoder(m, L, seed=30 + L) for L in range(m.cfg.n_layers)]
    plain = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=7, vmap=vmap, progress=False)
    calls: list[tuple[int, int]] = []
    g = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=7, vmap=vmap,
                          progress=lambda u: calls.append((u.done, u.total)) if u.unit == "target" else None)
    kinds = g.nodes["kind"]
    total = int((kinds == "logit").sum() + (kinds == "feature").sum())
    n_logits = int((kinds == "logit").sum())
    assert {t for _, t in calls} == {total}
    done = [d for d, _ in calls]
    assert done == sorted(set(done)) and done[-1] == total
    # one call per backward batch of 7: the logits' batches, then the features'
    assert len(calls) == math.ceil(n_logits / 7) + math.ceil((total - n_logits) / 7) and len(calls) >= 3
    assert torch.equal(g.adjacency, plain.adjacency) and g.nodes.equals(plain.nodes)

    seen: list[int] = []

    def stop_at_the_second(u) -> None:
        if u.unit != "target":
            return
        seen.append(u.done)
        if len(seen) == 2:
            raise Stop(f"stopped at {u.done:g} of {u.total:g}")

    with pytest.raises(Stop, match=f"stopped at {done[1]} of {total}") as e:
        attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=7, vmap=vmap, progress=stop_at_the_second)
    assert seen == done[:2]  # nothing ran after the raise
    big = g.adjacency.numel()
    tb = e.value.__traceback__
    while tb is not None:  # every frame the exception passed through: no tensor as large as the adjacency left
        for name, value in tb.tb_frame.f_locals.items():
            tensors = value if isinstance(value, (list, tuple)) else [value]
            assert not any(isinstance(t, torch.Tensor) and t.numel() >= big for t in tensors), name
        tb = tb.tb_next


def test_progress_true_draws_a_tqdm_bar_to_the_end(models, capsys):
    m = models["llama_gqa"]
    attribution_graph(PROMPT, transcoders=[transcoder(m, 1)], model=m, batch_size=5, progress=True)
    err = capsys.readouterr().err
    assert "attribution_graph" in err and "100%" in err


def test_progress_updates_name_the_attribution_count_every_target_and_end_the_job(models):
    """slmviz.progress's contract: a sink of ProgressUpdate sees the "attribution" part count targets up to the
    total (logits + features), never going back, and the job's bar end at 1."""
    m = models["llama_gqa"]
    seen = []
    g = attribution_graph(PROMPT, transcoders=[transcoder(m, 1)], model=m, batch_size=5, progress=seen.append)
    total = int(g.nodes["kind"].isin(["logit", "feature"]).sum())
    counts = [u for u in seen if u.unit == "target"]
    assert counts and counts[-1].done == total and {u.total for u in counts} == {total}
    assert all(u.phase == "attribution" for u in counts)
    assert [u.fraction for u in seen] == sorted(u.fraction for u in seen) and seen[-1].fraction == 1.0


@pytest.mark.parametrize("architecture,kw", [("topk", {"k": 6, "rescale_acts_by_decoder_norm": True}),
                                             ("jumprelu", {})])
def test_topk_and_jumprelu_transcoders_give_exact_graphs(models, architecture, kw):
    """Other activations: a topk transcoder that rescales by decoder norms writes (a / |W_dec[f]|) W_dec[f], a
    jumprelu one a · W_dec[f]; either way Σ edges + constant gives every target of a plain forward."""
    m = models["llama_gqa"]
    tcs = [transcoder(m, L, seed=30 + L, architecture=architecture, scale=3.0, **kw) for L in range(2)]
    g = attribution_graph(PROMPT, transcoders=tcs, model=m)
    g._encoders = {L: tc.W_enc.detach() for L, tc in enumerate(tcs)}
    expected = targets_from_a_plain_forward(m, g)
    is_target = torch.tensor(g.nodes["kind"].isin(["feature", "logit"]).to_numpy())
    got = g.adjacency.sum(1) + g.constant
    assert g.n_features > 0
    # fp32 rounding of sums that cancel (W_dec rows of norm 3): within 1e-4 of the largest target
    assert torch.allclose(got[is_target], expected[is_target], atol=1e-4 * expected.abs().max(), rtol=0), \
        (got - expected)[is_target].abs().max()
    with torch.no_grad():  # the graph's feature vectors add up to the transcoder's own reconstruction
        ids = torch.tensor(g.input_ids)
        x = m.trace(ids, names=["blocks.1.mlp.hook_in"])["blocks.1.mlp.hook_in"]
        recon = tcs[1](x) - tcs[1].b_dec
        feats = g.nodes[(g.nodes["kind"] == "feature") & (g.nodes["layer"] == 1)]
        for p in (1, len(ids) - 1):
            rows = feats[feats["position"] == p]
            w = tcs[1].W_dec.detach()[torch.tensor(rows["feature"].to_numpy())]
            a = torch.tensor(rows["activation"].to_numpy(), dtype=torch.float32)
            if architecture == "topk":
                a = a / w.norm(dim=-1)
            assert torch.allclose((a[:, None] * w).sum(0), recon[p], atol=1e-4)


def test_unpruned_json_lists_only_edges_that_exist(models):
    """to_json without prune uses thresholds 1.0: no zero-weight link (circuit-tracer's rule alone would list every
    pair at that threshold), and all but the few whose cumulative share rounds past 1.0 of the nonzero ones."""
    m = models["llama_gqa"]
    g = attribution_graph(PROMPT, transcoders=[transcoder(m, 0, seed=7)], model=m)
    j = g.to_json()
    nonzero = int((g.adjacency != 0).sum())
    assert all(x["weight"] != 0 for x in j["links"]) and 0.99 * nonzero <= len(j["links"]) <= nonzero


def test_embedding_to_layer0_feature_edges_equal_the_hand_formula(models):
    """A[t, E_p] for a layer-0 feature t at position q, written out: the embedding reaches mlp.hook_in[q] through
    the residual (p = q) and through every head's value at p weighted by the frozen pattern, each norm dividing by
    its frozen scale:
    W_enc[:, t] · (w2 / s2[q]) ⊙ (δ_pq e_p + Σ_h pattern[h, q, p] W_o,h W_v,g(h) ((w1 / s1[p]) ⊙ e_p))."""
    m = models["llama_gqa"]
    cfg = m.cfg
    tc = transcoder(m, 0, seed=3)
    g = attribution_graph(PROMPT, transcoders=[tc], model=m)
    ids = torch.tensor(g.input_ids)
    t = m.trace(ids, names=["hook_embed", "blocks.0.attn.hook_pattern", "blocks.0.ln1.hook_scale",
                            "blocks.0.ln2.hook_scale"])
    lp = m.decoder.params.layers[0]
    h, kv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    w_v = lp.w_qkv[(h + kv) * dh:].view(kv, dh, cfg.d_model)  # [g, dh, d]
    w_o = lp.w_o.view(cfg.d_model, h, dh)  # [d, h, dh]
    e, pattern = t["hook_embed"], t["blocks.0.attn.hook_pattern"]
    s1, s2 = t["blocks.0.ln1.hook_scale"], t["blocks.0.ln2.hook_scale"]
    kinds = g.nodes["kind"].to_numpy()
    tok = {int(g.nodes.iloc[i].position): i for i in np.nonzero(kinds == "embedding")[0]}
    checked = 0
    for i in np.nonzero(kinds == "feature")[0][:12]:
        row = g.nodes.iloc[i]
        q, u = row.position, tc.W_enc.detach()[:, row.feature]
        for p in range(q + 1):
            x = lp.ln1 * e[p] / s1[p]
            v = torch.einsum("ged,d->ge", w_v, x)  # [g, dh]
            heads = torch.stack([w_o[:, j] @ v[j // (h // kv)] for j in range(h)])  # [h, d]
            into = (pattern[:, q, p, None] * heads).sum(0) + (e[p] if p == q else 0)
            expected = u @ (lp.ln2 * into / s2[q])
            assert math.isclose(float(g.adjacency[i, tok[p]]), float(expected), rel_tol=1e-4, abs_tol=1e-5)
            checked += 1
    assert checked > 12


def test_influence_is_the_closed_form_and_pruning_keeps_the_most_influential_nodes(models):
    """Node influence = w·((I - Â)⁻¹ - I) with Â the row-normalised |A| and w the logit probabilities; before its
    connectivity clean-up, pruning keeps exactly the nodes whose influence is among the top that reach 80 % of the
    total; every kept feature then has a kept edge in and out; thresholds of 1 keep every node with influence."""
    m = models["llama_gqa"]
    g = attribution_graph(PROMPT, transcoders=[transcoder(m, L, seed=L) for L in range(2)], model=m)
    a = normalize_matrix(g.adjacency).double()
    n = a.shape[0]
    w = torch.zeros(n, dtype=torch.float64)
    w[-len(g.logit_probabilities):] = g.logit_probabilities.double()
    closed = w @ (torch.linalg.inv(torch.eye(n, dtype=torch.float64) - a) - torch.eye(n, dtype=torch.float64))
    influence = compute_influence(normalize_matrix(g.adjacency), w.float())
    assert torch.allclose(influence.double(), closed, rtol=1e-4, atol=1e-7)

    p = g.prune(node_threshold=0.8, edge_threshold=0.98)
    kinds = g.nodes["kind"].to_numpy()
    order = np.argsort(-influence.numpy(), kind="stable")
    share = np.cumsum(influence.numpy()[order]) / influence.numpy().sum()
    top = set(order[: int(np.searchsorted(share, 0.8)) + 1].tolist())
    kept = set(np.nonzero(p.node_mask.numpy())[0].tolist())
    inner = set(np.nonzero(np.isin(kinds, ["feature", "error"]))[0].tolist())
    assert kept & inner <= top  # nothing below the threshold survives
    assert set(np.nonzero(np.isin(kinds, ["embedding", "logit"]))[0].tolist()) <= kept
    edges = p.edge_mask & p.node_mask[:, None] & p.node_mask[None, :]
    for i in kept & set(np.nonzero(kinds == "feature")[0].tolist()):
        assert edges[i].any() and edges[:, i].any()
    assert len(kept & inner) < len(inner)
    assert float(find_threshold(influence, 0.8)) > 0
    everything = g.prune(1.0, 1.0)
    assert set(np.nonzero(everything.node_mask.numpy())[0].tolist()) >= kept


def circuit_tracers_partial_influences(rows, logit_p, row_node):
    """circuit-tracer 0.5.0's compute_partial_influences, written out: power iteration on a normalised copy."""
    normalized = rows.abs()
    normalized /= normalized.sum(dim=1, keepdim=True).clamp(min=1e-8)
    influence, prod = torch.zeros(rows.shape[1]), torch.zeros(rows.shape[1])
    prod[-len(logit_p):] = logit_p
    for _ in range(128):
        prod = prod[row_node] @ normalized
        if not prod.any():
            break
        influence += prod
    return influence


def test_partial_influences_equal_circuit_tracers_dense_power_iteration():
    """partial_influences (which ranks features for max_feature_nodes) runs its power iteration on the row nodes'
    block and takes the product with every column in chunks, never copying `rows`; it must equal circuit-tracer's,
    for rows of an acyclic graph (row nodes feed only higher-numbered ones, the logits last), a row of zeros
    included, in every round of the max_feature_nodes loop (its first rows only)."""
    torch.manual_seed(0)
    n_nodes, n_logits = 60, 3
    features = torch.tensor([4, 9, 17, 23, 30, 41, 44, 52])
    row_node = torch.cat([torch.arange(n_nodes - n_logits, n_nodes), features[torch.randperm(len(features))]])
    rows = torch.randn(len(row_node), n_nodes)
    rows *= torch.arange(n_nodes)[None, :] < row_node[:, None]  # inputs from lower nodes only
    rows[-1] = 0
    logit_p = torch.tensor([0.5, 0.3, 0.2])
    assert circuit_tracers_partial_influences(rows, logit_p, row_node)[features].gt(0).sum() > 4  # past one step

    for r in (len(row_node), n_logits + 3):
        expected = circuit_tracers_partial_influences(rows[:r], logit_p, row_node[:r])
        for chunk_bytes in (4 * r * 7, 2**26):  # columns 7 at a time, and all at once
            got = partial_influences(rows[:r], logit_p, row_node[:r], chunk_bytes=chunk_bytes)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-7)


def test_row_normalized_abs_reads_the_normalised_matrix_a_block_at_a_time(models):
    """Scoring streams Â off the adjacency (prune.RowNormalizedAbs) instead of copying it: its products, its error
    shares and the influence over it equal normalize_matrix's dense Â to fp32 rounding, however the rows are cut into
    blocks (one row, a block that does not divide the rows, all at once), zero rows included."""
    m = models["llama_gqa"]
    g = attribution_graph(PROMPT, transcoders=[transcoder(m, L, seed=L) for L in range(2)], model=m)
    a = g.adjacency
    assert (a.abs().sum(1) == 0).any()  # embeddings and errors have no inputs
    dense = normalize_matrix(a)
    w = torch.zeros(a.shape[0])
    w[-len(g.logit_probabilities):] = g.logit_probabilities
    vec = torch.rand(a.shape[0])
    for rows in (1, 7, a.shape[0]):
        op = RowNormalizedAbs(a, block_bytes=rows * a.shape[1] * a.element_size())
        assert len(op.blocks) == -(-a.shape[0] // rows)
        assert torch.allclose(op.vecmat(vec), vec @ dense, rtol=1e-5, atol=1e-7)
        assert torch.allclose(op.row_sums(slice(3, 40)), dense[:, 3:40].sum(1), rtol=1e-5, atol=1e-7)
        assert torch.allclose(compute_influence(op, w), compute_influence(dense, w), rtol=1e-4, atol=1e-7)
    assert a.equal(g.adjacency)  # read, never changed


def test_graph_scores_are_one_without_errors_and_count_error_influence():
    """A hand-made graph (embedding e -> feature f -> logit, error x -> logit): replacement is e's share of the
    influence of tokens and errors, completeness the influence-weighted non-error share of each node's inputs."""
    # node order: f, x, e, logit; rows are targets
    a = torch.tensor([[0.0, 0.0, 2.0, 0.0],   # f <- e
                      [0.0, 0.0, 0.0, 0.0],
                      [0.0, 0.0, 0.0, 0.0],
                      [3.0, 1.0, 0.0, 0.0]])  # logit <- f (3), x (1)
    s = graph_scores(a, torch.tensor([1.0]), n_features=1, n_errors=1, n_tokens=1)
    # influence: logit -> f 0.75, x 0.25; f -> e 0.75. replacement = 0.75 / (0.75 + 0.25)
    assert s["replacement"] == pytest.approx(0.75)
    # completeness: weights f 0.75, x 0.25, e 0.75, logit 1; non-error shares f 1, x 1 (no inputs), e 1, logit 0.75
    assert s["completeness"] == pytest.approx((0.75 + 0.25 + 0.75 + 0.75) / (0.75 + 0.25 + 0.75 + 1))
    a[3, 1] = 0.0
    assert graph_scores(a, torch.tensor([1.0]), 1, 1, 1) == pytest.approx({"replacement": 1.0, "completeness": 1.0})


def paths_by_hand(a: torch.Tensor, probs: torch.Tensor, tokens: range) -> tuple[float, float]:
    """(Σ weight · edges, Σ weight) over every path from a logit to a token, enumerated one by one: a path's weight is
    its logit's probability times its row-normalised |A| entries."""
    rows = a.abs() / a.abs().sum(1, keepdim=True).clamp(min=1e-10)
    n, total, weighted = a.shape[0], 0.0, 0.0
    stack = [(n - len(probs) + i, float(p), 0) for i, p in enumerate(probs)]
    while stack:
        node, w, edges = stack.pop()
        if node in tokens and edges:
            total, weighted = total + w, weighted + w * edges
        stack += [(int(j), w * float(rows[node, j]), edges + 1) for j in torch.nonzero(rows[node]).flatten()]
    return weighted, total


def test_mean_path_length_is_the_influence_weighted_mean_over_every_token_to_logit_path():
    """On a hand-made DAG (f1, f2, error x, tokens e1 e2, two logits): the closed form equals the paths enumerated
    one by one; a token that writes its logit directly is a path of one edge; paths ending at x are left out."""
    # node order: f1, f2, x, e1, e2, l1, l2 (rows are targets)
    a = torch.zeros(7, 7)
    a[0, 3], a[0, 4] = 2.0, -1.0            # f1 <- e1, e2
    a[1, 0], a[1, 2], a[1, 3] = 0.5, 1.0, -0.5  # f2 <- f1, x, e1
    a[5, 1], a[5, 0], a[5, 4] = 3.0, 1.0, 1.0   # l1 <- f2, f1, e2
    a[6, 2], a[6, 1] = 1.0, 2.0              # l2 <- x, f2
    probs = torch.tensor([0.7, 0.3])
    weighted, total = paths_by_hand(a.double(), probs.double(), range(3, 5))
    got = mean_path_length(a.double(), probs.double(), n_features=2, n_errors=1, n_tokens=2)
    assert got == pytest.approx(weighted / total, rel=1e-12) and 1 < got < 3
    direct = torch.zeros(4, 4)  # f, x, e, logit: only e -> logit
    direct[3, 2] = 1.0
    assert mean_path_length(direct, torch.tensor([1.0]), 1, 1, 1) == 1.0
    direct[3, 2], direct[3, 1] = 0.0, 1.0  # only the error reaches the logit: no token-to-logit path
    assert math.isnan(mean_path_length(direct, torch.tensor([1.0]), 1, 1, 1))


def test_a_graphs_mean_path_length_matches_its_paths_enumerated(models):
    m = models["llama_gqa"]
    g = attribution_graph("w3 w5 w7", transcoders=[transcoder(m, L, seed=L) for L in range(m.cfg.n_layers)],
                          model=m, progress=False, max_feature_nodes=12)
    kinds = g.nodes["kind"].to_numpy()
    tokens = np.nonzero(kinds == "embedding")[0]
    weighted, total = paths_by_hand(g.adjacency.double(), g.logit_probabilities.double(),
                                    range(int(tokens[0]), int(tokens[-1]) + 1))
    assert g.mean_path_length() == pytest.approx(weighted / total, rel=1e-5)  # fp32 against float64 by hand


# circuit-tracer 0.5.0, frontend/graph_models.py: Metadata, QParams, Node fields in order.
CT_METADATA = ["slug", "scan", "transcoder_list", "prompt_tokens", "prompt", "node_threshold", "schema_version"]
CT_QPARAMS = ["pinnedIds", "supernodes", "linkType", "clickedId", "sg_pos"]
CT_NODE = ["node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob", "is_target_logit", "run_idx",
           "reverse_ctx_idx", "jsNodeId", "clerp", "influence", "activation"]


def test_json_has_circuit_tracers_schema_and_node_ids(models, tmp_path):
    """The JSON has circuit-tracer's keys, node id scheme (feature L_f_p, error 0_L_p, embedding E_tok_p, logit
    (n_layers+1)_tok_p), Cantor-paired feature numbers, and links between listed nodes; save_json round-trips."""
    m = models["llama_gqa"]
    g = attribution_graph(PROMPT, transcoders=[transcoder(m, 0, seed=5)], model=m).prune()
    j = g.to_json(slug="tiny")
    assert list(j) == ["metadata", "qParams", "nodes", "links"]
    # + Neuronpedia's optional metadata.info (generator, and the model and transcoders that load_json checks)
    assert list(j["metadata"]) == [*CT_METADATA, "info"] and list(j["qParams"]) == CT_QPARAMS
    assert j["metadata"]["prompt_tokens"] == g.tokens and j["metadata"]["node_threshold"] == 0.8
    ids = {n["node_id"] for n in j["nodes"]}
    L = m.cfg.n_layers
    for n in j["nodes"]:
        assert list(n) == CT_NODE
        kind = n["feature_type"]
        if kind == "cross layer transcoder":
            layer, feat, pos = map(int, n["node_id"].split("_"))
            assert n["layer"] == str(layer) and n["ctx_idx"] == pos and n["jsNodeId"] == f"{layer}_{feat}-0"
            assert n["feature"] == (layer + feat) * (layer + feat + 1) // 2 + feat and n["activation"] > 0
        elif kind == "mlp reconstruction error":
            assert n["node_id"] == f"0_{n['layer']}_{n['ctx_idx']}" and n["feature"] == -1
        elif kind == "embedding":
            assert n["node_id"] == f"E_{g.input_ids[n['ctx_idx']]}_{n['ctx_idx']}" and n["layer"] == "E"
        else:
            assert kind == "logit" and n["layer"] == str(L + 1) and n["ctx_idx"] == len(g.input_ids) - 1
            assert n["node_id"] == f"{L + 1}_{n['feature']}_{n['ctx_idx']}" and n["clerp"].startswith("Output ")
    logits = [n for n in j["nodes"] if n["feature_type"] == "logit"]
    assert [n["is_target_logit"] for n in logits] == [True] + [False] * (len(logits) - 1)
    assert sum(n["feature_type"] == "embedding" for n in j["nodes"]) == len(g.input_ids)
    assert j["links"] and all({"source", "target", "weight"} == set(x) for x in j["links"])
    assert all(x["source"] in ids and x["target"] in ids for x in j["links"])
    assert len(j["links"]) == len(g.links)
    path = g.save_json(tmp_path / "tiny.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(j))


def test_nodes_frame_has_what_the_app_needs_and_plot_draws_them(models):
    m = models["llama_gqa"]
    tc = transcoder(m, 1, seed=2)
    g = attribution_graph(PROMPT, transcoders=[tc], model=m)
    assert {"node_id", "kind", "layer", "position", "feature", "hook"} <= set(g.nodes.columns)
    feats = g.nodes[g.nodes["kind"] == "feature"]
    assert (feats["hook"] == tc.hook_name_out).all() and (feats["layer"] == 1).all()
    assert (feats["position"] > 0).all()  # position 0 (the prepended special token) is zeroed, as circuit-tracer
    assert g.tokens[0] == "w1"  # the tiny tokenizer's only special token (its EOS) went in front
    errs = g.nodes[g.nodes["kind"] == "error"]
    assert len(errs) == m.cfg.n_layers * len(g.input_ids)
    fig = g.prune().plot()
    custom = [tuple(c) for trace in fig.data if trace.mode == "markers" for c in trace.customdata]
    assert any(c[1] == "feature" and c[5] == tc.hook_name_out for c in custom)
    assert {c[1] for c in custom} >= {"embedding", "logit"}


def test_bad_input_gets_a_clear_error(models):
    m = models["llama_gqa"]
    with pytest.raises(AttributionGraphError, match="needs transcoders"):
        attribution_graph(PROMPT, transcoders=[], model=m)
    with pytest.raises(AttributionGraphError, match="another model"):
        wide = SAE.random(m.cfg.d_model + 8, 32, hook_name="blocks.0.mlp.hook_in",
                          hook_name_out="blocks.0.hook_mlp_out")
        attribution_graph(PROMPT, transcoders=[wide], model=m)
    with pytest.raises(AttributionGraphError, match="mlp.hook_in"):
        attribution_graph(PROMPT, transcoders=[SAE.random(m.cfg.d_model, 32, hook_name="blocks.0.hook_resid_post")],
                          model=m)
    with pytest.raises(AttributionGraphError, match="two transcoders for layer 0"):
        attribution_graph(PROMPT, transcoders=[transcoder(m, 0), transcoder(m, 0, seed=1)], model=m)
    with pytest.raises(AttributionGraphError, match=r"over the memory budget of 0.0001 GiB") as e:
        attribution_graph(PROMPT, transcoders=[transcoder(m, 0)], model=m, memory_budget_gb=1e-4)
    assert "needs about" in str(e.value) and "tokens" in str(e.value)


@pytest.mark.slow
def test_smollm2_graph_with_the_bundled_transcoders_reproduces_its_logits(model):
    """The real thing: SmolLM2 with transcoder_l6 and transcoder_l9 (every other layer all error)."""
    tcs = [slmviz.load_sae(name, model=model) for name in ("transcoder_l6", "transcoder_l9")]
    g = attribution_graph("The capital of France is", transcoders=tcs, model=model)
    last = model.logits(torch.tensor(g.input_ids))[-1]
    logit = torch.tensor((g.nodes["kind"] == "logit").to_numpy())
    expected = last[torch.tensor(g.nodes.loc[logit.numpy(), "feature"].to_numpy())] - last.mean()
    got = (g.adjacency.sum(1) + g.constant)[logit]
    assert torch.allclose(got, expected, atol=1e-3 * float(expected.abs().max()), rtol=0)
    assert set(g.nodes.loc[g.nodes["kind"] == "feature", "layer"]) == {6, 9}
    assert g.nodes.loc[logit.numpy(), "token"].iloc[0] == " Paris"
    p = g.prune()
    assert 0 < p.kept_nodes.shape[0] < g.nodes.shape[0]


def test_a_named_token_target_is_attributed_like_the_same_top_logit(models):
    """graphs.targets' seam: TokenTargets([t]) for a token t among the top logits gives t's logit row as the default
    graph gives it (the same sources, the same edges), and its rows still sum with the constant to its value."""
    from slmviz.graphs.attribution import TokenTargets

    m = models["gemma3"]
    tcs = [transcoder(m, L, seed=40 + L) for L in range(m.cfg.n_layers)]
    g = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=16, progress=False)
    logits = g.nodes[g.nodes["kind"] == "logit"]
    tok = int(logits["feature"].iloc[2])
    one = attribution_graph(PROMPT, transcoders=tcs, model=m, batch_size=16, progress=False,
                            targets=TokenTargets([tok]))
    n_src = len(g.nodes) - len(logits)
    assert one.nodes["kind"].tolist()[-1] == "logit" and int(one.nodes["feature"].iloc[-1]) == tok
    row_g = g.adjacency[n_src + 2, :n_src]
    row_one = one.adjacency[n_src, :n_src]
    torch.testing.assert_close(row_one, row_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(one.adjacency.sum(1) + one.constant, one.target_values, rtol=1e-4, atol=1e-4)
    assert float(one.target_values[-1]) == pytest.approx(float(g.target_values[n_src + 2]), abs=1e-5)
    with pytest.raises(AttributionGraphError, match="not a token id"):
        attribution_graph(PROMPT, transcoders=tcs, model=m, progress=False, targets=TokenTargets([10**9]))
