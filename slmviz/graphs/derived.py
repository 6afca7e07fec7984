"""Values read off an attribution graph's data: the row of each node id, the adjacency its prune masks keep, and each
node's influence on the logits. The workbench, interventions and the graph's figure all ask for them, so each is
computed once per graph and kept in the graph's own cache (`AttributionGraph.derived`), never on another object.

The functions take any graph with `nodes`, `adjacency`, `node_mask`, `edge_mask`, `logit_probabilities` and a
`derived(name, make)` cache; they do not import the graph class, which imports them.
"""

from __future__ import annotations

from typing import Any

import torch

from .prune import compute_influence, normalize_matrix


def first_rows(node_ids: list[str]) -> dict[str, int]:
    """{node_id: row}, the first row of an id that occurs twice.

    circuit-tracer's ids collide where a layer-0 feature "0_{f}_{p}" meets the error node "0_{L}_{p}" of layer L = f.
    Features come first in the node order, so the feature keeps the id and that error node cannot be named; taking
    the last row instead would silently point every such feature id at an error node (a pin, a label or an
    intervention would land on the wrong node). Pinned by tests/test_workbench.py::
    test_a_colliding_id_names_the_layer_0_feature."""
    index: dict[str, int] = {}
    for i, nid in enumerate(node_ids):
        index.setdefault(nid, i)
    return index


def node_index(graph: Any) -> dict[str, int]:
    """{node_id: row} of every node of the graph, kept or not (first_rows)."""
    return graph.derived("node_index", lambda: first_rows(graph.nodes["node_id"].tolist()))


def kept_adjacency(graph: Any) -> torch.Tensor:
    """The adjacency with the prune masks applied: 0 wherever an edge or either of its nodes is not kept (what the
    graph's JSON links hold)."""
    def make() -> torch.Tensor:
        keep = graph.edge_mask & graph.node_mask[:, None] & graph.node_mask[None, :]
        return torch.where(keep, graph.adjacency, torch.zeros(()))
    return graph.derived("kept_adjacency", make)


def node_influence(graph: Any) -> torch.Tensor:
    """Each node's influence on the logits through the kept adjacency (circuit-tracer's, as prune computes it), the
    logits' own probabilities added so that they rank with the rest."""
    def make() -> torch.Tensor:
        a = kept_adjacency(graph)
        n_logits = len(graph.logit_probabilities)
        weights = torch.zeros(a.shape[0])
        weights[a.shape[0] - n_logits:] = graph.logit_probabilities.float()
        return compute_influence(normalize_matrix(a), weights) + weights
    return graph.derived("node_influence", make)


__all__ = ["first_rows", "kept_adjacency", "node_index", "node_influence"]
