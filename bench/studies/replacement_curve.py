"""How the prepared PLT set's graph scores grow with training tokens: the same run's checkpoints, copied as it passed
each mark, each finished as train_transcoders finishes a run (BatchTopK's threshold measured on the same rows, the
coders saved as JumpReLU), then scored on bench/studies/replacement_scores.py's 20 prompts and evaluated on held-out
text.

A checkpoint is the run *before* its learning rate's final decay (lr_decay: the last 20 % of `tokens`), so an
earlier point is a lower bound on what a run of that many tokens would reach; the last point is the finished set.

    .venv/bin/python bench/studies/replacement_curve.py SNAPSHOT.safetensors [...] \
        [--log bench/results/replacement_scores_runs] [--out bench/results/replacement_curve.json]

With --log, each point's finished prompts go to LOG/plt@{tokens}-all.jsonl and a rerun skips them (a point is 20
unpruned graphs of the full set, so a curve may span sessions).

Copy the checkpoints while `slmviz prepare --transcoders plt` runs, e.g. when min over layers of
meta["layers"][L]["cursor"]["tokens"] passes 125k and 250k ($SLMVIZ_CACHE/transcoders/{model}/plt/
checkpoint.safetensors). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first
from replacement_scores import graph_report

import slmviz
from slmviz import TranscoderSet
from slmviz.corpora.named import resolve_corpus
from slmviz.formats.checkpoint import CHECKPOINT
from slmviz.training.loop import Run


def finished_set(model, snapshot: Path, corpus) -> tuple[TranscoderSet, int]:
    """The set a run's checkpoint would give if the run ended there; and the tokens each layer had trained on."""
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(snapshot.resolve(), Path(tmp) / CHECKPOINT)
        run = Run.from_checkpoint(Path(tmp))
    tokens = min(t.cursor.tokens for t in run.trainers.values())
    ts = run.finish(model, corpus)
    return TranscoderSet({L: ts.coder(L) for L in ts.layers}, name=f"{ts.name}@{tokens}"), tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshots", nargs="+", type=Path)
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=20_000, help="held-out tokens per corpus")
    p.add_argument("--log", type=Path, default=None, help="a folder for each point's finished prompts (resume)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    model = slmviz.load(args.model)
    corpus = resolve_corpus("mixed", model)
    for snapshot in args.snapshots:
        ts, tokens = finished_set(model, snapshot, corpus)
        log = args.log / f"plt@{tokens}-all.jsonl" if args.log else None
        entry = {"tokens": tokens, **score_point(model, ts, log, args.tokens)}
        print(json.dumps(entry), flush=True)
        if args.out:
            write_point(args.out, model.name, entry, "tokens")


def score_point(model, ts: TranscoderSet, log: Path | None, heldout_tokens: int,
                memory_budget_gb: float = 16) -> dict:
    """A set's median scores on replacement_scores's 20 unpruned graphs, and its per-layer EV on both held-out
    splits (median and worst layer, and every layer spliced at once). `memory_budget_gb`: each unpruned graph's
    budget (a narrower set fires more distinct features: the 1,024-wide set's 26-token induction prompt asked for
    16.5 GiB)."""
    entry = {k: v for k, v in graph_report(model, ts, None, log, memory_budget_gb).items() if k != "prompts"}
    for name in ("broad", "chat"):
        r = slmviz.evaluate_transcoders(ts, resolve_corpus(name, model, split="heldout"), model=model,
                                        tokens=heldout_tokens, progress=False)
        entry[f"heldout_{name}"] = {"median_ev": float(r["layers"]["explained_variance"].median()),
                                    "min_ev": float(r["layers"]["explained_variance"].min()),
                                    "replaced": r["replaced"]}
    return entry


def write_point(out: Path, model_name: str, entry: dict, key: str) -> None:
    """Write `entry` into `out`'s points beside those already there (a curve spans sessions), replacing the one of
    the same `key`."""
    kept = json.loads(out.read_text())["points"] if out.exists() else []
    points = sorted([p for p in kept if p[key] != entry[key]] + [entry], key=lambda p: p[key])
    out.write_text(json.dumps({"model": model_name, "points": points}, indent=1) + "\n")


if __name__ == "__main__":
    main()
