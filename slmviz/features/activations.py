"""The rows an SAE may see (`sae_rows`: in training, evaluation and dashboards alike) and a planned batch's padded
ids (`batch_ids`); what training alone needs (planning a corpus into blocks, the rows of every coder) is in
training/rows.py.
"""

from __future__ import annotations

import torch

from ..scans.batches import PAD_ID, Batch

# A row is massive when its norm exceeds this many times the median norm of its batch's other rows. Measured on
# Bible windows of 128 tokens (bench/results/perf.md "Features"): SmolLM2's first position sits at ~115x the median of
# the rest (layer 15: ~20 000 against ~173) while its other rows reach 1.6x (layer 3: 8.8x); Gemma 3 270M's
# punctuation rows reach ~10x at layer 9, real tokens an SAE should reconstruct, and its first position ~15x.
MASSIVE_FACTOR = 20.0


def sae_rows(x: torch.Tensor, first: torch.Tensor, *others: torch.Tensor,
             factor: float = MASSIVE_FACTOR) -> torch.Tensor:
    """Which activation rows an SAE trains on, is evaluated on and is shown on (dashboards): a bool mask [n].

    x [n, d] (and `others`, e.g. a transcoder's target [n, d_out]) are one batch's rows; `first` [n] is True at
    each window's first position. A row is dropped when it is a window's first position, or when its norm (in x
    or in any of `others`) exceeds `factor` times the median norm of the batch's non-first rows.

    What goes wrong otherwise: the first position of every forward is an attention sink with a *massive
    activation* (SmolLM2's residual norm ~25 000 against ~175 elsewhere), and so is the first position of a
    window cut mid-document or mid-word, whatever its token. One such row per 128 holds ~99% of the squared norm:
    an SAE fitted with them spends itself on that one direction (SAELens's defaults gave explained variance
    below 0 on 200k tokens), and every metric over them (explained variance, CE with x_hat spliced) measures
    that one row. Filtering token *ids* (SAELens's exclude_special_tokens) misses the mid-document windows;
    filtering position 0 alone misses a sink a model puts elsewhere (the norm test). The median is the batch's
    own, so the rule needs no state and a single prompt (a dashboard) applies it to itself.
    Pinned by tests/test_sae_train.py::test_massive_rows_are_dropped.
    """
    keep = ~first.to(x.device)  # the batch's layout is built on the CPU, its rows live on the model's device
    for t in (x, *others):
        norms = t.float().norm(dim=-1)  # [n]
        ordinary = norms[keep]
        if ordinary.numel() == 0:
            break
        keep = keep & (norms <= factor * ordinary.median())
    return keep


def batch_ids(batch: Batch, shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, L] padded on the right with PAD_ID, and the real-token mask [b, L]; `shape` pads to [rows, length]
    (rows of PAD_ID only are all False in the mask)."""
    lengths = torch.tensor([len(w.ids) for w in batch.windows])  # [b]
    rows, longest = shape if shape is not None else (len(batch.windows), int(lengths.max()))
    if rows < len(batch.windows) or longest < int(lengths.max()):
        raise ValueError(f"a batch of {len(batch.windows)} windows up to {int(lengths.max())} tokens does not fit "
                         f"the shape {shape}")
    ids = torch.full((rows, longest), PAD_ID, dtype=torch.long)  # [rows, L]
    for i, w in enumerate(batch.windows):
        ids[i, : len(w.ids)] = torch.tensor(w.ids)
    real = torch.arange(longest)[None, :] < torch.cat([lengths, lengths.new_zeros(rows - len(lengths))])[:, None]
    return ids, real
