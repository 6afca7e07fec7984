"""What an attribution graph is made of besides its edges: each target's constant (its value with every node
removed), the node table in circuit-tracer's order, and the logits before a final softcap."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from ..hooks import layer_hook_name
from .frozen import PromptState, Writes

WRITE_CHUNK = 65_536  # writes materialised at once where every vector is needed (replacement_constant)


def _pre_softcap(model: Any, state: PromptState) -> torch.Tensor:
    """The last position's logits before the final softcap: cap · atanh(logit / cap)."""
    cap = model.cfg.final_logit_softcap
    return torch.atanh((state.logits[-1].float() / cap).clamp(-1 + 1e-7, 1 - 1e-7)) * cap


def replacement_constant(model: Any, state: PromptState, ts: Any, f_layer: torch.Tensor, f_pos: torch.Tensor,
                         writes: Writes, errors: torch.Tensor, f_enc: torch.Tensor, logit_vecs: torch.Tensor,
                         n_nodes: int, logit_off: int) -> torch.Tensor:
    """Each target's value with every node removed: the replacement model run with the embeddings zeroed and every
    feature's and error's vector subtracted from the MLP outputs it writes (what remains is b_dec, biases, a zeroed
    BOS)."""
    cfg = model.cfg
    n_pos = len(state.ids)
    deltas = -errors.clone()
    for start in range(0, len(writes.node), WRITE_CHUNK):  # chunks: every vector at once is what Writes avoids
        idx = slice(start, start + WRITE_CHUNK)
        deltas.index_put_((writes.layer[idx], f_pos[writes.node[idx]]), -writes.vec(idx), accumulate=True)
    deltas = [d[None].to(model.dtype) for d in deltas]
    zero = torch.zeros(1, n_pos, cfg.d_model, dtype=model.dtype, device=state.embed.device)
    mlp_in, normed = ts.frozen_forward(model, state, zero, deltas)
    out = torch.zeros(n_nodes, device=state.embed.device)
    n_feat = len(f_layer)
    for i in range(n_feat):
        out[i] = mlp_in[int(f_layer[i])][0, int(f_pos[i])].float() @ f_enc[i]
    out[logit_off:] = logit_vecs @ normed[0, -1].float()
    return out.cpu()


def node_table(model: Any, ids: torch.Tensor, f_layer: torch.Tensor, f_pos: torch.Tensor, f_idx: torch.Tensor,
               f_act: torch.Tensor, feat_hook: list[str], n_layers: int, logit_idx: torch.Tensor,
               logit_p: torch.Tensor) -> pd.DataFrame:
    """One row per node in adjacency order, with circuit-tracer's node ids (frontend/graph_models.Node)."""
    n_pos = len(ids)
    strings = model.to_strings(ids)
    rows: list[dict[str, Any]] = []
    for L, p, f, a, hook in zip(f_layer.tolist(), f_pos.tolist(), f_idx.tolist(), f_act.tolist(), feat_hook,
                                strict=True):
        rows.append({"node_id": f"{L}_{f}_{p}", "kind": "feature", "layer": L, "position": p, "feature": f,
                     "activation": a, "hook": hook, "token": strings[p], "probability": math.nan})
    for L in range(n_layers):
        hook = layer_hook_name(L, "hook_mlp_out")
        for p in range(n_pos):
            rows.append({"node_id": f"0_{L}_{p}", "kind": "error", "layer": L, "position": p, "feature": -1,
                         "activation": math.nan, "hook": hook, "token": strings[p], "probability": math.nan})
    for p in range(n_pos):
        rows.append({"node_id": f"E_{int(ids[p])}_{p}", "kind": "embedding", "layer": -1, "position": p,
                     "feature": int(ids[p]), "activation": math.nan, "hook": "hook_embed", "token": strings[p],
                     "probability": math.nan})
    logit_strings = model.to_strings(logit_idx)
    for i, (tok, prob) in enumerate(zip(logit_idx.tolist(), logit_p.tolist(), strict=True)):
        rows.append({"node_id": f"{n_layers + 1}_{tok}_{n_pos - 1}", "kind": "logit", "layer": n_layers,
                     "position": n_pos - 1, "feature": tok, "activation": math.nan, "hook": "logits",
                     "token": logit_strings[i], "probability": prob})
    return pd.DataFrame(rows, columns=["node_id", "kind", "layer", "position", "feature", "activation", "hook",
                                       "token", "probability"])
