"""Splicing SAEs and transcoders into trace / generate / stream / scan / patch (docs/features.md)."""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.features.sae import SAE
from slmviz.hooks import SAE_HOOKS, HookNameError

FAMILIES = ["llama_gqa", "qwen2", "mistral", "gemma3", "qwen3", "olmo2"]
IDS = torch.arange(1, 10)


def saes_for(m, seed: int = 0) -> list[SAE]:
    """A residual SAE (layer 0), a transcoder (last layer) and an attn.hook_z SAE (layer 1) of model m."""
    d, last = m.cfg.d_model, m.cfg.n_layers - 1
    return [
        SAE.random(d, 4 * d, architecture="topk", k=8, seed=seed, hook_name="blocks.0.hook_resid_post"),
        SAE.random(d, 3 * d, architecture="jumprelu", seed=seed + 1, hook_name=f"blocks.{last}.mlp.hook_in",
                   hook_name_out=f"blocks.{last}.hook_mlp_out"),
        SAE.random(m.cfg.n_heads * m.cfg.d_head, 2 * d, seed=seed + 2, hook_name="blocks.1.attn.hook_z",
                   reshape_activations="hook_z"),
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to b's largest entry; equal entries (masked scores' -inf too) count as 0."""
    same = a == b
    finite = torch.isfinite(b)
    if not torch.equal(same | finite, torch.ones_like(same)):
        return float("inf")  # a non-finite entry that differs
    diff = torch.where(same, torch.zeros_like(a), a - b)
    return float(diff.abs().max() / b[finite].abs().max().clamp(min=1e-12))


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in FAMILIES}


@pytest.mark.parametrize("arch", FAMILIES)
def test_with_the_error_term_every_hook_equals_the_trace_without_saes(models, arch):
    m = models[arch]
    saes = saes_for(m)
    plain, spliced = m.trace(IDS), m.trace(IDS, saes=saes)
    for name in plain.names:
        assert rel(spliced[name], plain[name]) <= 1e-6, name
    assert rel(spliced.logits, plain.logits) <= 1e-6
    for sae in saes:
        acts = spliced[f"{sae.hook_name_out}.hook_sae_acts_post"]
        assert acts.shape == (len(IDS), sae.d_sae)
        assert set(spliced.names) >= {f"{sae.hook_name_out}.{h}" for h in SAE_HOOKS}
        # the recorded values are the SAE's own: acts from the input, recons + error = the model's value
        x_in = spliced[sae.hook_name].flatten(1) if sae.hook_name.endswith("hook_z") else spliced[sae.hook_name]
        torch.testing.assert_close(acts, sae.encode(x_in))
        recons, error = (spliced[f"{sae.hook_name_out}.{h}"] for h in ("hook_sae_recons", "hook_sae_error"))
        torch.testing.assert_close(recons + error, spliced[sae.hook_name_out].reshape(recons.shape))


def test_zeroing_a_feature_changes_the_output_by_its_decoder_contribution(models):
    m = models["llama_gqa"]
    sae = saes_for(m)[0]
    acts = m.trace(IDS, saes=[sae])[f"{sae.hook_name_out}.hook_sae_acts_post"]
    feature = int(acts.count_nonzero(0).argmax())  # a feature active at several positions
    assert acts[:, feature].count_nonzero() > 0

    def zero(x, name):
        x = x.clone()
        x[:, feature] = 0
        return x

    plain = m.trace(IDS, saes=[sae])
    edited = m.trace(IDS, saes=[sae], hooks={f"{sae.hook_name_out}.hook_sae_acts_post": zero})
    change = edited[sae.hook_name_out] - plain[sae.hook_name_out]
    expected = -acts[:, feature, None] * sae.W_dec[feature].detach()
    torch.testing.assert_close(change, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(edited.logits, plain.logits)  # the edit flows on through the model


def test_without_the_error_term_the_model_runs_on_the_reconstruction(models):
    m = models["llama_gqa"]
    sae = saes_for(m)[0]
    sae.use_error_term = False
    t, plain = m.trace(IDS, saes=[sae]), m.trace(IDS)
    assert not torch.allclose(t.logits, plain.logits)
    torch.testing.assert_close(t[sae.hook_name_out], t[f"{sae.hook_name_out}.hook_sae_recons"])
    torch.testing.assert_close(t[sae.hook_name_out], sae(plain[sae.hook_name_out]))


def test_a_transcoder_replaces_the_mlp_output_by_its_prediction(models):
    m = models["gemma3"]
    tc = saes_for(m)[1]
    tc.use_error_term = False
    t, plain = m.trace(IDS, saes=[tc]), m.trace(IDS)
    torch.testing.assert_close(t[tc.hook_name_out], tc(plain[tc.hook_name]))  # reads mlp.hook_in


def test_several_saes_compose_with_a_variant(models):
    m = models["llama_gqa"]
    saes = saes_for(m)
    plain = m.trace(IDS, variant="rope_interleaved")
    spliced = m.trace(IDS, variant="rope_interleaved", saes=saes)
    assert rel(spliced.logits, plain.logits) <= 1e-6
    assert not torch.allclose(spliced.logits, m.trace(IDS, saes=saes).logits)


def test_generate_and_stream_accept_saes(models):
    m = models["llama_gqa"]
    saes = saes_for(m)
    assert m.generate_ids(IDS, 6, stop_at_eos=False, saes=saes) == m.generate_ids(IDS, 6, stop_at_eos=False)
    seen = []
    steps = list(m.stream(IDS, 3, stop_at_eos=False, saes=saes[:1],
                          hooks={f"{saes[0].hook_name_out}.hook_sae_acts_post": lambda x, n: seen.append(x.shape)}))
    assert len(steps) == 3 and seen[0] == (len(IDS), saes[0].d_sae) and seen[-1] == (1, saes[0].d_sae)


def test_names_can_select_sae_hooks(models):
    m = models["llama_gqa"]
    sae = saes_for(m)[0]
    name = f"{sae.hook_name_out}.hook_sae_acts_post"
    t = m.trace(IDS, saes=[sae], names=[name])
    assert t.names == [name]


def test_bad_saes_are_clear_errors(models):
    m = models["llama_gqa"]
    far = SAE.random(m.cfg.d_model, 8, hook_name="blocks.7.hook_resid_post")
    with pytest.raises(HookNameError, match="blocks.7.hook_resid_post.*does not have"):
        m.trace(IDS, saes=[far])
    sae = saes_for(m)[0]
    with pytest.raises(ValueError, match="two SAEs write"):
        m.trace(IDS, saes=[sae, sae])
    with pytest.raises(TypeError, match="saes= takes a list"):
        m.trace(IDS, saes=sae)
    with pytest.raises(TypeError, match="SAE objects"):
        m.trace(IDS, saes=["blocks.0.hook_resid_post"])
    wide = SAE.random(m.cfg.d_model + 1, 8, hook_name="blocks.0.hook_resid_post")
    with pytest.raises(ValueError, match="width 65"):
        m.trace(IDS, saes=[wide])
    with pytest.raises(HookNameError):
        m.trace(IDS, names=[f"{sae.hook_name_out}.hook_sae_acts_post"])  # not spliced: not a hook


def test_patch_and_scan_accept_saes(models):
    m = models["llama_gqa"]
    saes = saes_for(m)
    clean, corrupted = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]
    with_saes = slmviz.patch(clean, corrupted, answer=7, wrong=9, model=m, site="resid_mid", saes=saes)
    plain = slmviz.patch(clean, corrupted, answer=7, wrong=9, model=m, site="resid_mid")
    torch.testing.assert_close(with_saes.values, plain.values, rtol=1e-5, atol=1e-5)
    saes[0].use_error_term = False
    broken = slmviz.patch(clean, corrupted, answer=7, wrong=9, model=m, site="resid_mid", saes=saes[:1])
    assert broken.clean != plain.clean
    saes[0].use_error_term = True

    name = f"{saes[0].hook_name_out}.hook_sae_acts_post"
    docs = ["w1 w2 w3 w4 w5 w6", "w9 w8 w7"]
    s = slmviz.scan(docs, hooks=[name], model=m, saes=saes, top_k=2, progress=False)
    # the scan zeroes features on the rows the SAE's row rule drops: each window's first (no row here is massive)
    acts = torch.cat([m.trace(d, saes=saes, names=[name])[name][1:] for d in docs])
    acts = torch.cat([acts, acts.new_zeros(len(docs), acts.shape[1])])
    torch.testing.assert_close(s.mean(name).float(), acts.mean(0), rtol=1e-5, atol=1e-6)
    top = s.top_examples(name, int(acts.amax(0).argmax()))
    assert float(top.activation.iloc[0]) == pytest.approx(float(acts.max()), rel=1e-5)


def test_attribution_gradients_flow_through_the_features(models):
    m = models["llama_gqa"]
    sae = saes_for(m)[0]
    est = slmviz.patch([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], answer=7, wrong=9, model=m, site="resid_mid",
                       method="attribution", saes=[sae])
    assert torch.isfinite(est.values).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", [None, "gemma-3-270m"])
def test_bundled_models_trace_identically_with_a_random_sae(name):
    m = slmviz.load(name)
    layer = m.cfg.n_layers // 2
    saes = [SAE.random(m.cfg.d_model, 1024, architecture="topk", k=32, hook_name=f"blocks.{layer}.hook_resid_post"),
            SAE.random(m.cfg.d_model, 1024, architecture="jumprelu", seed=1, hook_name=f"blocks.{layer}.mlp.hook_in",
                       hook_name_out=f"blocks.{layer}.hook_mlp_out")]
    prompt = "The capital of France is Paris, and the capital of Italy is"
    plain, spliced = m.trace(prompt), m.trace(prompt, saes=saes)
    for hook in plain.names:
        assert rel(spliced[hook], plain[hook]) <= 1e-6, hook
    assert rel(spliced.logits, plain.logits) <= 1e-6
