"""How long a prepared set's recipe takes with the trainer as it is now, trained into a folder of its own (the
prepared set in $SLMVIZ_CACHE is left alone), and what the result scores on held-out text.

It runs exactly what `slmviz prepare --transcoders KIND` runs (training.prepare.recipe on the "mixed" corpus,
train_transcoders) and prints the wall time of the train_transcoders call, then the held-out evaluation of the set
(per-layer EV, L0, dead fraction; every layer replaced at once). Resumable: run it again with the same --out after
a stop, and it continues (the time printed is then that of the last leg only, so the log keeps each leg's).

    .venv/bin/python bench/studies/train_recipe.py plt --out /work/plt_recipe [--model SmolLM2-135M-Instruct]
        [--eval-tokens 10000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import cpu_model, load_average

import slmviz
from slmviz.corpora.named import resolve_corpus
from slmviz.training.prepare import CORPUS, recipe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["plt", "clt"])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None)
    p.add_argument("--eval-tokens", type=int, default=10_000)
    args = p.parse_args()
    model = slmviz.load(args.model) if args.model else slmviz.load()
    kw = recipe(model, args.kind)
    corpus = kw.pop("corpus", CORPUS)
    print(f"{cpu_model()}, load average {load_average()}; {model.name} {args.kind}: {kw}", flush=True)
    start = time.perf_counter()
    ts = slmviz.train_transcoders(model, layers="all", corpus=resolve_corpus(corpus, model), kind=args.kind,
                                  out=args.out, **kw)
    print(f"train_transcoders: {time.perf_counter() - start:.0f} s", flush=True)
    for split in ("broad", "chat"):
        r = slmviz.evaluate_transcoders(ts, resolve_corpus(split, model, split="heldout"), model=model,
                                        tokens=args.eval_tokens, progress=False)
        layers = r["layers"]
        print(json.dumps({"heldout": split, "median_ev": round(float(layers["explained_variance"].median()), 4),
                          "worst_ev": round(float(layers["explained_variance"].min()), 4),
                          "median_l0": round(float(layers["l0"].median()), 1),
                          "max_dead": round(float(layers["frac_dead"].max()), 4),
                          "ce_loss_score": round(r["replaced"]["ce_loss_score"], 4),
                          "top1_agreement": round(r["replaced"]["top1_agreement"], 4)}), flush=True)


if __name__ == "__main__":
    main()
