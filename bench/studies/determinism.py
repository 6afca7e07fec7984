"""Is a prepared recipe's training repeatable? The same recipe trained twice, each in a fresh process, on the same
corpus file, then every saved tensor compared bit for bit.

    .venv/bin/python bench/studies/determinism.py [--recipe plt-quick] [--tokens 16384] [--corpus FILE]

Why: two builds of the quick set differed in every layer. Two causes were found and fixed in 0.3.0: the broad
corpus followed whatever was installed (corpora.broad.runtime_distributions, stable_order), and advanced indexing's
CPU backward summed repeated features' gradients in a run-dependent order (training.sparse.gather). --tokens below
the recipe's keeps the check to a minute or two; the default corpus is the recipe's own, prepared in $SLMVIZ_CACHE.
Prints one JSON line (and appends it to --out); nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first

WORKER = """
import sys, json, slmviz
from slmviz.corpora.named import resolve_corpus
from slmviz.training.prepare import RECIPES, TRAINED_AS
model, recipe, tokens, corpus, out = sys.argv[1:6]
m = slmviz.load(model)
kw = dict(RECIPES[(m.name, recipe)])
corpus = corpus if corpus != "-" else resolve_corpus(kw.pop("corpus", "mixed"), m)
kw.pop("corpus", None)
kw["tokens"] = int(tokens)
slmviz.train_transcoders(m, layers="all", kind=TRAINED_AS.get(recipe, recipe), out=out, progress=False,
                         corpus=corpus, **kw)
"""


def compare(a: Path, b: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors") if p.name != "checkpoint.safetensors")
    differ = []
    for rel in files:
        x, y = load_file(a / rel), load_file(b / rel)
        differ += [f"{rel}:{k}" for k in x if not x[k].equal(y[k])]
    return {"files": len(files), "tensors_differing": len(differ), "first_differing": differ[:5]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="SmolLM2-135M-Instruct")
    p.add_argument("--recipe", default="plt-quick")
    p.add_argument("--tokens", type=int, default=16_384)
    p.add_argument("--corpus", default="-", help="a corpus file (default: the recipe's own)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "determinism.jsonl")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [Path(tmp) / "a", Path(tmp) / "b"]
        t0 = time.perf_counter()
        for out in runs:
            subprocess.run([sys.executable, "-c", WORKER, args.model, args.recipe, str(args.tokens), args.corpus,
                            str(out)], check=True)
        row = {"model": args.model, "recipe": args.recipe, "tokens": args.tokens, **compare(*runs),
               "seconds": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M")}
    print(json.dumps(row), flush=True)
    with args.out.open("a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
