"""How the PLT set's graph scores grow with width: SmolLM2's prepared recipe (prepared.RECIPES: k 64, BatchTopK
saved as JumpReLU, skip, the "mixed" corpus, seed 0) trained at several widths on the same tokens, each run to the
end of its own learning-rate decay, then scored as bench/studies/replacement_curve.py scores a point (the 20 prompts'
unpruned graphs, held-out EV).

    .venv/bin/python bench/studies/replacement_width.py --widths 1024 2048 4096 --tokens 65536 \
        --runs /work/widths --log bench/results/replacement_scores_runs --out bench/results/replacement_width.json

Each width trains into RUNS/d{width}@{tokens} (train_transcoders checkpoints there, so a killed run resumes) and its
finished prompts go to LOG/plt-d{width}@{tokens}-all.jsonl (a rerun skips them); each point is written to --out as
it finishes. `train_seconds` is the train_transcoders call's time (the corpus planned, every layer trained, the set
saved; run with nothing else on the machine), or null where the run had finished before this call. The same k at
every width keeps L0 fixed, so the points differ in dictionary size alone. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first
from replacement_curve import score_point, write_point

import slmviz
from slmviz.corpora.named import resolve_corpus
from slmviz.training.prepare import RECIPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--tokens", type=int, default=65_536, help="training tokens a layer, the same at every width")
    p.add_argument("--runs", type=Path, required=True, help="a folder for the runs (each resumes there)")
    p.add_argument("--heldout-tokens", type=int, default=10_000, help="held-out tokens per corpus")
    p.add_argument("--log", type=Path, default=None, help="a folder for each point's finished prompts (resume)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--memory-budget-gb", type=float, default=19, help="each unpruned graph's (on a 23 GB machine)")
    args = p.parse_args()
    model = slmviz.load()
    corpus = resolve_corpus("mixed", model)
    recipe = {k: v for k, v in RECIPES[(model.name, "plt")].items() if k not in ("d_sae", "tokens")}
    for width in args.widths:
        out = args.runs / f"d{width}@{args.tokens}"
        finished = (out / "transcoder_set.json").exists()  # then train_transcoders loads it: nothing to time
        t = time.perf_counter()
        ts = slmviz.train_transcoders(model, layers="all", corpus=corpus, d_sae=width, tokens=args.tokens, out=out,
                                      progress=False, **recipe)
        trained = None if finished else round(time.perf_counter() - t, 1)  # a resumed run's: this call's part
        log = args.log / f"plt-d{width}@{args.tokens}-all.jsonl" if args.log else None
        entry = {"d_sae": width, "tokens": args.tokens, "train_seconds": trained,
                 **score_point(model, ts, log, args.heldout_tokens, args.memory_budget_gb)}
        print(json.dumps(entry), flush=True)
        if args.out:
            write_point(args.out, model.name, entry, "d_sae")


if __name__ == "__main__":
    main()
