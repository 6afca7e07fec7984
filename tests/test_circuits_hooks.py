"""The opt-in input hooks (docs/circuits.md): blocks.L.hook_q_input / hook_k_input / hook_v_input / hook_mlp_in.

They are computed only when named, show the residual each reader sees before its norm, and an edit of one reader's
copy reaches that reader only. Not covered here: the circuits built on them (tests/test_circuits_edges.py).
"""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.hooks import INPUT_HOOKS, HookNameError, hook_shape, input_hook_names
from slmviz.model.block import READS_BEFORE, RESIDUAL_FORMS

FAMILIES = ["llama_gqa", "llama_bias", "qwen2", "mistral_window", "gemma3", "qwen3", "olmo2"]
IDS = [3, 17, 5, 99, 42, 8, 11, 60]
LAYER = 1


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {arch: slmviz.load(tiny_dirs[arch]) for arch in FAMILIES}


def _names(layer: int = LAYER) -> list[str]:
    return [f"blocks.{layer}.{local}" for local in INPUT_HOOKS]


def test_a_default_trace_never_computes_them(models):
    m = models["llama_gqa"]
    t = m.trace(IDS)
    assert not set(t.names) & set(input_hook_names(m.cfg.n_layers))
    assert not set(m.hook_names) & set(input_hook_names(m.cfg.n_layers))
    t = m.trace(IDS, names=lambda n: n.startswith(f"blocks.{LAYER}."))  # a predicate does not pick them either
    assert not set(t.names) & set(_names())


@pytest.mark.parametrize("arch", FAMILIES)
def test_named_they_show_the_residual_each_reader_reads(models, arch):
    m = models[arch]
    base = m.trace(IDS, names=[f"blocks.{LAYER}.hook_resid_pre", f"blocks.{LAYER}.hook_resid_mid"])
    t = m.trace(IDS, names=[*_names(), f"blocks.{LAYER}.hook_resid_pre"])
    assert torch.equal(t.logits, base.logits), "naming them must not change the run"
    for name in _names():
        assert tuple(t[name].shape) == hook_shape(name, m.cfg, len(IDS)), name
    pre, mid = base[f"blocks.{LAYER}.hook_resid_pre"], base[f"blocks.{LAYER}.hook_resid_mid"]
    for local in ("hook_q_input", "hook_k_input", "hook_v_input"):
        x = t[f"blocks.{LAYER}.{local}"]
        assert torch.equal(x, pre[:, None].expand_as(x))
    assert torch.equal(t[f"blocks.{LAYER}.hook_mlp_in"], mid)


def test_unknown_input_hook_names_are_refused(models):
    m = models["llama_gqa"]
    with pytest.raises(HookNameError, match="hook_q_input"):
        m.trace(IDS, names=[f"blocks.{m.cfg.n_layers}.hook_q_input"])  # no such layer
    with pytest.raises(HookNameError, match="did you mean"):
        m.trace(IDS, names=["blocks.0.hook_q_inputs"])


def _kick(index: int, size: float = 2.0):
    """A hook fn adding a fixed random vector to reader `index` (a head, a KV group) at every position."""

    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        x = x.clone()
        g = torch.Generator().manual_seed(7)
        bump = size * torch.randn(x.shape[-1], generator=g) * x.abs().mean()
        if x.dim() == 3:
            x[:, index] += bump
        else:
            x += bump
        return x

    return fn


def _moved(m, hooks: dict, name: str, reduce: tuple[int, ...] = (0, 2)) -> torch.Tensor:
    """How far each head's (or group's) value of hook `name` moves under `hooks`, relative to its largest entry."""
    base = m.trace(IDS, names=[name])[name]
    edited = m.trace(IDS, hooks=hooks, names=[name])[name]
    return (edited - base).abs().amax(reduce) / base.abs().max()


@pytest.mark.parametrize("arch", FAMILIES)
def test_editing_one_heads_input_changes_that_head_only(models, arch):
    """Each head's z moves only when its own query input, or its KV group's key or value input, is edited.

    OLMo-2 normalises the whole query projection (and the whole key projection) at once, so there an edit of one
    head's query input moves that head's hook_q only, and the shared QK-norm scale then moves every head's
    normalised query, as the model computes it; its value inputs stay separate."""
    m = models[arch]
    cfg = m.cfg
    z, q, k = (f"blocks.{LAYER}.attn.{n}" for n in ("hook_z", "hook_q", "hook_k"))
    group = cfg.n_kv_heads - 1
    readers = [h for h in range(cfg.n_heads) if h // (cfg.n_heads // cfg.n_kv_heads) == group]
    others = [h for h in range(cfg.n_heads) if h not in readers]
    coupled = cfg.qk_norm == "projection"
    moved = _moved(m, {f"blocks.{LAYER}.hook_q_input": _kick(1)}, q if coupled else z)  # [h]
    assert moved[1] > 1e-4
    assert torch.all(moved[[h for h in range(cfg.n_heads) if h != 1]] < 3e-6), moved
    moved = _moved(m, {f"blocks.{LAYER}.hook_k_input": _kick(group)}, k if coupled else z)
    if coupled:  # [g]: the group's key only, before the projection-wide norm
        assert moved[group] > 1e-4 and torch.all(moved[:group] < 3e-6), moved
    else:
        assert torch.all(moved[readers] > 1e-4) and torch.all(moved[others] < 3e-6), moved
    moved = _moved(m, {f"blocks.{LAYER}.hook_v_input": _kick(group)}, z)
    assert torch.all(moved[readers] > 1e-4) and torch.all(moved[others] < 3e-6), moved


@pytest.mark.parametrize("arch", FAMILIES)
def test_editing_the_mlp_input_changes_the_mlp_only(models, arch):
    m = models[arch]
    names = [f"blocks.{LAYER}.hook_resid_mid", f"blocks.{LAYER}.hook_mlp_out", f"blocks.{LAYER}.hook_attn_out"]
    base = m.trace(IDS, names=names)
    edited = m.trace(IDS, hooks={f"blocks.{LAYER}.hook_mlp_in": _kick(0)}, names=names)
    assert torch.equal(edited[names[0]], base[names[0]]), "the residual stream itself is not edited"
    assert torch.equal(edited[names[2]], base[names[2]])
    assert not torch.allclose(edited[names[1]], base[names[1]])


@pytest.mark.parametrize(("arch", "variant"), [(a, None) for a in FAMILIES] + [
    ("llama_gqa", "post_norm"), ("llama_gqa", "no_norm"), ("llama_gqa", "layer_norm"), ("gemma3", "pre_norm_only"),
])
def test_the_input_hooks_sit_before_each_familys_norm(models, arch, variant):
    """Adding d to every reader's copy (q, k and v inputs) gives the attention output that adding d to the residual
    at resid_pre gives, under every norm placement (pre, output, sandwich, and the post / no-norm variants): the hooks
    are the residual *before* the norm. Likewise hook_mlp_in against resid_mid. A norm applied twice, or skipped,
    to an edited input would break the equality."""
    m = models[arch]
    attn_out, mlp_out = f"blocks.{LAYER}.hook_attn_out", f"blocks.{LAYER}.hook_mlp_out"
    via_resid = m.trace(IDS, variant=variant, hooks={f"blocks.{LAYER}.hook_resid_pre": _kick(0)}, names=[attn_out])
    via_inputs = m.trace(IDS, variant=variant, names=[attn_out], hooks={
        f"blocks.{LAYER}.{local}": _kick_all() for local in ("hook_q_input", "hook_k_input", "hook_v_input")})
    tol = 1e-5 * _size(via_resid[attn_out])
    torch.testing.assert_close(via_inputs[attn_out], via_resid[attn_out], rtol=1e-5, atol=tol)
    via_resid = m.trace(IDS, variant=variant, hooks={f"blocks.{LAYER}.hook_resid_mid": _kick(0)}, names=[mlp_out])
    via_input = m.trace(IDS, variant=variant, hooks={f"blocks.{LAYER}.hook_mlp_in": _kick(0)}, names=[mlp_out])
    torch.testing.assert_close(via_input[mlp_out], via_resid[mlp_out], rtol=1e-5, atol=1e-5 * _size(via_resid[mlp_out]))


def _kick_all():
    """The same bump as _kick(0) on a [pos, d] residual, added to every reader of a [pos, k, d] input hook."""
    one = _kick(0)

    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        return one(x[:, 0], name)[:, None].expand_as(x).clone()

    return fn


def _size(x: torch.Tensor) -> float:
    return float(x.abs().max())


def test_every_residual_form_is_placed():
    """READS_BEFORE names the forms whose sub-layer reads N(x); the others read x (block.Block.forward relies on it)."""
    x = torch.randn(2, 3)
    marker = []

    def before(v):
        marker.append("before")
        return v

    for name, form in RESIDUAL_FORMS.items():
        marker.clear()
        form(x, lambda v: v, before, lambda v: v, lambda v: v)
        assert (name in READS_BEFORE) == bool(marker), name
