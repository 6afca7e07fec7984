"""The decoder's parameters, stored the way the kernels read them fastest.

Matrices are kept transposed, [in, out] and contiguous, and applied as `x @ W`: a decoding step is a
matrix-vector product bound by reading the weights, and on this kind of CPU that layout reads
them ~20% faster than nn.Linear's [out, in] (see bench/decode_floor.py). q/k/v and gate/up are fused
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
    """x @ w (+ b) for [in, out] weights. x: [pos, in] -> [pos, out]."""
    return torch.addmm(b, x, w) if b is not None else x @ w
