"""Activation patching: the identities every sweep must satisfy, the batched engine against the per-cell
reference on every site, and the errors a user sees for bad input.

Runs on a tiny random GQA model (4 query heads, 2 KV heads) except the SmolLM2 sanity check at the end.
Does not cover: timing (bench/perf/patching.py), attribution patching (tests/test_attribution_patching.py),
agreement with TransformerLens itself (TL is not installed; the semantics are pinned by the identities).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ARCHS

import slmviz
from slmviz.hooks import build_context
from slmviz.interventions import patching
from slmviz.interventions.patching import patch
from slmviz.interventions.result import _writer, patched_trace
from slmviz.interventions.sites import SITES

CLEAN = [3, 10, 11, 12, 13, 14, 15, 16]
CORRUPTED = [3, 10, 11, 12, 40, 14, 15, 16]  # differs at position 4 only
FIRST_DIFF = 4
ANSWER, WRONG = 20, 21


def _sweep(m, site, **kw):
    return patch(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, site=site, model=m, **kw)


@pytest.fixture(scope="module")
def m(tiny_model):
    return tiny_model


def test_patching_a_run_with_its_own_activations_changes_nothing(m):
    for site in ("resid_pre", "z", "k", "heads"):
        r = patch(CLEAN, CLEAN, answer=ANSWER, wrong=WRONG, site=site, model=m, engine="per_cell")
        assert r.clean == r.corrupted
        torch.testing.assert_close(r.values, torch.full_like(r.values, r.clean), rtol=0, atol=1e-6)


def test_patching_resid_pre_at_every_position_reproduces_the_source_run(m):
    clean = m.trace(CLEAN, names=[f"blocks.{L}.hook_resid_pre" for L in range(m.cfg.n_layers)])
    for layer in range(m.cfg.n_layers):
        name = f"blocks.{layer}.hook_resid_pre"
        ctx = build_context(m.hook_names, [], {name: _writer(clean[name], (slice(None),))})
        logits = m.decoder.forward(torch.tensor(CORRUPTED), ctx, slmviz.Variant())
        torch.testing.assert_close(logits, clean.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("engine", ["per_cell", "batched"])
def test_patching_before_the_first_differing_token_has_no_effect(m, engine):
    for site in ("resid_pre", "resid_mid", "attn_out", "z", "v"):
        r = _sweep(m, site, engine=engine)
        before = r.values[:, :FIRST_DIFF]
        torch.testing.assert_close(before, torch.full_like(before, r.corrupted), rtol=0, atol=1e-6)


def test_a_patch_at_position_p_changes_no_logit_before_p(m):
    corrupted = m.trace(CORRUPTED, names=[])
    for site, head in (("resid_pre", None), ("z", 1), ("k", 1), ("pattern", 2)):
        for p in (FIRST_DIFF, 6):
            t = patched_trace(m, torch.tensor(CORRUPTED), torch.tensor(CLEAN), site, 1, p, head)
            # equal up to rounding: a hooked value may send attention through the eager kernel instead of SDPA
            torch.testing.assert_close(t.logits[:p], corrupted.logits[:p], rtol=0, atol=1e-6)
            assert (t.logits[p:] - corrupted.logits[p:]).abs().max() > 1e-5  # and the patch did something


def test_patching_resid_pre_of_layer_0_at_p_equals_swapping_token_p(m):
    swapped = list(CORRUPTED)
    swapped[FIRST_DIFF] = CLEAN[FIRST_DIFF]
    t = patched_trace(m, torch.tensor(CORRUPTED), torch.tensor(CLEAN), "resid_pre", 0, FIRST_DIFF)
    torch.testing.assert_close(t.logits, m.trace(swapped, names=[]).logits, rtol=0, atol=1e-6)


def test_patching_all_heads_z_at_a_position_equals_patching_attn_out_there(m):
    layer, p = 1, 6
    name = f"blocks.{layer}.attn.hook_z"
    clean = m.trace(CLEAN, names=[name])
    ctx = build_context(m.hook_names, [], {name: _writer(clean[name], (p, slice(None)))})
    via_z = m.decoder.forward(torch.tensor(CORRUPTED), ctx, slmviz.Variant())
    via_out = patched_trace(m, torch.tensor(CORRUPTED), torch.tensor(CLEAN), "attn_out", layer, p).logits
    torch.testing.assert_close(via_z, via_out, rtol=0, atol=1e-5)


def test_every_site_has_the_documented_shape(m):
    n, h, g, pos = m.cfg.n_layers, m.cfg.n_heads, m.cfg.n_kv_heads, len(CLEAN)
    expected = {"resid_pre": (n, pos), "resid_mid": (n, pos), "resid_post": (n, pos), "attn_out": (n, pos),
                "mlp_out": (n, pos), "z": (n, pos, h), "q": (n, pos, h), "pattern": (n, pos, h),
                "k": (n, pos, g), "v": (n, pos, g), "heads": (n, h)}
    assert set(expected) == set(SITES)
    for site, shape in expected.items():
        r = _sweep(m, site, engine="per_cell")
        assert tuple(r.values.shape) == shape, site
        assert r.complete and not torch.isnan(r.values).any()
        frame = r.frame()
        assert list(frame.columns) == ["layer", "position", "token", "head", "value", "normalized"]
        assert len(frame) == r.values.numel()


def test_denoising_the_last_layer_resid_post_at_the_last_position_restores_the_clean_metric(m):
    r = _sweep(m, "resid_post", engine="per_cell")
    assert r.values[-1, -1].item() == pytest.approx(r.clean, abs=1e-5)
    assert r.normalized[-1, -1].item() == pytest.approx(1.0, abs=1e-5)
    noised = _sweep(m, "resid_post", engine="per_cell", direction="noise")
    assert noised.values[-1, -1].item() == pytest.approx(r.corrupted, abs=1e-5)
    assert (noised.clean, noised.corrupted) == (r.clean, r.corrupted)


def test_a_callable_metric_is_accepted(m):
    def prob_of_answer(logits):
        return torch.softmax(logits[-1], -1)[ANSWER]

    r = patch(CLEAN, CORRUPTED, metric=prob_of_answer, site="resid_pre", model=m, engine="per_cell")
    assert 0 <= r.clean <= 1 and r.values.shape == (m.cfg.n_layers, len(CLEAN))
    same = patch(CLEAN, CORRUPTED, prob_of_answer, site="resid_pre", model=m, engine="per_cell")
    assert torch.equal(same.values, r.values)


@pytest.mark.parametrize("site", list(SITES))
@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_the_batched_sweep_equals_one_forward_per_cell(m, site, direction):
    fast = _sweep(m, site, engine="batched", direction=direction)
    slow = _sweep(m, site, engine="per_cell", direction=direction)
    assert fast.complete and slow.complete
    torch.testing.assert_close(fast.values, slow.values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", [a for a in ("llama_mqa_tied", "qwen2", "mistral_window", "llama_bias", "gemma3",
                                           "qwen3", "olmo2") if a in TINY_ARCHS])
def test_the_batched_sweep_equals_one_forward_per_cell_on_other_architectures(tiny_dirs, arch):
    other = slmviz.load(tiny_dirs[arch])
    for site in ("resid_mid", "k", "pattern"):
        fast = patch(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, site=site, model=other, engine="batched")
        slow = patch(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, site=site, model=other, engine="per_cell")
        torch.testing.assert_close(fast.values, slow.values, rtol=0, atol=1e-5)


@pytest.mark.parametrize("site", ["resid_pre", "attn_out", "z", "k", "pattern"])
def test_small_batches_with_their_own_shared_prefix_still_equal_one_forward_per_cell(m, site, monkeypatch):
    """Prompts that differ at position 1, cut into batches of a few rows: each batch starts at its own
    earliest position and reads the positions before it from a KV cache."""
    monkeypatch.setattr(patching, "TOKENS_PER_BATCH", 12)
    corrupted = [3, 50] + CLEAN[2:]
    kw = dict(answer=ANSWER, wrong=WRONG, site=site, model=m)
    fast, slow = patch(CLEAN, corrupted, engine="batched", **kw), patch(CLEAN, corrupted, engine="per_cell", **kw)
    torch.testing.assert_close(fast.values, slow.values, rtol=0, atol=1e-5)


def test_progress_is_reported_up_to_every_cell(m):
    seen = []
    r = _sweep(m, "resid_pre", engine="per_cell", progress=lambda u: seen.append((u.done, u.total, u.unit)))
    assert seen[0] == (0, r.total, "cell") and seen[-1] == (r.total, r.total, "cell")
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)


# --- errors --------------------------------------------------------------------------------------------
def test_prompts_of_different_lengths_are_refused_with_both_tokenisations(m):
    with pytest.raises(slmviz.PromptError, match=r"clean has 8: \['w3'.*corrupted has 3: \['w3', 'w10', 'w11'\]"):
        patch(CLEAN, [3, 10, 11], answer=ANSWER, model=m)


def test_an_answer_that_is_not_one_token_names_its_tokens(m):
    with pytest.raises(ValueError, match=r"answer 'w5 w6' is 2 tokens \['w5', 'w6'\]"):
        patch(CLEAN, CORRUPTED, answer="w5 w6", wrong=WRONG, model=m)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        patch(CLEAN, CORRUPTED, answer=10_000, model=m)


def test_bad_site_direction_and_method_name_the_choices(m):
    with pytest.raises(ValueError, match="sites are: resid_pre, resid_mid"):
        _sweep(m, "resid")
    with pytest.raises(ValueError, match="direction must be one of"):
        _sweep(m, "resid_pre", direction="up")
    with pytest.raises(ValueError, match="method must be one of"):
        _sweep(m, "resid_pre", method="magic")
    with pytest.raises(ValueError, match="same token"):
        patch(CLEAN, CORRUPTED, answer=ANSWER, wrong=ANSWER, model=m)
    with pytest.raises(ValueError, match="needs answer="):
        patch(CLEAN, CORRUPTED, model=m)


def test_string_answers_work_and_the_metric_is_named(m):
    r = patch("w3 w5 w6 w7", "w3 w5 w8 w7", answer="w2", wrong="w4", model=m, engine="per_cell")
    assert r.metric_name == "logit('w2') - logit('w4')"
    assert r.tokens == ["w3", "w5", "w8", "w7"] and r.source_tokens[2] == "w6"


# --- figures -------------------------------------------------------------------------------------------
def test_the_heatmap_is_diverging_centred_at_zero_with_layers_by_tokens(m):
    r = _sweep(m, "resid_pre", engine="per_cell")
    fig = r.plot()
    (heat,) = fig.data
    assert fig.layout.coloraxis.cmid == 0 and fig.layout.coloraxis.cmin == -fig.layout.coloraxis.cmax
    assert list(heat.y) == list(range(m.cfg.n_layers)) and len(heat.x) == len(CLEAN)
    assert heat.x[FIRST_DIFF] == "4: w13 ⇄ w40" and heat.x[0] == "0: w3"
    assert heat.customdata[1][5].tolist() == [1, 5, -1]  # layer, position, head (-1: no head axis)
    heads = _sweep(m, "z", engine="per_cell").plot()
    assert len(heads.data) == m.cfg.n_heads and heads.data[2].customdata[0][3].tolist() == [0, 3, 2]
    assert len(_sweep(m, "k", engine="per_cell").plot().data) == m.cfg.n_kv_heads
    assert list(_sweep(m, "heads", engine="per_cell").plot().data[0].x) == [f"head {h}" for h in range(4)]


def test_a_partial_sweep_draws_blank_cells_and_says_how_far_it_got(m):
    from slmviz.interventions.patching import patch_steps

    steps = patch_steps(CLEAN, CORRUPTED, ANSWER, WRONG, site="resid_pre", model=m, engine="per_cell")
    first = next(steps)
    assert first.done == 0 and torch.isnan(first.values).all()
    second = next(steps)
    assert second.done == 1
    assert "Computing: 1/16 cells" in second.plot().layout.title.subtitle.text.replace("<br>", " ")  # wrapped to fit


def test_a_single_patched_run_names_the_cell_it_needs(m):
    ids, src = torch.tensor(CORRUPTED), torch.tensor(CLEAN)
    with pytest.raises(ValueError, match=r"takes a cell \(position in 0..7, kv_head in 0..1\)"):
        patched_trace(m, ids, src, "k", 0, 3, 2)
    with pytest.raises(ValueError, match=r"takes a cell \(head in 0..3\)"):
        patched_trace(m, ids, src, "heads", 0)
    assert patched_trace(m, ids, src, "heads", 1, head=3).logits.shape == (len(CLEAN), m.cfg.vocab_size)

