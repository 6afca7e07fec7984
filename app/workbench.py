"""The attribution-graph workbench, under the Circuits tab's attribution graph: read the graph as Neuronpedia's
viewer lets people (node cards, pins and the subgraph with its scores, supernodes, labels) and test the story by
setting features and rerunning the model, offline.

Layout and handlers only: every number comes from slmviz.graphs.workbench / slmviz.graphs.intervene (the
library a notebook uses: g.pin, g.subgraph(), g.supernode, g.label, g.intervene, g.load_json) and every figure from
slmviz.plots.subgraph. The workbench's state (pins, supernodes, edited labels) lives on the session's graph, the one
the Circuits tab built (its gr.State `found`); a handler checks its input before it changes anything, so bad input
is a toast and the state stays as it was.

Element ids (tests outside the repo use them): #graph-plot (the graph, click a node), #graph-node-card,
#graph-pin (pin / unpin the selected node), #graph-subgraph (the pinned nodes' plot), #graph-supernode-name,
#graph-intervene, #graph-intervention-result; also #graph-node (the selected node id), #graph-table (the kept
features, select one), #graph-clear, #graph-pin-top, #graph-pin-top-n, #graph-subgraph-status,
#graph-supernode-members, #graph-supernode-add, #graph-label, #graph-label-save, #graph-intervene-nodes,
#graph-intervene-value, #graph-intervene-number, #graph-intervene-mode, #graph-json, #graph-load.

An intervention (two forwards and two short greedy continuations) is a job of app/scan_jobs.py's worker, like the
graph itself, so other sessions are served meanwhile.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr
import pandas as pd
import torch

from slmviz.features.dashboard import acts_hook, top_contexts
from slmviz.graphs.intervene import intervene
from slmviz.graphs.view import graph_view
from slmviz.graphs.workbench import WorkbenchError, feature_labels, node_index
from slmviz.plots.subgraph import subgraph_figure, workbench_figure

from .corpus_tab import SCANS, session
from .handlers import Handlers, display_frame, readable_errors, to_plot
from .scan_jobs import RUNNER, Job, JobCancelled, wait

WB_KIND = "intervention"
VALUE_CHOICES = [("0 (switch off)", "0"), ("−1× (flip)", "-1x"), ("2× (double)", "2x"), ("a number", "number")]
MODE_CHOICES = [("constrained (patterns, norms, errors frozen)", "constrained"), ("free (the model rerun)", "free")]
CONTINUATION_TOKENS = 8
TOP_LOGITS = 10
EDGES_SHOWN = 6
PIN_TOP_N = 10

# A click on a node of #graph-plot or #graph-subgraph (plotly's click is not a Gradio event): copy its node id
# (customdata[0]) into #graph-node and press the hidden #graph-node-show. Re-attached for a few seconds after every
# redraw; removeAllListeners keeps it to one handler per plot div.
NODE_CLICK_JS = """
() => {
  const attach = (sel) => {
    const div = document.querySelector(sel + ' .js-plotly-plot');
    if (!div || !div.on) return;
    if (div.removeAllListeners) div.removeAllListeners('plotly_click');
    div.on('plotly_click', (ev) => {
      const hit = (ev.points || []).find((p) => p.customdata && p.customdata[0] !== undefined);
      const box = document.querySelector('#graph-node textarea, #graph-node input');
      if (!hit || !box) return;
      box.value = String(hit.customdata[0]);
      box.dispatchEvent(new Event('input', {bubbles: true}));
      setTimeout(() => document.querySelector('#graph-node-show').click(), 150);
    });
  };
  let tries = 0;
  const timer = setInterval(() => { attach('#graph-plot'); attach('#graph-subgraph');
                                     if (++tries > 20) clearInterval(timer); }, 300);
}
"""

INTRO = """**Workbench.** Click a node (or select a feature in the table) to see its card. **Pin** the nodes that
tell the story: the subgraph on the right shows them with the edges among them, and its scores are recomputed as
Neuronpedia does (unpinned features merged into the error node of their layer and position). Group pinned nodes
into a named **supernode**, edit a feature's **label** (automatic ones say `[auto]`), and **intervene**: set the
selected features (or a supernode) to 0, −1×, 2× or a number and rerun the model. The JSON below carries the
pins and supernodes (`qParams`) and the labels (`clerp`); load one back to continue."""


def esc(x: Any) -> str:
    return html.escape(str(x))


class WorkbenchHandlers:
    """The workbench's handlers; the graph comes from the Circuits tab's `found` state, transcoders' names and
    scans from the Features tab's SAE store (`features`)."""

    def __init__(self, handlers: Handlers, features: Any = None):
        self.h = handlers
        self.features = features

    # --- the graph and its views --------------------------------------------------------------------------------
    @staticmethod
    def _found(found: dict | None) -> dict[str, Any]:
        if not found or "graph" not in found:
            raise ValueError("Build the attribution graph first (the button above), then use the workbench")
        return found

    def _pruned(self, found: dict, node_threshold: Any, edge_threshold: Any) -> Any:
        """The graph pruned at the sliders' thresholds (kept between calls; it shares the workbench state)."""
        from .circuits_tab import _thresholds

        key = _thresholds(node_threshold, edge_threshold)
        cached = found.get("wb_pruned")
        if cached is None or cached[0] != key:
            cached = (key, found["graph"].prune(*key))
            found["wb_pruned"] = cached
        self._use_scans(found)
        return cached[1]

    def _entries(self, found: dict) -> dict[int, Any]:
        """{layer: the Features tab's SAE entry} of the graph's transcoders."""
        if self.features is None:
            return {}
        model = found["model"]
        out = {}
        for layer, name in found.get("layers", {}).items():
            try:
                out[layer] = self.features.saes.get(model, name)
            except Exception:  # noqa: BLE001 - an SAE that no longer loads: no scan, no card contexts
                continue
        return out

    def _scan(self, found: dict, layer: int) -> Any:
        """The cached feature scan of the layer's transcoder (None until the Features tab has run it)."""
        from .features_tab import DASHBOARD_ROWS, TOP_K

        entry = self._entries(found).get(layer)
        if entry is None:
            return None
        done = SCANS.finished(found["model"], [acts_hook(entry.sae)], TOP_K, entry.key + DASHBOARD_ROWS)
        return done[0] if done else None

    def _use_scans(self, found: dict) -> None:
        graph = found["graph"]
        for layer in found.get("layers", {}):
            if layer not in graph.scans:
                scan = self._scan(found, layer)
                if scan is not None:
                    graph.use_scans({layer: scan})

    def _views(self, found: dict, node_threshold: Any, edge_threshold: Any) -> tuple:
        """(subgraph plot, subgraph status, feature table) of the current state: what a change shows first."""
        pruned = self._pruned(found, node_threshold, edge_threshold)
        labels = feature_labels(pruned)
        sg = pruned.subgraph()
        return to_plot(subgraph_figure(sg)), subgraph_status(pruned, sg), display_frame(node_table(pruned, labels))

    @readable_errors
    def graph_views(self, found: dict | None, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        """(graph plot, JSON file) of the current state, chained after every change: the larger graph is drawn and
        the JSON written after the subgraph shows (the subgraph's redraw is what a click waits for)."""
        if not found or "graph" not in found:
            return gr.skip(), gr.skip()
        pruned = self._pruned(found, node_threshold, edge_threshold)
        path = self.h.output_path("attribution-graph-workbench.json")
        path.write_text(json.dumps(pruned.to_json(slug=path.stem)))  # compact: written again after every change
        return to_plot(workbench_figure(graph_view(pruned, feature_labels(pruned)))), str(path)

    @readable_errors
    def render(self, found: dict | None, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        """Draw the workbench for the graph just built or re-pruned (nothing yet: no change)."""
        if not found or "graph" not in found:
            return tuple(gr.skip() for _ in range(5))
        return (*self._views(found, node_threshold, edge_threshold),
                *self.graph_views(found, node_threshold, edge_threshold))

    # --- the node card ------------------------------------------------------------------------------------------
    @readable_errors
    def card(self, found: dict | None, node: str, node_threshold: float | None,
             edge_threshold: float | None) -> tuple[str, str]:
        """The selected node's card, and its label for the label box."""
        found = self._found(found)
        pruned = self._pruned(found, node_threshold, edge_threshold)
        node = (node or "").strip()
        if not node:
            raise ValueError("Click a node in the graph (or select one in the table) first")
        return node_card(self, found, pruned, node), (pruned.label(node) if is_feature(pruned, node) else "")

    @readable_errors
    def select(self, evt: gr.SelectData, found: dict | None, node_threshold: float | None,
               edge_threshold: float | None) -> tuple[str, str, str]:
        """A row of the feature table: that node becomes the selected one."""
        row = evt.row_value or []
        if not row:
            raise ValueError("Select a row of the table")
        node = str(row[0])
        card, label = self.card(found, node, node_threshold, edge_threshold)
        return node, card, label

    # --- pins, supernodes, labels -------------------------------------------------------------------------------
    @readable_errors
    def pin(self, found: dict | None, node: str, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        """Pin the selected node(s) (ids separated by commas), or unpin them if they are all pinned already."""
        found = self._found(found)
        graph = found["graph"]
        ids = split_ids(node)
        if not ids:
            raise ValueError("Click a node in the graph (or type its id) to pin it")
        if all(i in graph.pinned for i in ids):
            graph.unpin(*ids)
        else:
            graph.pin(*ids)
        return self._views(found, node_threshold, edge_threshold)

    @readable_errors
    def clear(self, found: dict | None, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        found = self._found(found)
        found["graph"].clear_pins()
        return self._views(found, node_threshold, edge_threshold)

    @readable_errors
    def pin_top(self, found: dict | None, n: float | None, node_threshold: float | None,
                edge_threshold: float | None) -> tuple:
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
    def supernode(self, found: dict | None, name: str, members: str, node_threshold: float | None,
                  edge_threshold: float | None) -> tuple:
        """Group the named members (default: the pinned nodes in no supernode yet) under a name."""
        found = self._found(found)
        ids = split_ids(members)
        found["graph"].supernode(name, ids if ids else None)
        return self._views(found, node_threshold, edge_threshold)

    @readable_errors
    def label(self, found: dict | None, node: str, text: str, node_threshold: float | None,
              edge_threshold: float | None) -> tuple:
        """Set the selected feature's label ("" goes back to the automatic one); redraw and show its card."""
        found = self._found(found)
        graph = found["graph"]
        node = (node or "").strip()
        if not node:
            raise ValueError("Click a feature node first, then edit its label")
        graph.label(node, text or "")
        pruned = self._pruned(found, node_threshold, edge_threshold)
        return (*self._views(found, node_threshold, edge_threshold), node_card(self, found, pruned, node))

    @readable_errors
    def load(self, found: dict | None, file: Any, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        """Take a saved JSON's pins, supernodes and labels (refused, with nothing changed, if it was made for
        another model, transcoder set or prompt)."""
        found = self._found(found)
        if not file:
            raise ValueError("Choose a graph JSON to load")
        path = file if isinstance(file, str) else getattr(file, "name", file)
        found["graph"].load_json(path)
        return self._views(found, node_threshold, edge_threshold)

    # --- interventions ------------------------------------------------------------------------------------------
    @readable_errors
    def intervene(self, found: dict | None, nodes: str, selected: str, value: str, number: float | None, mode: str,
                  request: gr.Request, progress: gr.Progress = gr.Progress()) -> Iterator[str]:  # noqa: B008
        """Set the features (ids or supernode names, default: the selected node) and rerun the model: the top
        logits and a greedy continuation beside the original ones (a job of the worker)."""
        found = self._found(found)
        graph = found["graph"]
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
        from slmviz.graphs.intervene import resolve

        resolve(graph, {t: amount for t in targets})  # every check now, a readable error before the job

        def work(report: Callable[..., None]) -> Any:
            report(0.1, f"Rerunning the model with {', '.join(targets)} set ({mode})")
            return intervene(graph, {t: amount for t in targets}, constrained=mode == "constrained",
                             continuation=CONTINUATION_TOKENS)

        job = RUNNER.submit(work, session(request), kind=WB_KIND)
        for _ in waiting(job, session(request), progress):
            yield gr.skip()
        yield intervention_html(job.result, targets, mode)

    def cancel(self, request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=WB_KIND)
        return "<p>Cancelled.</p>"


def waiting(job: Job, who: str, progress: Any) -> Iterator[None]:
    try:
        yield from wait(job, who, progress)
    except JobCancelled:
        raise gr.Error("Cancelled; press Intervene to start again", print_exception=False) from None


def split_ids(text: str | None) -> list[str]:
    """Node ids or supernode names separated by commas (or new lines)."""
    parts = (text or "").replace("\n", ",").split(",")
    return [p.strip() for p in parts if p.strip()]


def is_feature(graph: Any, node: str) -> bool:
    index = node_index(graph)
    return node in index and graph.nodes["kind"].iat[index[node]] == "feature"


def node_table(pruned: Any, labels: dict[str, str]) -> pd.DataFrame:
    """The kept feature nodes, most influential first: node, layer, position, token, activation, label, pinned."""
    nodes = pruned.kept_nodes
    nodes = nodes[nodes["kind"] == "feature"]
    if pruned.influence is not None:
        order = pruned.influence.numpy()[nodes.index.to_numpy()].argsort(kind="stable")
        nodes = nodes.iloc[order]
    pinned = set(pruned.pinned)
    return pd.DataFrame({"node": nodes["node_id"], "layer": nodes["layer"].astype(int),
                         "position": nodes["position"].astype(int), "token": nodes["token"],
                         "activation": nodes["activation"].round(3),
                         "label": [labels.get(n, "") for n in nodes["node_id"]],
                         "pinned": ["yes" if n in pinned else "" for n in nodes["node_id"]]})


def subgraph_status(pruned: Any, sg: Any) -> str:
    if not len(sg.nodes):
        return "**Subgraph:** nothing pinned yet. Pin nodes (click one, then **Pin / unpin**), or pin the top n."
    s = sg.scores
    groups = "; ".join(f"**{esc(g[0])}**: {', '.join(g[1:])}" for g in pruned.supernodes) or "none"
    return (f"**Subgraph:** {len(pruned.pinned)} pinned nodes shown as {len(sg.nodes)} (supernodes collapsed), "
            f"{len(sg.links)} edges among them. Replacement score **{s['replacement']:.3f}**, completeness "
            f"**{s['completeness']:.3f}** (unpinned features merged into the error node of their layer and position). "
            f"Supernodes: {groups}. Pinned: {', '.join(pruned.pinned)}.")


def _edges_html(graph: Any, i: int, incoming: bool, labels: dict[str, str]) -> str:
    a = graph.adjacency
    weights = a[i] if incoming else a[:, i]
    k = min(EDGES_SHOWN, int((weights != 0).sum()))
    if k == 0:
        return "<p><i>none</i></p>"
    top = weights.abs().topk(k).indices.tolist()
    ids = graph.nodes["node_id"].to_numpy()
    kinds = graph.nodes["kind"].to_numpy()
    tokens = graph.nodes["token"].to_numpy()
    rows = "".join(
        f"<tr><td>{esc(ids[j])}</td><td>{esc(kinds[j])}</td><td>{esc(labels.get(ids[j]) or repr(tokens[j]))}</td>"
        f"<td style='text-align:right;color:{'#2471a3' if float(weights[j]) > 0 else '#c0392b'}'>"
        f"{float(weights[j]):+.4g}</td></tr>" for j in top)
    head = "<tr><th>node</th><th>kind</th><th>label / token</th><th>weight</th></tr>"
    return f"<table class='wb-table'>{head}{rows}</table>"


def _error_norms(found: dict) -> torch.Tensor:
    """[n_layers, pos]: the norm of what each layer's transcoder misses (a layer without one: its whole MLP output),
    and [n_layers, pos] of the MLP output's own norm; from one traced run of the graph's tokens, kept."""
    if "wb_error_norms" not in found:
        graph, model = found["graph"], found["model"]
        coders = dict(getattr(graph.transcoders, "coders", {}) or {})
        names = [f"blocks.{L}.hook_mlp_out" for L in range(graph.n_layers)]
        names += [f"{sae.hook_name_out}.hook_sae_error" for sae in coders.values()]
        t = model.trace(graph.input_ids, saes=list(coders.values()), names=names)
        out = torch.stack([t[f"blocks.{L}.hook_mlp_out"].float().norm(dim=-1) for L in range(graph.n_layers)])
        err = out.clone()
        for L, sae in coders.items():
            err[L] = t[f"{sae.hook_name_out}.hook_sae_error"].float().norm(dim=-1)
        found["wb_error_norms"] = (err, out)
    return found["wb_error_norms"]


def node_card(wb: WorkbenchHandlers, found: dict, pruned: Any, node: str) -> str:
    """The card of one node: what it is, its label, its strongest edges, and per kind: a feature's top contexts
    (the cached feature scan) and logit effects, an error node's norm and the transcoder that misses it."""
    graph = found["graph"]
    index = node_index(graph)
    if node not in index:
        raise WorkbenchError(f"{node!r} is not a node of this graph")
    i = index[node]
    r = graph.nodes.iloc[i]
    labels = feature_labels(pruned)
    pinned = "pinned" if node in graph.pinned else "not pinned"
    head = (f"<h4>{esc(r.kind)} {esc(node)} <small>({pinned})</small></h4><p>layer {esc(r.layer)}, position "
            f"{esc(r.position)}, token <code>{esc(repr(r.token))}</code>")
    parts = []
    if r.kind == "feature":
        layer, feature = int(r.layer), int(r.feature)
        name = found.get("layers", {}).get(layer, r.hook)
        head += f", activation <b>{float(r.activation):.4g}</b>; feature {feature} of <b>{esc(name)}</b></p>"
        head += f"<p>Label: <b>{esc(graph.label(node))}</b></p>"
        scan = wb._scan(found, layer)
        entry = wb._entries(found).get(layer)
        sae = entry.sae if entry is not None else getattr(graph.transcoders, "coders", {}).get(layer)
        if scan is not None and sae is not None:
            contexts = top_contexts(scan, sae, feature).head(5)
            rows = "".join(f"<li>{esc(c).replace('[[', '<b>').replace(']]', '</b>')} "
                           f"<small>({a:.3g})</small></li>" for c, a in zip(contexts["context"],
                                                                           contexts["activation"], strict=True))
            parts.append(f"<h5>Top activating contexts</h5><ol>{rows or '<li><i>it never fired</i></li>'}</ol>")
        else:
            parts.append("<p><i>No feature scan yet for this transcoder: <b>Open its page</b> above runs it once; "
                         "its top contexts then show here.</i></p>")
        if sae is not None:
            effects = sae.logit_effects(feature, k=5, model=found["model"])
            for kind in ("promoted", "suppressed"):
                toks = ", ".join(f"<code>{esc(repr(t))}</code> {e:+.3g}"
                                 for t, e in zip(effects.loc[effects.kind == kind, "token"],
                                                 effects.loc[effects.kind == kind, "effect"], strict=True))
                parts.append(f"<p>Logit effects, {kind}: {toks}</p>")
    elif r.kind == "error":
        layer, pos = int(r.layer), int(r.position)
        err, out = _error_norms(found)
        name = found.get("layers", {}).get(layer)
        missing = (f"what <b>{esc(name)}</b> misses of this MLP output" if name else
                   "no transcoder at this layer: the whole MLP output is error")
        share = float(err[layer, pos]) / max(float(out[layer, pos]), 1e-12)
        head += (f"</p><p>Norm <b>{float(err[layer, pos]):.4g}</b> ({share:.0%} of the MLP output's norm "
                 f"{float(out[layer, pos]):.4g}): {missing}.</p>")
        if pos == 0:
            head += "<p><i>Position 0's errors are left out of the graph (zero_bos).</i></p>"
    elif r.kind == "logit":
        head += f", probability <b>{float(r.probability):.3f}</b></p>"
    else:
        head += "</p>"
    parts.append("<h5>Strongest incoming edges</h5>" + _edges_html(graph, i, True, labels))
    parts.append("<h5>Strongest outgoing edges</h5>" + _edges_html(graph, i, False, labels))
    return f"<div class='wb-card'>{head}{''.join(parts)}</div>"


def intervention_html(r: Any, targets: list[str], mode: str) -> str:
    """The top logits and the greedy continuation, original beside new."""
    top = r.top(TOP_LOGITS)

    def table(prefix: str) -> str:
        rows = "".join(f"<tr><td>{i}</td><td><code>{esc(repr(t))}</code></td><td>{p:.3f}</td><td>{lg:.3f}</td></tr>"
                       for i, (t, p, lg) in enumerate(zip(top[f"{prefix}token"], top[f"{prefix}prob"],
                                                          top[f"{prefix}logit"], strict=True)))
        return f"<table class='wb-table'><tr><th>#</th><th>token</th><th>prob</th><th>logit</th></tr>{rows}</table>"

    values = ", ".join(f"{esc(k)} = {v:.4g}" for k, v in r.values.items())
    crossed = ""
    if r.crossed:
        shown = ", ".join(esc(c) for c in r.crossed[:12]) + (f" and {len(r.crossed) - 12} more"
                                                             if len(r.crossed) > 12 else "")
        crossed = (f"<p><b>{len(r.crossed)} features crossed their threshold</b>, so the result leaves the graph's "
                   f"linear model: {shown}</p>")
    return (f"<div class='wb-intervention'><p>Set {values} ({esc(mode)}; {len(targets)} target(s)).</p>{crossed}"
            f"<div style='display:flex;gap:24px;flex-wrap:wrap'>"
            f"<div class='wb-original'><h5>Original top logits</h5>{table('')}"
            f"<p>Greedy continuation: <code>{esc(r.original_continuation)}</code></p></div>"
            f"<div class='wb-new'><h5>New top logits</h5>{table('new ')}"
            f"<p>Greedy continuation: <code>{esc(r.continuation)}</code></p></div></div>"
            f"<p><small>The continuation always runs free (new tokens have no frozen patterns), with the edit at the "
            f"prompt's positions.</small></p></div>")


def build_workbench(handlers: Handlers, features: Any, found: gr.State, node_threshold: gr.Slider,
                    edge_threshold: gr.Slider, light_kw: dict, job_kw: dict) -> Callable[..., None]:
    """The workbench's layout, inside the Circuits tab's attribution-graph accordion, and its events; returns
    wire(*events): after each of those events (the graph built, re-pruned) the workbench redraws."""
    wb = WorkbenchHandlers(handlers, features)
    with gr.Accordion("Workbench: inspect, pin, group, label and intervene", open=True):
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=3):
                graph_plot = gr.Plot(show_label=False, elem_id="graph-plot")
                table = gr.Dataframe(label="kept features, most influential first (select one; then Pin)",
                                     interactive=False, elem_id="graph-table", latex_delimiters=[], max_height=300,
                                     headers=["node", "layer", "position", "token", "activation", "label", "pinned"])
            with gr.Column(scale=2):
                with gr.Row():
                    node = gr.Textbox(label="selected node (click one, or type ids separated by commas)",
                                      elem_id="graph-node", scale=3)
                    show = gr.Button("Show", elem_id="graph-node-show", scale=1, min_width=60)
                with gr.Row():
                    pin_btn = gr.Button("Pin / unpin", variant="primary", elem_id="graph-pin")
                    clear_btn = gr.Button("Clear pins", elem_id="graph-clear")
                with gr.Row():
                    top_n = gr.Number(value=PIN_TOP_N, precision=0, minimum=1, label="n", elem_id="graph-pin-top-n",
                                      min_width=80)
                    top_btn = gr.Button("Pin the top n features by influence (and the top logit)",
                                        elem_id="graph-pin-top")
                card = gr.HTML(elem_id="graph-node-card")
        with gr.Row():
            with gr.Column(scale=3):
                sub_plot = gr.Plot(show_label=False, elem_id="graph-subgraph")
                sub_status = gr.Markdown(elem_id="graph-subgraph-status")
            with gr.Column(scale=2):
                with gr.Row():
                    sn_name = gr.Textbox(label="supernode name", placeholder="say Paris",
                                         elem_id="graph-supernode-name")
                    sn_members = gr.Textbox(label="members (empty: the pinned nodes in no supernode)",
                                            elem_id="graph-supernode-members")
                sn_btn = gr.Button("Make the supernode", elem_id="graph-supernode-add")
                with gr.Row():
                    label_box = gr.Textbox(label="label of the selected feature (empty: automatic)",
                                           elem_id="graph-label", scale=3)
                    label_btn = gr.Button("Save label", elem_id="graph-label-save", scale=1, min_width=60)
                json_file = gr.File(label="the graph with pins, supernodes and labels (JSON)", elem_id="graph-json")
                load_file = gr.File(label="load a saved graph JSON", file_types=[".json"], type="filepath",
                                    elem_id="graph-load")
        gr.Markdown("**Intervene**: set the selected feature(s), named nodes or a supernode, and rerun the model.")
        with gr.Row():
            iv_nodes = gr.Textbox(label="nodes or supernode (empty: the selected node)",
                                  elem_id="graph-intervene-nodes", scale=2)
            iv_value = gr.Radio(VALUE_CHOICES, value="0", label="set to", elem_id="graph-intervene-value", scale=2)
            iv_number = gr.Number(value=0.0, label="number", elem_id="graph-intervene-number", min_width=80, scale=1)
            iv_mode = gr.Radio(MODE_CHOICES, value="constrained", label="mode", elem_id="graph-intervene-mode",
                               scale=2)
        with gr.Row():
            iv_btn = gr.Button("Intervene", variant="primary", elem_id="graph-intervene")
            iv_cancel = gr.Button("Cancel", elem_id="graph-intervene-cancel")
        iv_result = gr.HTML(elem_id="graph-intervention-result")

    thresholds = [node_threshold, edge_threshold]
    views = [sub_plot, sub_status, table]
    later = [graph_plot, json_file]
    table.select(wb.select, [found, *thresholds], [node, card, label_box], api_visibility="private", **light_kw)
    gr.on([show.click, node.submit], wb.card, [found, node, *thresholds], [card, label_box],
          api_name="workbench_card", **light_kw)
    changes = [
        pin_btn.click(wb.pin, [found, node, *thresholds], views, api_name="workbench_pin", **light_kw),
        clear_btn.click(wb.clear, [found, *thresholds], views, api_name="workbench_clear", **light_kw),
        top_btn.click(wb.pin_top, [found, top_n, *thresholds], views, api_name="workbench_pin_top", **light_kw),
        gr.on([sn_btn.click, sn_name.submit], wb.supernode, [found, sn_name, sn_members, *thresholds], views,
              api_name="workbench_supernode", **light_kw),
        gr.on([label_btn.click, label_box.submit], wb.label, [found, node, label_box, *thresholds], [*views, card],
              api_name="workbench_label", **light_kw),
        load_file.upload(wb.load, [found, load_file, *thresholds], views, api_name="workbench_load", **light_kw),
    ]
    for i, change in enumerate(changes):  # then the graph plot and the JSON (one endpoint for API clients)
        change.success(wb.graph_views, [found, *thresholds], later, **light_kw,
                       **({"api_name": "workbench_views"} if i == 0 else {"api_visibility": "private"}))
    ran = iv_btn.click(wb.intervene, [found, iv_nodes, node, iv_value, iv_number, iv_mode], iv_result,
                       api_name="workbench_intervene", **job_kw)
    iv_cancel.click(wb.cancel, None, iv_result, cancels=[ran], api_name="workbench_cancel", **light_kw)
    graph_plot.change(None, None, None, js=NODE_CLICK_JS)
    sub_plot.change(None, None, None, js=NODE_CLICK_JS)

    def wire(*events: Any) -> None:
        for event in events:
            event.then(wb.render, [found, *thresholds], [*views, *later], api_visibility="private", **light_kw)

    return wire


__all__ = ["WorkbenchHandlers", "build_workbench", "node_card", "node_table"]
