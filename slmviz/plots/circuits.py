"""Plotly figures of circuits: the component graph's top edges drawn layer by layer, and the faithfulness curve.

A Circuit (slmviz.circuits) in, a Figure out; nothing here runs the model (Circuit.plot calls us), so the flow stays
one-way. Columns left to right: the input, then each layer's heads (one row per head) and its MLP (on a row of its
own, below head 0), then the logits. The nodes that an edge touches carry their names.
An edge runs from its source to the head (or MLP, or logits) that reads it: solid into a query, dashed into a key,
dotted into a value (a key or value edge ends at the first head of its KV group). Width is |score|, colour the sign.
Each edge carries customdata [source, target, score], which an app reads on click.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import plotly.graph_objects as go

NEGATIVE, POSITIVE = "#c0392b", "#2471a3"  # red: the corrupted value moves the metric down; blue: up
DASH = {"q": "solid", "k": "dash", "v": "dot", "": "solid"}
MLP_ROW = -1.5  # the MLPs' row: below head 0, apart from every head's
INPUT_X = -1.0  # the input's column: two layer steps left of layer 0's heads, so its tick label clears L0's


def node_position(name: str, n_layers: int, n_heads: int, n_kv_heads: int) -> tuple[float, float, str]:
    """(x, y, kind) of a source or destination node; a destination <q>/<k>/<v> is drawn at its head."""
    kind = ""
    if "<" in name:
        name, kind = name[: name.index("<")], name[name.index("<") + 1]
    middle = (n_heads - 1) / 2
    if name == "input":
        return INPUT_X, middle, kind
    if name == "logits":
        return 2.0 * n_layers + 1, middle, kind
    layer, _, rest = name[1:].partition(".")
    x = 1.0 + 2 * int(layer)
    if name.startswith("m"):
        return x + 1, MLP_ROW, kind
    index = int(rest[1:])
    head = index * (n_heads // n_kv_heads) if rest.startswith("g") else index  # a KV group: its first query head
    return x, float(head), kind


def circuit_graph(circuit: Any, n: int = 50, title: str | None = None) -> go.Figure:
    """The top-n edges of a Circuit layer by layer (see the module docstring)."""
    graph = circuit.graph
    top = circuit.top(n)
    L, h, g = graph.n_layers, graph.n_heads, graph.n_kv_heads
    biggest = float(top["score"].abs().max()) if len(top) else 1.0
    fig = go.Figure()
    for source, target, score in top.itertuples(index=False):
        x0, y0, _ = node_position(source, L, h, g)
        x1, y1, kind = node_position(target, L, h, g)
        width = 0.5 + 7.5 * abs(score) / (biggest or 1.0)
        fig.add_trace(go.Scatter(
            x=[x0, x1], y=[y0, y1], mode="lines", showlegend=False,
            line={"width": width, "color": NEGATIVE if score < 0 else POSITIVE, "dash": DASH[kind]},
            customdata=[[source, target, score]] * 2,
            hovertemplate=f"{source} → {target}<br>score {score:.4g}<extra></extra>",
        ))
    used = set(top["source"]) | {t[: t.index("<")] if "<" in t else t for t in top["target"]}
    nodes = ["input", *[f"a{layer}.h{i}" for layer in range(L) for i in range(h)],
             *[f"m{layer}" for layer in range(L)], "logits"]
    xs, ys, labels, colours = [], [], [], []
    for name in nodes:
        x, y, _ = node_position(name, L, h, g)
        xs.append(x)
        ys.append(y)
        labels.append(name)
        colours.append("#222" if name in used else "#ccc")
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", marker={"size": 7, "color": colours}, text=labels,
                             hovertemplate="%{text}<extra></extra>", showlegend=False))
    shown = [i for i, name in enumerate(labels) if name in used]  # the nodes of the drawn edges, named
    fig.add_trace(go.Scatter(x=[xs[i] for i in shown], y=[ys[i] for i in shown], mode="text",
                             text=[labels[i] for i in shown], textposition="top center", textfont={"size": 10},
                             hoverinfo="skip", showlegend=False))
    ticks = [INPUT_X, *[1.0 + 2 * layer for layer in range(L)], 2.0 * L + 1]
    tick_text = ["input", *[f"L{layer}" for layer in range(L)], "logits"]
    steps = f", {circuit.steps} steps" if getattr(circuit, "steps", None) else ""
    fig.update_layout(
        title=title or f"Top {len(top)} of {graph.n_edges} edges ({circuit.method}{steps}): {circuit.metric_name}",
        xaxis={"tickvals": ticks, "ticktext": tick_text, "title": "layer (heads, then MLP)", "showgrid": False,
               "zeroline": False},
        yaxis={"title": "head", "tickvals": [MLP_ROW, *range(h)], "ticktext": ["MLP", *map(str, range(h))],
               "showgrid": False, "range": [MLP_ROW - 1, h]},
        template="plotly_white", height=360 + 22 * h, margin={"t": 60, "l": 60, "r": 20, "b": 50},
    )
    return fig


def faithfulness_curve(frame: pd.DataFrame, title: str = "Faithfulness of the top-n circuit") -> go.Figure:
    """normalized metric against circuit size (log x): 0 = the corrupted run, 1 = the clean one."""
    sizes = frame["n_edges"].clip(lower=0.5)  # 0 edges drawn at the left edge of the log axis
    fig = go.Figure(go.Scatter(x=sizes, y=frame["normalized"], mode="lines+markers",
                               customdata=frame[["n_edges", "metric"]].to_numpy(),
                               hovertemplate="%{customdata[0]} edges<br>normalized %{y:.3f}<br>"
                                             "metric %{customdata[1]:.4g}<extra></extra>"))
    fig.add_hline(y=0.8, line={"dash": "dot", "color": "#888"})
    fig.update_layout(title=title, xaxis={"type": "log", "title": "edges in the circuit"},
                      yaxis={"title": "normalized metric"}, template="plotly_white", height=360)
    return fig
