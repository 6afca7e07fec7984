"""GPT-2, GPT-NeoX (Pythia) and Gemma 2 equal transformers on the same weights (tiny random models built by
transformers' own config classes), keep the hook contract with TransformerLens's names, pin each of their
conventions to its named function, refuse the checkpoint options slmviz does not reimplement, and offer their
presets only where they apply. Not covered here: real checkpoints (`slmviz check` runs those on a user's
machine), and the analyses on these families (tests/test_families_parts.py).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from family_models import NEW_FAMILIES, build_family_model

import slmviz
from slmviz.analysis.diff import kl_per_position
from slmviz.config import UnsupportedModelError, config_from_hf
from slmviz.hooks import NULL_CONTEXT, hook_shape, layer_hook_name
from slmviz.loading.reference import load_reference, reference_generate, relative_error, run_reference
from slmviz.loading.weights import conv1d_to_linear, neox_qkv_rows, read_tensors
from slmviz.model.attention import softcap
from slmviz.model.decoder import learned_positions
from slmviz.model.mlp import gelu_new
from slmviz.model.norm import normalize
from slmviz.model.rope import rotate_half, rotate_partial
from slmviz.variants import VariantError, resolve_variant

FAMILIES = list(NEW_FAMILIES)
IDS = torch.arange(3, 23)  # 20 tokens: past the tiny Gemma 2's 4-token window


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: build_family_model(root / arch, arch) for arch in FAMILIES}


@pytest.fixture(scope="module")
def models(dirs):
    return {arch: slmviz.load(dirs[arch]) for arch in FAMILIES}


@pytest.fixture(scope="module")
def references(dirs):
    return {arch: load_reference(dirs[arch]) for arch in FAMILIES}


@pytest.fixture(scope="module")
def traces(models):
    return {arch: models[arch].trace(IDS) for arch in FAMILIES}


def at(layer: int, local: str) -> str:
    return layer_hook_name(layer, local)


def decode_step_logits(m: slmviz.Model, variant: str | None) -> torch.Tensor:
    """The logits [vocab] of one cached decoding step (token 7) after prefilling IDS, under `variant`."""
    v = resolve_variant(variant, m.cfg)
    cache = m.decoder.new_cache(len(IDS) + 1)
    m.decoder.forward(IDS, NULL_CONTEXT, v, cache)
    return m.decoder.forward(torch.tensor([7]), NULL_CONTEXT, v, cache)[-1]


# --- parity ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILIES)
def test_each_new_family_matches_transformers_eager(models, references, traces, arch):
    """Logits within 1e-5 relative (traced and plain paths), every block's output and pattern too, same argmax."""
    ref = run_reference(references[arch], IDS)
    ours = traces[arch]
    assert relative_error(ref.logits, ours.logits) <= 1e-5
    assert relative_error(ref.logits, models[arch].logits(IDS)) <= 1e-5
    assert torch.equal(ref.logits.argmax(-1), ours.logits.argmax(-1))
    for layer, (resid, pattern) in enumerate(zip(ref.resid_post, ref.patterns, strict=True)):
        assert relative_error(resid, ours[at(layer, "hook_resid_post")]) <= 1e-5, layer
        assert float((pattern - ours[at(layer, "attn.hook_pattern")]).abs().max()) <= 1e-5, layer


@pytest.mark.parametrize("arch", FAMILIES)
def test_each_new_family_decodes_like_transformers_generate(models, references, arch):
    """Cached greedy decoding (learned positions past the prompt, partial rotary, capped scores in the cache)."""
    assert models[arch].generate_ids(IDS, 12, stop_at_eos=False) == reference_generate(references[arch], IDS, 12)[:12]


# --- hook names and the contract -------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILIES)
def test_every_hook_has_its_table_shape(models, traces, arch):
    m, t = models[arch], traces[arch]
    assert sorted(t.names) == sorted(m.hook_names)
    for name in t.names:
        assert tuple(t[name].shape) == hook_shape(name, m.cfg, len(IDS)), name


def test_transformer_lens_names_per_family(models, traces):
    """GPT-2: hook_pos_embed, rotary hooks that turn nothing, an ungated MLP (hook_pre, hook_post); Pythia:
    hook_rot_q on partial rotary, ungated MLP; Gemma 2: four norms per block, the gated MLP's hooks. ln1's scale and
    normalized everywhere."""
    names = {arch: set(models[arch].hook_names) for arch in FAMILIES}
    for arch in FAMILIES:
        assert {at(0, "ln1.hook_scale"), at(0, "ln1.hook_normalized"), at(1, "ln2.hook_scale")} <= names[arch]
    assert "hook_pos_embed" in names["gpt2"] and "hook_pos_embed" not in names["gpt_neox"] | names["gemma2"]
    t = traces["gpt2"]  # nothing turns: hook_rot_q is hook_q (kept so QK attributions read one name everywhere)
    assert torch.equal(t[at(0, "attn.hook_rot_q")], t[at(0, "attn.hook_q")])
    assert {at(0, "attn.hook_rot_q"), at(0, "attn.hook_rot_k")} <= names["gpt_neox"]
    for arch in ("gpt2", "gpt_neox"):
        assert {at(0, "mlp.hook_pre"), at(0, "mlp.hook_post")} <= names[arch]
        assert not any(n.endswith(("mlp.hook_gate", "mlp.hook_pre_linear")) for n in names[arch])
    assert {at(0, "ln1_post.hook_scale"), at(0, "ln2_post.hook_normalized"), at(0, "mlp.hook_gate")} <= names["gemma2"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_hook_contract_identities_hold_parallel_residual_included(models, traces, arch):
    """resid_post = resid_pre + attn_out + mlp_out (through resid_mid), resid_pre[L+1] = resid_post[L], and the
    first resid_pre is hook_embed (+ hook_pos_embed). Not covered: edits through these hooks (test_hooks.py)."""
    t, n = traces[arch], models[arch].cfg.n_layers
    first = t["hook_embed"] + (t["hook_pos_embed"] if arch == "gpt2" else 0)
    assert torch.equal(first, t[at(0, "hook_resid_pre")])
    for layer in range(n):
        pre, mid, post = (t[at(layer, f"hook_resid_{s}")] for s in ("pre", "mid", "post"))
        assert torch.equal(mid, pre + t[at(layer, "hook_attn_out")])
        assert torch.equal(post, mid + t[at(layer, "hook_mlp_out")])
        scale = float(post.abs().max())
        assert float((post - (pre + t[at(layer, "hook_attn_out")] + t[at(layer, "hook_mlp_out")])).abs().max()) \
            <= 1e-6 * scale
        if layer + 1 < n:
            assert torch.equal(post, t[at(layer + 1, "hook_resid_pre")])
        pattern = t[at(layer, "attn.hook_pattern")]
        assert torch.allclose(pattern.sum(-1), torch.ones(()), atol=1e-5)
        assert float(pattern.triu(1).abs().max()) == 0.0


# --- the conventions, one pin each --------------------------------------------------------------------------
def test_gpt2_conv1d_weights_are_transposed(models, dirs):
    """c_attn, c_proj, c_fc and the MLP's c_proj are stored [in, out]; the decoder holds their transposes. The
    attention's c_proj is square, so an untransposed copy would pass every shape check."""
    raw = read_tensors(dirs["gpt2"])
    layer = models["gpt2"].decoder.params.layers[0]
    w = raw["transformer.h.0.attn.c_proj.weight"]
    assert w.shape[0] == w.shape[1] and not torch.equal(w, w.t())
    assert torch.equal(conv1d_to_linear(w), w.t()) and torch.equal(layer.w_o, w.t())
    assert torch.equal(layer.w_qkv, raw["transformer.h.0.attn.c_attn.weight"].t())
    assert torch.equal(layer.w_gate_up, raw["transformer.h.0.mlp.c_fc.weight"].t())
    assert torch.equal(layer.w_down, raw["transformer.h.0.mlp.c_proj.weight"].t())


def test_neox_fused_qkv_is_laid_out_per_head():
    """NeoX's rows are [q_0, k_0, v_0, q_1, k_1, v_1, ...], dh rows each; slmviz's are all q, all k, all v."""
    h, dh = 2, 3
    rows = torch.arange(3 * h * dh)
    q, k, v = neox_qkv_rows(rows, h, dh).split(h * dh)
    assert q.tolist() == [0, 1, 2, 9, 10, 11] and k.tolist() == [3, 4, 5, 12, 13, 14]
    assert v.tolist() == [6, 7, 8, 15, 16, 17]
    w = torch.randn(3 * h * dh, 5)
    assert torch.equal(neox_qkv_rows(w, h, dh)[dh:2 * dh], w[3 * dh:4 * dh])  # q of head 1 follows q of head 0


def test_layer_norm_centres_and_adds_its_bias(traces, models):
    """LayerNorm subtracts the row's mean and adds a bias after the weight: torch's layer_norm, bit for bit unhooked,
    within rounding hooked; hook_normalized (before weight and bias) has mean 0 on every row."""
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 16) * 3 + 1, torch.randn(16), torch.randn(16)
    expected = F.layer_norm(x, (16,), w, b, 1e-5)
    assert torch.equal(normalize(x, w, 1e-5, "layer", bias=b), expected)
    hooked = normalize(x, w, 1e-5, "layer", on_normalized=lambda v: v, bias=b)
    assert float((hooked - expected).abs().max()) <= 1e-6
    assert not torch.allclose(normalize(x, w, 1e-5, "rms", bias=b), expected, atol=1e-3)
    for arch in ("gpt2", "gpt_neox"):
        normalized = traces[arch][at(0, "ln1.hook_normalized")]
        assert float(normalized.mean(-1).abs().max()) <= 1e-5
        p = models[arch].decoder.params.layers[0]
        resid = traces[arch][at(0, "hook_resid_pre")]
        assert torch.allclose(normalized * p.ln1 + p.norm_biases["ln1"], F.layer_norm(resid, (resid.shape[-1],),
                              p.ln1, p.norm_biases["ln1"], models[arch].cfg.norm_eps), atol=1e-5)


def test_gpt2_uses_gelu_new_written_out():
    """Equal, bit for bit, to transformers' NewGELUActivation; the exact erf GELU differs."""
    from transformers.activations import NewGELUActivation

    x = torch.linspace(-6, 6, 1001)
    assert torch.equal(gelu_new(x), NewGELUActivation()(x))
    assert float((gelu_new(x) - F.gelu(x)).abs().max()) > 1e-4


def test_partial_rotary_turns_the_first_dims_paired_within_them(traces, models):
    """Pythia's rotary_pct 0.25 of d_head 16 turns dims 0..3, pairing i with i + 2; dims 4.. pass unchanged; position 0
    does not move; each turned pair keeps its norm. With every dim turned, rotate_partial is rotate_half."""
    cfg, t = models["gpt_neox"].cfg, traces["gpt_neox"]
    r = cfg.rotary_dims
    assert r == 4 and cfg.d_head == 16
    q, rot = t[at(0, "attn.hook_q")], t[at(0, "attn.hook_rot_q")]
    assert torch.equal(rot[..., r:], q[..., r:]) and torch.allclose(rot[0], q[0])
    assert not torch.allclose(rot[1:, :, :r], q[1:, :, :r])
    for i in range(r // 2):
        pair = [i, i + r // 2]
        assert torch.allclose(rot[..., pair].norm(dim=-1), q[..., pair].norm(dim=-1), atol=1e-5)
    x, angles = torch.randn(1, 3, 2, 8), torch.rand(3, 4)
    assert torch.equal(rotate_partial(x, angles, rotate_half, 8), rotate_half(x, angles))


def test_neox_runs_attention_and_mlp_in_parallel(traces, models):
    """The MLP reads ln2 of the block's *input* (resid_pre), not resid_mid; sequential_residual changes the logits."""
    m, t = models["gpt_neox"], traces["gpt_neox"]
    p = m.decoder.params.layers[1]
    expected = F.layer_norm(t[at(1, "hook_resid_pre")], (m.cfg.d_model,), p.ln2, p.norm_biases["ln2"], m.cfg.norm_eps)
    assert torch.allclose(t[at(1, "mlp.hook_in")], expected, atol=1e-5)
    assert not torch.allclose(t[at(1, "mlp.hook_in")], F.layer_norm(
        t[at(1, "hook_resid_mid")], (m.cfg.d_model,), p.ln2, p.norm_biases["ln2"], m.cfg.norm_eps), atol=1e-3)
    assert float(kl_per_position(m.logits(IDS), m.logits(IDS, variant="sequential_residual")).mean()) > 0


def test_learned_positions_carry_the_cache_offset(models, references):
    """A decoding step reads the wpe row of its absolute position; the bug reads row 0 (prefill unaffected)."""
    assert learned_positions(5, 1, True, False, 64).tolist() == [5]
    assert learned_positions(5, 1, True, True, 64).tolist() == [0]
    assert learned_positions(0, 3, False, True, 64).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="max_position_embeddings"):
        learned_positions(63, 2, True, False, 64)
    m = models["gpt2"]
    full = m.logits(torch.cat([IDS, torch.tensor([7])]))[-1]
    assert relative_error(full, decode_step_logits(m, None)) <= 1e-5
    assert not torch.allclose(full, decode_step_logits(m, "kv_position_bug"), atol=1e-3)


def test_gemma2_soft_caps_scores_before_the_mask_and_logits(models, traces):
    """hook_attn_scores holds cap · tanh(s / cap) (TransformerLens's meaning), masked entries -inf after the cap;
    logits lie within ±final cap; without the caps (no_softcap) both exceed them on this model."""
    m, t = models["gemma2"], traces["gemma2"]
    x = torch.linspace(-10, 10, 101)
    assert torch.equal(softcap(x, 2.0), torch.tanh(x / 2.0) * 2.0) and softcap(x, None) is x
    scores = t[at(1, "attn.hook_attn_scores")]
    finite = scores[torch.isfinite(scores)]
    assert float(finite.abs().max()) <= m.cfg.attn_softcap
    assert torch.isinf(scores.triu(1)[scores.triu(1) != 0]).all()
    assert float(t.logits.abs().max()) <= m.cfg.final_logit_softcap
    uncapped = m.trace(IDS, variant="no_softcap", names=[at(1, "attn.hook_attn_scores")])
    raw = uncapped[at(1, "attn.hook_attn_scores")]
    assert float(raw[torch.isfinite(raw)].abs().max()) > m.cfg.attn_softcap
    assert float(uncapped.logits.abs().max()) > m.cfg.final_logit_softcap


# --- checkpoint options refused by name ---------------------------------------------------------------------
@pytest.mark.parametrize("option", ["scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"])
def test_gpt2_options_slmviz_does_not_reimplement_are_refused_by_name(option):
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModelError, match=option):
        config_from_hf(GPT2Config(n_layer=1, n_embd=32, n_head=2, **{option: True}))


def test_an_unknown_rope_type_is_refused_by_name():
    from transformers import GPTNeoXConfig

    raw = GPTNeoXConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64).to_dict()
    raw["rope_parameters"] = {"rope_type": "longrope_v9", "rope_theta": 1e4, "partial_rotary_factor": 0.25}
    with pytest.raises(UnsupportedModelError, match="longrope_v9"):
        config_from_hf(types.SimpleNamespace(**raw))


# --- presets --------------------------------------------------------------------------------------------------
OWN_PRESETS = {
    "gpt2": ["rms_for_layernorm", "no_pos_embed", "post_norm", "kv_position_bug"],
    "gpt_neox": ["sequential_residual", "rotary_full", "rms_for_layernorm", "kv_position_bug"],
    "gemma2": ["no_softcap", "pre_norm_only", "no_norm_offset", "kv_position_bug"],
}


@pytest.mark.parametrize(("arch", "name"), [(a, n) for a, names in OWN_PRESETS.items() for n in names])
def test_each_family_preset_is_offered_and_changes_its_family(models, arch, name):
    """KL(faithful ‖ preset) > 0 on the prompt; kv_position_bug on the generated tokens instead (prefill is equal)."""
    m = models[arch]
    assert name in slmviz.variants(m)
    if name == "kv_position_bug":
        assert not torch.equal(decode_step_logits(m, name), decode_step_logits(m, None))
        assert torch.equal(m.logits(IDS, variant=name), m.logits(IDS))
        return
    assert float(kl_per_position(m.logits(IDS), m.logits(IDS, variant=name)).mean()) > 0, name


REFUSED = [
    ("gpt2", "rotary_full", "partial rotary"), ("gpt2", "sequential_residual", "parallel residual"),
    ("gpt2", "no_softcap", "soft-capped"), ("gpt2", "rope_interleaved", "rotary positions"),
    ("gpt2", "standard_ffn", "gated MLP"), ("gpt2", "layer_norm", "changes nothing"),
    ("gpt_neox", "no_pos_embed", "learned absolute positions"), ("gpt_neox", "post_norm", "parallel residual"),
    ("gemma2", "rms_for_layernorm", "convention gemma2 does not have"), ("gemma2", "rotary_full", "partial rotary"),
]


@pytest.mark.parametrize(("arch", "name", "why"), REFUSED)
def test_presets_are_refused_where_they_do_not_apply_saying_why(models, arch, name, why):
    with pytest.raises(VariantError, match=rf"{name}.*does not apply to {arch}.*{why}.*Presets that apply"):
        models[arch].trace(IDS, variant=name)


# --- slmviz check ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", FAMILIES)
def test_slmviz_check_proves_parity_on_a_folder_of_each_family(dirs, arch, capsys):
    """`slmviz check FOLDER`: every layer, every pattern, the logits and 16 greedy tokens against transformers."""
    from slmviz.cli import main

    assert main(["check", str(dirs[arch]), "--prompt", "w3 w4 w5 w6 w7 w8"]) == 0
    out = capsys.readouterr().out
    assert "OK: slmviz matches transformers" in out and "equal to transformers' generate: True" in out
    assert arch in out


# --- mutations: break one convention, the tiny model stops matching transformers --------------------------------
def _exact_gelu_for_gelu_new(mp):
    from slmviz.model import mlp

    mp.setitem(mlp.ACTIVATIONS, "gelu_new", F.gelu)


def _rms_for_layer_statistics(mp):
    from slmviz.model import norm

    mp.setitem(norm.NORM_STATISTICS, "layer", norm.rms_statistics)


def _qkv_rows_as_stored(mp):
    from slmviz.loading import weights

    mp.setattr(weights, "neox_qkv_rows", lambda w, h, dh: w)


def _rotate_the_last_dims(mp):
    from slmviz.model import block

    def last(x, angles, rotate, n_rot, in_fp32=False):
        if n_rot == x.shape[-1]:
            return rotate(x, angles, in_fp32)
        return torch.cat((x[..., :-n_rot], rotate(x[..., -n_rot:], angles, in_fp32)), dim=-1)

    mp.setattr(block, "rotate_partial", last)


def _sequential_for_parallel(mp):
    from slmviz.model import block

    def sequential(x, attn, mlp, hook):
        mid = hook("hook_resid_mid", x + hook("hook_attn_out", attn(x)))
        return mid + hook("hook_mlp_out", mlp(mid))

    mp.setattr(block, "parallel_residual", sequential)


def _no_softcap(mp):
    from slmviz.model import attention, decoder

    mp.setattr(attention, "softcap", lambda x, cap: x)
    mp.setattr(decoder, "softcap", lambda x, cap: x)


MUTATIONS = {
    "gpt2_gelu_new": ("gpt2", _exact_gelu_for_gelu_new),
    "gpt2_layer_norm_centring": ("gpt2", _rms_for_layer_statistics),
    "neox_qkv_layout": ("gpt_neox", _qkv_rows_as_stored),
    "neox_partial_rotary_dims": ("gpt_neox", _rotate_the_last_dims),
    "neox_parallel_residual": ("gpt_neox", _sequential_for_parallel),
    "gemma2_softcap": ("gemma2", _no_softcap),
}


@pytest.mark.parametrize("convention", list(MUTATIONS))
def test_breaking_a_new_family_convention_breaks_parity(dirs, references, convention, monkeypatch):
    """The parity check is sensitive to each new convention: the broken model differs by > 1e-5 relative. (The
    learned-position offset only shows in decoding: test_learned_positions_carry_the_cache_offset.)"""
    arch, mutate = MUTATIONS[convention]
    ref = run_reference(references[arch], IDS)
    mutate(monkeypatch)
    m = slmviz.load(dirs[arch])
    assert relative_error(ref.logits, m.trace(IDS).logits) > 1e-5
