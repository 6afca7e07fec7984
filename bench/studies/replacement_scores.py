"""How well a replacement model explains SmolLM2 (or Gemma 3 270M): circuit-tracer's graph scores on 20 fixed prompts,
and what bounds them.

For each replacement model named (`bundled`: the two bundled transcoders; `plt` / `clt`: the model's prepared set;
or a set's folder), on PROMPTS (factual recall, IOI, induction, two-digit arithmetic, two-hop recall; 4 each):
- the unpruned graph's replacement and completeness scores (AttributionGraph.scores(), circuit-tracer's
  compute_graph_scores), median and range, the graph's time, and its mean token-to-logit path length
  (AttributionGraph.mean_path_length: Ameisen et al. compare it between a CLT and PLTs);
- each layer's error nodes' share of the influence on the logits (what bounds the replacement score);
- with --evaluate: evaluate_transcoders on the held-out splits of the broad and chat corpora: per-layer EV, L0 and
  dead fraction, and the model with every MLP replaced at once (CE-loss score, top-1 agreement).
Prints a JSON report and, with --out, writes it (into the file's report when there is one: a set run again replaces
its own entry, keeping its held-out figures unless --evaluate measures them again). Nothing is asserted.

    .venv/bin/python bench/studies/replacement_scores.py bundled plt [--model gemma-3-270m] [--out FILE]
        [--evaluate [--no-graphs]]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first

import slmviz
from slmviz.graphs.prune import RowNormalizedAbs, compute_influence

PROMPTS = {
    "factual": ["The capital of France is", "The Eiffel Tower is in the city of", "Water is made of hydrogen and",
                "The largest planet in the solar system is"],
    "ioi": ["When Mary and John went to the store, John gave a drink to",
            "After Tom and Anna arrived at the party, Anna handed a gift to",
            "When Sarah and David met at the park, David threw the ball to",
            "Then, Lucy and Mark had a long talk, and Mark gave the book to"],
    "induction": ["The code is 7 3 9 1 5. Again, the code is 7 3 9", "apple kiwi plum fig apple kiwi",
                  "Dursley Potter Granger Dursley Potter", "red blue green red blue"],
    "arithmetic": ["23 + 14 =", "45 + 21 =", "36 + 52 =", "17 + 61 ="],
    "two_hop": ["The capital of the state containing Dallas is",
                "The currency of the country whose capital is Paris is",
                "The language spoken in the country whose capital is Madrid is",
                "The continent of the country containing Tokyo is"],
}


def replacement(name: str, model) -> object:
    if name == "bundled":
        return [slmviz.load_sae(n, model=model) for n in slmviz.bundled_saes(model) if n.startswith("transcoder")]
    return slmviz.load_transcoders(name, model=model)


def graph_report(model, transcoders, max_feature_nodes: int | None, log: Path | None = None,
                 memory_budget_gb: float = 16) -> dict:
    """Every prompt's graph scores and per-layer error share; with `log`, each prompt's row is appended to that jsonl
    as it finishes and a rerun skips the prompts already there (an unpruned graph over a full set takes minutes on a
    2-core CPU, so a run may span sessions)."""
    done = {}
    if log is not None and log.exists():
        done = {r["prompt"]: r for r in map(json.loads, log.read_text().splitlines()) if r}
    rows = []
    for task, prompts in PROMPTS.items():
        for prompt in prompts:
            if prompt in done and "path_length" in done[prompt]:  # a row from before path lengths: run again
                rows.append(done[prompt])
                continue
            t = time.perf_counter()
            g = slmviz.attribution_graph(prompt, transcoders=transcoders, model=model, progress=False,
                                         max_feature_nodes=max_feature_nodes, memory_budget_gb=memory_budget_gb)
            seconds = time.perf_counter() - t
            scores = g.scores()
            kinds = g.nodes["kind"].to_numpy()
            w = torch.zeros(len(kinds))
            w[kinds == "logit"] = g.logit_probabilities.float()
            influence = compute_influence(RowNormalizedAbs(g.adjacency), w)  # no copy of a ~10 GB adjacency
            total = float(influence[(kinds == "error") | (kinds == "embedding") | (kinds == "feature")].sum())
            layer = g.nodes["layer"].to_numpy()
            share = [float(influence[torch.from_numpy((kinds == "error") & (layer == L))].sum()) / max(total, 1e-12)
                     for L in range(model.cfg.n_layers)]
            path_length = g.mean_path_length()
            row = {"task": task, "prompt": prompt, "features": g.n_features, "nodes": len(g.nodes),
                   "seconds": round(seconds, 2), "scoring_seconds": round(time.perf_counter() - t - seconds, 2),
                   **{k: round(v, 4) for k, v in scores.items()}, "path_length": round(path_length, 3),
                   "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                   "error_share": [round(x, 4) for x in share]}
            del g, influence  # the next prompt's adjacency must not sit beside this one's
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "error_share"}), flush=True)
            if log is not None:
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    reps = [r["replacement"] for r in rows]
    comps = [r["completeness"] for r in rows]
    error_share = torch.tensor([r["error_share"] for r in rows]).mean(0)
    return {"median_replacement": statistics.median(reps), "range_replacement": [min(reps), max(reps)],
            "median_completeness": statistics.median(comps), "range_completeness": [min(comps), max(comps)],
            "median_seconds": statistics.median(r["seconds"] for r in rows),
            "median_path_length": statistics.median(r["path_length"] for r in rows),
            "error_share_by_layer": [round(float(x), 4) for x in error_share], "prompts": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sets", nargs="+", help="bundled | plt | clt | a set's folder")
    p.add_argument("--model", default=None)
    p.add_argument("--max-feature-nodes", type=int, default=None)
    p.add_argument("--memory-budget-gb", type=float, default=16,
                   help="each unpruned graph's budget (a narrow set fires more distinct features: the quick set's "
                        "26-token induction prompt's graph has about 55k nodes)")
    p.add_argument("--evaluate", action="store_true", help="also evaluate_transcoders on the held-out splits")
    p.add_argument("--tokens", type=int, default=20_000, help="held-out tokens per corpus for --evaluate")
    p.add_argument("--no-graphs", action="store_true",
                   help="with --evaluate: only the held-out evaluation, keeping the set's graph figures in --out")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--log", type=Path, default=None,
                   help="a folder: each set's finished prompts go to LOG/<set>.jsonl, and a rerun skips them")
    args = p.parse_args()
    model = slmviz.load(args.model)
    report = {"model": model.name, "sets": {}}
    if args.out and args.out.exists():
        report = json.loads(args.out.read_text())
        if report.get("model") != model.name:
            raise SystemExit(f"{args.out} reports {report.get('model')}, not {model.name}: pick another --out")
    for name in args.sets:
        tcs = replacement(name, model)
        log = None
        if args.log is not None:
            args.log.mkdir(parents=True, exist_ok=True)
            log = args.log / f"{Path(name).name}-{args.max_feature_nodes or 'all'}.jsonl"
        entry = {} if args.no_graphs else graph_report(model, tcs, args.max_feature_nodes, log, args.memory_budget_gb)
        if args.evaluate and name != "bundled":
            from slmviz.corpora.named import resolve_corpus

            for corpus in ("broad", "chat"):
                r = slmviz.evaluate_transcoders(tcs, resolve_corpus(corpus, model, split="heldout"), model=model,
                                                tokens=args.tokens, progress=False)
                entry[f"heldout_{corpus}"] = {"layers": r["layers"].round(4).to_dict("records"),
                                              "replaced": r["replaced"]}
        old = report["sets"].get(name, {})
        kept = old if args.no_graphs else {k: v for k, v in old.items() if k.startswith("heldout_")}
        report["sets"][name] = {**kept, **entry}
        print(json.dumps({name: {k: v for k, v in entry.items() if k != "prompts"}}, indent=1), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
