"""One decoder block: where the norms sit around the two sub-layers, and the sub-layers themselves."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import ArchConfig
from ..hooks import LAYER_HOOKS, HookContext, layer_hook_name
from ..variants import Variant
from .attention import attention_scale, eager_attention, fused_attention
from .kv_cache import KVCache
from .mlp import ACTIVATIONS, MLP_FORMS
from .norm import normalize, skip_norm
from .params import LayerParams, linear
from .rope import ROTATIONS

Sublayer = Callable[[torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor], torch.Tensor]


def pre_norm_residual(x: torch.Tensor, sublayer: Sublayer, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """x + F(N(x)): normalise *before* the sub-layer. Returns (new residual, F's output).

    Every LLaMA/Qwen2/Mistral/SmolLM2 checkpoint was trained pre-norm. The 2017 order N(x + F(x))
    (`post_norm_residual`) runs with the same weights and silently changes every layer.
    Pinned by tests/test_conventions.py::test_blocks_normalise_before_each_sublayer.
    """
    out = sublayer(norm(x))
    return x + out, out


def post_norm_residual(x: torch.Tensor, sublayer: Sublayer, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """N(x + F(x)): the `post_norm` variant (seed 002). resid_mid/resid_post are the normalised sums."""
    out = sublayer(x)
    return norm(x + out), out


RESIDUAL_FORMS = {"pre": pre_norm_residual, "post": post_norm_residual, "none": pre_norm_residual}
NORMS = {"pre": normalize, "post": normalize, "none": skip_norm}


class LayerHooks:
    """Routes a block's local hook names (`attn.hook_z`) to the run's context as full names."""

    __slots__ = ("ctx", "names")

    def __init__(self, ctx: HookContext, names: dict[str, str]):
        self.ctx, self.names = ctx, names

    def __call__(self, local: str, x: torch.Tensor) -> torch.Tensor:
        return self.ctx(self.names[local], x)

    def wants(self, local: str) -> bool:
        return self.ctx.wants(self.names[local])


class Block:
    def __init__(self, cfg: ArchConfig, params: LayerParams, layer: int):
        self.cfg, self.p, self.layer = cfg, params, layer
        self.hook_names = {local: layer_hook_name(layer, local) for local in LAYER_HOOKS}
        h, g, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.qkv_split = (h * dh, g * dh, g * dh)

    def forward(
        self,
        x: torch.Tensor,
        ctx: HookContext,
        variant: Variant,
        angles: torch.Tensor,
        kv_index: torch.Tensor,
        allowed: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        """x: [pos, d_model] -> [pos, d_model]. `angles` are this layer's RoPE angles [pos, d_head/2]."""
        hook = LayerHooks(ctx, self.hook_names)
        residual = RESIDUAL_FORMS[variant.norm]
        norm = NORMS[variant.norm]
        eps, p = self.cfg.norm_eps, self.p

        def norm1(v: torch.Tensor) -> torch.Tensor:
            return norm(v, p.ln1, eps, variant.norm_type,
                        lambda t: hook("ln1.hook_scale", t), lambda t: hook("ln1.hook_normalized", t))

        def norm2(v: torch.Tensor) -> torch.Tensor:
            return norm(v, p.ln2, eps, variant.norm_type,
                        lambda t: hook("ln2.hook_scale", t), lambda t: hook("ln2.hook_normalized", t))

        def attn(v: torch.Tensor) -> torch.Tensor:
            return hook("hook_attn_out", self.attention(v, hook, variant, angles, kv_index, allowed, cache))

        def mlp(v: torch.Tensor) -> torch.Tensor:
            return hook("hook_mlp_out", self.mlp(v, hook, variant))

        x = hook("hook_resid_pre", x)
        x, _ = residual(x, attn, norm1)
        x = hook("hook_resid_mid", x)
        x, _ = residual(x, mlp, norm2)
        return hook("hook_resid_post", x)

    def attention(
        self,
        x: torch.Tensor,
        hook: LayerHooks,
        variant: Variant,
        angles: torch.Tensor,
        kv_index: torch.Tensor,
        allowed: torch.Tensor | None,
        cache: KVCache | None,
    ) -> torch.Tensor:
        cfg, p = self.cfg, self.p
        n_pos = x.shape[0]
        h, g, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        qkv = linear(x, p.w_qkv, p.b_qkv)  # [pos, (h + 2g) * dh]
        q, k, v = qkv.split(self.qkv_split, dim=-1)
        q = hook("attn.hook_q", q.view(n_pos, h, dh))  # [pos, h, dh]
        k = hook("attn.hook_k", k.view(n_pos, g, dh))  # [pos, g, dh]
        v = hook("attn.hook_v", v.view(n_pos, g, dh))  # [pos, g, dh]
        rotate = ROTATIONS[variant.rope]
        q = hook("attn.hook_rot_q", rotate(q, angles))
        k = hook("attn.hook_rot_k", rotate(k, angles))

        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [g, pos, dh]
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # [g, pos_k, dh]
        k, v = k[kv_index], v[kv_index]  # [g, pos_k, dh] -> [h, pos_k, dh]
        q = q.transpose(0, 1)  # [h, pos, dh]
        scale = attention_scale(dh)

        if hook.wants("attn.hook_attn_scores") or hook.wants("attn.hook_pattern"):
            scores, pattern = eager_attention(q, k, allowed, scale)
            hook("attn.hook_attn_scores", scores)
            pattern = hook("attn.hook_pattern", pattern)
            z = torch.matmul(pattern, v)  # [h, pos, dh]
        else:
            z = fused_attention(q, k, v, allowed, scale)  # [h, pos, dh]
        z = hook("attn.hook_z", z.transpose(0, 1))  # [pos, h, dh]

        if hook.wants("attn.hook_result"):
            w_o = p.w_o.view(h, dh, cfg.d_model)
            result = torch.einsum("phd,hdm->phm", z, w_o)  # [pos, h, d_model]
            hooked = hook("attn.hook_result", result)
            if hooked is not result:
                # Someone edited per-head writes: the output must be built from them.
                out = hooked.sum(1)
                return out + p.b_o if p.b_o is not None else out
        return linear(z.reshape(n_pos, h * dh), p.w_o, p.b_o)  # [pos, d_model]

    def mlp(self, x: torch.Tensor, hook: LayerHooks, variant: Variant) -> torch.Tensor:
        p, d_mlp = self.p, self.cfg.d_mlp
        w_gate, w_up = p.w_gate_up[:, :d_mlp], p.w_gate_up[:, d_mlp:]
        b_gate, b_up = (None, None) if p.b_gate_up is None else (p.b_gate_up[:d_mlp], p.b_gate_up[d_mlp:])

        def gate(v: torch.Tensor) -> torch.Tensor:
            return linear(v, w_gate, b_gate)

        def up(v: torch.Tensor) -> torch.Tensor:
            return linear(v, w_up, b_up)

        post = MLP_FORMS[variant.mlp](x, gate, up, ACTIVATIONS[self.cfg.act], hook)  # [pos, d_mlp]
        return linear(post, p.w_down, p.b_down)  # [pos, d_model]
