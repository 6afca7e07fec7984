"""The sparse decoder's backward, two ways, to place features.train.DENSE_BACKWARD_DENSITY on this CPU.

decode_sparse (every coder's training step: the decoder, and the aux loss's dead-feature decoder) sums the active
rows of W_dec with an embedding bag. Its gradient can come from the bag's own backward (a sort of the feature
indices, then an accumulation) or from two dense products (codes.T @ grad and (grad @ W_dec.T)[rows, feats]).
This times a forward + backward of each, interleaved, over widths and active entries per row, on the shapes of a
training step (512 rows, d_out 576: SmolLM2). A ratio > 1 means the dense backward is faster. The density column
is nnz / (rows * d_sae); decode_sparse multiplies densely from DENSE_BACKWARD_DENSITY up.

    .venv/bin/python bench/decode_backward.py [--repeats 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import Row, interleaved, main, median

from slmviz.features import train

ROWS, D_OUT = 512, 576
CASES = [(4096, 64), (4096, 288), (16384, 64), (16384, 288), (65536, 64), (65536, 288)]  # (d_sae, active per row)


def case(d_sae: int, per_row: int, repeats: int) -> Row:
    g = torch.Generator().manual_seed(0)
    W_dec = torch.randn(d_sae, D_OUT, generator=g).requires_grad_()
    feats = torch.rand(ROWS, d_sae, generator=g).topk(per_row, dim=-1).indices.reshape(-1)
    rows = torch.arange(ROWS).repeat_interleave(per_row)
    values = torch.rand(feats.numel(), generator=g).requires_grad_()
    offsets = torch.searchsorted(rows, torch.arange(ROWS))
    grad = torch.randn(ROWS, D_OUT, generator=g)

    def bag() -> None:
        with torch.inference_mode(False):
            F.embedding_bag(feats, W_dec, offsets, mode="sum", per_sample_weights=values).backward(grad)

    def dense() -> None:
        with torch.inference_mode(False):
            old, train.DENSE_BACKWARD_DENSITY = train.DENSE_BACKWARD_DENSITY, 0.0
            try:
                train.decode_sparse(rows, feats, values, W_dec, ROWS).backward(grad)
            finally:
                train.DENSE_BACKWARD_DENSITY = old

    t = interleaved({"bag": bag, "dense": dense}, warmup=2, repeats=repeats)
    density = feats.numel() / (ROWS * d_sae)
    chosen = "dense" if density >= train.DENSE_BACKWARD_DENSITY else "bag"
    ratio = median(t["bag"]) / median(t["dense"])
    return Row(f"decoder f+b, d_sae {d_sae}, {per_row} per row (density {density:.4f}), bag / dense",
               f"{median(t['dense']) * 1e3:.1f} ms dense", f"{median(t['bag']) * 1e3:.1f} ms bag", ratio,
               f"decode_sparse uses {chosen}", (ratio >= 1) == (chosen == "dense"))


def run(args: argparse.Namespace) -> list[Row]:
    return [case(d_sae, per_row, args.repeats) for d_sae, per_row in CASES]


if __name__ == "__main__":
    main(run, __doc__)
