"""The backward passes of an attribution graph: each target's row of edges, one backward per batch of targets,
each row's gradient injected at its own target (circuit-tracer's attribute; here one copy of the prompt forward
and the backward vmapped over the rows)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from .frozen import PromptState, Writes


def attribute_rows(model: Any, state: PromptState, ts: Any, targets: list[tuple], adjacency: torch.Tensor,
                   batch_size: int, f_pos: torch.Tensor, writes: Writes, errors: torch.Tensor,
                   token_vecs: torch.Tensor, err_off: int, tok_off: int, logit_off: int, vmap: bool = True,
                   report: Callable[[int], None] | None = None) -> None:
    """Fill adjacency's rows of `targets` [(layer read, position, read vector, node index)]: one forward of the
    replacement model up to the deepest layer they read, then one backward per `batch_size` of them, each row's
    gradient injected at its own target. `report(n)` after each backward: n rows of `targets` are filled
    (called outside the vmap fallback's `except`, so whatever it raises propagates as it is).

    `vmap=True`: the forward runs one copy of the prompt and each backward is vmapped over its rows
    (`is_grads_batched`), so the forward (whose MLPs are computed, then replaced) costs one row, not
    `batch_size`. circuit-tracer runs `batch_size` copies instead; so does this function with vmap=False, and as
    the fallback where an op has no batching rule. The gradients are the same (tests compare both).
    """
    args = (model, state, ts, targets, adjacency, batch_size, f_pos, writes, errors, token_vecs, err_off, tok_off,
            logit_off)
    for one_row in ((True, False) if vmap else (False,)):
        batches = _attribute_rows(*args, one_row=one_row)
        try:
            while True:
                try:
                    done = next(batches)
                except StopIteration:
                    return
                except RuntimeError as e:  # an op without a batching rule: the fallback redoes every row
                    if not one_row or ("vmap" not in str(e) and "batch" not in str(e).lower()):
                        raise
                    break
                if report is not None:
                    report(done)
        finally:
            batches.close()  # a stop mid-way: the suspended backward's autograd graph goes now


def _attribute_rows(model: Any, state: PromptState, ts: Any, targets: list[tuple], adjacency: torch.Tensor,
                    batch_size: int, f_pos: torch.Tensor, writes: Writes, errors: torch.Tensor,
                    token_vecs: torch.Tensor, err_off: int, tok_off: int, logit_off: int,
                    one_row: bool) -> Iterator[int]:
    """attribute_rows' work, yielding the number of rows filled after each backward.

    A feature's edge into a target is the sum over the MLP outputs it writes of (gradient there) · (its vector
    there): the gradient at layer j's output is the same for every source writing j, so each layer's writes are one
    matrix product."""
    cfg, dtype, dev = model.cfg, model.dtype, state.embed.device
    n_layers, n_pos, n_nodes = cfg.n_layers, len(state.ids), adjacency.shape[1]
    top = max(t[0] for t in targets)
    rows = min(batch_size, len(targets))
    copies = 1 if one_row else rows
    embed_leaf = state.embed[None].expand(copies, -1, -1).clone().requires_grad_(True)  # [c, pos, d_model]
    deltas = [torch.zeros(copies, n_pos, cfg.d_model, dtype=dtype, device=dev, requires_grad=True)
              for _ in range(n_layers)]
    mlp_in, normed = ts.frozen_forward(model, state, embed_leaf, deltas, grad=True,
                                       last_layer=None if top == n_layers else top)
    reads = [*mlp_in, normed]  # what a target at layer L reads (n_layers: the logits)
    # The writes grouped by (layer written, position): each reads the gradient at its own position only, so one
    # [b, d] @ [d, n] product per group; [b, pos, d] @ [d, all writes of the layer] would multiply by every other
    # position too, pos times the work (a CLT feature writes every later layer, so its layers hold many writes).
    write_pos = f_pos[writes.node]  # [w]
    groups = [(layer, int(p), idx) for layer in range(n_layers)
              for p, idx in _by_position(write_pos, (writes.layer == layer).nonzero(as_tuple=True)[0])]
    n_feat = len(f_pos)
    for start in range(0, len(targets), rows):
        batch = targets[start:start + rows]
        inject: dict[int, torch.Tensor] = {}
        for b, (layer, pos, vec, _) in enumerate(batch):
            g = inject.setdefault(layer, torch.zeros(rows, n_pos, cfg.d_model, dtype=dtype, device=dev))
            g[b, pos] = vec.to(dtype)
        deepest = max(inject)
        shape = (rows, 1, n_pos, cfg.d_model) if one_row else (rows, n_pos, cfg.d_model)
        grads = torch.autograd.grad([reads[L] for L in inject], [embed_leaf, *deltas[:deepest]],
                                    [inject[L].view(shape) for L in inject], retain_graph=start + rows < len(targets),
                                    allow_unused=True, is_grads_batched=one_row)
        del inject
        # Each layer's gradient as [b, pos, d_model] fp32, replaced in the list one at a time: no stacked copy of
        # them all (rows x layers x pos x d_model, the largest thing a backward leaves; graph_memory_bytes).
        grads = list(grads)
        for i, g in enumerate(grads):
            grads[i] = None if g is None else g.reshape(rows, n_pos, cfg.d_model).float()
        g_embed, g_layers = grads[0], grads[1:]  # sources above the deepest target (None) get nothing
        block = torch.zeros(rows, n_nodes, device=dev)  # computed where the model runs, kept in `adjacency`
        feature_edges = torch.zeros(rows, n_feat, device=dev)
        for layer, p, idx in groups:
            if layer < deepest and g_layers[layer] is not None:
                m = (g_layers[layer][:, p] @ writes.table[writes.row[idx]].T) * writes.scale[idx]  # [b, n]
                feature_edges.index_add_(1, writes.node[idx], m)
        block[:, :n_feat] = feature_edges
        for layer, g in enumerate(g_layers):
            if g is not None:
                at = err_off + layer * n_pos
                block[:, at:at + n_pos] = torch.einsum("bpd,pd->bp", g, errors[layer])
        block[:, tok_off:logit_off] = torch.einsum("bpd,pd->bp", g_embed, token_vecs)
        del grads, g_embed, g_layers
        block = block.to(adjacency.device)
        for b, (_, _, _, node) in enumerate(batch):
            adjacency[node] = block[b]
        yield start + len(batch)


def _by_position(pos: torch.Tensor, sel: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(position, the entries of `sel` whose pos is it)], positions ascending."""
    if len(sel) == 0:
        return []
    p = pos[sel]
    order = torch.argsort(p, stable=True)
    values, counts = torch.unique_consecutive(p[order], return_counts=True)
    return list(zip(values.tolist(), torch.split(sel[order], counts.tolist()), strict=True))
