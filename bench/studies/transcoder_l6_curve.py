"""What bounds the bundled transcoder_l6 on modern prose: its explained variance against training tokens and against
width, each point trained with the shipped recipe on "balanced" (k 54, skip, BatchTopK) and evaluated on the three
texts bench/tools/bundle_sae.py uses.

    OMP_NUM_THREADS=2 .venv/bin/python bench/studies/transcoder_l6_curve.py \
        [--points 6144x300000 12288x300000 6144x1000000x128]

A point is WIDTHxTOKENS, or WIDTHxTOKENSxK for another k than the shipped 54 (the L0 lever). Each is a
`slmviz.train_sae` run in $SLMVIZ_CACHE/sae_runs/probe_l6_w{width}_{tokens}[_k{k}] (the shipped 6144 x 3M point
reads the run the bundled SAE came from): a finished run is read back, a missing one is trained (resumable; the
model's forward dominates a run's time, so 6144 and 12288 wide cost about the same). The evaluation is
encoding-only (no CE forwards, so it is short next to training): explained variance and L0 of the coder as
trained (fp32, not the fp16 of the bundled file) on bench/modern_prose.txt (all of it), and on the first 60
documents of the chat and broad held-out splits. On the shipped run it gives the prose and chat figures
bundle_sae.py records to three digits; broad's 60 documents are fewer than bundle_sae.py's held-out tokens, so its
figure differs slightly (results/transcoder_l6_curve.json).
Adds its points to bench/results/transcoder_l6_curve.json (a point measured again replaces its figures) and prints the
table of every point there.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import BENCH_DIR, RESULTS, markdown_table

import slmviz
from slmviz.corpora.reading import iter_documents
from slmviz.features.activations import sae_rows
from slmviz.features.evaluate import Totals
from slmviz.loading.bundled import cache_dir
from slmviz.training.cli import resolve_corpus

TEXTS = {"modern prose": str(BENCH_DIR / "modern_prose.txt"), "chat held-out": "chat-heldout",
         "broad held-out": "broad-heldout"}
DOCS = 60  # documents of each held-out split (prose: all 32)
SHIPPED = "smollm2_skip_transcoder_l6_k54_balanced"  # the run transcoder_l6 ships from: 6144 wide, 3M tokens
K = 54  # the shipped transcoder_l6's k
POINTS = ("6144x300000", "12288x300000", "6144x1000000", "12288x1000000", "6144x3000000", "6144x1000000x128")


def run_folder(width: int, tokens: int, k: int = K) -> Path:
    runs = cache_dir() / "sae_runs"
    if (width, tokens, k) == (6144, 3_000_000, K):
        return runs / SHIPPED
    return runs / (f"probe_l6_w{width}_{tokens}" + (f"_k{k}" if k != K else ""))


def train(model, width: int, tokens: int, k: int = K) -> object:
    """The shipped recipe (docs/features.md, "Bundled SAEs") at this width, length and k."""
    return slmviz.train_sae(model, "blocks.6.mlp.hook_in", resolve_corpus("balanced", model),
                            hook_out="blocks.6.hook_mlp_out",
                            architecture="batchtopk", skip=True, d_sae=width, k=k, tokens=tokens, lr=2e-3,
                            batch_tokens=512, dead_window=100_000, dtype="bfloat16", out=run_folder(width, tokens, k),
                            progress=False)


@torch.no_grad()
def encoding_metrics(model, sae, corpus: str) -> dict[str, float]:
    """EV and L0 (evaluate.Totals, evaluate_sae's formulas) over the rows evaluate_sae keeps (activations.sae_rows),
    one document per forward."""
    path = corpus if corpus.endswith(".txt") else resolve_corpus(corpus, model)
    totals = Totals(sae.d_out, sae.d_sae)
    for doc in itertools.islice(iter_documents(path), DOCS):
        t = model.trace(doc[:2000], names=[sae.hook_name, sae.hook_name_out])
        x = t[sae.hook_name].reshape(-1, sae.d_in).float()
        y = t[sae.hook_name_out].reshape(-1, sae.d_out).float()
        first = torch.zeros(x.shape[0], dtype=torch.bool)
        first[0] = True
        keep = sae_rows(x, first, y)
        f = sae.encode(x[keep])
        totals.add_rows(y[keep], sae.decode(f, x[keep]), f)
    m = totals.metrics()
    return {"explained_variance": round(m["explained_variance"], 4), "l0": round(m["l0"], 1), "rows": m["tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", nargs="+", default=list(POINTS), help="WIDTHxTOKENS[xK]")
    args = parser.parse_args()
    model = slmviz.load("SmolLM2-135M-Instruct")
    results = []
    for point in args.points:
        width, tokens, k = ([int(v) for v in point.split("x")] + [K])[:3]
        train(model, width, tokens, k)
        sae = slmviz.load_sae(run_folder(width, tokens, k), model=model)
        row = {"d_sae": width, "tokens": tokens, "k": k, "run": run_folder(width, tokens, k).name,
               **{name: encoding_metrics(model, sae, text) for name, text in TEXTS.items()}}
        print(json.dumps(row), flush=True)
        results.append(row)
    out = RESULTS / "transcoder_l6_curve.json"
    kept = {p["run"]: p for p in (json.loads(out.read_text())["points"] if out.exists() else [])}
    kept.update({r["run"]: r for r in results})  # a re-measured point replaces its old figures
    results = sorted(kept.values(), key=lambda r: (r.get("k", K), r["tokens"], r["d_sae"]))
    out.write_text(json.dumps({"what": __doc__.splitlines()[0], "points": results}, indent=1) + "\n")
    header = ["d_sae", "tokens", "k"] + [f"EV {name} (L0)" for name in TEXTS]
    body = [[f"{r['d_sae']:,}", f"{r['tokens']:,}", r.get("k", K)]
            + [f"{r[n]['explained_variance']:.3f} ({r[n]['l0']:.0f})" for n in TEXTS] for r in results]
    print(markdown_table(header, body))


if __name__ == "__main__":
    sys.exit(main())
