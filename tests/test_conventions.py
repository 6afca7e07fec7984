"""Each silent-correctness convention, pinned: unit checks of the named function, and a mutation check
that breaking the convention makes a tiny random model stop matching transformers.

Not covered here: the variants built on these conventions (tests/test_variants.py).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import slmviz
from slmviz.hooks import build_context
from slmviz.loading import weights
from slmviz.loading.reference import load_reference, relative_error, run_reference
from slmviz.model import attention, block, decoder, mlp, norm, rope
from slmviz.variants import BASE


# --- unit pins -------------------------------------------------------------------------------------
def test_rms_norm_does_not_subtract_the_mean():
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    out = norm.normalize(x, torch.ones(4), eps=0.0)
    assert torch.allclose(out, x / x.pow(2).mean().sqrt())
    centred = norm.normalize(x, torch.ones(4), eps=0.0, norm_type="layer")
    assert abs(float(centred.mean())) < 1e-6 and not torch.allclose(out, centred)


def test_rms_norm_matches_transformers_bit_for_bit():
    """Same op order as LlamaRMSNorm (fp32 rsqrt multiply, weight after): identical bits, not just close."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ref = LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64))
    x = torch.randn(7, 64) * 1000
    assert torch.equal(norm.normalize(x, ref.weight.detach(), 1e-5), ref(x).detach())


def test_rms_norm_hooks_have_transformerlens_meaning():
    x = torch.randn(3, 8)
    seen = {}
    norm.normalize(x, torch.full((8,), 2.0), 1e-6, "rms",
                   lambda s: seen.setdefault("scale", s), lambda n: seen.setdefault("normalized", n))
    assert torch.allclose(seen["scale"], (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt())
    assert torch.allclose(seen["normalized"], x / seen["scale"])


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_linear", "llama_dynamic", "llama3", "llama_head_dim"])
def test_rope_frequencies_match_transformers(tiny_dirs, arch):
    """inv_freq for default/linear/dynamic(NTK, beyond max positions)/llama3 equals transformers' own."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = AutoConfig.from_pretrained(tiny_dirs[arch])
    m = slmviz.load(tiny_dirs[arch])
    cfg = m.cfg
    rope_type = cfg.rope_scaling["rope_type"]
    for seq_len in (8, 30):
        ours = rope.rope_inv_freq(cfg.d_head, cfg.rope_theta, cfg.rope_scaling, seq_len, cfg.max_position_embeddings)
        if rope_type == "default":
            theirs = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.d_head, 2).float() / cfg.d_head))
        else:
            theirs, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu", seq_len=seq_len)
        assert torch.equal(ours, theirs), (arch, seq_len)


def test_rope_uses_the_checkpoints_base(model):
    assert model.cfg.rope_theta == 100_000.0  # SmolLM2; 10 000 is the `rope_theta_10k` variant


def test_rope_pairs_dim_i_with_i_plus_half():
    """A unit vector on dim 0 rotates into dim d/2 (rotate_half), not into dim 1 (interleaved)."""
    d = 8
    x = torch.zeros(1, 1, d)
    x[..., 0] = 1.0
    angles = torch.full((1, d // 2), torch.pi / 2)
    out = rope.rotate_half(x, angles)
    assert torch.allclose(out[0, 0], torch.eye(d)[d // 2], atol=1e-6)
    out_interleaved = rope.rotate_interleaved(x, angles)
    assert torch.allclose(out_interleaved[0, 0], torch.eye(d)[1], atol=1e-6)


def test_rope_matches_transformers_apply_rotary_pos_emb():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    angles = rope.rope_angles(torch.arange(3, 8), rope.rope_inv_freq(16, 10_000.0, {}, 8, 64))
    emb = torch.cat((angles, angles), -1)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], emb.cos()[None], emb.sin()[None])
    assert torch.equal(rope.rotate_half(q, angles), hq[0].transpose(0, 1))
    assert torch.equal(rope.rotate_half(k, angles), hk[0].transpose(0, 1))


def test_rope_preserves_norms_and_does_nothing_at_position_zero():
    x = torch.randn(6, 3, 16)
    angles = rope.rope_angles(torch.arange(6), rope.rope_inv_freq(16, 10_000.0, {}, 6, 64))
    for rotate in (rope.rotate_half, rope.rotate_interleaved):
        out = rotate(x, angles)
        assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
        assert torch.equal(out[0], x[0])


def test_gqa_groups_are_contiguous():
    """SmolLM2: 9 query heads, 3 KV heads → heads 0-2 read KV 0, 3-5 KV 1, 6-8 KV 2 (repeat_interleave)."""
    assert [attention.kv_head_of(q, 3) for q in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert attention.kv_head_index(9, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert attention.kv_head_index(9, 3, "tile").tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    k = torch.randn(1, 3, 5, 4)
    from transformers.models.llama.modeling_llama import repeat_kv

    assert torch.equal(repeat_kv(k, 3)[0], k[0][attention.kv_head_index(9, 3)])


def test_each_query_head_reads_its_groups_values(tiny_model):
    """In the model, z of head i = pattern_i @ v[kv_head_of(i)] (tiny model: 4 query heads, 2 KV heads)."""
    t = tiny_model.trace(torch.arange(2, 12))
    pattern, v, z = t["blocks.0.attn.hook_pattern"], t["blocks.0.attn.hook_v"], t["blocks.0.attn.hook_z"]
    n_rep = tiny_model.cfg.n_rep
    for head in range(tiny_model.cfg.n_heads):
        expected = pattern[head] @ v[:, attention.kv_head_of(head, n_rep)]
        assert torch.allclose(z[:, head], expected, atol=1e-5)


def test_causal_mask_hides_the_future():
    assert torch.equal(attention.attention_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert attention.attention_mask(1, 6) is None  # a decoding step sees the whole cache
    assert attention.attention_mask(4, 4, causal=False) is None
    window = attention.attention_mask(5, 5, sliding_window=2)
    assert window[4].tolist() == [False, False, False, True, True]


def test_sliding_window_holds_the_token_and_w_minus_1_before_it():
    """Window W: query i reads keys i-W+1 .. i (W keys), as transformers' sliding_window_overlay (q - k < W)."""
    window = attention.attention_mask(8, 8, sliding_window=3)
    assert window[7].tolist() == [False] * 5 + [True] * 3 and int(window.sum(-1).max()) == 3
    step = attention.attention_mask(1, 8, sliding_window=3)  # a cached decoding step at position 7
    assert step.tolist() == [[False] * 5 + [True] * 3]


def test_gemma_norms_multiply_by_one_plus_w():
    """Gemma3RMSNorm: normalised · (1 + w) with the 1 added in fp32; LLaMA: normalised · w."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    ref = Gemma3RMSNorm(16, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(0.1 * torch.randn(16))
    x = torch.randn(5, 16) * 30
    factor = norm.norm_weight(ref.weight.detach(), 1.0, in_fp32=True)
    assert torch.equal(norm.normalize(x, factor, 1e-6, weight_in_fp32=True), ref(x).detach())
    assert torch.equal(norm.norm_weight(ref.weight.detach(), 0.0, False), ref.weight.detach())
    w16 = torch.tensor([0.001], dtype=torch.bfloat16)
    assert norm.norm_weight(w16, 1.0, in_fp32=True).dtype == torch.float32  # 1.001 survives; bf16 rounds it to 1


def test_gemma_uses_the_tanh_gelu():
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 101)
    assert torch.equal(mlp.ACTIVATIONS["gelu_pytorch_tanh"](x), ACT2FN["gelu_pytorch_tanh"](x))
    assert not torch.equal(mlp.ACTIVATIONS["gelu"](x), mlp.ACTIVATIONS["gelu_pytorch_tanh"](x))


def test_gemma_scales_embeddings_in_the_weights_dtype(tiny_dirs):
    """hook_embed = E[ids] · sqrt(d_model) with the scale rounded to the weights' dtype (bf16: sqrt(640) = 25.25)."""
    assert float(decoder.embed_scale(640, torch.bfloat16)) == 25.25
    assert float(decoder.embed_scale(80, torch.float32)) == float(torch.tensor(80**0.5, dtype=torch.float32))
    m = slmviz.load(tiny_dirs["gemma3"])
    ids = torch.arange(1, 6)
    t = m.trace(ids, names=["hook_embed"])
    assert torch.equal(t["hook_embed"], m.decoder.params.embed[ids] * decoder.embed_scale(80, torch.float32))


def test_norm_weights_map_by_placement_not_by_name():
    """`post_attention_layernorm` is LLaMA's norm before the MLP and Gemma's / OLMo-2's norm after attention."""
    names = weights.NORM_WEIGHT_NAMES
    assert names["pre"]["ln2"] == names["sandwich"]["ln1_post"] == names["output"]["ln1_post"]
    assert names["sandwich"]["ln2"] == "pre_feedforward_layernorm" and "ln1" not in names["output"]


def test_qk_norm_spans_what_the_family_normalises(tiny_dirs):
    """Qwen3 divides each head's d_head by its own RMS (a scale per head); OLMo-2 divides the whole q
    projection by one RMS per position, before the head split."""
    for arch, scale_shape, flat in (("qwen3", (6, 4, 1), False), ("olmo2", (6, 1), True)):
        m = slmviz.load(tiny_dirs[arch])
        t = m.trace(torch.arange(3, 9))
        q, scale = t["blocks.0.attn.hook_q"], t["blocks.0.attn.q_norm.hook_scale"]
        q = q.flatten(1) if flat else q
        assert tuple(scale.shape) == scale_shape, arch
        torch.testing.assert_close(scale, (q.pow(2).mean(-1, keepdim=True) + m.cfg.norm_eps).sqrt())
        torch.testing.assert_close(t["blocks.0.attn.q_norm.hook_normalized"] * scale, q)


def test_olmo2_normalises_each_sublayer_output(tiny_dirs):
    """resid_mid = resid_pre + ln1_post(attention), and nothing normalises the sub-layer's input."""
    m = slmviz.load(tiny_dirs["olmo2"])
    t = m.trace(torch.arange(1, 7))
    pre, mid, out = t["blocks.0.hook_resid_pre"], t["blocks.0.hook_resid_mid"], t["blocks.0.hook_attn_out"]
    assert torch.equal(mid, pre + out)
    q = (pre @ m.decoder.params.layers[0].w_qkv[: 4 * 20].t()).view(6, 4, 20)  # q_proj reads resid_pre itself
    torch.testing.assert_close(t["blocks.0.attn.hook_q"], q)
    torch.testing.assert_close(out, m.decoder.params.layers[0].ln1_post * t["blocks.0.ln1_post.hook_normalized"])


def test_gemma_wraps_each_sublayer_in_two_norms(tiny_dirs):
    m = slmviz.load(tiny_dirs["gemma3"])
    t = m.trace(torch.arange(1, 7))
    lp, b = m.decoder.params.layers[0], "blocks.0."
    torch.testing.assert_close(t[b + "ln1.hook_normalized"] * t[b + "ln1.hook_scale"], t[b + "hook_resid_pre"])
    torch.testing.assert_close(t[b + "hook_attn_out"], (1 + lp.ln1_post) * t[b + "ln1_post.hook_normalized"])
    assert torch.equal(t[b + "hook_resid_mid"], t[b + "hook_resid_pre"] + t[b + "hook_attn_out"])


def test_scores_are_scaled_by_sqrt_d_head(tiny_dirs):
    """With head_dim=24 ≠ hidden/heads=16 the scale must come from head_dim."""
    m = slmviz.load(tiny_dirs["llama_head_dim"])
    assert m.cfg.d_head == 24 and attention.attention_scale(24) == 24**-0.5
    assert attention.attention_scale(16, query_pre_attn_scalar=24) == 24**-0.5  # Gemma's own scalar wins
    t = m.trace(torch.arange(1, 6))
    q, k = t["blocks.0.attn.hook_rot_q"], t["blocks.0.attn.hook_rot_k"]
    expected = torch.einsum("qhd,khd->hqk", q, k[:, attention.kv_head_index(4, 2)]) / 24**0.5
    scores = t["blocks.0.attn.hook_attn_scores"]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.allclose(scores[:, mask], expected[:, mask], atol=1e-5)
    assert torch.isneginf(scores[:, ~mask]).all()


def test_swiglu_activates_the_gate_not_up(tiny_model):
    t = tiny_model.trace(torch.arange(1, 8))
    pre, gate, lin, post = (t[f"blocks.1.mlp.{n}"] for n in ("hook_pre", "hook_gate", "hook_pre_linear", "hook_post"))
    assert torch.allclose(gate, F.silu(pre))
    assert torch.allclose(post, gate * lin)
    d_mlp = tiny_model.cfg.d_mlp
    x = t["blocks.1.ln2.hook_normalized"] * tiny_model.decoder.params.layers[1].ln2
    assert torch.allclose(pre, x @ tiny_model.decoder.params.layers[1].w_gate_up[:d_mlp].t(), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_bias", "qwen2", "mistral", "gemma3", "qwen3", "olmo2"])
def test_mlp_hook_in_is_exactly_what_the_mlp_receives(tiny_dirs, arch):
    """blocks.L.mlp.hook_in equals the input transformers' MLP module receives (its gate/up projections' input),
    captured independently by a forward pre-hook on each layer's `mlp`; on Gemma it is not ln2.hook_normalized
    (that is before the (1 + w) weight), and on OLMo-2 (no norm before the MLP) it is hook_resid_mid."""
    hf = load_reference(tiny_dirs[arch])
    seen: dict[int, torch.Tensor] = {}
    handles = [layer.mlp.register_forward_pre_hook(lambda mod, args, i=i: seen.__setitem__(i, args[0][0].detach()))
               for i, layer in enumerate(hf.model.layers)]
    ids = torch.arange(1, 8)
    try:
        run_reference(hf, ids)
    finally:
        for h in handles:
            h.remove()
    m = slmviz.load(tiny_dirs[arch])
    t = m.trace(ids)
    for layer in range(m.cfg.n_layers):
        mine = t[f"blocks.{layer}.mlp.hook_in"]
        assert mine.shape == (7, m.cfg.d_model)
        torch.testing.assert_close(mine, seen[layer], rtol=1e-5, atol=1e-5)
        d_mlp = m.cfg.d_mlp
        lp = m.decoder.params.layers[layer]
        torch.testing.assert_close(t[f"blocks.{layer}.mlp.hook_pre"], F.linear(mine, lp.w_gate_up[:d_mlp],
                                   None if lp.b_gate_up is None else lp.b_gate_up[:d_mlp]), rtol=1e-5, atol=1e-5)
    if arch == "gemma3":
        gap = (t["blocks.0.mlp.hook_in"] - t["blocks.0.ln2.hook_normalized"]).abs().max()
        assert gap > 0.1  # the silent wrong choice: before the (1 + w) weight
    if arch == "olmo2":
        assert torch.equal(t["blocks.0.mlp.hook_in"], t["blocks.0.hook_resid_mid"])


def test_blocks_normalise_before_each_sublayer(tiny_model):
    """resid_mid = resid_pre + attn_out and ln1 reads resid_pre (pre-norm), per layer."""
    t = tiny_model.trace(torch.arange(1, 8))
    for layer in range(tiny_model.cfg.n_layers):
        pre = t[f"blocks.{layer}.hook_resid_pre"]
        assert torch.allclose(t[f"blocks.{layer}.ln1.hook_normalized"] * t[f"blocks.{layer}.ln1.hook_scale"], pre,
                              atol=1e-5)
        assert torch.allclose(t[f"blocks.{layer}.hook_resid_mid"], pre + t[f"blocks.{layer}.hook_attn_out"])


def test_tied_unembedding_reuses_the_embedding(tiny_dirs):
    m = slmviz.load(tiny_dirs["llama_mqa_tied"])
    p = m.decoder.params
    assert p.unembed is p.embed  # held once, not a copy
    t = m.trace(torch.arange(1, 6))
    assert torch.allclose(t.logits, (t["ln_final.hook_normalized"] * p.ln_final) @ p.embed.t(), atol=1e-5)


def test_position_offset_is_read_once_from_the_cache():
    assert decoder.position_offset(None) == 0
    assert decoder.layer_position_offset(7, 3, decoding=True, kv_position_bug=False) == 7
    assert decoder.layer_position_offset(7, 3, decoding=True, kv_position_bug=True) == 10
    assert decoder.layer_position_offset(0, 3, decoding=False, kv_position_bug=True) == 0


def test_cached_decoding_matches_one_full_forward(tiny_model):
    """Logits of each cached step equal the last row of a full forward over the same tokens."""
    ids = torch.arange(2, 9)
    steps = list(tiny_model.stream(ids, 6, stop_at_eos=False))
    full_ids = torch.cat([ids, torch.tensor([s.token_id for s in steps])])
    full = tiny_model.logits(full_ids)
    assert [int(full[len(ids) - 1 + i].argmax()) for i in range(6)] == [s.token_id for s in steps]
    cache = tiny_model.decoder.new_cache(len(full_ids))
    ctx = build_context(tiny_model.hook_names, [])
    v = BASE
    tiny_model.decoder.forward(full_ids[:7], ctx, v, cache)
    for i in range(7, len(full_ids)):
        step = tiny_model.decoder.forward(full_ids[i : i + 1], ctx, v, cache)
        assert relative_error(full[i], step[0]) <= 1e-5


# --- mutations: break one convention, the tiny model stops matching transformers --------------------
def _layer_statistics_as_rms(monkeypatch):
    monkeypatch.setitem(norm.NORM_STATISTICS, "rms", norm.layer_statistics)


def _interleaved_pairs(monkeypatch):
    monkeypatch.setitem(rope.ROTATIONS, "rotate_half", rope.rotate_interleaved)


def _wrong_rope_base(monkeypatch):
    original = rope.rope_inv_freq
    monkeypatch.setattr(decoder, "rope_inv_freq", lambda d, theta, *a: original(d, theta * 10, *a))


def _tiled_gqa(monkeypatch):
    monkeypatch.setattr(attention, "kv_head_of", lambda q, n_rep: q % 2)


def _no_causal_mask(monkeypatch):
    original = attention.attention_mask
    monkeypatch.setattr(decoder, "attention_mask", lambda nq, nk, causal, *a: original(nq, nk, False, *a))


def _scale_by_d_model(monkeypatch):
    monkeypatch.setattr(block, "attention_scale", lambda d_head, scalar=None: 64**-0.5)


def _activate_up_not_gate(monkeypatch):
    monkeypatch.setitem(mlp.MLP_FORMS, "swiglu", lambda x, gate, up, act, hook: mlp.swiglu(x, up, gate, act, hook))


def _post_norm_order(monkeypatch):
    monkeypatch.setitem(block.RESIDUAL_FORMS, "pre", block.post_norm_residual)


def _no_norm_offset(monkeypatch):
    original = norm.norm_weight
    monkeypatch.setattr(block, "norm_weight", lambda w, offset, fp32: original(w, 0.0, fp32))


def _no_embed_scale(monkeypatch):
    monkeypatch.setattr(decoder, "embed_scale", lambda d, dtype: torch.ones((), dtype=dtype))


def _global_window_one_wider(monkeypatch):
    original = attention.attention_mask
    monkeypatch.setattr(decoder, "attention_mask", lambda nq, nk, causal, sw, *a: original(
        nq, nk, causal, None if sw is None else sw + 1, *a))


def _no_qk_norm(monkeypatch):
    monkeypatch.setattr(block.Block, "qk_normalize", lambda self, q, k, hook, c: (q, k))


def _scale_by_head_dim(monkeypatch):
    monkeypatch.setattr(block, "attention_scale", lambda d_head, scalar=None: d_head**-0.5)


def _exact_gelu(monkeypatch):
    monkeypatch.setitem(mlp.ACTIVATIONS, "gelu_pytorch_tanh", F.gelu)


def _local_base_on_global_layers(monkeypatch):
    original = decoder.Decoder.conventions
    monkeypatch.setattr(decoder.Decoder, "conventions",
                        lambda self, v: replace(original(self, v), rope_local_theta=original(self, v).rope_theta))


def _pre_norm_for_olmo(monkeypatch):
    monkeypatch.setitem(block.RESIDUAL_FORMS, "output", block.pre_norm_residual)


def _sandwich_without_post(monkeypatch):
    monkeypatch.setitem(block.RESIDUAL_FORMS, "sandwich", block.pre_norm_residual)


# Family conventions: (tiny model that has it, mutation).
FAMILY_MUTATIONS = {
    "gemma_norm_offset": ("gemma3", _no_norm_offset),
    "gemma_embed_scale": ("gemma3", _no_embed_scale),
    "gemma_sliding_window": ("gemma3", _global_window_one_wider),
    "gemma_qk_norm": ("gemma3", _no_qk_norm),
    "gemma_query_pre_attn_scalar": ("gemma3", _scale_by_head_dim),
    "gemma_gelu_tanh": ("gemma3", _exact_gelu),
    "gemma_sandwich": ("gemma3", _sandwich_without_post),
    "gemma_local_rope_base": ("gemma3", _local_base_on_global_layers),
    "qwen3_qk_norm": ("qwen3", _no_qk_norm),
    "olmo2_output_norm": ("olmo2", _pre_norm_for_olmo),
    "olmo2_qk_norm": ("olmo2", _no_qk_norm),
}


@pytest.mark.parametrize("convention", list(FAMILY_MUTATIONS))
def test_breaking_a_family_convention_breaks_parity(tiny_dirs, convention, monkeypatch):
    """The same sensitivity check for Gemma 3, Qwen3 and OLMo-2: the broken model differs by > 1e-5 relative
    (20 tokens, 5× the tiny Gemma's sliding window)."""
    arch, mutate = FAMILY_MUTATIONS[convention]
    ids = torch.arange(3, 23)
    ref = run_reference(load_reference(tiny_dirs[arch]), ids)
    mutate(monkeypatch)
    m = slmviz.load(tiny_dirs[arch])
    assert relative_error(ref.logits, m.trace(ids).logits) > 1e-5


MUTATIONS = {
    "rms_norm": _layer_statistics_as_rms,
    "rope_pairing": _interleaved_pairs,
    "rope_frequencies": _wrong_rope_base,
    "gqa_mapping": _tiled_gqa,
    "causal_mask": _no_causal_mask,
    "score_scale": _scale_by_d_model,
    "swiglu_gate": _activate_up_not_gate,
    "norm_order": _post_norm_order,
}


@pytest.mark.parametrize("convention", list(MUTATIONS))
def test_breaking_a_convention_breaks_parity(tiny_dir, convention, monkeypatch):
    """The parity check is sensitive to each convention: the broken model differs from transformers by > 1e-3."""
    hf = load_reference(tiny_dir)
    ids = torch.arange(3, 19)
    ref = run_reference(hf, ids)
    MUTATIONS[convention](monkeypatch)
    m = slmviz.load(tiny_dir)  # a fresh Decoder, so index tables built at construction see the mutation
    assert relative_error(ref.logits, m.trace(ids).logits) > 1e-3


def test_breaking_the_position_offset_breaks_cached_decoding(tiny_model, monkeypatch):
    ids = torch.arange(2, 9)
    faithful = tiny_model.generate_ids(ids, 8, stop_at_eos=False)
    monkeypatch.setattr(decoder, "position_offset", lambda cache: 0)
    assert tiny_model.generate_ids(ids, 8, stop_at_eos=False) != faithful
