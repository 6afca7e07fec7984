"""The Graph tab: one prompt's attribution graph over a model's transcoders, told first as a short checked story
(its summary), then drawn to be read, with its workbench.

The tab picks the best transcoders that are ready (the full per-layer set, then the CLT, then the quick set, then the
bundled single transcoders: app/transcoder_sets.py) and says in #graph-set which it uses and what the graph scores;
a set that is not built yet is offered for building (#graph-build-quick, #graph-build-full: long jobs with their
progress and Cancel, resumed after a restart from their checkpoint), not for picking. A gallery (#graph-gallery)
offers prompts the model answers right, each with the probability of its answer (measured: bench/studies/
graph_gallery.py writes app/graph_gallery.json). Before a graph exists the page shows nothing else; once it is built
(#graph-build):

- #graph-answer says what the model answers (the graph explains its top logits), and says so plainly when that is
  not what the prompt seems to ask; the graph puts the tokenizer's special token in front of the prompt (position
  0, an attention sink whose features it leaves out, as circuit-tracer does), and says which;
- #graph-summary: the graph's supernodes as boxes with weighted arrows, each with its checked effect; clicking a box
  opens its nodes in the full graph (app/tabs/graph_summary.py);
- #graph-plot: the full graph, tokens along the bottom and layers upward (app/tabs/graph_readable.py), the 50 most
  influential nodes first; two sliders redraw it in the page; hovering or clicking a node picks out its edges and
  dims the rest; no two labels overlap (the page hides a label that would cover another; every node's hover text
  has its label); a click shows its card under the graph;
- the workbench (app/tabs/graph_workbench.py: pins and the subgraph with its scores, supernodes, labels,
  interventions), the attention panel (app/tabs/graph_qk.py: head loadings and QK pairs), and the kept features'
  table with each feature's page (the Features tab's card).

The session's state is one GraphState (app/tabs/graph_state.py). A user's mistake is a warning, and every panel
keeps what it showed (graph_state.keeps_work).

Element ids (tests use them): #graph-set, #graph-prompt, #graph-transcoders, #graph-gallery, #graph-build-quick,
#graph-build-quick-cancel, #graph-quick-status, #graph-build-full, #graph-build-full-cancel, #graph-full-status,
#graph-node-threshold, #graph-edge-threshold, #graph-build, #graph-cancel, #graph-status, #graph-answer,
#graph-results (everything shown once a graph exists), #graph-summary, #graph-summary-status, #graph-keep-nodes,
#graph-min-weight, #graph-plot (click a node), #graph-node-card, #graph-pin, #graph-subgraph,
#graph-supernode-name, #graph-intervene, #graph-intervention-result; also #graph-node (the selected node id),
#graph-node-show, #graph-table (the kept features, select one), #graph-clear, #graph-pin-top, #graph-pin-top-n,
#graph-subgraph-status, #graph-supernode-members, #graph-supernode-add, #graph-label, #graph-label-save,
#graph-intervene-nodes, #graph-intervene-value, #graph-intervene-number, #graph-intervene-mode,
#graph-intervene-cancel, #graph-json, #graph-load; the kept features: #graph-all-edges (every kept edge drawn),
#graph-features (their table), #graph-pruned-json, #graph-feature-node, #graph-feature-open, #graph-feature-card;
beside the node card, while the set in use has no readable prepared scan: #graph-rebuild-scan,
#graph-rebuild-scan-cancel, #graph-rebuild-scan-status (app/tabs/graph_scan.py); the attention panel's
(app/tabs/graph_qk.py).

API names: graph_attribution, graph_attribution_cancel, graph_prune, graph_feature, graph_summary, graph_summary_apply,
graph_build_full, graph_build_full_cancel, graph_build_quick, graph_build_quick_cancel, and the workbench's. The
names before the rename (circuit_attribution, circuit_attribution_cancel, circuit_prune, circuit_feature,
circuit_set_build, circuit_set_cancel) stay for one release (OLD_API_NAMES); circuit_attribution takes the names of
the transcoders as before, unchecked against the picker's choices (so a set not built yet gets the handler's "build
it first"). So does the old id of the picker, #circuit-attr-transcoders, around #graph-transcoders. An API client
gets a bad input's error (the page gets a warning and keeps its panels).

Clicking a node: plotly's click is not a Gradio event, so a few lines of page JavaScript (app/shared.py's
plot_click_js) copy the node's id into a textbox and press its button.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr
from gradio.context import Context

from slmviz.plots.features import FEATURE_LINK

from ..jobs import RUNNER
from ..models import AppContext
from ..saes import SAEStore
from ..scans import SCANS
from ..shared import PICK_FEATURE, PICK_NODE, Queues, html_click_js, plot_click_js, session
from ..transcoder_sets import QUICK
from .graph_attribution import JOB_KIND, AttributionHandlers, gallery_samples
from .graph_qk import build_qk_panel
from .graph_readable import (
    KEEP_DEFAULT,
    KEEP_MIN,
    KEEP_STEP,
    MAX_NODES_SENT,
    MIN_WEIGHT_DEFAULT,
    MIN_WEIGHT_MAX,
    MIN_WEIGHT_STEP,
    highlight_js,
    redraw_js,
)
from .graph_scan import RebuildPanel, ScanRebuild
from .graph_summary import CLICK_JS as SUMMARY_CLICK_JS
from .graph_summary import SummaryHandlers
from .graph_workbench import MODE_CHOICES, VALUE_CHOICES, WorkbenchHandlers

ATTR_PROMPT = "The capital of France is"
NODE_THRESHOLD, EDGE_THRESHOLD = 0.95, 0.98  # SmolLM2's two transcoders: 0.8 keeps error nodes only
PIN_TOP_N = 10
REDRAW_AFTER_MS = 300  # a new figure from the server: Gradio draws it first, then the sliders' values apply
FEATURE_CLICK_JS = html_click_js(FEATURE_LINK, "feature")  # a nearest feature's link on the card: its number
GRAPH_CLICK_JS = plot_click_js(["graph-all-edges"], "graph-feature-node", "graph-feature-open", PICK_FEATURE)
WORKBENCH_CLICK_JS = plot_click_js(["graph-plot", "graph-subgraph"], "graph-node", "graph-node-show", PICK_NODE)
# the API names before the rename to graph_*: kept for one release
OLD_API_NAMES = {"graph_attribution": "circuit_attribution", "graph_attribution_cancel": "circuit_attribution_cancel",
                 "graph_prune": "circuit_prune", "graph_feature": "circuit_feature",
                 "graph_build_full": "circuit_set_build", "graph_build_full_cancel": "circuit_set_cancel"}

INTRO = """**Attribution graph.** For one prompt: the active transcoder features at each position, one error node per
layer and position (what the transcoders miss; a layer without a transcoder is all error), the token embeddings and
the top logits, joined by their direct effects with attention patterns and norm scales frozen (circuit-tracer's
semantics). Pick a prompt from the gallery (ones the model answers right) or type your own, and build it: the
**summary** comes first (the graph's groups of features, each checked by turning it off), then the **full graph**
(hover a node to pick out its edges; click it for its card)."""

SUMMARY_INTRO = """**Summary.** The kept features grouped into supernodes (by layer, position and what they feed),
with the embedding, error and logit groups; arrows as thick as the summed edges between groups. Each box says what
setting its features to 0 does to the answer's logit, measured in a free run of the model, with the graph's own
prediction in brackets. **Click a box** to see its nodes in the full graph below."""

FEATURES_INTRO = """Every kept feature, most influential first, and the graph with all its kept edges
(slmviz's `g.plot()`). **Click a feature node** here, or select a row, to open its page (the Features tab's card)."""

WORKBENCH_INTRO = """**Workbench.** Click a node (or select a feature in the table) to see its card under the graph.
**Pin** the nodes that tell the story: the subgraph below shows them with the edges among them, and its scores are
recomputed as Neuronpedia does (unpinned features merged into the error node of their layer and position). Group
pinned nodes into a named **supernode**, edit a feature's **label** (automatic ones say `[auto]`), and **intervene**:
set the selected features (or a supernode) to 0, −1×, 2× or a number and rerun the model. The JSON below carries the
pins and supernodes (`qParams`) and the labels (`clerp`); load one back to continue."""

FULL_GRAPH_INTRO = """**The full graph.** Tokens run along the bottom and layers upward, the most influential nodes
first; the sliders choose how many nodes and which edges are drawn, without recomputing it. **Hover a node** to pick
out its edges (the rest dims); a label that would cover another is left off, and its node's hover text has it."""


def build_graph_tab(ctx: AppContext, saes: SAEStore, features: Any, source: gr.State, queues: Queues) -> None:
    """The Graph tab, inside the page's `with gr.Tabs():`; `features` is the Features tab's FeatureHandlers (a
    feature node's page is its card). Long work waits in the "jobs" queue."""
    ah = AttributionHandlers(ctx, saes, features)
    sh = SummaryHandlers()
    model = ctx.store.get()
    offered = ah.pickable(model)
    ticked = ah.ticked(model, offered)
    samples, labels = gallery_samples(model)
    with gr.Tab("Graph"):
        gr.Markdown(INTRO)
        set_line = gr.Markdown(ah.set_line(model, ticked, None), elem_id="graph-set")
        with gr.Row():
            prompt = gr.Textbox(label="prompt", value=samples[0][0] if samples else ATTR_PROMPT,
                                elem_id="graph-prompt", scale=3, info=ah.bos_note(model))
            with gr.Column(scale=2, elem_id="circuit-attr-transcoders"):  # the picker's old id, for one release
                names = gr.CheckboxGroup(offered, value=ticked, label="transcoders", elem_id="graph-transcoders")
        gallery = gr.Dataset(components=[prompt], samples=samples or [[ATTR_PROMPT]],
                             sample_labels=labels or None, label="prompts the model answers right (its answer, "
                             "with the probability it gives it)", elem_id="graph-gallery", samples_per_page=12)
        quick_shown, quick_said = ah.sets.panel(model, QUICK)  # app/transcoder_sets.py: build the quick set
        quick_status = gr.Markdown(quick_said, elem_id="graph-quick-status")
        with gr.Row():
            quick_build = gr.Button("Build the quick transcoder set", elem_id="graph-build-quick",
                                    visible=quick_shown, variant="primary")
            quick_cancel = gr.Button("Cancel the quick build", elem_id="graph-build-quick-cancel",
                                     visible=quick_shown)
        no_set, said = ah.sets.panel(model)  # the full set
        set_status = gr.Markdown(said, elem_id="graph-full-status")
        with gr.Row():
            set_build = gr.Button("Build the full transcoder set", elem_id="graph-build-full", visible=no_set)
            set_cancel = gr.Button("Cancel the build", elem_id="graph-build-full-cancel", visible=no_set)
        with gr.Row():
            node_threshold = gr.Slider(0.5, 1.0, value=NODE_THRESHOLD, step=0.01, elem_id="graph-node-threshold",
                                       label="node threshold (fraction of the influence on the logits kept)")
            edge_threshold = gr.Slider(0.5, 1.0, value=EDGE_THRESHOLD, step=0.01, label="edge threshold",
                                       elem_id="graph-edge-threshold")
        with gr.Row():
            build_btn = gr.Button("Build the attribution graph", variant="primary", elem_id="graph-build")
            cancel_btn = gr.Button("Cancel", elem_id="graph-cancel")
        status = gr.Markdown(elem_id="graph-status")
        answer = gr.Markdown(elem_id="graph-answer")
        state = gr.State(None, time_to_live=3600)  # the session's graph: a GraphState (app/tabs/graph_state.py)
        with gr.Column(visible=False, elem_id="graph-results") as results:  # nothing shown before a graph exists
            gr.Markdown(SUMMARY_INTRO)
            summary = gr.HTML(elem_id="graph-summary", js_on_load=SUMMARY_CLICK_JS)
            summary_status = gr.Markdown(elem_id="graph-summary-status")
            with gr.Row():
                apply_btn = gr.Button("Keep these groups as supernodes", size="sm", elem_id="graph-summary-apply",
                                      scale=0)
                applied = gr.Markdown(elem_id="graph-summary-applied")
            rebuild = RebuildPanel(ScanRebuild(ah.sets), names, source, queues)  # a set's missing or damaged scan
            gr.Markdown(FULL_GRAPH_INTRO)
            workbench = build_workbench(WorkbenchHandlers(ctx, saes), state, node_threshold, edge_threshold, queues,
                                        beside_card=rebuild.layout)
            with gr.Accordion("Attention: head loadings and QK pairs", open=True):
                build_qk_panel(state, queues)
            with gr.Accordion("The kept features: table, every edge drawn, and each feature's page", open=True):
                gr.Markdown(FEATURES_INTRO)
                plot = gr.Plot(show_label=False, elem_id="graph-all-edges")
                with gr.Row():
                    with gr.Column(scale=3):
                        nodes = gr.Dataframe(label="feature nodes, most influential first (select one)",
                                             interactive=False, elem_id="graph-features", latex_delimiters=[],
                                             max_height=360, headers=["layer", "feature", "position", "token",
                                                                      "activation", "transcoder"])
                    with gr.Column(scale=2):
                        json_file = gr.File(label="the graph (circuit-tracer's JSON)", elem_id="graph-pruned-json")
                        with gr.Row():
                            node_box = gr.Textbox(label="feature node (click one in the graph, or "
                                                  "layer_feature_position)", elem_id="graph-feature-node", scale=3)
                            open_btn = gr.Button("Open its page", elem_id="graph-feature-open", scale=1)
                opened = gr.State(None)  # the transcoder whose card is open (its nearest features link to it)
                opened_feature = gr.State(None)  # the Features tab's handler also returns the feature number
                card = gr.HTML(elem_id="graph-feature-card", js_on_load=FEATURE_CLICK_JS)
        with gr.Column(visible=False):  # the old API names' triggers (never shown): OLD_API_NAMES
            old = {name: gr.Button(name, visible=False) for name in OLD_API_NAMES.values()}
            old_names = gr.JSON(visible=False)  # not checked against the picker's choices, as before the rename
            old_node = gr.Textbox(visible=False)

    outputs = [plot, nodes, json_file, status, state]  # the API's four values (a State is not sent)
    inputs = [prompt, names, node_threshold, edge_threshold, source]
    built = build_btn.click(ah.attribution, inputs, outputs, api_name="graph_attribution", **queues.jobs)
    old_built = old["circuit_attribution"].click(ah.attribution, [prompt, old_names, *inputs[2:]],
                                                 outputs, api_name="circuit_attribution", **queues.jobs)
    gallery.click(lambda sample: sample[0], gallery, prompt, api_visibility="private", **queues.light)
    source.change(ah.gallery, source, [gallery, prompt], api_visibility="private", **queues.light)
    for event in (built, old_built):
        event.then(ah.describe, [state, names, source], set_line, api_visibility="private", **queues.light)
        event.then(ah.shown, state, [answer, results], api_visibility="private", **queues.light)
    names.input(ah.describe, [state, names, source], set_line, api_visibility="private", **queues.light)

    def cancel(request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)
        SCANS.jobs.leave(session(request), kind="scan")  # a feature page waiting for its transcoder's scan
        return "Cancelled."

    repruned = gr.on([node_threshold.release, edge_threshold.release], ah.reprune,
                     [state, node_threshold, edge_threshold], outputs[:4], api_name="graph_prune", **queues.light)
    old["circuit_prune"].click(ah.reprune, [state, node_threshold, edge_threshold], outputs[:4],
                               api_name="circuit_prune", **queues.light)
    summarized = [event.then(sh.summarize, [state, node_threshold, edge_threshold], [summary, summary_status],
                             **({"api_name": "graph_summary"} if i == 0 else {"api_visibility": "private"}),
                             **queues.jobs)
                  for i, event in enumerate((built, old_built, repruned))]
    # the summary's groups into the workbench (the person's choice: they pin every member), then its views redrawn
    kept_groups = apply_btn.click(sh.apply, state, applied, api_name="graph_summary_apply", **queues.light)
    workbench.wire(built, old_built, repruned, kept_groups)  # pins, subgraph, supernodes, labels, interventions
    # a summary box clicked: its members become the selected nodes, drawn ringed in the full graph
    workbench.redraw_graph(summary.click(sh.open_group, state, [workbench.node, summary_status],
                                         api_visibility="private", **queues.light))
    on_card = {"show_progress_on": card}  # the scan's progress on the card, not on the node box
    opening = [nodes.select(ah.select_feature, [state, source], [card, opened, node_box], api_visibility="private",
                            **on_card, **queues.jobs),
               gr.on([open_btn.click, node_box.submit], ah.open_feature, [state, node_box, source],
                     [card, opened, node_box], api_name="graph_feature", **on_card, **queues.jobs),
               old["circuit_feature"].click(ah.open_feature, [state, old_node, source],
                                            [card, opened, node_box], api_name="circuit_feature", **queues.jobs),
               # the card's nearest features open their own page, as in the Features tab
               card.click(features.open, [opened, source], [opened_feature, card], api_visibility="private",
                          **on_card, **queues.jobs)]
    for button, name in ((cancel_btn, "graph_attribution_cancel"),
                         (old["circuit_attribution_cancel"], "circuit_attribution_cancel")):
        button.click(cancel, None, status, cancels=[built, old_built, *summarized, *opening], api_name=name,
                     **queues.light)
    plot.change(None, None, None, js=GRAPH_CLICK_JS)
    building, old_building = (button.click(ah.sets.build, source, [names, set_status, set_build, set_cancel],
                                           api_name=name, **queues.jobs)
                              for button, name in ((set_build, "graph_build_full"),
                                                   (old["circuit_set_build"], "circuit_set_build")))
    quick = quick_build.click(ah.sets.build_quick, source, [names, quick_status, quick_build, quick_cancel],
                              api_name="graph_build_quick", **queues.jobs)
    for after in (building, old_building, quick):  # the picker ticks the new set: say so
        after.success(ah.describe, [state, names, source], set_line, api_visibility="private", **queues.light)
    page = Context.root_block  # a set built since the server started: ticked, and no Build button, on page load
    offers = [(ah.sets.offer, [set_build, set_cancel, set_status]),
              (ah.sets.offer_quick, [quick_build, quick_cancel, quick_status])]
    for offer, shown in offers:
        source.change(offer, source, shown, api_visibility="private", **queues.light)
        if page is not None:
            page.load(offer, source, shown, api_visibility="private")
    refreshed = None
    if page is not None:
        refreshed = page.load(ah.sets.refresh, source, names, api_visibility="private")
        refreshed.then(ah.describe, [state, names, source], set_line, api_visibility="private")
    # Cancel gives Build back: the running build disabled it (the old API name answers its one string, as before)
    set_cancel.click(ah.sets.cancel_and_offer, None, [set_status, set_build], cancels=[building, old_building],
                     api_name="graph_build_full_cancel", **queues.light)
    old["circuit_set_cancel"].click(ah.sets.cancel, None, set_status, cancels=[building, old_building],
                                    api_name="circuit_set_cancel", **queues.light)
    quick_cancel.click(ah.sets.cancel_and_offer, None, [quick_status, quick_build], cancels=[quick],
                       api_name="graph_build_quick_cancel", **queues.light)
    source.change(lambda: (None, gr.update(visible=False), ""), None, [state, results, answer],
                  api_visibility="private", **queues.light)
    choices_changed = source.change(ah.transcoder_choices, source, names, api_visibility="private", **queues.light)
    rebuild.offer_after(built, choices_changed, refreshed)


@dataclass
class WorkbenchParts:
    """What the tab wires to the workbench: `wire(*events)` redraws it after each event (the graph built,
    re-pruned), `redraw_graph(event)` redraws the full graph and its JSON after one, and `node` is the box of the
    selected node ids."""

    wire: Callable[..., None]
    redraw_graph: Callable[[Any], None]
    node: gr.Textbox


def build_workbench(wb: WorkbenchHandlers, state: gr.State, node_threshold: gr.Slider, edge_threshold: gr.Slider,
                    queues: Queues, beside_card: Callable[[], Any] | None = None) -> WorkbenchParts:
    """The full graph and the workbench: their layout, under the summary, and their events. `beside_card()` lays
    out more under the node's buttons (the rebuild of a set's scan) and returns an event after which the node's
    card is drawn again (or None)."""
    with gr.Row():
        keep = gr.Slider(KEEP_MIN, MAX_NODES_SENT, value=KEEP_DEFAULT, step=KEEP_STEP, elem_id="graph-keep-nodes",
                         label="nodes drawn: the most influential (embeddings, logits and pins always)")
        min_weight = gr.Slider(0, MIN_WEIGHT_MAX, value=MIN_WEIGHT_DEFAULT, step=MIN_WEIGHT_STEP,
                               elem_id="graph-min-weight",
                               label="smallest edge drawn (fraction of the largest edge's |weight|)")
    graph_plot = gr.Plot(show_label=False, elem_id="graph-plot")  # the page's full width: the columns need it
    with gr.Row():  # under the graph: the selected node and its card
        with gr.Column(scale=1, min_width=320):
            with gr.Row():
                node = gr.Textbox(label="selected node (click one, or type ids separated by commas)",
                                  elem_id="graph-node", scale=3)
                show = gr.Button("Show", elem_id="graph-node-show", scale=1, min_width=60)
            with gr.Row():
                pin_btn = gr.Button("Pin / unpin", variant="primary", elem_id="graph-pin")
                clear_btn = gr.Button("Clear pins", elem_id="graph-clear")
            card_changed = beside_card() if beside_card is not None else None
        with gr.Column(scale=2):
            card = gr.HTML(elem_id="graph-node-card")
    with gr.Accordion("Workbench: inspect, pin, group, label and intervene", open=True):
        gr.Markdown(WORKBENCH_INTRO)
        with gr.Row():
            with gr.Column(scale=3):
                table = gr.Dataframe(label="kept features, most influential first (select one; then Pin)",
                                     interactive=False, elem_id="graph-table", latex_delimiters=[], max_height=300,
                                     headers=["node", "layer", "position", "token", "activation", "label", "pinned"])
            with gr.Column(scale=2), gr.Row():
                top_n = gr.Number(value=PIN_TOP_N, precision=0, minimum=1, label="n", elem_id="graph-pin-top-n",
                                  min_width=80)
                top_btn = gr.Button("Pin the top n features by influence (and the top logit)",
                                    elem_id="graph-pin-top")
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
    light = queues.light
    table.select(wb.select, [state, *thresholds], [node, card, label_box], api_visibility="private", **light)
    gr.on([show.click, node.submit], wb.card, [state, node, *thresholds], [card, label_box],
          api_name="workbench_card", **light)
    if card_changed is not None:
        card_changed.success(wb.card_again, [state, node, *thresholds], card, api_visibility="private", **light)
    changes = [
        pin_btn.click(wb.pin, [state, node, *thresholds], views, api_name="workbench_pin", **light),
        clear_btn.click(wb.clear, [state, *thresholds], views, api_name="workbench_clear", **light),
        top_btn.click(wb.pin_top, [state, top_n, *thresholds], views, api_name="workbench_pin_top", **light),
        gr.on([sn_btn.click, sn_name.submit], wb.supernode, [state, sn_name, sn_members, *thresholds], views,
              api_name="workbench_supernode", **light),
        gr.on([label_btn.click, label_box.submit], wb.label, [state, node, label_box, *thresholds], [*views, card],
              api_name="workbench_label", **light),
        load_file.upload(wb.load, [state, load_file, *thresholds], views, api_name="workbench_load", **light),
    ]
    for i, change in enumerate(changes):  # then the graph plot and the JSON (one endpoint for API clients)
        change.success(wb.graph_views, [state, *thresholds], later, **light,
                       **({"api_name": "workbench_views"} if i == 0 else {"api_visibility": "private"}))
    ran = iv_btn.click(wb.intervene, [state, iv_nodes, node, iv_value, iv_number, iv_mode], iv_result,
                       api_name="workbench_intervene", **queues.jobs)
    iv_cancel.click(wb.cancel, None, iv_result, cancels=[ran], api_name="workbench_cancel", **light)
    graph_plot.change(None, None, None, js=WORKBENCH_CLICK_JS)
    graph_plot.change(None, None, None, js=highlight_js("graph-plot"))  # hover: a node's edges, the rest dimmed
    # the sliders redraw the graph in the page (no request); a new figure from the server takes their values too
    sliders = ("graph-plot", "graph-keep-nodes", "graph-min-weight")
    gr.on([keep.input, min_weight.input], None, [keep, min_weight], None, js=redraw_js(*sliders))
    graph_plot.change(None, [keep, min_weight], None, js=redraw_js(*sliders, delay_ms=REDRAW_AFTER_MS))
    sub_plot.change(None, None, None, js=WORKBENCH_CLICK_JS)

    def wire(*events: Any) -> None:
        for event in events:
            event.then(wb.render, [state, *thresholds], [*views, *later], api_visibility="private", **light)

    def redraw_graph(event: Any) -> None:
        event.success(wb.graph_views, [state, *thresholds], later, api_visibility="private", **light)

    return WorkbenchParts(wire, redraw_graph, node)
