"""Plotly figures of the attribution-graph workbench (slmviz.graphs.workbench): the graph with its pinned nodes
ringed and labels in the hover text, and the subgraph of the pinned nodes (supernodes as one node each).

Edges are drawn as a few traces (one per sign and width band, segments separated by None), not one trace per edge,
so a subgraph of a hundred nodes and a few thousand edges redraws in a browser at once. Nothing here runs the
model. Each node carries customdata [node_id, kind, ...] as in plots.attribution, which the app reads on click.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import torch

from .attribution import KIND_STYLE, NEGATIVE, POSITIVE, node_xy

BANDS = 5  # edge width bands per sign
TEMPLATE = pio.templates["plotly_white"]
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


MAX_DRAWN = 600  # nodes drawn of a larger graph: the most influential first (embeddings and logits always)


def drawn_mask(graph: Any, max_nodes: int = MAX_DRAWN) -> np.ndarray:
    """The kept nodes to draw: all of them, or the `max_nodes` most influential (embeddings, logits and pinned
    nodes always) when there are more, so that a graph of thousands of nodes draws its top nodes first."""
    kept = graph.node_mask.numpy().copy()
    if kept.sum() <= max_nodes:
        return kept
    from ..graphs.workbench import node_index, node_influence

    # a pruned graph's cumulative influence orders its nodes as their influence does (smallest first = most
    # influential), without another pass over the adjacency
    influence = -graph.influence.numpy() if graph.influence is not None else node_influence(graph).numpy()
    kinds = graph.nodes["kind"].to_numpy()
    always = np.isin(kinds, ["embedding", "logit"])
    index = node_index(graph)
    always[[index[p] for p in graph.pinned if p in index]] = True
    always &= kept
    rest = np.nonzero(kept & ~always)[0]
    room = max(max_nodes - int(always.sum()), 0)
    chosen = rest[np.argsort(-influence[rest], kind="stable")[:room]]
    out = always.copy()
    out[chosen] = True
    return out


def figure(traces: list[dict[str, Any]], layout: dict[str, Any]) -> go.Figure:
    """A Figure from plain dicts, without plotly's per-value validation (most of the time of a figure of a few
    thousand points: 0.3 s of 0.45 s for SmolLM2's pruned graph); the dicts here use valid keys only."""
    return go.Figure({"data": traces, "layout": layout}, _validate=False)


def _top_links(graph: Any, drawn: np.ndarray, max_links: int) -> pd.DataFrame:
    """source, target, weight of the `max_links` largest kept edges among the drawn nodes."""
    from ..graphs.workbench import kept_adjacency

    rows = torch.from_numpy(np.nonzero(drawn)[0])
    a = kept_adjacency(graph)[rows][:, rows]
    dst, src = torch.nonzero(a, as_tuple=True)
    w = a[dst, src]
    order = w.abs().argsort(descending=True, stable=True)[:max_links]
    ids = graph.nodes["node_id"].to_numpy()[rows.numpy()]
    return pd.DataFrame({"source": ids[src[order].numpy()], "target": ids[dst[order].numpy()],
                         "weight": w[order].numpy()})


def workbench_figure(graph: Any, labels: dict[str, str] | None = None, max_links: int = 400,
                     max_nodes: int = MAX_DRAWN) -> go.Figure:
    """The pruned graph by position and layer (as plots.attribution draws it, edges in a few width bands), each
    feature's label in its hover text, the pinned nodes ringed; at most `max_nodes` nodes (drawn_mask)."""
    labels = labels or {}
    drawn = drawn_mask(graph, max_nodes)
    kept = graph.nodes[drawn]
    x, y = node_xy(kept, graph.n_layers)
    where = {nid: (xi, yi) for nid, xi, yi in zip(kept["node_id"], x, y, strict=True)}
    links = _top_links(graph, drawn, max_links)
    traces = _edge_traces(links, where)
    for kind, (symbol, colour) in KIND_STYLE.items():
        sel = (kept["kind"] == kind).to_numpy()
        if not sel.any():
            continue
        part = kept[sel]
        text = [f"{r.kind} {r.node_id}<br>layer {r.layer}, position {r.position} ({r.token!r})"
                + (f"<br>feature {r.feature} of {r.hook}, activation {r.activation:.3g}" if r.kind == "feature" else "")
                + (f"<br>p = {r.probability:.3f}" if r.kind == "logit" else "")
                + (f"<br><b>{labels[r.node_id]}</b>" if r.node_id in labels else "")
                for r in part.itertuples(index=False)]
        custom = part[["node_id", "kind", "layer", "position", "feature", "hook"]].to_numpy().tolist()
        traces.append({"type": "scatter", "x": x[sel].tolist(), "y": y[sel].tolist(), "mode": "markers", "name": kind,
                       "text": text, "hoverinfo": "text", "customdata": custom,
                       "marker": {"symbol": symbol, "color": colour, "size": 11 if kind != "error" else 8,
                                  "line": {"width": 1, "color": "#333"}}})
    pinned = [p for p in graph.pinned if p in where]
    if pinned:
        traces.append({"type": "scatter", "x": [where[p][0] for p in pinned], "y": [where[p][1] for p in pinned],
                       "mode": "markers", "name": "pinned", "hoverinfo": "skip",
                       "marker": {"symbol": "circle-open", "size": 19, "color": PIN_RING, "line": {"width": 3}}})
    n_kept = int(graph.node_mask.sum())
    shown = f"; the top {len(kept)} of {n_kept} nodes by influence" if len(kept) < n_kept else ""
    ticks = list(range(len(graph.tokens)))
    layout = {
        "title": {"text": f"Attribution graph: {graph.prompt!r} (click a node for its card; ringed: pinned{shown})"},
        "template": TEMPLATE, "height": 650,
        "xaxis": {"title": {"text": "position"}, "tickmode": "array", "tickvals": ticks,
                  "ticktext": [f"{i}: {t!r}" for i, t in enumerate(graph.tokens)]},
        "yaxis": {"title": {"text": "layer"}, "tickmode": "array", "tickvals": list(range(graph.n_layers + 2)),
                  "ticktext": ["emb", *[str(L) for L in range(graph.n_layers)], "logit"]},
        "legend": {"orientation": "h"}}
    return figure(traces, layout)


def subgraph_figure(sg: Any, height: int = 520) -> go.Figure:
    """The subgraph's nodes at (position, layer), labelled, supernodes as large diamonds; edges as in the graph."""
    nodes = sg.nodes
    if not len(nodes):
        return figure([], {"title": {"text": "Subgraph: pin nodes to see them here"}, "template": TEMPLATE,
                           "height": height})
    x = nodes["position"].to_numpy(dtype=float).copy()
    y = np.where(nodes["kind"] == "embedding", 0.0,
                 np.where(nodes["kind"] == "logit", sg.n_layers + 1.0, nodes["layer"].to_numpy(dtype=float) + 1.0))
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
    layout = {
        "title": {"text": f"Subgraph of {len(nodes)} nodes: replacement {s['replacement']:.3f}, completeness "
                          f"{s['completeness']:.3f}"},
        "template": TEMPLATE, "height": height,
        "xaxis": {"title": {"text": "position"}, "tickmode": "array", "tickvals": list(range(len(sg.tokens))),
                  "ticktext": [f"{i}: {t!r}" for i, t in enumerate(sg.tokens)]},
        "yaxis": {"title": {"text": "layer"}, "tickmode": "array", "tickvals": list(range(sg.n_layers + 2)),
                  "ticktext": ["emb", *[str(L) for L in range(sg.n_layers)], "logit"],
                  "range": [-0.7, sg.n_layers + 1.7]},
        "legend": {"orientation": "h"}}
    return figure(traces, layout)
