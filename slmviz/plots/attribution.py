"""Plotly figure of an attribution graph (slmviz.graphs.graph): nodes by position (x) and layer (y).

Rows bottom to top: the token embeddings, each layer's features and error nodes, the logits on top. Each token
position has a column as wide as its fullest (layer, position) cell needs (spread_columns), so the position where
most nodes are gets most of the width and the nodes of one cell sit side by side without overlapping. An edge
runs from its source to its target, width |weight| (relative to the largest shown), colour its sign.
Each node carries customdata [node_id, kind, layer, position, feature, hook], which the app reads on click to open a
feature's page. Nothing here runs the model or computes anything about the graph: the figures read what they are
given and place it.

The node markers, their hover text and the axes are shared with plots.subgraph's workbench figure.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def spread_columns(positions: Sequence[int], rows: Sequence[float], widths: Sequence[float],
                   min_widths: Sequence[float], marker: float) -> tuple[list[float], list[float]]:
    """Where to draw nodes so that the nodes of one (row, position) cell sit side by side: each node takes
    `widths[i]` along x (its marker, `marker` wide, then any room for its label), in the order given (put the most
    influential first); each position's column is as wide as its widest cell (at least `min_widths[p]`, so that a
    position without nodes keeps a narrow column and its token name fits); a cell sits centred in its column.

    Returns (x of each marker's centre, the columns' edges: len(min_widths) + 1 values from 0). Plain Python, one
    pass, in the order the page's JavaScript twin (app/tabs/graph_readable.py's DRAW_JS) repeats exactly: a change
    here that is not made there makes the page's redraw differ from the server's figure."""
    cell_width: dict[tuple[float, int], float] = {}
    for p, r, w in zip(positions, rows, widths, strict=True):
        cell_width[(r, p)] = cell_width.get((r, p), 0.0) + w
    column = list(min_widths)
    for (_, p), w in cell_width.items():
        column[p] = max(column[p], w)
    edges = [0.0]
    for w in column:
        edges.append(edges[-1] + w)
    cursor: dict[tuple[float, int], float] = {}
    x = []
    for p, r, w in zip(positions, rows, widths, strict=True):
        at = cursor.get((r, p), edges[p] + (column[p] - cell_width[(r, p)]) / 2)
        x.append(at + marker / 2)
        cursor[(r, p)] = at + w
    return x, edges


def node_xy(nodes: Any, n_layers: int, n_positions: int) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """(x, y) of each node and the x of each position's column centre: a node one unit wide, its cell's nodes side
    by side in the frame's order (spread_columns; each column at least 2 units); y = node_y."""
    positions = nodes["position"].to_numpy(dtype=int).tolist()
    y = node_y(nodes["kind"], nodes["layer"], n_layers)
    x, edges = spread_columns(positions, y.tolist(), [1.0] * len(positions), [2.0] * n_positions, 1.0)
    return np.asarray(x), y, [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)]


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


def axes(tokens: list[str], n_layers: int, centres: Sequence[float] | None = None) -> dict[str, Any]:
    """The x axis named by position and token (at each column's centre, `centres`, from node_xy; by default at
    0, 1, ...), the y axis by row (emb, each layer, logit)."""
    ticks = list(centres) if centres is not None else list(range(len(tokens)))
    return {"xaxis": {"title": {"text": "position"}, "tickmode": "array", "tickvals": ticks,
                      "ticktext": [f"{i}: {t!r}" for i, t in enumerate(tokens)]},
            "yaxis": {"title": {"text": "layer"}, "tickmode": "array", "tickvals": list(range(n_layers + 2)),
                      "ticktext": ["emb", *[str(L) for L in range(n_layers)], "logit"]}}


def attribution_graph_figure(graph: Any, max_links: int = 400, title: str | None = None) -> go.Figure:
    """The kept nodes and the `max_links` largest kept links of an AttributionGraph (prune it first: an unpruned
    graph of a real prompt has thousands of nodes)."""
    kept = graph.kept_nodes
    x, y, centres = node_xy(kept, graph.n_layers, len(graph.tokens))
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
              "height": 650, **axes(graph.tokens, graph.n_layers, centres), "legend": {"orientation": "h"}}
    return figure(traces, layout)
