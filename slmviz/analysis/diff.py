"""Faithful vs broken: divergence statistics between traces of the same prompt under different variants."""

from __future__ import annotations

import pandas as pd
import torch

from ..hooks import RESIDUAL_STAGES, hook_names, layer_hook_name
from .traced import Traced

DIVERGENCE_THRESHOLD = 0.01  # 1 % relative change of the residual stream
RESIDUAL_HOOKS = tuple(RESIDUAL_STAGES.values())


KL_BLOCK_CELLS = 1 << 24  # logits per block of rows (64 MB in fp32): see kl_per_position


def kl_per_position(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(reference ‖ other) in nats per position, from logits [..., vocab]. +inf where `other` is not finite.

    Computed a block of rows at a time: over the whole [pos, vocab] at once, its five temporaries are each as large
    as the logits (Gemma's 262,144-token vocabulary over a 535-token prompt: 560 MB each), and memory touched
    afresh costs far more than the arithmetic on some machines (bench/results/notes.md, "make test's CPU"). Each
    row's value is the same either way: every operation is row by row."""
    if reference.shape != other.shape:
        raise ValueError(f"kl_per_position needs logits of one shape, got {tuple(reference.shape)} and "
                         f"{tuple(other.shape)}")
    vocab = reference.shape[-1]
    ref_rows, other_rows = reference.reshape(-1, vocab), other.reshape(-1, vocab)
    step = max(1, KL_BLOCK_CELLS // max(vocab, 1))
    out = [_kl_rows(ref_rows[i:i + step], other_rows[i:i + step]) for i in range(0, ref_rows.shape[0], step)]
    kl = torch.cat(out) if out else torch.zeros(0, device=reference.device)
    return kl.reshape(reference.shape[:-1])


def _kl_rows(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    log_p = torch.log_softmax(reference.float(), dim=-1)
    log_q = torch.log_softmax(other.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    bad = ~torch.isfinite(other).all(-1)
    return torch.where(bad, torch.full_like(kl, float("inf")), kl)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """‖b - a‖ / ‖a‖ over the last dim (inf where b is not finite). a, b: [pos, d] -> [pos]."""
    a, b = a.float(), b.float()
    rel = (b - a).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-12)
    return torch.where(torch.isfinite(b).all(-1), rel, torch.full_like(rel, float("inf")))


def trace_diff(reference: Traced, other: Traced) -> pd.DataFrame:
    """Per-layer, per-position relative residual difference: layer, stage, position, token, rel_diff."""
    rows = []
    for layer in range(reference.n_layers):
        for stage, local in RESIDUAL_STAGES.items():
            name = layer_hook_name(layer, local)
            if name in reference and name in other:
                rel = relative_difference(reference[name], other[name])
                rows += [(layer, stage, pos, reference.tokens[pos], float(r)) for pos, r in enumerate(rel)]
    return pd.DataFrame(rows, columns=["layer", "stage", "position", "token", "rel_diff"])


def first_divergent_layer(reference: Traced, other: Traced, threshold: float = DIVERGENCE_THRESHOLD) -> int | None:
    """First layer whose resid_post differs by more than `threshold` (relative) at any position."""
    for layer in range(reference.n_layers):
        name = layer_hook_name(layer, "hook_resid_post")
        if float(relative_difference(reference[name], other[name]).max()) > threshold:
            return layer
    return None


def divergence(reference: Traced, other: Traced, threshold: float = DIVERGENCE_THRESHOLD) -> dict:
    """The numbers of a verdict on `other` against `reference` (same prompt): kl_mean and kl_last (nats,
    KL(reference ‖ other) per next-token prediction), top1_agree (positions whose top token agrees, of `positions`)
    and first_layer (the first layer whose resid_post moves by more than `threshold` relative L2, None if none),
    with the threshold itself. Non-finite logits give KL inf and count as disagreement."""
    kl = kl_per_position(reference.logits, other.logits)
    finite = torch.isfinite(other.logits).all(-1)
    agree = (other.logits.argmax(-1) == reference.logits.argmax(-1)) & finite
    return {"kl_mean": float(kl.mean()), "kl_last": float(kl[-1]), "top1_agree": int(agree.sum()),
            "positions": int(agree.numel()), "first_layer": first_divergent_layer(reference, other, threshold),
            "threshold": threshold}


def first_divergent_hook(reference: Traced, other: Traced, rtol: float = 1e-5) -> str | None:
    """First hook (execution order) whose values differ beyond rtol relative to their size."""
    for name in hook_names(reference.config):
        if name in reference and name in other:
            a, b = reference[name].float(), other[name].float()
            if a.shape != b.shape:
                return name
            finite = torch.isfinite(a)
            if not torch.equal(finite, torch.isfinite(b)):
                return name
            scale = a[finite].abs().max().clamp_min(1e-12) if finite.any() else torch.tensor(1.0)
            if ((a - b)[finite].abs() > rtol * scale).any():
                return name
    return None
