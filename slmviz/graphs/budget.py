"""attribution_graph's memory budget: what a graph holds at its peak, estimated before any work, and the largest
feature cap that fits (the error's hint)."""

from __future__ import annotations

from typing import Any

DEFAULT_MEMORY_BUDGET_GB = 4.0
PARTIAL_INFLUENCE_CHUNK = 2**26  # bytes of |rows| selection.partial_influences takes at a time


def estimate_memory_bytes(n_nodes: int, n_pos: int, batch_size: int, cfg: Any, bytes_per: int = 4,
                          copies: int = 1) -> int:
    """What attribution_graph holds at its peak, on the safe side: the dense fp32 adjacency and the graph's
    boolean edge mask over it (5 bytes a pair: scores and path lengths read the adjacency a block at a time,
    prune.RowNormalizedAbs; pruning, g.prune, holds up to three more fp32 copies of the graph it prunes), the
    forward's saved activations for `copies` rows of the prompt (~16 d_model-wide values per token per layer, the
    patterns, the MLP's hidden layer while it runs), and each backward's gradients for `batch_size` targets (~4
    residual-sized tensors per layer: the vmapped grads, their fp32 copies, the buffers). docs/attribution-graphs.md
    ("Memory") sets it beside a measured peak."""
    adjacency = n_nodes * n_nodes * (4 + 1)
    per_token_layer = 16 * cfg.d_model + cfg.n_heads * n_pos + 3 * cfg.d_mlp
    forward = copies * n_pos * cfg.n_layers * per_token_layer * bytes_per
    grads = 4 * batch_size * n_pos * (cfg.n_layers + 1) * cfg.d_model * 4
    return adjacency + forward + grads


def graph_memory_bytes(n_pos: int, n_feat: int, n_logits: int, cap: int, batch_size: int, cfg: Any,
                       bytes_per: int = 4, vmap: bool = True, write_values: int = 0) -> int:
    """What attribution_graph's memory budget charges a prompt of `n_pos` tokens with `n_feat` active features, the
    `cap` most influential kept (max_feature_nodes):
    - estimate_memory_bytes over the kept nodes;
    - every active feature's encoder row (d_model values) and its four indices, held from phase 0 to the end;
    - `write_values` fp32-sized values for the features' writes (Writes.values: one d_model row per distinct
      feature and layer it writes, a CLT feature of layer L writing n_layers - L, plus a few indices per write);
    - while features are chosen, the rows of the kept features and logits over *every* node, 4 * (cap + n_logits)
      * all nodes: what grows with a long prompt's active features and bounds its length; and partial_influences'
      [rows, rows] block and column chunk (it never copies the rows themselves).
    bench/studies/longest_prompt.py measures a process's peak against it (docs/features.md, "The longest prompt", and
    docs/cross-layer-transcoders.md)."""
    cap = min(cap, n_feat)
    other = cfg.n_layers * n_pos + n_pos + n_logits  # error, embedding and logit nodes
    rows = min(batch_size, cap + n_logits)
    estimate = estimate_memory_bytes(other + cap, n_pos, rows, cfg, bytes_per, copies=1 if vmap else rows)
    estimate += n_feat * (4 * cfg.d_model + 4 * 8)
    if cap < n_feat:  # the rows attributed before the columns of unselected features are dropped
        held = 4 * (cap + n_logits) * (other + n_feat)
        estimate += held + 4 * (cap + n_logits) ** 2 + min(held, PARTIAL_INFLUENCE_CHUNK)
    return estimate + 4 * write_values


def largest_cap(budget: float, n_pos: int, n_feat: int, n_logits: int, batch_size: int, cfg: Any, bytes_per: int,
                vmap: bool, write_values: int) -> int:
    """The largest max_feature_nodes whose graph_memory_bytes fits `budget` (0 if none does), by bisection."""
    def need(cap: int) -> float:
        return graph_memory_bytes(n_pos, n_feat, n_logits, cap, batch_size, cfg, bytes_per, vmap, write_values)

    lo, hi = 0, n_feat
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
    return lo
