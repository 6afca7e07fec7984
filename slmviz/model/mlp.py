"""The feed-forward sub-layer: gated (SwiGLU, GeGLU; faithful) or seed 002's plain FFN on the same weights."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (transformers' "gelu_pytorch_tanh"), which Gemma was trained with.

    The exact erf GELU (`F.gelu`, the `gelu_exact` variant) differs from it by up to ~1e-3 per unit and
    still runs. Pinned by tests/test_conventions.py::test_gemma_uses_the_tanh_gelu.
    """
    return F.gelu(x, approximate="tanh")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's "gelu_new": 0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))), written out as transformers'
    NewGELUActivation (and the original GPT-2 code) computes it.

    The same function as gelu_tanh, but evaluated in another order: the two differ by an ulp or so, which
    is why the formula is spelled out, not swapped for F.gelu(approximate="tanh"). The exact erf GELU
    (the `gelu_exact` variant) differs from it by up to ~1e-3 and still runs.
    Pinned by tests/test_families_gpt2_neox_gemma2.py::test_gpt2_uses_gelu_new_written_out.
    """
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# config.json's activation name -> function (SwiGLU with silu; Gemma's GeGLU with gelu_pytorch_tanh; GPT-2's
# gelu_new; GPT-NeoX's exact gelu).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_pytorch_tanh": gelu_tanh, "gelu": F.gelu, "gelu_new": gelu_new,
}

Linear = Callable[[torch.Tensor], torch.Tensor]


def swiglu(x: torch.Tensor, gate: Linear, up: Linear, act: Callable, hook) -> torch.Tensor:
    """post = act(gate(x)) · up(x): the gate decides, per hidden unit, how much of up(x) passes.

    Every LLaMA/Qwen2/Mistral MLP is gated this way. Swapping the gate and up projections, or
    applying the activation to up instead of gate, runs and produces garbage; dropping the gate is the
    `standard_ffn` variant. Hooks: hook_pre = gate(x), hook_gate = act(gate(x)),
    hook_pre_linear = up(x), hook_post = their product.
    Pinned by tests/test_conventions.py::test_swiglu_activates_the_gate_not_up.
    """
    pre = hook("mlp.hook_pre", gate(x))
    g = hook("mlp.hook_gate", act(pre))
    lin = hook("mlp.hook_pre_linear", up(x))
    return hook("mlp.hook_post", g * lin)


def standard_ffn(x: torch.Tensor, gate: Linear, up: Linear, act: Callable, hook) -> torch.Tensor:
    """Seed 002's StandardFFN on the trained weights: post = act(up(x)); the gate projection is never read.

    The hook contract still holds: hook_pre = up(x) (the pre-activation, TransformerLens's meaning for an
    ungated MLP), hook_gate = act(hook_pre), hook_pre_linear = ones (there is no linear path), and
    hook_post = hook_gate · hook_pre_linear.
    """
    pre = hook("mlp.hook_pre", up(x))
    g = hook("mlp.hook_gate", act(pre))
    lin = hook("mlp.hook_pre_linear", torch.ones_like(pre))
    return hook("mlp.hook_post", g * lin)


def plain_mlp(x: torch.Tensor, gate: Linear, up: Linear, act: Callable, hook) -> torch.Tensor:
    """post = act(up(x)): the ungated MLP GPT-2 (c_fc) and GPT-NeoX (dense_h_to_4h) were trained with.

    Its hooks are TransformerLens's for such a model: hook_pre = up(x), hook_post = act(hook_pre) (no
    hook_gate / hook_pre_linear: there is no gate). `gate` is never called (these families have no gate rows).
    """
    pre = hook("mlp.hook_pre", up(x))
    return hook("mlp.hook_post", act(pre))


MLP_FORMS = {"swiglu": swiglu, "standard": standard_ffn, "plain": plain_mlp}
