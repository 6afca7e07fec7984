"""Greedy generation side by side: slmviz `generate` vs transformers `generate`, 48 new tokens, plus the
weight-read floor (bench/decode_floor.py) measured in the same rounds.

tokens/s = 48 / wall time of the whole call (prompt prefill included) on both sides. The floor row
compares slmviz's tokens/s with 1 / floor, the rate of a decoder that did nothing but read its weights.

    .venv/bin/python bench/generate.py [--repeats 5] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import GENERATE_PROMPT, Row, interleaved, load_models, main, median, spread
from decode_floor import floor_passes, floor_seconds

SPEEDUP_TARGET = 1.5
FLOOR_TARGET = 0.85
FLOOR_PASSES_PER_ROUND = 3


def run(args: argparse.Namespace) -> list[Row]:
    model, refs = load_models("sdpa")  # transformers' default attention for generate
    hf = refs["sdpa"]
    n = args.new_tokens
    ids = model.encode(GENERATE_PROMPT, chat=True)

    def ours() -> list[int]:
        return model.generate_ids(ids, n, stop_at_eos=False)

    def theirs() -> list[int]:
        # min_new_tokens keeps transformers going past an EOS exactly like stop_at_eos=False does for slmviz.
        out = hf.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
        return out[0, ids.numel():].tolist()

    passes = floor_passes(model.decoder.params)
    times: dict[str, list[float]] = {"slmviz": [], "transformers": []}
    floor_times: dict[str, list[float]] = {name: [] for name in passes}
    with torch.inference_mode():
        same = ours() == theirs()  # also the warm-up
    interleaved(passes, warmup=1, repeats=0)
    for _ in range(args.repeats):
        interleaved({"slmviz": ours, "transformers": theirs}, warmup=0, repeats=1, into=times)
        interleaved(passes, warmup=0, repeats=FLOOR_PASSES_PER_ROUND, into=floor_times)

    ours_tps = n / median(times["slmviz"])
    ref_tps = n / median(times["transformers"])
    layout, floor = floor_seconds(floor_times)
    floor_tps = 1 / floor
    decode = _decode_only_rate(model, ids, n, args.repeats)
    agree = "same tokens as transformers" if same else "TOKENS DIFFER from transformers"
    return [
        Row(f"greedy generate, {n} new tokens: tokens/s ÷ transformers generate",
            f"{ours_tps:.1f} tok/s", f"{ref_tps:.1f} tok/s", ours_tps / ref_tps, f"≥ {SPEEDUP_TARGET}",
            ours_tps / ref_tps >= SPEEDUP_TARGET,
            f"prompt {ids.numel()} tokens (chat), prefill included; {agree}; spread slmviz "
            f"{spread(times['slmviz'])}, transformers {spread(times['transformers'])}"),
        Row(f"greedy generate, {n} new tokens: tokens/s ÷ weight-read floor",
            f"{ours_tps:.1f} tok/s", f"{floor_tps:.1f} tok/s ({floor * 1e3:.1f} ms/pass)",
            ours_tps / floor_tps, f"≥ {FLOOR_TARGET}", ours_tps / floor_tps >= FLOOR_TARGET,
            f"floor layout {layout}; decode steps alone (prefill excluded): {decode:.1f} tok/s = "
            f"{decode / floor_tps:.0%} of floor; every layout: " + ", ".join(
                f"{name} {median(ts) * 1e3:.1f} ms" for name, ts in floor_times.items())),
    ]


def _decode_only_rate(model, ids: torch.Tensor, n: int, repeats: int) -> float:
    """tokens/s of the cached decoding steps alone: time from the first yielded token to the last."""
    rates = []
    for _ in range(repeats):
        stamps = [time.perf_counter() for _ in model.stream(ids, n, stop_at_eos=False)]
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return median(rates)


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=48)


if __name__ == "__main__":
    main(run, __doc__, _args)
