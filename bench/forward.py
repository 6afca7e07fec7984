"""Forward passes side by side: full-capture trace vs transformers eager with attentions + hidden states,
and the capture-off forward (`model.logits`) vs transformers sdpa, on the same token ids.

    .venv/bin/python bench/forward.py [--repeats 7]
"""

from __future__ import annotations

import argparse

from common import Row, interleaved, load_models, main, median, prompt_ids, spread

TRACE_TARGET = 1.0
LOGITS_TARGET = 1.05


def _all_but_result(name: str) -> bool:
    return not name.endswith("attn.hook_result")


def run(args: argparse.Namespace) -> list[Row]:
    model, refs = load_models("eager", "sdpa")
    eager, sdpa = refs["eager"], refs["sdpa"]
    rows = []

    ids = prompt_ids(model, 128)
    n_hooks = len(model.hook_names)
    t = interleaved({
        "slmviz": lambda: model.trace(ids),
        "transformers": lambda: eager(ids[None], output_attentions=True, output_hidden_states=True),
        "without hook_result": lambda: model.trace(ids, names=_all_but_result),
    }, repeats=args.repeats)
    assert len(model.trace(ids).names) == n_hooks  # every hook really is captured
    ours, ref, no_result = median(t["slmviz"]), median(t["transformers"]), median(t["without hook_result"])
    rows.append(Row(
        f"trace, 128 tokens, all {n_hooks} hooks ÷ transformers eager + attentions + hidden states",
        f"{ours:.3f} s", f"{ref:.3f} s", ours / ref, f"≤ {TRACE_TARGET}", ours / ref <= TRACE_TARGET,
        f"spread slmviz {spread(t['slmviz'])}, transformers {spread(t['transformers'])}",
    ))
    rows.append(Row(
        "(evidence) the same trace without the 30 attn.hook_result ÷ the same transformers run",
        f"{no_result:.3f} s", f"{ref:.3f} s", no_result / ref, "(what bounds the row above)", None,
        "hook_result is a per-head matmul transformers never does, with o_proj's FLOPs (2·pos·d_model²)",
    ))

    for n in (128, 512):
        ids = prompt_ids(model, n)
        t = interleaved({
            "slmviz": lambda ids=ids: model.logits(ids),
            "transformers": lambda ids=ids: sdpa(ids[None]),
        }, repeats=args.repeats)
        ours, ref = median(t["slmviz"]), median(t["transformers"])
        rows.append(Row(
            f"forward, capture off (model.logits), {n} tokens ÷ transformers sdpa",
            f"{ours:.3f} s", f"{ref:.3f} s", ours / ref, f"≤ {LOGITS_TARGET}", ours / ref <= LOGITS_TARGET,
            f"spread slmviz {spread(t['slmviz'])}, transformers {spread(t['transformers'])}",
        ))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
