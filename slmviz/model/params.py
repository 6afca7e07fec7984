"""The decoder's parameters, stored the way the kernels read them fastest.

Matrices are kept transposed, [in, out] and contiguous, and applied as `x @ W`: a decoding step is a
matrix-vector product bound by reading the weights, and on this kind of CPU that layout reads
them ~25% faster than nn.Linear's [out, in] on one thread, and ~30% faster again when split into one
column block per thread (`linear`). bench/decode_floor.py measures every layout: on 2 threads the fastest
pass is [out, in] split into row blocks (16.7 vs 23.4 ms over SmolLM2), so this layout is not yet the
floor; README "Performance" has the numbers. q/k/v and gate/up are fused
into one matrix each so a decoding step makes 4 matmuls per layer instead of 7.
Only slmviz/weights.py knows how HF names map onto these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerParams:
    ln1: torch.Tensor  # [d_model]  input_layernorm
    ln2: torch.Tensor  # [d_model]  post_attention_layernorm
    w_qkv: torch.Tensor  # [d_model, (h + 2g) * d_head]
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # [h * d_head, d_model]
    b_o: torch.Tensor | None
    w_gate_up: torch.Tensor  # [d_model, 2 * d_mlp]: gate columns first, then up
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # [d_mlp, d_model]
    b_down: torch.Tensor | None


@dataclass
class DecoderParams:
    embed: torch.Tensor  # [vocab, d_model]
    layers: list[LayerParams]
    ln_final: torch.Tensor  # [d_model]
    unembed: torch.Tensor  # [d_model, vocab]; a transposed copy of embed when embeddings are tied


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x @ w (+ b) for [in, out] weights. x: [pos, in] -> [pos, out].

    One row (a decoding step) is a matrix-vector product bound by reading w, and MKL runs it on one core
    however many threads torch has. So one row is multiplied by one column block of w per thread, as one
    batched matmul that torch spreads over its threads: ~30 % faster over SmolLM2's weights on 2 cores
    (bench/decode_floor.py) and bit-identical to `x @ w`, since every output is the same dot product.
    """
    blocks = _column_blocks(x, w)
    if blocks > 1:
        n_in, n_out = w.shape
        cols = w.view(n_in, blocks, n_out // blocks).transpose(0, 1)  # [in, out] -> [blocks, in, out/blocks]
        rows = x.expand(blocks, 1, n_in)  # [1, in] -> [blocks, 1, in] (no copy)
        out = torch.bmm(rows, cols) if b is None else torch.baddbmm(b.view(blocks, 1, -1), rows, cols)
        return out.view(1, n_out)  # [blocks, 1, out/blocks] -> [1, out]: the blocks in column order
    return torch.addmm(b, x, w) if b is not None else x @ w


_MIN_SPLIT = 1 << 16  # below ~256 KB of weights one core's read is too short to be worth the extra ops


def _column_blocks(x: torch.Tensor, w: torch.Tensor) -> int:
    """How many column blocks `linear` splits a one-row product into: one per thread, 1 = no split."""
    if x.shape[0] != 1 or not w.is_contiguous() or w.numel() < _MIN_SPLIT:
        return 1
    threads = torch.get_num_threads()
    n_out = w.shape[1]
    return next((k for k in range(threads, 1, -1) if n_out % k == 0), 1)
