"""Attention conventions: GQA head mapping, causal mask, score scale, and the attention kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .params import one_thread


def kv_head_of(q_head: int, n_rep: int) -> int:
    """Query head q reads KV head q // n_rep: contiguous groups of n_rep query heads share a KV head.

    This is transformers' `repeat_interleave` (repeat_kv) mapping that every GQA checkpoint
    (SmolLM2: 9 query heads, 3 KV heads) was trained with. `q % n_kv_heads` also indexes a valid
    KV head and runs, but scrambles the groups: the `gqa_tile` variant.
    Pinned by tests/test_conventions.py::test_gqa_groups_are_contiguous.
    """
    return q_head // n_rep


def kv_head_of_tiled(q_head: int, n_kv_heads: int) -> int:
    """The `gqa_tile` variant: query head q reads KV head q % g (what `k.repeat(1, n_rep, 1)` gives)."""
    return q_head % n_kv_heads


def kv_head_index(n_heads: int, n_kv_heads: int, mapping: str = "grouped") -> torch.Tensor:
    """LongTensor [h]: the KV head each query head reads, from `kv_head_of` (or the tiled variant)."""
    n_rep = n_heads // n_kv_heads
    pick = {"grouped": lambda q: kv_head_of(q, n_rep), "tile": lambda q: kv_head_of_tiled(q, n_kv_heads)}[mapping]
    return torch.tensor([pick(q) for q in range(n_heads)], dtype=torch.long)


def gather_kv(x: torch.Tensor, kv_index: torch.Tensor, grouped: bool) -> torch.Tensor:
    """[b, g, pos_k, dh] -> [b, h, pos_k, dh]: for each query head, the KV head `kv_index` says it reads.

    With contiguous groups (`grouped`, the `kv_head_of` mapping) this is transformers' repeat_kv: an expand
    and one reshape copy, a memcpy's cost (and no copy at all when every query head has its own KV head);
    any other mapping (the `gqa_tile` variant) gathers with an index, which on a CPU costs several times
    more. Both give the same values.
    """
    if not grouped:
        return x[:, kv_index]
    b, g, n, dh = x.shape
    h = kv_index.numel()
    if h == g:
        return x
    return x[:, :, None].expand(b, g, h // g, n, dh).reshape(b, h, n, dh)  # [b, g, n_rep, pos_k, dh] -> [b, h, ...]


def attention_scale(d_head: int, query_pre_attn_scalar: float | None = None) -> float:
    """Scores are q·k / sqrt(d_head), with d_head the per-head size (config.head_dim when given); Gemma
    scales by query_pre_attn_scalar ** -0.5 instead (its config's own number, 256 for Gemma 3 270M).

    Using d_model, or hidden_size/heads when a checkpoint sets an explicit head_dim, or ignoring Gemma's
    query_pre_attn_scalar when it differs from head_dim, sharpens or flattens every pattern without error.
    Pinned by tests/test_conventions.py::test_scores_are_scaled_by_sqrt_d_head.
    """
    return (query_pre_attn_scalar if query_pre_attn_scalar is not None else d_head) ** -0.5


def attention_mask(
    n_q: int, n_k: int, causal: bool = True, sliding_window: int | None = None, device: torch.device | None = None
) -> torch.Tensor | None:
    """Bool [pos_q, pos_k], True where query i may read key j; None when every key is visible.

    Queries are the last n_q of the n_k positions (key j is at absolute position j, query i at
    n_k - n_q + i), so during cached decoding the new token sees the whole cache. Causal: key
    position <= query position; dropping this lets every position read the future
    (`no_causal_mask`). A sliding window W (Mistral, Gemma's sliding layers) additionally requires
    query - key < W: the token itself and the W - 1 before it. `<=` would let one key too many in,
    which changes nothing below W tokens and every sliding layer beyond.
    Pinned by tests/test_conventions.py::test_causal_mask_hides_the_future and
    ::test_sliding_window_holds_the_token_and_w_minus_1_before_it.
    """
    q_pos = torch.arange(n_k - n_q, n_k, device=device)[:, None]
    k_pos = torch.arange(n_k, device=device)[None, :]
    allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if causal:
        allowed &= k_pos <= q_pos
    if sliding_window is not None:
        allowed &= (q_pos - k_pos) < sliding_window
    return None if bool(allowed.all()) else allowed


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap · tanh(x / cap) (Gemma 2's attention scores, cap 50, and final logits, cap 30); x itself for None.

    Computed as transformers does, x / cap, tanh, then · cap. The cap bounds every score to (-cap, cap): without
    it (`no_softcap`, or an SDPA/flash kernel that cannot cap) large scores sharpen their patterns and the
    model still runs. Attention capping comes after the 1/sqrt scale and before the mask, so masked entries
    stay -inf. TransformerLens's hook_attn_scores holds the capped value, and so does slmviz's; the score
    that is bilinear in q and k is the one before the cap.
    Pinned by tests/test_families_gpt2_neox_gemma2.py::test_gemma2_soft_caps_scores_before_the_mask_and_logits.
    """
    return x if cap is None else torch.tanh(x / cap) * cap


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor | None, scale: float, cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, pattern), both [b, h, pos_q, pos_k]; masked scores are -inf. q: [b, h, pos_q, dh]; k: [b, h, pos_k, dh].

    Like transformers' eager path: scale after the matmul, soft-cap (`softcap`, Gemma 2), mask, softmax in fp32.
    Scaling and masking write into the fresh matmul output (no hook has seen it yet), so the scores cost one
    [b, h, pos_q, pos_k] buffer.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [b, h, pos_q, pos_k]
    if cap is not None:
        scores = softcap(scores, cap)
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    return scores, softmax_pattern(scores)


def softmax_pattern(scores: torch.Tensor) -> torch.Tensor:
    """Attention weights from scores: softmax over keys, computed in fp32 like transformers' eager path."""
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
    cap: float | None = None,
) -> torch.Tensor:
    """z [b, h, pos_q, dh] through PyTorch's fused SDPA kernel, used when nobody asked for scores or patterns.

    q: [b, h, pos_q, dh]. k, v: [b, h, pos_k, dh], or [b, g, pos_k, dh] with g < h KV heads, which the kernel
    shares the `kv_head_of` way (enable_gqa repeats each KV head n_rep times, contiguous groups) without
    copying them; callers pass g heads only when their head mapping is exactly that (see
    `reads_contiguous_groups`). Only 4-D inputs reach the CPU flash-attention kernel (3-D ones fall back to
    the unfused math path, ~3x slower at 512 tokens). A plain causal prefill goes through `is_causal=True`
    (no mask tensor is materialised).
    `cap`: soft-capped scores (Gemma 2, `softcap`), which SDPA cannot compute: a single query only (a decoding step,
    where the one-query path caps them itself); several queries with a cap take `eager_attention`.
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    if n_q == 1:
        return _one_query_attention(q, k, v, allowed, scale, cap)
    if cap is not None:
        raise ValueError("SDPA cannot soft-cap scores: several queries with a cap take eager_attention")
    grouped = k.shape[1] != q.shape[1]
    if allowed is not None and n_q == n_k and torch.equal(allowed, _lower_triangle(n_q, allowed.device)):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=grouped)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=grouped)


def _one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, scale: float,
    cap: float | None = None,
) -> torch.Tensor:
    """`fused_attention` for a single query (a decoding step): two small batched matmuls.

    SDPA's per-call setup costs more than the whole product for one query (~50 vs ~20 µs, 30 times a step).
    The h query heads are viewed as g groups of n_rep, the heads of one KV head side by side (`kv_head_of`),
    so each KV head is read once and never copied. A soft cap (Gemma 2) applies to the scaled scores before the
    mask, in `eager_attention`'s order; taking the eager path instead would copy every cached key and value per
    query head (gather_kv) at every step.
    """
    b, h, _, dh = q.shape
    g, n_k = k.shape[1], k.shape[2]
    grouped_q = q.reshape(b * g, h // g, dh)  # [b, h, 1, dh] -> [b·g, n_rep, dh]
    keys = k.reshape(b * g, n_k, dh)  # a view for the cache's [1, g, pos_k, dh] slice
    with one_thread(q.device):
        scores = torch.baddbmm(_empty(q), grouped_q, keys.transpose(1, 2), beta=0, alpha=scale)  # [b·g, n_rep, pos_k]
        if cap is not None:
            scores = softcap(scores, cap)
        if allowed is not None:  # [1, pos_k], e.g. a sliding window
            scores.masked_fill_(~allowed, float("-inf"))
        z = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(b * g, n_k, dh))  # [b·g, n_rep, dh]
    return z.view(b, h, 1, dh)


# baddbmm's ignored input (beta=0), one per dtype: lets the scale ride on the matmul. It must have the
# batches' dtype (baddbmm refuses an fp32 input beside bf16 batches, even though it never reads it).
_EMPTY = {dtype: torch.empty((), dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}


def _empty(like: torch.Tensor) -> torch.Tensor:
    if like.device.type == "cpu" and like.dtype in _EMPTY:
        return _EMPTY[like.dtype]
    return torch.empty((), device=like.device, dtype=like.dtype)


def reads_contiguous_groups(kv_index: torch.Tensor, n_kv_heads: int) -> bool:
    """True if `kv_index` (from `kv_head_index`) is the mapping SDPA's enable_gqa applies:
    repeat_interleave of the g KV heads, i.e. contiguous groups. False for `gqa_tile`, whose heads must
    be gathered explicitly."""
    n_rep = kv_index.numel() // n_kv_heads
    return torch.equal(kv_index, torch.arange(n_kv_heads).repeat_interleave(n_rep))


def _lower_triangle(n: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()
