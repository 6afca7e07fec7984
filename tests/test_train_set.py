"""train_transcoders (one forward feeds every layer's coder) and transcoder sets on disk (slmviz, circuit-tracer,
Gemma Scope 2 layouts), on a tiny random LLaMA; no real model is loaded here.

Independent references: train_sae on each layer alone (the same seed and batches must give the same coders), a
run never interrupted (for resume), and the attribution graph of the set before saving (for the round trips).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import build_tiny_model
from safetensors.torch import load_file, save_file

import slmviz
from slmviz.features.sae import SAE
from slmviz.formats.checkpoint import CheckpointError, read_checkpoint
from slmviz.replacement.load import load_transcoders
from slmviz.replacement.transcoder_set import TranscoderSet, TranscoderSetError
from slmviz.training.train import train_sae, train_transcoders

SMALL = dict(d_sae=48, k=4, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512, progress=False,
             dtype="float32", checkpoint_every=0)
PROMPT = [1, 7, 12, 3, 44, 9, 101, 23]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return slmviz.load(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa"))


@pytest.fixture(scope="module")
def corpus():
    return [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]


@pytest.fixture(scope="module")
def trained(tiny, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("set") / "plt"
    return train_transcoders(tiny, corpus=corpus, tokens=1200, out=out, architecture="batchtopk", skip=True, **SMALL)


def random_set(model, seed: int = 0, skip: bool = True, architecture: str = "jumprelu") -> TranscoderSet:
    d = model.cfg.d_model
    return TranscoderSet([SAE.random(d, 2 * d, seed=seed + L, architecture=architecture, skip=skip,
                                     k=4 if architecture == "topk" else None,
                                     hook_name=f"blocks.{L}.mlp.hook_in", hook_name_out=f"blocks.{L}.hook_mlp_out")
                          for L in range(model.cfg.n_layers)], name="random")


def assert_same_coders(a: TranscoderSet, b: TranscoderSet, exact: bool = True) -> None:
    assert a.layers == b.layers
    for L in a.layers:
        for name, t in a.coder(L).tensors().items():
            u = b.coder(L).tensors()[name]
            if exact:
                assert torch.equal(t, u), (L, name)
            else:
                assert torch.allclose(t, u, rtol=1e-4, atol=1e-5), (L, name, float((t - u).abs().max()))


def test_one_pass_equals_each_layer_trained_alone(tiny, corpus, trained, tmp_path):
    """Every layer's coder is what train_sae trains for that layer alone with the same arguments (same seed, same
    kept rows, same shuffles), within fp32 rounding; the forward is what is shared."""
    assert trained.kind == "plt" and trained.layers == list(range(tiny.cfg.n_layers)) and trained.d_sae == 48
    for L in trained.layers:
        alone = train_sae(tiny, f"blocks.{L}.mlp.hook_in", corpus, hook_out=f"blocks.{L}.hook_mlp_out", tokens=1200,
                          out=tmp_path / f"alone{L}", architecture="batchtopk", skip=True, **SMALL)
        for name, t in alone.tensors().items():
            got = trained.coder(L).tensors()[name]
            assert torch.allclose(got, t, rtol=1e-4, atol=1e-6), (L, name, float((got - t).abs().max()))


def stop_at_layer_1_in_block_1():
    """A progress callback that interrupts the run at layer 1's first step of block 1. Each layer steps through a
    whole block before the next layer does, so that step comes after the third change of the layer that stepped
    (block 0: layer 0, then 1; block 1: layer 0, then 1)."""
    last: dict[int, int] = {}
    stepped: list[int] = []

    def stop(update):
        stats = update.stats
        layer = next(L for L, f in stats["layers"].items() if f["tokens"] != last.get(L))
        last.update({L: f["tokens"] for L, f in stats["layers"].items()})
        if not stepped or stepped[-1] != layer:
            stepped.append(layer)
        if stepped == [0, 1, 0, 1]:
            raise KeyboardInterrupt

    return stop


def test_a_run_killed_mid_block_resumes_to_the_same_weights(tiny, corpus, trained, tmp_path):
    """Stopped inside a block (after one layer's steps of it and before the next layer's: the checkpoint on disk
    then holds a set half way through the block), resumed, it ends with exactly the uninterrupted run's weights."""
    with pytest.raises(KeyboardInterrupt):
        train_transcoders(tiny, corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk",
                          skip=True, **{**SMALL, "progress": stop_at_layer_1_in_block_1()})
    cursors = {name: v["cursor"] for name, v in read_checkpoint(tmp_path / "cut").coders.items()}
    where = {name: (c["block"], c["batch"]) for name, c in cursors.items()}
    assert where["L0"] > where["L1"] == (1, 0), cursors  # layer 0 is through block 1, layer 1 not started on it
    resumed = train_transcoders(tiny, corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk",
                                skip=True, **SMALL)
    assert_same_coders(trained, resumed)
    again = train_transcoders(tiny, corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk",
                              skip=True, **SMALL)  # finished: loaded, not re-run
    assert_same_coders(trained, again)
    checkpoint = read_checkpoint(tmp_path / "cut")  # finished: no weights kept twice
    assert checkpoint.tensors == {} and all(v["cursor"]["finished"] for v in checkpoint.coders.values())
    with pytest.raises(CheckpointError, match="d_sae"):
        train_transcoders(tiny, corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk",
                          skip=True, **{**SMALL, "d_sae": 32})


def test_checkpoints_wait_for_checkpoint_every_not_each_block_end(tiny, corpus, tmp_path):
    """A checkpoint is written once `checkpoint_every` seconds have passed, not at every block's end (a real set's is
    1.8 GB): stopped in its second block, a run with an hour's interval has written none, and starts over."""
    with pytest.raises(KeyboardInterrupt):
        train_transcoders(tiny, corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk",
                          skip=True, **{**SMALL, "progress": stop_at_layer_1_in_block_1(), "checkpoint_every": 3600})
    assert read_checkpoint(tmp_path / "cut") is None


def test_a_run_killed_after_its_last_block_resumes_to_the_same_weights(tiny, corpus, trained, tmp_path,
                                                                      monkeypatch):
    """Killed after the last step and before the set is saved (in BatchTopK's threshold pass): the checkpoint on
    disk is not a finished one, and the resume ends with the same weights."""
    from slmviz.training import loop

    real = loop.threshold_rows

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "threshold_rows", killed)
    with pytest.raises(KeyboardInterrupt):
        train_transcoders(tiny, corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk",
                          skip=True, **SMALL)
    assert not any(v["cursor"]["finished"] for v in read_checkpoint(tmp_path / "cut").coders.values())
    monkeypatch.setattr(loop, "threshold_rows", real)
    # finished where it stands from the checkpoint alone (bench/studies/replacement_curve.py's way), it is the same set
    assert_same_coders(trained, loop.Run.from_checkpoint(tmp_path / "cut").finish(tiny, corpus))
    resumed = train_transcoders(tiny, corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk",
                                skip=True, **SMALL)
    assert_same_coders(trained, resumed)


def test_progress_reports_every_layer(tiny, corpus, tmp_path):
    seen = []
    train_transcoders(tiny, layers=[1], corpus=corpus, tokens=300, out=tmp_path / "one", **{**SMALL,
                      "progress": lambda u: seen.append(u.stats)})
    assert seen and set(seen[-1]["layers"]) == {1}
    last = seen[-1]["layers"][1]
    assert {"explained_variance", "l0", "dead_fraction", "tokens"} <= set(last)
    assert seen[-1]["tokens"] >= 300


def test_the_set_splices_exactly_and_graphs(tiny, trained):
    """trace(saes=set) with error terms leaves the logits as they are; the set is one replacement model for
    attribution_graph (edges + constant = targets)."""
    plain = tiny.trace(PROMPT, names=[])
    spliced = tiny.trace(PROMPT, saes=trained, names=[f"blocks.{L}.hook_mlp_out.hook_sae_acts_post"
                                                      for L in trained.layers])
    assert torch.equal(plain.logits, spliced.logits)
    assert spliced["blocks.1.hook_mlp_out.hook_sae_acts_post"].shape == (len(PROMPT), 48)
    g = slmviz.attribution_graph(PROMPT, transcoders=trained, model=tiny, progress=False)
    assert torch.allclose(g.adjacency.sum(1) + g.constant, g.target_values, atol=1e-4)
    assert len(g.transcoder_names) == tiny.cfg.n_layers


@pytest.mark.parametrize("fmt", ["slmviz", "circuit-tracer"])
def test_round_trip_gives_identical_features_and_graphs(tiny, tmp_path, fmt):
    ts = random_set(tiny)
    before = slmviz.attribution_graph(PROMPT, transcoders=ts, model=tiny, progress=False)
    ts.save(tmp_path / fmt, format=fmt)
    back = load_transcoders(tmp_path / fmt, model=tiny)
    assert_same_coders(ts, back)
    after = slmviz.attribution_graph(PROMPT, transcoders=back, model=tiny, progress=False)
    assert list(after.nodes["node_id"]) == list(before.nodes["node_id"])
    assert torch.equal(after.adjacency, before.adjacency)


def test_circuit_tracer_layout_is_what_circuit_tracer_reads(tiny, tmp_path):
    """config.yaml with model_kind transcoder_set and TransformerLens hook names; W_enc stored [d_sae, d_model]
    (circuit-tracer's F.linear orientation), W_dec [d_sae, d_model], the threshold under its module's name."""
    ts = random_set(tiny)
    ts.save(tmp_path / "ct", format="circuit-tracer")
    config = yaml.safe_load((tmp_path / "ct" / "config.yaml").read_text())
    assert config["model_kind"] == "transcoder_set"
    assert (config["feature_input_hook"], config["feature_output_hook"]) == ("mlp.hook_in", "mlp.hook_out")
    assert config["transcoders"] == [f"layer_{L}.safetensors" for L in range(tiny.cfg.n_layers)]
    state = load_file(tmp_path / "ct" / "layer_0.safetensors")
    d, s = tiny.cfg.d_model, 2 * tiny.cfg.d_model
    assert state["W_enc"].shape == (s, d) and state["W_dec"].shape == (s, d) and state["W_skip"].shape == (d, d)
    assert torch.equal(state["W_enc"], ts.coder(0).W_enc.detach().T)
    assert torch.equal(state["activation_function.threshold"], ts.coder(0).threshold.detach())


def test_a_topk_set_has_no_circuit_tracer_form(tiny, tmp_path):
    with pytest.raises(TranscoderSetError, match="TopK"):
        random_set(tiny, architecture="topk").save(tmp_path / "ct", format="circuit-tracer")


def test_gemma_scope_transcoder_all_loads_as_one_set(tiny, tmp_path):
    ts = random_set(tiny)
    root = tmp_path / "transcoder_all"
    for L, sae in ts.coders.items():
        folder = root / f"layer_{L}_width_16k_l0_small_affine"
        folder.mkdir(parents=True)
        t = sae.tensors()
        save_file({"w_enc": t["W_enc"].contiguous(), "w_dec": t["W_dec"].contiguous(), "b_enc": t["b_enc"],
                   "b_dec": t["b_dec"], "threshold": t["threshold"],
                   "affine_skip_connection": t["W_skip"].T.contiguous()}, str(folder / "params.safetensors"))
    back = load_transcoders(root, model=tiny)
    assert_same_coders(ts, back)
    before = slmviz.attribution_graph(PROMPT, transcoders=ts, model=tiny, progress=False)
    after = slmviz.attribution_graph(PROMPT, transcoders=back, model=tiny, progress=False)
    assert torch.equal(after.adjacency, before.adjacency)
    # a second width for layer 0: which one is meant must be said
    other = root / "layer_0_width_65k_l0_small_affine"
    other.mkdir()
    (other / "params.safetensors").write_bytes((root / "layer_0_width_16k_l0_small_affine" /
                                                "params.safetensors").read_bytes())
    with pytest.raises(TranscoderSetError, match="several transcoders for one layer"):
        load_transcoders(root, model=tiny)
    assert load_transcoders(root, model=tiny, width="16k").layers == ts.layers


def test_bad_sets_are_clear_errors_naming_the_file(tiny, tmp_path):
    ts = random_set(tiny)
    # a missing layer (circuit-tracer layout without the list)
    ts.save(tmp_path / "gap", format="circuit-tracer")
    config = yaml.safe_load((tmp_path / "gap" / "config.yaml").read_text())
    del config["transcoders"]
    (tmp_path / "gap" / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "gap" / "layer_0.safetensors").unlink()
    with pytest.raises(TranscoderSetError, match=r"no layer file for layers \[0\]"):
        load_transcoders(tmp_path / "gap", model=tiny)
    # d_sae differing between files
    ts.save(tmp_path / "width", format="circuit-tracer")
    narrow = SAE.random(tiny.cfg.d_model, 8, seed=3, architecture="jumprelu", skip=True,
                        hook_name="blocks.1.mlp.hook_in", hook_name_out="blocks.1.hook_mlp_out")
    TranscoderSet([ts.coder(0), narrow]).save(tmp_path / "narrow", format="circuit-tracer")
    (tmp_path / "width" / "layer_1.safetensors").write_bytes((tmp_path / "narrow" / "layer_1.safetensors").read_bytes())
    with pytest.raises(TranscoderSetError, match="layer_1.safetensors: d_sae 8 differs"):
        load_transcoders(tmp_path / "width", model=tiny)
    # hooks slmviz has no counterpart for
    ts.save(tmp_path / "hooks", format="circuit-tracer")
    config = yaml.safe_load((tmp_path / "hooks" / "config.yaml").read_text())
    config["feature_input_hook"] = "hook_attn_out"
    (tmp_path / "hooks" / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(TranscoderSetError, match="hook_attn_out"):
        load_transcoders(tmp_path / "hooks", model=tiny)
    # a set for another model: slmviz layout naming it, and widths that do not fit
    ts.save(tmp_path / "other")
    meta = json.loads((tmp_path / "other" / "transcoder_set.json").read_text())
    meta["model"] = "SmolLM2-135M-Instruct"
    (tmp_path / "other" / "transcoder_set.json").write_text(json.dumps(meta))
    with pytest.raises(TranscoderSetError, match="a set for 'SmolLM2-135M-Instruct'"):
        load_transcoders(tmp_path / "other", model=tiny)
    wide = TranscoderSet([SAE.random(tiny.cfg.d_model * 2, 8, architecture="relu", hook_name="blocks.0.mlp.hook_in",
                                     hook_name_out="blocks.0.hook_mlp_out")])
    wide.save(tmp_path / "wide")
    with pytest.raises(TranscoderSetError, match="another model"):
        load_transcoders(tmp_path / "wide", model=tiny)
    # two coders for one layer, a coder at another site
    with pytest.raises(TranscoderSetError, match="two transcoders for layer 0"):
        TranscoderSet([ts.coder(0), ts.coder(0)])
    with pytest.raises(TranscoderSetError, match="hook_resid_post"):
        TranscoderSet([SAE.random(tiny.cfg.d_model, 8, hook_name="blocks.0.hook_resid_post")])
    # the prepared set by name, before it is prepared
    with pytest.raises(TranscoderSetError, match="slmviz prepare --transcoders plt"):
        load_transcoders("plt", model=tiny)


def test_set_evaluation_matches_evaluate_sae_layer_by_layer(tiny, corpus, trained):
    """evaluate_transcoders' per-layer figures are evaluate_sae's for each coder, from one forward; a one-layer set
    replaced alone gives evaluate_sae's CE-loss and KL scores exactly."""
    from slmviz.replacement.evaluate import evaluate_transcoders

    r = evaluate_transcoders(trained, corpus, model=tiny, tokens=600, window=16, batch_tokens=128, progress=False)
    for L in trained.layers:
        alone = slmviz.evaluate_sae(trained.coder(L), corpus, model=tiny, tokens=600, window=16, batch_tokens=128,
                                    progress=False)
        row = r["layers"].set_index("layer").loc[L]
        for key in ("explained_variance", "l0", "frac_dead"):
            assert row[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-6), (L, key)
    one = TranscoderSet([trained.coder(1)])
    r1 = evaluate_transcoders(one, corpus, model=tiny, tokens=600, window=16, batch_tokens=128, progress=False)
    alone = slmviz.evaluate_sae(trained.coder(1), corpus, model=tiny, tokens=600, window=16, batch_tokens=128,
                                progress=False)
    assert r1["replaced"]["ce_loss_score"] == pytest.approx(alone["ce_loss_score"], rel=1e-5)
    assert r1["replaced"]["kl_score"] == pytest.approx(alone["kl_score"], rel=1e-5)
    assert 0 <= r["replaced"]["top1_agreement"] <= 1 and r["replaced"]["targets"] > 0


def test_max_feature_nodes_keeps_the_full_graphs_edges_among_the_chosen(tiny):
    """With max_feature_nodes, the graph keeps that many features (circuit-tracer's rounds by partial influence);
    every kept edge equals the uncapped graph's, and the unchosen features' effects move into `constant`, so
    Σ edges + constant is still each target's value."""
    ts = random_set(tiny)
    full = slmviz.attribution_graph(PROMPT, transcoders=ts, model=tiny, progress=False, batch_size=8)
    n = full.n_features
    cap = n // 3
    capped = slmviz.attribution_graph(PROMPT, transcoders=ts, model=tiny, progress=False, batch_size=8,
                                      max_feature_nodes=cap, update_interval=1)
    assert capped.n_features == cap
    # by (kind, layer, position, feature): circuit-tracer's node ids repeat (layer-0 feature "0_1_5" and the error
    # node of layer 1, position 5)
    key = ["kind", "layer", "position", "feature"]
    index = {k: i for i, k in enumerate(full.nodes[key].itertuples(index=False, name=None))}
    rows = torch.tensor([index[k] for k in capped.nodes[key].itertuples(index=False, name=None)])
    assert (capped.nodes["kind"] == "feature").sum() == cap
    targets = capped.nodes["kind"].isin(["feature", "logit"]).to_numpy()
    sub = full.adjacency[rows][:, rows]
    assert torch.allclose(capped.adjacency[targets], sub[targets], rtol=1e-4, atol=1e-4), \
        float((capped.adjacency[targets] - sub[targets]).abs().max())
    assert torch.allclose(capped.adjacency.sum(1) + capped.constant, capped.target_values, atol=1e-3)
    with pytest.raises(slmviz.AttributionGraphError, match="max_feature_nodes="):
        slmviz.attribution_graph(PROMPT, transcoders=ts, model=tiny, progress=False, memory_budget_gb=0.005)
