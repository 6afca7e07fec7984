"""Cross-layer transcoder files (slmviz.formats.circuit_tracer, slmviz.formats.gemma_scope, read by
slmviz.replacement.load.load_clt): circuit-tracer's W_enc_{L} / W_dec_{L} layout and Gemma
Scope 2's clt/ folders, on synthetic folders for tiny models.

Checked against: the formula written out by hand from the saved files' own tensors (read with safetensors, not
through slmviz), and the features and graphs of the CLT before saving. Not covered here: circuit-tracer's own
loader reading these files (bench/peers/clt_circuit_tracer.py runs its load_clt on them), real Gemma Scope 2 downloads.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import slmviz
from slmviz.errors import CLTError
from slmviz.graphs.attribution import attribution_graph
from slmviz.replacement.clt import CrossLayerTranscoder
from slmviz.replacement.load import load_clt, load_transcoders
from slmviz.replacement.prepared import holds_clt

PROMPT = "w3 w5 w7 w9 w11 w4"


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in ("llama_gqa", "gemma3", "olmo2")}


def random_clt(m, seed=0, **kw):
    return CrossLayerTranscoder.random(m.cfg.n_layers, m.cfg.d_model, 40, seed=seed, **kw)


def same_features_and_graph(m, a, b):
    """Both CLTs give the same hook_sae_acts_post and recons at every layer, and identical attribution graphs."""
    ta, tb = m.trace(PROMPT, saes=a), m.trace(PROMPT, saes=b)
    for L in range(m.cfg.n_layers):
        for sub in ("hook_sae_acts_post", "hook_sae_recons"):
            name = f"blocks.{L}.hook_mlp_out.{sub}"
            assert torch.equal(ta[name], tb[name]), name
    ga = attribution_graph(PROMPT, transcoders=a, model=m, progress=False)
    gb = attribution_graph(PROMPT, transcoders=b, model=m, progress=False)
    assert ga.nodes.equals(gb.nodes)
    assert torch.equal(ga.adjacency, gb.adjacency)
    # the constant's replacement run sums in an order that varies between runs of one CLT too (~1e-8 here)
    assert torch.allclose(ga.constant, gb.constant, atol=1e-6, rtol=0)
    assert ga.n_features > 0


@pytest.mark.parametrize("arch,architecture,input_hook", [("llama_gqa", "jumprelu", "hook_resid_mid"),
                                                          ("gemma3", "relu", "mlp.hook_in"),
                                                          ("olmo2", "topk", "mlp.hook_in")])
def test_circuit_tracer_layout_round_trips_to_identical_features_and_graphs(models, tmp_path, arch, architecture,
                                                                            input_hook):
    m = models[arch]
    clt = random_clt(m, seed=1, architecture=architecture, input_hook=input_hook,
                     k=4 if architecture == "topk" else None)
    folder = clt.save(tmp_path / "ct", format="circuit-tracer")
    n = m.cfg.n_layers
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.yaml", *[f"W_enc_{L}.safetensors" for L in range(n)], *[f"W_dec_{L}.safetensors" for L in range(n)]])
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    assert cfg["feature_input_hook"] == input_hook and cfg["feature_output_hook"] == "hook_mlp_out"
    assert cfg["model_kind"] == ("slmviz_topk_cross_layer_transcoder" if architecture == "topk"
                                 else "cross_layer_transcoder")
    back = load_clt(folder, model=m)
    assert holds_clt(folder)
    assert (back.architecture, back.k, back.input_hook, back.n_layers) == (clt.architecture, clt.k, input_hook, n)
    for k, v in clt.tensors().items():
        assert torch.equal(back.tensors()[k], v), k
    same_features_and_graph(m, clt, back)


def test_gemma_scope_2_layout_round_trips_and_keeps_the_last_layer(models, tmp_path):
    """An affine JumpReLU CLT saved as params_layer_{L}.safetensors + config.json loads back with all n layers
    (circuit-tracer 0.5.0's range(max(paths.keys())) would read n - 1 of them), the same tensors, features and
    graph; w_dec is stored [d_sae, n_layers, d_model] with zeros before the layer."""
    m = models["gemma3"]
    n = m.cfg.n_layers
    clt = random_clt(m, seed=2, skip=True)
    folder = clt.save(tmp_path / "clt" / "width_40_l0_medium_affine", format="gemma-scope-2")
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["config.json", *[f"params_layer_{L}.safetensors" for L in range(n)]])
    paths = {L: folder / f"params_layer_{L}.safetensors" for L in range(n)}
    assert list(range(max(paths.keys()))) == list(range(n - 1))  # circuit-tracer's loop: the last file left out
    raw = load_file(str(paths[n - 1]))
    assert raw["w_dec"].shape == (40, n, m.cfg.d_model) and (raw["w_dec"][:, : n - 1] == 0).all()
    back = load_clt(folder, model=m)
    assert back.n_layers == n and back.W_skip is not None
    for k, v in clt.tensors().items():
        assert torch.equal(back.tensors()[k], v), k
    same_features_and_graph(m, clt, back)


def test_gemma_scope_2_folder_without_config_json_reads_mlp_hook_in(models, tmp_path):
    m = models["llama_gqa"]
    folder = random_clt(m, seed=3).save(tmp_path / "width_40_l0_big", format="gemma-scope-2")
    (folder / "config.json").unlink()
    back = load_clt(folder, model=m)
    assert back.input_hook == "mlp.hook_in" and back.W_skip is None


@pytest.mark.parametrize("arch", ["llama_gqa", "gemma3"])
def test_the_reconstruction_is_the_formula_written_out_from_the_saved_files(models, tmp_path, arch):
    """From circuit-tracer's files, read with safetensors alone: f_L = relu(x_L W_enc_Lᵀ + b_enc_L) ·
    1[· > threshold_L], y_j = Σ_{L ≤ j} f_L W_dec_L[:, j - L] + b_dec_j; the loaded CLT's spliced recons equal it, and
    splicing with error terms leaves the logits as they are."""
    m = models[arch]
    n = m.cfg.n_layers
    folder = random_clt(m, seed=4, input_hook="hook_resid_mid").save(tmp_path / "ct")
    enc = [load_file(str(folder / f"W_enc_{L}.safetensors")) for L in range(n)]
    dec = [load_file(str(folder / f"W_dec_{L}.safetensors"))[f"W_dec_{L}"] for L in range(n)]
    plain = m.trace(PROMPT)
    feats = []
    for L in range(n):
        h = plain[f"blocks.{L}.hook_resid_mid"].double() @ enc[L][f"W_enc_{L}"].double().T + enc[L][f"b_enc_{L}"]
        feats.append(h.relu() * (h > enc[L][f"threshold_{L}"].double()))
    t = m.trace(PROMPT, saes=load_clt(folder, model=m))
    assert torch.equal(t.logits, plain.logits)
    for j in range(n):
        y = enc[j][f"b_dec_{j}"].double() + sum(feats[L] @ dec[L][:, j - L].double() for L in range(j + 1))
        assert torch.allclose(t[f"blocks.{j}.hook_mlp_out.hook_sae_recons"].double(), y, atol=1e-4)
    assert all((f > 0).any() for f in feats)


@pytest.fixture()
def ct_folder(models, tmp_path):
    return random_clt(models["llama_gqa"], seed=5).save(tmp_path / "ct")


def test_a_decoder_of_the_wrong_shape_is_named_with_its_file(models, ct_folder):
    path = ct_folder / "W_dec_1.safetensors"
    w = load_file(str(path))["W_dec_1"]
    save_file({"W_dec_1": torch.cat([w, w], dim=1).contiguous()}, str(path))  # [d_sae, 2, d] for the last layer
    shapes = r"W_dec_1 has shape \(40, 2, 64\), expected \[40, 1, 64\]"
    with pytest.raises(CLTError, match=r"W_dec_1\.safetensors: " + shapes):
        load_clt(ct_folder, model=models["llama_gqa"])


@pytest.mark.parametrize("name", ["W_enc_1.safetensors", "W_dec_0.safetensors"])
def test_a_missing_per_layer_file_is_named(ct_folder, name):
    (ct_folder / name).unlink()
    with pytest.raises(CLTError, match=f"missing.*{name}"):
        load_clt(ct_folder)


def test_a_missing_tensor_in_a_file_is_named(ct_folder):
    path = ct_folder / "W_enc_1.safetensors"
    raw = load_file(str(path))
    del raw["W_enc_1"]
    save_file(raw, str(path))
    with pytest.raises(CLTError, match=r"W_enc_1\.safetensors: no tensor 'W_enc_1'"):
        load_clt(ct_folder)


def test_a_clt_for_another_layer_count_is_refused_naming_the_folder(models, tmp_path):
    m = models["gemma3"]  # 3 layers
    folder = random_clt(models["llama_gqa"], seed=6).save(tmp_path / "two", format="gemma-scope-2")
    with pytest.raises(CLTError, match=r"two: a CLT of 2 layers; .* has 3"):
        load_clt(folder, model=m)


def test_an_input_hook_slmviz_cannot_read_is_refused_naming_config_yaml(ct_folder):
    cfg = yaml.safe_load((ct_folder / "config.yaml").read_text())
    cfg["feature_input_hook"] = "ln2.hook_normalized"
    (ct_folder / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CLTError, match=r"config\.yaml: feature_input_hook 'ln2.hook_normalized'"):
        load_clt(ct_folder)


def test_a_gemma_scope_2_hook_point_other_than_the_pre_mlp_norm_is_refused(models, tmp_path):
    folder = random_clt(models["llama_gqa"], seed=7).save(tmp_path / "gs", format="gemma-scope-2")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hf_hook_point_in"] = "model.layers.{L}.output"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CLTError, match=r"config\.json: hf_hook_point_in"):
        load_clt(folder)


def test_formats_that_cannot_hold_a_clt_say_why(models, tmp_path):
    m = models["llama_gqa"]
    with pytest.raises(CLTError, match="reads no skip path"):
        random_clt(m, skip=True).save(tmp_path / "a", format="circuit-tracer")
    with pytest.raises(CLTError, match="JumpReLU"):
        random_clt(m, architecture="relu").save(tmp_path / "b", format="gemma-scope-2")
    with pytest.raises(CLTError, match="mlp.hook_in"):
        random_clt(m, input_hook="hook_resid_mid").save(tmp_path / "c", format="gemma-scope-2")
    negative = random_clt(m)
    with torch.no_grad():
        negative.threshold[1, 3] = -0.5
    with pytest.raises(CLTError, match="negative JumpReLU thresholds"):
        negative.save(tmp_path / "d")
    with pytest.raises(CLTError, match="no CLT here"):
        load_clt(tmp_path)


@pytest.mark.parametrize("fmt", ["circuit-tracer", "gemma-scope-2"])
def test_load_transcoders_takes_a_clt_folder_in_either_layout(models, tmp_path, fmt):
    m = models["llama_gqa"]
    clt = random_clt(m, seed=8)
    back = load_transcoders(clt.save(tmp_path / fmt, format=fmt), model=m)
    assert isinstance(back, CrossLayerTranscoder) and back.kind == "clt"
    for k, v in clt.tensors().items():
        assert torch.equal(back.tensors()[k], v), k
