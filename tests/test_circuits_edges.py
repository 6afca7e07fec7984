"""The component graph and exact edge patching (docs/circuits.md), on tiny models of every family.

Each patched edge is checked against a hand-written hook that adds (a_u^corrupted - a_u^clean) to the destination's
input; patching every edge into v against replacing v's whole input; the empty set and the full graph against the
clean and corrupted runs. Not covered here: EAP / EAP-IG scores (tests/test_circuits_eap.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import slmviz
from slmviz.circuits.circuit import circuit, patch_edges, prepare
from slmviz.circuits.engine import head_writes, patched_metrics, post_scale_hook
from slmviz.circuits.graph import ComponentGraph, EdgeNameError, graph_edges
from slmviz.tokens import PromptError

FAMILIES = ["llama_gqa", "llama_bias", "qwen2", "mistral_window", "gemma3", "qwen3", "olmo2"]
CLEAN = [3, 17, 5, 99, 42, 8, 11, 60]
CORRUPTED = [3, 17, 6, 99, 40, 8, 11, 60]  # differs at positions 2 and 4
ANSWER, WRONG = 5, 6


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in FAMILIES}


def logit_diff(logits: torch.Tensor) -> float:
    return float(logits[-1, ANSWER] - logits[-1, WRONG])


# --- the graph ------------------------------------------------------------------------------------------
def expected_edges(n_layers: int, h: int, g: int) -> int:
    """Every source before every destination: layer L's q/k/v read the input and layers < L; its MLP also reads
    layer L's heads; the logits read everything."""
    total = 0
    for layer in range(n_layers):
        before = 1 + layer * (h + 1)
        total += (h + 2 * g) * before + (before + h)
    return total + 1 + n_layers * (h + 1)


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_graph_has_every_source_before_every_destination(models, arch):
    m = models[arch]
    cfg = m.cfg
    edges = graph_edges(m)
    assert len(edges) == expected_edges(cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == ComponentGraph.of(m).n_edges
    assert len(set(edges)) == len(edges)
    assert edges[0] == ("input", "a0.h0<q>") and edges[-1] == (f"m{cfg.n_layers - 1}", "logits")
    targets = {t for _, t in edges}
    assert f"a0.g{cfg.n_kv_heads - 1}<k>" in targets and f"a0.g{cfg.n_kv_heads}<k>" not in targets
    assert ("a0.h0", "m0") in edges and ("a0.h0", "a0.h1<q>") not in edges and ("m0", "a0.h0<q>") not in edges


@pytest.mark.slow
def test_smollm2_and_gemma_have_the_documented_edge_counts(model):
    """70,651 and 5,644 edges with keys and values per KV group (123,211 and 10,342 if ungrouped, as EAP-IG)."""
    from transformers import AutoConfig

    from slmviz.config import config_from_hf
    from slmviz.loading.bundled import prepare as prepare_bundled

    assert len(graph_edges(model)) == 70_651
    # the graph reads only the configuration: Gemma's, without loading its 1 GB of weights
    gemma = config_from_hf(AutoConfig.from_pretrained(str(prepare_bundled("gemma-3-270m"))))
    assert len(graph_edges(SimpleNamespace(cfg=gemma))) == 5_644
    for cfg, ungrouped in ((model.cfg, 123_211), (gemma, 10_342)):
        assert expected_edges(cfg.n_layers, cfg.n_heads, cfg.n_heads) == ungrouped


# --- head writes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILIES)
def test_head_writes_sum_to_attn_out(models, arch):
    """Each head's write (attn.hook_result, scaled by the run's post-attention norm where the family has one) adds
    up to what the attention adds to the residual stream, so the residual a destination reads is the sum of its
    sources' writes plus terms that no run changes."""
    m = models[arch]
    for layer in range(m.cfg.n_layers):
        scale = post_scale_hook(m, layer)
        names = [f"blocks.{layer}.attn.hook_result", f"blocks.{layer}.hook_attn_out", *([scale] if scale else [])]
        t = m.trace(CLEAN, names=names)
        writes = head_writes(m, layer, t[names[0]][None], t[scale][None] if scale else None)[0]  # [pos, h, d]
        b_o = m.decoder.params.layers[layer].b_o
        total = writes.sum(1) + (b_o if b_o is not None and scale is None else 0)
        torch.testing.assert_close(total, t[names[1]], rtol=1e-5, atol=1e-5 * float(t[names[1]].abs().max()))


# --- exact edge patching --------------------------------------------------------------------------------
def source_value(m, trace, source: str) -> torch.Tensor:
    """a_u [pos, d_model] of one run, read from a trace by hand."""
    if source == "input":
        return trace["hook_embed"]
    layer = int(source[1:].split(".")[0])
    if source.startswith("m"):
        return trace[f"blocks.{layer}.hook_mlp_out"]
    head = int(source.split(".h")[1])
    scale = post_scale_hook(m, layer)
    writes = head_writes(m, layer, trace[f"blocks.{layer}.attn.hook_result"][None],
                         trace[scale][None] if scale else None)[0]
    return writes[:, head]


def destination_hook(m, target: str, delta: torch.Tensor | None = None, whole: torch.Tensor | None = None):
    """{hook name: fn} that adds `delta` [pos, d] to (or replaces by `whole`) destination `target`'s input only."""
    if target == "logits":
        name, index = f"blocks.{m.cfg.n_layers - 1}.hook_resid_post", None
    elif target.startswith("m"):
        name, index = f"blocks.{int(target[1:])}.hook_mlp_in", None
    else:
        layer, rest = target[1:].split(".", 1)
        kind = rest[rest.index("<") + 1]
        name, index = f"blocks.{layer}.hook_{kind}_input", int(rest[1:rest.index("<")])

    def fn(x: torch.Tensor, _name: str) -> torch.Tensor:
        x = x.clone()
        view = x if index is None else x[:, index]
        if whole is not None:
            view[...] = whole
        else:
            view += delta
        return x

    return {name: fn}


def sample_edges(m) -> list[tuple[str, str]]:
    last = m.cfg.n_layers - 1
    h, g = m.cfg.n_heads - 1, m.cfg.n_kv_heads - 1
    return [("input", "a0.h1<q>"), ("input", f"a0.g{g}<k>"), ("input", "a0.g0<v>"), ("a0.h1", "m0"),
            (f"a0.h{h}", f"a1.g{g}<k>"), ("m0", "a1.h0<q>"), ("m0", f"a1.g{g}<v>"), ("a0.h0", "m1"),
            (f"a{last}.h1", "logits"), (f"m{last}", "logits"), ("input", "logits"), ("m0", f"m{last}")]


@pytest.mark.parametrize("arch", FAMILIES)
def test_patching_one_edge_equals_a_hand_written_hook(models, arch):
    m = models[arch]
    clean, corrupted = m.trace(CLEAN), m.trace(CORRUPTED)
    edges = sample_edges(m)
    got = patch_edges(CLEAN, CORRUPTED, edges=[[e] for e in edges], answer=ANSWER, wrong=WRONG, model=m)
    for (source, target), value in zip(edges, got, strict=True):
        delta = source_value(m, corrupted, source) - source_value(m, clean, source)
        want = logit_diff(m.trace(CLEAN, hooks=destination_hook(m, target, delta=delta), names=[]).logits)
        assert value == pytest.approx(want, abs=2e-5), (source, target)


@pytest.mark.parametrize("arch", FAMILIES)
def test_patching_every_edge_into_v_equals_patching_its_whole_input(models, arch):
    m = models[arch]
    graph = ComponentGraph.of(m)
    corrupted = m.trace(CORRUPTED)
    last = m.cfg.n_layers - 1
    cases = {"a1.h2<q>": corrupted["blocks.1.hook_resid_pre"], "a1.g0<v>": corrupted["blocks.1.hook_resid_pre"],
             "m0": corrupted["blocks.0.hook_resid_mid"], "logits": corrupted[f"blocks.{last}.hook_resid_post"]}
    for target, whole in cases.items():
        into = [e for e in graph.edges() if e[1] == target]
        value = patch_edges(CLEAN, CORRUPTED, edges=into, answer=ANSWER, wrong=WRONG, model=m)
        want = logit_diff(m.trace(CLEAN, hooks=destination_hook(m, target, whole=whole), names=[]).logits)
        assert value == pytest.approx(want, abs=2e-5), target


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_empty_set_and_the_full_graph_give_the_clean_and_corrupted_metrics(models, arch):
    m = models[arch]
    graph = ComponentGraph.of(m)
    clean = logit_diff(m.trace(CLEAN, names=[]).logits)
    corrupted = logit_diff(m.trace(CORRUPTED, names=[]).logits)
    runs, _ = prepare(m, CLEAN, CORRUPTED, ANSWER, WRONG)
    empty, full = patch_edges(CLEAN, CORRUPTED, edges=[[], graph.edges()], answer=ANSWER, wrong=WRONG, model=m)
    assert (empty, full) == (runs[0].clean_metric, runs[0].corrupted_metric)  # exactly: no run needed
    assert empty == pytest.approx(clean, abs=2e-5) and full == pytest.approx(corrupted, abs=2e-5)
    # The same two sets through the patched runs themselves (the shortcut off) agree to rounding.
    ran = patched_metrics(m, graph, runs, [torch.zeros_like(graph.real()), graph.real()], shortcuts=False)
    assert ran[0, 0].item() == pytest.approx(empty, abs=2e-5) and ran[1, 0].item() == pytest.approx(full, abs=2e-5)


def test_many_sets_run_as_one_batch_and_equal_one_at_a_time(models):
    m = models["gemma3"]
    graph = ComponentGraph.of(m)
    edges = graph.edges()
    sets = [edges[::3], edges[1::5], edges[:10], [("a1.h0", "logits")], edges[-20:]]
    together = patch_edges(CLEAN, CORRUPTED, edges=sets, answer=ANSWER, wrong=WRONG, model=m)
    alone = [patch_edges(CLEAN, CORRUPTED, edges=s, answer=ANSWER, wrong=WRONG, model=m) for s in sets]
    assert together == pytest.approx(alone, abs=1e-5)
    # A dataset of pairs is the mean of its pairs.
    other = ([3, 9, 5, 99, 2, 8], [3, 9, 6, 99, 2, 8])
    both = patch_edges([CLEAN, other[0]], [CORRUPTED, other[1]], edges=sets[0], answer=ANSWER, wrong=WRONG, model=m)
    second = patch_edges(*other, edges=sets[0], answer=ANSWER, wrong=WRONG, model=m)
    assert both == pytest.approx((alone[0] + second) / 2, abs=1e-6)


def test_faithfulness_runs_from_the_corrupted_to_the_clean_metric(models):
    m = models["llama_gqa"]
    c = circuit(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, model=m, method="exact")
    total = c.graph.n_edges
    f = c.faithfulness([0, 1, 5, 20, total])
    assert list(f.columns) == ["n_edges", "metric", "normalized"]
    assert f["metric"].iloc[0] == c.corrupted and f["metric"].iloc[-1] == c.clean  # exactly
    assert f["normalized"].iloc[0] == 0 and f["normalized"].iloc[-1] == 1
    # Each size is the clean run with every edge outside the top n patched.
    top = c.top(5)
    outside = [e for e in c.graph.edges() if e not in set(zip(top.source, top.target, strict=True))]
    assert f["metric"].iloc[2] == pytest.approx(
        patch_edges(CLEAN, CORRUPTED, edges=outside, answer=ANSWER, wrong=WRONG, model=m), abs=1e-6)
    reached = f[f["normalized"] >= 0.8]["n_edges"].min()
    assert f.attrs["smallest_80"] == reached
    assert c.smallest(0.8) <= reached


# --- bad input ------------------------------------------------------------------------------------------
def test_bad_input_gets_a_clear_error(models, tiny_dirs):
    m = models["llama_gqa"]
    with pytest.raises(PromptError, match=r"same number of tokens.*\['w3', 'w4', 'w5'\].*\['w3', 'w4'\]"):
        patch_edges("w3 w4 w5", "w3 w4", edges=[("m0", "logits")], answer=ANSWER, model=m)
    with pytest.raises(ValueError, match="is 2 tokens"):
        circuit(CLEAN, CORRUPTED, answer="w5 w6", wrong=WRONG, model=m)
    with pytest.raises(EdgeNameError, match="did you mean 'a1.h2<q>'"):
        patch_edges(CLEAN, CORRUPTED, edges=[("m0", "a1.h2<Q>")], answer=ANSWER, model=m)
    with pytest.raises(EdgeNameError, match="did you mean 'a0.h3'"):
        patch_edges(CLEAN, CORRUPTED, edges=["a0.h33->logits"], answer=ANSWER, model=m)
    with pytest.raises(EdgeNameError, match="no edge m1 -> a1.h0<q>"):
        patch_edges(CLEAN, CORRUPTED, edges=[("m1", "a1.h0<q>")], answer=ANSWER, model=m)
    with pytest.raises(EdgeNameError, match="KV groups"):
        patch_edges(CLEAN, CORRUPTED, edges=[("m0", "a1.h0<k>")], answer=ANSWER, model=m)  # keys are per group
    with pytest.raises(ValueError, match="method must be one of"):
        circuit(CLEAN, CORRUPTED, answer=ANSWER, model=m, method="acdc")
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        circuit(CLEAN, CORRUPTED, answer=ANSWER, model=m, method="eap-ig", steps=0)
