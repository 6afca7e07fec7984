"""Logit lens: read each layer's residual stream through the final norm and the unembedding."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import torch

from .model.block import NORMS

if TYPE_CHECKING:
    from .trace import Trace


def lens_probs(trace: Trace, layer: int) -> torch.Tensor:
    """Next-token probabilities [pos, vocab] if the model stopped after block `layer`.

    Uses the trace's own variant for the final norm (so a no-norm trace is read without one). The
    last layer's lens equals the model's output.
    """
    model = trace._model
    if model is None:
        raise RuntimeError("The logit lens needs the model's weights: this trace was loaded from disk; "
                           "re-trace it with a model")
    p, cfg = model.decoder.params, model.cfg
    resid = trace[f"blocks.{layer}.hook_resid_post"]
    x = NORMS[trace.variant.norm](resid, p.ln_final, cfg.norm_eps, trace.variant.norm_type)
    return torch.softmax((x @ p.unembed).float(), dim=-1)


def logit_lens(trace: Trace, k: int = 5) -> pd.DataFrame:
    """Columns: layer, position, token (input), rank, pred (predicted token), pred_id, prob.

    One layer at a time, so memory stays at [pos, vocab] however deep the model is. Non-finite
    residuals give prob = NaN rows and a `finite` column of False, never an exception.
    """
    rows = []
    for layer in range(trace.n_layers):
        probs = lens_probs(trace, layer)
        finite = torch.isfinite(probs).all(dim=-1)
        top = torch.nan_to_num(probs, nan=-1.0).topk(k, dim=-1)
        for pos in range(probs.shape[0]):
            for rank in range(k):
                tid = int(top.indices[pos, rank])
                ok = bool(finite[pos])
                rows.append((layer, pos, trace.tokens[pos], rank + 1, trace.token_string(tid) if ok else "",
                             tid if ok else -1, float(top.values[pos, rank]) if ok else float("nan"), ok))
    return pd.DataFrame(rows, columns=["layer", "position", "token", "rank", "pred", "pred_id", "prob", "finite"])
