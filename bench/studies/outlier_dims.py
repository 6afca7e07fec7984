"""How much of a per-layer set's MLP-output variance sits in a few dimensions, and its EV without them.

Gemma 3 270M's set explains almost all of layer 0's variance on chat text, yet replacing that one layer costs top-1
agreement (bench/studies/replaced_by_layers.py). This prints, per layer: the share of the variance in the top-N
dimensions, EV over all dimensions, EV over the rest, and EV with every dimension weighted equally (1 - mean of
err/var). Rows: the first position of each document dropped (the attention sink). Nothing is asserted.

    .venv/bin/python bench/studies/outlier_dims.py plt --model gemma-3-270m --layers 0 15 --corpus chat --docs 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first

import slmviz
from slmviz.corpora.named import resolve_corpus
from slmviz.corpora.reading import iter_documents


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("set", help="plt, or a per-layer set's folder")
    p.add_argument("--model", default=None)
    p.add_argument("--layers", type=int, nargs="+", default=[0])
    p.add_argument("--corpus", default="chat")
    p.add_argument("--docs", type=int, default=20, help="held-out documents, each cut to 400 characters")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()
    model = slmviz.load(args.model)
    ts = slmviz.load_transcoders(args.set, model=model)
    docs = [d[:400] for d in iter_documents(resolve_corpus(args.corpus, model, split="heldout"), limit=args.docs)]
    for L in args.layers:
        ys, y_hats = [], []
        for doc in docs:
            t = model.trace(doc, names=[ts.read_hook(L), ts.write_hook(L)])
            x, y = t[ts.read_hook(L)].reshape(-1, ts.d_model), t[ts.write_hook(L)].reshape(-1, ts.d_model)
            y_hats.append(ts.reconstruct(L, {L: ts.encode(L, x)}, {L: x})[1:].float())
            ys.append(y[1:].float())
        y, y_hat = torch.cat(ys), torch.cat(y_hats)
        var, err = y.var(0), (y - y_hat).pow(2).mean(0)
        top = var.argsort(descending=True)
        rest = top[args.top:]
        print(json.dumps({"model": model.name, "layer": L, "corpus": args.corpus, "rows": len(y),
                          f"top{args.top}_dims": top[:args.top].tolist(),
                          f"top{args.top}_variance_share": round(float(var[top[:args.top]].sum() / var.sum()), 4),
                          "ev": round(float(1 - err.sum() / var.sum()), 4),
                          "ev_without_top": round(float(1 - err[rest].sum() / var[rest].sum()), 4),
                          "ev_dims_equal": round(float(1 - (err / var).mean()), 4)}), flush=True)


if __name__ == "__main__":
    main()
