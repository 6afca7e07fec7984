"""Pruning an attribution graph by influence: circuit-tracer's graph.prune_graph, formula for formula.

Influence: normalise |A| so each target's incoming weights sum to 1 (row-normalised), weight the logits by their
probabilities, and sum that weight over every path into each node: w·Â + w·Â² + ... = w·((I - Â)⁻¹ - I). The graph is
acyclic (sources only reach later layers), so the series ends after at most depth-many terms.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def normalize_matrix(matrix: torch.Tensor) -> torch.Tensor:
    """|A| with each row (a target's incoming edges) scaled to sum 1 (rows of zeros stay zero). Scaled in place, in
    the one copy `abs` makes: a full set's unpruned graph has tens of thousands of nodes, gigabytes a copy, and a
    second copy for the quotient ran the bench that scores such graphs out of memory (docs/attribution-graphs.md,
    "Memory")."""
    normalized = matrix.abs()
    return normalized.div_(normalized.sum(dim=1, keepdim=True).clamp(min=1e-10))


ROW_BLOCK_BYTES = 2**26  # how much of |A| RowNormalizedAbs materialises at a time


class RowNormalizedAbs:
    """Â (normalize_matrix's row-normalised |A|) as an operator read off A a block of rows at a time, never held.

    Scoring an unpruned graph needs only products with Â, and a full set's graph of a long prompt has ~50k nodes:
    its adjacency is ~10 GB in fp32, and a normalised copy doubled that past a 23 GB machine (docs/attribution-
    graphs.md, "Memory"). The same Â, up to the order of float operations: the rows' scale is applied to the
    vector (`vec * 1/rowsum`) rather than to |A|, and rows of zeros stay zero (their sum is clamped as in
    normalize_matrix).
    """

    def __init__(self, matrix: torch.Tensor, block_bytes: int = ROW_BLOCK_BYTES) -> None:
        self.matrix = matrix
        n_rows, n_cols = matrix.shape
        self.step = max(1, block_bytes // (matrix.element_size() * max(n_cols, 1)))
        self.blocks = [(s, min(s + self.step, n_rows)) for s in range(0, n_rows, self.step)]
        sums = torch.cat([matrix[s:e].abs().sum(1) for s, e in self.blocks]) if n_rows else matrix.new_zeros(0)
        self.inverse = 1 / sums.clamp(min=1e-10)
        self.shape = matrix.shape
        self.dtype = matrix.dtype

    def vecmat(self, vec: torch.Tensor) -> torch.Tensor:
        """vec @ Â. Blocks where vec is zero are skipped: on a graph, whole layers carry no weight yet."""
        out = self.matrix.new_zeros(self.shape[1])
        for s, e in self.blocks:
            weights = vec[s:e] * self.inverse[s:e]
            if weights.any():
                out += weights @ self.matrix[s:e].abs()
        return out

    def row_sums(self, columns: slice) -> torch.Tensor:
        """Â[:, columns].sum(1): each row's normalised weight from those columns (graph_scores' error share)."""
        return torch.cat([self.matrix[s:e, columns].abs().sum(1) for s, e in self.blocks]) * self.inverse


def _vecmat(vec: torch.Tensor, a: torch.Tensor | RowNormalizedAbs) -> torch.Tensor:
    return a.vecmat(vec) if isinstance(a, RowNormalizedAbs) else vec @ a


def influence_terms(a: torch.Tensor | RowNormalizedAbs, logit_weights: torch.Tensor, max_iter: int = 1000
                    ) -> Iterator[torch.Tensor]:
    """logit_weights · Âˡ for l = 1, 2, ... (the weight of the paths of exactly l edges into each node), until a term
    is exactly zero (a DAG's paths end); RuntimeError when a term past `max_iter` is not (a cycle). `a` is Â itself
    (normalize_matrix) or RowNormalizedAbs over A."""
    current = _vecmat(logit_weights, a)
    for _ in range(max_iter):
        if not current.any():
            return
        yield current
        current = _vecmat(current, a)
    if current.any():
        raise RuntimeError(f"influence did not converge after {max_iter} iterations: the graph has a cycle")


def compute_influence(a: torch.Tensor | RowNormalizedAbs, logit_weights: torch.Tensor, max_iter: int = 1000
                      ) -> torch.Tensor:
    """logit_weights · (Â + Â² + ...), summed until a term is exactly zero (a DAG's paths end)."""
    start = logit_weights.new_zeros(a.shape[1], dtype=a.dtype)
    return sum(influence_terms(a, logit_weights, max_iter), start=start)


def find_threshold(scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """The score at which the largest scores first reach `threshold` of their total (circuit-tracer's rule)."""
    sorted_scores = torch.sort(scores, descending=True).values
    cumulative = torch.cumsum(sorted_scores, dim=0) / torch.sum(sorted_scores)
    index = min(int(torch.searchsorted(cumulative, threshold)), len(cumulative) - 1)
    return sorted_scores[index]


def prune_masks(
    adjacency: torch.Tensor, logit_probabilities: torch.Tensor, n_logits: int, n_tokens: int, n_features: int,
    node_threshold: float = 0.8, edge_threshold: float = 0.98,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(node_mask [n], edge_mask [n, n], cumulative influence [n]) of circuit-tracer's prune_graph.

    Node order: features, errors, embeddings (n_tokens), logits (n_logits), as in the adjacency.
    """
    for name, value in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be between 0.0 and 1.0, got {value!r}")
    n = adjacency.shape[0]
    logit_weights = torch.zeros(n)
    logit_weights[n - n_logits:] = logit_probabilities.float()

    node_influence = compute_influence(normalize_matrix(adjacency), logit_weights)
    node_mask = node_influence >= find_threshold(node_influence, node_threshold)
    node_mask[n - n_logits - n_tokens:] = True  # embeddings and logits always stay

    pruned = adjacency.clone()
    pruned[~node_mask] = 0
    pruned[:, ~node_mask] = 0
    normalized_pruned = normalize_matrix(pruned)
    edge_influence = compute_influence(normalized_pruned, logit_weights) + logit_weights
    edge_scores = normalized_pruned * edge_influence[:, None]
    edge_mask = edge_scores >= find_threshold(edge_scores.flatten(), edge_threshold)
    # At a threshold of 1.0 (or when the cut falls among zero scores) circuit-tracer's rule keeps edges of score 0,
    # i.e. every (target, source) pair whose weight is 0: n² links of nothing. Only edges that exist are kept.
    edge_mask &= adjacency != 0

    inner = n - n_logits - n_tokens  # features and errors
    old = node_mask.clone()
    node_mask[:inner] &= edge_mask[:, :inner].any(0)  # a feature or error needs a kept outgoing edge
    node_mask[:n_features] &= edge_mask[:n_features].any(1)  # a feature needs a kept incoming edge
    while not torch.equal(node_mask, old):  # each removal may strand another node; at most depth rounds
        old[:] = node_mask
        edge_mask[~node_mask] = False
        edge_mask[:, ~node_mask] = False
        node_mask[:inner] &= edge_mask[:, :inner].any(0)
        node_mask[:n_features] &= edge_mask[:n_features].any(1)

    sorted_scores, order = torch.sort(node_influence, descending=True)
    cumulative = torch.cumsum(sorted_scores, dim=0) / torch.sum(sorted_scores)
    scores = torch.zeros_like(node_influence)
    scores[order] = cumulative
    return node_mask, edge_mask, scores


def graph_scores(adjacency: torch.Tensor, logit_probabilities: torch.Tensor, n_features: int, n_errors: int,
                 n_tokens: int) -> dict[str, float]:
    """circuit-tracer's compute_graph_scores: how much of the graph's computation runs through features rather than
    error nodes.

    replacement: of the influence that embeddings and errors have on the logits, the share of the embeddings' (1
    when every path from a token to a logit runs through features only). completeness: each node's incoming
    weight not from error nodes (row-normalised |A|), averaged with the node's influence on the logits (plus the
    logits' own probabilities) as weights; partial credit for nodes mostly explained by features.
    """
    n = adjacency.shape[0]
    n_logits = len(logit_probabilities)
    logit_weights = torch.zeros(n)
    logit_weights[n - n_logits:] = logit_probabilities.float()
    normalized = RowNormalizedAbs(adjacency)  # an unpruned graph's adjacency can be most of the machine's memory
    influence = compute_influence(normalized, logit_weights)
    error_start, error_end = n_features, n_features + n_errors
    tokens = influence[error_end:error_end + n_tokens].sum()
    errors = influence[error_start:error_end].sum()
    replacement = tokens / (tokens + errors)
    non_error = 1 - normalized.row_sums(slice(error_start, error_end))
    weights = influence + logit_weights
    completeness = (non_error * weights).sum() / weights.sum()
    return {"replacement": float(replacement), "completeness": float(completeness)}


def mean_path_length(adjacency: torch.Tensor, logit_probabilities: torch.Tensor, n_features: int, n_errors: int,
                     n_tokens: int, max_iter: int = 1000) -> float:
    """The influence-weighted mean number of edges on the graph's paths from a token to a logit (Ameisen et al.
    2025 compare it between replacement models: 2.3 steps for their CLT, 3.7 for their PLTs).

    A path's weight is its logit's probability times the product of its row-normalised |A| entries (the weights
    compute_influence sums), so the mass of the paths of exactly l edges that end at the tokens is
    (w · Â^l)[tokens], and the mean is Σ l·mass_l / Σ mass_l. Paths that end at an error node are left out: an
    error node has no inputs, so its path says nothing about how the token got there. 1.0 when every token writes
    its logit directly; nan when no path reaches a token. Node order as graph_scores: features, errors, tokens,
    logits."""
    n = adjacency.shape[0]
    weights = torch.zeros(n, dtype=adjacency.dtype)
    weights[n - len(logit_probabilities):] = logit_probabilities.to(adjacency.dtype)
    # In the adjacency's dtype and without a normalised copy, as graph_scores: a float64 copy of a full set's
    # unpruned graph is several times the adjacency, past a laptop's memory (docs/attribution-graphs.md, "Memory")
    start = n_features + n_errors
    mass = weighted = 0.0
    for length, term in enumerate(influence_terms(RowNormalizedAbs(adjacency), weights, max_iter), start=1):
        reached = float(term[start:start + n_tokens].sum())
        mass, weighted = mass + reached, weighted + length * reached
    return weighted / mass if mass > 0 else float("nan")
