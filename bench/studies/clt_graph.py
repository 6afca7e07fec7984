"""Attribution-graph time and peak memory over a CLT against a PLT set on SmolLM2-135M-Instruct, same prompt.

    .venv/bin/python bench/studies/clt_graph.py [--tokens 16 64] [--k 8] [--d-sae 768]

Random coders at every layer, TopK with k active features per token and layer for both, so both graphs have the same
feature nodes and what differs is what a CLT adds: each feature of layer L writes n_layers - L decoder vectors,
whose edges the graph sums (a PLT feature writes one). The CLT reads mlp.hook_in, like the PLT. Each graph runs in a
fresh process (its peak RSS is its own); the prompt is the bundled model's text cut to `tokens` tokens after the
special token attribution_graph puts first. Reported: wall time, peak RSS, nodes. Nothing is asserted; the figures
go to --out (bench/results/clt_graph.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS

TEXT = ("The capital of France is Paris, and the capital of Italy is Rome. Paris is known for the Eiffel Tower, and "
        "Rome for the Colosseum. Many tourists visit both cities every year, travelling by train or by plane between "
        "them. The food in both countries is famous: French bread and cheese, Italian pasta and pizza. In the summer "
        "the weather is warm, and in the winter it is cold in the north and mild in the south of each country.")


def one(kind: str, tokens: int, k: int, d_sae: int) -> dict:
    import torch

    import slmviz
    from slmviz import SAE, CrossLayerTranscoder, TranscoderSet

    m = slmviz.load()
    n, d = m.cfg.n_layers, m.cfg.d_model
    ids = m.encode(TEXT)[: tokens - 1]
    if kind == "clt":
        coders = CrossLayerTranscoder.random(n, d, d_sae, architecture="topk", k=k, seed=0)
    else:
        hooks = [(f"blocks.{L}.mlp.hook_in", f"blocks.{L}.hook_mlp_out") for L in range(n)]
        coders = TranscoderSet([SAE.random(d, d_sae, seed=L, architecture="topk", k=k, hook_name=a, hook_name_out=b)
                                for L, (a, b) in enumerate(hooks)])
    torch.manual_seed(0)
    t = time.perf_counter()
    g = slmviz.attribution_graph(ids, transcoders=coders, model=m, progress=False, memory_budget_gb=16)
    wall = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"kind": kind, "tokens": len(g.input_ids), "wall_s": wall, "peak_rss_gb": rss, "nodes": len(g.nodes),
            "features": g.n_features}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--d-sae", type=int, default=768)
    ap.add_argument("--one", choices=["clt", "plt"])
    ap.add_argument("--out", default=str(RESULTS / "clt_graph.md"))
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.tokens[0], args.k, args.d_sae)))
        return
    rows = []
    for tokens in args.tokens:
        for kind in ("plt", "clt"):
            proc = subprocess.run([sys.executable, __file__, "--one", kind, "--tokens", str(tokens), "--k",
                                   str(args.k), "--d-sae", str(args.d_sae)], capture_output=True, text=True, check=True)
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            write(rows, args)  # after every graph: a long run stopped half way keeps what it measured


def write(rows: list[dict], args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    lines = ["# Attribution graphs over a CLT against a PLT set (SmolLM2-135M-Instruct)", "",
             f"Made by `bench/studies/clt_graph.py --tokens {' '.join(map(str, args.tokens))} --k {args.k}` on this "
             "machine's "
             f"CPU ({os.cpu_count()} cores, load average {load:.1f} at the last row: other work shared it): random "
             f"TopK coders at every layer, d_sae {args.d_sae}, k {args.k} (the same feature nodes for both), fp32.", "",
             "| prompt tokens | set | nodes | wall (s) | peak RSS (GB) |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['kind'].upper()} | {r['nodes']:,} | {r['wall_s']:.1f} | "
                     f"{r['peak_rss_gb']:.2f} |")
    lines.append("")
    text = "\n".join(lines)
    print(text, flush=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
