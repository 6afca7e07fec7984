"""Plotly figures of the attribution-graph workbench (slmviz.circuits.workbench): the graph with its pinned nodes
ringed and labels in the hover text, and the subgraph of the pinned nodes (supernodes as one node each).

Edges are drawn as a few traces (one per sign and width band, segments separated by None), not one trace per edge,
so a subgraph of a hundred nodes and a few thousand edges redraws in a browser at once. Nothing here runs the
model. Each node carries customdata [node_id, kind, ...] as in plots.attribution, which the app reads on click.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .attribution import KIND_STYLE, NEGATIVE, POSITIVE, attribution_graph_figure, node_xy

BANDS = 5  # edge width bands per sign
PIN_RING = "#8e44ad"


def _edge_traces(links: Any, where: dict[str, tuple[float, float]]) -> list[go.Scatter]:
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
            traces.append(go.Scatter(x=xs, y=ys, mode="lines", showlegend=False, hoverinfo="skip",
                                     line={"width": 0.7 + 6.0 * (b + 0.5) / BANDS, "color": colour}, opacity=0.55))
    return traces


def workbench_figure(graph: Any, labels: dict[str, str] | None = None, max_links: int = 400) -> go.Figure:
    """The pruned graph (plots.attribution) with each feature's label in its hover text and the pinned nodes
    ringed."""
    fig = attribution_graph_figure(graph, max_links=max_links)
    labels = labels or {}
    for trace in fig.data:
        if trace.mode == "lines":
            trace.hoverinfo = "skip"  # an edge's end points sit on its nodes: hovering there means the node
        elif trace.customdata is not None and labels:
            trace.text = [t + (f"<br><b>{labels[c[0]]}</b>" if c[0] in labels else "")
                          for t, c in zip(trace.text, trace.customdata, strict=True)]
    pinned = [p for p in graph.pinned if p in set(graph.nodes["node_id"][graph.node_mask.numpy()])]
    if pinned:
        kept = graph.nodes[graph.node_mask.numpy()]
        x, y = node_xy(kept, graph.n_layers)
        where = {nid: (xi, yi) for nid, xi, yi in zip(kept["node_id"], x, y, strict=True)}
        fig.add_trace(go.Scatter(
            x=[where[p][0] for p in pinned], y=[where[p][1] for p in pinned], mode="markers", name="pinned",
            hoverinfo="skip", marker={"symbol": "circle-open", "size": 19, "color": PIN_RING, "line": {"width": 3}}))
    fig.update_layout(title=f"Attribution graph: {graph.prompt!r} (click a node for its card; ringed: pinned)")
    return fig


def subgraph_figure(sg: Any, height: int = 520) -> go.Figure:
    """The subgraph's nodes at (position, layer), labelled, supernodes as large diamonds; edges as in the graph."""
    nodes = sg.nodes
    fig = go.Figure()
    if not len(nodes):
        fig.update_layout(title="Subgraph: pin nodes to see them here", template="plotly_white", height=height)
        return fig
    x = nodes["position"].to_numpy(dtype=float).copy()
    y = np.where(nodes["kind"] == "embedding", 0.0,
                 np.where(nodes["kind"] == "logit", sg.n_layers + 1.0, nodes["layer"].to_numpy(dtype=float) + 1.0))
    seen: dict[tuple[float, float], int] = {}
    for i, key in enumerate(zip(x.tolist(), y.tolist(), strict=True)):  # nodes of one cell side by side
        j = seen.get(key, 0)
        seen[key] = j + 1
        x[i] += 0.22 * j
    where = {nid: (xi, yi) for nid, xi, yi in zip(nodes["node_id"], x, y, strict=True)}
    for trace in _edge_traces(sg.links, where):
        fig.add_trace(trace)
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
        fig.add_trace(go.Scatter(
            x=x[sel], y=y[sel], mode="markers+text", name=kind, text=short, textposition=where_text,
            hovertext=hover, hoverinfo="text", customdata=[[n, kind] for n in part["node_id"]],
            marker={"symbol": symbol, "color": colour, "size": 20 if kind == "supernode" else 12,
                    "line": {"width": 1, "color": "#333"}}))
    s = sg.scores
    fig.update_layout(
        title=f"Subgraph of {len(nodes)} nodes: replacement {s['replacement']:.3f}, completeness "
              f"{s['completeness']:.3f}",
        template="plotly_white", height=height,
        xaxis={"title": "position", "tickmode": "array", "tickvals": list(range(len(sg.tokens))),
               "ticktext": [f"{i}: {t!r}" for i, t in enumerate(sg.tokens)]},
        yaxis={"title": "layer", "tickmode": "array", "tickvals": list(range(sg.n_layers + 2)),
               "ticktext": ["emb", *[str(L) for L in range(sg.n_layers)], "logit"], "range": [-0.7, sg.n_layers + 1.7]},
        legend={"orientation": "h"})
    return fig
