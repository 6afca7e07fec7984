"""The longest prompt an attribution graph over SmolLM2's full prepared PLT set (or, with `--kind clt`, its CLT)
admits: by the memory budget's own estimate (slmviz.graphs.attribution.graph_memory_bytes), for the default budget
and for 24 GB, and checked by a run at the default budget.

What grows with a prompt's length: every position activates about L0 features at each of the 30 layers, and while
the `max_feature_nodes` most influential are chosen, the rows of the kept features are held over *every* active
feature (circuit-tracer's design too: its issue #92 runs out at ~2.3k tokens on 80 GB). So the budget allows
(budget - fixed) / (4 bytes x (cap + logits) x active features per token) tokens, roughly.

The active features per token are counted on real text (the chat corpus's held-out split, its documents joined), as
the graph counts them: each layer's coder on the clean run's MLP inputs, position 0 (the special token, zeroed in the
graph) left out, with what the features' writes hold (a decoder row per distinct feature and layer it writes: a CLT
feature of layer L writes n_layers - L).
The estimate then uses the prefix's own count, 10 logits and batch_size 64 (attribution_graph's
defaults). The check: a graph at the longest length for the default budget (time, and the process's peak resident
set above what it held before), and one token more, which must be refused by the budget before any work.

    .venv/bin/python bench/studies/longest_prompt.py [--kind plt|clt] [--cap 4096] [--max-tokens 2048]
        [--out bench/results/longest_prompt.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import cpu_model, reset_peak, status_gb

import slmviz
from slmviz import CrossLayerTranscoder
from slmviz.corpora.named import resolve_corpus
from slmviz.corpora.reading import iter_documents
from slmviz.graphs.attribution import DEFAULT_MEMORY_BUDGET_GB, graph_memory_bytes, prepend_special, writes_values

GB = 2**30


def active_per_prefix(model, ts, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, values): count[n] = the active features of the graph of ids[:n] (positions 1..n-1, every layer), and
    values[n] = what its writes hold (attribution.Writes.values: a d_model row per distinct feature and layer it
    writes, one for a PLT feature and n_layers - L for a CLT feature of layer L, plus its indices)."""
    t = model.trace(ids, names=[c.hook_name for c in ts])
    n_pos, clt = len(ids), isinstance(ts, CrossLayerTranscoder)
    per_pos = torch.zeros(n_pos, dtype=torch.long)  # active features at each position
    writes_per_pos = torch.zeros(n_pos, dtype=torch.long)
    new_rows_per_pos = torch.zeros(n_pos, dtype=torch.long)  # table rows first needed at each position
    with torch.no_grad():
        for c in ts:
            x = t[c.hook_name].float()
            fired = (ts.encode(c.layer, x) if clt else c.encode(x)) != 0  # [pos, d_sae]
            fired[0] = False
            rows = model.cfg.n_layers - c.layer if clt else 1
            per_pos += fired.sum(-1)
            writes_per_pos += fired.sum(-1) * rows
            ever = fired.any(0)
            first = fired.int().argmax(0)[ever]  # the position each feature first fires at
            new_rows_per_pos += torch.bincount(first, minlength=n_pos) * rows
    zero = torch.zeros(1, dtype=torch.long)
    values = writes_values(new_rows_per_pos.cumsum(0), writes_per_pos.cumsum(0), model.cfg.d_model)
    return torch.cat([zero, per_pos.cumsum(0)]), torch.cat([zero, values])


def longest(counts: torch.Tensor, values: torch.Tensor, budget_gb: float, cap: int, cfg) -> int:
    """The largest n whose graph_memory_bytes fits the budget (counts is nondecreasing, so the first n over it ends
    the search)."""
    n_ok = 0
    for n in range(2, len(counts)):
        feat = int(counts[n])
        need = graph_memory_bytes(n, feat, 10, cap, 64, cfg, 4, True, int(values[n]))
        if need > budget_gb * GB:
            break
        n_ok = n
    return n_ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", choices=("plt", "clt"), default="plt", help="the prepared set to load")
    p.add_argument("--cap", type=int, default=4096, help="max_feature_nodes (the app's for a full set)")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--no-run", action="store_true", help="the estimates only")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = slmviz.load()
    ts = slmviz.load_transcoders(args.kind, model=model)
    text = ""
    for doc in iter_documents(resolve_corpus("chat", model, split="heldout"), limit=200):
        text += doc + "\n\n"
        if len(text) > 8 * args.max_tokens:  # enough for max_tokens (a token is ~4 characters), under the context
            break
    ids = prepend_special(model.tokenizer, model.encode(text))[: args.max_tokens]
    counts, values = active_per_prefix(model, ts, ids)
    per_token = float(counts[-1]) / (len(ids) - 1)
    report = {"cpu": cpu_model(), "set": f"{args.kind}: {len(ts)} x {ts.d_sae}", "cap": args.cap,
              "active_features_per_token": round(per_token, 1), "limits": {}}
    for budget in (DEFAULT_MEMORY_BUDGET_GB, 24 / 1.073741824):  # 24 GB, in GiB
        n = longest(counts, values, budget, args.cap, model.cfg)
        report["limits"][f"{budget:.2f} GiB"] = {
            "longest_tokens": n, "capped_at_text_length": n == len(ids) - 1,
            "estimate_gib": round(graph_memory_bytes(n, int(counts[n]), 10, args.cap, 64, model.cfg, 4, True,
                                                     int(values[n])) / GB, 2)}
    print(json.dumps(report, indent=1), flush=True)
    if not args.no_run:
        n = report["limits"][f"{DEFAULT_MEMORY_BUDGET_GB:.2f} GiB"]["longest_tokens"]
        before = reset_peak()
        t = time.perf_counter()
        g = slmviz.attribution_graph(ids[:n], transcoders=ts, model=model, max_feature_nodes=args.cap,
                                     progress=False)
        check = {"tokens": n, "seconds": round(time.perf_counter() - t, 1),
                 "peak_gb_above_before": round(status_gb("VmHWM") - before, 2),
                 "features_kept": g.n_features, **{k: round(v, 4) for k, v in g.scores().items()}}
        try:
            slmviz.attribution_graph(ids[:n + 1], transcoders=ts, model=model, max_feature_nodes=args.cap,
                                     progress=False)
            check["one_more_token"] = "built (the estimate's count differs by the logits: it assumed 10)"
        except slmviz.AttributionGraphError as e:
            check["one_more_token"] = f"refused: {e}"
        report["check_default_budget"] = check
        print(json.dumps(check, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
