"""The feed-forward sub-layer: SwiGLU (faithful) or seed 002's plain FFN on the same weights (variant)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu}

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


MLP_FORMS = {"swiglu": swiglu, "standard": standard_ffn}
