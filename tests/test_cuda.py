"""The replacement models on a GPU: a PLT set and a CLT trained with device="cuda", their checkpoints, splicing,
attribution graphs and feature patching, each against the same computation on the CPU; then the other user-facing
paths (train_sae, evaluate_sae / evaluate_transcoders, steering, dashboards, feature scans, patching, ablation,
logit attribution and lens, circuits, the workbench's interventions), each on a GPU against the CPU. Skipped without
CUDA (CI has none; bench/perf/gpu_transcoders.py runs this file on a GPU machine and records the result).

Independent references: the CPU run of the same seed (the coders' init and the batches' order come from CPU
generators, so the two runs start equal and differ by float rounding only), the graph's linear model (edges +
constant = targets), and a checkpoint resumed on the other device.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz.analysis.logit_attribution import logit_attribution
from slmviz.circuits.circuit import circuit, patch_edges
from slmviz.features.dashboard import feature_card, search_features, top_features
from slmviz.features.sae import SAE
from slmviz.graphs.attribution import attribution_graph
from slmviz.graphs.intervene import intervene
from slmviz.replacement.load import load_clt, load_transcoders
from slmviz.training.train import train_transcoders

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

SMALL = dict(d_sae=48, k=4, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512, progress=False,
             dtype="float32", checkpoint_every=0)
PROMPT = [1, 7, 12, 3, 44, 9, 101, 23]
CLEAN = [3, 10, 11, 12, 13, 14, 15, 16]
CORRUPTED = [3, 10, 11, 12, 40, 14, 15, 16]


@pytest.fixture(scope="module", autouse=True)
def exact_fp32():
    """fp32 products in fp32 on the GPU (no TF32), as on the CPU: the comparisons below are of rounding only."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa")


@pytest.fixture(scope="module")
def cpu(folder):
    return slmviz.load(folder)


@pytest.fixture(scope="module")
def gpu(folder):
    return slmviz.load(folder, device="cuda")


@pytest.fixture(scope="module")
def corpus():
    return [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]


def tensors_of(s) -> dict[str, torch.Tensor]:
    """A CLT's tensors, or a PLT set's, each coder's named by its layer."""
    if hasattr(s, "tensors"):
        return s.tensors()
    return {f"{L}.{k}": v for L in s.layers for k, v in s.coder(L).tensors().items()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_exact_graph(g) -> None:
    target = torch.tensor(g.nodes["kind"].isin(["feature", "logit"]).to_numpy())
    got = (g.adjacency.sum(1) + g.constant)[target].cpu()
    want = g.target_values[target].cpu()
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=0), float((got - want).abs().max())


@pytest.mark.parametrize("kind", ["plt", "clt"])
def test_a_set_trained_on_cuda_is_the_cpu_runs_up_to_rounding(cpu, gpu, corpus, tmp_path, kind):
    args = dict(kind=kind, corpus=corpus, tokens=1200, architecture="batchtopk", skip=True, **SMALL)
    on_cpu = train_transcoders(cpu, out=tmp_path / "cpu", **args)
    on_gpu = train_transcoders(gpu, out=tmp_path / "gpu", device="cuda", **args)
    back = load_transcoders(tmp_path / "gpu", model=cpu)  # the files the GPU run wrote, read on the CPU
    ours, theirs = tensors_of(on_cpu), tensors_of(back)
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        # ~10 steps of Adam from the same init and batches; BatchTopK can flip a near-tie, so a bound, not equality
        assert relative(theirs[name], t) < 0.05, (name, relative(theirs[name], t))
    for name, t in tensors_of(on_gpu).items():
        assert t.device.type == "cuda", name
        assert torch.equal(t.cpu(), theirs[name]), name  # what it returned is what it saved


@pytest.mark.parametrize("kind", ["plt", "clt"])
def test_on_cuda_splicing_is_exact_and_graphs_are_the_cpus(cpu, gpu, corpus, tmp_path, kind):
    train_transcoders(cpu, out=tmp_path / "set", kind=kind, corpus=corpus, tokens=1200, architecture="batchtopk",
                      skip=True, **SMALL)
    on_cpu = load_transcoders(tmp_path / "set", model=cpu)
    on_gpu = load_transcoders(tmp_path / "set", model=gpu)
    spliced = gpu.trace(PROMPT, saes=on_gpu)
    assert torch.equal(spliced.logits, gpu.trace(PROMPT).logits)  # error terms on: nothing changes
    name = "blocks.1.hook_mlp_out.hook_sae_acts_post"
    acts = {d: m.trace(PROMPT, saes=s, names=[name])[name] for d, m, s in (("cpu", cpu, on_cpu), ("gpu", gpu, on_gpu))}
    assert relative(acts["gpu"], acts["cpu"]) < 1e-4
    g_cpu = attribution_graph(PROMPT, transcoders=on_cpu, model=cpu, progress=False)
    g_gpu = attribution_graph(PROMPT, transcoders=on_gpu, model=gpu, progress=False)
    assert_exact_graph(g_gpu)
    assert g_gpu.n_features == g_cpu.n_features and g_gpu.nodes["node_id"].equals(g_cpu.nodes["node_id"])
    for column in ("activation", "probability"):
        a, b = (torch.tensor(g.nodes[column].to_numpy()).nan_to_num() for g in (g_gpu, g_cpu))
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), column
    assert relative(g_gpu.constant, g_cpu.constant) < 1e-4
    assert relative(g_gpu.target_values, g_cpu.target_values) < 1e-4
    assert relative(g_gpu.adjacency, g_cpu.adjacency) < 1e-4


def test_feature_patching_over_a_clt_on_cuda_is_the_cpus(cpu, gpu, corpus, tmp_path):
    train_transcoders(cpu, out=tmp_path / "clt", kind="clt", corpus=corpus, tokens=1200, architecture="batchtopk",
                      skip=True, **SMALL)
    frames = {}
    for device, m in (("cpu", cpu), ("gpu", gpu)):
        clt = load_clt(tmp_path / "clt", model=m)
        frames[device] = slmviz.patch(CLEAN, CORRUPTED, answer=20, wrong=21, site="sae", saes=clt, model=m,
                                      top=10).frame()
    keys = ["layer", "position", "feature"]
    a, b = (frames[d].sort_values(keys).reset_index(drop=True) for d in ("cpu", "gpu"))
    assert a[keys].equals(b[keys])
    assert torch.allclose(torch.tensor(b["effect"].to_numpy()), torch.tensor(a["effect"].to_numpy()),
                          rtol=1e-3, atol=1e-5)


def test_a_clt_checkpoint_written_on_cuda_resumes_on_the_cpu(cpu, gpu, corpus, tmp_path):
    """Train on a GPU box, finish on a laptop: the checkpoint (weights, Adam moments, dead-feature counters,
    BatchTopK threshold) holds no CUDA tensors that the CPU run cannot take."""
    calls = []

    def stop(update):
        stats = update.stats
        calls.append(stats["tokens"])
        if len(calls) == 5:
            raise KeyboardInterrupt

    args = dict(kind="clt", corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk", skip=True)
    with pytest.raises(KeyboardInterrupt):
        train_transcoders(gpu, device="cuda", **args, **{**SMALL, "progress": stop, "checkpoint_every": 0})
    resumed = train_transcoders(cpu, **args, **SMALL)
    whole = train_transcoders(cpu, **{**args, "out": tmp_path / "whole"}, **SMALL)
    for name, t in whole.tensors().items():
        assert relative(resumed.tensors()[name], t) < 0.05, name


# --- the other user-facing paths: each on the GPU against the same call on the CPU ----------------------------------
def on_gpu(sae: SAE) -> SAE:
    """A copy of a CPU SAE on the GPU (the same weights)."""
    return copy.deepcopy(sae).to("cuda")


def assert_close(a, b, rtol: float = 1e-4, atol: float = 1e-5, what: str = "") -> None:
    a, b = (x.detach().double().cpu() if isinstance(x, torch.Tensor) else torch.tensor(np.array(x, dtype=float))
            for x in (a, b))
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True), (what, float((a - b).abs().nan_to_num().max()))


def assert_same_numbers(a: dict, b: dict, rtol: float = 1e-3, atol: float = 1e-5) -> None:
    assert set(a) == set(b)
    for k, v in a.items():
        if isinstance(v, float) and math.isnan(v):
            assert math.isnan(b[k]), k
        else:
            assert b[k] == pytest.approx(v, rel=rtol, abs=atol), k


def random_transcoder(layer: int, seed: int = 0, **kwargs) -> SAE:
    return SAE.random(64, 48, seed=seed, scale=0.1, hook_name=f"blocks.{layer}.mlp.hook_in",
                      hook_name_out=f"blocks.{layer}.hook_mlp_out", **{"architecture": "relu", **kwargs})


@pytest.mark.parametrize("skip", [False, True], ids=["sae", "skip_transcoder"])
def test_train_sae_on_cuda_is_the_cpus_run_and_stays_there(cpu, gpu, corpus, tmp_path, skip):
    args = (dict(hook="blocks.1.mlp.hook_in", hook_out="blocks.1.hook_mlp_out", architecture="batchtopk", skip=True)
            if skip else dict(hook="blocks.1.hook_resid_post", architecture="topk"))
    ours = slmviz.train_sae(cpu, corpus=corpus, tokens=1200, out=tmp_path / "cpu", **args, **SMALL)
    theirs = slmviz.train_sae(gpu, corpus=corpus, tokens=1200, out=tmp_path / "gpu", **args, **SMALL)
    for name, t in ours.tensors().items():
        got = theirs.tensors()[name]
        assert got.device.type == "cuda", name  # where the model runs: the splice takes it as it is
        assert relative(got, t) < 0.05, (name, relative(got, t))  # ~10 Adam steps from the same init and batches
    again = slmviz.train_sae(gpu, corpus=corpus, tokens=1200, out=tmp_path / "gpu", **args, **SMALL)  # finished
    assert again.W_enc.device.type == "cuda" and torch.equal(again.W_enc, theirs.W_enc)
    assert_close(gpu.trace(PROMPT, saes=[theirs], names=[]).logits, gpu.trace(PROMPT, names=[]).logits, atol=1e-4)


def test_evaluate_sae_and_transcoders_on_cuda_are_the_cpus(cpu, gpu, corpus):
    tc = random_transcoder(1, seed=3, architecture="jumprelu", skip=True)
    args = dict(tokens=None, window=16, batch_tokens=128, progress=False)
    ours = slmviz.evaluate_sae(tc, corpus[:6], model=cpu, **args)
    theirs = slmviz.evaluate_sae(on_gpu(tc), corpus[:6], model=gpu, **args)
    assert ours["tokens"] == theirs["tokens"] > 0
    assert_same_numbers(ours, theirs)
    sets = [slmviz.evaluate_transcoders([random_transcoder(L, seed=L) for L in (0, 1)], corpus[:6], model=cpu,
                                        **args)]
    sets.append(slmviz.evaluate_transcoders([on_gpu(random_transcoder(L, seed=L)) for L in (0, 1)], corpus[:6],
                                            model=gpu, **args))
    a, b = (r["layers"] for r in sets)
    assert a[["layer", "tokens"]].equals(b[["layer", "tokens"]])
    for column in ("explained_variance", "l0", "frac_dead", "frac_dense", "mse"):
        assert_close(b[column].to_numpy(), a[column].to_numpy(), rtol=1e-3, what=column)
    # The scores divide by (CE ablated - CE clean), which random coders on a tiny model make small against the
    # spliced CE (scores near -150): the GPU's 1e-7 in each CE becomes ~4e-3 of a score, so the scores get 1e-2.
    ours, theirs = sets[0]["replaced"], sets[1]["replaced"]
    scores = [k for k in ours if k.endswith("_score")]
    assert_same_numbers({k: v for k, v in ours.items() if k not in scores},
                        {k: v for k, v in theirs.items() if k not in scores})
    assert_same_numbers({k: ours[k] for k in scores}, {k: theirs[k] for k in scores}, rtol=1e-2)


def test_steering_dashboards_and_feature_scans_on_cuda_are_the_cpus(cpu, gpu, corpus):
    sae = SAE.random(64, 48, seed=1, architecture="topk", k=4, hook_name="blocks.1.hook_resid_post")
    hook = f"{sae.hook_name_out}.hook_sae_acts_post"
    out = {}
    for device, m, s in (("cpu", cpu, sae), ("gpu", gpu, on_gpu(sae))):
        scan = slmviz.scan(corpus[:16], hooks=[hook, "blocks.0.hook_mlp_out"], saes=[s], model=m, top_k=5, window=16,
                           variants="no_causal_mask", progress=False)
        out[device] = dict(
            steered=m.trace(PROMPT, hooks=slmviz.steer(s, {3: 8.0, 5: -2.0}), names=[]).logits,
            scan=scan, card=feature_card(s, 3, scan=scan, model=m),
            top=top_features(m.trace(PROMPT, saes=[s]), s),
            promotes=search_features(s, "w5", model=m), nearest=s.nearest(7),
            effects=s.logit_effects(7, model=m))
    a, b = out["cpu"], out["gpu"]
    assert_close(b["steered"], a["steered"], what="steered logits")
    for h in (hook, "blocks.0.hook_mlp_out"):
        assert int(a["scan"].stats[h].n) == int(b["scan"].stats[h].n)
        for stat in ("mean", "max", "min"):
            assert_close(getattr(b["scan"], stat)(h), getattr(a["scan"], stat)(h), rtol=1e-3, what=f"{h} {stat}")
    damage = [d["scan"].damage_summary().select_dtypes("number").to_numpy() for d in (a, b)]
    assert_close(damage[1], damage[0], rtol=1e-3, atol=1e-4, what="damage")
    assert a["card"].stats["tokens"] == b["card"].stats["tokens"]
    assert b["card"].stats["max"] == pytest.approx(a["card"].stats["max"], rel=1e-3)
    for key in ("effects", "nearest"):
        card_a, card_b = getattr(a["card"], key), getattr(b["card"], key)
        assert card_a.select_dtypes("int").equals(card_b.select_dtypes("int")), key
        assert a[key].select_dtypes("int").equals(b[key].select_dtypes("int")), key
    assert_close(b["effects"]["effect"].to_numpy(), a["effects"]["effect"].to_numpy(), what="logit effects")
    assert_close(b["nearest"]["cosine"].to_numpy(), a["nearest"]["cosine"].to_numpy(), what="nearest")
    assert a["top"]["kept"].equals(b["top"]["kept"])
    assert_close(b["top"]["activation"].to_numpy(), a["top"]["activation"].to_numpy(), what="top features")
    assert_close(b["promotes"]["effect"].to_numpy(), a["promotes"]["effect"].to_numpy(), what="search")


def test_patching_ablation_and_logit_attribution_on_cuda_are_the_cpus(cpu, gpu, corpus):
    out: dict[str, dict] = {}
    for device, m in (("cpu", cpu), ("gpu", gpu)):
        r = out[device] = {}
        for site in ("resid_pre", "z", "pattern"):
            r[site] = slmviz.patch(CLEAN, CORRUPTED, answer=20, wrong=21, site=site, model=m).values
        r["per_cell"] = slmviz.patch(CLEAN, CORRUPTED, answer=20, wrong=21, site="k", engine="per_cell",
                                     model=m).values
        for site in ("resid_pre", "z"):
            r[f"attribution {site}"] = slmviz.patch(CLEAN, CORRUPTED, answer=20, wrong=21, site=site, model=m,
                                                    method="attribution").values
        hooks = ["blocks.0.attn.hook_z", "blocks.0.mlp.hook_post", "blocks.1.hook_mlp_out"]
        scan = slmviz.scan(corpus[:10], hooks=hooks, model=m, window=16, progress=False)
        for kind, reference in (("zero", None), ("mean", scan), ("mean", corpus[:3]), ("resample", corpus[:3])):
            hooks = slmviz.ablation(heads=[(0, 1)], neurons=[(0, 5)], layers=[(1, "mlp")], kind=kind,
                                    reference=reference, model=m)
            r[f"ablate {kind} {type(reference).__name__}"] = m.trace(PROMPT, hooks=hooks, names=[]).logits
        t = m.trace(PROMPT)
        for by in ("layer", "head", "neuron"):
            r[f"dla {by}"] = logit_attribution(t, 20, 21, by=by)["attribution"].to_numpy()
        lens = t.logit_lens(k=3)
        r["lens ids"], r["lens probs"] = lens["pred_id"].to_numpy(), lens["prob"].to_numpy()
    for key, want in out["cpu"].items():
        assert_close(out["gpu"][key], want, atol=1e-4, what=key)


def test_circuits_on_cuda_are_the_cpus(cpu, gpu):
    args = dict(answer=20, wrong=21)
    out: dict[str, dict] = {}
    masks = None
    for device, m in (("cpu", cpu), ("gpu", gpu)):
        r = out[device] = {}
        for method in ("eap", "eap-ig", "exact"):
            c = circuit(CLEAN, CORRUPTED, model=m, method=method, steps=3, **args)
            assert c.scores.device.type == "cpu"
            r[method] = c.scores
        masks = masks if masks is not None else torch.stack([c.circuit_mask(n) for n in (3, 30)])
        r["faithfulness"] = c.faithfulness([0, 5, 40]).select_dtypes("number").to_numpy()
        r["patch_edges"] = patch_edges(CLEAN, CORRUPTED, edges=masks, model=m, **args)
        # a dataset, and a metric fn (the per-row metric, not the built-in logit difference)
        r["dataset"] = circuit([CLEAN, CORRUPTED], [CORRUPTED, CLEAN], answer=[20, 21], wrong=[21, 20], model=m,
                               method="eap").scores
        r["metric fn"] = circuit(CLEAN, CORRUPTED, metric=lambda logits: logits[-1, 20] - logits[-1, 21], model=m,
                                 method="eap-ig", steps=2).scores
    for key, want in out["cpu"].items():
        assert_close(out["gpu"][key], want, rtol=1e-3, atol=1e-4, what=key)


def test_graph_interventions_and_subgraphs_on_cuda_are_the_cpus(cpu, gpu):
    tcs = [random_transcoder(L, seed=L) for L in (0, 1)]
    g_cpu = attribution_graph(PROMPT, transcoders=tcs, model=cpu, progress=False)
    g_gpu = attribution_graph(PROMPT, transcoders=[on_gpu(t) for t in tcs], model=gpu, progress=False)
    top = g_cpu.pin_top(3, logit=True)
    assert g_gpu.pin_top(3, logit=True) == top
    a, b = g_cpu.subgraph(), g_gpu.subgraph()
    assert a.nodes["node_id"].equals(b.nodes["node_id"])
    assert_same_numbers(a.scores, b.scores)
    assert_close(b.links["weight"].to_numpy(), a.links["weight"].to_numpy(), rtol=1e-3, what="subgraph links")
    for constrained in (True, False):
        ours = intervene(g_cpu, {top[0]: "-1x", top[1]: 0.0}, constrained=constrained, continuation=3)
        theirs = intervene(g_gpu, {top[0]: "-1x", top[1]: 0.0}, constrained=constrained, continuation=3)
        assert_close(theirs.logits, ours.logits, atol=1e-4, what=f"constrained={constrained}")
        assert_close(theirs.original, ours.original, atol=1e-4)
        assert theirs.crossed == ours.crossed and theirs.continuation == ours.continuation
        pd.testing.assert_frame_equal(theirs.top(5)[["rank", "token"]], ours.top(5)[["rank", "token"]])


def test_qk_attributions_and_head_loadings_on_cuda_are_the_cpus(cpu, gpu):
    """graphs.qk and graphs.head_loadings compute where the model runs: on a GPU graph they give the CPU's split of
    the same attention score and edge (results on the CPU either way), and the GPU's still sums exactly."""
    from slmviz.graphs.head_loadings import head_loadings
    from slmviz.graphs.qk import qk_attribution

    tcs = [random_transcoder(L, seed=30 + L, skip=True) for L in (0, 1)]
    g_cpu = attribution_graph(PROMPT, transcoders=tcs, model=cpu, progress=False)
    g_gpu = attribution_graph(PROMPT, transcoders=[on_gpu(t) for t in tcs], model=gpu, progress=False)
    a, b = (qk_attribution(g, layer=1, head=2, query=-1, key=3, max_pairs=None) for g in (g_cpu, g_gpu))
    assert b.score == pytest.approx(a.score, rel=1e-4, abs=1e-5)
    size = b.scale * float(b.query_vectors.sum(0).norm() * b.key_vectors.sum(0).norm())
    assert abs(b.pairs["contribution"].sum() - b.score) <= 3e-5 * size + 1e-6
    assert a.nodes["node_id"].equals(b.nodes["node_id"]) and b.query_vectors.device.type == "cpu"
    assert_close(b.query_vectors, a.query_vectors, rtol=1e-4, atol=1e-5 * float(a.query_vectors.abs().max()))
    assert_close(b.key_vectors, a.key_vectors, rtol=1e-4, atol=1e-5 * float(a.key_vectors.abs().max()))
    nodes = g_cpu.nodes
    source = nodes.loc[(nodes["kind"] == "embedding") & (nodes["position"] == 2), "node_id"].iat[0]
    target = nodes.loc[nodes["kind"] == "logit", "node_id"].iat[0]
    ours, theirs = (head_loadings(g, source, target).sort_values(["layer", "head"]) for g in (g_cpu, g_gpu))
    scale = max(abs(ours.attrs["edge"]), float(ours["weight"].abs().max()))
    for column in ("weight", "one_hop"):
        assert_close(theirs[column].to_numpy(), ours[column].to_numpy(), rtol=1e-4, atol=1e-5 * scale, what=column)
    assert theirs.attrs["recomputed_edge"] == pytest.approx(theirs.attrs["edge"], abs=2e-5 * scale)
