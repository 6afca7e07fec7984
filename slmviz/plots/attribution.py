"""Plotly figure of an attribution graph (slmviz.graphs.attribution): nodes by position (x) and layer (y).

Rows bottom to top: the token embeddings, each layer's features and error nodes, the logits on top. Nodes of one
(layer, position) cell are spread side by side inside the cell. An edge runs from its source to its target, width
|weight| (relative to the largest shown), colour its sign. Each node carries customdata [node_id, kind, layer,
position, feature, hook], which the app reads on click to open a feature's page. Nothing here runs the model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

NEGATIVE, POSITIVE = "#c0392b", "#2471a3"
KIND_STYLE = {  # kind -> (marker symbol, colour)
    "embedding": ("square", "#7f8c8d"), "feature": ("circle", "#e67e22"),
    "error": ("diamond", "#bdc3c7"), "logit": ("square", "#27ae60"),
}


def node_xy(nodes: Any, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of each node: x = position plus an offset spreading a cell's nodes over [-0.4, 0.4]; y = layer + 1
    (0 for embeddings, n_layers + 1 for logits)."""
    x = nodes["position"].to_numpy(dtype=float).copy()
    y = np.where(nodes["kind"] == "embedding", 0.0,
                 np.where(nodes["kind"] == "logit", n_layers + 1.0, nodes["layer"].to_numpy(dtype=float) + 1.0))
    keys = list(zip(y.tolist(), x.tolist(), strict=True))
    counts: dict[tuple[float, float], int] = {}
    for k in keys:
        counts[k] = counts.get(k, 0) + 1
    seen: dict[tuple[float, float], int] = {}
    for i, k in enumerate(keys):
        n, j = counts[k], seen.get(k, 0)
        seen[k] = j + 1
        if n > 1:
            x[i] += -0.4 + 0.8 * j / (n - 1)
    return x, y


def attribution_graph_figure(graph: Any, max_links: int = 400, title: str | None = None) -> go.Figure:
    """The kept nodes and the `max_links` largest kept links of an AttributionGraph (prune it first: an unpruned
    graph of a real prompt has thousands of nodes)."""
    kept = graph.nodes[graph.node_mask.numpy()]
    x, y = node_xy(kept, graph.n_layers)
    where = {nid: (xi, yi) for nid, xi, yi in zip(kept["node_id"], x, y, strict=True)}
    links = graph.links.head(max_links)
    biggest = float(links["weight"].abs().max()) if len(links) else 1.0
    fig = go.Figure()
    for sign, colour in ((1, POSITIVE), (-1, NEGATIVE)):
        part = links[np.sign(links["weight"]) == sign]
        for source, target, weight in part.itertuples(index=False):
            (x0, y0), (x1, y1) = where[source], where[target]
            fig.add_trace(go.Scatter(
                x=[x0, x1], y=[y0, y1], mode="lines", showlegend=False, hoverinfo="text",
                text=f"{source} → {target}<br>weight {weight:.4g}",
                line={"width": 0.5 + 6.0 * abs(weight) / (biggest or 1.0), "color": colour}, opacity=0.6))
    for kind, (symbol, colour) in KIND_STYLE.items():
        sel = (kept["kind"] == kind).to_numpy()
        if not sel.any():
            continue
        part = kept[sel]
        label = [f"{r.kind} {r.node_id}<br>layer {r.layer}, position {r.position} ({r.token!r})"
                 + (f"<br>feature {r.feature} of {r.hook}, activation {r.activation:.3g}"
                    if r.kind == "feature" else "")
                 + (f"<br>p = {r.probability:.3f}" if r.kind == "logit" else "")
                 for r in part.itertuples(index=False)]
        custom = part[["node_id", "kind", "layer", "position", "feature", "hook"]].to_numpy().tolist()
        fig.add_trace(go.Scatter(
            x=x[sel], y=y[sel], mode="markers", name=kind, text=label, hoverinfo="text", customdata=custom,
            marker={"symbol": symbol, "color": colour, "size": 11 if kind != "error" else 8,
                    "line": {"width": 1, "color": "#333"}}))
    ticks = list(range(len(graph.tokens)))
    fig.update_layout(
        title=title or f"Attribution graph: {graph.prompt!r}", template="plotly_white", height=650,
        xaxis={"title": "position", "tickmode": "array", "tickvals": ticks,
               "ticktext": [f"{i}: {t!r}" for i, t in enumerate(graph.tokens)]},
        yaxis={"title": "layer", "tickmode": "array", "tickvals": list(range(graph.n_layers + 2)),
               "ticktext": ["emb", *[str(L) for L in range(graph.n_layers)], "logit"]},
        legend={"orientation": "h"})
    return fig
