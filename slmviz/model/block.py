"""One decoder block: where the norms sit around the two sub-layers, and the sub-layers themselves."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import ArchConfig
from ..hooks import LAYER_HOOKS, HookContext, layer_hook_name
from ..variants import Variant
from .attention import attention_scale, eager_attention, fused_attention, softmax_pattern
from .kv_cache import KVCache
from .mlp import ACTIVATIONS, MLP_FORMS
from .norm import normalize, skip_norm, unhooked
from .params import LayerParams, linear
from .rope import ROTATIONS

Sublayer = Callable[[torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor], torch.Tensor]


def pre_norm_residual(x: torch.Tensor, sublayer: Sublayer, norm: Norm) -> torch.Tensor:
    """x + F(N(x)): normalise *before* the sub-layer; returns the new residual.

    Every LLaMA/Qwen2/Mistral/SmolLM2 checkpoint was trained pre-norm. The 2017 order N(x + F(x))
    (`post_norm_residual`) runs with the same weights and silently changes every layer.
    Pinned by tests/test_conventions.py::test_blocks_normalise_before_each_sublayer.
    """
    return x + sublayer(norm(x))


def post_norm_residual(x: torch.Tensor, sublayer: Sublayer, norm: Norm) -> torch.Tensor:
    """N(x + F(x)): the `post_norm` variant (seed 002). resid_mid/resid_post are the normalised sums."""
    return norm(x + sublayer(x))


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

    def callback(self, local: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """fn(x) -> x for one hook point, or `unhooked` when nobody reads it (so the kernel can skip the value)."""
        name = self.names[local]
        if not self.ctx.wants(name):
            return unhooked
        return lambda t: self.ctx(name, t)


class NoHooks:
    """LayerHooks for a block in which nobody reads or replaces anything: every hook point is a pass-through.

    A decoding step without hooks calls ~20 hook points per layer; this skips the name lookups.
    """

    __slots__ = ()

    def __call__(self, local: str, x: torch.Tensor) -> torch.Tensor:
        return x

    def wants(self, local: str) -> bool:
        return False

    def callback(self, local: str) -> Callable[[torch.Tensor], torch.Tensor]:
        return unhooked


NO_HOOKS = NoHooks()


class GateUp:
    """The two MLP input projections of one call, sharing one matmul over the fused [2·d_mlp, d_model] weight.

    `gate(x)` multiplies x by the whole gate|up matrix once (one weight read; at decoding that is the
    cost) and keeps the up half; `up(x)` on the same x returns that half. `up` alone (the standard FFN
    variant never calls `gate`) multiplies by the up rows only.
    """

    __slots__ = ("p", "d_mlp", "_x", "_up")

    def __init__(self, p: LayerParams, d_mlp: int):
        self.p, self.d_mlp = p, d_mlp
        self._x: torch.Tensor | None = None
        self._up: torch.Tensor | None = None

    def gate(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = linear(x, self.p.w_gate_up, self.p.b_gate_up)  # [pos, 2 * d_mlp]
        gate, self._up = gate_up.split_with_sizes((self.d_mlp, self.d_mlp), dim=-1)  # [pos, d_mlp] each (views)
        self._x = x
        return gate

    def up(self, x: torch.Tensor) -> torch.Tensor:
        if x is self._x:
            return self._up
        d, b = self.d_mlp, self.p.b_gate_up
        return linear(x, self.p.w_gate_up[d:], None if b is None else b[d:])


class Block:
    def __init__(self, cfg: ArchConfig, params: LayerParams, layer: int):
        self.cfg, self.p, self.layer = cfg, params, layer
        self.hook_names = {local: layer_hook_name(layer, local) for local in LAYER_HOOKS}
        h, g, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.qkv_split = (h * dh, g * dh, g * dh)
        self.qk_width = (h + g) * dh  # q and k sit side by side at the start of each qkv row

    def forward(
        self,
        x: torch.Tensor,
        ctx: HookContext,
        variant: Variant,
        angles: torch.Tensor,
        kv_index: torch.Tensor,
        allowed: torch.Tensor | None,
        cache: KVCache | None,
        kv_grouped: bool = False,
    ) -> torch.Tensor:
        """x: [pos, d_model] -> [pos, d_model]. `angles` are this layer's RoPE angles [pos, d_head/2].

        `kv_grouped`: kv_index is the contiguous-group mapping, so the fused kernel may share KV heads itself.
        """
        hook = LayerHooks(ctx, self.hook_names) if ctx.wants_any(self.hook_names.values()) else NO_HOOKS
        residual = RESIDUAL_FORMS[variant.norm]
        norm = NORMS[variant.norm]
        eps, p = self.cfg.norm_eps, self.p
        ln1 = (hook.callback("ln1.hook_scale"), hook.callback("ln1.hook_normalized"))
        ln2 = (hook.callback("ln2.hook_scale"), hook.callback("ln2.hook_normalized"))

        def norm1(v: torch.Tensor) -> torch.Tensor:
            return norm(v, p.ln1, eps, variant.norm_type, *ln1)

        def norm2(v: torch.Tensor) -> torch.Tensor:
            return norm(v, p.ln2, eps, variant.norm_type, *ln2)

        def attn(v: torch.Tensor) -> torch.Tensor:
            out = self.attention(v, hook, variant, angles, kv_index, allowed, cache, kv_grouped)
            return hook("hook_attn_out", out)

        def mlp(v: torch.Tensor) -> torch.Tensor:
            return hook("hook_mlp_out", self.mlp(v, hook, variant))

        x = hook("hook_resid_pre", x)
        x = residual(x, attn, norm1)
        x = hook("hook_resid_mid", x)
        x = residual(x, mlp, norm2)
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
        kv_grouped: bool = False,
    ) -> torch.Tensor:
        cfg, p = self.cfg, self.p
        n_pos = x.shape[0]
        h, g, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        qkv = linear(x, p.w_qkv, p.b_qkv)  # [pos, (h + 2g) * dh]
        q_in, k_in, v = qkv.split_with_sizes(self.qkv_split, dim=-1)
        q_in, k_in = q_in.view(n_pos, h, dh), k_in.view(n_pos, g, dh)  # [pos, h, dh], [pos, g, dh]
        q = hook("attn.hook_q", q_in)
        k = hook("attn.hook_k", k_in)
        v = hook("attn.hook_v", v.view(n_pos, g, dh))  # [pos, g, dh]
        rotate = ROTATIONS[variant.rope]
        if q is q_in and k is k_in:
            # Unchanged by hooks, q and k are one [pos, h + g, dh] block of qkv: RoPE acts per head, so one
            # rotation covers both (same values as two, half the ops of a decoding step).
            qk = rotate(qkv[:, : self.qk_width].view(n_pos, h + g, dh), angles)  # [pos, h + g, dh]
            q, k = qk.split_with_sizes((h, g), dim=1)  # [pos, h, dh], [pos, g, dh]
        else:
            q, k = rotate(q, angles), rotate(k, angles)
        q = hook("attn.hook_rot_q", q)
        k = hook("attn.hook_rot_k", k)

        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [g, pos, dh]
        if cache is not None:
            k, v = cache.append(self.layer, k, v)  # [g, pos_k, dh]
        q = q.transpose(0, 1)  # [h, pos, dh]
        scale = attention_scale(dh)

        if hook.wants("attn.hook_attn_scores") or hook.wants("attn.hook_pattern"):
            k, v = k[kv_index], v[kv_index]  # [g, pos_k, dh] -> [h, pos_k, dh]
            scores, pattern = eager_attention(q, k, allowed, scale)
            hooked_scores = hook("attn.hook_attn_scores", scores)
            if hooked_scores is not scores:  # edited scores must decide the pattern
                pattern = softmax_pattern(hooked_scores)
            pattern = hook("attn.hook_pattern", pattern)
            z = torch.matmul(pattern, v)  # [h, pos, dh]
        else:
            if not kv_grouped:
                k, v = k[kv_index], v[kv_index]  # [g, pos_k, dh] -> [h, pos_k, dh]
            z = fused_attention(q, k, v, allowed, scale)  # [h, pos, dh]
        z = hook("attn.hook_z", z.transpose(0, 1))  # [pos, h, dh]

        if hook.wants("attn.hook_result"):
            # Each head's write z_h @ W_o[h], all heads in one batched matmul (z is [h, pos, dh] underneath).
            w_o = p.w_o.t().view(h, dh, cfg.d_model)  # [d_model, h * dh] -> [h, dh, d_model]: head i's columns
            result = torch.bmm(z.transpose(0, 1), w_o).transpose(0, 1)  # [h, pos, d_model] -> [pos, h, d_model]
            hooked = hook("attn.hook_result", result)
            if hooked is not result:
                # Someone edited per-head writes: the output must be built from them.
                out = hooked.sum(1)  # [pos, d_model]
                return out + p.b_o if p.b_o is not None else out
        # Unedited, the output is the o_proj matmul, as in transformers, so a full trace stays bit-identical to
        # it. Summing the per-head writes instead would save that matmul (~4% of a 128-token trace) but rounds
        # differently, and SmolLM2's ~1e4 residual amplifies that to 8.8e-5 in the logits (tolerance 1e-4).
        return linear(z.reshape(n_pos, h * dh), p.w_o, p.b_o)  # [pos, d_model]

    def mlp(self, x: torch.Tensor, hook: LayerHooks, variant: Variant) -> torch.Tensor:
        p = self.p
        projections = GateUp(p, self.cfg.d_mlp)
        post = MLP_FORMS[variant.mlp](x, projections.gate, projections.up, ACTIVATIONS[self.cfg.act], hook)
        return linear(post, p.w_down, p.b_down)  # [pos, d_model]
