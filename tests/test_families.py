"""Gemma 3, Qwen3 and OLMo-2 equal transformers on the same weights, each with its own conventions, hook
names and presets: tiny random models built by transformers' own config classes, and the bundled
Gemma 3 270M (slow). Not covered here: the LLaMA-family presets (tests/test_variants.py) and the pins of
each named convention function (tests/test_conventions.py).
"""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.analysis.diff import kl_per_position
from slmviz.hooks import hook_shape
from slmviz.loading.reference import load_reference, reference_generate, relative_error, run_reference
from slmviz.variants import PRESETS, VariantError, applies

FAMILIES = ["gemma3", "qwen3", "olmo2"]
IDS = torch.arange(3, 23)  # 20 tokens: past the tiny Gemma's 4-token window
# Each family preset, and a tiny model it applies to (docs/correctness.md, the families).
FAMILY_PRESETS = {
    "no_norm_offset": "gemma3", "no_embed_scale": "gemma3", "no_qk_norm": "gemma3", "qk_norm_after_rope": "gemma3",
    "rope_local_as_global": "gemma3", "pre_norm_only": "gemma3", "gelu_exact": "gemma3",
    "no_sliding_window": "gemma3",
}


@pytest.fixture(scope="module")
def family_models(tiny_dirs) -> dict[str, slmviz.Model]:
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in FAMILIES}


@pytest.fixture(scope="module")
def references(tiny_dirs):
    return {arch: load_reference(tiny_dirs[arch]) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_tiny_family_models_match_transformers(family_models, references, arch):
    """Logits within 1e-5 relative, every layer's residual stream and attention pattern too, same argmax."""
    ours, ref = family_models[arch].trace(IDS), run_reference(references[arch], IDS)
    assert relative_error(ref.logits, ours.logits) <= 1e-5
    assert torch.equal(ref.logits.argmax(-1), ours.logits.argmax(-1))
    for layer, (resid, pattern) in enumerate(zip(ref.resid_post, ref.patterns, strict=True)):
        assert relative_error(resid, ours[f"blocks.{layer}.hook_resid_post"]) <= 1e-5, layer
        assert float((pattern - ours[f"blocks.{layer}.attn.hook_pattern"]).abs().max()) <= 1e-5, layer


@pytest.mark.parametrize("arch", FAMILIES)
def test_tiny_family_models_decode_like_transformers_generate(family_models, references, arch):
    """Cached greedy decoding (sliding windows, two RoPE bases, QK-norm all inside the cache) equals generate."""
    ours = family_models[arch].generate_ids(IDS, 12, stop_at_eos=False)
    assert ours == reference_generate(references[arch], IDS, 12)[:12]


def test_each_family_has_exactly_its_own_hook_names(family_models, tiny_model):
    """lnX_post where a norm follows the sub-layer, no lnX where none precedes it, q/k_norm where they exist."""
    def local(m):
        return {n.split(".", 2)[2] for n in m.hook_names if n.startswith("blocks.0.")}

    gemma, qwen3, olmo2 = (local(family_models[a]) for a in FAMILIES)
    llama = local(tiny_model)
    assert {"ln1_post.hook_scale", "ln2_post.hook_normalized", "attn.q_norm.hook_scale", "ln1.hook_scale"} <= gemma
    assert {"attn.q_norm.hook_normalized", "attn.k_norm.hook_scale", "ln1.hook_scale"} <= qwen3
    assert not any("_post." in n for n in qwen3 | llama)
    assert {"ln1_post.hook_scale", "attn.k_norm.hook_normalized"} <= olmo2
    assert not any(n.startswith(("ln1.", "ln2.")) for n in olmo2)
    assert not any("q_norm" in n for n in llama)


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_hook_has_its_table_shape(family_models, arch):
    m = family_models[arch]
    t = m.trace(IDS)
    assert sorted(t.names) == sorted(m.hook_names)
    for name in t.names:
        assert tuple(t[name].shape) == hook_shape(name, m.cfg, len(IDS)), name


def test_qk_norm_hooks_have_per_head_or_per_projection_scales(family_models):
    """Gemma/Qwen3 normalise each head's d_head: one scale per head. OLMo-2 the whole projection: one per position."""
    g = family_models["gemma3"].trace(IDS)["blocks.0.attn.q_norm.hook_scale"]
    o = family_models["olmo2"].trace(IDS)["blocks.0.attn.k_norm.hook_scale"]
    assert g.shape == (20, 4, 1) and o.shape == (20, 1)


@pytest.mark.parametrize("name", list(FAMILY_PRESETS))
def test_every_family_preset_changes_the_model_it_applies_to(family_models, name):
    """KL(faithful ‖ preset) > 0 on a 20-token prompt (5× the tiny Gemma's window, so sliding layers slide).
    On random weights some switches move little (gelu_exact: ~1e-7 nats); the real model's test has a floor."""
    m = family_models[FAMILY_PRESETS[name]]
    assert name in slmviz.variants(m)
    kl = kl_per_position(m.logits(IDS), m.logits(IDS, variant=name))
    assert float(kl.mean()) > 0, name


@pytest.mark.parametrize("name", list(FAMILY_PRESETS))
def test_family_presets_are_refused_on_llama_naming_the_ones_that_apply(tiny_model, name):
    with pytest.raises(VariantError, match=rf"{name}.*does not apply to llama.*Presets that apply to llama: "):
        tiny_model.trace(IDS, variant=name)


def test_applicable_presets_per_family(family_models):
    """qwen3 and olmo2 have QK-norm but no (1 + w), embedding scale, sliding windows or GELU."""
    for arch in ("qwen3", "olmo2"):
        offered = slmviz.variants(family_models[arch])
        assert {"no_qk_norm", "qk_norm_after_rope"} <= set(offered)
        assert not {"no_norm_offset", "no_embed_scale", "no_sliding_window", "gelu_exact", "pre_norm_only"} & set(
            offered)
    gemma = slmviz.variants(family_models["gemma3"])
    assert set(FAMILY_PRESETS) <= set(gemma)
    assert "gqa_tile" not in gemma  # MQA: every query head reads the one KV head either way


def test_norm_placement_is_expressible_on_every_family(family_models, tiny_model):
    """pre / output / post / none run everywhere (each changes the output); sandwich needs both norm weights."""
    for m in (*family_models.values(), tiny_model):
        faithful = m.logits(IDS)
        own = m.cfg.norm_placement
        for placement in ("pre", "output", "post", "none"):
            out = m.logits(IDS, variant={"norm": placement})
            assert torch.equal(out, faithful) == (placement == own), (m.cfg.model_type, placement)
        if own == "sandwich":
            assert torch.equal(m.logits(IDS, variant={"norm": "sandwich"}), faithful)
        else:
            with pytest.raises(VariantError, match="sandwich.*needs norm weights before and after"):
                m.logits(IDS, variant={"norm": "sandwich"})


def test_plots_can_tell_sliding_from_global_layers(family_models, tiny_model):
    cfg = family_models["gemma3"].cfg
    assert cfg.mixes_layer_types and [cfg.layer_type(i) for i in range(3)] == [
        "sliding_attention", "full_attention", "sliding_attention"]
    assert not tiny_model.cfg.mixes_layer_types


# --- the bundled Gemma 3 270M ----------------------------------------------------------------------
GEMMA_PROMPTS = {
    "short": "The capital of France is",
    "code": "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    # 535 tokens, past the window of 512, so the 15 sliding layers really drop keys while the 3 global layers keep
    # them (the test asserts it is past); no longer than that, since attention's cost grows with its square.
    "beyond_window": "The old lighthouse keeper wrote in his log every night. " * 48 + "On the last night he wrote",
}


@pytest.fixture(scope="module")
def gemma():
    return slmviz.load("gemma-3-270m")


@pytest.fixture(scope="module")
def gemma_reference(gemma):
    return load_reference(gemma.path)


@pytest.fixture(scope="module")
def gemma_logits(gemma):
    """{prompt name: gemma.logits(its ids)} (the capture-off path), each computed once for the module's tests: the
    beyond-window prompt's logits are 560 MB."""
    cache: dict[str, torch.Tensor] = {}

    def logits(prompt: str) -> torch.Tensor:
        if prompt not in cache:
            cache[prompt] = gemma.logits(gemma.encode(GEMMA_PROMPTS[prompt]))
        return cache[prompt]

    return logits


@pytest.mark.slow
@pytest.mark.parametrize("prompt", list(GEMMA_PROMPTS))
def test_gemma_3_270m_matches_transformers(gemma, gemma_reference, gemma_logits, prompt):
    """max |Δlogit| ≤ 1e-4, same argmax everywhere, every layer's residual within 1e-5 relative, against
    transformers' eager attention (capturing patterns runs slmviz's eager path too).

    The capture-off path uses SDPA, as transformers' sdpa does: on a 667-token prompt the two sdpa runs
    agree with each other and both differ from eager by 1.6e-4 (measured), so that path is held to the
    reference's own eager-vs-sdpa gap instead."""
    ids = gemma.encode(GEMMA_PROMPTS[prompt])
    if prompt == "beyond_window":
        assert ids.numel() > gemma.cfg.sliding_window
    ours = gemma.trace(ids, names=lambda n: n.endswith(("hook_resid_post", "hook_pattern")))
    ref = run_reference(gemma_reference, ids)
    assert max_abs_difference(ours.logits, ref.logits) <= 1e-4
    assert max_abs_difference(gemma_logits(prompt), ref.logits) <= 5e-4
    assert torch.equal(ours.logits.argmax(-1), ref.logits.argmax(-1))
    for layer in range(gemma.cfg.n_layers):
        assert relative_error(ref.resid_post[layer], ours[f"blocks.{layer}.hook_resid_post"]) <= 1e-5, layer


def max_abs_difference(a: torch.Tensor, b: torch.Tensor, rows: int = 32) -> float:
    """max |a - b| over logits [pos, vocab], `rows` positions at a time: at once, the difference and its absolute
    value are two more tensors as large as the logits (560 MB each on the beyond-window prompt), and on these
    machines fresh memory costs more than the arithmetic (bench/results/notes.md, "make test's CPU")."""
    return max(float((x - y).abs().max()) for x, y in zip(a.split(rows), b.split(rows), strict=True))


@pytest.mark.slow
def test_gemma_3_270m_generates_like_transformers(gemma, gemma_reference):
    ids = gemma.encode(GEMMA_PROMPTS["short"])
    assert gemma.generate_ids(ids, 24, stop_at_eos=False) == reference_generate(gemma_reference, ids, 24)[:24]
    assert gemma.generate(ids, 12).startswith(" the capital of the country of France")


@pytest.mark.slow
def test_gemma_family_presets_change_the_real_model(gemma, gemma_logits):
    """Every Gemma preset moves the logits (KL > 0: faithful vs itself is exactly 0); no_sliding_window only
    beyond the 512-token window. gelu_exact moves them least (~1e-6 nats, bench/results/variants_table.md)."""
    short = gemma.encode(GEMMA_PROMPTS["short"])
    long = gemma.encode(GEMMA_PROMPTS["beyond_window"])
    faithful_short, faithful_long = gemma_logits("short"), gemma_logits("beyond_window")
    for name in FAMILY_PRESETS:
        assert applies(name, gemma.cfg), name
        if name == "no_sliding_window":
            assert torch.equal(gemma.logits(short, variant=name), faithful_short)  # below the window: identical
            kl = kl_per_position(faithful_long, gemma.logits(long, variant=name))
        else:
            kl = kl_per_position(faithful_short, gemma.logits(short, variant=name))
        assert float(kl.mean()) > 0, name
    # gqa_tile (Gemma 3 270M has one KV head), and the presets of conventions Gemma 3 does not have: LayerNorm,
    # learned positions, a parallel residual, partial rotary, soft-capping
    assert [n for n in PRESETS if not applies(n, gemma.cfg)] == ["gqa_tile", "rms_for_layernorm", "no_pos_embed",
                                                                "sequential_residual", "rotary_full", "no_softcap"]


@pytest.mark.slow
def test_slmviz_check_passes_on_gemma(capsys):
    from slmviz.cli import main

    assert main(["check", "--model", "gemma-3-270m", "--prompt", GEMMA_PROMPTS["short"]]) == 0
    assert "OK: slmviz matches transformers" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize("arch", ["llama_gqa", *FAMILIES])
def test_tiny_models_on_cuda_match_transformers(tiny_dirs, arch):
    """The same decoder on a GPU (F.linear instead of the CPU row split) against transformers on the CPU:
    fp32 on both, so only the kernels' summation order differs. Skipped here: this machine has no GPU."""
    m = slmviz.load(tiny_dirs[arch], device="cuda")
    ref = run_reference(load_reference(tiny_dirs[arch]), IDS)
    ours = m.trace(IDS)
    assert relative_error(ref.logits, ours.logits.cpu()) <= 1e-4
    assert m.generate_ids(IDS, 6, stop_at_eos=False) == family_reference_ids(tiny_dirs[arch])


def family_reference_ids(folder) -> list[int]:
    return reference_generate(load_reference(folder), IDS, 6)[:6]
