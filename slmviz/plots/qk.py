"""The figure of a QK attribution (slmviz.graphs.qk): the largest query-side nodes against the largest key-side
nodes, each cell the contribution of that pair to the attention score (diverging, centred at 0).

A QKAttribution and the block of pair contributions to draw (graphs.qk.top_block, which QKAttribution.plot passes)
in, a Figure out: nothing here runs the model or computes attributions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from .patch import DIVERGING
from .trace import show_token


def node_names(frame: Any, tokens: list[str]) -> list[str]:
    """One axis label per side row: 'kind node_id @ position (token): label' shortened to fit."""
    out = []
    for nid, kind, pos, label in zip(frame["node"], frame["kind"], frame["position"], frame["label"], strict=True):
        where = f" @{int(pos)} {show_token(tokens[int(pos)])}" if int(pos) >= 0 and tokens else ""
        text = f"{kind} {nid}{where}" if kind != "bias" else "bias"
        if label and kind == "feature":
            text += f": {label[:40]}"
        out.append(text)
    return out


def qk_figure(qk: Any, q_frame: Any, k_frame: Any, block: np.ndarray, height: int | None = None) -> go.Figure:
    """The query-side rows `q_frame` x the key-side rows `k_frame` (the sides' largest by |contribution|), each cell
    the pair's contribution `block[i, j]`; the title gives the entry, the score and the pattern."""
    y, x = node_names(q_frame, qk.tokens), node_names(k_frame, qk.tokens)
    biggest = float(np.abs(block).max()) if block.size else 1.0
    heat = go.Heatmap(z=block, x=x, y=y, colorscale=DIVERGING, zmid=0, zmin=-biggest, zmax=biggest, xgap=1, ygap=1,
                      colorbar={"title": {"text": "contribution"}},
                      hovertemplate="query: %{y}<br>key: %{x}<br>contribution %{z:.4g}<extra></extra>")
    q_tok = show_token(qk.tokens[qk.query]) if qk.tokens else ""
    k_tok = show_token(qk.tokens[qk.key]) if qk.tokens else ""
    # two short lines, not one long one: a plot half a page wide clipped the one line at its right edge
    title = (f"Layer {qk.layer} head {qk.head}: query {qk.query} {q_tok} -> key {qk.key} {k_tok}<br>"
             f"<span style='font-size:12px'>score {qk.score:.3f}, pattern {qk.pattern:.3f}; the largest {len(y)} x "
             f"{len(x)} nodes of each side</span>")
    fig = go.Figure(heat)
    fig.update_layout(title={"text": title, "x": 0.01, "xanchor": "left"}, margin={"t": 80},
                      template="plotly_white", height=height or 260 + 28 * len(y),
                      xaxis={"title": {"text": "key side"}, "tickangle": -40},
                      yaxis={"title": {"text": "query side"}, "autorange": "reversed"})
    return fig


__all__ = ["node_names", "qk_figure"]
