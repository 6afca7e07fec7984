"""Cross-layer transcoders (slmviz.replacement.clt): the formula, splicing, and exact attribution graphs.

Checked against references that do not share the CLT's own code paths: the formula written out by hand from the
CLT's tensors on a plain trace's inputs, the model's own logits, generate's KV-cache decoding against full traces,
and the frozen replacement model run forward with one node removed. Not covered here: the file formats
(tests/test_clt_io.py), training, bf16.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import slmviz
from slmviz.graphs.attribution import AttributionGraphError, active_features, attribution_graph
from slmviz.graphs.frozen import prompt_state
from slmviz.replacement.clt import CLTError, CrossLayerTranscoder

PROMPT = "w3 w5 w7 w9 w11 w4"
ARCHS = ("llama_gqa", "llama_bias", "gemma3", "qwen3", "olmo2")


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in ARCHS}


def clt_for(model, seed=0, input_hook="mlp.hook_in", d_sae=48, **kw) -> CrossLayerTranscoder:
    return CrossLayerTranscoder.random(model.cfg.n_layers, model.cfg.d_model, d_sae, seed=seed, input_hook=input_hook,
                                       **kw)


def by_hand(clt, inputs):
    """Each layer's features and y_j = Σ_{L ≤ j} f_L W_dec[L][:, j - L] + b_dec[j] (+ x_j W_skip[j]ᵀ), from the
    tensors alone (float64)."""
    n = clt.n_layers
    W_enc, b_enc = clt.W_enc.detach().double(), clt.b_enc.detach().double()
    feats = []
    for L in range(n):
        h = inputs[L].double() @ W_enc[L] + b_enc[L]
        if clt.architecture == "jumprelu":
            f = h.relu() * (h > clt.threshold.detach().double()[L])
        elif clt.architecture == "topk":
            v, i = h.topk(clt.k, dim=-1)
            f = torch.zeros_like(h).scatter(-1, i, v.relu())
        else:
            f = h.relu()
        feats.append(f)
    outs = []
    for j in range(n):
        y = clt.b_dec.detach().double()[j].expand(inputs[j].shape).clone()
        for L in range(j + 1):
            y += feats[L] @ clt.W_dec[L].detach().double()[:, j - L]
        if clt.W_skip is not None:
            y += inputs[j].double() @ clt.W_skip.detach().double()[j].T
        outs.append(y)
    return feats, outs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("input_hook,architecture,skip", [("mlp.hook_in", "jumprelu", False),
                                                          ("hook_resid_mid", "relu", True),
                                                          ("mlp.hook_in", "topk", False)])
def test_splicing_with_error_terms_keeps_the_logits_and_recons_is_the_formula(models, arch, input_hook,
                                                                               architecture, skip):
    """trace(saes=clt) with error terms: logits bit-equal to the plain trace; every layer's hook_sae_acts_post and
    hook_sae_recons equal the hand formula on that layer's input hook (recons at j sums every layer L ≤ j)."""
    m = models[arch]
    clt = clt_for(m, seed=1, input_hook=input_hook, architecture=architecture, skip=skip,
                  k=5 if architecture == "topk" else None)
    plain = m.trace(PROMPT)
    t = m.trace(PROMPT, saes=clt)
    assert torch.equal(t.logits, plain.logits)
    inputs = [plain[clt.read_hook(L)] for L in range(m.cfg.n_layers)]
    feats, outs = by_hand(clt, inputs)
    for j in range(m.cfg.n_layers):
        out = f"blocks.{j}.hook_mlp_out"
        assert torch.allclose(t[f"{out}.hook_sae_acts_post"].double(), feats[j], atol=1e-5)
        assert torch.allclose(t[f"{out}.hook_sae_recons"].double(), outs[j], atol=1e-4)
        assert torch.allclose(t[f"{out}.hook_sae_error"] + t[f"{out}.hook_sae_recons"], plain[out], atol=1e-5)
    assert (feats[0] > 0).any() and (feats[-1] > 0).any()


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3"])
def test_without_error_terms_every_mlp_output_is_the_formula_of_the_spliced_run(models, arch):
    """use_error_term=False: each hook_mlp_out carries y_j of the inputs the spliced run itself computed, so the
    logits change; the inputs of later layers are those of the replaced run."""
    m = models[arch]
    clt = clt_for(m, seed=2)
    clt.use_error_term = False
    names = [n for L in range(m.cfg.n_layers) for n in (clt.read_hook(L), f"blocks.{L}.hook_mlp_out")]
    t = m.trace(PROMPT, saes=clt, names=names)
    _, outs = by_hand(clt, [t[clt.read_hook(L)] for L in range(m.cfg.n_layers)])
    for j in range(m.cfg.n_layers):
        assert torch.allclose(t[f"blocks.{j}.hook_mlp_out"].double(), outs[j], atol=1e-4)
    assert not torch.allclose(t.logits, m.trace(PROMPT, names=[]).logits)


def test_an_edit_of_layer_0s_features_moves_every_later_layers_reconstruction(models):
    """Zeroing layer 0's features (hook_sae_acts_post) removes their writes from recons at every layer j ≥ 0, and
    the output of each layer moves by exactly recons - its unedited value (the error term stays the clean one)."""
    m = models["gemma3"]
    clt = clt_for(m, seed=3)
    plain = m.trace(PROMPT)
    zero = {"blocks.0.hook_mlp_out.hook_sae_acts_post": lambda x, name: torch.zeros_like(x)}
    t = m.trace(PROMPT, saes=clt, hooks=zero)
    inputs = [t[clt.read_hook(L)] for L in range(m.cfg.n_layers)]
    feats, _ = by_hand(clt, inputs)
    feats[0] = torch.zeros_like(feats[0])
    for j in range(m.cfg.n_layers):
        expected = clt.b_dec.detach().double()[j] + sum(feats[L] @ clt.W_dec[L].detach().double()[:, j - L]
                                                        for L in range(j + 1))
        assert torch.allclose(t[f"blocks.{j}.hook_mlp_out.hook_sae_recons"].double(), expected, atol=1e-4)
    with torch.no_grad():
        clean0 = clt.encode(0, plain[clt.read_hook(0)])
        moved = -(clean0 @ clt.W_dec[0][:, 0])
    assert torch.allclose(t["blocks.0.hook_mlp_out"] - plain["blocks.0.hook_mlp_out"], moved, atol=1e-5)
    assert not torch.allclose(t.logits, plain.logits)


def test_generate_with_a_clt_decodes_as_full_traces_do(models):
    """generate (KV cache, one position per step) with the CLT spliced and no error terms picks, at every step, the
    argmax of a full spliced trace of the text so far: each step's forward starts the shared record afresh."""
    m = models["llama_gqa"]
    clt = clt_for(m, seed=4, d_sae=64)
    clt.use_error_term = False
    ids = m.encode(PROMPT)
    got = m.generate_ids(ids, max_new_tokens=5, saes=clt, stop_at_eos=False)
    plain = m.generate_ids(ids, max_new_tokens=5, stop_at_eos=False)
    seq = ids.tolist()
    for token in got:
        assert token == int(m.trace(torch.tensor(seq), saes=clt, names=[]).logits[-1].argmax())
        seq.append(token)
    assert len(got) == len(plain) == 5


def test_a_clt_of_another_model_or_hook_is_refused(models):
    m = models["llama_gqa"]
    with pytest.raises(AttributionGraphError, match="3 layers.*has 2"):
        attribution_graph(PROMPT, transcoders=CrossLayerTranscoder.random(3, m.cfg.d_model, 8), model=m)
    with pytest.raises(CLTError, match="reads one of"):
        CrossLayerTranscoder(2, 64, 8, input_hook="ln2.hook_normalized")
    with pytest.raises(CLTError, match="needs k"):
        CrossLayerTranscoder(2, 64, 8, architecture="topk")


def targets_by_hand(model, clt, graph):
    """Each target's value from a plain forward: W_enc[L][:, f] · (layer L's input hook) for features, logit minus
    the mean logit at the last position for logits."""
    ids = torch.tensor(graph.input_ids)
    t = model.trace(ids, names=[clt.read_hook(L) for L in range(model.cfg.n_layers)])
    out = torch.zeros(len(graph.nodes))
    kinds = graph.nodes["kind"].to_numpy()
    for i in np.nonzero(kinds == "feature")[0]:
        row = graph.nodes.iloc[i]
        out[i] = t[clt.read_hook(row.layer)][row.position] @ clt.W_enc.detach()[row.layer][:, row.feature]
    last = t.logits[-1]
    for i in np.nonzero(kinds == "logit")[0]:
        out[i] = last[graph.nodes.iloc[i].feature] - last.mean()
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("input_hook,skip", [("mlp.hook_in", False), ("hook_resid_mid", True)])
def test_the_graph_over_a_clt_is_exact_in_its_linear_model(models, arch, input_hook, skip):
    """Σ edges + constant = every target's value from a plain forward (features reading mlp.hook_in or
    hook_resid_mid), with features at every layer."""
    m = models[arch]
    clt = clt_for(m, seed=5, input_hook=input_hook, skip=skip)
    g = attribution_graph(PROMPT, transcoders=clt, model=m, batch_size=16, progress=False)
    expected = targets_by_hand(m, clt, g)
    is_target = torch.tensor(g.nodes["kind"].isin(["feature", "logit"]).to_numpy())
    got = g.adjacency.sum(1) + g.constant
    scale = expected[is_target].abs().max()
    assert torch.allclose(got[is_target], expected[is_target], atol=3e-5 * scale, rtol=0), \
        (got - expected)[is_target].abs().max()
    assert set(g.nodes.loc[g.nodes["kind"] == "feature", "layer"]) == set(range(m.cfg.n_layers))
    assert g.transcoder_names == clt.names


@pytest.mark.parametrize("arch,skip", [("llama_gqa", True), ("gemma3", False), ("olmo2", False)])
def test_removing_a_clt_feature_moves_each_target_by_its_edges_including_its_later_layer_writes(models, arch,
                                                                                                   skip):
    """Removing a layer-0 feature subtracts a · W_dec[0][f, j] from the MLP output of every layer j; in the frozen
    linear model that moves every target by minus the feature's adjacency column, whose edges into the logits thus
    include the writes to layer 1 and later (for a feature at the last position: the change differs without them)."""
    m = models[arch]
    n, d = m.cfg.n_layers, m.cfg.d_model
    clt = clt_for(m, seed=6, skip=skip)
    g = attribution_graph(PROMPT, transcoders=clt, model=m, batch_size=32, progress=False)
    ids = torch.tensor(g.input_ids)
    state = prompt_state(m, ids, clt)
    kinds = g.nodes["kind"].to_numpy()
    feats = np.nonzero(kinds == "feature")[0]
    layer0 = [i for i in feats if g.nodes.iloc[i].layer == 0]

    def targets(deltas):
        reads, normed = clt.frozen_forward(m, state, state.embed[None], deltas)
        out = torch.zeros(len(g.nodes))
        for i in feats:
            row = g.nodes.iloc[i]
            out[i] = reads[row.layer][0, row.position] @ clt.W_enc.detach()[row.layer][:, row.feature]
        last = normed[0, -1] @ m.decoder.params.unembed.T
        for i in np.nonzero(kinds == "logit")[0]:
            out[i] = last[g.nodes.iloc[i].feature] - last.mean()
        return out

    zeros = [torch.zeros(1, len(ids), d) for _ in range(n)]
    with torch.no_grad():
        base = targets(zeros)
        for i in [*layer0[:3], *layer0[-2:]]:
            row = g.nodes.iloc[i]
            deltas = [z.clone() for z in zeros]
            for j in range(n):
                deltas[j][0, row.position] = -row.activation * clt.W_dec[0].detach()[row.feature, j]
            change = targets(deltas) - base
            column = g.adjacency[:, i]
            assert column.abs().max() > 0
            scale = max(float(base.abs().max()), float(column.abs().max()), 1.0)
            assert torch.allclose(change, -column, atol=3e-5 * scale, rtol=0), (row, (change + column).abs().max())
            if row.position < len(ids) - 1:
                continue  # a write after the last attention reaches the logits only at the last position
            # without the later-layer writes the column would be different: they carry part of it
            only_own = [z.clone() for z in zeros]
            only_own[0][0, row.position] = deltas[0][0, row.position]
            partial = targets(only_own) - base
            assert not torch.allclose(partial, change, atol=1e-6)


def test_a_graphs_writes_hold_each_clt_features_decoder_rows_once_however_often_it_fires(models):
    """attribution.Writes: each write's vector is a · W_dec[L][f, j - L] (written out from the tensors), while its
    table holds one row per distinct (feature, layer written); stored per write, a long prompt's rows grew with
    its length (37 MB a token over SmolLM2's CLT) and the memory budget refused prompts past ~55 tokens."""
    m = models["llama_gqa"]
    n = m.cfg.n_layers
    clt = clt_for(m, seed=7, d_sae=16)
    ids = m.encode(PROMPT * 4)
    state = prompt_state(m, ids, clt)
    f_layer, f_pos, f_idx, f_act, _, writes, _ = active_features(clt, state, n, zero_bos=False)
    distinct = {(int(L), int(f)) for L, f in zip(f_layer, f_idx, strict=True)}
    assert len(f_layer) > 2 * len(distinct)  # features fire at several positions each
    assert writes.table.shape[0] == sum(n - L for L, _ in distinct)
    assert len(writes.node) == sum(n - int(L) for L in f_layer)
    node = writes.node
    rows = [clt.W_dec[int(f_layer[i])].detach()[int(f_idx[i]), int(j - f_layer[i])]
            for i, j in zip(node, writes.layer, strict=True)]
    expected = f_act[node, None] * torch.stack(rows)
    assert torch.equal(writes.layer >= f_layer[node], torch.ones(len(node), dtype=torch.bool))
    assert torch.allclose(writes.vec(), expected, atol=1e-6, rtol=0)
    kept = torch.tensor([0, 3, len(f_layer) - 1])
    sub = writes.select(kept)
    assert sub.table is writes.table and set(sub.node.tolist()) == {0, 1, 2}
    assert torch.allclose(sub.vec(), writes.vec(torch.isin(node, kept).nonzero(as_tuple=True)[0]))


CLEAN = [3, 10, 11, 12, 13, 14, 15, 16]
CORRUPTED = [3, 10, 11, 12, 40, 14, 15, 16]
ANSWER, WRONG = 20, 21


def metric_of(logits):
    return logits[-1, ANSWER] - logits[-1, WRONG]


def test_patch_site_sae_over_a_clt_attributes_through_every_layer_a_feature_writes(models):
    """patch(site="sae", saes=clt): each cell's attribution is (f_source - f_target) · d metric / d f, where by hand
    f is a leaf whose writes a · W_dec[L][f, j - L] are added at every hook_mlp_out j ≥ L of a plain target run;
    the exact cells (layer-1 ones start their batched run at layer 1, where layer 0's CLT units never run) equal a
    hand-written hook on a spliced trace."""
    from slmviz.hooks import build_context

    m = models["gemma3"]
    n = m.cfg.n_layers
    clt = clt_for(m, seed=7, d_sae=32)
    r = slmviz.patch(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, site="sae", saes=clt, model=m, top=10)
    frame = r.frame()
    assert set(frame["layer"]) == set(range(n))
    for L in range(n):
        name = f"blocks.{L}.hook_mlp_out.hook_sae_acts_post"
        f_target = m.trace(CORRUPTED, saes=clt, names=[name])[name]
        f_source = m.trace(CLEAN, saes=clt, names=[name])[name]
        leaf = f_target[None].clone().requires_grad_()

        def add(j, L=L, leaf=leaf, f_target=f_target):
            def fn(x, _):
                return x + ((leaf - f_target[None]) @ clt.W_dec[L].detach()[:, j - L]).to(x.dtype)
            return fn

        ctx = build_context(m.hook_names, [], {f"blocks.{j}.hook_mlp_out": add(j) for j in range(L, n)}, batched=True)
        value = metric_of(m.decoder.forward(torch.tensor(CORRUPTED)[None], ctx, slmviz.Variant(), grad=True)[0])
        (grad,) = torch.autograd.grad(value, [leaf])
        want = (f_source - f_target).double() * grad[0].double()
        cells = frame[frame["layer"] == L]
        assert len(cells) > 0
        for row in cells.itertuples():
            assert row.effect == pytest.approx(float(want[row.position, row.feature]), rel=1e-4, abs=1e-6)
    ran = frame.dropna(subset=["exact"])
    assert len(ran) == 10 and ran["layer"].max() >= 1
    for row in ran.itertuples():
        def put(x, _, p=row.position, f=row.feature, value=row.source_act):
            out = x.clone()
            out[p, f] = value
            return out

        t = m.trace(CORRUPTED, saes=clt, names=[], hooks={f"{row.hook}.hook_sae_acts_post": put})
        assert row.exact == pytest.approx(float(metric_of(t.logits)), abs=1e-5)


def test_the_workbench_intervenes_on_and_labels_a_clt_graph(models):
    """Constrained (error terms, patterns and norm scales frozen), zeroing a last-layer CLT feature moves each
    demeaned logit by minus its edge; automatic labels read a feature's summed writes (its direct path to the
    unembedding)."""
    m = models["llama_gqa"]
    clt = clt_for(m, seed=8)
    g = attribution_graph(PROMPT, transcoders=clt, model=m, progress=False)
    nodes = g.nodes
    last = len(g.input_ids) - 1
    feats = nodes[(nodes["kind"] == "feature") & (nodes["layer"] == m.cfg.n_layers - 1) & (nodes["position"] == last)]
    i = int(feats.index[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no feature crosses its threshold: a last-layer feature feeds none
        new = g.intervene({feats.iloc[0].node_id: 0.0}, constrained=True)
    orig = m.logits(torch.tensor(g.input_ids))[-1]
    logit_rows = np.nonzero((nodes["kind"] == "logit").to_numpy())[0]
    for r in logit_rows:
        tok = int(nodes.iloc[r].feature)
        moved = (new[tok] - new.mean()) - (orig[tok] - orig.mean())
        assert float(moved) == pytest.approx(-float(g.adjacency[r, i]), abs=2e-5)
    labels = g.labels
    assert labels and all(v.startswith("[auto]") for v in labels.values())
    g.label(feats.iloc[0].node_id, "edited")
    assert g.labels[feats.iloc[0].node_id] == "edited"



def test_a_corpus_scan_with_a_clt_scans_each_layers_features(models):
    """scan(saes=clt) runs batched, padded forwards: each layer's hook_sae_acts_post is scanned as a trace of each
    document gives it (zero on each window's first row, the row rule of training), layer 1's included, whose
    reconstruction needs layer 0's activations of the same batch."""
    m = models["llama_gqa"]
    clt = clt_for(m, seed=9)
    docs = ["w1 w2 w3 w4 w5 w6", "w9 w8 w7", "w4 w4 w5 w11 w3"]
    names = [f"blocks.{L}.hook_mlp_out.hook_sae_acts_post" for L in range(m.cfg.n_layers)]
    s = slmviz.scan(docs, hooks=names, model=m, saes=clt, top_k=2, progress=False)
    for name in names:
        acts = torch.cat([m.trace(d, saes=clt, names=[name])[name][1:] for d in docs])
        acts = torch.cat([acts, acts.new_zeros(len(docs), acts.shape[1])])
        torch.testing.assert_close(s.mean(name).float(), acts.mean(0), rtol=1e-5, atol=1e-6)


def test_max_feature_nodes_keeps_a_clt_graphs_edges_as_they_are(models):
    """max_feature_nodes=n over a CLT: n features, each edge between kept nodes (later-layer writes included) the
    full graph's."""
    m = models["gemma3"]
    clt = clt_for(m, seed=10)
    full = attribution_graph(PROMPT, transcoders=clt, model=m, progress=False)
    capped = attribution_graph(PROMPT, transcoders=clt, model=m, progress=False, max_feature_nodes=25)
    assert capped.n_features == 25 < full.n_features
    def keys(g):  # node ids collide (layer-0 feature 0_f_p, error 0_L_p): key by what a node is
        return list(zip(*(g.nodes[c].tolist() for c in ("kind", "layer", "position", "feature")), strict=True))

    where = {key: i for i, key in enumerate(keys(full))}
    rows = [where[key] for key in keys(capped)]
    kinds = capped.nodes["kind"].to_numpy()
    targets = np.nonzero(np.isin(kinds, ["feature", "logit"]))[0]
    got = capped.adjacency[targets]
    want = full.adjacency[torch.tensor(rows)[targets]][:, torch.tensor(rows)]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_a_clt_that_writes_only_its_own_layer_is_the_plt_set_it_copies(models):
    """A CLT built from per-layer JumpReLU skip transcoders (W_dec[L][:, 0] = W_dec, every later slot 0) gives the
    PLT set's reconstructions, attribution graph and evaluate_transcoders figures."""
    from slmviz.features.sae import SAE
    from slmviz.replacement.transcoder_set import TranscoderSet

    m = models["gemma3"]
    n, d = m.cfg.n_layers, m.cfg.d_model
    saes = [SAE.random(d, 40, seed=20 + L, architecture="jumprelu", skip=True, hook_name=f"blocks.{L}.mlp.hook_in",
                       hook_name_out=f"blocks.{L}.hook_mlp_out") for L in range(n)]
    clt = CrossLayerTranscoder(n, d, 40, architecture="jumprelu", skip=True)
    with torch.no_grad():
        for L, sae in enumerate(saes):
            clt.W_enc[L], clt.b_enc[L], clt.threshold[L] = sae.W_enc, sae.b_enc, sae.threshold
            clt.W_dec[L][:, 0] = sae.W_dec
            clt.b_dec[L], clt.W_skip[L] = sae.b_dec, sae.W_skip
    plt = TranscoderSet(saes)
    a, b = m.trace(PROMPT, saes=plt), m.trace(PROMPT, saes=clt)
    for L in range(n):
        name = f"blocks.{L}.hook_mlp_out.hook_sae_recons"
        assert torch.allclose(a[name], b[name], atol=1e-5)
    ga = attribution_graph(PROMPT, transcoders=plt, model=m, progress=False)
    gb = attribution_graph(PROMPT, transcoders=clt, model=m, progress=False)
    assert ga.nodes["node_id"].tolist() == gb.nodes["node_id"].tolist()
    assert torch.allclose(ga.adjacency, gb.adjacency, atol=1e-5, rtol=1e-4)
    corpus = ["w1 w2 w3 w4 w5 w6 w7 w8", "w9 w8 w7 w3 w2", "w4 w4 w5 w11 w3 w12 w40"]
    ea = slmviz.evaluate_transcoders(plt, corpus, model=m, progress=False)
    eb = slmviz.evaluate_transcoders(clt, corpus, model=m, progress=False)
    for col in ("explained_variance", "l0"):
        assert np.allclose(ea["layers"][col], eb["layers"][col], atol=1e-5)
    for key in ("ce_loss_score", "top1_agreement", "ce_replaced"):
        assert eb["replaced"][key] == pytest.approx(ea["replaced"][key], abs=1e-5)


@pytest.mark.parametrize("architecture", ["jumprelu", "topk", "relu"])
def test_a_clt_layers_feature_view_encodes_as_the_clt_and_decodes_its_whole_direct_path(models, architecture):
    """CLTLayer.feature_view(), what feature cards read: the CLT's layer encoder exactly (a trace spliced with the
    view gives the CLT's acts), decoder row = the feature's writes summed over layers, labels shared both ways."""
    m = models["llama_gqa"]
    kw = {"k": 5} if architecture == "topk" else {}
    clt = clt_for(m, seed=4, architecture=architecture, **kw)
    clt.model = m
    for L in clt.layers:
        view = clt[L].feature_view()
        assert (view.hook_name, view.hook_name_out, view.d_sae) == (clt.read_hook(L), clt.write_hook(L), clt.d_sae)
        assert view.is_transcoder and view.architecture == clt.architecture
        acts = f"{view.hook_name_out}.hook_sae_acts_post"
        via_view = m.trace(PROMPT, saes=[view], names=[acts])[acts]
        via_clt = m.trace(PROMPT, saes=clt, names=[acts])[acts]
        torch.testing.assert_close(via_view, via_clt, rtol=0, atol=0)
        for f in (0, clt.d_sae - 1):
            want = sum(clt.W_dec[L].detach()[f, i] for i in range(clt.n_layers - L))
            torch.testing.assert_close(view.residual_direction(f), want.float())
    view = clt[1].feature_view()
    view.labels[3] = "edited in a card"
    assert clt.labels[1][3] == "edited in a card" and view.label(3) == "edited in a card"
