"""The scan's fast paths give the slow paths' results exactly: a sparse coder's histogram and top-k over its fired
entries only (scans.reduce.Fired), and SAE features from a plain forward plus each SAE's encoder instead of the
spliced forward (scans.batches._encoder_plan). Tiny random models of two families."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz.features.dashboard import acts_hook
from slmviz.features.sae import SAE
from slmviz.scans import batches
from slmviz.scans.reduce import EDGES, N_BINS, HookPartial, positive_entries, top_rows


def dense_histogram(x: torch.Tensor) -> torch.Tensor:
    bins = torch.bucketize(x.float().contiguous(), EDGES) + torch.arange(x.shape[1]) * N_BINS
    return torch.bincount(bins.flatten(), minlength=x.shape[1] * N_BINS).view(x.shape[1], N_BINS)


def test_fired_entries_give_the_dense_histogram_and_top_rows_with_ties_and_rare_features():
    gen = torch.Generator().manual_seed(0)
    for trial in range(150):
        n, f = int(torch.randint(1, 60, (), generator=gen)), int(torch.randint(1, 9, (), generator=gen))
        density = float(torch.rand((), generator=gen))
        x = torch.rand(n, f, generator=gen) * (torch.rand(n, f, generator=gen) < density)
        if trial % 3 == 0:
            x = (x * 4).round() / 4  # many ties among fired values
        if trial % 5 == 0:
            x[:, 0] = 0  # a feature that never fires
        k = int(torch.randint(1, n + 1, (), generator=gen))
        fired = positive_entries(x)
        assert fired is not None
        assert torch.equal(fired.histogram(n), dense_histogram(x))
        assert torch.equal(fired.top_rows(x, k), top_rows(x, k)), (trial, n, f, k)


def test_features_below_zero_or_nan_take_the_dense_path():
    assert positive_entries(torch.tensor([[0.0, -1.0], [2.0, 0.0]])) is None
    assert positive_entries(torch.tensor([[0.0, float("nan")], [2.0, 0.0]])) is None


def test_of_tokens_with_and_without_fired_entries_is_the_same_partial():
    gen = torch.Generator().manual_seed(3)
    n, f, c = 40, 6, 5
    x = torch.rand(n, f, generator=gen) * (torch.rand(n, f, generator=gen) < 0.2)
    keys = torch.arange(n) * 7
    ctx = torch.randint(-1, n, (n, c), generator=gen)
    ids = torch.randint(0, 50, (n,), generator=gen)
    a = HookPartial.of_tokens(x, keys, ctx, ids, None, 8)
    slow = HookPartial.of_tokens.__func__  # the dense reductions: as if x had an entry below 0
    import slmviz.scans.reduce as reduce

    real = reduce.positive_entries
    reduce.positive_entries = lambda _x: None
    try:
        b = slow(HookPartial, x, keys, ctx, ids, None, 8)
    finally:
        reduce.positive_entries = real
    for name in ("n", "mean", "m2", "min", "max", "hist", "top_val", "top_key", "top_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.top_acts.nan_to_num(-7), b.top_acts.nan_to_num(-7))


@pytest.mark.parametrize("family", ["llama_gqa", "gemma3"])
def test_a_scan_of_sae_features_without_the_decoders_equals_the_spliced_scan(family, tmp_path, monkeypatch):
    m = slmviz.load(build_tiny_model(tmp_path / family, family, seed=2))
    d = m.cfg.d_model
    coders = [SAE.random(d, 32, seed=layer, architecture="relu", hook_name=f"blocks.{layer}.mlp.hook_in",
                         hook_name_out=f"blocks.{layer}.hook_mlp_out") for layer in (0, 1)]
    hooks = [acts_hook(c) for c in coders]
    docs = [" ".join(f"w{(i * 5 + j) % 90}" for j in range(10 + i % 17)) for i in range(24)]
    calls = []
    real = batches._forward_encoders

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(batches, "_forward_encoders", counted)
    fast = slmviz.scan(docs, hooks=hooks, saes=coders, model=m, top_k=4, batch_tokens=128, progress=False)
    assert calls  # the encoder path ran
    monkeypatch.setattr(batches, "_encoder_plan", lambda *a: None)
    spliced = slmviz.scan(docs, hooks=hooks, saes=coders, model=m, top_k=4, batch_tokens=128, progress=False)
    # the values themselves, as run_batch gets them: equal, and no autograd graph (the splice runs in inference mode)
    ids = torch.tensor([m.encode(docs[3]).tolist()[:12], m.encode(docs[5]).tolist()[:12]])
    names = [*hooks, *(f"{c.hook_name_out}.hook_sae_input" for c in coders), coders[1].hook_name_out]
    monkeypatch.undo()
    got, _ = batches._forward(m, ids, torch.tensor([12, 12]), names, False, coders)
    monkeypatch.setattr(batches, "_encoder_plan", lambda *a: None)
    want, _ = batches._forward(m, ids, torch.tensor([12, 12]), names, False, coders)
    for h in names:
        assert torch.equal(got[h], want[h]) and not got[h].requires_grad, h
    for h in hooks:
        a, b = fast.stats[h], spliced.stats[h]
        for name in ("n", "mean", "m2", "min", "max", "hist", "top_val", "top_key", "top_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (h, name)


def test_the_encoder_path_is_refused_where_the_decoder_matters(tmp_path):
    coder = SAE.random(16, 8, seed=0, architecture="relu", hook_name="blocks.0.mlp.hook_in",
                       hook_name_out="blocks.0.hook_mlp_out")
    acts = "blocks.0.hook_mlp_out.hook_sae_acts_post"
    assert batches._encoder_plan([acts], [coder]) == {acts: coder}
    assert batches._encoder_plan([acts, "blocks.0.hook_mlp_out.hook_sae_recons"], [coder]) is None
    coder.use_error_term = False  # the reconstruction flows on: the forward is not the plain one
    assert batches._encoder_plan([acts], [coder]) is None
