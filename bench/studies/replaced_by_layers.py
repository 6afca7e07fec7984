"""Which layers' coders break the replacement model as a language model: evaluate_transcoders's every-MLP-replaced
run (CE-loss score, top-1 agreement) with only one group of a set's layers replaced at a time, on a held-out split.

A set whose graphs score well can still make a poor language model when every MLP is replaced at once (errors
compound layer after layer); this shows where. Nothing is asserted.

    .venv/bin/python bench/studies/replaced_by_layers.py plt --model gemma-3-270m --groups 6 --corpus chat --tokens 2048
    .venv/bin/python bench/studies/replaced_by_layers.py plt --model gemma-3-270m --only 0 17   # single layers
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first

import slmviz
from slmviz import TranscoderSet
from slmviz.corpora.named import resolve_corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("set", help="plt, or a per-layer set's folder")
    p.add_argument("--model", default=None)
    p.add_argument("--groups", type=int, default=6, help="layers per group")
    p.add_argument("--corpus", default="chat")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--only", type=int, nargs="+", default=None, help="just these layers, each alone (no groups)")
    args = p.parse_args()
    model = slmviz.load(args.model)
    ts = slmviz.load_transcoders(args.set, model=model)
    corpus = resolve_corpus(args.corpus, model, split="heldout")
    layers = ts.layers
    groups = [layers[i:i + args.groups] for i in range(0, len(layers), args.groups)]
    for group in [[L] for L in args.only] if args.only else [*groups, layers]:
        t = time.perf_counter()
        sub = TranscoderSet({L: ts.coder(L) for L in group}, name=f"{ts.name}[{group[0]}..{group[-1]}]")
        r = slmviz.evaluate_transcoders(sub, corpus, model=model, tokens=args.tokens, progress=False)["replaced"]
        row = {"model": model.name, "set": args.set, "corpus": args.corpus, "layers": [group[0], group[-1]],
               "ce_loss_score": round(r["ce_loss_score"], 4), "top1_agreement": round(r["top1_agreement"], 4),
               "targets": r["targets"], "seconds": round(time.perf_counter() - t, 1)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
