"""The SAE object: each architecture's formula against a hand computation, the SAELens folder round trip, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from slmviz.errors import SAEError
from slmviz.features.sae import SAE

X = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]])  # [pos=2, d_in=3]
W_ENC = torch.tensor([[1.0, 0.0, -1.0, 2.0], [0.0, 1.0, 1.0, 0.0], [1.0, -1.0, 0.0, 1.0]])  # [3, 4]
B_ENC = torch.tensor([0.5, 0.0, -0.5, 0.0])
W_DEC = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]])  # [4, 3]
B_DEC = torch.tensor([0.1, 0.2, 0.3])


def state(**extra):
    return {"W_enc": W_ENC, "b_enc": B_ENC, "W_dec": W_DEC, "b_dec": B_DEC, **extra}


def hand_pre(x, apply_b_dec=False):
    """h by hand, one entry at a time."""
    xs = [[x[p][i] - (B_DEC[i] if apply_b_dec else 0.0) for i in range(3)] for p in range(2)]
    return torch.tensor([[sum(float(xs[p][i]) * float(W_ENC[i][j]) for i in range(3)) + float(B_ENC[j])
                          for j in range(4)] for p in range(2)])


def hand_dec(f):
    return torch.tensor([[sum(float(f[p][j]) * float(W_DEC[j][i]) for j in range(4)) + float(B_DEC[i])
                          for i in range(3)] for p in range(2)])


def test_relu_encode_and_decode_equal_the_hand_computation():
    sae = SAE.from_state(state(), architecture="standard", apply_b_dec_to_input=True)
    h = hand_pre(X, apply_b_dec=True)
    assert torch.allclose(sae.encode_pre(X), h)
    f = h.clamp(min=0)
    assert torch.allclose(sae.encode(X), f)
    assert torch.allclose(sae.decode(f), hand_dec(f))
    assert torch.allclose(sae(X), hand_dec(f))
    assert sae.architecture == "relu" and not sae.is_transcoder


def test_topk_keeps_the_k_largest_pre_activations_then_relu():
    sae = SAE.from_state(state(), architecture="topk", k=2)
    h = hand_pre(X)
    assert torch.allclose(h, torch.tensor([[2.0, -2.5, -3.5, 2.5], [-0.5, 4.0, 2.5, -1.0]]))  # worked by hand
    f = torch.tensor([[2.0, 0.0, 0.0, 2.5], [0.0, 4.0, 2.5, 0.0]])
    assert torch.allclose(sae.encode(X), f)
    sae3 = SAE.from_state(state(), architecture="topk", k=3)
    # the third largest of row 0 is -2.5: kept by topk, then zeroed by relu
    assert torch.allclose(sae3.encode(X)[0], torch.tensor([2.0, 0.0, 0.0, 2.5]))
    assert torch.allclose(sae.decode(f), hand_dec(f))


def test_jumprelu_is_relu_times_a_strict_threshold_step():
    theta = torch.tensor([2.0, 0.0, 3.0, 1.0])
    sae = SAE.from_state(state(threshold=theta), architecture="jumprelu")
    h = hand_pre(X)
    f = torch.tensor([[0.0, 0.0, 0.0, 2.5], [0.0, 4.0, 0.0, 0.0]])  # 2.0 > 2.0 is false: strict
    assert torch.allclose(h.clamp(min=0) * (h > theta), f)
    assert torch.allclose(sae.encode(X), f)
    assert torch.allclose(sae.decode(f), hand_dec(f))


def test_skip_transcoder_adds_x_times_w_skip_transposed():
    w_skip = torch.arange(6.0).reshape(2, 3) / 10  # [d_out=2, d_in=3]
    st = {"W_enc": W_ENC, "b_enc": B_ENC, "W_dec": W_DEC[:, :2], "b_dec": B_DEC[:2], "W_skip": w_skip}
    tc = SAE.from_state(st, architecture="skip_transcoder", hook_name="blocks.0.mlp.hook_in",
                        hook_name_out="blocks.0.hook_mlp_out")
    assert tc.is_transcoder and tc.d_out == 2 and tc.architecture == "relu"
    f = hand_pre(X).clamp(min=0)
    expect = f @ W_DEC[:, :2] + B_DEC[:2] + torch.stack([(X[p] * w_skip).sum(-1) for p in range(2)])
    assert torch.allclose(tc(X), expect, atol=1e-6)
    assert torch.allclose(tc.decode(f), f @ W_DEC[:, :2] + B_DEC[:2])  # no x: no skip term


def test_any_leading_dims_and_dtype_round_trip():
    sae = SAE.random(8, 16, architecture="topk", k=4, seed=1)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    f = sae.encode(x)
    assert f.shape == (2, 3, 16) and f.dtype == torch.float64
    assert ((f != 0).sum(-1) <= 4).all()
    assert sae(x).shape == (2, 3, 8) and sae(x).dtype == torch.float64


@pytest.mark.parametrize("arch,extra", [
    ("standard", {}), ("topk", {"k": 3}), ("jumprelu", {}),
    ("transcoder", {"d_out": 6}), ("skip_transcoder", {"d_out": 6}), ("jumprelu_transcoder", {"d_out": 6}),
])
def test_saelens_folder_round_trips(tmp_path, arch, extra):
    d_out = extra.pop("d_out", None)
    hook_out = "blocks.1.hook_mlp_out" if d_out else None
    sae = SAE.random(5, 12, d_out=d_out, architecture=arch, seed=3, hook_name="blocks.1.mlp.hook_in" if d_out else
                     "blocks.1.hook_resid_post", hook_name_out=hook_out, metadata={"model_name": "tiny"}, **extra)
    sae.save(tmp_path / "s")
    cfg = json.loads((tmp_path / "s" / "cfg.json").read_text())
    assert cfg["architecture"] == arch
    assert cfg["metadata"]["hook_name"] == sae.hook_name and cfg["metadata"]["model_name"] == "tiny"
    back = SAE.load(tmp_path / "s")
    assert back.architecture == sae.architecture and back.k == sae.k and back.hook_name_out == sae.hook_name_out
    assert back.is_transcoder == sae.is_transcoder
    for name, t in sae.tensors().items():
        assert torch.equal(back.tensors()[name], t), name
    x = torch.randn(7, 5)
    assert torch.equal(back.encode(x), sae.encode(x)) and torch.equal(back(x), sae(x))


def test_from_state_copies_its_tensors_unless_told_to_adopt_them():
    """Trainers hand from_state their live tensors and keep training: the SAE must not move with them. A loader's
    freshly read tensors (copy=False) become the parameters as they are, converted only where the dtype differs.
    Not covered: the loaders passing copy=False (their tests check the loaded values)."""
    live = {k: v.clone() for k, v in state().items()}
    sae = SAE.from_state(live, architecture="standard")
    live["W_enc"].add_(1.0)
    assert torch.equal(sae.W_enc, W_ENC)
    adopted = SAE.from_state(live, architecture="standard", copy=False)
    assert adopted.W_enc.data_ptr() == live["W_enc"].data_ptr() and adopted.W_enc.requires_grad
    assert SAE.from_state(live, copy=False, dtype=torch.float64).W_enc.data_ptr() != live["W_enc"].data_ptr()
    assert SAE.from_state(sae.tensors(), **sae.spec()).spec() == sae.spec()


def test_k_larger_than_d_sae_is_an_error():
    with pytest.raises(SAEError, match="k=9 is larger than d_sae=4"):
        SAE.from_state(state(), architecture="topk", k=9)
    with pytest.raises(SAEError, match="needs k"):
        SAE.from_state(state(), architecture="topk")


def test_mis_shaped_missing_and_non_finite_tensors_are_named():
    with pytest.raises(SAEError, match=r"'b_enc' has shape \(3,\), expected \(4,\)"):
        SAE.from_state(state(b_enc=torch.zeros(3)))
    with pytest.raises(SAEError, match=r"missing tensors \['threshold'\]"):
        SAE.from_state(state(), architecture="jumprelu")
    with pytest.raises(SAEError, match="'W_dec' holds 1 non-finite"):
        w = W_DEC.clone()
        w[0, 0] = float("nan")
        SAE.from_state(state(W_dec=w))
    with pytest.raises(SAEError, match="W_enc must be"):
        SAE.from_state(state(W_enc=torch.zeros(3)))


def test_unknown_architecture_lists_the_supported_ones():
    with pytest.raises(SAEError, match="unknown SAE architecture 'gated'.*standard.*topk.*jumprelu.*transcoder"):
        SAE.from_state(state(), architecture="gated")


@pytest.mark.parametrize("suffix", [".pt", ".pkl", ".bin"])
def test_pickle_files_are_refused(tmp_path, suffix):
    from slmviz.formats.files import read_safetensors

    path = tmp_path / f"weights{suffix}"
    torch.save(state(), path)
    with pytest.raises(SAEError, match="pickle"):
        read_safetensors(path)
    with pytest.raises(SAEError, match="pickle"):
        SAE.load(tmp_path)  # a folder holding only a pickle names it


def test_a_corrupt_or_missing_file_is_a_clear_error(tmp_path):
    (tmp_path / "cfg.json").write_text(json.dumps({"architecture": "standard", "d_in": 3, "d_sae": 4}))
    with pytest.raises(SAEError, match="no such weights file"):
        SAE.load(tmp_path)
    (tmp_path / "sae_weights.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(SAEError, match="not a readable safetensors"):
        SAE.load(tmp_path)
    save_file(state(), str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps({"architecture": "standard", "normalize_activations": "layer_norm"}))
    with pytest.raises(SAEError, match="normalize_activations"):
        SAE.load(tmp_path)
