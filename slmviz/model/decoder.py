"""The decoder: embed, run the blocks with one position offset, final norm, unembed.

Inside, every activation has a leading batch dimension [b, pos, ...]; `forward` takes one prompt [pos]
(what traces and generation run) or a batch [b, pos] of prompts of one length (sweeps, corpus scans).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ..config import SLIDING, ArchConfig
from ..hooks import HookContext, hook_names
from ..variants import Conventions, Variant, resolve
from .attention import attention_mask, kv_head_index, reads_contiguous_groups, softcap
from .block import AttentionInputs, Block
from .kv_cache import KVCache
from .norm import norm_weight, normalize, skip_norm, unhooked
from .params import DecoderParams, StepThreads, linear
from .rope import rope_angles, rope_inv_freq


def position_offset(cache: KVCache | None) -> int:
    """Absolute position of the first new token: the cache's committed length, read ONCE per forward.

    The decoder reads it before the layer loop and every layer uses the same value; the cache only
    advances after all layers have appended. Re-deriving it inside each layer from a length that the
    earlier layers already advanced (seed 001's bug) gives layer L the position offset + L during
    cached decoding: `layer_position_offset` with the `kv_position_bug` variant.
    Pinned by tests/test_conventions.py::test_cached_decoding_matches_one_full_forward.
    """
    return 0 if cache is None else cache.length


def layer_position_offset(offset: int, layer: int, decoding: bool, kv_position_bug: bool) -> int:
    """The offset layer `layer` applies RoPE at. Faithful: `offset` for every layer.

    With `kv_position_bug`, a cached decoding step (`decoding`: the cache already held positions) sees
    offset + layer, because each earlier layer appended one entry to the shared length first. Prefill
    starts from an empty cache, where buggy and faithful code agree.
    """
    return offset + layer if (kv_position_bug and decoding) else offset


def embed_scale(d_model: int, dtype: torch.dtype) -> torch.Tensor:
    """Gemma's embedding multiplier sqrt(d_model), rounded to the weights' dtype as transformers does.

    The scale is not in the checkpoint (Gemma3TextScaledWordEmbedding holds it as a buffer and casts it
    to the embedding's dtype before multiplying), so a port can forget it (`no_embed_scale`) or multiply
    by the exact float: in bf16 sqrt(640) = 25.30 rounds to 25.25, and every activation moves by 0.2%.
    Pinned by tests/test_conventions.py::test_gemma_scales_embeddings_in_the_weights_dtype.
    """
    return torch.tensor(d_model**0.5, dtype=torch.float32).to(dtype)


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(logits / cap) when the config sets final_logit_softcapping (None: logits unchanged); see
    attention.softcap."""
    return softcap(logits, cap)


def learned_positions(offset: int, n_new: int, decoding: bool, kv_position_bug: bool, max_positions: int,
                      device: torch.device | None = None) -> torch.Tensor:
    """The rows of GPT-2's learned position embedding (wpe) that n_new tokens read: offset + arange(n_new).

    `offset` is the cache length (`position_offset`), so a decoding step's token reads row p, its absolute
    position, as transformers' GPT2Model does with past_seen_tokens. The embedding is added once, before the
    first block; forgetting the offset in a cached step (`kv_position_bug` with learned positions: rows
    0..n_new-1) runs, and every generated token is embedded as if it were the first. Past the table's
    max_position_embeddings rows there is no position: a clear error rather than an index error.
    Pinned by tests/test_families_gpt2_neox_gemma2.py::test_learned_positions_carry_the_cache_offset.
    """
    start = 0 if (kv_position_bug and decoding) else offset
    if start + n_new > max_positions:
        raise ValueError(f"{start + n_new} positions, but this model's learned position embedding has "
                         f"{max_positions} (max_position_embeddings)")
    return torch.arange(start, start + n_new, device=device)


class Decoder:
    """A decoder-only LM over DecoderParams, for every supported family (their differences are ArchConfig data)."""

    def __init__(self, cfg: ArchConfig, params: DecoderParams):
        self.cfg, self.params = cfg, params
        self.blocks = [Block(cfg, lp, i) for i, lp in enumerate(params.layers)]
        self.hook_names = hook_names(cfg)
        self._inv_freq_cache: dict[tuple[float, int, bool], torch.Tensor] = {}
        self._kv_index = {m: kv_head_index(cfg.n_heads, cfg.n_kv_heads, m).to(self.device) for m in ("grouped", "tile")}
        self._kv_grouped = {m: reads_contiguous_groups(i.cpu(), cfg.n_kv_heads) for m, i in self._kv_index.items()}
        self._conventions: dict[Variant, Conventions] = {}
        self._final_norm: dict[float, torch.Tensor] = {}
        self._step_threads = StepThreads()  # one thread or every thread for a decoding step, measured per model

    @property
    def device(self) -> torch.device:
        return self.params.embed.device

    def conventions(self, variant: Variant) -> Conventions:
        """`variants.resolve(variant, cfg)`, memoised (a decoding step asks once per token)."""
        if variant not in self._conventions:
            self._conventions[variant] = resolve(variant, self.cfg)
        return self._conventions[variant]

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.d_head, capacity, self.params.embed.dtype, batch, self.device)

    def inv_freq(self, theta: float, seq_len: int, scaled: bool = True, dims: int | None = None) -> torch.Tensor:
        """RoPE inverse frequencies at base `theta` over `dims` turned dims (d_head; fewer for partial rotary);
        `scaled=False` for Gemma's local layers (no scaling)."""
        cfg = self.cfg
        scaling = cfg.rope_scaling if scaled else {"rope_type": "default"}
        dynamic = scaling.get("rope_type") == "dynamic" and seq_len > cfg.max_position_embeddings
        key = (theta, seq_len if dynamic else 0, scaled, dims or cfg.d_head)
        if key not in self._inv_freq_cache:
            self._inv_freq_cache[key] = rope_inv_freq(
                dims or cfg.d_head, theta, scaling, seq_len, cfg.max_position_embeddings
            ).to(self.device)
        return self._inv_freq_cache[key]

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: HookContext,
        variant: Variant,
        cache: KVCache | None = None,
        last_only: bool = False,
        grad: bool = False,
        stop_after_layer: int | None = None,
    ) -> torch.Tensor:
        """input_ids [pos] -> logits [pos, vocab]; or [b, pos] -> [b, pos, vocab] (pos 1 with last_only).

        `grad=True` runs with autograd on (attribution patching backpropagates to activations); otherwise
        under inference_mode. `stop_after_layer=L` runs blocks 0..L only and returns block L's resid_post
        [(b,) pos, d_model] instead of logits: what reads activations of layer L (SAE training) needs no more.
        """
        single = input_ids.dim() == 1
        ids = input_ids[None] if single else input_ids  # [b, pos]
        timed = self.is_plain_step(ids, ctx, cache, grad)
        threads = self._step_threads.pick() if timed else "every"
        start = time.perf_counter()
        with _autograd(grad), self._step_threads.threads(threads, self.device):
            c = self.conventions(variant)
            p = self.params
            x = p.embed[ids.to(self.device)]  # [b, pos, d_model]
            if c.embed_scale:
                x = x * embed_scale(self.cfg.d_model, x.dtype)
            x = ctx("hook_embed", x)
            if self.cfg.positions == "learned":
                x = x + ctx("hook_pos_embed", self.position_embedding(ids.shape[1], c, cache, x))
            logits = self._run(x, 0, ctx, c, cache, last_only, stop_after_layer)
        if timed:
            self._step_threads.record(threads, (time.perf_counter() - start) / ids.shape[0])
        return logits[0] if single else logits

    def is_plain_step(self, ids: torch.Tensor, ctx: HookContext, cache: KVCache | None, grad: bool) -> bool:
        """True for a forward whose threads StepThreads chooses: one new position per row after a cache that
        holds positions already (a decoding step), on a CPU with several threads, with no autograd and no hook
        point read or replaced.

        Hooked steps keep every thread: a hook fn (user code, a spliced SAE) would otherwise run on one thread,
        and its cost would blur the two timings. Prompts (prefill, traces) keep every thread: their matrix
        products are large enough for every thread to pay.
        """
        return (ids.shape[1] == 1 and cache is not None and cache.length > 0 and not grad
                and self.device.type == "cpu" and torch.get_num_threads() > 1
                and not ctx.wants_any(self.hook_names))

    def position_embedding(self, n_new: int, c: Conventions, cache: KVCache | None, like: torch.Tensor) -> torch.Tensor:
        """`hook_pos_embed` [b, pos, d_model]: the learned position rows the new tokens read (`learned_positions`);
        zeros with the `no_pos_embed` variant, so resid_pre[0] = hook_embed + hook_pos_embed holds either way."""
        if c.positions != "learned":
            return torch.zeros_like(like)
        offset = position_offset(cache)
        rows = learned_positions(offset, n_new, offset > 0, c.kv_position_bug, self.params.pos_embed.shape[0],
                                 self.device)
        return self.params.pos_embed[rows].expand(like.shape[0], -1, -1)  # [b, pos, d_model]

    def forward_from(
        self,
        x: torch.Tensor,
        start_layer: int,
        ctx: HookContext,
        variant: Variant,
        last_only: bool = False,
        grad: bool = False,
        cache: KVCache | None = None,
        stop_after_layer: int | None = None,
    ) -> torch.Tensor:
        """Resume a forward at block `start_layer` from its resid_pre x [b, pos, d_model] -> logits [b, pos, vocab].

        Patching sweeps use this: every patched copy of a run shares the layers before the patch, so they
        start here from the cached residual instead of recomputing them. With `cache` (keys and values of
        the positions before x's, for layers >= start_layer), x holds only the later positions.
        `stop_after_layer` as in `forward` (circuits read two logits off the last resid_post themselves).
        """
        if not 0 <= start_layer < self.cfg.n_layers:
            raise ValueError(f"start_layer must be in [0, {self.cfg.n_layers}), got {start_layer}")
        with _autograd(grad):
            return self._run(x, start_layer, ctx, self.conventions(variant), cache, last_only, stop_after_layer)

    def _run(
        self, x: torch.Tensor, start_layer: int, ctx: HookContext, c: Conventions, cache: KVCache | None,
        last_only: bool, stop_after_layer: int | None = None,
    ) -> torch.Tensor:
        cfg, p = self.cfg, self.params
        n_new = x.shape[1]
        offset = position_offset(cache)
        n_keys = offset + n_new
        decoding = offset > 0
        masks: dict[int | None, torch.Tensor | None] = {}
        kv_index, kv_grouped = self._kv_index[c.gqa], self._kv_grouped[c.gqa]
        angles: dict[tuple[int, float], torch.Tensor] = {}
        if stop_after_layer is not None and not start_layer <= stop_after_layer < cfg.n_layers:
            raise ValueError(f"stop_after_layer must be in [{start_layer}, {cfg.n_layers}), got {stop_after_layer}")
        end = cfg.n_layers if stop_after_layer is None else stop_after_layer + 1
        for block in self.blocks[start_layer:end]:
            sliding = cfg.layer_type(block.layer) == SLIDING
            window = c.sliding_window if sliding else None
            if window not in masks:
                masks[window] = attention_mask(n_new, n_keys, c.causal, window, self.device)
            theta = c.rope_local_theta if sliding else c.rope_theta
            start = layer_position_offset(offset, block.layer, decoding, c.kv_position_bug)
            key = (start, theta)
            if key not in angles:
                # One angles tensor for every layer with the same start and base (all of them in a LLaMA,
                # two in a Gemma): RoPE's cos/sin are then computed once per forward (rope.half_trig).
                scaled = not (sliding and cfg.rope_local_theta is not None)
                positions = torch.arange(start, start + n_new, device=self.device)
                angles[key] = rope_angles(positions, self.inv_freq(theta, n_keys, scaled, c.rotary_dims))
            inputs = AttentionInputs(angles[key], kv_index, masks[window], cache, kv_grouped)
            x = block.forward(x, ctx, c, inputs)  # [b, pos, d]
        if cache is not None:
            cache.advance(n_new)
        if stop_after_layer is not None:
            return x  # [b, pos, d_model]: block stop_after_layer's resid_post

        if last_only:
            x = x[:, -1:]
        x = self.final_norm(x, c, _callback(ctx, "ln_final.hook_scale"), _callback(ctx, "ln_final.hook_normalized"))
        return softcap_logits(linear(x, p.unembed, None), c.final_softcap)  # [b, pos, vocab]

    def final_norm(
        self, x: torch.Tensor, c: Conventions, on_scale: Callable = unhooked, on_normalized: Callable = unhooked
    ) -> torch.Tensor:
        """ln_final under conventions c (removed by the no_norm variant). The logit lens reads layers through it."""
        if c.norm == "none":
            return skip_norm(x, on_scale, on_normalized)
        return normalize(x, self.final_norm_factor(c), self.cfg.norm_eps, c.norm_type, on_scale, on_normalized,
                         c.norm_weight_in_fp32, self.params.ln_final_bias)

    def final_norm_factor(self, c: Conventions) -> torch.Tensor:
        """ln_final's factor under conventions c (see norm.norm_weight), computed once per offset."""
        if c.norm_offset not in self._final_norm:
            self._final_norm[c.norm_offset] = norm_weight(self.params.ln_final, c.norm_offset, c.norm_weight_in_fp32)
        return self._final_norm[c.norm_offset]


def _autograd(grad: bool) -> contextlib.AbstractContextManager:
    return torch.enable_grad() if grad else torch.inference_mode()


def _callback(ctx: HookContext, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn(x) -> x for one hook point, or `unhooked` when nobody reads it (see norm.normalize)."""
    return (lambda t: ctx(name, t)) if ctx.wants(name) else unhooked
