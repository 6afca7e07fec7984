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

Element ids: #graph-summary (the drawing), #graph-summary-status, #graph-summary-apply (the groups become the
workbench's supernodes).
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from slmviz.progress import as_progress

from ..jobs import RUNNER
from ..shared import parse_thresholds, readable_errors, session, wait_or_say
from .graph_state import GraphState, built, keeps_work

JOB_KIND = "summary"
MAX_GROUPS = 12
BOX_W, BOX_H, GAP = 210, 62, 12  # a feature group's box in the drawing's pixels, and the least room between boxes
SMALL_W, SMALL_H = 160, 40  # a token's, the errors' or a logit's box
EFFECT_CHARS = 36  # a box's effect line: longer ones leave out the target token (the legend names it)
MARGIN = 16
LOGITS_DRAWN = 3  # the most probable logits get a box (the rest are in the full graph)
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


def drawn_groups(groups: Any) -> Any:
    """The groups that get a box: all but the logits beyond the LOGITS_DRAWN most probable (their influence)."""
    groups = groups.reset_index(drop=True)
    logits = groups[groups["kind"] == "logit"].sort_values("influence", ascending=False)
    return groups.drop(index=logits.index[LOGITS_DRAWN:]).reset_index(drop=True)


def effect_line(checked: Any, name: str, target: str) -> str:
    """ "off: ' Paris' −3.1 (predicted −3.4)" for the group `name` of the check's table, or ""."""
    if checked is None or not len(checked):
        return ""
    row = checked[checked["name"] == name]
    if not len(row):
        return ""
    r = row.iloc[0]
    sign = "" if bool(r["agree"]) else " ≠"
    numbers = f"{number(r['measured'])} (predicted {number(r['predicted'])}){sign}"
    return f"off: {target} {numbers}" if target else f"off: {numbers}"


def number(x: Any) -> str:
    """A signed logit change with the digits that matter: −0.07, −3.1, +15 (a true minus sign)."""
    x = float(x)
    digits = 2 if abs(x) < 1 else 1 if abs(x) < 100 else 0
    return f"{x:+.{digits}f}".replace("-", "−")


def box_size(kind: str) -> tuple[int, int]:
    """(width, height) of a group's box: a feature group has three lines (label, where, checked effect); a token,
    the errors and a logit one or two."""
    return (BOX_W, BOX_H) if kind == "features" else (SMALL_W, SMALL_H)


def place(groups: Any, n_tokens: int, n_layers: int, width: int) -> tuple[dict[str, tuple[float, float]], int]:
    """{group name: (x, y) of its box's top left}, and the drawing's height. A box goes above its group's mean
    position (the prompt's tokens share the width) at the height of its mean layer (embeddings at the bottom,
    logits just above the highest other box); one that would overlap a box already placed (lower layers first)
    tries a step to either side, then moves up until it is free. So no two boxes overlap, and lower layers stay
    lower."""
    kinds = list(groups["kind"])
    span = 300 + 26 * len(groups)  # the height the layers spread over, before boxes move up

    def level(i: int) -> float:
        if kinds[i] == "embedding":
            return -1.0
        if kinds[i] == "logit":
            return n_layers + 1.0
        return _mean(groups["layers"].iloc[i])

    slot = (width - 2 * MARGIN) / max(n_tokens, 1)
    placed: list[tuple[float, float, float, float]] = []  # x, y (upward, of the bottom edge), w, h
    up: dict[str, tuple[float, float, float]] = {}

    def free(x: float, y: float, w: float, h: float) -> bool:
        return all(x + w + GAP <= px or px + pw + GAP <= x or y + h + GAP <= py or py + ph + GAP <= y
                   for px, py, pw, ph in placed)

    for i in sorted(range(len(groups)), key=lambda i: (level(i), -float(groups["influence"].iloc[i]))):
        w, h = box_size(kinds[i])
        centre = MARGIN + (_mean(groups["positions"].iloc[i]) + 0.5) * slot
        x0 = min(max(MARGIN, centre - w / 2), width - MARGIN - w)
        y = (level(i) + 1) / (n_layers + 2) * span
        if kinds[i] == "logit":  # the logits sit just above the highest box, not at the top of an empty span
            y = max((py + ph for _, py, _, ph in placed), default=0.0) + 3 * GAP
        while True:
            spots = [x0 + k * (w + GAP) for k in (0, -1, 1, -2, 2)]
            spot = next((x for x in spots if MARGIN <= x <= width - MARGIN - w and free(x, y, w, h)), None)
            if spot is not None:
                break
            y += (h + GAP) / 2
        placed.append((spot, y, w, h))
        up[groups["name"].iloc[i]] = (spot, y, h)
    height = int(max((y + h for _, y, h in up.values()), default=0) + 2 * MARGIN)
    return {name: (x, height - MARGIN - y - h) for name, (x, y, h) in up.items()}, height


def summary_html(summary: Any, checked: Any, tokens: list[str], n_layers: int, target: str,
                 width: int = 1240) -> str:
    """The SVG drawing of a GraphSummary: its groups as boxes (label, layers and positions, share of the influence,
    checked effect), its strongest edges as arrows."""
    groups = drawn_groups(summary.groups)
    if not len(groups):
        return "<p><i>The pruned graph has no groups to show.</i></p>"
    places, height = place(groups, len(tokens), n_layers, width)
    size = {r.name: box_size(r.kind) for r in groups.itertuples(index=False)}
    edges = summary.edges
    if len(edges):
        edges = edges.reindex(edges["weight"].abs().sort_values(ascending=False).index).head(ARROWS_DRAWN)
    wmax = float(edges["weight"].abs().max()) if len(edges) else 1.0
    arrows = []
    for e in edges.itertuples(index=False):
        if e.source not in places or e.target not in places or e.source == e.target:
            continue
        (x1, y1), (x2, y2) = places[e.source], places[e.target]
        (w1, h1), (w2, h2) = size[e.source], size[e.target]
        sx, sy, tx, ty = x1 + w1 / 2, y1, x2 + w2 / 2, y2 + h2
        if sy <= ty:  # the target is not above: join the sides
            sy, ty = y1 + h1 / 2, y2 + h2 / 2
            sx, tx = (x1 + w1, x2) if x1 < x2 else (x1, x2 + w2)
        w = float(e.weight)
        colour = POSITIVE if w > 0 else NEGATIVE
        arrows.append(f"<line class='graph-summary-edge' data-source='{esc(e.source)}' data-target='{esc(e.target)}' "
                      f"x1='{sx:.1f}' y1='{sy:.1f}' x2='{tx:.1f}' y2='{ty:.1f}' stroke='{colour}' "
                      f"stroke-width='{0.8 + 6 * abs(w) / wmax:.2f}' stroke-opacity='0.55' "
                      f"marker-end='url(#graph-summary-arrow-{'pos' if w > 0 else 'neg'})'>"
                      f"<title>{esc(e.source)} → {esc(e.target)}: {w:+.4g}</title></line>")
    named = all(len(effect_line(checked, n, target)) <= EFFECT_CHARS for n in groups["name"])
    boxes = []
    for r in groups.itertuples(index=False):
        x, y = places[r.name]
        w, h = size[r.name]
        positions = [int(p) for p in r.positions]
        tok = ", ".join(repr(tokens[p]) for p in positions[:3] if 0 <= p < len(tokens))
        members = list(r.members)
        if r.kind == "features":
            where = f"L{_span(r.layers)} @ {_span(r.positions)} · {float(r.influence):.0%}"
            effect = effect_line(checked, r.name, target if named else "")
            lines = [(short(r.label or r.name), 12.5, "600", "#1c2833"), (short(where), 11, "400", "#566573"),
                     (effect, 11, "400", "#1c2833")]
        else:
            effect = ""
            first = r.label if r.kind != "error" else f"errors · {float(r.influence):.0%}"
            lines = [(short(first, 24), 11.5, "600", "#1c2833")]
            if r.kind == "error":
                lines.append((short(f"{len(members)} nodes, L{_span(r.layers)}", 20), 10.5, "400", "#566573"))
        title = (f"{r.name}: {r.label}\n{len(members)} nodes, {float(r.influence):.0%} of the influence; layers "
                 f"{_span(r.layers)}, positions {_span(r.positions)} ({tok})" + (f"\n{effect}" if effect else "")
                 + "\nclick: its nodes in the full graph")
        text = "".join(f"<text x='8' y='{16 + 17 * k}' font-size='{size_}' font-weight='{weight}' fill='{fill}'>"
                       f"{esc(t)}</text>" for k, (t, size_, weight, fill) in enumerate(lines))
        boxes.append(
            f"<g class='graph-summary-box' data-group='{esc(r.name)}' data-kind='{esc(r.kind)}' "
            f"transform='translate({x:.1f},{y:.1f})' style='cursor:pointer'><title>{esc(title)}</title>"
            f"<rect width='{w}' height='{h}' rx='7' fill='{KIND_FILL.get(r.kind, '#fff')}' stroke='#7f8c8d'/>"
            f"{text}</g>")
    defs = "".join(f"<marker id='graph-summary-arrow-{k}' viewBox='0 0 10 10' refX='9' refY='5' markerWidth='9' "
                   f"markerHeight='9' markerUnits='userSpaceOnUse' orient='auto-start-reverse'>"
                   f"<path d='M 0 0 L 10 5 L 0 10 z' fill='{c}'/></marker>"
                   for k, c in (("pos", POSITIVE), ("neg", NEGATIVE)))
    legend = (f"Each box: a group's label; its layers @ positions · its share of the influence; off: the change of "
              f"the logit of {target} when its features are set to 0, in a free run (the graph's prediction in "
              "brackets; ≠ where they disagree in sign). Arrows: the summed edges, blue excites, red inhibits.")
    return (f"<div class='graph-summary-drawing' style='overflow-x:auto'><p class='graph-summary-legend' "
            f"style='font-size:12px;color:#566573;margin:2px 0'>{esc(legend)}</p><svg viewBox='0 0 {width} {height}' "
            f"style='width:100%;max-width:{width}px;height:auto' font-family='sans-serif' "
            f"xmlns='http://www.w3.org/2000/svg'><defs>{defs}</defs>{''.join(arrows)}{''.join(boxes)}</svg></div>")


def target_name(state: GraphState, checked: Any) -> str:
    """The check's target token, as the box lines show it (quoted)."""
    attrs = getattr(checked, "attrs", None) or {}
    if attrs.get("target_token") is not None:
        return repr(str(attrs["target_token"]))
    if attrs.get("target") is not None:
        return repr(state.model.to_strings([int(attrs["target"])])[0])
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
        if state.summary is not None and state.summary_at == thresholds:  # made already (a build that kept it)
            yield self.drawn(state, state.seconds_summary)
            return

        def work(report: Callable[..., None]) -> tuple[Any, Any, float]:
            started = time.perf_counter()
            # slmviz.progress: one bar over both steps, never backwards, its line naming the step and the time left
            p = as_progress(lambda u: report(u.fraction, u.text()), "summary")
            # apply=False: the groups stay out of the workbench, whose pins and subgraph are the person's own (applied,
            # every member of every group is pinned, and the subgraph is no longer what the person pinned)
            summary = pruned.summarize(max_groups=MAX_GROUPS, apply=False,
                                       progress=p.part("grouping the features", share=0.2))
            checked = summary.check(progress=p.part("checking each group (set to 0: predicted, then a free run)",
                                                    share=0.8))
            return summary, checked, time.perf_counter() - started

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        said = ""
        for _ in wait_or_say(job, session(request), progress, "Cancelled; build the graph again for its summary"):
            if job.desc != said:
                said = job.desc
                yield gr.skip(), f"Summarizing: {said}"
        summary, checked, seconds = job.result
        state.summary, state.checked, state.summary_at, state.seconds_summary = summary, checked, thresholds, seconds
        yield self.drawn(state, seconds)

    @readable_errors
    @keeps_work(1, said=0)
    def apply(self, state: GraphState | None, request: gr.Request) -> str:
        """The summary's feature groups become the workbench's supernodes (GraphSummary.apply): the subgraph and
        the JSON show them; a person's pins and supernodes stay theirs, and applying again replaces only these."""
        state = built(state, "keep its summary's groups")
        if state.summary is None:
            raise ValueError("The graph has no summary yet: wait for it to be drawn above, then keep its groups")
        state.summary.apply()
        wb = state.summary.graph.workbench
        return (f"The summary's {len(wb.auto)} feature groups are supernodes now, in the workbench's subgraph and "
                "the JSON (circuit-tracer's viewer shows them). Your own pins and supernodes stay as they were; "
                "removing a group's supernode leaves it out, and takes back only the pins it made.")

    @staticmethod
    def drawn(state: GraphState, seconds: float) -> tuple[str, str]:
        """(the drawing, its status line) of the state's summary."""
        target = target_name(state, state.checked)
        return (summary_html(state.summary, state.checked, list(state.graph.tokens), state.graph.n_layers, target),
                summary_status(state.summary, state.checked, target, seconds, state.seconds))

    @readable_errors
    @keeps_work(2, said=1)
    def open_group(self, evt: gr.EventData, state: GraphState | None) -> tuple[str, str]:
        """A clicked box: its members become the full graph's focus (drawn, ringed, their edges picked out)."""
        state = built(state, "click a box of its summary")
        name = getattr(evt, "group", None) or (getattr(evt, "_data", None) or {}).get("group")
        members, said = self.focus(state, name)
        return ", ".join(members), said

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


def summary_status(summary: Any, checked: Any, target: str, seconds: float, graph_seconds: float) -> str:
    groups = summary.groups
    features = groups[groups["kind"] == "features"]
    agree = int(checked["agree"].sum()) if checked is not None and len(checked) else 0
    checked_n = len(checked) if checked is not None else 0
    return (f"**Summary:** {len(features)} feature groups holding {summary.coverage:.0%} of the kept features' "
            f"influence, plus the embedding, error and logit groups. Each box says what turning its features off does "
            f"to the logit of {esc(target)}: measured in a free run, and predicted by the graph "
            f"({agree} of {checked_n} agree in sign; ≠ marks a disagreement). {earlier_note(summary, checked)}"
            f"Made and checked in {seconds:.1f} s (the graph itself: {graph_seconds:.1f} s). {esc(summary.note)} "
            "**Click a box** to see its nodes in the full graph.")


def earlier_note(summary: Any, checked: Any) -> str:
    """Why a check can disagree, said where it does: the graph freezes attention, so a group at an earlier token,
    which reaches the answer only through attention, is predicted without the attention it moves in a free run
    (bench/studies/summary.py measures how often each kind agrees)."""
    if checked is None or not len(checked) or bool(checked["agree"].all()):
        return ""
    last = len(summary.graph.tokens) - 1
    groups = summary.feature_groups.set_index("name")
    off = [r.name for r in checked.itertuples() if not r.agree and r.name in groups.index
           and last not in groups.loc[r.name, "positions"]]
    if not off:
        return ""
    return (f"{len(off)} of the disagreements sit at earlier tokens only: they reach the answer through attention, "
            "which the graph's prediction freezes and a free run moves (the QK panel below explains a head's "
            "pattern). ")
