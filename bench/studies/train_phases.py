"""Where one train_transcoders call spends its time: each phase's wall-clock seconds, from timers around the trainer's
own functions (the shared forwards, the skip maps' fit, the coders' steps, checkpoints, BatchTopK's final threshold,
saving the set), on SmolLM2's 30 layers with the prepared recipe's shape (4096 features, k 64, skip, BatchTopK) and
the trainer's defaults otherwise, on the first documents of the "mixed" corpus.

    .venv/bin/python bench/studies/train_phases.py [--tokens 65536] [--layers 30]

What the phases leave out (planning, shuffles, the progress summary) is printed as "other". The timers wrap calls,
not lines, so their cost is nothing next to the phases. bench/results/sparsify_compare.md records a run and what it
led to.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, head_of, main

import slmviz
from slmviz.corpora.named import resolve_corpus
from slmviz.training import loop
from slmviz.training.config import fastest_dtype
from slmviz.training.sae_objective import SAEObjective

# (module or class, function name, phase): what each timer wraps (the loop's own names: it imports them by name)
PHASES = (
    (loop, "block_rows", "forwards of the training blocks"),
    (loop, "threshold_rows", "the final threshold's rows (forwards)"),
    (SAEObjective, "initialise", "init (input scales, skip maps' least-squares fit)"),
    (loop.Trainer, "step", "coders' steps"),
    (SAEObjective, "estimate_threshold", "the final threshold from its rows"),
    (loop.Run, "save_checkpoint", "checkpoints"),
    (loop, "save_result", "saving the set"),
)


def timed(seconds: dict[str, float], calls: collections.Counter) -> None:
    """Wrap each PHASES function with a timer adding to seconds[phase] (monkeypatching the trainer's modules)."""
    for owner, name, phase in PHASES:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_phase] += time.perf_counter() - start
                calls[_phase] += 1

        setattr(owner, name, wrapper)


def run(args: argparse.Namespace) -> list[Row]:
    model = slmviz.load()
    layers = list(range(min(args.layers, model.cfg.n_layers)))
    corpus = head_of(resolve_corpus("mixed", model), 2 * args.tokens, model)
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    timed(seconds, calls)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        slmviz.train_transcoders(model, layers=layers, corpus=corpus, d_sae=4096, k=64, tokens=args.tokens,
                                    architecture="batchtopk", skip=True, batch_tokens=512, lr=2e-3,
                                    out=Path(tmp), progress=False)
        total = time.perf_counter() - start
    threshold_rows = seconds["the final threshold's rows (forwards)"]
    seconds["forwards of the training blocks"] -= threshold_rows  # its forwards go through block_rows_by_layer too
    rows = [Row(f"{phase} (s)", f"{s:.1f}", "", s / total, "share", None, f"{calls[phase]} calls")
            for phase, s in seconds.items()]
    rows.append(Row("other (s)", f"{total - sum(seconds.values()):.1f}", "", None, "", None))
    rows.append(Row(f"train_transcoders, {len(layers)} layers x {args.tokens:,} tokens (s)", f"{total:.1f}", "",
                    None, "", None, f"dtype {fastest_dtype('cpu')}, torch {torch.__version__}"))
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokens", type=int, default=65_536)
    parser.add_argument("--layers", type=int, default=30)


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0], add_args)
