"""What bf16 costs against fp32, and what it buys, on both bundled models (slmviz.load(dtype="bfloat16")).

Also SmolLM2's greedy generation in bf16 against transformers' in bf16, and its decoding steps against the
weight-read floor of its bf16 weights (the floor in the dtype being run).

Accuracy (the model's own fp32 run is the reference; transformers' bf16 gives the same numbers bit for bit,
tests/test_dtype.py): KL(fp32 ‖ bf16) of the next-token distribution, top-1 agreement, and the residual
stream's relative error, over a 128-token passage and `slmviz check`'s three prompts. Speed, on this CPU: the
issue's GEMM row ([1024, 576] × [576, 1536] through F.linear, fp32 vs bf16) and a 128-token full trace and
capture-off forward in bf16 ÷ fp32, interleaved.

    .venv/bin/python bench/perf/dtype.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import GENERATE_PROMPT, Row, interleaved, main, median, per_step, prompt_ids, spread

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


def generate_rows(repeats: int, n: int = 48) -> list[Row]:
    """SmolLM2 in bf16: greedy generate ÷ transformers' bf16 generate, and the decoding steps ÷ the bf16
    weight-read floor (bench/perf/decode_floor.py's passes over the bf16 weights: half the bytes of fp32's)."""
    from decode_floor import floor_passes, floor_seconds

    from slmviz.loading.reference import load_reference

    model = slmviz.load(dtype="bfloat16")
    hf = load_reference(model.path, "sdpa", dtype=torch.bfloat16)
    ids = model.encode(GENERATE_PROMPT, chat=True)
    steps: list[float] = []

    def ours() -> list[int]:
        stamps, tokens = [], []
        for step in model.stream(ids, n, stop_at_eos=False):
            stamps.append(time.perf_counter())
            tokens.append(step.token_id)
        steps.append(per_step(stamps))
        return tokens

    def theirs() -> list[int]:
        out = hf.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=hf.config.eos_token_id)
        return out[0, ids.numel():].tolist()

    with torch.inference_mode():
        same = ours() == theirs()
    steps.clear()
    passes = floor_passes(model.decoder.params)
    times: dict[str, list[float]] = {"slmviz": [], "transformers": []}
    floor_times: dict[str, list[float]] = {name: [] for name in passes}
    interleaved(passes, warmup=1, repeats=0)
    for _ in range(repeats):
        interleaved({"slmviz": ours, "transformers": theirs}, warmup=0, repeats=1, into=times)
        interleaved(passes, warmup=0, repeats=2, into=floor_times)
    a, b = n / median(times["slmviz"]), n / median(times["transformers"])
    layout, floor = floor_seconds(floor_times)
    decode = 1 / median(steps)
    return [
        Row(f"bf16 greedy generate, {n} new tokens: tokens/s ÷ transformers bf16 generate", f"{a:.1f} tok/s",
            f"{b:.1f} tok/s", a / b, "≥ 1.5", a / b >= 1.5,
            f"SmolLM2 in bf16 on both sides; {'same tokens' if same else 'TOKENS DIFFER'}; spread slmviz "
            f"{spread(times['slmviz'])}, transformers {spread(times['transformers'])}"),
        Row(f"bf16 greedy generate, {n} new tokens: decoding steps alone, tokens/s ÷ bf16 weight-read floor",
            f"{decode:.1f} tok/s", f"{1 / floor:.1f} tok/s ({floor * 1e3:.1f} ms/pass)", decode * floor, "≥ 0.85",
            decode * floor >= 0.85,
            f"floor over the bf16 weights (269 MB), layout {layout}; every layout: "
            + ", ".join(f"{k} {median(v) * 1e3:.1f} ms" for k, v in floor_times.items())),
    ]


def run(args: argparse.Namespace) -> list[Row]:
    rows = gemm_rows(args.repeats) + generate_rows(max(3, args.repeats // 2))
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
