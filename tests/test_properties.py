"""Property-based: random prompts under random valid variants keep every trace identity docs/correctness.md lists.

Variants are composed field by field from the tuples in slmviz.variants (so a new field value is
exercised without editing this file). Tiny random checkpoints of several architectures take random
token ids; the real SmolLM2 takes random text (emoji, control characters, other scripts) through its
own tokenizer. Examples are kept few so the file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

import slmviz
from slmviz.config import SLIDING
from slmviz.hooks import hook_names, hook_shape
from slmviz.model.block import norm_slots
from slmviz.tokens import PromptError
from slmviz.variants import (
    GQA_MAPPINGS,
    MLP_TYPES,
    NORM_PLACEMENTS,
    NORM_TYPES,
    PRESETS,
    QK_NORM_ORDERS,
    ROPE_PAIRINGS,
    Variant,
    VariantError,
)

# Architectures that differ in a way the identities see: GQA/MQA/MHA, o-bias (attn_out = Σ result + b_o),
# qkv bias, explicit head_dim, tied embeddings, a sliding window shorter than the prompts, and the families
# with norms after their sub-layers (Gemma: sandwich, OLMo-2: output) and QK-norm.
ARCHS = ["llama_gqa", "llama_mha", "llama_mqa_tied", "llama_bias", "llama_head_dim", "qwen2", "mistral_window",
         "gemma3", "qwen3", "olmo2"]

OPTIONAL_BOOL = st.none() | st.booleans()
VARIANTS = st.builds(
    Variant,
    norm=st.none() | st.sampled_from(NORM_PLACEMENTS),
    norm_type=st.sampled_from(NORM_TYPES),
    norm_offset=OPTIONAL_BOOL,
    embed_scale=OPTIONAL_BOOL,
    qk_norm=OPTIONAL_BOOL,
    qk_norm_order=st.none() | st.sampled_from(QK_NORM_ORDERS),
    rope=st.sampled_from(ROPE_PAIRINGS),
    rope_theta=st.none() | st.floats(min_value=1.5, max_value=1e7, allow_nan=False, allow_infinity=False),
    rope_local_as_global=st.booleans(),
    gqa=st.sampled_from(GQA_MAPPINGS),
    causal=st.booleans(),
    sliding_window=OPTIONAL_BOOL,
    mlp=st.sampled_from(MLP_TYPES),
    kv_position_bug=st.booleans(),
)
# Presets by name too, so resolve_variant's string path is exercised.
VARIANT_LIKE = VARIANTS | st.sampled_from(list(PRESETS))

ODD_CHARS = "😀👩‍🚀🇫🇷日本語العربيةЗдрав हिन्दी\x00\x07\x1b\x7f\u200b\u200d\u202e\ufeff e\u0301 \t\n\r"
TEXTS = (
    st.text(min_size=1, max_size=16)
    | st.text(alphabet=ODD_CHARS, min_size=1, max_size=16)
    | st.sampled_from([" ", "\n\n", "\t \r\n", "x" * 60, "ab" * 25])
)

RELATIVE_TOLERANCE = 1e-4  # summing per-head writes vs one matmul: fp32 rounding only


@pytest.fixture(scope="module")
def tiny_models(tiny_dirs) -> dict[str, slmviz.Model]:
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in ARCHS}


def _assert_close_where_finite(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to fp32 rounding, relative to the tensor's size, wherever both sides are finite.

    SmolLM2's residual reaches ~1e4 and overflows under no_norm, so differences are measured relative
    to the largest finite value and non-finite entries are left to `first_nonfinite`.
    """
    mask = torch.isfinite(actual) & torch.isfinite(expected)
    if not mask.any():
        return
    err = (actual[mask] - expected[mask]).abs().max()
    scale = expected[mask].abs().max().clamp_min(1.0)
    assert err <= RELATIVE_TOLERANCE * scale, f"{what}: max error {float(err):.3g} at scale {float(scale):.3g}"


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Bit-for-bit (NaN equal to NaN): for identities the model computes with the very same operation."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


def _dropped_norm(name: str, c, cfg) -> bool:
    """True for the hooks of a norm the variant drops: a residual-stream norm its placement c.norm does not use
    on this family, or the QK-norm under no_qk_norm."""
    if ".q_norm." in name or ".k_norm." in name:
        return c.qk_norm == "none"
    if not name.startswith("blocks.") or ".ln" not in name:
        return False
    slot = name.split(".")[2]  # ln1, ln1_post, ln2, ln2_post
    before, after = norm_slots(c.norm, slot.split("_")[0], cfg.has_pre_norms, cfg.has_post_norms)
    used = {"pre": {before}, "none": {before}, "output": {after}, "post": {after}, "sandwich": {before, after}}
    return slot not in used[c.norm]


def check_trace_invariants(model: slmviz.Model, t: slmviz.Trace, v: Variant) -> None:
    """Every identity of docs/correctness.md on one full trace, under variant v."""
    cfg, params, n = model.cfg, model.decoder.params, t.input_ids.numel()
    c = model.decoder.conventions(v)
    # Everything captured (in call order, which post-norm changes: the norm runs after its sub-layer), except
    # the norms a placement drops (Gemma under "pre" has no norm after its sub-layers: ln1_post never runs).
    assert sorted(t.names) == sorted(n for n in hook_names(cfg) if not _dropped_norm(n, c, cfg))
    for name in t.names:
        assert tuple(t[name].shape) == hook_shape(name, cfg, n), name
    assert t.logits.shape == (n, cfg.vocab_size)
    assert len(t.tokens) == n
    assert t.variant == v

    _assert_same(t["hook_embed"], t["blocks.0.hook_resid_pre"], "embed = resid_pre[0]")
    for layer in range(cfg.n_layers):
        b = f"blocks.{layer}."
        lp = params.layers[layer]
        pre, mid, post = t[b + "hook_resid_pre"], t[b + "hook_resid_mid"], t[b + "hook_resid_post"]
        attn_out, mlp_out = t[b + "hook_attn_out"], t[b + "hook_mlp_out"]
        after1, after2 = (norm_slots(c.norm, s, cfg.has_pre_norms, cfg.has_post_norms)[1] for s in ("ln1", "ln2"))
        block = model.decoder.blocks[layer]
        if c.norm != "post":
            _assert_same(mid, pre + attn_out, f"L{layer} resid_mid = resid_pre + attn_out")
            _assert_same(post, mid + mlp_out, f"L{layer} resid_post = resid_mid + mlp_out")
        else:  # post-norm: the residual *is* the normalised sum, N(x + F(x)) = w · normalized(x + F(x))
            w1, w2 = (block.norm_factor(s, c.norm_offset, c.norm_weight_in_fp32) for s in (after1, after2))
            _assert_close_where_finite(mid, w1 * t[b + f"{after1}.hook_normalized"], f"L{layer} resid_mid = N(..)")
            _assert_close_where_finite(post, w2 * t[b + f"{after2}.hook_normalized"], f"L{layer} resid_post = N(..)")
        if layer + 1 < cfg.n_layers:
            _assert_same(t[f"blocks.{layer + 1}.hook_resid_pre"], post, f"resid_pre[{layer + 1}] = resid_post[{layer}]")

        heads_sum = t[b + "attn.hook_result"].sum(1)
        if lp.b_o is not None:
            heads_sum = heads_sum + lp.b_o
        if c.norm in ("output", "sandwich"):  # a norm follows attention: Σ_h result is what it normalises
            normed = t[b + f"{after1}.hook_normalized"] * t[b + f"{after1}.hook_scale"]
            if c.norm_type == "layer":  # LayerNorm's normalized value is centred: compare the centred sum
                heads_sum = heads_sum - heads_sum.mean(-1, keepdim=True)
            _assert_close_where_finite(normed, heads_sum, f"L{layer} ln1_post input = Σ_h result (+ b_o)")
        else:
            _assert_close_where_finite(attn_out, heads_sum, f"L{layer} attn_out = Σ_h result (+ b_o)")
        _assert_same(t[b + "mlp.hook_post"], t[b + "mlp.hook_gate"] * t[b + "mlp.hook_pre_linear"],
                     f"L{layer} hook_post = hook_gate · hook_pre_linear")

        pattern = t[b + "attn.hook_pattern"]  # [h, pos_q, pos_k]
        rows = torch.isfinite(pattern).all(-1)  # [h, pos_q]; rows of an overflowed no_norm run are NaN
        assert (pattern[rows] >= 0).all(), f"L{layer} pattern has negative weights"
        sums = pattern.sum(-1)[rows]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-5), f"L{layer} pattern rows do not sum to 1"
        q_pos = torch.arange(n)[:, None]
        k_pos = torch.arange(n)[None, :]
        hidden = torch.zeros(n, n, dtype=torch.bool)
        if v.causal:
            hidden |= k_pos > q_pos  # the future
        if c.sliding_window is not None and cfg.layer_type(layer) == SLIDING:
            hidden |= (q_pos - k_pos) >= c.sliding_window  # outside a sliding layer's window
        masked = pattern.masked_fill(~hidden, 0.0)[rows]
        assert (masked == 0).all(), f"L{layer} pattern attends to masked keys (causal={v.causal})"


def check_health(t: slmviz.Trace, v: Variant) -> None:
    """Finite logits unless the variant removes the norms; then any overflow is located by name, not raised."""
    bad = t.first_nonfinite()
    if v.norm != "none":
        assert bad is None, f"non-finite values from {bad} under {v}"
        assert torch.isfinite(t.logits).all()
    elif bad is not None:
        assert bad in t.names or bad == "logits"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arch=st.sampled_from(ARCHS), ids=st.lists(st.integers(0, 127), min_size=1, max_size=20), variant=VARIANT_LIKE)
def test_trace_identities_hold_for_random_ids_and_variants_on_tiny_models(tiny_models, arch, ids, variant):
    """Random token ids (including one-token prompts and prompts longer than mistral_window's 5-key window)
    under random field-by-field variants, on tiny models of several architectures: hook names and shapes,
    the residual identities (pre-norm and no-norm: sums; post-norm: the normalised sums), resid_pre[L+1] =
    resid_post[L], attn_out = Σ_h result (+ o-bias), hook_post = gate · up, pattern rows are distributions
    that give no weight to masked keys, and finite logits unless norms are removed.
    Does not cover cached decoding (see the generation property) or parity with transformers."""
    model = tiny_models[arch]
    try:
        v = slmviz.resolve_variant(variant, model.cfg)
    except VariantError as e:  # a field or preset this family lacks: refused, naming what applies
        assert f"Presets that apply to {model.cfg.model_type}:" in str(e)
        with pytest.raises(VariantError):
            model.trace(ids, variant=variant)
        return
    t = model.trace(ids, variant=variant)
    check_trace_invariants(model, t, v)
    check_health(t, v)


@settings(max_examples=15, deadline=None)
@given(
    ids=st.lists(st.integers(0, 127), min_size=1, max_size=12), variant=VARIANTS,
    max_new_tokens=st.integers(0, 4), temperature=st.sampled_from([0.0, 0.7]),
)
def test_generation_runs_for_random_ids_and_variants(tiny_models, ids, variant, max_new_tokens, temperature):
    """Cached decoding (where kv_position_bug acts) under random variants: never raises, yields at most
    max_new_tokens in-vocabulary ids, and the greedy run's first token is the full forward's argmax.
    Does not check that decoding equals repeated full forwards (tests of the KV cache do)."""
    model = tiny_models["gemma3"]
    try:
        slmviz.resolve_variant(variant, model.cfg)
    except VariantError:
        return
    out = model.generate_ids(ids, max_new_tokens, variant=variant, temperature=temperature, seed=0,
                             stop_at_eos=False)
    assert len(out) == max_new_tokens
    assert all(0 <= i < 128 for i in out)
    if temperature == 0 and out:
        assert out[0] == int(model.logits(ids, variant=variant)[-1].argmax())


@settings(max_examples=25, deadline=None)
@given(text=TEXTS)
def test_random_text_either_traces_or_says_it_produced_no_tokens_on_the_tiny_tokenizer(tiny_models, text):
    """Any text through the tiny word-level tokenizer (which drops whitespace): a trace whose identities hold,
    or the PromptError for text that produced no tokens; never another exception."""
    model = tiny_models["llama_gqa"]
    try:
        t = model.trace(text)
    except PromptError as e:
        assert "produced no tokens" in str(e)
        return
    check_trace_invariants(model, t, t.variant)
    check_health(t, t.variant)


@pytest.mark.slow
# No shrinking: each example is a 30-layer forward, and shrinking one failure can take minutes.
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(text=TEXTS, variant=VARIANT_LIKE, chat=st.booleans())
@example(text="Bonjour 😀 \x00\x1b[0m 日本語", variant="no_norm", chat=False)
@example(text=" \t\n", variant=Variant(norm="post", norm_type="layer", causal=False), chat=True)
def test_trace_identities_hold_for_random_text_on_the_real_model(model, text, variant, chat):
    """Random text (emoji, control characters, other scripts, whitespace) through SmolLM2's own tokenizer,
    plain or in the chat template, under random variants: the text traces with exactly the tokenizer's ids
    and the identities hold. SmolLM2 may legitimately overflow with norms removed; then `first_nonfinite`
    names the hook and nothing raises.
    Does not cover long prompts (kept short for CI time) or that the ids decode back to the text (the
    vocabulary lacks a few bytes; tests/test_errors.py checks the round trip on representable odd text)."""
    if not chat and model.tokenizer(text)["input_ids"] == []:
        # SmolLM2's vocabulary lacks a few byte tokens (e.g. for \x04, \x13 and the lead bytes of
        # U+40000-U+BFFFF), which its tokenizer drops: text made only of those is a clear PromptError.
        with pytest.raises(PromptError, match="produced no tokens"):
            model.trace(text, variant=variant)
        return
    try:
        v = slmviz.resolve_variant(variant, model.cfg)
    except VariantError:
        with pytest.raises(VariantError):
            model.trace(text, variant=variant, chat=chat)
        return
    t = model.trace(text, variant=variant, chat=chat)
    check_trace_invariants(model, t, v)
    check_health(t, v)
    if not chat:
        assert t.input_ids.tolist() == model.tokenizer(text)["input_ids"]  # nothing added, lost or reordered


@pytest.mark.slow
def test_no_norm_overflow_on_the_real_model_is_located_not_raised(model):
    """Pinned example for check_health's no-norm branch: SmolLM2 without norms overflows fp32 on an ordinary
    prompt, the trace still returns, and first_nonfinite names a hook in execution order.
    If a future change keeps it finite, the test says so instead of passing silently."""
    t = model.trace("The capital of France is Paris. The capital of Germany is", variant="no_norm")
    bad = t.first_nonfinite()
    if bad is None:
        pytest.skip("no_norm stayed finite on this prompt; the overflow branch is not exercised")
    assert bad in t.names or bad == "logits"
    check_trace_invariants(model, t, slmviz.resolve_variant("no_norm"))
