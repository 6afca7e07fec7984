"""The Graph tab's attention panel: which heads carry an edge that crosses positions (head loadings), and why a head
attends from a query position to a key (QK attribution over the graph's nodes).

Every number is the library's: g.head_loadings(source, target) and g.qk(layer, head, query, key) on the session's
graph (slmviz.graphs.head_loadings, slmviz.graphs.qk; the workbench keeps each QK record, which the graph JSON
carries), the heat map is QKAttribution.plot. Each runs as a job of app/jobs.py's worker (a frozen forward and a
backward on the full model), so other sessions are served meanwhile. Bad input (a layer, head or position out of
range, a masked entry, a node not in the graph, an edge that does not cross positions) is the library's one-line
error, shown as a warning; the graph, its workbench state and every panel stay as they were. QK pairs runs the head
typed in its boxes; with them empty it takes the strongest head of the edge typed above (its head loadings' largest
|weight|, the edge's target as query and its source as key), and with neither it asks for one: it never scores a
head the person did not choose.

Element ids: #graph-qk (the button), #graph-qk-result (the pairs table), #graph-head-loadings (the heads of an
edge); also #graph-edge, #graph-head-loadings-run, #graph-qk-layer, #graph-qk-head, #graph-qk-query, #graph-qk-key,
#graph-qk-plot, #graph-qk-status.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr
import pandas as pd

from ..jobs import RUNNER
from ..shared import Queues, display_frame, readable_errors, session, to_plot, wait_or_say
from .graph_state import GraphState, built, keeps_work

JOB_KIND = "qk"
PAIRS_SHOWN = 20  # rows of the pairs table
HEAT_MAP_NODES = 10  # query-side x key-side nodes of the heat map

INTRO = """**Attention: which heads carry an edge, and why they attend.** Type an edge that crosses positions (`source
-> target`, node ids as in the graph; the source at an earlier position) and press **Head loadings**: the part of the
edge that flows through each head, and its one-hop part. Select a head in that table (or type a layer, head, query and
key position; with none typed, QK pairs takes the edge's strongest head) and press **QK pairs**: the head's pre-softmax
score at (query, key) split exactly over pairs of this graph's nodes, query side x key side, with a heat map of the top
nodes of each side."""


def whole(value: Any, what: str) -> int:
    """A number box's value as a whole number, or a readable error naming the box."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"The {what} must be a whole number, got {value!r}") from None
    if not number.is_integer():
        raise ValueError(f"The {what} must be a whole number, got {value!r}")
    return int(number)


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def strongest_head(graph: Any, source: str, target: str, report: Callable[..., None]) -> list[int]:
    """[layer, head, query, key] of the head that carries the most of the edge source -> target (its head
    loadings' largest |weight|), queried from the target's position to the source's."""
    report(0.1, f"Finding the strongest head of {source} -> {target} (its head loadings)")
    table = graph.head_loadings(source, target)
    if not len(table):
        raise ValueError(f"No head carries {source} -> {target}; type a layer and head")
    best = table.iloc[int(table["weight"].abs().to_numpy().argmax())]
    positions = dict(zip(graph.nodes["node_id"], graph.nodes["position"], strict=True))
    return [int(best["layer"]), int(best["head"]), int(positions[target]), int(positions[source])]


def split_edge(text: str | None) -> tuple[str, str]:
    """'source -> target' (or 'source, target') as the two node ids."""
    parts = [p for p in re.split(r"\s*(?:->|→|,)\s*", (text or "").strip()) if p]
    if len(parts) != 2:
        raise ValueError(f"An edge is 'source -> target' (two node ids of the graph), got {text!r}")
    return parts[0], parts[1]


class QKHandlers:
    """Head loadings and QK attributions of the session's graph (the Graph tab's GraphState)."""

    @staticmethod
    def _graph(found: GraphState | None) -> Any:
        return built(found, "ask about its attention").graph

    @readable_errors
    @keeps_work(2, said=1)
    def head_loadings(self, found: GraphState | None, edge: str, request: gr.Request,
                      progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The heads that carry the edge (a job of the worker): layer, head, weight, one-hop part."""
        graph = self._graph(found)
        source, target = split_edge(edge)

        def work(report: Callable[..., None]) -> pd.DataFrame:
            report(0.1, f"Splitting {source} -> {target} over the heads (a forward and a backward)")
            return graph.head_loadings(source, target)

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        for _ in wait_or_say(job, session(request), progress, "Cancelled"):
            yield gr.skip(), gr.skip()
        table = job.result
        a = table.attrs
        said = (f"**{a['source']} -> {a['target']}**: edge weight {a['edge']:+.4g}, of which {a['multi_head']:+.4g} "
                f"({a['multi_head_share']:.0%}) through two heads or more. Select a head for its QK pairs.")
        yield display_frame(table.round(6)), said

    @readable_errors
    @keeps_work(4)
    def pick_head(self, evt: gr.SelectData, found: GraphState | None, edge: str) -> tuple:
        """A row of the head-loadings table: its layer and head, the edge's target as query and source as key."""
        graph = self._graph(found)
        row = evt.row_value or []
        if len(row) < 2:
            raise ValueError("Select a row of the head-loadings table")
        source, target = split_edge(edge)
        positions = dict(zip(graph.nodes["node_id"], graph.nodes["position"], strict=True))
        return int(row[0]), int(row[1]), int(positions.get(target, -1)), int(positions.get(source, 0))

    @readable_errors
    @keeps_work(7, said=2)
    def qk(self, found: GraphState | None, layer: Any, head: Any, query: Any, key: Any, edge: str | None,
           request: gr.Request, progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The QK pairs of (layer, head) at (query, key) (a job of the worker): the table, heat map and status, and
        the entry it scored in the four boxes. With the head's boxes empty: the strongest head of the typed edge."""
        graph = self._graph(found)
        chosen = not (_empty(layer) and _empty(head))
        if chosen:
            entry = [whole(v, what) for v, what in ((layer, "layer"), (head, "head"), (query, "query position"),
                                                    (key, "key position"))]
        elif (edge or "").strip():
            source, target = split_edge(edge)
        else:
            raise ValueError("Choose a head first: type its layer and head, or type an edge above (then QK pairs "
                             "takes its strongest head, or press Head loadings and select one)")

        def work(report: Callable[..., None]) -> tuple[Any, list[int]]:
            at = entry if chosen else strongest_head(graph, source, target, report)
            report(0.5, f"QK attribution of layer {at[0]} head {at[1]}, query {at[2]} -> key {at[3]}")
            return graph.qk(*at), at

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        for _ in wait_or_say(job, session(request), progress, "Cancelled"):
            yield tuple(gr.skip() for _ in range(7))
        qk, at = job.result
        pairs = qk.pairs.head(PAIRS_SHOWN)
        table = pd.DataFrame({"query side": pairs["query_label"], "key side": pairs["key_label"],
                              "query node": pairs["query_node"], "key node": pairs["key_node"],
                              "contribution": pairs["contribution"].round(6)})
        how = "" if chosen else f" (the strongest head of {source} -> {target})"
        # a soft-capping model (Gemma 2) caps the score after the bilinear q.k that the pairs split: both are said
        capped = "" if qk.capped_score is None else (f", {qk.capped_score:.4g} after the model's soft-cap (the pairs "
                                                      "split the score before it)")
        said = (f"**Layer {qk.layer} head {qk.head}, query {qk.query} -> key {qk.key}**{how}: score {qk.score:.4g}"
                f"{capped} (pattern {qk.pattern:.3f}); the pairs sum to {qk.linear_score:.4g}. Top {len(table)} pairs "
                "by |contribution|.")
        yield display_frame(table), to_plot(qk.plot(HEAT_MAP_NODES)), said, *at

    def cancel(self, request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)
        return "Cancelled."


def build_qk_panel(state: gr.State, queues: Queues) -> None:
    """The attention panel's layout and events, under the workbench."""
    qh = QKHandlers()
    gr.Markdown(INTRO)
    with gr.Row():
        edge = gr.Textbox(label="edge (source -> target)", placeholder="e.g. 1_3_2 -> 27_0_5", elem_id="graph-edge",
                          scale=3)
        loadings_btn = gr.Button("Head loadings", elem_id="graph-head-loadings-run", scale=1)
    loadings = gr.Dataframe(label="heads carrying the edge (select one)", interactive=False, latex_delimiters=[],
                            max_height=260, elem_id="graph-head-loadings",
                            headers=["layer", "head", "weight", "one_hop"])
    with gr.Row():
        layer = gr.Number(label="layer (empty: the edge's strongest head)", value=None, precision=0,
                          elem_id="graph-qk-layer", min_width=80)
        head = gr.Number(label="head", value=None, precision=0, elem_id="graph-qk-head", min_width=80)
        query = gr.Number(label="query position (-1: the last)", value=-1, precision=0, elem_id="graph-qk-query",
                          min_width=80)
        key = gr.Number(label="key position", value=0, precision=0, elem_id="graph-qk-key", min_width=80)
        qk_btn = gr.Button("QK pairs", variant="primary", elem_id="graph-qk")
        cancel_btn = gr.Button("Cancel", elem_id="graph-qk-cancel")
    status = gr.Markdown(elem_id="graph-qk-status")
    pairs = gr.Dataframe(label="QK pairs: query-side x key-side nodes", interactive=False, latex_delimiters=[],
                         max_height=420, elem_id="graph-qk-result",
                         headers=["query side", "key side", "query node", "key node", "contribution"])
    heat = gr.Plot(show_label=False, elem_id="graph-qk-plot")  # the page's width: its title and axis labels fit
    runs = [gr.on([loadings_btn.click, edge.submit], qh.head_loadings, [state, edge], [loadings, status],
                  api_name="graph_head_loadings", **queues.jobs),
            qk_btn.click(qh.qk, [state, layer, head, query, key, edge], [pairs, heat, status, layer, head, query, key],
                         api_name="graph_qk", **queues.jobs)]
    loadings.select(qh.pick_head, [state, edge], [layer, head, query, key], api_visibility="private",
                    **queues.light)
    cancel_btn.click(qh.cancel, None, status, cancels=runs, api_name="graph_qk_cancel", **queues.light)
