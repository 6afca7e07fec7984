"""The graph workbench's handlers: read the attribution graph as Neuronpedia's viewer lets people (node cards, pins and
the subgraph with its scores, supernodes, labels) and test the story by setting features and rerunning the model,
offline.

Every number comes from slmviz.graphs.workbench / slmviz.graphs.intervene (the library a notebook uses: g.pin,
g.subgraph(), g.supernode, g.label, g.intervene, g.load_json), every figure from slmviz.plots.subgraph, and every
card from app/tabs/graph_cards.py. The workbench's state (pins, supernodes, edited labels) lives on the session's
graph, the one the Graph tab built (its GraphState, app/tabs/graph_state.py); a handler checks its input before it
changes anything, so bad input is a warning and the state and every panel stay as they were. An intervention (two
forwards and two short greedy continuations) is a job of app/jobs.py's worker, like the graph itself, so other
sessions are served meanwhile. The layout and events are app/tabs/graph.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from slmviz.graphs.intervene import intervene, resolve
from slmviz.graphs.workbench import feature_labels, node_index
from slmviz.plots.subgraph import subgraph_figure

from ..jobs import RUNNER
from ..models import AppContext
from ..saes import SAEStore, finished_feature_scan, scan_source
from ..shared import display_frame, parse_thresholds, readable_errors, session, to_plot, wait_or_say
from .graph_cards import intervention_html, is_feature, node_card, node_table, split_ids, subgraph_status
from .graph_readable import readable_figure
from .graph_state import GraphState, built, keeps_work

JOB_KIND = "intervention"  # the workbench's Cancel leaves only this kind of job
VALUE_CHOICES = [("0 (switch off)", "0"), ("−1× (flip)", "-1x"), ("2× (double)", "2x"), ("a number", "number")]
MODE_CHOICES = [("constrained (patterns, norms, errors frozen)", "constrained"), ("free (the model rerun)", "free")]
CONTINUATION_TOKENS = 8


class WorkbenchHandlers:
    """The workbench's handlers; the graph comes from the Graph tab's GraphState, its transcoders' entries and
    feature scans from the server's SAEStore."""

    def __init__(self, ctx: AppContext, saes: SAEStore):
        self.ctx = ctx
        self.saes = saes

    # --- the graph and its views --------------------------------------------------------------------------------
    @staticmethod
    def _found(found: GraphState | None) -> GraphState:
        return built(found)

    def _pruned(self, found: GraphState, node_threshold: Any, edge_threshold: Any) -> Any:
        """The graph pruned at the sliders' thresholds (kept between calls; it shares the workbench state)."""
        pruned = found.prune(parse_thresholds(node_threshold, edge_threshold))
        self._use_scans(found)
        return pruned

    def _entries(self, found: GraphState) -> dict[int, Any]:
        """{layer: the SAEStore's entry} of the graph's transcoders."""
        model = found.model
        out = {}
        for layer, name in found.layers.items():
            try:
                out[layer] = self.saes.get(model, name)
            except Exception:  # noqa: BLE001 - an SAE that no longer loads: no scan, no card contexts
                continue
        return out

    def _scan(self, found: GraphState, layer: int) -> Any:
        """The cached feature scan of the layer's transcoder (None until the Features tab has run it)."""
        entry = self._entries(found).get(layer)
        if entry is None:
            return None
        done = finished_feature_scan(found.model, entry)
        return done[0] if done else None

    def _coder(self, found: GraphState, layer: int) -> tuple[Any, Any, str]:
        """(the layer's transcoder, its cached feature scan or None, where that scan's text comes from): what a
        feature's card reads."""
        entry = self._entries(found).get(layer)
        sae = entry.sae if entry is not None else getattr(found.graph.transcoders, "coders", {}).get(layer)
        done = finished_feature_scan(found.model, entry) if entry is not None else None
        return sae, (done[0] if done else None), scan_source(entry, done[1] if done else None)

    def _card(self, found: GraphState, pruned: Any, node: str) -> str:
        return node_card(found, pruned, node, lambda layer: self._coder(found, layer))

    def _use_scans(self, found: GraphState) -> None:
        """The graph's automatic labels read each layer's current feature scan: a scan rebuilt since the graph was
        built (app/tabs/graph_scan.py) replaces the one it had (its labels are cached per scan, edited ones kept)."""
        graph = found.graph
        for layer in found.layers:
            scan = self._scan(found, layer)
            if scan is not None and graph.scans.get(layer) is not scan:
                graph.use_scans({layer: scan})

    def _views(self, found: GraphState, node_threshold: Any, edge_threshold: Any) -> tuple:
        """(subgraph plot, subgraph status, feature table) of the current state: what a change shows first."""
        pruned = self._pruned(found, node_threshold, edge_threshold)
        labels = feature_labels(pruned)
        sg = pruned.subgraph()
        return to_plot(subgraph_figure(sg)), subgraph_status(pruned, sg), display_frame(node_table(pruned, labels))

    @readable_errors
    def graph_views(self, found: GraphState | None, node_threshold: float | None,
                    edge_threshold: float | None) -> tuple:
        """(graph plot, JSON file) of the current state, chained after every change: the larger graph is drawn and
        the JSON written after the subgraph shows (the subgraph's redraw is what a click waits for)."""
        if not isinstance(found, GraphState):
            return gr.skip(), gr.skip()
        pruned = self._pruned(found, node_threshold, edge_threshold)
        path = self.ctx.output_path("attribution-graph-workbench.json")
        path.write_text(json.dumps(pruned.to_json(slug=path.stem)))  # compact: written again after every change
        kept = int(pruned.node_mask.sum())
        focus = [n for n in found.focus if n in node_index(pruned)]
        title = (f"{pruned.prompt!r}: {kept:,} kept nodes (ringed: purple pinned"
                 + (f", orange the {len(focus)} nodes of the summary box clicked" if focus else "") + ")")
        grouped = set()  # the summary's supernodes pin their members: those are not the person's pins
        if found.summary is not None:
            grouped = {str(m) for ms in found.summary.feature_groups["members"] for m in ms}
        return (to_plot(readable_figure(pruned, feature_labels(pruned), title, focus=focus, grouped=grouped)),
                str(path))

    @readable_errors
    def render(self, found: GraphState | None, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        """Draw the workbench for the graph just built or re-pruned (nothing yet: no change)."""
        if not isinstance(found, GraphState):
            return tuple(gr.skip() for _ in range(5))
        return (*self._views(found, node_threshold, edge_threshold),
                *self.graph_views(found, node_threshold, edge_threshold))

    # --- the node card ------------------------------------------------------------------------------------------
    @readable_errors
    @keeps_work(2)
    def card(self, found: GraphState | None, node: str, node_threshold: float | None,
             edge_threshold: float | None, request: gr.Request) -> tuple[str, str]:
        """The selected node's card, and its label for the label box."""
        return self._node_card(found, node, node_threshold, edge_threshold)

    def _node_card(self, found: GraphState | None, node: str, node_threshold: Any,
                   edge_threshold: Any) -> tuple[str, str]:
        found = self._found(found)
        pruned = self._pruned(found, node_threshold, edge_threshold)
        node = (node or "").strip()
        if not node:
            raise ValueError("Click a node in the graph (or select one in the table) first")
        return self._card(found, pruned, node), (pruned.label(node) if is_feature(pruned, node) else "")

    @readable_errors
    def card_again(self, found: GraphState | None, node: str, node_threshold: float | None,
                   edge_threshold: float | None) -> Any:
        """The selected node's card drawn again (its feature scan was rebuilt); no change when no node of the
        graph is selected (nothing was asked for: no error)."""
        node = (node or "").strip()
        if not isinstance(found, GraphState) or node not in node_index(found.graph):
            return gr.skip()
        return self._card(found, self._pruned(found, node_threshold, edge_threshold), node)

    @readable_errors
    @keeps_work(3)
    def select(self, evt: gr.SelectData, found: GraphState | None, node_threshold: float | None,
               edge_threshold: float | None, request: gr.Request) -> tuple[str, str, str]:
        """A row of the feature table: that node becomes the selected one."""
        row = evt.row_value or []
        if not row:
            raise ValueError("Select a row of the table")
        node = str(row[0])
        card, label = self._node_card(found, node, node_threshold, edge_threshold)
        return node, card, label

    # --- pins, supernodes, labels -------------------------------------------------------------------------------
    @readable_errors
    @keeps_work(3)
    def pin(self, found: GraphState | None, node: str, node_threshold: float | None,
            edge_threshold: float | None, request: gr.Request) -> tuple:
        """Pin the selected node(s) (ids separated by commas), or unpin them if they are all pinned already."""
        found = self._found(found)
        graph = found.graph
        ids = split_ids(node)
        if not ids:
            raise ValueError("Click a node in the graph (or type its id) to pin it")
        if all(i in graph.pinned for i in ids):
            graph.unpin(*ids)
        else:
            graph.pin(*ids)
        return self._views(found, node_threshold, edge_threshold)

    @readable_errors
    @keeps_work(3)
    def clear(self, found: GraphState | None, node_threshold: float | None, edge_threshold: float | None,
              request: gr.Request) -> tuple:
        found = self._found(found)
        found.graph.clear_pins()
        return self._views(found, node_threshold, edge_threshold)

    @readable_errors
    @keeps_work(3)
    def pin_top(self, found: GraphState | None, n: float | None, node_threshold: float | None,
                edge_threshold: float | None, request: gr.Request) -> tuple:
        """Pin the n kept features with the largest influence on the logits, and the most probable logit."""
        found = self._found(found)
        try:
            count = int(n) if n is not None and float(n) == int(n) else None
        except (TypeError, ValueError, OverflowError):
            count = None
        if count is None or count < 1:
            raise ValueError(f"The number of nodes to pin must be a whole number of at least 1, got {n!r}")
        pruned = self._pruned(found, node_threshold, edge_threshold)
        pruned.pin_top(count, logit=True)
        return self._views(found, node_threshold, edge_threshold)

    @readable_errors
    @keeps_work(3)
    def supernode(self, found: GraphState | None, name: str, members: str, node_threshold: float | None,
                  edge_threshold: float | None, request: gr.Request) -> tuple:
        """Group the named members (default: the pinned nodes in no supernode yet) under a name."""
        found = self._found(found)
        ids = split_ids(members)
        found.graph.supernode(name, ids if ids else None)
        return self._views(found, node_threshold, edge_threshold)

    @readable_errors
    @keeps_work(4)
    def label(self, found: GraphState | None, node: str, text: str, node_threshold: float | None,
              edge_threshold: float | None, request: gr.Request) -> tuple:
        """Set the selected feature's label ("" goes back to the automatic one); redraw and show its card."""
        found = self._found(found)
        graph = found.graph
        node = (node or "").strip()
        if not node:
            raise ValueError("Click a feature node first, then edit its label")
        graph.label(node, text or "")
        pruned = self._pruned(found, node_threshold, edge_threshold)
        return (*self._views(found, node_threshold, edge_threshold), self._card(found, pruned, node))

    @readable_errors
    @keeps_work(3)
    def load(self, found: GraphState | None, file: Any, node_threshold: float | None,
             edge_threshold: float | None, request: gr.Request) -> tuple:
        """Take a saved JSON's pins, supernodes and labels (refused, with nothing changed, if it was made for
        another model, transcoder set or prompt)."""
        found = self._found(found)
        if not file:
            raise ValueError("Choose a graph JSON to load")
        path = file if isinstance(file, str) else getattr(file, "name", file)
        found.graph.load_json(path)
        return self._views(found, node_threshold, edge_threshold)

    # --- interventions ------------------------------------------------------------------------------------------
    @readable_errors
    @keeps_work(1)
    def intervene(self, found: GraphState | None, nodes: str, selected: str, value: str, number: float | None,
                  mode: str,
                  request: gr.Request, progress: gr.Progress = gr.Progress()) -> Iterator[str]:  # noqa: B008
        """Set the features (ids or supernode names, default: the selected node) and rerun the model: the top
        logits and a greedy continuation beside the original ones (a job of the worker)."""
        found = self._found(found)
        graph = found.graph
        targets = split_ids(nodes) or split_ids(selected)
        if not targets:
            raise ValueError("Click a feature node (or name nodes or a supernode) to intervene on")
        if value not in ("0", "-1x", "2x", "number"):
            raise ValueError(f"Pick a value: 0, -1x, 2x or a number (got {value!r})")
        amount: Any = value
        if value == "number":
            if number is None:
                raise ValueError("Type the number to set the features to")
            amount = number
        if mode not in ("constrained", "free"):
            raise ValueError(f"Pick a mode: constrained or free (got {mode!r})")
        resolve(graph, {t: amount for t in targets})  # every check now, a readable error before the job

        def work(report: Callable[..., None]) -> Any:
            report(0.1, f"Rerunning the model with {', '.join(targets)} set ({mode})")
            return intervene(graph, {t: amount for t in targets}, constrained=mode == "constrained",
                             continuation=CONTINUATION_TOKENS)

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        for _ in wait_or_say(job, session(request), progress, "Cancelled; press Intervene to start again"):
            yield gr.skip()
        yield intervention_html(job.result, targets, mode)

    def cancel(self, request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)
        return "<p>Cancelled.</p>"
