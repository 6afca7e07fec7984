"""Logit lens: read each layer's residual stream through the final norm and the unembedding."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from ..hooks import layer_hook_name
from .traced import Traced

ROWS_PER_CHUNK = 2048  # [rows, vocab] fp32 logits per matmul: 2048 × 49152 × 4 B ≈ 400 MB at most


def _lens_inputs(trace: Traced, layers: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normalised residuals [len(layers) * pos, d_model], unembed, ln_final) for the trace's variant."""
    model = trace._model
    if model is None:
        raise RuntimeError("The logit lens needs the model's weights: this trace was loaded from disk; "
                           "re-trace the prompt with a model")
    p = model.decoder.params
    resid = torch.stack([trace[layer_hook_name(layer, "hook_resid_post")][start:] for layer in layers])  # [L, pos, d]
    # The trace's own variant decides the final norm (a no-norm trace is read without one, Gemma's with 1 + w).
    decoder = model.decoder
    x = decoder.final_norm(resid.flatten(0, 1), decoder.conventions(trace.variant))
    return x, p.unembed, p.ln_final


def lens_probs(trace: Traced, layer: int) -> torch.Tensor:
    """Next-token probabilities [pos, vocab] if the model stopped after block `layer`.

    The last layer's lens equals the model's output distribution.
    """
    x, unembed, _ = _lens_inputs(trace, [layer], 0)
    return torch.softmax(F.linear(x, unembed).float(), dim=-1)


@torch.inference_mode()
def logit_lens(trace: Traced, k: int = 5, start: int = 0) -> pd.DataFrame:
    """Top-k next tokens read from every layer's resid_post, for positions `start` onwards.

    Columns: layer, position, token (input), rank, pred (predicted token), pred_id, prob, finite.
    All layers go through one batched matmul per chunk of rows, and probabilities come from the top-k
    logits and a logsumexp, so the full [rows, vocab] softmax is never materialised. Rows whose values
    stopped being finite get prob NaN, pred "" and finite False, never an exception.
    """
    layers = list(range(trace.n_layers))
    x, unembed, _ = _lens_inputs(trace, layers, start)
    values, indices, finite = [], [], []
    for chunk in x.split(ROWS_PER_CHUNK):
        logits = F.linear(chunk, unembed).float()  # [rows, vocab]; fp32 for a bf16 model (logsumexp, numpy)
        ok = torch.isfinite(logits).all(-1)
        top = torch.nan_to_num(logits, nan=-torch.inf).topk(k, dim=-1)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        values.append(torch.exp(top.values - lse).masked_fill(~ok[:, None], float("nan")))
        indices.append(top.indices.masked_fill(~ok[:, None], -1))
        finite.append(ok)
    probs = torch.cat(values).cpu().numpy()  # [L * pos, k]
    ids = torch.cat(indices).cpu().numpy()
    ok = torch.cat(finite).cpu().numpy()
    n_pos = len(trace.tokens) - start
    strings = {int(i): trace.token_string(int(i)) for i in np.unique(ids) if i >= 0}
    strings[-1] = ""
    row = np.arange(len(layers) * n_pos).repeat(k)
    return pd.DataFrame({
        "layer": row // n_pos,
        "position": start + row % n_pos,
        "token": [trace.tokens[start + r % n_pos] for r in row],
        "rank": np.tile(np.arange(1, k + 1), len(layers) * n_pos),
        "pred": [strings[int(i)] for i in ids.reshape(-1)],
        "pred_id": ids.reshape(-1),
        "prob": probs.reshape(-1),
        "finite": ok.repeat(k),
    })
