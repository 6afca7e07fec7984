"""Greedy generation side by side: slmviz `generate` vs transformers `generate`, 48 new tokens, plus the
weight-read floor (bench/perf/decode_floor.py) measured in the same rounds.

tokens/s = 48 / wall time of the whole call (prompt prefill included) on both sides. The floor rows compare
slmviz with 1 / floor, the rate of a decoder that did nothing but read its weights: once for the whole
call, once for the decoding steps alone (the floor bounds those; the prefill is compute-bound). An
evidence row splits one decoding step into its weight matmuls and everything else. Each round runs
slmviz, transformers, an instrumented slmviz stream and the floor passes back to back, so a neighbour's
burst of work lands on every figure of that round.

    .venv/bin/python bench/perf/generate.py [--repeats 5] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import GENERATE_PROMPT, Row, decoding_step_split, interleaved, load_models, main, median, per_step, spread
from decode_floor import floor_passes, floor_seconds

SPEEDUP_TARGET = 1.5
FLOOR_TARGET = 0.85
FLOOR_PASSES_PER_ROUND = 3


def run(args: argparse.Namespace) -> list[Row]:
    model, refs = load_models("sdpa")  # transformers' default attention for generate
    hf = refs["sdpa"]
    n = args.new_tokens
    ids = model.encode(GENERATE_PROMPT, chat=True)
    step_seconds: list[float] = []  # per decoding step, from the timed slmviz calls themselves

    def ours() -> list[int]:
        tokens, stamps = [], []
        for step in model.stream(ids, n, stop_at_eos=False):
            stamps.append(time.perf_counter())
            tokens.append(step.token_id)
        step_seconds.append(per_step(stamps))
        return tokens

    def theirs() -> list[int]:
        # min_new_tokens keeps transformers going past an EOS exactly like stop_at_eos=False does for slmviz.
        out = hf.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
        return out[0, ids.numel():].tolist()

    passes = floor_passes(model.decoder.params)
    times: dict[str, list[float]] = {"slmviz": [], "transformers": []}
    floor_times: dict[str, list[float]] = {name: [] for name in passes}
    splits: list[tuple[float, float]] = []
    with torch.inference_mode():
        same = ours() == theirs()  # also the warm-up
    interleaved(passes, warmup=1, repeats=0)
    step_seconds.clear()
    for _ in range(args.repeats):
        interleaved({"slmviz": ours, "transformers": theirs}, warmup=0, repeats=1, into=times)
        splits.append(decoding_step_split(model, ids, n))
        interleaved(passes, warmup=0, repeats=FLOOR_PASSES_PER_ROUND, into=floor_times)

    ours_tps = n / median(times["slmviz"])
    ref_tps = n / median(times["transformers"])
    layout, floor = floor_seconds(floor_times)
    floor_tps = 1 / floor
    decode_tps = 1 / median(step_seconds)
    step, in_matmuls = median([s for s, _ in splits]), median([m for _, m in splits])
    agree = "same tokens as transformers" if same else "TOKENS DIFFER from transformers"
    layouts = ", ".join(f"{name} {median(ts) * 1e3:.1f} ms" for name, ts in floor_times.items())
    return [
        Row(f"greedy generate, {n} new tokens: tokens/s ÷ transformers generate",
            f"{ours_tps:.1f} tok/s", f"{ref_tps:.1f} tok/s", ours_tps / ref_tps, f"≥ {SPEEDUP_TARGET}",
            ours_tps / ref_tps >= SPEEDUP_TARGET,
            f"prompt {ids.numel()} tokens (chat), prefill included; {agree}; spread slmviz "
            f"{spread(times['slmviz'])}, transformers {spread(times['transformers'])}"),
        Row(f"greedy generate, {n} new tokens: tokens/s ÷ weight-read floor (whole call, prefill included)",
            f"{ours_tps:.1f} tok/s", f"{floor_tps:.1f} tok/s ({floor * 1e3:.1f} ms/pass)",
            ours_tps / floor_tps, f"≥ {FLOOR_TARGET}", ours_tps / floor_tps >= FLOOR_TARGET,
            f"floor layout {layout}; every layout: {layouts}"),
        Row(f"greedy generate, {n} new tokens: decoding steps alone, tokens/s ÷ weight-read floor",
            f"{decode_tps:.1f} tok/s", f"{floor_tps:.1f} tok/s", decode_tps / floor_tps, f"≥ {FLOOR_TARGET}",
            decode_tps / floor_tps >= FLOOR_TARGET,
            f"time from the first yielded token to the last, same calls as the row above; the rest of the whole "
            f"call, ≈ {median(times['slmviz']) - (n - 1) * median(step_seconds):.2f} s, is the prefill of "
            f"{ids.numel()} tokens and the first token"),
        Row("(evidence) one decoding step: its weight matmuls ÷ the floor pass; the rest is small ops",
            f"{step * 1e3:.1f} ms/step, of which matmuls {in_matmuls * 1e3:.1f} ms",
            f"{floor * 1e3:.1f} ms/pass", in_matmuls / floor, "(what bounds the rows above)", None,
            f"everything else (norms, RoPE, cache writes, attention, SwiGLU, residual adds, sampling: ~30 eager "
            f"PyTorch ops per layer): {(step - in_matmuls) * 1e3:.1f} ms/step; matmuls timed one by one "
            f"(perf_counter around each), so they carry the timer's own cost"),
    ]


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=48)


if __name__ == "__main__":
    main(run, __doc__, _args)
