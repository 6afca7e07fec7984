"""The Graph tab's readable drawing of a pruned attribution graph, which two sliders redraw in the page.

Tokens along the bottom, layers upward (embeddings at the bottom, logits on top), the nodes of one (layer,
position) cell side by side in order of influence, the most influential nodes labelled beside their marker, error
nodes small and pale, edges in two colours by sign. The server sends the pruned graph ONCE, inside the figure's
`layout.meta` (graph_payload: each node's place, kind, short label and influence rank; the strongest edges with
their weights), so the sliders redraw it in the browser with Plotly.react, no request and nothing recomputed:

- how many nodes to keep (the top n by influence; embeddings, logits and pinned nodes always);
- the smallest edge drawn, as a fraction of the largest edge's |weight|.

The drawing is written twice, on purpose and kept line for line alike: `draw` here (the first figure the server
sends, and what an API client gets) and DRAW_JS (every slider move). tests/test_graph_tab_browser.py pins that the
page's redraw at the sliders' first values gives the server's figure. Graphs of more than GL_FROM nodes draw their
markers with WebGL (scattergl): SVG markers make a redraw of thousands of points take seconds.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import plotly.graph_objects as go
import torch

from slmviz.features.labels import AUTO
from slmviz.graphs.derived import kept_adjacency, node_influence
from slmviz.plots.attribution import KIND_STYLE, NEGATIVE, POSITIVE, TEMPLATE, axes, figure, node_xy

MAX_NODES_SENT = 5000  # the most influential kept nodes the page receives (the keep slider's maximum)
MAX_EDGES_SENT = 20000  # the strongest edges among them
KEEP_DEFAULT, KEEP_MIN, KEEP_STEP = 200, 10, 10
MIN_WEIGHT_DEFAULT, MIN_WEIGHT_MAX, MIN_WEIGHT_STEP = 0.05, 1.0, 0.01
LABELLED = 40  # the most influential shown feature or logit of each cell carries its label beside the marker
LABEL_CHARS = 24
GL_FROM = 1000  # nodes sent from which the markers are drawn with WebGL
META_KEY = "slmviz_graph"
# kind -> (marker size, opacity): error nodes quieter than the features they stand beside
KIND_LOOK = {"embedding": (11, 1.0), "feature": (9, 0.95), "error": (6, 0.35), "logit": (11, 1.0)}


def influence_rank(graph: Any) -> np.ndarray:
    """Each node's rank by influence on the logits among the kept nodes (0 = the most influential; the pruned
    graph's cumulative influence orders them, smallest first, as graphs.view.drawn_mask reads it)."""
    score = -graph.influence.numpy() if graph.influence is not None else node_influence(graph).numpy()
    kept = np.nonzero(graph.node_mask.numpy())[0]
    rank = np.full(len(score), np.iinfo(np.int32).max, dtype=np.int64)
    rank[kept[np.argsort(-score[kept], kind="stable")]] = np.arange(len(kept))
    return rank


def short(text: Any, n: int = LABEL_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def graph_payload(graph: Any, labels: dict[str, str]) -> dict[str, Any]:
    """What the page needs to draw the pruned `graph` at any slider position: its MAX_NODES_SENT most influential
    kept nodes (x, y, kind, id, label, hover text, rank; rank -1 for those always drawn: embeddings, logits, pins)
    and the MAX_EDGES_SENT largest kept edges among them (source and target as indices into the nodes)."""
    rank = influence_rank(graph)
    kinds = graph.nodes["kind"].to_numpy()
    kept = np.nonzero(graph.node_mask.numpy())[0]
    pinned = set(graph.workbench.pinned)
    always = np.isin(kinds[kept], ["embedding", "logit"]) | graph.nodes["node_id"].iloc[kept].isin(pinned).to_numpy()
    order = kept[np.lexsort((rank[kept], ~always))]  # the always-drawn first, then by influence
    rows = np.sort(order[:MAX_NODES_SENT], kind="stable")
    rows = rows[np.argsort(rank[rows], kind="stable")]  # by influence: a cell's most influential node leftmost
    nodes = graph.nodes.iloc[rows]
    x, y = node_xy(nodes, graph.n_layers)
    ids = nodes["node_id"].tolist()
    # the keep slider counts the nodes it may hide: ranks 0, 1, ... among them, -1 for those always drawn
    always_sent = [k in ("embedding", "logit") or i in pinned for i, k in zip(ids, nodes["kind"], strict=True)]
    ranked = iter(range(len(ids)))  # rows are in influence order already
    shown_rank = [-1 if a else next(ranked) for a in always_sent]
    texts, hovers = [], []
    for r in nodes.itertuples(index=False):
        text = labels.get(r.node_id, "") if r.kind == "feature" else repr(r.token) if r.kind == "logit" else ""
        texts.append(short(text.removeprefix(AUTO)))  # the hover text says "[auto]"
        hovers.append(f"{r.kind} {r.node_id}<br>layer {r.layer}, position {r.position} ({r.token!r})"
                      + (f"<br>activation {r.activation:.3g}" if r.kind == "feature" else "")
                      + (f"<br>p = {r.probability:.3f}" if r.kind == "logit" else "")
                      + (f"<br><b>{labels[r.node_id]}</b>" if r.node_id in labels else ""))
    a = kept_adjacency(graph)[torch.from_numpy(rows)][:, torch.from_numpy(rows)]
    dst, src = torch.nonzero(a, as_tuple=True)
    w = a[dst, src]
    top = w.abs().argsort(descending=True, stable=True)[:MAX_EDGES_SENT]
    return {"ids": ids, "kind": nodes["kind"].tolist(), "x": np.round(x, 4).tolist(), "y": y.tolist(),
            "rank": shown_rank, "text": texts, "hover": hovers, "pinned": [i in pinned for i in ids],
            "src": src[top].tolist(), "dst": dst[top].tolist(), "w": [round(float(v), 6) for v in w[top]],
            "wmax": float(w.abs().max()) if len(w) else 0.0, "gl": len(ids) > GL_FROM,
            "style": {k: [*KIND_STYLE[k], *KIND_LOOK[k]] for k in KIND_STYLE},
            "colours": [POSITIVE, NEGATIVE], "labelled": LABELLED}


def draw(g: dict[str, Any], keep: float, min_weight: float) -> list[dict[str, Any]]:
    """The traces at slider values (keep, min_weight): DRAW_JS in Python (keep them alike)."""
    n = len(g["ids"])
    shown = [g["rank"][i] < keep for i in range(n)]
    cut = min_weight * g["wmax"]
    traces = []
    for sign, colour, name in ((1, g["colours"][0], "edges +"), (-1, g["colours"][1], "edges −")):
        xs: list[Any] = []
        ys: list[Any] = []
        for s, d, w in zip(g["src"], g["dst"], g["w"], strict=True):
            if shown[s] and shown[d] and abs(w) >= cut and w * sign > 0:
                xs += [g["x"][s], g["x"][d], None]
                ys += [g["y"][s], g["y"][d], None]
        traces.append({"type": "scattergl" if g["gl"] else "scatter", "x": xs, "y": ys, "mode": "lines",
                       "name": name, "hoverinfo": "skip", "line": {"color": colour, "width": 1}, "opacity": 0.45})
    for kind, (symbol, colour, size, opacity) in g["style"].items():
        sel = [i for i in range(n) if shown[i] and g["kind"][i] == kind]
        traces.append({"type": "scattergl" if g["gl"] else "scatter", "x": [g["x"][i] for i in sel],
                       "y": [g["y"][i] for i in sel], "mode": "markers", "name": kind,
                       "hovertext": [g["hover"][i] for i in sel], "hoverinfo": "text",
                       "customdata": [[g["ids"][i], kind] for i in sel],
                       "marker": {"symbol": symbol, "color": colour, "size": size, "opacity": opacity,
                                  "line": {"width": 0.5, "color": "#333"}}})
    named = [i for i in range(n) if shown[i] and g["text"][i] and g["kind"][i] in ("feature", "logit")]
    named = first_per_cell(g, sorted(named, key=lambda i: (g["rank"][i], i)))
    traces.append({"type": "scatter", "x": [g["x"][i] for i in named], "y": [g["y"][i] for i in named],
                   "mode": "text", "name": "labels", "text": [g["text"][i] for i in named],
                   "textposition": "middle right", "textfont": {"size": 10}, "hoverinfo": "skip"})
    ring = [i for i in range(n) if g["pinned"][i]]
    traces.append({"type": "scatter", "x": [g["x"][i] for i in ring], "y": [g["y"][i] for i in ring],
                   "mode": "markers", "name": "pinned", "hoverinfo": "skip",
                   "marker": {"symbol": "circle-open", "size": 17, "color": "#8e44ad", "line": {"width": 2}}})
    return traces


def first_per_cell(g: dict[str, Any], ordered: list[int]) -> list[int]:
    """The nodes to label: in `ordered`'s order, the first of each (row, position) cell (labels of one cell would
    overlap), at most g["labelled"]."""
    out: list[int] = []
    cells: set[tuple[float, int]] = set()
    for i in ordered:
        cell = (g["y"][i], round(g["x"][i]))  # a cell's nodes sit within 0.4 of its position
        if cell in cells:
            continue
        cells.add(cell)
        out.append(i)
        if len(out) == g["labelled"]:
            break
    return out


# DRAW_JS: `draw` above, in the page's JavaScript (keep them alike).
DRAW_JS = """
(g, keep, minWeight) => {
  const n = g.ids.length, shown = g.rank.map((r) => r < keep), cut = minWeight * g.wmax, traces = [];
  const type = g.gl ? 'scattergl' : 'scatter';
  [[1, g.colours[0], 'edges +'], [-1, g.colours[1], 'edges −']].forEach(([sign, colour, name]) => {
    const xs = [], ys = [];
    for (let e = 0; e < g.src.length; e++) {
      const s = g.src[e], d = g.dst[e], w = g.w[e];
      if (shown[s] && shown[d] && Math.abs(w) >= cut && w * sign > 0) {
        xs.push(g.x[s], g.x[d], null); ys.push(g.y[s], g.y[d], null);
      }
    }
    traces.push({type, x: xs, y: ys, mode: 'lines', name, hoverinfo: 'skip', line: {color: colour, width: 1},
                 opacity: 0.45});
  });
  for (const [kind, [symbol, colour, size, opacity]] of Object.entries(g.style)) {
    const sel = [];
    for (let i = 0; i < n; i++) if (shown[i] && g.kind[i] === kind) sel.push(i);
    traces.push({type, x: sel.map((i) => g.x[i]), y: sel.map((i) => g.y[i]), mode: 'markers', name: kind,
                 hovertext: sel.map((i) => g.hover[i]), hoverinfo: 'text', customdata: sel.map((i) => [g.ids[i], kind]),
                 marker: {symbol, color: colour, size, opacity, line: {width: 0.5, color: '#333'}}});
  }
  const named = [];
  for (let i = 0; i < n; i++) {
    if (shown[i] && g.text[i] && (g.kind[i] === 'feature' || g.kind[i] === 'logit')) named.push(i);
  }
  named.sort((a, b) => (g.rank[a] - g.rank[b]) || (a - b));
  const top = [], cells = new Set();
  for (const i of named) {
    const cell = g.y[i] + '|' + Math.round(g.x[i]);
    if (cells.has(cell)) continue;
    cells.add(cell);
    top.push(i);
    if (top.length === g.labelled) break;
  }
  traces.push({type: 'scatter', x: top.map((i) => g.x[i]), y: top.map((i) => g.y[i]), mode: 'text', name: 'labels',
               text: top.map((i) => g.text[i]), textposition: 'middle right', textfont: {size: 10}, hoverinfo: 'skip'});
  const ring = [];
  for (let i = 0; i < n; i++) if (g.pinned[i]) ring.push(i);
  traces.push({type: 'scatter', x: ring.map((i) => g.x[i]), y: ring.map((i) => g.y[i]), mode: 'markers',
               name: 'pinned', hoverinfo: 'skip',
               marker: {symbol: 'circle-open', size: 17, color: '#8e44ad', line: {width: 2}}});
  return traces;
}
"""


def redraw_js(plot_id: str, keep_id: str, weight_id: str, delay_ms: int = 0) -> str:
    """The sliders' event (Gradio `fn=None, js=...`): redraw the figure in #plot_id from the graph in its
    layout.meta, in the page, at the values the sliders #keep_id and #weight_id show when it runs (read there, not
    from the event's arguments: a redraw delayed by `delay_ms`, after the server sends a new figure and Gradio draws
    it, must not undo a slider moved meanwhile)."""
    return f"""
(...values) => {{
  const draw = {DRAW_JS};
  const shown = (id, i) => {{
    const input = document.querySelector('#' + id + ' input[type=range]');
    return Number(input ? input.value : values[i]);
  }};
  const redraw = () => {{
    const div = document.querySelector({json.dumps(f"#{plot_id} .js-plotly-plot")});
    const g = div && div.layout && div.layout.meta && div.layout.meta.{META_KEY};
    if (!g || !window.Plotly) return;
    window.Plotly.react(div, draw(g, shown({json.dumps(keep_id)}, 0), shown({json.dumps(weight_id)}, 1)), div.layout);
  }};
  if ({delay_ms}) setTimeout(redraw, {delay_ms}); else redraw();
}}
"""


def readable_figure(graph: Any, labels: dict[str, str], title: str, keep: float = KEEP_DEFAULT,
                    min_weight: float = MIN_WEIGHT_DEFAULT) -> go.Figure:
    """The figure of the pruned `graph` at slider values (keep, min_weight), carrying the graph in layout.meta for
    the page's redraws."""
    return payload_figure(graph_payload(graph, labels), list(graph.tokens), graph.n_layers, title, keep, min_weight)


def payload_figure(g: dict[str, Any], tokens: list[str], n_layers: int, title: str, keep: float = KEEP_DEFAULT,
                   min_weight: float = MIN_WEIGHT_DEFAULT) -> go.Figure:
    """The figure of a graph payload `g` (graph_payload's) over the prompt's `tokens` and `n_layers` layers."""
    frame = axes(tokens, n_layers)
    frame["xaxis"].update(showgrid=False, zeroline=False)
    frame["yaxis"].update(zeroline=False)
    layout = {"title": {"text": title}, "template": TEMPLATE, "height": 760, **frame,
              "hovermode": "closest", "legend": {"orientation": "h"}, "uirevision": "graph",
              "margin": {"l": 60, "r": 20, "t": 60, "b": 90}, "meta": {META_KEY: g}}
    return figure(draw(g, keep, min_weight), layout)
