"""What bf16 costs against fp32, and what it buys, on both bundled models (slmviz.load(dtype="bfloat16")).

Accuracy (the model's own fp32 run is the reference; transformers' bf16 gives the same numbers bit for bit,
tests/test_dtype.py): KL(fp32 ‖ bf16) of the next-token distribution, top-1 agreement, and the residual
stream's relative error, over a 128-token passage and `slmviz check`'s three prompts. Speed, on this CPU: the
issue's GEMM row ([1024, 576] × [576, 1536] through F.linear, fp32 vs bf16) and a 128-token full trace and
capture-off forward in bf16 ÷ fp32, interleaved.

    .venv/bin/python bench/dtype.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from common import Row, interleaved, main, median, prompt_ids, spread

import slmviz
from slmviz.analysis.diff import kl_per_position, relative_difference
from slmviz.cli import CHECK_PROMPTS
from slmviz.loading.reference import relative_error

MODELS = {"SmolLM2-135M-Instruct": "SmolLM2", "gemma-3-270m": "Gemma 3 270M"}


def gemm_rows(repeats: int) -> list[Row]:
    """The issue's GEMM row: F.linear of a [1024, 576] activation by a [1536, 576] weight, fp32 vs bf16."""
    torch.manual_seed(0)
    x, w = torch.randn(1024, 576), torch.randn(1536, 576)
    xb, wb = x.bfloat16(), w.bfloat16()
    t = interleaved({"fp32": lambda: F.linear(x, w), "bf16": lambda: F.linear(xb, wb)}, warmup=3,
                    repeats=max(repeats, 15))
    flop = 2 * 1024 * 576 * 1536
    fp32, bf16 = flop / median(t["fp32"]) / 1e9, flop / median(t["bf16"]) / 1e9
    return [Row(
        "matrix multiply [1024, 576] × [576, 1536], F.linear: bf16 GFLOP/s ÷ fp32 GFLOP/s",
        f"{bf16:.0f} GFLOP/s (bf16)", f"{fp32:.0f} GFLOP/s (fp32)", bf16 / fp32, "(recorded: decides bf16's use)",
        None, f"spread fp32 {spread(t['fp32'])}, bf16 {spread(t['bf16'])}; slmviz measures its own smaller product "
        "once per process (params.bf16_matmul_slowdown) to warn where bf16 is slow",
    )]


def accuracy(fp32: slmviz.Model, bf16: slmviz.Model, prompts: list[torch.Tensor]) -> dict[str, float]:
    """KL(fp32 ‖ bf16) mean and max over positions, top-1 agreement, and the residual errors, over all prompts."""
    kls, agree, n = [], 0, 0
    tensor_err, position_err = 0.0, []
    names = lambda name: name.endswith("hook_resid_post")  # noqa: E731
    for ids in prompts:
        a, b = fp32.trace(ids, names=names), bf16.trace(ids, names=names)
        kls.append(kl_per_position(a.logits, b.logits))
        agree += int((a.logits.argmax(-1) == b.logits.argmax(-1)).sum())
        n += ids.numel()
        for layer in range(fp32.cfg.n_layers):
            name = f"blocks.{layer}.hook_resid_post"
            tensor_err = max(tensor_err, relative_error(a[name], b[name]))
            position_err.append(relative_difference(a[name], b[name]))
    kl = torch.cat(kls)
    per_position = torch.cat(position_err)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "top1": agree / n, "resid_max": tensor_err,
            "resid_pos_median": float(per_position.median()), "resid_pos_max": float(per_position.max()),
            "positions": n}


def run(args: argparse.Namespace) -> list[Row]:
    rows = gemm_rows(args.repeats)
    for name, label in MODELS.items():
        fp32 = slmviz.load(name)
        bf16 = slmviz.load(name, dtype="bfloat16")
        ids = prompt_ids(fp32, 128)
        prompts = [ids] + [fp32.encode(p) for p in CHECK_PROMPTS]
        start = time.perf_counter()
        acc = accuracy(fp32, bf16, prompts)
        print(f"{label}: accuracy over {acc['positions']} positions in {time.perf_counter() - start:.0f} s", flush=True)
        where = f"{acc['positions']} positions: a 128-token passage and slmviz check's 3 prompts"
        rows += [
            Row(f"{label} bf16 vs fp32: KL(fp32 ‖ bf16) of the next token, mean over positions (nats)",
                f"{acc['kl_mean']:.2e}", "", acc["kl_mean"], "(recorded)", None,
                f"max over positions {acc['kl_max']:.2e}; {where}"),
            Row(f"{label} bf16 vs fp32: top-1 agreement", f"{acc['top1']:.1%}", "", acc["top1"], "(recorded)", None,
                where),
            Row(f"{label} bf16 vs fp32: largest residual error, max |Δ| ÷ max |x| over every layer's resid_post",
                f"{acc['resid_max']:.2e}", "", acc["resid_max"], "(recorded)", None,
                f"per position ‖Δ‖ ÷ ‖x‖: median {acc['resid_pos_median']:.2e}, max {acc['resid_pos_max']:.2e}; "
                f"{where}"),
        ]
        t = interleaved({
            "trace fp32": lambda m=fp32, x=ids: m.trace(x), "trace bf16": lambda m=bf16, x=ids: m.trace(x),
            "forward fp32": lambda m=fp32, x=ids: m.logits(x), "forward bf16": lambda m=bf16, x=ids: m.logits(x),
        }, warmup=1, repeats=args.repeats)
        for what in ("trace", "forward"):
            a, b = median(t[f"{what} fp32"]), median(t[f"{what} bf16"])
            title = "full trace (all hooks)" if what == "trace" else "capture-off forward (model.logits)"
            rows.append(Row(
                f"{label}: {title}, 128 tokens, bf16 ÷ fp32 time", f"{b:.3f} s", f"{a:.3f} s", b / a,
                "(recorded: < 1 where bf16 wins)", None,
                f"spread bf16 {spread(t[f'{what} bf16'])}, fp32 {spread(t[f'{what} fp32'])}",
            ))
    return rows


if __name__ == "__main__":
    main(run, __doc__, lambda p: p.set_defaults(repeats=5))
