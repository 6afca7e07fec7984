"""Feature selection for a capped graph (max_feature_nodes): circuit-tracer's loop that attributes the logits, then
the unvisited features of highest partial influence, a round at a time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .backward import attribute_rows
from .budget import PARTIAL_INFLUENCE_CHUNK
from .frozen import PromptState


def partial_influences(rows: torch.Tensor, logit_p: torch.Tensor, row_node: torch.Tensor,
                       max_iter: int = 128, chunk_bytes: int = PARTIAL_INFLUENCE_CHUNK) -> torch.Tensor:
    """circuit-tracer's compute_partial_influences: each node's influence on the logits through the rows attributed
    so far (rows [r, n_nodes], row r being node row_node[r]'s inputs), by power iteration on the row-normalised |rows|
    from the logit probabilities.

    Without a normalised copy of `rows`, which circuit-tracer makes: on a long prompt `rows` is the largest tensor a
    capped graph holds (the kept features' rows over every active feature), and its copy doubled the peak past the
    memory budget's estimate (docs/features.md, "The longest prompt"). The iteration only ever reads its vector
    at the row nodes, so it runs on the [r, r] block of the normalised |rows| over their columns, and the influence
    on every node is one product of the summed iterates with the normalised |rows|, a column chunk at a time. Equal
    to circuit-tracer's up to the order of float sums (tests/test_attribution_graph.py pins it)."""
    n_rows, n_nodes = rows.shape
    step = max(1, chunk_bytes // (4 * max(n_rows, 1)))
    row_sums = torch.zeros(n_rows)
    for s in range(0, n_nodes, step):
        row_sums += rows[:, s:s + step].abs().sum(1)
    inv = 1 / row_sums.clamp(min=1e-8)
    block = rows[:, row_node].abs().mul_(inv[:, None])  # [r, r]: normalised |rows| at the row nodes' columns
    start = torch.zeros(n_nodes)
    start[-len(logit_p):] = logit_p
    vec, summed = start[row_node], torch.zeros(n_rows)  # the iterate at the row nodes, and its sum over iterations
    for _ in range(max_iter):
        if not vec.any():
            break
        summed += vec
        vec = vec @ block
    weights = summed * inv
    influence = torch.empty(n_nodes)
    for s in range(0, n_nodes, step):
        influence[s:s + step] = weights @ rows[:, s:s + step].abs()
    return influence


def attribute_most_influential(model: Any, state: PromptState, ts: Any, logit_targets: list[tuple],
                               logit_p: torch.Tensor, f_layer: torch.Tensor, f_pos: torch.Tensor, f_enc: torch.Tensor,
                               cap: int, n_nodes: int, args: tuple, vmap: bool, report: Callable[[int], None],
                               update_interval: int) -> tuple[torch.Tensor, torch.Tensor]:
    """circuit-tracer's max_feature_nodes loop: attribute the logits, then `cap` features in rounds, each taking the
    unvisited features of highest partial influence. Returns (the chosen features' indices, sorted; the adjacency
    over the chosen features and every other node, rows and columns of unchosen features dropped)."""
    n_feat, n_logits = len(f_layer), len(logit_targets)
    batch_size = args[0]
    rows = torch.zeros(cap + n_logits, n_nodes)
    row_node = torch.zeros(cap + n_logits, dtype=torch.long)
    attribute_rows(model, state, ts, [(*t[:3], i) for i, t in enumerate(logit_targets)], rows, *args, vmap=vmap,
                   report=report)
    row_node[:n_logits] = torch.tensor([t[3] for t in logit_targets])
    visited = torch.zeros(n_feat, dtype=torch.bool)
    st = n_logits
    while st - n_logits < cap:
        influence = partial_influences(rows[:st], logit_p, row_node[:st])
        rank = torch.argsort(influence[:n_feat], descending=True)
        pending = rank[~visited[rank]][: min(update_interval * batch_size, cap - (st - n_logits))]
        targets = [(int(f_layer[i]), int(f_pos[i]), f_enc[i], st + j) for j, i in enumerate(pending.tolist())]
        attribute_rows(model, state, ts, targets, rows, *args, vmap=vmap,
                       report=lambda n, st=st: report(st + n))
        row_node[st:st + len(pending)] = pending
        visited[pending] = True
        st += len(pending)
    selected = visited.nonzero().flatten()
    columns = torch.cat([selected, torch.arange(n_feat, n_nodes)])
    position = torch.full((n_nodes,), -1, dtype=torch.long)
    position[columns] = torch.arange(len(columns))
    adjacency = torch.zeros(len(columns), len(columns))
    adjacency[position[row_node]] = rows[:, columns]
    return selected, adjacency
