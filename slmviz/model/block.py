"""One decoder block: where the norms sit around the two sub-layers, and the sub-layers themselves.

Every activation inside has a leading batch dimension: [b, pos, ...]. One prompt is b = 1; the hook
context shows a trace the batch-free view (see hooks.HookContext).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ArchConfig
from ..hooks import ALL_LAYER_HOOKS, INPUT_HOOKS, HookContext, layer_hook_name
from ..variants import Conventions
from .attention import attention_scale, eager_attention, fused_attention, gather_kv, softmax_pattern
from .kv_cache import KVCache
from .mlp import ACTIVATIONS, MLP_FORMS
from .norm import norm_weight, normalize, skip_norm, unhooked
from .params import LayerParams, linear
from .rope import ROTATIONS, rotate_partial

Sublayer = Callable[[torch.Tensor], torch.Tensor]
Norm = Callable[[torch.Tensor], torch.Tensor]
# Every residual form is form(x, F, before, after, added) -> new residual. `before` / `after` are the norms
# in front of and behind the sub-layer F; `added` is the hook on exactly what is added to x (hook_attn_out,
# hook_mlp_out), so resid_mid = resid_pre + attn_out holds in every form but post-norm's.


def pre_norm_residual(x: torch.Tensor, sublayer: Sublayer, before: Norm, after: Norm, added: Norm) -> torch.Tensor:
    """x + F(N(x)): normalise *before* the sub-layer; returns the new residual.

    Every LLaMA/Qwen2/Qwen3/Mistral/SmolLM2 checkpoint was trained pre-norm. The 2017 order N(x + F(x))
    (`post_norm_residual`) runs with the same weights and silently changes every layer.
    Pinned by tests/test_conventions.py::test_blocks_normalise_before_each_sublayer.
    """
    return x + added(sublayer(before(x)))


def output_norm_residual(x: torch.Tensor, sublayer: Sublayer, before: Norm, after: Norm, added: Norm) -> torch.Tensor:
    """x + N(F(x)): OLMo-2 normalises each sub-layer's *output*, and nothing before it.

    Loading OLMo-2 into a pre-norm block (its norm moved in front of the sub-layer) runs, and every
    layer's output changes. Pinned by tests/test_conventions.py::test_olmo2_normalises_each_sublayer_output.
    """
    return x + added(after(sublayer(x)))


def sandwich_norm_residual(
    x: torch.Tensor, sublayer: Sublayer, before: Norm, after: Norm, added: Norm
) -> torch.Tensor:
    """x + N_post(F(N(x))): Gemma wraps each sub-layer in two norms with their own weights.

    Dropping the one after (`pre_norm_only`) runs, and each sub-layer's raw output reaches the residual.
    Pinned by tests/test_conventions.py::test_gemma_wraps_each_sublayer_in_two_norms.
    """
    return x + added(after(sublayer(before(x))))


def post_norm_residual(x: torch.Tensor, sublayer: Sublayer, before: Norm, after: Norm, added: Norm) -> torch.Tensor:
    """N(x + F(x)): the `post_norm` variant (seed 002). resid_mid/resid_post are the normalised sums."""
    return after(x + added(sublayer(x)))


def no_norm_residual(x: torch.Tensor, sublayer: Sublayer, before: Norm, after: Norm, added: Norm) -> torch.Tensor:
    """x + F(x): the `no_norm` variant (`before` is skip_norm, so its hooks still see scale 1)."""
    return x + added(sublayer(before(x)))


RESIDUAL_FORMS = {
    "pre": pre_norm_residual, "output": output_norm_residual, "sandwich": sandwich_norm_residual,
    "post": post_norm_residual, "none": no_norm_residual,
}
# The forms whose sub-layer reads N(x) (`before`); the others feed it x itself. The input hooks
# (hook_q_input, ..., hook_mlp_in) sit on x before that norm: a form missing here would apply its norm
# twice or not at all to an edited input. Pinned by tests/test_circuits_hooks.py.
READS_BEFORE = frozenset({"pre", "sandwich", "none"})

# A parallel block's branch under each placement: what one sub-layer adds, F read through the norm before it
# and/or followed by the norm after it. ("post" normalises a sum of one sub-layer: variants.resolve refuses it.)
BRANCHES: dict[str, Callable[[Sublayer, Norm, Norm], Sublayer]] = {
    "pre": lambda f, before, after: lambda x: f(before(x)),
    "none": lambda f, before, after: lambda x: f(before(x)),
    "output": lambda f, before, after: lambda x: after(f(x)),
    "sandwich": lambda f, before, after: lambda x: after(f(before(x))),
}


def parallel_residual(x: torch.Tensor, attn: Sublayer, mlp: Sublayer, hook) -> torch.Tensor:
    """x + attn(x) + mlp(x): GPT-NeoX's use_parallel_residual; both branches read the block's input x.

    `attn` / `mlp` are the branches with their norms (ln1 before attention, ln2 before the MLP, both reading x).
    The hook contract still holds as sums: resid_mid = resid_pre + attn_out, resid_post = resid_mid + mlp_out,
    but here resid_mid is a partial sum nothing reads (the MLP saw resid_pre). Feeding the MLP resid_mid
    instead (`sequential_residual`, the GPT-2 order) runs on Pythia's weights and changes every layer.
    transformers sums (mlp + attn) + x; this sums (x + attn) + mlp, one fp32 rounding apart.
    Pinned by tests/test_families_gpt2_neox_gemma2.py::test_neox_runs_attention_and_mlp_in_parallel.
    """
    attn_out = hook("hook_attn_out", attn(x))
    mid = hook("hook_resid_mid", x + attn_out)
    return mid + hook("hook_mlp_out", mlp(x))


def norm_slots(placement: str, sublayer: str, has_pre: bool, has_post: bool) -> tuple[str, str]:
    """(slot before, slot after) sub-layer `sublayer` ("ln1" or "ln2") under a placement: whose weights
    (and hook names) each norm position uses.

    A slot the checkpoint has is used where it belongs; a placement that puts a norm where the
    checkpoint has none reuses the sub-layer's only norm weight there (OLMo-2 under "pre" normalises
    its input with its post weight; LLaMA under "output" or "post" normalises after with its pre weight).
    """
    pre, post = sublayer, f"{sublayer}_post"
    before = pre if has_pre else post
    after = post if has_post else pre
    return before, after


class LayerHooks:
    """Routes a block's local hook names (`attn.hook_z`) to the run's context as full names."""

    __slots__ = ("ctx", "names")

    def __init__(self, ctx: HookContext, names: dict[str, str]):
        self.ctx, self.names = ctx, names

    def __call__(self, local: str, x: torch.Tensor) -> torch.Tensor:
        return self.ctx(self.names[local], x)

    def wants(self, local: str) -> bool:
        return self.ctx.wants(self.names[local])

    def edits(self, local: str) -> bool:
        return self.ctx.edits(self.names[local])

    def callback(self, local: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """fn(x) -> x for one hook point, or `unhooked` when nobody reads it (so the kernel can skip the value)."""
        name = self.names.get(local)
        if name is None or not self.ctx.wants(name):
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

    def edits(self, local: str) -> bool:
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
        gate_up = linear(x, self.p.w_gate_up, self.p.b_gate_up)  # [b, pos, 2 * d_mlp]
        gate, self._up = gate_up.split_with_sizes((self.d_mlp, self.d_mlp), dim=-1)  # [b, pos, d_mlp] each (views)
        self._x = x
        return gate

    def up(self, x: torch.Tensor) -> torch.Tensor:
        if x is self._x:
            return self._up
        d, b = self.d_mlp, self.p.b_gate_up
        return linear(x, self.p.w_gate_up[d:], None if b is None else b[d:])


@dataclass(frozen=True, slots=True)
class AttentionInputs:
    """What one layer's attention reads besides its input x, set up by the decoder for each layer of a forward.

    angles: this layer's RoPE angles [pos, d_head/2]. kv_index: the KV head each query head reads [h].
    allowed: the mask [pos_q, pos_k] (causal, and the sliding window of a sliding layer); None = every key.
    cache: the KV cache this layer's keys and values are appended to, or None. kv_grouped: kv_index is the
    contiguous-group mapping, so the fused kernel may share KV heads itself.
    """

    angles: torch.Tensor
    kv_index: torch.Tensor
    allowed: torch.Tensor | None
    cache: KVCache | None
    kv_grouped: bool = False


class Block:
    def __init__(self, cfg: ArchConfig, params: LayerParams, layer: int):
        self.cfg, self.p, self.layer = cfg, params, layer
        # Every local name any family has: the ones this family lacks (hook_rot_q with learned positions, hook_gate
        # in an ungated MLP) are not in the model's hook_names, so no run ever asks for them.
        self.hook_names = {local: layer_hook_name(layer, local) for local in [*ALL_LAYER_HOOKS, *INPUT_HOOKS]}
        h, g, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.qkv_split = (h * dh, g * dh, g * dh)
        self.qk_width = (h + g) * dh  # q and k sit side by side at the start of each qkv row
        self._norm_weights: dict[tuple[str, float], torch.Tensor] = {}

    def norm_factor(self, slot: str, offset: float, in_fp32: bool) -> torch.Tensor:
        """The factor of norm `slot` (ln1, ln1_post, ..., q_norm), computed once per offset (see norm_weight)."""
        key = (slot, offset)
        if key not in self._norm_weights:
            self._norm_weights[key] = norm_weight(getattr(self.p, slot), offset, in_fp32)
        return self._norm_weights[key]

    def _norm(self, slot: str, hook: LayerHooks, c: Conventions) -> Norm:
        """The residual-stream norm in `slot` under conventions c, firing that slot's hooks."""
        if c.norm == "none":
            return lambda v: skip_norm(v, hook.callback(f"{slot}.hook_scale"), hook.callback(f"{slot}.hook_normalized"))
        weight = self.norm_factor(slot, c.norm_offset, c.norm_weight_in_fp32)
        on_scale, on_normalized = hook.callback(f"{slot}.hook_scale"), hook.callback(f"{slot}.hook_normalized")
        eps = self.cfg.norm_eps
        bias = self.p.norm_biases.get(slot) if self.p.norm_biases else None
        return lambda v: normalize(v, weight, eps, c.norm_type, on_scale, on_normalized, c.norm_weight_in_fp32, bias)

    def forward(self, x: torch.Tensor, ctx: HookContext, c: Conventions, inputs: AttentionInputs) -> torch.Tensor:
        """x: [b, pos, d_model] -> [b, pos, d_model] under conventions c; `inputs` is what the attention reads."""
        hook = LayerHooks(ctx, self.hook_names) if ctx.wants_any(self.hook_names.values()) else NO_HOOKS
        residual = RESIDUAL_FORMS[c.norm]
        has_pre, has_post = self.cfg.has_pre_norms, self.cfg.has_post_norms
        norms1 = [self._norm(slot, hook, c) for slot in norm_slots(c.norm, "ln1", has_pre, has_post)]
        norms2 = [self._norm(slot, hook, c) for slot in norm_slots(c.norm, "ln2", has_pre, has_post)]

        def attn(v: torch.Tensor) -> torch.Tensor:
            return self.attention(v, hook, c, inputs)

        def mlp(v: torch.Tensor) -> torch.Tensor:
            return self.mlp(v, hook, c)

        x = hook("hook_resid_pre", x)
        if c.parallel_residual:
            return hook("hook_resid_post", self.parallel(x, hook, c, inputs, norms1, norms2))
        if hook.wants("hook_q_input") or hook.wants("hook_k_input") or hook.wants("hook_v_input"):
            # Opt-in per-head inputs (hooks.INPUT_HOOKS): the attention reads x and applies the norm itself, once
            # to the shared residual and once per head whose input a hook replaced (split_qkv).
            norm_in = (norms1[0], self._norm(norm_slots(c.norm, "ln1", has_pre, has_post)[0], NO_HOOKS, c)) \
                if c.norm in READS_BEFORE else None
            x = residual(x, lambda v: self.attention(v, hook, c, inputs, split=norm_in or (_same, _same)),
                         _same, norms1[1], lambda v: hook("hook_attn_out", v))
        else:
            x = residual(x, attn, *norms1, lambda v: hook("hook_attn_out", v))
        x = hook("hook_resid_mid", x)
        if hook.wants("hook_mlp_in"):  # opt-in: the residual the MLP branch reads, before its norm
            before = norms2[0] if c.norm in READS_BEFORE else _same
            x = residual(x, lambda v: mlp(before(hook("hook_mlp_in", v))), _same, norms2[1],
                         lambda v: hook("hook_mlp_out", v))
        else:
            x = residual(x, mlp, *norms2, lambda v: hook("hook_mlp_out", v))
        return hook("hook_resid_post", x)

    def parallel(self, x: torch.Tensor, hook: LayerHooks, c: Conventions, inputs: AttentionInputs,
                 norms1: list[Norm], norms2: list[Norm]) -> torch.Tensor:
        """`parallel_residual` with this block's branches, the opt-in input hooks on x as in the sequential path."""
        branch = BRANCHES[c.norm]
        if hook.wants("hook_q_input") or hook.wants("hook_k_input") or hook.wants("hook_v_input"):
            norm_in = (norms1[0], self._norm(norm_slots(c.norm, "ln1", self.cfg.has_pre_norms,
                                                        self.cfg.has_post_norms)[0], NO_HOOKS, c)) \
                if c.norm in READS_BEFORE else (_same, _same)
            attn = branch(lambda v: self.attention(v, hook, c, inputs, split=norm_in), _same, norms1[1])
        else:
            attn = branch(lambda v: self.attention(v, hook, c, inputs), *norms1)
        mlp = branch(lambda v: self.mlp(v, hook, c), *norms2)
        if hook.wants("hook_mlp_in"):
            inner = mlp
            mlp = lambda v: inner(hook("hook_mlp_in", v))  # noqa: E731
        return parallel_residual(x, attn, mlp, hook)

    def attention(
        self, x: torch.Tensor, hook: LayerHooks, c: Conventions, inputs: AttentionInputs,
        split: tuple[Norm, Norm] | None = None,
    ) -> torch.Tensor:
        """`split`: x is the residual before the norm, and (hooked norm, plain norm) are applied here, per head
        where an input hook edits (split_qkv). None: x is already what the attention reads (the usual path)."""
        cfg, p = self.cfg, self.p
        b, n_pos = x.shape[0], x.shape[1]
        h, g, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        # [b, pos, (h + 2g) * dh]
        qkv = linear(x, p.w_qkv, p.b_qkv) if split is None else self.split_qkv(x, hook, *split)
        q_in, k_in, v = qkv.split_with_sizes(self.qkv_split, dim=-1)
        q_in, k_in = q_in.view(b, n_pos, h, dh), k_in.view(b, n_pos, g, dh)  # [b, pos, h, dh], [b, pos, g, dh]
        q = hook("attn.hook_q", q_in)
        k = hook("attn.hook_k", k_in)
        v = hook("attn.hook_v", v.view(b, n_pos, g, dh))  # [b, pos, g, dh]
        fp32 = cfg.rope_in_fp32  # rope.rotation_dtype: OLMo-2 rotates in fp32, the others in the activations' dtype

        rotation, n_rot = ROTATIONS[c.rope], c.rotary_dims

        def rotate(v: torch.Tensor) -> torch.Tensor:
            return rotate_partial(v, inputs.angles, rotation, n_rot, fp32)

        qk_norm = c.qk_norm != "none"
        if q is q_in and k is k_in and not qk_norm:
            # Unchanged by hooks, q and k are one [b, pos, h + g, dh] block of qkv: RoPE acts per head, so one
            # rotation covers both (same values as two, half the ops of a decoding step).
            qk = rotate(qkv[..., : self.qk_width].view(b, n_pos, h + g, dh))  # [b, pos, h + g, dh]
            q, k = qk.split_with_sizes((h, g), dim=2)  # [b, pos, h, dh], [b, pos, g, dh]
        elif not qk_norm:
            q, k = rotate(q), rotate(k)
        elif c.qk_norm_after_rope:
            q, k = self.qk_normalize(rotate(q), rotate(k), hook, c)
        else:
            q, k = self.qk_normalize(q, k, hook, c)
            q, k = rotate(q), rotate(k)
        q = hook("attn.hook_rot_q", q)
        k = hook("attn.hook_rot_k", k)

        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [b, g, pos, dh]
        if inputs.cache is not None:
            k, v = inputs.cache.append(self.layer, k, v)  # [b, g, pos_k, dh]
        q = q.transpose(1, 2)  # [b, h, pos, dh]
        scale = attention_scale(dh, cfg.query_pre_attn_scalar)

        # Soft-capped scores (Gemma 2) have no fused kernel for several queries: the eager path caps them
        # (attention.softcap); a decoding step's single query caps them in the one-query kernel.
        capped_prompt = c.attn_softcap is not None and n_pos > 1
        if hook.wants("attn.hook_attn_scores") or hook.wants("attn.hook_pattern") or capped_prompt:
            kv_index, grouped = inputs.kv_index, inputs.kv_grouped
            k, v = gather_kv(k, kv_index, grouped), gather_kv(v, kv_index, grouped)  # [b, h, pos_k, dh]
            scores, pattern = eager_attention(q, k, inputs.allowed, scale, c.attn_softcap)
            hooked_scores = hook("attn.hook_attn_scores", scores)
            if hooked_scores is not scores:  # edited scores must decide the pattern
                pattern = softmax_pattern(hooked_scores)
            pattern = hook("attn.hook_pattern", pattern)
            z = torch.matmul(pattern, v)  # [b, h, pos, dh]
        else:
            if not inputs.kv_grouped:
                k, v = k[:, inputs.kv_index], v[:, inputs.kv_index]  # [b, g, pos_k, dh] -> [b, h, pos_k, dh]
            z = fused_attention(q, k, v, inputs.allowed, scale, c.attn_softcap)  # [b, h, pos, dh]
        z = hook("attn.hook_z", z.transpose(1, 2))  # [b, pos, h, dh]

        if hook.edits("attn.hook_result"):
            # Someone may edit per-head writes: build them (each head's z_h @ W_o[h]) and sum the result. Read
            # without an edit, hook_result is derived from hook_z on demand (Trace), never materialised here.
            hooked = hook("attn.hook_result", per_head_result(z, p.w_o, cfg))  # [b, pos, h, d_model]
            out = hooked.sum(2)  # [b, pos, d_model]
            return out + p.b_o if p.b_o is not None else out
        if hook.wants("attn.hook_result"):
            hook("attn.hook_result", per_head_result(z, p.w_o, cfg))
        # Unedited, the output is the o_proj matmul, as in transformers, so a full trace stays bit-identical to
        # it. Summing the per-head writes instead would save that matmul (~4% of a 128-token trace) but rounds
        # differently, and SmolLM2's ~1e4 residual amplifies that to 8.8e-5 in the logits (tolerance 1e-4).
        return linear(z.reshape(b, n_pos, h * dh), p.w_o, p.b_o)  # [b, pos, d_model]

    def split_qkv(self, x: torch.Tensor, hook: LayerHooks, hooked_norm: Norm, plain_norm: Norm) -> torch.Tensor:
        """The q|k|v projection [b, pos, (h + 2g) * dh] from per-reader inputs: x [b, pos, d_model] is the residual
        before the norm; hook_q_input [b, pos, h, d_model] and hook_k_input / hook_v_input [b, pos, g, d_model]
        (per KV group, as the model computes keys and values) show it once per reader.

        An input no hook replaced is projected from the shared norm (`hooked_norm`, which fires ln1's hooks once,
        as in a plain forward); a replaced one is normalised per head with `plain_norm` (the same norm, no hooks:
        its scale would be [b, pos, h, 1]) and projected with that head's rows of W_q (or the group's of W_k, W_v),
        so an edit of head i's input reaches head i only. Normalising once and reusing it for every head would
        ignore the edit; editing after the norm would skip the norm's division, which differs per head.
        """
        cfg, p = self.cfg, self.p
        b, n_pos, d = x.shape
        readers = (("hook_q_input", cfg.n_heads), ("hook_k_input", cfg.n_kv_heads), ("hook_v_input", cfg.n_kv_heads))
        views = [x[:, :, None].expand(b, n_pos, heads, d) for _, heads in readers]  # [b, pos, heads, d_model], no copy
        seen = [hook(local, view) for (local, _), view in zip(readers, views, strict=True)]
        shared = hooked_norm(x)  # ln1's hooks see the shared residual's norm, as in a plain forward
        if all(s is v for s, v in zip(seen, views, strict=True)):
            return linear(shared, p.w_qkv, p.b_qkv)  # nothing edited: the plain path, bit for bit
        parts, start = [], 0
        for (_, heads), view, edited in zip(readers, views, seen, strict=True):
            rows = slice(start, start + heads * cfg.d_head)
            start = rows.stop
            w, bias = p.w_qkv[rows], None if p.b_qkv is None else p.b_qkv[rows]
            if edited is view:
                parts.append(linear(shared, w, bias))  # [b, pos, heads * dh]
                continue
            per_head = torch.einsum("bphd,hed->bphe", plain_norm(edited), w.view(heads, cfg.d_head, d))
            per_head = per_head.reshape(b, n_pos, heads * cfg.d_head)
            parts.append(per_head if bias is None else per_head + bias)
        return torch.cat(parts, dim=-1)

    def qk_normalize(
        self, q: torch.Tensor, k: torch.Tensor, hook: LayerHooks, c: Conventions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of queries [b, pos, h, dh] and keys [b, pos, g, dh]: over each head's d_head ("head": Qwen3,
        Gemma) or over the whole projection ("projection": OLMo-2, [b, pos, h·dh] before the head split).

        Per head and per projection both run on the other family's weights only if the sizes match; they
        normalise over different sets of numbers, so mixing them up changes every score.
        Pinned by tests/test_conventions.py::test_qk_norm_spans_what_the_family_normalises.
        """
        eps = self.cfg.norm_eps
        out = []
        for x, slot in ((q, "q_norm"), (k, "k_norm")):
            weight = self.norm_factor(slot, c.norm_offset, c.norm_weight_in_fp32)
            on_scale = hook.callback(f"attn.{slot}.hook_scale")
            on_normalized = hook.callback(f"attn.{slot}.hook_normalized")
            flat = x.flatten(-2) if c.qk_norm == "projection" else x  # [b, pos, heads · dh] for OLMo-2
            normed = normalize(flat, weight, eps, "rms", on_scale, on_normalized, c.norm_weight_in_fp32)
            out.append(normed.view(x.shape))
        return out[0], out[1]

    def mlp(self, x: torch.Tensor, hook: LayerHooks, c: Conventions) -> torch.Tensor:
        p = self.p
        x = mlp_input(x, hook)
        if c.mlp == "plain":  # ungated (GPT-2, GPT-NeoX): w_gate_up holds the up rows only
            post = MLP_FORMS["plain"](x, None, lambda v: linear(v, p.w_gate_up, p.b_gate_up), ACTIVATIONS[c.act], hook)
            return linear(post, p.w_down, p.b_down)  # [b, pos, d_model]
        projections = GateUp(p, self.cfg.d_mlp)
        post = MLP_FORMS[c.mlp](x, projections.gate, projections.up, ACTIVATIONS[c.act], hook)
        return linear(post, p.w_down, p.b_down)  # [b, pos, d_model]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def mlp_input(x: torch.Tensor, hook: LayerHooks | NoHooks) -> torch.Tensor:
    """`blocks.L.mlp.hook_in` [b, pos, d_model]: exactly what the MLP receives, fired as the MLP starts.

    That is the pre-MLP norm's output *after* its learned weight ((1 + w) on Gemma), or hook_resid_mid itself
    where no norm sits before the MLP (OLMo-2), or whatever a variant feeds the MLP. Gemma Scope 2's transcoders
    were trained on this value (transformers' `pre_feedforward_layernorm` output), and so are the ones slmviz
    trains. What breaks if it moves: `ln2.hook_normalized` is x / scale *before* the weight (TransformerLens's
    meaning; TL folds the weight into W_in, so there the two coincide, here they do not). A transcoder reading it
    runs and silently computes garbage features, and an edit of it would be scaled by the weight afterwards.
    Pinned by tests/test_conventions.py::test_mlp_hook_in_is_exactly_what_the_mlp_receives.
    """
    return hook("mlp.hook_in", x)


def per_head_result(z: torch.Tensor, w_o: torch.Tensor, cfg: ArchConfig) -> torch.Tensor:
    """Each head's write into the residual stream before o_proj's bias (and any norm after attention):
    z [..., pos, h, dh] -> [..., pos, h, d_model], z_h @ W_o[:, h·dh:(h+1)·dh].T, all heads in one matmul.

    Their sum over heads is o_proj's output; Trace derives hook_result from hook_z with this on demand.
    One matmul per head over every row and position (bmm with the heads as its batch): a broadcast matmul of
    [b, h, pos, dh] by [h, dh, d] would first copy W_o once per row of the batch.
    """
    h, dh = cfg.n_heads, cfg.d_head
    w = w_o.t().reshape(h, dh, cfg.d_model)  # [d_model, h * dh] -> [h, dh, d_model]: head i's columns
    rows = z.reshape(-1, h, dh).transpose(0, 1)  # [..., pos, h, dh] -> [h, rows, dh]
    out = torch.bmm(rows, w)  # [h, rows, d_model]
    return out.transpose(0, 1).reshape(*z.shape[:-1], cfg.d_model)  # [..., pos, h, d] (a view)
