"""The Graph tab's summary, drawn first (#graph-summary): the pruned graph's supernodes as labelled boxes placed by
layer (upward) and position (rightward), joined by arrows as thick as their weight, each box saying its checked
effect ("off: ' Paris' −3.1 (predicted −3.4)": the target logit's change when the group's features are set to 0,
measured in a free run, and the graph's linear prediction). Clicking a box opens its features in the full graph
below (app/tabs/graph_workbench.py draws them ringed, their edges picked out).

The numbers are the library's: `pruned.summarize(max_groups=...)` (slmviz.graphs.summary's GraphSummary: groups,
edges) and `GraphSummary.check()` (predicted, measured, agree). Making and checking a summary runs as a job of
app/jobs.py's worker with its progress (slmviz.progress's ProgressUpdate.text()) in the status line and Cancel, so
other sessions are served meanwhile. The drawing is SVG written here (boxes and arrows need no plotting library),
with a few lines of page JavaScript that send a clicked box's name to the server.

Element ids: #graph-summary (the drawing), #graph-summary-status.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from ..jobs import RUNNER
from ..shared import parse_thresholds, readable_errors, session, wait_or_say
from .graph_state import GraphState, built, keeps_work

JOB_KIND = "summary"
MAX_GROUPS = 12
BOX_W, BOX_H, GAP = 190, 62, 14  # a box's size in the drawing's pixels, and the least room between two boxes
ARROWS_DRAWN = 40  # the strongest group edges drawn
LABEL_CHARS = 28
POSITIVE, NEGATIVE = "#2471a3", "#c0392b"
KIND_FILL = {"embedding": "#eaf2f8", "features": "#fef9e7", "error": "#f2f3f4", "logit": "#e9f7ef"}
CLICK_JS = """
element.addEventListener('click', (e) => {
  const box = e.target.closest('.graph-summary-box');
  if (box && box.dataset.group) trigger('click', {group: box.dataset.group});
});
"""
NO_SUMMARY = ("<p class='graph-summary-none'><i>This slmviz has no graph summary (GraphSummary) yet; the full graph "
              "below shows every kept node.</i></p>")


def esc(x: Any) -> str:
    return html.escape(str(x))


def short(text: Any, n: int = LABEL_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def _mean(values: Any, default: float = 0.0) -> float:
    try:
        vals = [float(v) for v in values]
    except TypeError:
        vals = [float(values)]
    return sum(vals) / len(vals) if vals else default


def _span(values: Any) -> str:
    try:
        vals = sorted({int(v) for v in values})
    except TypeError:
        vals = [int(values)]
    if not vals:
        return ""
    return str(vals[0]) if len(vals) == 1 else f"{vals[0]}–{vals[-1]}"


def effect_line(checked: Any, name: str, target: str) -> str:
    """ "off: ' Paris' −3.1 (predicted −3.4)" for the group `name` of the check's table, or ""."""
    if checked is None or not len(checked):
        return ""
    row = checked[checked["name"] == name]
    if not len(row):
        return ""
    r = row.iloc[0]
    sign = "" if bool(r["agree"]) else " ≠"
    return (f"off: {target} {float(r['measured']):+.2f} (predicted {float(r['predicted']):+.2f}){sign}"
            .replace("-", "−"))


def place(groups: Any, n_layers: int, width: int) -> tuple[dict[str, tuple[float, float]], int]:
    """{group name: (x, y) of its box's top left}, and the drawing's height: x by the group's mean position (the
    positions that have a group share the width), y by its mean layer (embeddings at the bottom, logits on top);
    boxes of one column that would overlap are pushed apart upward, and a box that would cross another column's
    box moves right of it."""
    columns = sorted({round(_mean(p)) for p in groups["positions"]})
    col_of = {c: i for i, c in enumerate(columns)}
    col_w = max(BOX_W + GAP, (width - 20) / max(len(columns), 1))
    row_h = BOX_H + GAP
    kinds = list(groups["kind"])

    def level(i: int) -> float:
        if kinds[i] == "embedding":
            return -1.0
        if kinds[i] == "logit":
            return n_layers + 1.0
        return _mean(groups["layers"].iloc[i])

    # each column's boxes, lowest layer first, one row apart at least
    rows: dict[str, float] = {}
    for c in columns:
        members = sorted((i for i in range(len(groups)) if round(_mean(groups["positions"].iloc[i])) == c),
                         key=level)
        last = -math.inf
        for i in members:
            want = (level(i) + 1) / (n_layers + 2) * (len(groups) + 2)  # in rows, from the bottom
            at = max(want, last + 1)
            rows[groups["name"].iloc[i]] = at
            last = at
    top = max(rows.values(), default=0) + 1
    height = int(top * row_h + 40)
    places = {}
    for i, name in enumerate(groups["name"]):
        c = col_of[round(_mean(groups["positions"].iloc[i]))]
        x = 10 + c * col_w + (col_w - BOX_W) / 2
        places[name] = (x, height - 30 - (rows[name] + 1) * row_h + GAP)
    return places, height


def summary_html(summary: Any, checked: Any, tokens: list[str], n_layers: int, target: str,
                 width: int = 1300) -> str:
    """The SVG drawing of a GraphSummary: its groups as boxes (label, layers and positions, share of the influence,
    checked effect), its strongest edges as arrows."""
    groups = summary.groups.reset_index(drop=True)
    if not len(groups):
        return "<p><i>The pruned graph has no groups to show.</i></p>"
    places, height = place(groups, n_layers, width)
    edges = summary.edges
    if len(edges):
        edges = edges.reindex(edges["weight"].abs().sort_values(ascending=False).index).head(ARROWS_DRAWN)
    wmax = float(edges["weight"].abs().max()) if len(edges) else 1.0
    arrows = []
    for e in edges.itertuples(index=False):
        if e.source not in places or e.target not in places or e.source == e.target:
            continue
        (x1, y1), (x2, y2) = places[e.source], places[e.target]
        sx, sy, tx, ty = x1 + BOX_W / 2, y1, x2 + BOX_W / 2, y2 + BOX_H
        if sy <= ty:  # the target is not above: join the sides
            sy, ty = y1 + BOX_H / 2, y2 + BOX_H / 2
        w = float(e.weight)
        colour = POSITIVE if w > 0 else NEGATIVE
        arrows.append(f"<line class='graph-summary-edge' data-source='{esc(e.source)}' data-target='{esc(e.target)}' "
                      f"x1='{sx:.1f}' y1='{sy:.1f}' x2='{tx:.1f}' y2='{ty:.1f}' stroke='{colour}' "
                      f"stroke-width='{0.8 + 6 * abs(w) / wmax:.2f}' stroke-opacity='0.55' "
                      f"marker-end='url(#graph-summary-arrow-{'pos' if w > 0 else 'neg'})'>"
                      f"<title>{esc(e.source)} → {esc(e.target)}: {w:+.4g}</title></line>")
    boxes = []
    for r in groups.itertuples(index=False):
        x, y = places[r.name]
        where = f"L{_span(r.layers)} @ {_span(r.positions)}" if r.kind == "features" else r.kind
        positions = sorted({int(p) for p in (r.positions if hasattr(r.positions, "__iter__") else [r.positions])})
        tok = ", ".join(repr(tokens[p]) for p in positions[:2] if 0 <= p < len(tokens))
        effect = effect_line(checked, r.name, target) if r.kind == "features" else ""
        members = list(r.members)
        title = (f"{r.name}: {r.label}\n{len(members)} nodes, {float(r.influence):.0%} of the influence; "
                 f"{where} ({tok})" + (f"\n{effect}" if effect else "") + "\nclick: its nodes in the full graph")
        boxes.append(
            f"<g class='graph-summary-box' data-group='{esc(r.name)}' data-kind='{esc(r.kind)}' "
            f"transform='translate({x:.1f},{y:.1f})' style='cursor:pointer'><title>{esc(title)}</title>"
            f"<rect width='{BOX_W}' height='{BOX_H}' rx='7' fill='{KIND_FILL.get(r.kind, '#fff')}' stroke='#7f8c8d'/>"
            f"<text x='8' y='17' font-size='12.5' font-weight='600'>{esc(short(r.label or r.name))}</text>"
            f"<text x='8' y='34' font-size='11' fill='#566573'>{esc(short(f'{where} · {float(r.influence):.0%}'))}"
            f"</text><text x='8' y='51' font-size='11' fill='#1c2833'>{esc(short(effect, 32))}</text></g>")
    defs = "".join(f"<marker id='graph-summary-arrow-{k}' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='6' "
                   f"markerHeight='6' orient='auto-start-reverse'><path d='M 0 0 L 10 5 L 0 10 z' fill='{c}'/></marker>"
                   for k, c in (("pos", POSITIVE), ("neg", NEGATIVE)))
    return (f"<div class='graph-summary-drawing' style='overflow-x:auto'><svg width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' font-family='sans-serif' xmlns='http://www.w3.org/2000/svg'>"
            f"<defs>{defs}</defs>{''.join(arrows)}{''.join(boxes)}</svg></div>")


def target_name(state: GraphState, checked: Any) -> str:
    """The check's target token, as the box lines show it (quoted)."""
    target = getattr(checked, "attrs", {}).get("target") if checked is not None else None
    if target is not None:
        return repr(state.model.to_strings([int(target)])[0])
    logits = state.graph.nodes[state.graph.nodes["kind"] == "logit"]
    return repr(str(logits["token"].iloc[0])) if len(logits) else "the top logit"


class SummaryHandlers:
    """Making, checking and opening the session's graph summary."""

    @readable_errors
    @keeps_work(2, said=1)
    def summarize(self, state: GraphState | None, node_threshold: float | None, edge_threshold: float | None,
                  request: gr.Request, progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The pruned graph's summary and its check (a job of the worker): the drawing and its status line."""
        if not isinstance(state, GraphState):
            yield gr.skip(), gr.skip()
            return
        thresholds = parse_thresholds(node_threshold, edge_threshold)
        pruned = state.prune(thresholds)
        if not hasattr(pruned, "summarize"):
            yield NO_SUMMARY, ""
            return

        def work(report: Callable[..., None]) -> tuple[Any, Any, float]:
            import time

            started = time.perf_counter()

            def sink(u: Any) -> None:  # slmviz.progress: one line a person reads, the bar never backwards
                report(u.fraction, u.text())

            report(0.0, "Grouping the kept features into supernodes")
            summary = pruned.summarize(max_groups=MAX_GROUPS, progress=sink)
            report(0.5, "Checking each group: its features set to 0, the graph's prediction and a free run")
            checked = summary.check(progress=sink)
            return summary, checked, time.perf_counter() - started

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        said = ""
        for _ in wait_or_say(job, session(request), progress, "Cancelled; build the graph again for its summary"):
            if job.desc != said:
                said = job.desc
                yield gr.skip(), f"Summarizing: {said}"
        summary, checked, seconds = job.result
        state.summary, state.checked, state.summary_at = summary, checked, thresholds
        target = target_name(state, checked)
        yield (summary_html(summary, checked, list(state.graph.tokens), state.graph.n_layers, target),
               summary_status(summary, checked, target, seconds))

    @readable_errors
    @keeps_work(2, said=1)
    def open_group(self, evt: gr.EventData, state: GraphState | None) -> tuple[list[str], str]:
        """A clicked box: its members become the full graph's focus (drawn, ringed, their edges picked out)."""
        state = built(state, "click a box of its summary")
        name = getattr(evt, "group", None) or (getattr(evt, "_data", None) or {}).get("group")
        return self.focus(state, name)

    @staticmethod
    def focus(state: GraphState, name: str | None) -> tuple[list[str], str]:
        if state.summary is None:
            raise ValueError("The graph has no summary yet")
        groups = state.summary.groups
        row = groups[groups["name"] == name]
        if not len(row):
            raise ValueError(f"{name!r} is not a group of this summary; its groups are "
                             f"{', '.join(map(str, groups['name']))}")
        members = [str(m) for m in row["members"].iloc[0]]
        state.focus = members
        label = row["label"].iloc[0]
        return members, (f"**{esc(name)}** ({esc(label)}): its {len(members)} nodes are ringed in orange in the full "
                         "graph below, their edges picked out. Click another box, or a node, to move on.")


def summary_status(summary: Any, checked: Any, target: str, seconds: float) -> str:
    groups = summary.groups
    features = groups[groups["kind"] == "features"]
    agree = int(checked["agree"].sum()) if checked is not None and len(checked) else 0
    checked_n = len(checked) if checked is not None else 0
    return (f"**Summary:** {len(features)} feature groups holding {float(features['influence'].sum()):.0%} of the "
            f"influence, plus the embedding, error and logit groups. Each box says what turning its features off does "
            f"to the logit of {esc(target)}: measured in a free run, and predicted by the graph "
            f"({agree} of {checked_n} agree in sign; ≠ marks a disagreement). Made and checked in {seconds:.1f} s. "
            "**Click a box** to see its nodes in the full graph.")
