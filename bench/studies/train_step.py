"""One coder's training step at SmolLM2's prepared-set shape, and BatchTopK's cut against torch.topk, side by side.

- The cut (features.train.batch_top_k_cut): the (k*B+1)-th largest of relu(h) [B, d_sae], which every BatchTopK step
  and each layer's final threshold need, against the obvious reference, torch.topk over the flattened batch. Both
  give the same value (asserted here each round, and tested in tests/test_sae_train.py); the ratio is their time.
- The step (Trainer.step: encoder, BatchTopK, sparse decode, skip, aux loss, backward, fused Adam) at 512 rows x
  576 -> 4096 features, k 64, skip, in fp32 and in bf16 autocast, on synthetic rows (the step's cost does not depend
  on what the rows hold, only on their shape and on how many features are dead; here none are).

    .venv/bin/python bench/studies/train_step.py [--repeats 7]

What a one-pass run spends beyond its steps (the shared forward, the skip maps' fit, the final threshold, the
checkpoints) is measured whole by bench/studies/train_transcoders.py and bench/peers/sparsify_compare.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, interleaved, main

from slmviz.training.config import TrainConfig, fastest_dtype
from slmviz.training.loop import Trainer
from slmviz.training.sae_objective import SAEObjective
from slmviz.training.sparse import batch_top_k_cut

ROWS, D_MODEL, D_SAE, K = 512, 576, 4096, 64


def trainer(dtype: str) -> tuple[Trainer, torch.Tensor, torch.Tensor]:
    cfg = TrainConfig(kind="sae", model="bench", hooks=(("in", "out"),), d_in=D_MODEL, d_out=D_MODEL, d_sae=D_SAE, k=K,
                      architecture="batchtopk", tokens=10**9, lr=2e-3, batch_tokens=ROWS, seed=0, dtype=dtype,
                      window=128, forward_tokens=4096, buffer_tokens=16_384, dead_window=10**9,
                      aux_coefficient=1 / 32, lr_decay=0.2, corpus="synthetic", massive_factor=10.0, skip=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * ROWS, 1, D_MODEL, generator=g)  # [rows, layers, d]: one layer
    y = x @ torch.randn(D_MODEL, D_MODEL, generator=g) / D_MODEL**0.5 + torch.randn(8 * ROWS, 1, D_MODEL, generator=g)
    t = Trainer(SAEObjective(cfg, cfg.hooks, torch.device("cpu")))
    t.objective.initialise(x, y)
    return t, x, y


def run(args: argparse.Namespace) -> list[Row]:
    g = torch.Generator().manual_seed(1)
    a = (torch.randn(ROWS, D_SAE, generator=g) + 0.5 * torch.randn(ROWS, 1, generator=g)).relu()
    keep = K * ROWS

    def ours() -> torch.Tensor:
        return batch_top_k_cut(a, keep)

    def reference() -> torch.Tensor:
        return a.flatten().topk(keep + 1, sorted=False).values.min()

    assert ours() == reference()
    times = interleaved({"slmviz": ours, "torch.topk": reference}, repeats=args.repeats)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    rows = [Row(f"BatchTopK's cut, {ROWS} x {D_SAE}, k {K} (ms)", f"{ms['slmviz']:.1f}", f"{ms['torch.topk']:.1f}",
                ms["slmviz"] / ms["torch.topk"], "< 1", ms["slmviz"] < ms["torch.topk"],
                "the reference: torch.topk over the flattened batch; the same value")]

    for dtype in ("float32", "bfloat16"):
        t, x, y = trainer(dtype)
        def one_step(t: Trainer = t, x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            i = t.cursor.steps % 8
            t.cursor.steps += 1
            with torch.inference_mode(False):
                t.step(x[i * ROWS:(i + 1) * ROWS], y[i * ROWS:(i + 1) * ROWS])

        step_ms = statistics.median(interleaved({dtype: one_step}, repeats=args.repeats)[dtype]) * 1e3
        rows.append(Row(f"one transcoder step, {ROWS} rows, {D_MODEL} -> {D_SAE}, k {K}, skip, {dtype} (ms)",
                        f"{step_ms:.1f}", "", None, "", None,
                        f"fastest_dtype here: {fastest_dtype('cpu')}"))
    return rows


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0])
