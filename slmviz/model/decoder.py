"""The decoder: embed, run the blocks with one position offset, final norm, unembed."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import ArchConfig
from ..hooks import HookContext, hook_names
from ..variants import Variant
from .attention import attention_mask, kv_head_index, reads_contiguous_groups
from .block import NORMS, Block
from .kv_cache import KVCache
from .norm import unhooked
from .params import DecoderParams, linear
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


class Decoder:
    """A LLaMA-style decoder over DecoderParams. One sequence at a time: activations are [pos, ...]."""

    def __init__(self, cfg: ArchConfig, params: DecoderParams):
        self.cfg, self.params = cfg, params
        self.blocks = [Block(cfg, lp, i) for i, lp in enumerate(params.layers)]
        self.hook_names = hook_names(cfg.n_layers)
        self._inv_freq_cache: dict[tuple[float, int], torch.Tensor] = {}
        self._kv_index = {m: kv_head_index(cfg.n_heads, cfg.n_kv_heads, m) for m in ("grouped", "tile")}
        self._kv_grouped = {m: reads_contiguous_groups(i, cfg.n_kv_heads) for m, i in self._kv_index.items()}

    def new_cache(self, capacity: int) -> KVCache:
        cfg = self.cfg
        return KVCache(cfg.n_layers, cfg.n_kv_heads, cfg.d_head, capacity, self.params.embed.dtype)

    def inv_freq(self, variant: Variant, seq_len: int) -> torch.Tensor:
        cfg = self.cfg
        theta = variant.rope_theta or cfg.rope_theta
        dynamic = cfg.rope_scaling.get("rope_type") == "dynamic" and seq_len > cfg.max_position_embeddings
        key = (theta, seq_len if dynamic else 0)
        if key not in self._inv_freq_cache:
            self._inv_freq_cache[key] = rope_inv_freq(
                cfg.d_head, theta, cfg.rope_scaling, seq_len, cfg.max_position_embeddings
            )
        return self._inv_freq_cache[key]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: HookContext,
        variant: Variant,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """input_ids [pos] -> logits [pos, vocab] (or [1, vocab] with last_only)."""
        cfg, p = self.cfg, self.params
        n_new = input_ids.shape[0]
        offset = position_offset(cache)
        n_keys = offset + n_new
        decoding = offset > 0
        inv_freq = self.inv_freq(variant, n_keys)
        allowed = attention_mask(n_new, n_keys, variant.causal, cfg.sliding_window)
        kv_index, kv_grouped = self._kv_index[variant.gqa], self._kv_grouped[variant.gqa]

        x = ctx("hook_embed", p.embed[input_ids])  # [pos, d_model]
        angles, angles_start = None, None
        for block in self.blocks:
            start = layer_position_offset(offset, block.layer, decoding, variant.kv_position_bug)
            if start != angles_start:
                # One angles tensor for every layer that starts at the same position (all of them unless
                # kv_position_bug): RoPE's cos/sin are then computed once per forward (rope.half_trig).
                angles, angles_start = rope_angles(torch.arange(start, start + n_new), inv_freq), start
            x = block.forward(x, ctx, variant, angles, kv_index, allowed, cache, kv_grouped)  # [pos, d_model]
        if cache is not None:
            cache.advance(n_new)

        if last_only:
            x = x[-1:]
        x = NORMS[variant.norm](
            x, p.ln_final, cfg.norm_eps, variant.norm_type,
            _callback(ctx, "ln_final.hook_scale"), _callback(ctx, "ln_final.hook_normalized"),
        )
        return linear(x, p.unembed, None)  # [pos, vocab]


def _callback(ctx: HookContext, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn(x) -> x for one hook point, or `unhooked` when nobody reads it (see norm.normalize)."""
    return (lambda t: ctx(name, t)) if ctx.wants(name) else unhooked
