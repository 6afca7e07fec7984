"""A bundled SAE's encoding-only metrics (explained variance, L0, dead and dense fractions) on many held-out tokens.

    OMP_NUM_THREADS=1 .venv/bin/python bench/studies/sae_dead.py resid_post_l9 --model gemma-3-270m --tokens 64000

Why: `evaluate_sae` runs three full forwards per batch (clean, spliced, zeroed) for the CE and KL scores, each with
a [tokens, vocab] logits tensor; on Gemma 3 270M (262k vocabulary) that is slow enough that its dead fraction
was measured on 8k tokens, where a feature that fires once in 20 000 tokens counts as dead. The dead and dense
fractions, L0 and explained variance need only the SAE's input and output hooks: this script runs one forward per
batch that stops after the hook's layer, on the same windows, batches and rows (activations.sae_rows) as
`evaluate_sae`, and reports the same formulas (evaluate.Totals). CE / KL stay evaluate_sae's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sae", help="a bundled SAE's name, or an SAE folder")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=64_000, help="held-out real tokens to read")
    parser.add_argument("--corpus", default="broad-heldout")
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--batch-tokens", type=int, default=512)
    args = parser.parse_args()

    import torch

    import slmviz
    from slmviz.corpora.reading import iter_documents
    from slmviz.features.activations import batch_ids, sae_rows
    from slmviz.features.bundled import bundled_sae_folder
    from slmviz.features.evaluate import Totals
    from slmviz.scans.batches import iter_windows, plan_batches
    from slmviz.training.cli import resolve_corpus
    from slmviz.training.rows import forward_hooks

    model = slmviz.load(args.model)
    sae = slmviz.load_sae(bundled_sae_folder(args.sae, model) or args.sae, model=model)
    hooks = list(dict.fromkeys([sae.hook_name, sae.hook_name_out]))
    totals = Totals(sae.d_out, sae.d_sae)
    seen, start = 0, time.perf_counter()
    docs = iter_documents(resolve_corpus(args.corpus, model))
    with torch.no_grad():
        for batch in plan_batches(iter_windows(model.tokenizer, docs, args.window), args.batch_tokens):
            ids, real = batch_ids(batch)
            values = forward_hooks(model, ids, hooks)
            x, y = values[sae.hook_name][real], values[sae.hook_name_out][real]  # [n, d_in], [n, d_out]
            first = torch.zeros_like(real)
            first[:, 0] = True
            keep = sae_rows(x, first[real], y)  # the rows evaluate_sae keeps
            f = sae.encode(x[keep])
            totals.add_rows(y[keep], sae.decode(f, x[keep]), f)
            seen += batch.n_tokens
            if seen >= args.tokens:
                break
    m = totals.metrics()
    fired = totals.fired
    out = {"sae": args.sae, "model": model.name, "corpus": args.corpus, "real_tokens": seen, "rows": m["tokens"],
           **{k: m[k] for k in ("explained_variance", "l0", "frac_dead", "frac_dense")},
           "fired_at_most_once": float((fired <= 1).double().mean()),
           "seconds": round(time.perf_counter() - start, 1)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
