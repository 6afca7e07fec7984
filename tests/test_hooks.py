"""The hook contract: every name and shape of docs/hook-names.md, capture filters, interventions, and the identities
between hooks that must hold on every trace."""

from __future__ import annotations

import pytest
import torch

from slmviz.hooks import LAYER_HOOKS, hook_names, hook_shape

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def trace(model):
    return model.trace(PROMPT)


def test_every_hook_is_captured_with_its_contract_shape(trace, model):
    """All 3 global + 22 per-layer names, for every layer, with docs/hook-names.md's shapes (no batch dimension)."""
    expected = hook_names(model.cfg.n_layers)
    assert trace.names == expected
    assert len(expected) == 3 + len(LAYER_HOOKS) * model.cfg.n_layers
    n = len(trace.tokens)
    for name in expected:
        assert tuple(trace[name].shape) == hook_shape(name, model.cfg, n), name
    assert trace["blocks.0.attn.hook_pattern"].shape == (9, n, n)
    assert trace["blocks.0.attn.hook_k"].shape == (n, 3, 64)  # KV heads are not expanded
    assert trace.logits.shape == (n, model.cfg.vocab_size) and trace.input_ids.shape == (n,)


def test_tiny_models_of_every_architecture_have_the_full_contract(tiny_dirs):
    import slmviz

    for arch, folder in tiny_dirs.items():
        m = slmviz.load(folder)
        t = m.trace(torch.arange(1, 7))
        for name in m.hook_names:
            assert tuple(t[name].shape) == hook_shape(name, m.cfg, 6), (arch, name)


def test_identities_hold_between_hooks(trace, model):
    """resid sums, resid_pre[L+1] = resid_post[L], Σ_h result = attn_out, gate·up = post, causal normalised patterns."""
    n = len(trace.tokens)
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    assert torch.equal(trace["blocks.0.hook_resid_pre"], trace["hook_embed"])
    for L in range(model.cfg.n_layers):
        b = f"blocks.{L}."
        pre, mid, post = trace[b + "hook_resid_pre"], trace[b + "hook_resid_mid"], trace[b + "hook_resid_post"]
        torch.testing.assert_close(mid, pre + trace[b + "hook_attn_out"], rtol=0, atol=0)
        torch.testing.assert_close(post, mid + trace[b + "hook_mlp_out"], rtol=0, atol=0)
        if model.cfg.n_layers > L + 1:
            assert torch.equal(trace[f"blocks.{L + 1}.hook_resid_pre"], post)
        attn_out = trace[b + "hook_attn_out"]
        assert (trace[b + "attn.hook_result"].sum(1) - attn_out).abs().max() <= 1e-4 * attn_out.abs().max()
        gate_times_up = trace[b + "mlp.hook_gate"] * trace[b + "mlp.hook_pre_linear"]
        torch.testing.assert_close(trace[b + "mlp.hook_post"], gate_times_up)
        pattern = trace[b + "attn.hook_pattern"]
        torch.testing.assert_close(pattern.sum(-1), torch.ones(9, n))
        assert (pattern[:, upper] == 0).all()
        assert torch.isneginf(trace[b + "attn.hook_attn_scores"][:, upper]).all()


def test_names_filter_exact_predicate_and_none(model):
    only = model.trace(PROMPT, names=["blocks.3.attn.hook_pattern", "hook_embed"])
    assert sorted(only.names) == ["blocks.3.attn.hook_pattern", "hook_embed"]
    resid = model.trace(PROMPT, names=lambda n: "resid" in n)
    assert len(resid.names) == 3 * model.cfg.n_layers
    none = model.trace(PROMPT, names=[])
    assert none.names == []
    torch.testing.assert_close(none.logits, only.logits, rtol=1e-5, atol=1e-4)


def test_unknown_hook_name_suggests_the_nearest(model):
    with pytest.raises((KeyError, ValueError), match="blocks.3.attn.hook_pattern"):
        model.trace(PROMPT, names=["blocks.3.attn.hook_patern"])
    with pytest.raises((KeyError, ValueError), match="hook_z"):
        model.trace(PROMPT, hooks={"blocks.3.attn.hook_zz": lambda t, n: None})


def test_zeroing_hook_z_zeroes_that_layers_attention_output(model):
    t = model.trace(PROMPT, hooks={"blocks.5.attn.hook_z": lambda z, name: torch.zeros_like(z)})
    assert (t["blocks.5.hook_attn_out"] == 0).all()
    assert (t["blocks.4.hook_attn_out"] != 0).any()
    base = model.trace(PROMPT, names=[])
    assert not torch.allclose(t.logits, base.logits)  # the replacement fed forward


def test_hook_fn_receives_its_name_and_observes_without_changing(model):
    seen = []
    t = model.trace(PROMPT, names=[], hooks={"blocks.2.mlp.hook_post": lambda x, name: seen.append((name, x.shape))})
    assert seen == [("blocks.2.mlp.hook_post", (len(t.tokens), model.cfg.d_mlp))]
    torch.testing.assert_close(t.logits, model.trace(PROMPT, names=[]).logits)


def test_editing_one_heads_result_changes_only_through_that_head(model):
    """Zeroing head 4's write (hook_result) equals attn_out minus that head's contribution."""
    base = model.trace(PROMPT, names=["blocks.7.attn.hook_result", "blocks.7.hook_attn_out"])

    def drop_head(result, name):
        result = result.clone()
        result[:, 4] = 0
        return result

    t = model.trace(PROMPT, hooks={"blocks.7.attn.hook_result": drop_head}, names=["blocks.7.hook_attn_out"])
    expected = base["blocks.7.hook_attn_out"] - base["blocks.7.attn.hook_result"][:, 4]
    assert (t["blocks.7.hook_attn_out"] - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_replacing_the_norm_scale_divides_by_the_replacement(model):
    t = model.trace(PROMPT, hooks={"blocks.1.ln1.hook_scale": lambda s, n: torch.ones_like(s)},
                    names=["blocks.1.ln1.hook_normalized", "blocks.1.hook_resid_pre"])
    torch.testing.assert_close(t["blocks.1.ln1.hook_normalized"], t["blocks.1.hook_resid_pre"])


def test_hooks_see_every_decoding_step(model):
    """Generation calls hook fns at the prefill (all prompt positions) and once per new token (one position)."""
    shapes = []
    text = model.generate(PROMPT, max_new_tokens=5, hooks={"blocks.0.attn.hook_pattern": lambda p, n: shapes.append(
        tuple(p.shape))}, stop_at_eos=False)
    n = len(model.encode(PROMPT))
    assert shapes == [(9, n, n)] + [(9, 1, n + i) for i in range(1, 5)]  # the 5th token needs no further step
    assert isinstance(text, str) and text


def test_hook_steering_changes_generation(model):
    base = model.generate(PROMPT, max_new_tokens=8)
    steered = model.generate(PROMPT, max_new_tokens=8,
                             hooks={"blocks.10.hook_resid_post": lambda x, n: x * torch.tensor(0.0)})
    assert steered != base


def test_editing_attention_scores_decides_the_pattern(model):
    """A hook on hook_attn_scores that masks every key but the first makes each head attend to token 0 only."""
    def first_key_only(scores, name):
        edited = torch.full_like(scores, float("-inf"))
        edited[..., 0] = 0.0
        return edited

    t = model.trace(PROMPT, hooks={"blocks.2.attn.hook_attn_scores": first_key_only},
                    names=["blocks.2.attn.hook_pattern", "blocks.2.attn.hook_z", "blocks.2.attn.hook_v"])
    pattern = t["blocks.2.attn.hook_pattern"]
    assert (pattern[..., 0] == 1).all() and (pattern[..., 1:] == 0).all()
    v0 = t["blocks.2.attn.hook_v"][0]  # [g, d_head] at position 0
    z = t["blocks.2.attn.hook_z"]  # [pos, h, d_head]: every position now reads position 0's values
    torch.testing.assert_close(z, v0[[0, 0, 0, 1, 1, 1, 2, 2, 2]].expand_as(z))
