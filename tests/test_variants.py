"""The variants lab: each switch does exactly what it says, damages the real model measurably, and keeps
the hook contract. Not covered here: the app's Break-it tab (tests/test_app.py)."""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.analysis.diff import first_divergent_hook, kl_per_position
from slmviz.hooks import hook_shape
from slmviz.loading.reference import reference_generate, relative_error, run_reference
from slmviz.variants import PRESETS, Variant, VariantError, applies, resolve_variant

# The presets for conventions LLaMA-family models have; the others need Gemma, Qwen3 or OLMo-2
# (tests/test_families.py covers those).
FAMILY_PRESETS = ["no_norm_offset", "no_embed_scale", "no_qk_norm", "qk_norm_after_rope", "rope_local_as_global",
                  "pre_norm_only", "gelu_exact", "no_sliding_window",
                  # GPT-2, Pythia, Gemma 2 (tests/test_families_gpt2_neox_gemma2.py)
                  "rms_for_layernorm", "no_pos_embed", "sequential_residual", "rotary_full", "no_softcap"]
LLAMA_PRESETS = [n for n in PRESETS if n not in FAMILY_PRESETS]
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Germany is"


@pytest.fixture(scope="module")
def faithful(model):
    return model.trace(PROMPT)


def test_presets_cover_every_switch_and_describe_themselves():
    assert list(PRESETS) == ["faithful", "post_norm", "no_norm", "layer_norm", "rope_interleaved", "no_rope",
                             "rope_theta_10k", "gqa_tile", "no_causal_mask", "standard_ffn", "kv_position_bug",
                             *FAMILY_PRESETS]
    for name, preset in PRESETS.items():
        assert len(preset.description) > 30, name
        assert (name == "faithful") == preset.variant.is_faithful
    assert slmviz.variants()["post_norm"] == Variant(norm="post")


def test_variant_accepts_name_variant_or_dict_and_rejects_bad_values():
    assert resolve_variant("gqa_tile") == resolve_variant({"gqa": "tile"}) == Variant(gqa="tile")
    assert resolve_variant(None) == Variant()
    with pytest.raises(ValueError, match="post_norm"):
        resolve_variant("postnorm")
    with pytest.raises(ValueError, match="interleaved"):
        Variant(rope="sideways")
    with pytest.raises(ValueError, match="norm_type"):
        resolve_variant({"normtype": "rms"})


def test_faithful_equals_transformers_through_trace_generate_and_compare(model, hf_model, faithful):
    ids = faithful.input_ids
    ref = run_reference(hf_model, ids)
    traced = model.trace(ids, variant="faithful")
    assert float((traced.logits - ref.logits).abs().max()) <= 1e-4
    ours = model.generate_ids(ids, 16, variant="faithful")
    theirs = reference_generate(hf_model, ids, 16)
    assert ours == [t for t in theirs if t != model.tokenizer.eos_token_id][: len(ours)] and len(ours) >= 1
    row = slmviz.compare(ids, variants=["faithful"], model=model).iloc[0]
    assert row.kl_mean <= 1e-6 and row.top1_agreement == 1.0 and pd_isna(row.diverges_at_layer)


def pd_isna(x) -> bool:
    import pandas as pd

    return bool(pd.isna(x))


def test_smollm2_offers_exactly_the_llama_presets(model):
    """variants(model) lists what applies: every LLaMA-family switch, none of the Gemma/Qwen3/OLMo-2 ones."""
    assert list(slmviz.variants(model)) == LLAMA_PRESETS
    for name in FAMILY_PRESETS:
        with pytest.raises(VariantError, match="does not apply to llama.*Presets that apply to llama: post_norm"):
            model.trace("Hi", variant=name)


@pytest.mark.parametrize("name", [n for n in LLAMA_PRESETS if n not in ("faithful", "kv_position_bug")])
def test_every_preset_changes_the_real_model_measurably(model, faithful, name):
    """Mean KL(faithful ‖ variant) ≥ 1e-3 nats: >1e6× the faithful-vs-transformers noise (~1e-10)."""
    t = model.trace(faithful.input_ids, variant=name, names=[])
    kl = kl_per_position(faithful.logits, t.logits)
    assert float(kl.mean()) >= 1e-3


def test_kv_position_bug_leaves_prefill_and_changes_the_continuation(model, faithful):
    t = model.trace(faithful.input_ids, variant="kv_position_bug", names=[])
    assert torch.equal(t.logits, model.trace(faithful.input_ids, names=[]).logits)
    prompt = "Write a short story about a robot who learns to paint."
    ids = model.encode(prompt, chat=True)
    assert model.generate(ids, 48, variant="kv_position_bug") != model.generate(ids, 48)


def test_kv_position_bug_shifts_layer_L_by_L_during_decoding(tiny_model):
    """Under the bug, layer L's decode-step key is rotated at position p + L (a faithful model at p + L shows it)."""
    ids = torch.arange(2, 8)
    seen = {}

    def grab(x, name):
        seen.setdefault(name, []).append(x.clone())

    names = {f"blocks.{L}.attn.hook_rot_k": grab for L in range(2)} | {"blocks.1.attn.hook_k": grab}
    list(tiny_model.stream(ids, 2, variant="kv_position_bug", hooks=names, stop_at_eos=False))
    step_k = seen["blocks.1.attn.hook_k"][1]  # unrotated key of the first decoded token, layer 1
    from slmviz.model.rope import rope_angles, rotate_half

    inv = tiny_model.decoder.inv_freq(tiny_model.cfg.rope_theta, 7)
    expected = rotate_half(step_k, rope_angles(torch.tensor([6 + 1]), inv))  # position 6, layer 1 → 7
    torch.testing.assert_close(seen["blocks.1.attn.hook_rot_k"][1], expected)


def test_no_causal_mask_lets_positions_read_the_future(model, faithful):
    t = model.trace(faithful.input_ids, variant="no_causal_mask", names=["blocks.0.attn.hook_pattern"])
    n = len(t.tokens)
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    assert (t["blocks.0.attn.hook_pattern"][:, upper] > 0).all()


def test_gqa_tile_makes_head_i_read_kv_head_i_mod_g(tiny_model):
    """Tiny model: 4 query heads, 2 KV heads; grouped gives [0,0,1,1], tile [0,1,0,1]."""
    t = tiny_model.trace(torch.arange(1, 9), variant="gqa_tile")
    pattern, v, z = t["blocks.0.attn.hook_pattern"], t["blocks.0.attn.hook_v"], t["blocks.0.attn.hook_z"]
    for head in range(4):
        torch.testing.assert_close(z[:, head], pattern[head] @ v[:, head % 2])
    assert not torch.allclose(z[:, 1], pattern[1] @ v[:, 0])  # where grouped and tile differ


def test_rope_interleaved_rotates_adjacent_pairs(tiny_model):
    t = tiny_model.trace(torch.arange(1, 6), variant="rope_interleaved")
    q, rot = t["blocks.0.attn.hook_q"], t["blocks.0.attn.hook_rot_q"]
    inv = tiny_model.decoder.inv_freq(tiny_model.cfg.rope_theta, 5)
    angle = 3 * inv[0]  # position 3, pair 0 = dims (0, 1)
    c, s = torch.cos(angle), torch.sin(angle)
    torch.testing.assert_close(rot[3, :, 0], q[3, :, 0] * c - q[3, :, 1] * s)
    torch.testing.assert_close(rot[3, :, 1], q[3, :, 1] * c + q[3, :, 0] * s)


def test_no_rope_leaves_queries_unrotated(tiny_model):
    t = tiny_model.trace(torch.arange(1, 6), variant="no_rope")
    assert torch.equal(t["blocks.1.attn.hook_rot_q"], t["blocks.1.attn.hook_q"])


def test_rope_theta_override_changes_frequencies(model):
    conventions = model.decoder.conventions
    theta_10k, own = conventions(Variant(rope_theta=10_000.0)).rope_theta, conventions(Variant()).rope_theta
    assert (theta_10k, own) == (10_000.0, model.cfg.rope_theta) and own != 10_000.0
    assert model.decoder.inv_freq(theta_10k, 8)[1] > model.decoder.inv_freq(own, 8)[1]


def test_post_norm_applies_the_norm_after_the_residual_add(tiny_model):
    t = tiny_model.trace(torch.arange(1, 7), variant="post_norm")
    b = "blocks.0."
    total = t[b + "hook_resid_pre"] + t[b + "hook_attn_out"]
    w = tiny_model.decoder.params.layers[0].ln1
    rms = (total.pow(2).mean(-1, keepdim=True) + tiny_model.cfg.norm_eps).sqrt()
    torch.testing.assert_close(t[b + "hook_resid_mid"], w * total / rms)
    torch.testing.assert_close(t[b + "ln1.hook_scale"], rms)


def test_layer_norm_subtracts_the_mean(tiny_model):
    t = tiny_model.trace(torch.arange(1, 7), variant="layer_norm")
    normalized = t["blocks.0.ln1.hook_normalized"]
    assert normalized.mean(-1).abs().max() < 1e-5
    assert tiny_model.trace(torch.arange(1, 7))["blocks.0.ln1.hook_normalized"].mean(-1).abs().max() > 1e-3


def test_no_norm_passes_the_residual_unscaled(tiny_model):
    t = tiny_model.trace(torch.arange(1, 7), variant="no_norm")
    assert torch.equal(t["blocks.0.ln1.hook_normalized"], t["blocks.0.hook_resid_pre"])
    assert (t["blocks.0.ln1.hook_scale"] == 1).all()


def test_standard_ffn_never_reads_the_gate_projection(tiny_dir):
    """Poison the gate rows with NaN: the standard FFN stays finite, SwiGLU does not."""
    m = slmviz.load(tiny_dir)
    for layer in m.decoder.params.layers:
        layer.w_gate_up[: m.cfg.d_mlp] = float("nan")
    ids = torch.arange(1, 7)
    t = m.trace(ids, variant="standard_ffn")
    assert torch.isfinite(t.logits).all()
    torch.testing.assert_close(t["blocks.0.mlp.hook_gate"], torch.nn.functional.silu(t["blocks.0.mlp.hook_pre"]))
    assert not torch.isfinite(m.trace(ids).logits).all()


def test_variants_compose(tiny_model):
    """Variant(norm="post", rope="interleaved") rotates adjacent pairs AND normalises after the add."""
    ids = torch.arange(1, 7)
    both = tiny_model.trace(ids, variant=Variant(norm="post", rope="interleaved"))
    from slmviz.model.rope import rope_angles, rotate_interleaved

    angles = rope_angles(torch.arange(6), tiny_model.decoder.inv_freq(tiny_model.cfg.rope_theta, 6))
    rotated = rotate_interleaved(both["blocks.0.attn.hook_q"], angles)
    torch.testing.assert_close(both["blocks.0.attn.hook_rot_q"], rotated)
    total = both["blocks.0.hook_resid_pre"] + both["blocks.0.hook_attn_out"]
    torch.testing.assert_close(both["blocks.0.ln1.hook_normalized"] * both["blocks.0.ln1.hook_scale"], total)
    torch.testing.assert_close(both["blocks.0.attn.hook_q"].flatten(1),
                               both["blocks.0.hook_resid_pre"] @ tiny_model.decoder.params.layers[0].w_qkv[:64].t())
    assert not torch.allclose(both.logits, tiny_model.trace(ids, variant="post_norm").logits)
    assert not torch.allclose(both.logits, tiny_model.trace(ids, variant="rope_interleaved").logits)
    assert both.variant.label() == "norm=post, rope=interleaved"


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_keeps_the_full_hook_contract(tiny_model, name):
    """Every preset that applies keeps every hook name and shape; one that does not is refused by name."""
    if not applies(name, tiny_model.cfg):
        with pytest.raises(VariantError, match=f"{name}.*does not apply"):
            tiny_model.trace(torch.arange(1, 7), variant=name)
        return
    t = tiny_model.trace(torch.arange(1, 7), variant=name)
    assert sorted(t.names) == sorted(tiny_model.hook_names)  # post_norm reaches ln1 after attention
    for hook in t.names:
        assert tuple(t[hook].shape) == hook_shape(hook, tiny_model.cfg, 6)


def test_first_divergent_hook_is_where_each_switch_acts(tiny_model):
    ids = torch.arange(1, 9)
    base = tiny_model.trace(ids)
    expected = {
        "post_norm": "blocks.0.ln1.hook_scale",  # the norm now measures resid_pre + attn_out
        "no_norm": "blocks.0.ln1.hook_scale",  # the scale becomes 1
        "layer_norm": "blocks.0.ln1.hook_scale", "rope_interleaved": "blocks.0.attn.hook_rot_q",
        "no_rope": "blocks.0.attn.hook_rot_q",
        "gqa_tile": "blocks.0.attn.hook_attn_scores", "no_causal_mask": "blocks.0.attn.hook_attn_scores",
        "standard_ffn": "blocks.0.mlp.hook_pre",
    }
    for name, hook in expected.items():
        assert first_divergent_hook(base, tiny_model.trace(ids, variant=name)) == hook, name
    # The tiny model's own base is 10 000, so rope_theta_10k is a no-op there; another base shows the same point.
    other_base = tiny_model.trace(ids, variant={"rope_theta": 500.0})
    assert first_divergent_hook(base, other_base) == "blocks.0.attn.hook_rot_q"


def test_no_norm_overflow_is_reported_not_raised(model, faithful):
    """SmolLM2 without norms overflows fp32: the trace names where, compare stays NaN-free with a note."""
    t = model.trace(faithful.input_ids, variant="no_norm", names=lambda n: "resid" in n)
    where = t.first_nonfinite()
    assert where is not None and where.startswith("blocks.")
    df = slmviz.compare(faithful.input_ids, variants=["no_norm", "rope_theta_10k"], model=model)
    assert not df[["kl_mean", "kl_last", "top1_agreement"]].isna().any().any()
    row = df.iloc[0]
    assert row.kl_mean == float("inf") and row.nonfinite_at == where and "overflow" in row.note


def test_compare_reports_continuations_and_divergence(model):
    df = slmviz.compare("The capital of France is", variants=["gqa_tile", "kv_position_bug"], model=model,
                        max_new_tokens=6)
    assert list(df.variant) == ["gqa_tile", "kv_position_bug"]
    for col in ("kl_mean", "kl_last", "top1_agreement", "faithful_next", "variant_next", "diverges_at_layer",
                "faithful_continuation", "variant_continuation"):
        assert col in df.columns
    tile = df.iloc[0]
    assert tile.kl_mean > 1 and tile.diverges_at_layer == 0 and tile.variant_continuation != tile.faithful_continuation
    assert df.iloc[1].kl_mean == 0.0


def test_trace_diff_gives_per_layer_per_position_divergence(model, faithful):
    broken = model.trace(faithful.input_ids, variant="rope_theta_10k", names=lambda n: "resid" in n)
    base = model.trace(faithful.input_ids, names=lambda n: "resid" in n)
    diff = base.diff(broken)
    assert set(diff.columns) >= {"layer", "stage", "position", "token", "rel_diff"}
    assert len(diff) == 3 * model.cfg.n_layers * len(base.tokens)
    assert diff[diff.position == 0].rel_diff.max() == 0  # position 0 is never rotated
    assert diff.rel_diff.max() > 0.01
    assert relative_error(base.logits, broken.logits) > 0


def test_kl_per_position_by_blocks_of_rows_equals_the_whole_at_once(monkeypatch):
    """kl_per_position works a block of rows at a time (bounded memory on a 262k vocabulary); each row's value is
    exactly the formula over all rows at once, with +inf where `other` is not finite, for any leading shape."""
    from slmviz.analysis import diff

    torch.manual_seed(0)
    ref, other = 4 * torch.randn(2, 7, 50), 4 * torch.randn(2, 7, 50)
    other[1, 3, 5] = float("nan")
    log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(other, -1)
    whole = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    whole[1, 3] = float("inf")
    monkeypatch.setattr(diff, "KL_BLOCK_CELLS", 3 * 50)  # blocks of 3 rows: 14 rows make 5 blocks, the last short
    assert torch.equal(kl_per_position(ref, other), whole)
    monkeypatch.setattr(diff, "KL_BLOCK_CELLS", 1 << 24)
    assert torch.equal(kl_per_position(ref, other), whole)
    with pytest.raises(ValueError, match="one shape"):
        kl_per_position(ref, other[:, :3])
