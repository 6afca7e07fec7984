"""Plotly figures of the attribution-graph workbench: the graph with its pinned nodes ringed and labels in the hover
text (from a graphs.view.GraphView, which chose the nodes and edges to draw), and the subgraph of the pinned nodes
(a graphs.subgraph.Subgraph, supernodes as one node each).

Edges are drawn as a few traces (one per sign and width band, segments separated by None), not one trace per edge,
so a subgraph of a hundred nodes and a few thousand edges redraws in a browser at once. Nothing here runs the
model or computes anything about the graph. Each node carries customdata [node_id, kind, ...] as in
plots.attribution, which the app reads on click.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .attribution import KIND_STYLE, NEGATIVE, POSITIVE, TEMPLATE, axes, figure, node_traces, node_xy, node_y

BANDS = 5  # edge width bands per sign
PIN_RING = "#8e44ad"


def _edge_traces(links: Any, where: dict[str, tuple[float, float]]) -> list[dict[str, Any]]:
    """Few traces for many edges: one per (sign, width band), width ~ |weight| / the largest."""
    if not len(links):
        return []
    weights = links["weight"].to_numpy(dtype=float)
    biggest = float(np.abs(weights).max()) or 1.0
    band = np.minimum((BANDS * np.abs(weights) / biggest).astype(int), BANDS - 1)
    traces = []
    for sign, colour in ((1, POSITIVE), (-1, NEGATIVE)):
        for b in range(BANDS):
            sel = (np.sign(weights) == sign) & (band == b)
            if not sel.any():
                continue
            xs: list[float | None] = []
            ys: list[float | None] = []
            for source, target in zip(links["source"].to_numpy()[sel], links["target"].to_numpy()[sel], strict=True):
                (x0, y0), (x1, y1) = where[source], where[target]
                xs += [x0, x1, None]
                ys += [y0, y1, None]
            traces.append({"type": "scatter", "x": xs, "y": ys, "mode": "lines", "showlegend": False,
                           "hoverinfo": "skip", "line": {"width": 0.7 + 6.0 * (b + 0.5) / BANDS, "color": colour},
                           "opacity": 0.55})
    return traces


def workbench_figure(view: Any) -> go.Figure:
    """A graph's view (graphs.view.graph_view: the nodes and edges to draw, pins, labels) by position and layer, as
    plots.attribution draws a graph, edges in a few width bands, each feature's label in its hover text, the pinned
    nodes ringed."""
    nodes = view.nodes
    x, y, centres = node_xy(nodes, view.n_layers, len(view.tokens))
    where = {nid: (xi, yi) for nid, xi, yi in zip(nodes["node_id"], x, y, strict=True)}
    traces = _edge_traces(view.links, where) + node_traces(nodes, x, y, view.labels)
    pinned = [p for p in view.pinned if p in where]
    if pinned:
        traces.append({"type": "scatter", "x": [where[p][0] for p in pinned], "y": [where[p][1] for p in pinned],
                       "mode": "markers", "name": "pinned", "hoverinfo": "skip",
                       "marker": {"symbol": "circle-open", "size": 19, "color": PIN_RING, "line": {"width": 3}}})
    shown = f"; the top {len(nodes)} of {view.n_kept} nodes by influence" if len(nodes) < view.n_kept else ""
    layout = {
        "title": {"text": f"Attribution graph: {view.prompt!r} (click a node for its card; ringed: pinned{shown})"},
        "template": TEMPLATE, "height": 650, **axes(view.tokens, view.n_layers, centres),
        "legend": {"orientation": "h"}}
    return figure(traces, layout)


def subgraph_figure(sg: Any, height: int = 520) -> go.Figure:
    """The subgraph's nodes at (position, layer), labelled, supernodes as large diamonds; edges as in the graph."""
    nodes = sg.nodes
    if not len(nodes):
        return figure([], {"title": {"text": "Subgraph: pin nodes to see them here"}, "template": TEMPLATE,
                           "height": height})
    x = nodes["position"].to_numpy(dtype=float).copy()
    y = node_y(nodes["kind"], nodes["layer"], sg.n_layers)
    seen: dict[tuple[float, float], int] = {}
    for i, key in enumerate(zip(x.tolist(), y.tolist(), strict=True)):  # nodes of one cell side by side
        j = seen.get(key, 0)
        seen[key] = j + 1
        x[i] += 0.22 * j
    where = {nid: (xi, yi) for nid, xi, yi in zip(nodes["node_id"], x, y, strict=True)}
    traces = _edge_traces(sg.links, where)
    style = {**KIND_STYLE, "supernode": ("diamond-wide", "#8e44ad")}
    for kind, (symbol, colour) in style.items():
        sel = (nodes["kind"] == kind).to_numpy()
        if not sel.any():
            continue
        part = nodes[sel]
        hover = [f"{r.node_id} ({r.kind})<br>{r.label}" + (f"<br>{len(r.members)} members: {', '.join(r.members[:8])}"
                                                          if r.kind == "supernode" else "")
                 for r in part.itertuples(index=False)]
        short = [str(t)[:28] for t in part["label"]]
        where_text = ["top center" if i % 2 == 0 else "bottom center" for i in range(len(short))]  # less overlap
        traces.append({"type": "scatter", "x": x[sel].tolist(), "y": y[sel].tolist(), "mode": "markers+text",
                       "name": kind, "text": short, "textposition": where_text, "hovertext": hover,
                       "hoverinfo": "text", "customdata": [[n, kind] for n in part["node_id"]],
                       "marker": {"symbol": symbol, "color": colour, "size": 20 if kind == "supernode" else 12,
                                  "line": {"width": 1, "color": "#333"}}})
    s = sg.scores
    frame = axes(list(sg.tokens), sg.n_layers)
    frame["yaxis"]["range"] = [-0.7, sg.n_layers + 1.7]
    layout = {
        "title": {"text": f"Subgraph of {len(nodes)} nodes: replacement {s['replacement']:.3f}, completeness "
                          f"{s['completeness']:.3f}"},
        "template": TEMPLATE, "height": height, **frame, "legend": {"orientation": "h"}}
    return figure(traces, layout)
