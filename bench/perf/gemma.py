"""Gemma 3 270M side by side with transformers: the same rows as SmolLM2's forward.py and generate.py
(full trace vs eager with attentions + hidden states, capture-off forward vs sdpa, greedy generate), plus
where a decoding step's time goes: Gemma's 262 144-row unembedding is 640 MB of fp32 read per token.

    .venv/bin/python bench/perf/gemma.py [--repeats 5] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import GENERATE_PROMPT, Row, decoding_step_split, interleaved, load_models, main, median, prompt_ids, spread

MODEL = "gemma-3-270m"


def run(args: argparse.Namespace) -> list[Row]:
    model, refs = load_models("eager", "sdpa", name=MODEL)
    eager, sdpa = refs["eager"], refs["sdpa"]
    rows = []
    with torch.inference_mode():
        ids = prompt_ids(model, 128)
        n_hooks = len(model.hook_names)
        t = interleaved({
            "slmviz": lambda: model.trace(ids),
            "transformers": lambda: eager(ids[None], output_attentions=True, output_hidden_states=True),
        }, repeats=args.repeats)
        ours, ref = median(t["slmviz"]), median(t["transformers"])
        rows.append(Row(f"Gemma 3 270M: trace, 128 tokens, all {n_hooks} hooks ÷ transformers eager + attentions "
                        "+ hidden states", f"{ours:.3f} s", f"{ref:.3f} s", ours / ref, "≤ 1.0", ours / ref <= 1.0,
                        f"spread slmviz {spread(t['slmviz'])}, transformers {spread(t['transformers'])}"))
        for n in (128, 512):
            ids = prompt_ids(model, n)
            t = interleaved({"slmviz": lambda ids=ids: model.logits(ids),
                             "transformers": lambda ids=ids: sdpa(ids[None])}, repeats=args.repeats)
            ours, ref = median(t["slmviz"]), median(t["transformers"])
            rows.append(Row(f"Gemma 3 270M: capture-off forward, {n} tokens ÷ transformers sdpa", f"{ours:.3f} s",
                            f"{ref:.3f} s", ours / ref, "≤ 1.05", ours / ref <= 1.05,
                            f"spread slmviz {spread(t['slmviz'])}, transformers {spread(t['transformers'])}"))
    rows += _generate_rows(model, sdpa, args)
    return rows


def _generate_rows(model, hf, args: argparse.Namespace) -> list[Row]:
    n = args.new_tokens
    ids = model.encode(GENERATE_PROMPT)  # the bundled Gemma 3 270M is the base model: no chat template

    def ours() -> list[int]:
        return model.generate_ids(ids, n, stop_at_eos=False)

    def theirs() -> list[int]:
        out = hf.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=hf.config.eos_token_id)
        return out[0, ids.numel():].tolist()

    with torch.inference_mode():
        same = ours() == theirs()
        t = interleaved({"slmviz": ours, "transformers": theirs}, warmup=0, repeats=args.repeats)
    ours_tps, ref_tps = n / median(t["slmviz"]), n / median(t["transformers"])
    unembedding = model.decoder.params.unembed
    step, unembed = decoding_step_split(model, ids, n, timed=lambda w: w is unembedding)
    unembed_bytes = model.decoder.params.unembed.numel() * model.decoder.params.unembed.element_size()
    return [
        Row(f"Gemma 3 270M: greedy generate, {n} new tokens: tokens/s ÷ transformers generate",
            f"{ours_tps:.1f} tok/s", f"{ref_tps:.1f} tok/s", ours_tps / ref_tps, "≥ 1.5", ours_tps / ref_tps >= 1.5,
            f"prompt {ids.numel()} tokens, prefill included; "
            f"{'same tokens as transformers' if same else 'TOKENS DIFFER from transformers'}"),
        Row("(evidence) Gemma 3 270M: one decoding step, of which the unembedding matmul",
            f"{step * 1e3:.1f} ms/step, unembedding {unembed * 1e3:.1f} ms", "", unembed / step,
            "(share of a step)", None,
            f"the tied [262144, 640] unembedding is {unembed_bytes / 2**20:.0f} MiB of fp32 read per token "
            f"(the 18 blocks' weights are {_block_bytes(model) / 2**20:.0f} MiB); one row-split pass over it"),
    ]


def _block_bytes(model) -> int:
    total = 0
    for layer in model.decoder.params.layers:
        total += sum(t.numel() * t.element_size() for t in vars(layer).values() if isinstance(t, torch.Tensor))
    return total


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=32)


if __name__ == "__main__":
    main(run, __doc__, _args)
