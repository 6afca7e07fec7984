"""The Graph tab's readable drawing of a pruned attribution graph, which two sliders redraw in the page.

Tokens along the bottom, layers upward (embeddings at the bottom, logits on top). Each token position gets a
column as wide as its fullest (layer, position) cell needs (slmviz.plots.attribution.spread_columns): the position
where most drawn nodes are gets most of the width, one without any a narrow column. A cell's nodes sit side by
side in order of influence, and its top few features or logits carry a short label in room kept for it beside
their marker (as many per cell as fit a plot of PLOT_PX: 3, 2 or 1), so labels neither cover markers nor leave the
plot. Error nodes small and pale, edges in two colours by sign, thin grey lines between the columns.

The server sends the pruned graph ONCE, inside the figure's `layout.meta` (graph_payload: each node's position,
row, kind, short label and influence rank; the strongest edges with their weights), so the sliders redraw it in
the browser with Plotly.react, no request (the columns' widths follow the nodes drawn):

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
from slmviz.plots.attribution import KIND_STYLE, NEGATIVE, POSITIVE, TEMPLATE, axes, figure, node_y, spread_columns

MAX_NODES_SENT = 5000  # the most influential kept nodes the page receives (the keep slider's maximum)
MAX_EDGES_SENT = 20000  # the strongest edges among them
KEEP_DEFAULT, KEEP_MIN, KEEP_STEP = 50, 10, 10  # a first view a person reads: the 50 most influential nodes
MIN_WEIGHT_DEFAULT, MIN_WEIGHT_MAX, MIN_WEIGHT_STEP = 0.05, 1.0, 0.01
LABEL_CHARS = 24  # a label cut at a word boundary near this, so that what is left still says something
# the drawing's x unit is about a pixel of a plot PLOT_PX wide (its drawing area on a page 1400 px wide); a wider
# drawing is shrunk to fit, labels and nodes alike
PLOT_PX = 1100
SLOT_PX = 12  # a node's marker (and the gap to the next one)
CHAR_PX = 6.5  # a character of the labels' 10 px text, about: a label keeps this much room per character
# (features labelled per cell, labels in all): the first that fits PLOT_PX, the top nodes by influence labelled
# (every logit too); a graph too wide for even the last takes the last, its labels squeezed with the nodes
LABEL_STEPS = ((3, 60), (2, 60), (1, 60), (1, 30), (1, 15))
TOKEN_CHARS = 12  # a column is at least as wide as its token's name, cut to this
LABEL_HALO = "0 0 2px #fff, 0 0 2px #fff, 0 0 3px #fff, 0 0 3px #fff"  # a white halo: legible over edges
GL_FROM = 1000  # nodes sent from which the markers are drawn with WebGL
META_KEY = "slmviz_graph"
FOCUS_COLOUR = "#e67e22"  # the rings of a summary box's members
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
    """`text` on one line, cut to `n` characters at a word boundary where one falls in its second half (an
    ellipsis saying so; the hover text has it whole)."""
    text = " ".join(str(text).split())
    if len(text) <= n:
        return text
    cut = text[: n - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space >= n // 2 else cut).rstrip(" /,;:→") + "…"


def graph_payload(graph: Any, labels: dict[str, str], focus: list[str] | None = None,
                  grouped: set[str] | None = None) -> dict[str, Any]:
    """What the page needs to draw the pruned `graph` at any slider position: its MAX_NODES_SENT most influential
    kept nodes (position, row y, kind, id, label, hover text, rank; rank -1 for those always drawn: embeddings,
    logits, pins), the MAX_EDGES_SENT largest kept edges among them (source and target as indices into the nodes),
    and each position's token name and narrowest column. `focus`: nodes drawn always and ringed (a summary box's
    members), their edges picked out in the page. `grouped`: nodes pinned only because the summary made them a
    supernode's members: not ringed nor always drawn (the graph starts small)."""
    rank = influence_rank(graph)
    kinds = graph.nodes["kind"].to_numpy()
    kept = np.nonzero(graph.node_mask.numpy())[0]
    focused = set(focus or [])
    pinned = (set(graph.workbench.pinned) - set(grouped or ())) | focused
    always = np.isin(kinds[kept], ["embedding", "logit"]) | graph.nodes["node_id"].iloc[kept].isin(pinned).to_numpy()
    order = kept[np.lexsort((rank[kept], ~always))]  # the always-drawn first, then by influence
    rows = np.sort(order[:MAX_NODES_SENT], kind="stable")
    rows = rows[np.argsort(rank[rows], kind="stable")]  # by influence: a cell's most influential node leftmost
    nodes = graph.nodes.iloc[rows]
    y = node_y(nodes["kind"], nodes["layer"], graph.n_layers)
    tokens = [short(f"{p}: {t!r}", TOKEN_CHARS) for p, t in enumerate(graph.tokens)]
    ids = nodes["node_id"].tolist()
    # the keep slider counts the nodes it may hide: ranks 0, 1, ... among them, -1 for those always drawn
    always_sent = [k in ("embedding", "logit") or i in pinned for i, k in zip(ids, nodes["kind"], strict=True)]
    ranked = iter(range(len(ids)))  # rows are in influence order already
    shown_rank = [-1 if a else next(ranked) for a in always_sent]
    texts, hovers = [], []
    for r in nodes.itertuples(index=False):
        # a logit's label is its token, without the quotes its hover text shows
        token = str(r.token).strip() or repr(r.token)
        text = labels.get(r.node_id, "") if r.kind == "feature" else token if r.kind == "logit" else ""
        texts.append(short(text.removeprefix(AUTO)))  # the hover text says "[auto]"
        hovers.append(f"{r.kind} {r.node_id}<br>layer {r.layer}, position {r.position} ({r.token!r})"
                      + (f"<br>activation {r.activation:.3g}" if r.kind == "feature" else "")
                      + (f"<br>p = {r.probability:.3f}" if r.kind == "logit" else "")
                      + (f"<br><b>{labels[r.node_id]}</b>" if r.node_id in labels else ""))
    a = kept_adjacency(graph)[torch.from_numpy(rows)][:, torch.from_numpy(rows)]
    dst, src = torch.nonzero(a, as_tuple=True)
    w = a[dst, src]
    top = w.abs().argsort(descending=True, stable=True)[:MAX_EDGES_SENT]
    return {"ids": ids, "kind": nodes["kind"].tolist(), "position": nodes["position"].astype(int).tolist(),
            "y": y.tolist(), "tokens": tokens, "min_width": [max(2 * SLOT_PX, CHAR_PX * len(t) + 14) for t in tokens],
            "rank": shown_rank, "text": texts, "hover": hovers,
            "pinned": [i in pinned and i not in focused for i in ids], "focus": [i in focused for i in ids],
            "src": src[top].tolist(), "dst": dst[top].tolist(), "w": [round(float(v), 6) for v in w[top]],
            "wmax": float(w.abs().max()) if len(w) else 0.0, "gl": len(ids) > GL_FROM,
            "style": {k: [*KIND_STYLE[k], *KIND_LOOK[k]] for k in KIND_STYLE},
            "colours": [POSITIVE, NEGATIVE], "label_steps": [list(s) for s in LABEL_STEPS],
            "plot_px": PLOT_PX, "slot": SLOT_PX, "label_w": [CHAR_PX * len(t) + 12 if t else 0 for t in texts]}


def draw(g: dict[str, Any], keep: float, min_weight: float) -> list[dict[str, Any]]:
    """The traces at slider values (keep, min_weight): DRAW_JS in Python (keep them alike)."""
    n = len(g["ids"])
    shown = [g["rank"][i] < keep for i in range(n)]
    cut = min_weight * g["wmax"]
    drawn = [i for i in range(n) if shown[i]]
    named = [i for i in drawn if g["text"][i] and g["kind"][i] in ("feature", "logit")]
    named = sorted(named, key=lambda i: (g["rank"][i], i))
    for per_cell, most in g["label_steps"]:  # as many labels as fit the plot's width
        labelled = top_per_cell(g, named, per_cell, most)
        widths = [g["slot"] + (g["label_w"][i] if i in labelled else 0) for i in drawn]
        xs_drawn, edges = spread_columns([g["position"][i] for i in drawn], [g["y"][i] for i in drawn], widths,
                                         g["min_width"], g["slot"])
        if edges[-1] <= g["plot_px"]:
            break
    x: list[Any] = [None] * n
    for i, xi in zip(drawn, xs_drawn, strict=True):
        x[i] = xi
    traces = []
    for sign, colour, name in ((1, g["colours"][0], "edges +"), (-1, g["colours"][1], "edges −")):
        xs: list[Any] = []
        ys: list[Any] = []
        for s, d, w in zip(g["src"], g["dst"], g["w"], strict=True):
            if shown[s] and shown[d] and abs(w) >= cut and w * sign > 0:
                xs += [x[s], x[d], None]
                ys += [g["y"][s], g["y"][d], None]
        # SVG, not WebGL: a WebGL canvas lies over the SVG labels, and one SVG path per sign draws fast enough
        traces.append({"type": "scatter", "x": xs, "y": ys, "mode": "lines",
                       "name": name, "hoverinfo": "skip", "line": {"color": colour, "width": 1}, "opacity": 0.45})
    for kind, (symbol, colour, size, opacity) in g["style"].items():
        sel = [i for i in drawn if g["kind"][i] == kind]
        traces.append({"type": "scattergl" if g["gl"] else "scatter", "x": [x[i] for i in sel],
                       "y": [g["y"][i] for i in sel], "mode": "markers", "name": kind,
                       "hovertext": [g["hover"][i] for i in sel], "hoverinfo": "text",
                       "customdata": [[g["ids"][i], kind] for i in sel],
                       "marker": {"symbol": symbol, "color": colour, "size": size, "opacity": opacity,
                                  "line": {"width": 0.5, "color": "#333"}}})
    top = [i for i in named if i in labelled]
    traces.append({"type": "scatter", "x": [x[i] + g["slot"] / 2 for i in top], "y": [g["y"][i] for i in top],
                   "mode": "text", "name": "labels", "text": [g["text"][i] for i in top],
                   "textposition": "middle right", "hoverinfo": "skip",
                   "textfont": {"size": 10, "color": "#1c2833", "shadow": LABEL_HALO}})
    for key, colour in (("pinned", "#8e44ad"), ("focus", FOCUS_COLOUR)):
        ring = [i for i in drawn if g[key][i]]
        traces.append({"type": "scatter", "x": [x[i] for i in ring], "y": [g["y"][i] for i in ring],
                       "mode": "markers", "name": key, "hoverinfo": "skip",
                       "marker": {"symbol": "circle-open", "size": 17, "color": colour, "line": {"width": 2}}})
    # the columns: a thin line between two positions, each token's name under its column
    top_row = max(g["y"]) + 0.5 if n else 1.5
    bars: dict[str, list[Any]] = {"x": [], "y": []}
    for e in edges[1:-1]:
        bars["x"] += [e, e, None]
        bars["y"] += [-0.5, top_row, None]
    traces.append({"type": "scatter", "x": bars["x"], "y": bars["y"], "mode": "lines", "name": "columns",
                   "hoverinfo": "skip", "showlegend": False, "line": {"color": "#d5d8dc", "width": 1}})
    traces.append({"type": "scatter", "x": [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)],
                   "y": [-1.1] * len(g["tokens"]), "mode": "text", "name": "tokens", "text": g["tokens"],
                   "textposition": "middle center", "textfont": {"size": 10}, "hoverinfo": "skip",
                   "showlegend": False})
    return traces


def top_per_cell(g: dict[str, Any], named: list[int], per_cell: int, most: int) -> set[int]:
    """The nodes to label: in `named`'s order (by influence), every logit and the first `per_cell` features of each
    (row, position) cell, at most `most` features in all."""
    out: set[int] = set()
    count: dict[tuple[float, int], int] = {}
    features = 0
    for i in named:
        cell = (g["y"][i], g["position"][i])
        feature = g["kind"][i] == "feature"
        if feature and (count.get(cell, 0) >= per_cell or features == most):
            continue
        count[cell] = count.get(cell, 0) + 1
        features += feature
        out.add(i)
    return out


# DRAW_JS: `draw` above, in the page's JavaScript, with spread_columns (slmviz.plots.attribution) inlined (keep
# them alike: tests/test_graph_tab_browser.py compares them).
DRAW_JS = """
(g, keep, minWeight) => {
  const n = g.ids.length, shown = g.rank.map((r) => r < keep), cut = minWeight * g.wmax, traces = [];
  const type = g.gl ? 'scattergl' : 'scatter';
  const drawn = [];
  for (let i = 0; i < n; i++) if (shown[i]) drawn.push(i);
  const named = drawn.filter((i) => g.text[i] && (g.kind[i] === 'feature' || g.kind[i] === 'logit'));
  named.sort((a, b) => (g.rank[a] - g.rank[b]) || (a - b));
  const spread = (widths) => {  // slmviz.plots.attribution.spread_columns
    const cellWidth = new Map(), key = (i) => g.y[i] + '|' + g.position[i];
    drawn.forEach((i, k) => cellWidth.set(key(i), (cellWidth.get(key(i)) || 0) + widths[k]));
    const column = g.min_width.slice();
    drawn.forEach((i) => { column[g.position[i]] = Math.max(column[g.position[i]], cellWidth.get(key(i))); });
    const edges = [0];
    for (const w of column) edges.push(edges[edges.length - 1] + w);
    const cursor = new Map(), xs = [];
    drawn.forEach((i, k) => {
      const p = g.position[i];
      const at = cursor.has(key(i)) ? cursor.get(key(i)) : edges[p] + (column[p] - cellWidth.get(key(i))) / 2;
      xs.push(at + g.slot / 2);
      cursor.set(key(i), at + widths[k]);
    });
    return [xs, edges];
  };
  let labelled, xsDrawn, edges;
  for (const [perCell, most] of g.label_steps) {  // as many labels as fit the plot's width
    labelled = new Set();
    const count = new Map();
    let features = 0;
    for (const i of named) {
      const cell = g.y[i] + '|' + g.position[i], feature = g.kind[i] === 'feature';
      if (feature && ((count.get(cell) || 0) >= perCell || features === most)) continue;
      count.set(cell, (count.get(cell) || 0) + 1);
      features += feature ? 1 : 0;
      labelled.add(i);
    }
    [xsDrawn, edges] = spread(drawn.map((i) => g.slot + (labelled.has(i) ? g.label_w[i] : 0)));
    if (edges[edges.length - 1] <= g.plot_px) break;
  }
  const x = new Array(n).fill(null);
  drawn.forEach((i, k) => { x[i] = xsDrawn[k]; });
  [[1, g.colours[0], 'edges +'], [-1, g.colours[1], 'edges −']].forEach(([sign, colour, name]) => {
    const xs = [], ys = [];
    for (let e = 0; e < g.src.length; e++) {
      const s = g.src[e], d = g.dst[e], w = g.w[e];
      if (shown[s] && shown[d] && Math.abs(w) >= cut && w * sign > 0) {
        xs.push(x[s], x[d], null); ys.push(g.y[s], g.y[d], null);
      }
    }
    traces.push({type: 'scatter', x: xs, y: ys, mode: 'lines', name, hoverinfo: 'skip', line: {color: colour, width: 1},
                 opacity: 0.45});
  });
  for (const [kind, [symbol, colour, size, opacity]] of Object.entries(g.style)) {
    const sel = drawn.filter((i) => g.kind[i] === kind);
    traces.push({type, x: sel.map((i) => x[i]), y: sel.map((i) => g.y[i]), mode: 'markers', name: kind,
                 hovertext: sel.map((i) => g.hover[i]), hoverinfo: 'text', customdata: sel.map((i) => [g.ids[i], kind]),
                 marker: {symbol, color: colour, size, opacity, line: {width: 0.5, color: '#333'}}});
  }
  const top = named.filter((i) => labelled.has(i));
  traces.push({type: 'scatter', x: top.map((i) => x[i] + g.slot / 2), y: top.map((i) => g.y[i]), mode: 'text',
               name: 'labels',
               text: top.map((i) => g.text[i]), textposition: 'middle right', hoverinfo: 'skip',
               textfont: {size: 10, color: '#1c2833', shadow: '""" + LABEL_HALO + """'}});
  for (const [key, colour] of [['pinned', '#8e44ad'], ['focus', '""" + FOCUS_COLOUR + """']]) {
    const ring = drawn.filter((i) => g[key][i]);
    traces.push({type: 'scatter', x: ring.map((i) => x[i]), y: ring.map((i) => g.y[i]), mode: 'markers',
                 name: key, hoverinfo: 'skip',
                 marker: {symbol: 'circle-open', size: 17, color: colour, line: {width: 2}}});
  }
  const topRow = n ? Math.max(...g.y) + 0.5 : 1.5, bars = {x: [], y: []};
  for (const e of edges.slice(1, -1)) { bars.x.push(e, e, null); bars.y.push(-0.5, topRow, null); }
  traces.push({type: 'scatter', x: bars.x, y: bars.y, mode: 'lines', name: 'columns', hoverinfo: 'skip',
               showlegend: false, line: {color: '#d5d8dc', width: 1}});
  traces.push({type: 'scatter', x: g.tokens.map((_, p) => (edges[p] + edges[p + 1]) / 2),
               y: g.tokens.map(() => -1.1), mode: 'text', name: 'tokens', text: g.tokens,
               textposition: 'middle center', textfont: {size: 10}, hoverinfo: 'skip', showlegend: false});
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
                    min_weight: float = MIN_WEIGHT_DEFAULT, focus: list[str] | None = None,
                    grouped: set[str] | None = None) -> go.Figure:
    """The figure of the pruned `graph` at slider values (keep, min_weight), carrying the graph in layout.meta for
    the page's redraws; `focus`: node ids drawn always and ringed (a summary box's members)."""
    return payload_figure(graph_payload(graph, labels, focus, grouped), list(graph.tokens), graph.n_layers, title,
                          keep, min_weight)


def payload_figure(g: dict[str, Any], tokens: list[str], n_layers: int, title: str, keep: float = KEEP_DEFAULT,
                   min_weight: float = MIN_WEIGHT_DEFAULT) -> go.Figure:
    """The figure of a graph payload `g` (graph_payload's) over the prompt's `tokens` and `n_layers` layers."""
    frame = axes(tokens, n_layers)
    # the columns move with the sliders, so the tokens are a trace of the drawing (draw's "tokens"), not ticks
    frame["xaxis"].update(showgrid=False, zeroline=False, showticklabels=False, title={"text": "token position"})
    frame["yaxis"].update(zeroline=False, range=[-1.6, n_layers + 1.6])
    layout = {"title": {"text": title}, "template": TEMPLATE, "height": 760, **frame,
              "hovermode": "closest", "legend": {"orientation": "h"}, "uirevision": "graph",
              "margin": {"l": 50, "r": 10, "t": 50, "b": 40}, "meta": {META_KEY: g}}
    return figure(draw(g, keep, min_weight), layout)


# The page's side of the full graph, beyond drawing it: after every draw, no two labels overlap (DECLUTTER_JS), and
# hovering or clicking a node picks out its edges and dims the rest (highlight_js). Both act on the drawn figure
# only: the traces of `draw` stay as the server and DRAW_JS make them, so the two drawings stay comparable.
HIGHLIGHTED = ("highlight +", "highlight −", "highlight nodes")  # the traces a highlight adds, removed after it
DIMMED_OPACITY = 0.12
DECLUTTER_JS = """
(div) => {  // the tokens first (a crowded one moves a line down, else is left off), then the labels in influence
  // order: a label that would overlap one already shown is left off (its node's hover text has it)
  const texts = Array.from(div.querySelectorAll('g.textpoint text'));
  const nameOf = (el) => {
    const g = el.closest('g.trace'), d = g && g.__data__;
    return d && d[0] && d[0].trace ? d[0].trace.name : null;
  };
  texts.forEach((t) => { t.style.display = ''; t.style.transform = ''; });
  const placed = [];
  const free = (r) => !placed.some((q) => r.left < q.right - 0.5 && q.left < r.right - 0.5 &&
                                          r.top < q.bottom - 0.5 && q.top < r.bottom - 0.5);
  for (const t of texts.filter((el) => nameOf(el) === 'tokens')) {
    let r = t.getBoundingClientRect();
    if (!free(r)) { t.style.transform = 'translateY(13px)'; r = t.getBoundingClientRect(); }
    if (free(r)) placed.push(r); else t.style.display = 'none';
  }
  for (const t of texts.filter((el) => nameOf(el) === 'labels')) {
    const r = t.getBoundingClientRect();
    if (free(r)) placed.push(r); else t.style.display = 'none';
  }
}
"""


def highlight_js(plot_id: str) -> str:
    """The plot's change event (Gradio `fn=None, js=...`): attach, once per plot div, the handlers that keep the
    labels apart after every draw and pick out a node's edges on hover or click (a click keeps it; the nodes of a
    summary box clicked, the payload's `focus`, are picked out from the start)."""
    return f"""
() => {{
  const declutter = {DECLUTTER_JS};
  const HL = {json.dumps(list(HIGHLIGHTED))};
  const attach = () => {{
    const div = document.querySelector({json.dumps(f"#{plot_id} .js-plotly-plot")});
    if (!div || !div.on || div._slmvizHighlight) return;
    div._slmvizHighlight = true;
    const meta = () => div.layout && div.layout.meta && div.layout.meta.{META_KEY};
    const busy = () => div._slmvizBusy;
    const clear = () => {{
      const drop = div.data.map((t, i) => (HL.includes(t.name) ? i : -1)).filter((i) => i >= 0);
      const back = div._slmvizDimmed || [];
      div._slmvizDimmed = null;
      div._slmvizShown = null;
      const steps = [];
      if (drop.length) steps.push(() => window.Plotly.deleteTraces(div, drop));
      if (back.length) steps.push(() => window.Plotly.restyle(div, {{opacity: back.map((b) => b[1])}},
                                                              back.map((b) => b[0])));
      return steps.reduce((p, f) => p.then(f), Promise.resolve());
    }};
    const highlight = (ids) => {{
      const g = meta();
      if (!g || !ids.length) return Promise.resolve();
      const key = ids.join(',');
      if (div._slmvizShown === key) return Promise.resolve();
      return clear().then(() => {{
        const at = new Map();
        div.data.forEach((t) => {{
          if (!t.customdata || HL.includes(t.name)) return;
          t.customdata.forEach((c, k) => at.set(String(c[0]), [t.x[k], t.y[k]]));
        }});
        const want = new Set(ids), ends = new Set(ids.filter((i) => at.has(i)));
        const lines = [{{x: [], y: []}}, {{x: [], y: []}}];
        for (let e = 0; e < g.src.length; e++) {{
          const s = g.ids[g.src[e]], d = g.ids[g.dst[e]];
          if (!(want.has(s) || want.has(d)) || !at.has(s) || !at.has(d)) continue;
          const l = lines[g.w[e] > 0 ? 0 : 1];
          l.x.push(at.get(s)[0], at.get(d)[0], null);
          l.y.push(at.get(s)[1], at.get(d)[1], null);
          ends.add(s); ends.add(d);
        }}
        const dim = [];
        div.data.forEach((t, i) => {{
          if (!['labels', 'tokens', 'columns'].includes(t.name)) dim.push([i, t.opacity === undefined ? 1 : t.opacity]);
        }});
        div._slmvizDimmed = dim;
        div._slmvizShown = key;
        const ring = Array.from(ends).map((i) => at.get(i));
        return window.Plotly.restyle(div, {{opacity: {DIMMED_OPACITY}}}, dim.map((d) => d[0])).then(() =>
          window.Plotly.addTraces(div, [
            {{type: 'scatter', name: HL[0], x: lines[0].x, y: lines[0].y, mode: 'lines', hoverinfo: 'skip',
              showlegend: false, line: {{color: g.colours[0], width: 2.5}}}},
            {{type: 'scatter', name: HL[1], x: lines[1].x, y: lines[1].y, mode: 'lines', hoverinfo: 'skip',
              showlegend: false, line: {{color: g.colours[1], width: 2.5}}}},
            {{type: 'scatter', name: HL[2], x: ring.map((p) => p[0]), y: ring.map((p) => p[1]), mode: 'markers',
              hoverinfo: 'skip', showlegend: false,
              marker: {{size: 12, color: 'rgba(0,0,0,0)', line: {{width: 2, color: '#1c2833'}}}}}}]));
      }});
    }};
    // one change at a time: Plotly's calls are asynchronous, and a hover may come while one runs
    const run = (f) => {{
      if (busy()) {{ div._slmvizNext = f; return; }}
      div._slmvizBusy = true;
      Promise.resolve().then(f).catch(() => null).then(() => {{
        div._slmvizBusy = false;
        const next = div._slmvizNext; div._slmvizNext = null;
        if (next) run(next);
      }});
    }};
    const rest = () => (div._slmvizSticky && div._slmvizSticky.length ? highlight(div._slmvizSticky) : clear());
    let timer = null;
    div.on('plotly_hover', (ev) => {{
      const p = (ev.points || []).find((q) => q.customdata && q.customdata[0] !== undefined);
      if (!p) return;
      clearTimeout(timer);
      run(() => highlight([String(p.customdata[0])]));
    }});
    div.on('plotly_unhover', () => {{ clearTimeout(timer); timer = setTimeout(() => run(rest), 250); }});
    div.on('plotly_click', (ev) => {{
      const p = (ev.points || []).find((q) => q.customdata && q.customdata[0] !== undefined);
      if (p) div._slmvizSticky = [String(p.customdata[0])];
    }});
    div.on('plotly_afterplot', () => {{
      declutter(div);
      const g = meta();
      if (g && div._slmvizMeta !== g) {{  // a new figure: its focus (a summary box's nodes) picked out
        div._slmvizMeta = g;
        div._slmvizSticky = g.ids.filter((_, i) => g.focus && g.focus[i]);
        div._slmvizDimmed = null;
        div._slmvizShown = null;
      }}
      // a redraw from outside (a slider, a new figure) drops the highlight's traces: put the kept one back. Not
      // during the highlight's own restyle and addTraces (busy): that would start it again, and again
      if (!busy() && !div.data.some((t) => HL.includes(t.name))) {{
        div._slmvizShown = null;
        div._slmvizDimmed = null;
        if (div._slmvizSticky && div._slmvizSticky.length) run(() => highlight(div._slmvizSticky));
      }}
    }});
    declutter(div);
  }};
  let tries = 0;
  const timer = setInterval(() => {{ attach(); if (++tries > 20) clearInterval(timer); }}, 300);
}}
"""
