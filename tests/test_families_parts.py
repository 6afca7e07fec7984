"""Every part of slmviz on a tiny GPT-2, Pythia (GPT-NeoX) and Gemma 2: patching, direct logit attribution,
ablation, corpus scans, EAP / EAP-IG with exact faithfulness ends, a SAELens-format SAE on hook_resid_pre, per-layer
and cross-layer transcoders trained and spliced exactly, attribution graphs exact in their linear model (learned
positions inside the embedding nodes), QK attributions that sum to the score (before Gemma 2's cap, the capped value
beside it) and head loadings. Trace and cached generation: tests/test_families_gpt2_neox_gemma2.py.
Not covered: the circuit-tracer JSON's viewer, real checkpoints, bf16.
"""

from __future__ import annotations

import json

import pytest
import torch
from family_models import NEW_FAMILIES, build_family_model
from test_attribution_graph import targets_from_a_plain_forward

import slmviz
from slmviz.features.sae import SAE
from slmviz.graphs.attribution import attribution_graph
from slmviz.graphs.qk import qk_attribution
from slmviz.hooks import layer_hook_name

FAMILIES = list(NEW_FAMILIES)
PROMPT = [1, 3, 5, 7, 9, 11, 4, 8]
CORRUPT = [1, 3, 5, 7, 9, 12, 4, 8]  # differs at position 5 only
ANSWER, WRONG = 10, 20
CORPUS = [" ".join(f"w{(i * 7 + j * 3) % 120 + 2}" for j in range(20)) for i in range(30)]
SMALL = dict(d_sae=32, k=4, tokens=600, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=256,
             progress=False, dtype="float32", checkpoint_every=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-parts")
    return {arch: slmviz.load(build_family_model(root / arch, arch)) for arch in FAMILIES}


def transcoders(m) -> list[SAE]:
    """Random relu skip transcoders at every layer but the last (all error there)."""
    d = m.cfg.d_model
    return [SAE.random(d, d, seed=L, architecture="relu", skip=True, hook_name=layer_hook_name(L, "mlp.hook_in"),
                       hook_name_out=layer_hook_name(L, "hook_mlp_out")) for L in range(m.cfg.n_layers - 1)]


@pytest.fixture(scope="module")
def graphs(models):
    return {arch: attribution_graph(PROMPT, transcoders=transcoders(m), model=m, progress=False)
            for arch, m in models.items()}


@pytest.mark.parametrize("arch", FAMILIES)
def test_patching_the_differing_token_restores_the_clean_run(models, arch):
    """resid_pre of layer 0 at the one differing position carries the whole difference: the clean metric there, the
    corrupted one at the positions the two prompts share; attribution patching has the same shape."""
    m = models[arch]
    r = slmviz.patch(PROMPT, CORRUPT, answer=ANSWER, wrong=WRONG, site="resid_pre", model=m)
    assert r.values.shape == (m.cfg.n_layers, len(PROMPT))
    assert float(r.values[0, 5]) == pytest.approx(r.clean, abs=1e-5)
    assert float((r.values[0, :5] - r.corrupted).abs().max()) <= 1e-5
    heads = slmviz.patch(PROMPT, CORRUPT, answer=ANSWER, wrong=WRONG, site="heads", model=m)
    assert heads.values.shape == (m.cfg.n_layers, m.cfg.n_heads)
    grad = slmviz.patch(PROMPT, CORRUPT, answer=ANSWER, wrong=WRONG, site="resid_pre", model=m, method="attribution")
    assert grad.values.shape == r.values.shape


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("by", ["layer", "head"])
def test_direct_logit_attribution_rows_sum_to_the_logit_difference(models, arch, by):
    """Learned positions and the final LayerNorm's bias sit in the remainder row; with Gemma 2's logit cap the rows
    sum to the difference before the cap (attrs), the capped one beside it."""
    t = models[arch].trace(torch.tensor(PROMPT))
    frame = t.logit_attribution(ANSWER, WRONG, by=by)
    target = frame.attrs.get("logit_diff_before_cap", frame.attrs["logit_diff"])
    assert float(frame["attribution"].sum()) == pytest.approx(target, abs=1e-4 * max(1.0, abs(target)))
    assert frame.attrs["logit_diff"] == pytest.approx(float(t.logits[-1, ANSWER] - t.logits[-1, WRONG]), abs=1e-6)
    assert ("logit_diff_before_cap" in frame.attrs) == (arch == "gemma2")


@pytest.mark.parametrize("arch", FAMILIES)
def test_ablation_and_a_corpus_scan_run(models, arch):
    m = models[arch]
    ids = torch.tensor(PROMPT)
    ablated = m.trace(ids, hooks=slmviz.ablation(heads=[(0, 1)], model=m), names=[layer_hook_name(0, "attn.hook_z")])
    assert float(ablated[layer_hook_name(0, "attn.hook_z")][:, 1].abs().max()) == 0.0
    assert not torch.equal(ablated.logits, m.logits(ids))
    hook = layer_hook_name(0, "mlp.hook_post")
    s = slmviz.scan(CORPUS[:6], hooks=[hook], top_k=3, model=m, progress=False)
    top = s.top_examples(hook, index=1)
    assert len(top) == 3 and top["activation"].is_monotonic_decreasing


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("method", ["eap", "eap-ig"])
def test_circuits_empty_gives_the_corrupted_metric_and_full_the_clean(models, arch, method):
    """Exact edge patching with every edge corrupted is the corrupted run, with none the clean one: on Pythia's
    parallel blocks too, where attention of layer L feeds no MLP of layer L."""
    edges = slmviz.graph_edges(models[arch])
    assert (("a0.h0", "m0") in edges) == (arch != "gpt_neox") and ("a0.h0", "m1") in edges
    c = slmviz.circuit(PROMPT, CORRUPT, answer=ANSWER, wrong=WRONG, model=models[arch], method=method, steps=3)
    ends = c.faithfulness([0, len(c.edges)])
    assert ends["metric"].iloc[0] == pytest.approx(c.corrupted, abs=1e-4)
    assert ends["metric"].iloc[1] == pytest.approx(c.clean, abs=1e-4)


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_saelens_sae_on_hook_resid_pre_loads_and_splices_exactly(models, arch, tmp_path):
    """Saved in SAELens's format (cfg.json + sae_weights.safetensors, as SAELens's GPT-2 SAEs on resid_pre), loaded
    for this model: with the error term on, the logits are the model's."""
    m = models[arch]
    SAE.random(m.cfg.d_model, 32, seed=0, architecture="relu", hook_name="blocks.1.hook_resid_pre").save(tmp_path)
    assert "blocks.1.hook_resid_pre" in json.dumps(json.loads((tmp_path / "cfg.json").read_text()))
    sae = slmviz.load_sae(tmp_path, model=m)
    ids = torch.tensor(PROMPT)
    t = m.trace(ids, saes=[sae])
    assert float((t.logits - m.logits(ids)).abs().max()) <= 1e-5 * float(t.logits.abs().max())
    assert t["blocks.1.hook_resid_pre.hook_sae_acts_post"].shape == (len(PROMPT), 32)
    with pytest.raises(Exception, match="d_in|width|d_model"):
        bad = tmp_path / "other_width"
        SAE.random(m.cfg.d_model + 1, 8, seed=0, architecture="relu", hook_name="blocks.1.hook_resid_pre").save(bad)
        slmviz.load_sae(bad, model=m)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("kind", ["plt", "clt"])
def test_transcoder_sets_train_and_splice_exactly(models, arch, kind, tmp_path):
    m = models[arch]
    ts = slmviz.train_transcoders(m, layers="all", corpus=CORPUS, kind=kind, out=tmp_path / kind, **SMALL)
    ids = torch.tensor(PROMPT)
    assert float((m.trace(ids, saes=ts).logits - m.logits(ids)).abs().max()) <= 1e-5 * float(m.logits(ids).abs().max())


@pytest.mark.parametrize("arch", FAMILIES)
def test_attribution_graphs_are_exact_in_their_linear_model_and_save_circuit_tracer_json(models, graphs, arch,
                                                                                         tmp_path):
    """Σ edges into each feature + the bias constant = its input from a plain forward (LayerNorm's centring is linear
    with its scale frozen; GPT-2's learned positions ride in the embedding nodes); the logits too where they are not
    capped (Gemma 2's logit targets are before the cap)."""
    m, g = models[arch], graphs[arch]
    g._encoders = {L: tc.W_enc.detach() for L, tc in enumerate(transcoders(m))}
    expected = targets_from_a_plain_forward(m, g)
    kinds = g.nodes["kind"]
    targets = ["feature"] if arch == "gemma2" else ["feature", "logit"]
    is_target = torch.tensor(kinds.isin(targets).to_numpy())
    got = g.adjacency.sum(1) + g.constant
    scale = float(expected[is_target].abs().max())
    assert torch.allclose(got[is_target], expected[is_target], atol=2e-5 * scale, rtol=0)
    g.save_json(tmp_path / "graph.json")
    saved = json.loads((tmp_path / "graph.json").read_text())
    assert {"metadata", "nodes", "links"} <= set(saved)
    ids = {n["node_id"] for n in saved["nodes"]}
    assert all(link["source"] in ids and link["target"] in ids for link in saved["links"])


@pytest.mark.parametrize("arch", FAMILIES)
def test_qk_pairs_sum_to_the_score_and_head_loadings_split_an_edge(models, graphs, arch):
    """Pairs (learned positions inside the embedding nodes) sum to the score; on Gemma 2 that is the score before the
    cap, and capped_score is the model's hook_attn_scores."""
    m, g = models[arch], graphs[arch]
    layer = m.cfg.n_layers - 1
    qk = qk_attribution(g, layer=layer, head=1, query=-1, key=-2)
    name = layer_hook_name(layer, "attn.hook_attn_scores")
    model_score = m.trace(torch.tensor(PROMPT), names=[name])[name][1, -1, -2].item()
    assert float(qk.pairs["contribution"].sum()) == pytest.approx(qk.score, abs=1e-4 * max(1.0, abs(qk.score)))
    if arch == "gemma2":
        assert qk.capped_score == pytest.approx(model_score, abs=1e-6)
        cap = m.cfg.attn_softcap
        assert qk.capped_score == pytest.approx(cap * torch.tanh(torch.tensor(qk.score / cap)).item(), abs=1e-5)
    else:
        assert qk.capped_score is None and qk.score == pytest.approx(model_score, abs=1e-6)
    feature = g.nodes[g.nodes.kind == "feature"].iloc[0]
    logit = g.nodes[g.nodes.kind == "logit"].iloc[0]
    loads = g.head_loadings(feature["node_id"], logit["node_id"])
    assert len(loads) > 0 and "edge" in loads.attrs
