"""Rotary position embedding: frequencies (with the checkpoint's scaling) and the pairing convention."""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(d_head: int, theta: float, scaling: dict[str, Any], seq_len: int, max_pos: int) -> torch.Tensor:
    """Inverse frequencies [d_head/2]: theta^(-2i/d_head), then the checkpoint's RoPE scaling.

    The exponent uses integer 0, 2, 4, ... cast to float (as in transformers): computing it as
    arange(d_head/2)*2/d_head in another dtype shifts high frequencies slightly. The wrong base
    (e.g. a hard-coded 10 000 instead of SmolLM2's 100 000) runs fine and is the `rope_theta_10k`
    variant. Scaling types: linear divides all frequencies by `factor`; dynamic (NTK) enlarges
    theta once seq_len exceeds max_position_embeddings; llama3 divides low frequencies by
    `factor` and blends the middle band. Pinned by tests/test_conventions.py::test_rope_frequencies_*.
    """
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "dynamic" and seq_len > max_pos:
        factor = scaling["factor"]
        theta = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (d_head / (d_head - 2))
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, dtype=torch.int64).float() / d_head))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling (Meta's reference `apply_scaling`)."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Angle of each (position, frequency) pair: [pos] x [d_head/2] -> [pos, d_head/2], in fp32.

    Positions are absolute: during cached decoding the caller passes offset + arange(new tokens).
    """
    return positions.float()[:, None] * inv_freq[None, :]


def rotation_dtype(x_dtype: torch.dtype, in_fp32: bool) -> torch.dtype:
    """The dtype RoPE's multiply-adds run in: the activations' own (cos/sin cast to it), or fp32 with `in_fp32`.

    transformers' LLaMA, Qwen2/3, Mistral and Gemma 3 cast cos/sin to q's dtype and rotate in it (in bf16,
    every product rounds to 8 bits of mantissa); OLMo-2 leaves cos/sin in fp32, so q · cos promotes to fp32,
    and casts the rotated q, k back (`q_embed.to(q_type)`). The rotated values are then one bf16 rounding
    apart, which attention scores amplify; in fp32 both are the same. Read from ArchConfig.rope_in_fp32.
    Pinned by tests/test_dtype.py::test_rope_rotates_in_the_dtype_its_family_uses.
    """
    return torch.float32 if in_fp32 else x_dtype


def rotate_half(x: torch.Tensor, angles: torch.Tensor, in_fp32: bool = False) -> torch.Tensor:
    """HF/NeoX pairing: dim i rotates with dim i + d/2 by angle i. x: [b, pos, heads, d_head].

    transformers' LLaMA-family checkpoints need this pairing (their q/k rows were permuted at
    conversion so that it holds). Pairing (2i, 2i+1) instead is `rotate_interleaved`, which runs
    and corrupts every attention score except at position 0.
    Computed as x·cos + roll(x, d/2)·(-sin, sin): roll(x) = (x2, x1), and (x2·-sin, x1·sin) is
    transformers' rotate_half(x)·sin = (-x2, x1)·sin bit for bit (negation is exact).
    The arithmetic runs in `rotation_dtype(x.dtype, in_fp32)`; the result has x's dtype.
    Pinned by tests/test_conventions.py::test_rope_pairs_dim_i_with_i_plus_half.
    """
    cos, signed_sin = half_trig(angles, rotation_dtype(x.dtype, in_fp32))  # [pos, 1, d_head] each
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin).to(x.dtype)


def half_trig(angles: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) of cat(angles, angles), each [pos, 1, d_head]; sin's first half negated.

    Computed in fp32 (like transformers' rotary embedding) and then cast to `dtype` (see rotation_dtype).

    Memoised for the most recent `angles` tensors: the decoder computes the angles once per forward
    and RoPE base and hands the same tensor to every layer (and to q and k), so one cos/sin serves all
    of them (Gemma alternates two bases, hence more than one entry). The memo holds references to
    those tensors, so an identity match can never be a recycled id.
    """
    for memo_angles, memo_dtype, memo_trig in _trig_memo:
        if memo_angles is angles and memo_dtype == dtype:
            return memo_trig
    # cos/sin of the full [pos, d_head] angles like transformers, not of the half: the vectorised and the
    # scalar tail loop of torch.cos may differ in the last bit, and which elements fall in the tail
    # depends on the tensor's size.
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]  # [pos, 1, d_head]
    cos, sin = emb.cos(), emb.sin()
    half = angles.shape[-1]
    trig = (cos.to(dtype), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).to(dtype))
    _trig_memo.insert(0, (angles, dtype, trig))
    del _trig_memo[_TRIG_MEMO_SIZE:]
    return trig


_TRIG_MEMO_SIZE = 4
_trig_memo: list[tuple[torch.Tensor, torch.dtype, tuple[torch.Tensor, torch.Tensor]]] = []


def rotate_interleaved(x: torch.Tensor, angles: torch.Tensor, in_fp32: bool = False) -> torch.Tensor:
    """GPT-J / original Meta pairing: dim 2i rotates with dim 2i+1 by angle i (the variant)."""
    dtype = rotation_dtype(x.dtype, in_fp32)
    emb = angles.repeat_interleave(2, dim=-1)[:, None, :]  # [pos, 1, d_head]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((-x_odd, x_even), dim=-1).flatten(-2)  # [..., d_head]
    return (x * cos + rotated * sin).to(x.dtype)


def no_rotation(x: torch.Tensor, angles: torch.Tensor, in_fp32: bool = False) -> torch.Tensor:
    """The `no_rope` variant: queries and keys carry no position."""
    return x


ROTATIONS = {"rotate_half": rotate_half, "interleaved": rotate_interleaved, "none": no_rotation}


def rotate_partial(x: torch.Tensor, angles: torch.Tensor, rotate, n_rot: int, in_fp32: bool = False) -> torch.Tensor:
    """Partial rotary (GPT-NeoX's rotary_pct): the first `n_rot` dims of each head turn, the rest pass unchanged.

    x: [b, pos, heads, d_head]; angles: [pos, n_rot/2], from frequencies over n_rot dims (not d_head). Within
    the turned dims the pairing is the rotation's own: rotate_half pairs dim i with i + n_rot/2 (not i + d_head/2).
    Rotating every dim (`rotary_full`), or pairing across the whole head, runs and moves every score.
    The result keeps all d_head dims, as TransformerLens's hook_rot_q / hook_rot_k do.
    Pinned by tests/test_families_gpt2_neox_gemma2.py::test_partial_rotary_turns_the_first_dims_paired_within_them.
    """
    if n_rot == x.shape[-1]:
        return rotate(x, angles, in_fp32)
    return torch.cat((rotate(x[..., :n_rot], angles, in_fp32), x[..., n_rot:]), dim=-1)
