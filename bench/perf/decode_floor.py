"""The weight-read floor of decoding: the fastest bare matrix-vector pass over every weight matrix.

A greedy decoding step multiplies one activation row by every matrix of the model (q|k|v, o, gate|up,
down per layer, then the unembedding), so it reads all ~538 MB of fp32 weights once; on a CPU that read,
not arithmetic, bounds it. This script times exactly those products and nothing else, in the layouts a
decoder could store them in, and reports the fastest as the floor: no decoder on this machine and in
this precision can step faster. slmviz stores weights in the fastest layout found here ([out, in]) and
multiplies them the fastest way found here (slmviz/model/params.py: `linear`, row blocks).

    .venv/bin/python bench/perf/decode_floor.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, interleaved, main, median

Pass = Callable[[], None]


def weight_matrices(params) -> list[torch.Tensor]:
    """Every matrix a decoding step reads, as slmviz stores them: [out, in], contiguous."""
    mats = [w for lp in params.layers for w in (lp.w_qkv, lp.w_o, lp.w_gate_up, lp.w_down)]
    return mats + [params.unembed]


def floor_passes(params) -> dict[str, Pass]:
    """One bare matrix-vector pass over all weights per layout. The [in, out] copies are made once here."""
    out_in = weight_matrices(params)
    in_out = [w.t().contiguous() for w in out_in]
    rows = {w.shape[0]: torch.ones(1, w.shape[0], dtype=w.dtype) for w in in_out}  # the weights' dtype (bf16 too)
    vecs = {n: r[0] for n, r in rows.items()}

    def x_at_w() -> None:  # x [1, in] @ W [in, out]
        for w in in_out:
            torch.matmul(rows[w.shape[0]], w)

    def linear() -> None:  # what nn.Linear does: x @ W.T with W [out, in]
        for w in out_in:
            F.linear(rows[w.shape[1]], w)

    def mv() -> None:  # a plain gemv on [out, in]
        for w in out_in:
            torch.mv(w, vecs[w.shape[1]])

    # One block of W per thread, as one batched matmul that torch spreads over its threads (MKL runs a
    # single matrix-vector product on one core however many threads there are).
    threads = torch.get_num_threads()
    col_blocks = [(w, w.view(w.shape[0], threads, -1).transpose(0, 1)) for w in in_out
                  if w.shape[1] % threads == 0]
    row_blocks = [(w, w.view(threads, -1, w.shape[1])) for w in out_in if w.shape[0] % threads == 0]

    def x_at_w_blocks() -> None:  # [in, out] split into one column block per thread
        for w, cols in col_blocks:
            torch.bmm(rows[w.shape[0]].expand(threads, 1, -1), cols)

    def w_at_x_blocks() -> None:  # what slmviz does: [out, in], one row block per thread streams its rows
        for w, blocks in row_blocks:
            torch.bmm(blocks, rows[w.shape[1]].t().expand(threads, -1, 1))

    passes = {"x @ W, W [in, out]": x_at_w, "F.linear, W [out, in]": linear, "torch.mv, W [out, in]": mv}
    if threads > 1 and len(col_blocks) == len(row_blocks) == len(in_out):
        passes[f"x @ W, W [in, out], {threads} column blocks (bmm)"] = x_at_w_blocks
        passes[f"W @ x, W [out, in], {threads} row blocks (bmm)"] = w_at_x_blocks
    return passes


def floor_seconds(times: dict[str, list[float]]) -> tuple[str, float]:
    """(layout, median seconds) of the fastest layout."""
    best = min(times, key=lambda name: median(times[name]))
    return best, median(times[best])


def run(args: argparse.Namespace) -> list[Row]:
    import slmviz

    params = slmviz.load().decoder.params
    mb = sum(w.numel() * w.element_size() for w in weight_matrices(params)) / 1e6
    passes = floor_passes(params)
    times = interleaved(passes, warmup=2, repeats=args.repeats)
    for name, ts in times.items():
        print(f"  {name:24s} {median(ts) * 1e3:6.1f} ms per pass over {mb:.0f} MB "
              f"({mb / 1e3 / median(ts):.1f} GB/s)")
    layout, seconds = floor_seconds(times)
    return [Row(
        "weight-read floor: fastest bare matrix-vector pass over all weights",
        f"{seconds * 1e3:.1f} ms", "", None, "(reference figure)", None,
        f"{layout}; = {1 / seconds:.1f} tokens/s at most; " + ", ".join(
            f"{name}: {median(ts) * 1e3:.1f} ms" for name, ts in times.items()),
    )]


if __name__ == "__main__":
    main(run, __doc__)
