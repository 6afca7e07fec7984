"""Where the bundled `transcoder_l6` misses on modern prose: its error row by row, and whether a per-token lookup
would take it.

    .venv/bin/python bench/studies/transcoder_l6_rows.py [--out bench/results/transcoder_l6_rows.md]

On `bench/modern_prose.txt` (each text traced alone; position 0, the attention sink, left out, as sae_rows does):
- the shipped coder's explained variance over every row, and the share of its squared error held by its worst 1, 5,
  10, 20 and 50 % of rows, with the EV left when those rows are dropped (if a few rows held the error, a rule for
  them would be the lever);
- the worst rows' tokens;
- a per-token lookup table built from the model alone, T[t] = layer 6's MLP output at `[BOS, t]` (the
  initialisation of "Tokenized SAEs", Dooms & Wilhelm 2024): T[token] alone as a prediction of the MLP output, and
  as a prediction of the coder's residual (the best scale a·T, and a linear map T @ W fitted on the first half of
  the rows and tested on the second).
Nothing is asserted; the figures go to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import BENCH_DIR, RESULTS, cpu_model

LAYER = 6


def explained(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float(1 - (y - pred).pow(2).sum() / (y - y.mean(0)).pow(2).sum())


def main() -> None:
    import slmviz
    from slmviz.training.rows import forward_hooks

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS / "transcoder_l6_rows.md"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    m = slmviz.load()
    sae = slmviz.load_sae(f"transcoder_l{LAYER}", model=m)
    read, write = f"blocks.{LAYER}.mlp.hook_in", f"blocks.{LAYER}.hook_mlp_out"
    texts = [line.strip() for line in (BENCH_DIR / "modern_prose.txt").read_text().splitlines() if line.strip()]
    ys, preds, ids_all, where = [], [], [], []
    for text in texts:
        ids = m.encode(text)
        t = m.trace(ids, names=[read, write])
        x, y = t[read][1:], t[write][1:]
        ys.append(y.float())
        preds.append(sae.decode(sae.encode(x), x).float())
        ids_all.append(ids[1:])
        where += [(text, p) for p in range(1, len(ids))]
    y, pred, ids = torch.cat(ys), torch.cat(preds), torch.cat(ids_all)
    err = (y - pred).pow(2).sum(-1)
    var = (y - y.mean(0)).pow(2).sum(-1)
    order = err.argsort(descending=True)
    lines = ["# What bounds `transcoder_l6` on modern prose", "",
             f"Made by `bench/studies/transcoder_l6_rows.py`: the shipped coder on `bench/modern_prose.txt` "
             f"({len(texts)} texts, {len(y)} rows), {time.strftime('%Y-%m-%d')}, on {os.cpu_count()} cores of "
             f"{cpu_model()} "
             f"({torch.get_num_threads()} threads).", "",
             f"EV over every row: **{explained(pred, y):.3f}**.", "",
             "| worst rows | share of the squared error | EV without them |", "| --- | --- | --- |"]
    for q in (1, 5, 10, 20, 50):
        n = max(1, len(y) * q // 100)
        rest = order[n:]
        lines.append(f"| {q} % ({n}) | {float(err[order[:n]].sum() / err.sum()):.3f} | "
                     f"{float(1 - err[rest].sum() / var[rest].sum()):.3f} |")
    strings = m.to_strings(ids)
    worst = ", ".join(f"{strings[i]!r} ({err[i]:.0f} of {var[i]:.0f})" for i in order[:12].tolist())
    lines += ["", f"Worst rows, token (squared error of its variance about the mean): {worst}.", ""]

    t0 = time.perf_counter()
    bos = m.tokenizer.bos_token_id if m.tokenizer.bos_token_id is not None else 1
    lookup = torch.zeros(m.cfg.vocab_size, m.cfg.d_model)
    for s in range(0, m.cfg.vocab_size, 2048):
        tok = torch.arange(s, min(m.cfg.vocab_size, s + 2048))
        batch = torch.stack([torch.full_like(tok, bos), tok], 1)
        lookup[tok] = forward_hooks(m, batch, [write])[write][:, 1].float()
    built = time.perf_counter() - t0
    tk = lookup[ids]
    residual = y - pred
    a = float((residual * tk).sum() / tk.pow(2).sum())
    half = len(y) // 2
    w = torch.linalg.lstsq(tk[:half].double(), residual[:half].double()).solution.float()
    held = residual[half:]
    lines += [f"A per-token lookup T[t] = layer {LAYER}'s MLP output at [BOS, t], every token of the vocabulary "
              f"({built:.0f} s to build):", "",
              f"- T[token] alone as the MLP output: EV **{explained(tk, y):.3f}**;",
              f"- the coder's residual explained by a·T (best a = {a:.3f}): "
              f"**{float(1 - (residual - a * tk).pow(2).sum() / residual.pow(2).sum()):.4f}**;",
              f"- the residual of the second half explained by T @ W fitted on the first: "
              f"**{float(1 - (held - tk[half:] @ w).pow(2).sum() / held.pow(2).sum()):.3f}**.", ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
