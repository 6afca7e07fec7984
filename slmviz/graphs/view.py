"""What the workbench's figure of a graph shows, chosen here so that plots/ only draws it: on a graph of thousands
of kept nodes, the most influential ones (embeddings, logits and pins always), and the largest kept edges among them.

    view = graph_view(p, labels=p.labels)          # GraphView: nodes, links, pinned, labels, ...
    slmviz.plots.subgraph.workbench_figure(view)   # the plotly Figure
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from .derived import kept_adjacency, node_index, node_influence

MAX_DRAWN = 600  # nodes drawn of a larger graph: the most influential first (embeddings and logits always)
MAX_LINKS = 400  # edges drawn: the largest |weight| first


@dataclass
class GraphView:
    """The part of a graph a figure draws: `nodes` (rows of the graph's nodes frame, in its order), `links`
    (source, target, weight among them, largest |weight| first), the `pinned` ids among the nodes, feature `labels`
    {node_id: text}, and what the axes and title name: the prompt, its tokens, the layer count and `n_kept`, the
    kept nodes the graph has in all (more than len(nodes) when only the top ones are drawn)."""

    nodes: pd.DataFrame
    links: pd.DataFrame
    prompt: str
    tokens: list[str]
    n_layers: int
    n_kept: int
    pinned: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)


def drawn_mask(graph: Any, max_nodes: int = MAX_DRAWN) -> np.ndarray:
    """The kept nodes to draw: all of them, or the `max_nodes` most influential (embeddings, logits and pinned
    nodes always) when there are more, so that a graph of thousands of nodes draws its top nodes first."""
    kept = graph.node_mask.numpy().copy()
    if kept.sum() <= max_nodes:
        return kept
    # a pruned graph's cumulative influence orders its nodes as their influence does (smallest first = most
    # influential), without another pass over the adjacency
    influence = -graph.influence.numpy() if graph.influence is not None else node_influence(graph).numpy()
    kinds = graph.nodes["kind"].to_numpy()
    always = np.isin(kinds, ["embedding", "logit"])
    index = node_index(graph)
    always[[index[p] for p in graph.workbench.pinned if p in index]] = True
    always &= kept
    rest = np.nonzero(kept & ~always)[0]
    room = max(max_nodes - int(always.sum()), 0)
    chosen = rest[np.argsort(-influence[rest], kind="stable")[:room]]
    out = always.copy()
    out[chosen] = True
    return out


def top_links(graph: Any, drawn: np.ndarray, max_links: int = MAX_LINKS) -> pd.DataFrame:
    """source, target, weight of the `max_links` largest kept edges among the `drawn` nodes."""
    rows = torch.from_numpy(np.nonzero(drawn)[0])
    a = kept_adjacency(graph)[rows][:, rows]
    dst, src = torch.nonzero(a, as_tuple=True)
    w = a[dst, src]
    order = w.abs().argsort(descending=True, stable=True)[:max_links]
    ids = graph.nodes["node_id"].to_numpy()[rows.numpy()]
    return pd.DataFrame({"source": ids[src[order].numpy()], "target": ids[dst[order].numpy()],
                         "weight": w[order].numpy()})


def graph_view(graph: Any, labels: dict[str, str] | None = None, max_nodes: int = MAX_DRAWN,
               max_links: int = MAX_LINKS) -> GraphView:
    """The workbench's view of `graph` (prune it first): at most `max_nodes` nodes (drawn_mask) and `max_links`
    edges (top_links), its pins, and `labels` for the hover text (e.g. graph.labels)."""
    drawn = drawn_mask(graph, max_nodes)
    nodes = graph.nodes[drawn]
    shown = set(nodes["node_id"])
    return GraphView(nodes=nodes, links=top_links(graph, drawn, max_links), prompt=graph.prompt,
                     tokens=list(graph.tokens), n_layers=graph.n_layers, n_kept=int(graph.node_mask.sum()),
                     pinned=[p for p in graph.workbench.pinned if p in shown], labels=dict(labels or {}))


__all__ = ["MAX_DRAWN", "MAX_LINKS", "GraphView", "drawn_mask", "graph_view", "top_links"]
