"""load_sae: SAELens folders, Gemma Scope 2 folders (every site, with and without config.json), the hub, bad input;
and steering / logit effects / nearest features."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import slmviz
from slmviz.errors import SAEError
from slmviz.features.sae import SAE
from slmviz.formats import hub

# Gemma Scope 2's hook points, as its config.json writes them (hf_hook_point_in / _out).
HF_POINTS = {
    "resid_post": ("model.layers.{L}.output", None),
    "attn_out": ("model.layers.{L}.self_attn.o_proj.input", None),
    "mlp_out": ("model.layers.{L}.post_feedforward_layernorm.output", None),
    "transcoder": ("model.layers.{L}.pre_feedforward_layernorm.output",
                   "model.layers.{L}.post_feedforward_layernorm.output"),
}
EXPECTED_HOOKS = {
    "resid_post": ("blocks.{L}.hook_resid_post", "blocks.{L}.hook_resid_post"),
    "attn_out": ("blocks.{L}.attn.hook_z", "blocks.{L}.attn.hook_z"),
    "mlp_out": ("blocks.{L}.hook_mlp_out", "blocks.{L}.hook_mlp_out"),
    "transcoder": ("blocks.{L}.mlp.hook_in", "blocks.{L}.hook_mlp_out"),
}


@pytest.fixture(scope="module")
def gemma(tiny_dirs):
    return slmviz.load(tiny_dirs["gemma3"])


def gemma_scope_folder(root: Path, m, site: str, layer: int, config: bool, affine: bool = False,
                       d_sae: int = 32, seed: int = 0,
                       every_layer: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """A folder laid out exactly like Gemma Scope 2's: {site}/layer_{L}_width_{W}_l0_{size}[_affine]/params.safetensors
    with w_enc, w_dec, b_enc, b_dec, threshold (+ affine_skip_connection [d_in, d_out]) and maybe config.json;
    `every_layer`: under {site}_all/, as its every-layer sets (transcoder_all, resid_post_all) are."""
    g = torch.Generator().manual_seed(seed)
    d_in = m.cfg.n_heads * m.cfg.d_head if site == "attn_out" else m.cfg.d_model
    d_out = d_in
    group = f"{site}_all" if every_layer else site
    folder = root / group / f"layer_{layer}_width_{d_sae}_l0_small{'_affine' if affine else ''}"
    folder.mkdir(parents=True)
    params = {
        "w_enc": torch.randn(d_in, d_sae, generator=g) * 0.3, "w_dec": torch.randn(d_sae, d_out, generator=g) * 0.1,
        "b_enc": torch.randn(d_sae, generator=g) * 0.1, "b_dec": torch.randn(d_out, generator=g) * 0.1,
        "threshold": torch.rand(d_sae, generator=g) * 0.2,
    }
    if affine:
        params["affine_skip_connection"] = torch.randn(d_in, d_out, generator=g) * 0.05
    save_file(params, str(folder / "params.safetensors"))
    if config:
        point_in, point_out = HF_POINTS[site]
        cfg = {"architecture": "jump_relu", "hf_hook_point_in": point_in.format(L=layer), "model_name": "gemma-v3-270m",
               "width": d_sae, "l0": 10}
        if point_out:
            cfg["hf_hook_point_out"] = point_out.format(L=layer)
            cfg["affine_connection"] = affine
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder, params


@pytest.mark.parametrize("config", [True, False], ids=["config", "no_config"])
@pytest.mark.parametrize("site", ["resid_post", "attn_out", "mlp_out", "transcoder"])
def test_gemma_scope_2_folders_load_for_each_site(tmp_path, gemma, site, config):
    layer = 1
    folder, p = gemma_scope_folder(tmp_path, gemma, site, layer, config)
    sae = slmviz.load_sae(folder, model=gemma)
    hook_in, hook_out = (h.format(L=layer) for h in EXPECTED_HOOKS[site])
    assert (sae.hook_name, sae.hook_name_out) == (hook_in, hook_out)
    assert sae.architecture == "jumprelu" and not sae.apply_b_dec_to_input and sae.model is gemma
    assert sae.is_transcoder == (site == "transcoder")
    # the JumpReLU formula on the model's own activation at that hook
    t = gemma.trace(torch.arange(1, 8))
    x = t[hook_in].flatten(1) if site == "attn_out" else t[hook_in]
    h = x @ p["w_enc"] + p["b_enc"]
    f = torch.relu(h) * (h > p["threshold"])
    torch.testing.assert_close(sae.encode(x), f)
    torch.testing.assert_close(sae.decode(f), f @ p["w_dec"] + p["b_dec"])
    spliced = gemma.trace(torch.arange(1, 8), saes=[sae])
    torch.testing.assert_close(spliced[f"{hook_out}.hook_sae_acts_post"], f)
    torch.testing.assert_close(spliced.logits, t.logits, rtol=0, atol=0)


@pytest.mark.parametrize("site", ["resid_post", "transcoder"])
def test_every_layer_sets_load_by_their_folder_names(tmp_path, gemma, site):
    """Gemma Scope 2's every-layer sets (`transcoder_all/layer_L_...`, `resid_post_all/...`) hold the same files;
    without a config.json their site comes from the folder name with `_all` dropped."""
    for layer in range(gemma.cfg.n_layers):
        folder, _ = gemma_scope_folder(tmp_path, gemma, site, layer, config=False, every_layer=True)
        sae = slmviz.load_sae(folder, model=gemma)
        assert (sae.hook_name, sae.hook_name_out) == tuple(h.format(L=layer) for h in EXPECTED_HOOKS[site])
    odd = tmp_path / "transcoders_every" / "layer_0_width_32_l0_small"
    odd.mkdir(parents=True)
    (odd / "params.safetensors").write_bytes((folder / "params.safetensors").read_bytes())
    with pytest.raises(SAEError, match=r"site one of .*got 'transcoders_every/layer_0"):
        slmviz.load_sae(odd, model=gemma)


@pytest.mark.parametrize("config", [True, False], ids=["config", "no_config"])
def test_an_affine_transcoder_adds_x_times_the_skip_connection(tmp_path, gemma, config):
    folder, p = gemma_scope_folder(tmp_path, gemma, "transcoder", 2, config, affine=True)
    tc = slmviz.load_sae(folder, model=gemma)
    assert tc.W_skip is not None and tc.W_skip.shape == (gemma.cfg.d_model, gemma.cfg.d_model)
    x = torch.randn(5, gemma.cfg.d_model)
    h = x @ p["w_enc"] + p["b_enc"]
    f = torch.relu(h) * (h > p["threshold"])
    torch.testing.assert_close(tc(x), f @ p["w_dec"] + p["b_dec"] + x @ p["affine_skip_connection"])


def test_gemma_scope_folders_round_trip_through_saelens_format(tmp_path, gemma):
    folder, _ = gemma_scope_folder(tmp_path, gemma, "transcoder", 0, config=False, affine=True)
    tc = slmviz.load_sae(folder)
    tc.save(tmp_path / "saelens")
    cfg = json.loads((tmp_path / "saelens" / "cfg.json").read_text())
    assert cfg["architecture"] == "jumprelu_skip_transcoder" and cfg["apply_b_dec_to_input"] is False
    back = slmviz.load_sae(tmp_path / "saelens", model=gemma)
    x = torch.randn(4, gemma.cfg.d_model)
    assert torch.equal(back(x), tc(x)) and back.hook_name == "blocks.0.mlp.hook_in"


def test_gemma_scope_bad_folders_are_clear_errors(tmp_path, gemma):
    folder, p = gemma_scope_folder(tmp_path, gemma, "resid_post", 1, config=False)
    odd = tmp_path / "somewhere" / "my_sae"
    odd.mkdir(parents=True)
    (odd / "params.safetensors").write_bytes((folder / "params.safetensors").read_bytes())
    with pytest.raises(SAEError, match="named like Gemma Scope 2"):
        slmviz.load_sae(odd)
    p2 = dict(p)
    del p2["threshold"]
    save_file(p2, str(folder / "params.safetensors"))
    with pytest.raises(SAEError, match=r"missing \['threshold'\]"):
        slmviz.load_sae(folder)
    aff, _ = gemma_scope_folder(tmp_path / "b", gemma, "transcoder", 1, config=True, affine=False)
    cfg = json.loads((aff / "config.json").read_text())
    (aff / "config.json").write_text(json.dumps({**cfg, "affine_connection": True}))
    with pytest.raises(SAEError, match="affine transcoder.*no affine_skip_connection"):
        slmviz.load_sae(aff)
    (aff / "config.json").write_text(json.dumps({**cfg, "architecture": "topk"}))
    with pytest.raises(SAEError, match="only 'jump_relu'"):
        slmviz.load_sae(aff)


def test_a_width_or_hook_the_model_lacks_is_a_clear_error(tmp_path, gemma, tiny_dirs):
    llama = slmviz.load(tiny_dirs["llama_gqa"])  # d_model 64 vs Gemma's 80
    folder, _ = gemma_scope_folder(tmp_path, gemma, "resid_post", 1, config=True)
    with pytest.raises(SAEError, match=r"reads 80 values per token at 'blocks.1.hook_resid_post'.*64 wide"):
        slmviz.load_sae(folder, model=llama)
    deep = SAE.random(80, 8, hook_name="blocks.9.hook_resid_post")
    with pytest.raises(SAEError, match="does not have; this model has hook_resid_post at layers 0..2"):
        slmviz.load_sae(deep, model=gemma)
    post = SAE.random(64, 8, hook_name="blocks.0.ln2_post.hook_normalized")  # a Gemma / OLMo-2 hook only
    with pytest.raises(SAEError, match="llama models have no 'ln2_post.hook_normalized' hook"):
        slmviz.load_sae(post, model=llama)


def test_saelens_folders_load_and_pickles_are_refused(tmp_path, gemma):
    sae = SAE.random(80, 16, architecture="topk", k=4, hook_name="blocks.0.hook_resid_post",
                     apply_b_dec_to_input=True)
    sae.save(tmp_path / "s")
    back = slmviz.load_sae(tmp_path / "s", model=gemma)
    assert back.apply_b_dec_to_input and back.k == 4
    assert slmviz.load_sae(tmp_path / "s" / "sae_weights.safetensors").k == 4  # the weights file names its folder
    assert slmviz.load_sae(tmp_path, subfolder="s").k == 4
    torch.save(sae.state_dict(), tmp_path / "sae.pt")
    with pytest.raises(SAEError, match="pickle"):
        slmviz.load_sae(tmp_path / "sae.pt")
    (tmp_path / "only_pickle").mkdir()
    torch.save({}, tmp_path / "only_pickle" / "weights.bin")
    with pytest.raises(SAEError, match="pickle"):
        slmviz.load_sae(tmp_path / "only_pickle")
    with pytest.raises(SAEError, match="neither a folder"):
        slmviz.load_sae(str(tmp_path / "nothing" / "here"))


def test_a_hub_id_downloads_only_when_given_and_an_unreachable_hub_fails_in_bounded_time(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def hang(*args, **kwargs):
        calls.append(args)
        time.sleep(30)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hang)
    with pytest.raises(SAEError, match="neither a folder"):
        slmviz.load_sae("not a hub id")
    assert not calls  # nothing is fetched for a local name
    start = time.perf_counter()
    with pytest.raises(SAEError, match="did not answer.*within 1 s"):
        hub.download("google/gemma-scope-2-270m-pt", "resid_post/layer_9_width_16k_l0_medium", timeout_s=1)
    assert time.perf_counter() - start < 10 and calls

    def refuse(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refuse)
    with pytest.raises(SAEError, match="could not fetch google/gemma-scope-2-270m-pt/resid_post.*ConnectionError"):
        slmviz.load_sae("google/gemma-scope-2-270m-pt", subfolder="resid_post/layer_9_width_16k_l0_medium")
    with pytest.raises(SAEError, match="no folder 'google/gemma-scope-2-270m-pt' here.*subfolder="):
        slmviz.load_sae("google/gemma-scope-2-270m-pt")
    assert len(calls) == 1  # neither of those asked the hub


def test_a_hub_folder_in_gemma_scope_layout_loads(monkeypatch, tmp_path, gemma):
    """The hub path with a fake client serving a Gemma Scope 2 folder without config.json from a local 'repo'."""
    import huggingface_hub
    from huggingface_hub.utils import EntryNotFoundError

    repo = tmp_path / "repo"
    gemma_scope_folder(repo, gemma, "resid_post", 1, config=False)

    def fake(repo_id, filename, subfolder=None, **kwargs):
        path = repo / subfolder / filename
        if not path.exists():
            raise EntryNotFoundError(f"{filename} not found")
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    sae = slmviz.load_sae("google/gemma-scope-2-270m-pt", subfolder="resid_post/layer_1_width_32_l0_small",
                          model=gemma)
    assert sae.hook_name == "blocks.1.hook_resid_post"


# --- steering, logit effects, nearest features ----------------------------------------------------------------
def test_strength_zero_changes_nothing_and_a_positive_strength_raises_the_top_logit_effect_tokens(gemma):
    sae = slmviz.load_sae(SAE.random(80, 32, seed=4, hook_name="blocks.2.hook_resid_post"), model=gemma)
    feature = 5
    effects = sae.logit_effects(feature, k=5)
    assert list(effects.columns) == ["kind", "rank", "token_id", "token", "effect"]
    top = effects[effects.kind == "promoted"].token_id.tolist()
    bottom = effects[effects.kind == "suppressed"].token_id.tolist()
    assert effects[effects.kind == "promoted"].effect.is_monotonic_decreasing
    ids = torch.arange(1, 9)
    plain = gemma.trace(ids)
    same = gemma.trace(ids, hooks=slmviz.steer(sae, {feature: 0.0}))
    assert torch.equal(same.logits, plain.logits)
    steered = gemma.trace(ids, hooks=slmviz.steer(sae, {feature: 20.0}))
    change = steered.logits - plain.logits  # [pos, vocab]
    assert (change[:, top].mean(-1) > change.mean(-1)).all()  # every position, prompt tokens included
    assert (change[:, bottom].mean(-1) < change.mean(-1)).all()
    # generation steers every generated token too
    a = gemma.generate_ids(ids, 4, stop_at_eos=False)
    b = gemma.generate_ids(ids, 4, stop_at_eos=False, hooks=slmviz.steer(sae, {feature: 200.0}))
    assert a != b and set(b) & set(top)


def test_steering_adds_exactly_strength_times_the_decoder_row(gemma):
    sae = SAE.random(gemma.cfg.n_heads * gemma.cfg.d_head, 16, hook_name="blocks.1.attn.hook_z",
                     reshape_activations="hook_z")
    hooks = slmviz.steer(sae, {3: 2.0, 7: -1.0})
    name = "blocks.1.attn.hook_z"
    got = {}
    gemma.trace(torch.arange(1, 5), names=[], hooks={**{name: [hooks[name], lambda x, n: got.setdefault(n, x)]}})
    plain = gemma.trace(torch.arange(1, 5), names=[name])[name]
    expected = (2.0 * sae.W_dec[3] - sae.W_dec[7]).detach().view(gemma.cfg.n_heads, gemma.cfg.d_head)
    torch.testing.assert_close(got[name] - plain, expected.expand_as(plain))
    with pytest.raises(SAEError, match="out of range"):
        slmviz.steer(sae, {16: 1.0})
    with pytest.raises(SAEError, match="finite number"):
        slmviz.steer(sae, {1: float("nan")})
    assert sae.residual_direction(3, gemma).shape == (gemma.cfg.d_model,)
    with pytest.raises(SAEError, match="needs the model"):
        sae.logit_effects(3)


def test_nearest_features_rank_by_decoder_cosine():
    sae = SAE.random(8, 6, seed=2)
    with torch.no_grad():
        sae.W_dec[4] = 3 * sae.W_dec[1] + 0.01 * sae.W_dec[2]  # nearly parallel, other length
        sae.W_dec[5] = -sae.W_dec[1]
    near = sae.nearest(1, k=5)
    assert near.feature.iloc[0] == 4 and near.cosine.iloc[0] > 0.99
    assert near.feature.iloc[-1] == 5 and near.cosine.iloc[-1] == pytest.approx(-1.0)
    assert 1 not in near.feature.tolist() and len(near) == 5


def test_a_bundled_name_loads_with_the_model(monkeypatch, tmp_path, gemma):
    from slmviz.features import bundled

    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path)
    sae = SAE.random(80, 16, hook_name="blocks.1.hook_resid_post")
    sae.save(tmp_path / gemma.name / "resid_post_l1")
    assert slmviz.bundled_saes(gemma) == ["resid_post_l1"]
    back = slmviz.load_sae("resid_post_l1", model=gemma)
    assert torch.equal(back.W_enc, sae.W_enc) and back.model is gemma
    with pytest.raises(SAEError, match="neither a folder"):
        slmviz.load_sae("resid_post_l1")  # without the model it is not a bundled name
