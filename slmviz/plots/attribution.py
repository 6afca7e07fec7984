"""Plotly figure of an attribution graph (slmviz.graphs.graph): nodes by position (x) and layer (y).

Rows bottom to top: the token embeddings, each layer's features and error nodes, the logits on top. Nodes of one
(layer, position) cell are spread side by side inside the cell. An edge runs from its source to its target, width
|weight| (relative to the largest shown), colour its sign. Each node carries customdata [node_id, kind, layer,
position, feature, hook], which the app reads on click to open a feature's page. Nothing here runs the model or
computes anything about the graph: the figures read what they are given and place it.

The node markers, their hover text and the axes are shared with plots.subgraph's workbench figure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

NEGATIVE, POSITIVE = "#c0392b", "#2471a3"
KIND_STYLE = {  # kind -> (marker symbol, colour)
    "embedding": ("square", "#7f8c8d"), "feature": ("circle", "#e67e22"),
    "error": ("diamond", "#bdc3c7"), "logit": ("square", "#27ae60"),
}
TEMPLATE = pio.templates["plotly_white"]
CUSTOMDATA = ["node_id", "kind", "layer", "position", "feature", "hook"]  # what a click on a node hands the app


def figure(traces: list[dict[str, Any]], layout: dict[str, Any]) -> go.Figure:
    """A Figure from plain dicts, without plotly's per-value validation (most of the time a figure of a few
    thousand points takes); the dicts here use valid keys only."""
    return go.Figure({"data": traces, "layout": layout}, _validate=False)


def node_y(kinds: Any, layers: Any, n_layers: int) -> np.ndarray:
    """The row of each node: 0 for embeddings, layer + 1 for features and errors, n_layers + 1 for logits."""
    kinds = np.asarray(kinds)
    return np.where(kinds == "embedding", 0.0,
                    np.where(kinds == "logit", n_layers + 1.0, np.asarray(layers, dtype=float) + 1.0))


def node_xy(nodes: Any, n_layers: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of each node: x = position plus an offset spreading a cell's nodes over [-0.4, 0.4]; y = node_y."""
    x = nodes["position"].to_numpy(dtype=float).copy()
    y = node_y(nodes["kind"], nodes["layer"], n_layers)
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


def node_traces(nodes: Any, x: np.ndarray, y: np.ndarray, labels: dict[str, str] | None = None
                ) -> list[dict[str, Any]]:
    """One marker trace per kind of node (rows of a graph's nodes frame at x, y): the hover text says what the node
    is (and its label in bold, if `labels` has one), the customdata is CUSTOMDATA."""
    labels = labels or {}
    traces = []
    for kind, (symbol, colour) in KIND_STYLE.items():
        sel = (nodes["kind"] == kind).to_numpy()
        if not sel.any():
            continue
        part = nodes[sel]
        text = [f"{r.kind} {r.node_id}<br>layer {r.layer}, position {r.position} ({r.token!r})"
                + (f"<br>feature {r.feature} of {r.hook}, activation {r.activation:.3g}" if r.kind == "feature" else "")
                + (f"<br>p = {r.probability:.3f}" if r.kind == "logit" else "")
                + (f"<br><b>{labels[r.node_id]}</b>" if r.node_id in labels else "")
                for r in part.itertuples(index=False)]
        traces.append({"type": "scatter", "x": x[sel].tolist(), "y": y[sel].tolist(), "mode": "markers", "name": kind,
                       "text": text, "hoverinfo": "text", "customdata": part[CUSTOMDATA].to_numpy().tolist(),
                       "marker": {"symbol": symbol, "color": colour, "size": 11 if kind != "error" else 8,
                                  "line": {"width": 1, "color": "#333"}}})
    return traces


def axes(tokens: list[str], n_layers: int) -> dict[str, Any]:
    """The x axis named by position and token, the y axis by row (emb, each layer, logit)."""
    return {"xaxis": {"title": {"text": "position"}, "tickmode": "array", "tickvals": list(range(len(tokens))),
                      "ticktext": [f"{i}: {t!r}" for i, t in enumerate(tokens)]},
            "yaxis": {"title": {"text": "layer"}, "tickmode": "array", "tickvals": list(range(n_layers + 2)),
                      "ticktext": ["emb", *[str(L) for L in range(n_layers)], "logit"]}}


def attribution_graph_figure(graph: Any, max_links: int = 400, title: str | None = None) -> go.Figure:
    """The kept nodes and the `max_links` largest kept links of an AttributionGraph (prune it first: an unpruned
    graph of a real prompt has thousands of nodes)."""
    kept = graph.kept_nodes
    x, y = node_xy(kept, graph.n_layers)
    where = {nid: (xi, yi) for nid, xi, yi in zip(kept["node_id"], x.tolist(), y.tolist(), strict=True)}
    links = graph.links.head(max_links)
    biggest = float(links["weight"].abs().max()) if len(links) else 1.0
    traces = []
    for sign, colour in ((1, POSITIVE), (-1, NEGATIVE)):
        part = links[np.sign(links["weight"]) == sign]
        for source, target, weight in part.itertuples(index=False):
            (x0, y0), (x1, y1) = where[source], where[target]
            traces.append({"type": "scatter", "x": [x0, x1], "y": [y0, y1], "mode": "lines", "showlegend": False,
                           "hoverinfo": "text", "text": f"{source} → {target}<br>weight {weight:.4g}",
                           "line": {"width": 0.5 + 6.0 * abs(weight) / (biggest or 1.0), "color": colour},
                           "opacity": 0.6})
    traces += node_traces(kept, x, y)
    layout = {"title": {"text": title or f"Attribution graph: {graph.prompt!r}"}, "template": TEMPLATE,
              "height": 650, **axes(graph.tokens, graph.n_layers), "legend": {"orientation": "h"}}
    return figure(traces, layout)
