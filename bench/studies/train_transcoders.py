"""train_transcoders (every layer from one forward per batch) against training the layers one at a time with
train_sae, side by side in one process on the same tokens, and against its own floor.

Rows, on SmolLM2-135M-Instruct, skip transcoders (BatchTopK), the same arguments for both, on the first documents
of the broad corpus (about twice the tokens trained: BatchTopK's final threshold pass reads rows from across the
whole corpus, and on the full corpus its tokenizing would swamp a short run's time):
- layer-tokens/s of train_transcoders over `--layers` layers, and of train_sae run once per layer (what the issue's
  quick probe did). Target: one pass >= 3x.
- the floor of a one-pass run: one forward per batch (capturing every layer's input and output) plus each layer's
  coder steps timed alone, in the dtype the run trains in (the forward under its autocast); train_transcoders'
  time / that sum. Target: <= 1.25. (The floor runs in the run's dtype: an fp32 floor against a bf16 run would
  overstate it.)
Each figure in a fresh temporary folder; the model is loaded once. Nothing is asserted. The one-time work of a run
(BatchTopK's final threshold pass, the skip maps' init, the block-end checkpoint, saving) does not grow with the
tokens, so a short run is far from its floor (docs/features.md, "Training speed"); `--tokens 65536 --no-separate`
measures the floor at a length where the steps dominate, as in a prepared set's 500k.

    .venv/bin/python bench/studies/train_transcoders.py [--layers 30] [--tokens 8192] [--d-sae 4096] [--k 64] \
        [--no-separate]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, head_of, main

import slmviz
from slmviz.corpora.broad import broad_corpus
from slmviz.training.config import TrainConfig, autocast, fastest_dtype
from slmviz.training.loop import Trainer, training_batches
from slmviz.training.rows import block_rows, plan_blocks
from slmviz.training.sae_objective import SAEObjective
from slmviz.training.train import train_transcoders


def run(args: argparse.Namespace) -> list[Row]:
    model = slmviz.load()
    corpus = head_of(broad_corpus()[0], 2 * args.tokens, model)
    layers = list(range(min(args.layers, model.cfg.n_layers)))
    buffer = min(args.tokens, 16_384)  # the prepared recipes' shuffle buffer: 30 layers' rows of 65k tokens are 9 GB
    kw = dict(d_sae=args.d_sae, k=args.k, tokens=args.tokens, architecture="batchtopk", skip=True, batch_tokens=512,
              buffer_tokens=buffer, dtype=args.dtype, progress=False)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        train_transcoders(model, layers=layers, corpus=corpus, out=Path(tmp) / "set", **kw)
        one_pass = time.perf_counter() - t
        if not args.no_separate:
            t = time.perf_counter()
            for L in layers:
                slmviz.train_sae(model, f"blocks.{L}.mlp.hook_in", corpus, hook_out=f"blocks.{L}.hook_mlp_out",
                                 out=Path(tmp) / f"l{L}", **kw)
            separate = time.perf_counter() - t
    layer_tokens = args.tokens * len(layers)
    if not args.no_separate:
        speedup = separate / one_pass
        rows.append(Row(f"train_transcoders vs train_sae per layer ({len(layers)} layers x {args.tokens:,} tokens), "
                        "layer-tokens/s", f"{layer_tokens / one_pass:,.0f}", f"{layer_tokens / separate:,.0f}",
                        speedup, ">= 3", speedup >= 3, f"{one_pass:.1f} s vs {separate:.1f} s"))

    # The floor: the block's shared forward, then each layer's steps alone, on the same rows.
    dtype = args.dtype or fastest_dtype(torch.device("cpu"))  # what train_transcoders ran in: forward and steps
    cfg = TrainConfig(kind="plt", model=model.name, hooks=tuple((f"blocks.{L}.mlp.hook_in", f"blocks.{L}.hook_mlp_out")
                                                               for L in layers),
                      d_in=576, d_out=576, d_sae=args.d_sae, k=args.k, architecture="batchtopk", tokens=args.tokens,
                      lr=1e-3, batch_tokens=512, seed=0, dtype=dtype, window=128, forward_tokens=1024,
                      buffer_tokens=buffer, dead_window=500_000, aux_coefficient=1.0, lr_decay=0.2, corpus="",
                      massive_factor=20.0, skip=True)
    block = next(iter(plan_blocks(model, corpus, cfg)))
    t = time.perf_counter()
    with autocast(torch.device("cpu"), dtype):
        rows = block_rows(model, block, cfg, cfg.coders())
    forward = time.perf_counter() - t
    steps = 0.0
    for name, pairs in cfg.coders().items():
        trainer = Trainer(SAEObjective(cfg, pairs, torch.device("cpu")))
        coder, r = trainer.objective, rows[name]
        coder.initialise(r.x, r.y)
        t = time.perf_counter()
        for idx in training_batches(torch.arange(r.x.shape[0]), 512):
            trainer.step(coder.inputs(r.x[idx]), coder.targets(r.y[idx]))
        steps += time.perf_counter() - t
    floor = forward + steps
    scale = args.tokens / max(sum(b.n_tokens for b in block.batches), 1)
    floor = (forward + steps) * max(scale, 1)
    rows.append(Row("train_transcoders / (forward + every coder's steps timed alone)", f"{one_pass:.1f} s",
                    f"{floor:.1f} s", one_pass / floor, "<= 1.25", one_pass / floor <= 1.25,
                    f"one block: forward {forward:.1f} s, steps {steps:.1f} s ({dtype}), scaled x{scale:.2f}; the run "
                    "also plans blocks, checkpoints and measures BatchTopK's threshold"))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-sae", type=int, default=4096)
    p.add_argument("--k", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--no-separate", action="store_true",
                   help="the floor row only: skip train_sae per layer (at 65,536 tokens it would take ~1 h here)")


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0], add_arguments)
