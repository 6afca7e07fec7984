"""The Graph section's attribution graph: built over the picked transcoders (or a full set) as a long job, pruned
by influence, and each feature node's page opened (the Features tab's card).

The graph is slmviz.attribution_graph's (circuit-tracer's semantics); this module checks the inputs, runs it in
app/jobs.py's worker (other sessions are served meanwhile; Cancel stops it at its next batch), and turns the pruned
graph into the plot, the feature table, the JSON file and the status line. The session's graph lives in the
tab's gr.State as one GraphState (app/tabs/graph_state.py), which the workbench (app/tabs/graph_workbench.py) reads
and changes.

A user's mistake (an empty prompt, no transcoder ticked, a prompt too long for the memory budget) is a warning,
and every panel keeps what it showed: the status line says what went wrong in place of a stale "Running" line.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

import slmviz
from slmviz.graphs.attribution import DEFAULT_MEMORY_BUDGET_GB, prepend_special
from slmviz.hooks import layer_of
from slmviz.progress import ProgressUpdate, format_seconds

from ..jobs import RUNNER
from ..models import AppContext
from ..saes import SAEStore
from ..shared import display_frame, parse_thresholds, readable_errors, session, to_plot, wait_or_say
from ..transcoder_sets import MAX_FEATURE_NODES, TranscoderSets, set_kind, set_ready
from .graph_cards import kept_features
from .graph_state import GraphState, built, keeps_work

JOB_KIND = "attribution"  # the section's Cancel leaves only this kind of job
CANCELLED = "Cancelled; press Build to start again"
GALLERY = Path(__file__).resolve().parents[1] / "graph_gallery.json"  # bench/studies/graph_gallery.py writes it
# a top token that answers nothing: the graph then explains a function word, not what the prompt asks for
NOT_AN_ANSWER = {"the", "a", "an", "and", "or", "of", "to", "in", "on", "is", "was", "that", "this", "it", "not",
                 ",", ".", ":", ";", "!", "?", "-", "", "\n"}
UNSURE_P = 0.1  # a top token below this probability: the model is unsure, and the tab says so
# No cap on the prompt's length beyond the model's own: attribution_graph reports each backward batch, so a long
# graph shows its progress and Cancel stops it at the next batch. What bounds it is memory (the dense adjacency
# grows with the square of the nodes): attribution_graph refuses a prompt whose estimate exceeds ATTR_MEMORY_GB,
# saying the estimate. The sizes and times measured are in docs/app.md and docs/features.md ("The longest prompt",
# bench/studies/longest_prompt.py).
ATTR_MEMORY_GB = DEFAULT_MEMORY_BUDGET_GB


class AttributionHandlers:
    """Building, pruning and reading the session's attribution graph. Transcoders come from the server's SAEStore,
    full sets from app/transcoder_sets.py, and a feature's page from the Features tab's handlers (`features`)."""

    def __init__(self, ctx: AppContext, saes: SAEStore, features: Any):
        self.ctx = ctx
        self.saes = saes
        self.features = features  # app.tabs.features.FeatureHandlers: its feature page (show, open)
        self.sets = TranscoderSets(ctx, saes, offered=self.pickable)  # the model's full sets

    def transcoders(self, model: Any) -> list[str]:
        """The transcoders on offer for `model` (bundled, $SLMVIZ_SAE_DIRS, loaded in the Model tab), then its full
        set when prepared (app/transcoder_sets.py), one choice."""
        names = []
        for name in self.saes.names(model):
            try:
                if self.saes.get(model, name).sae.is_transcoder:
                    names.append(name)
            except Exception:  # noqa: BLE001 - one that does not load is simply not offered
                continue
        return names + self.sets.choices(model)

    def pickable(self, model: Any) -> list[str]:
        """The picker's choices: the single transcoders and the sets that are built (a set not built yet is offered
        by its Build button instead: picking it could only say "build it first")."""
        return [n for n in self.transcoders(model)
                if not self.sets.is_set(model, n) or set_ready(model, set_kind(model, n))]

    def ticked(self, model: Any, offered: list[str]) -> list[str]:
        """What the picker ticks first: the best prepared set that is ready, alone (TranscoderSets.ticked: the full
        set, the CLT, the quick set), else every single transcoder (the bundled pair on SmolLM2)."""
        return self.sets.ticked(model) or [n for n in offered if not self.sets.is_set(model, n)]

    @staticmethod
    def bos_note(model: Any) -> str:
        """What the graph puts in front of the prompt (the prompt box's note)."""
        tokenizer = getattr(model, "tokenizer", None)
        ids = prepend_special(tokenizer, model.encode("a")) if tokenizer is not None else None
        if ids is None or len(ids) < 2:
            return "The graph reads the prompt as typed (this tokenizer has no special token to put in front)."
        first = model.to_strings(ids[:1])[0]
        return (f"The graph puts {first} in front of the prompt (position 0: an attention sink whose features it "
                "leaves out, as circuit-tracer does); the Run tab reads the prompt as typed.")

    @readable_errors
    def gallery(self, source: str | None) -> tuple:
        """The gallery of the session's model, and its first prompt in the prompt box."""
        samples, labels = gallery_samples(self.ctx.model(source))
        if not samples:
            return gr.Dataset(samples=[[ATTR_PROMPT_FALLBACK]], sample_labels=None), gr.skip()
        return gr.Dataset(samples=samples, sample_labels=labels), samples[0][0]

    def set_line(self, model: Any, names: list[str] | None, found: GraphState | None) -> str:
        """#graph-set: which transcoders the graph uses (or will: the ticked ones) and, once built, its scores."""
        names = list(names or [])
        preference = ("the best that is ready: the full set, then the cross-layer transcoder, then the quick set, "
                      "then the bundled transcoders")
        if isinstance(found, GraphState) and found.scores and found.picked == names:
            s = found.scores
            return (f"**Graph over {', '.join(names)}**: replacement score **{s['replacement']:.3f}**, completeness "
                    f"**{s['completeness']:.3f}** (of this prompt's unpruned graph; 1 when the transcoders explain "
                    "everything).")
        if not names:
            return f"**No transcoders ticked**: tick a set or single transcoders ({preference})."
        if any(self.sets.is_set(model, n) for n in names):
            return f"**Uses the {', '.join(names)}** ({preference}); its scores show once the graph is built."
        return (f"**Uses {', '.join(names)}**: {model.name} has no full or quick transcoder set ready, so the layers "
                "without a transcoder are all error nodes; its scores show once the graph is built.")

    @readable_errors
    def describe(self, found: GraphState | None, names: list[str] | None, source: str | None) -> str:
        return self.set_line(self.ctx.model(source), names, found)

    @readable_errors
    def transcoder_choices(self, source: str | None) -> gr.CheckboxGroup:
        model = self.ctx.model(source)
        names = self.pickable(model)
        return gr.CheckboxGroup(choices=names, value=self.ticked(model, names))

    @readable_errors
    def shown(self, state: GraphState | None) -> tuple:
        """Once a graph exists: what the model answers (#graph-answer), and the panels that show it."""
        if not isinstance(state, GraphState):
            return gr.skip(), gr.skip()
        return answer_line(state.graph), gr.update(visible=True)

    @readable_errors
    @keeps_work(5, said=3)
    def attribution(self, prompt: str, names: list[str] | None, node_threshold: float | None,
                    edge_threshold: float | None, source: str | None, request: gr.Request,
                    progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The prompt's attribution graph over the picked transcoders (a long job), pruned by influence; a bad
        input is a warning and the graph on screen stays."""
        yield from self._attribution(prompt, names, node_threshold, edge_threshold, source, request, progress)

    def _attribution(self, prompt: str, names: list[str] | None, node_threshold: float | None,
                     edge_threshold: float | None, source: str | None, request: gr.Request,
                     progress: Any) -> Iterator[tuple]:
        model = self.ctx.model(source, progress)
        text = self.ctx.checked_prompt(prompt, model)
        offered = self.transcoders(model)
        if not names:
            have = (f"this model has {', '.join(offered)}" if offered else
                    f"none is loaded for {model.name}: load one in the Model tab")
            raise ValueError(f"An attribution graph needs transcoders (its nodes are their features): tick at least "
                             f"one ({have})")
        unknown = [n for n in names if n not in offered]
        if unknown:
            raise ValueError(f"{', '.join(map(repr, unknown))} is not a transcoder for {model.name}; the transcoders "
                             f"on offer are {', '.join(offered) or 'none'}")
        thresholds = parse_thresholds(node_threshold, edge_threshold)
        model.encode(text)  # too long for the model: a readable error now, not from the job
        full = [n for n in names if self.sets.is_set(model, n)]
        if full and len(names) > 1:
            raise ValueError(f"{full[0]!r} already has a transcoder at every layer: pick it alone, or untick it to "
                             f"pick {', '.join(n for n in names if n != full[0])}")
        kind = set_kind(model, full[0]) if full else None
        if kind:
            self.sets.check(model, kind)  # not built yet: a readable error now, not from the job
        entries = [] if full else [self.saes.get(model, n) for n in names]
        layers: dict[int, str] = {}
        for entry in entries:
            layer = layer_of(entry.sae.hook_name)
            if layer in layers:
                raise ValueError(f"{layers[layer]} and {entry.name} both read layer {layer}; pick one per layer")
            layers[layer] = entry.name

        def work(report: Callable[..., None]) -> GraphState:
            started = time.perf_counter()
            transcoders = [e.sae for e in entries]
            if full:  # loaded once per model (the first graph waits for it), then kept
                report(0.01, f"Loading the {full[0]}")
                transcoders, names_of = self.sets.load(model, kind)
                layers.update(names_of)
            report(0.02, f"The attribution graph over {', '.join(names)}: one forward, then one backward per batch "
                         "of targets (the top logits, then every active feature)")

            def attributed(u: ProgressUpdate) -> None:  # raises JobCancelled once no one waits: the graph stops
                said = u.text()
                if u.phase == "attribution" and u.total:
                    left = f" · {format_seconds(u.eta_s)} left" if u.eta_s is not None else ""
                    said = (f"attributed {u.done:,} of {u.total:,} targets (the top logits, then the active "
                            f"features), one backward per batch{left}")
                report(0.02 + 0.96 * u.fraction, said)

            cap = MAX_FEATURE_NODES if full else None  # a full set: the most influential features only
            graph = slmviz.attribution_graph(text, transcoders=transcoders, model=model, max_feature_nodes=cap,
                                             memory_budget_gb=ATTR_MEMORY_GB, progress=attributed)
            labels = self.sets.deep_labels(model, kind) if full else None
            if labels is not None:  # the set's deep scan is done: its labels and their scores, on cards and groups
                graph.use_labels(labels)
            return GraphState(graph=graph, layers=layers, model=model, seconds=time.perf_counter() - started,
                              scores=graph.scores(), picked=list(names), cap=cap)

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        said = ""
        for _ in wait_or_say(job, session(request), progress, CANCELLED):
            if job.desc != said:
                said = job.desc
                yield gr.skip(), gr.skip(), gr.skip(), f"Running: {said}", gr.skip()
        found = job.result
        yield (*self._pruned(found, *thresholds), found)

    def _pruned(self, found: GraphState, node_threshold: float, edge_threshold: float) -> tuple:
        """(plot, feature table, JSON file, status) of the graph pruned at these thresholds."""
        graph = found.graph
        pruned = found.prune((node_threshold, edge_threshold))
        path = pruned.save_json(self.ctx.output_path("attribution-graph.json"))
        nodes = pruned.kept_nodes
        counts = nodes["kind"].value_counts()
        scores = found.scores
        over = found.over
        scored = (f"**Replacement score {scores['replacement']:.3f}, completeness {scores['completeness']:.3f}** "
                  "(circuit-tracer's scores of the unpruned graph: the share of the influence that avoids error "
                  "nodes, and of each node's inputs that are not errors; 1 when the transcoders explain "
                  "everything). " if scores else "")
        capped = f" (at most {found.cap:,}, the most influential: max_feature_nodes)" if found.cap else ""
        status = (f"{scored}**{graph.prompt!r}**: {graph.n_features} active features{capped} over {over}; computed in "
                  f"{found.seconds:.1f} s. Pruned to {node_threshold:g} of the influence on the logits (edges "
                  f"{edge_threshold:g}): {int(counts.get('feature', 0))} features, {int(counts.get('error', 0))} "
                  f"error nodes, {int(counts.get('embedding', 0))} embeddings, {int(counts.get('logit', 0))} "
                  f"logits. Select a feature to open its page; the JSON is circuit-tracer's graph format.")
        fig = pruned.plot()
        for trace in fig.data:  # an edge's end points sit on its nodes: hovering and clicking there means the node
            if trace.mode == "lines":
                trace.hoverinfo = "skip"
        return to_plot(fig), display_frame(feature_table(pruned, found.layers)), str(path), status

    @readable_errors
    @keeps_work(4, said=3)
    def reprune(self, found: GraphState | None, node_threshold: float | None, edge_threshold: float | None,
                request: gr.Request) -> tuple:
        """The threshold sliders: prune the graph again (no model run)."""
        return self._reprune(found, node_threshold, edge_threshold)

    def _reprune(self, found: GraphState | None, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        if not isinstance(found, GraphState):
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return self._pruned(found, *parse_thresholds(node_threshold, edge_threshold))

    @readable_errors
    @keeps_work(3)
    def open_feature(self, found: GraphState | None, node: str, source: str | None, request: gr.Request,
                     progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """A feature node ('layer_feature_position', or 'layer, feature'): its page, the Features tab's card
        (its corpus contexts come from that tab's feature scan, run once per transcoder)."""
        yield from self._open_feature(found, node, source, request, progress)

    def _open_feature(self, found: GraphState | None, node: str, source: str | None, request: gr.Request,
                      progress: Any) -> Iterator[tuple]:
        found = built(found, "select a feature")
        numbers = [int(x) for x in re.findall(r"\d+", node or "")]
        if len(numbers) < 2:
            raise ValueError(f"A feature node is 'layer_feature_position' (its id) or 'layer, feature'; got {node!r}")
        layer, feature = numbers[:2]
        if layer not in found.layers:
            raise ValueError(f"Layer {layer} has no transcoder in this graph (its nodes there are error nodes); "
                             f"the transcoders read layers {', '.join(map(str, sorted(found.layers)))}")
        name = found.layers[layer]
        for f, card in self.features.show(name, feature, source, request, progress):
            if isinstance(card, str):  # else a no-op update while the feature scan runs
                yield card, name, f"{layer}_{f}"
            else:
                yield gr.skip(), name, gr.skip()

    @readable_errors
    @keeps_work(3)
    def select_feature(self, evt: gr.SelectData, found: GraphState | None, source: str | None, request: gr.Request,
                       progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        row = evt.row_value or []
        if len(row) < 2:
            raise ValueError("Select a row of the feature table")
        yield from self._open_feature(found, f"{row[0]}, {row[1]}", source, request, progress)


def feature_table(pruned: Any, layers: dict[int, str]) -> pd.DataFrame:
    """The kept feature nodes, most influential first: layer, feature, position, token, activation, transcoder."""
    nodes = kept_features(pruned)
    return pd.DataFrame({"layer": nodes["layer"].astype(int), "feature": nodes["feature"].astype(int),
                         "position": nodes["position"].astype(int), "token": nodes["token"],
                         "activation": nodes["activation"].round(3), "transcoder": nodes["layer"].map(layers)})


ATTR_PROMPT_FALLBACK = "The capital of France is"


def gallery_samples(model: Any) -> tuple[list[list[str]], list[str]]:
    """The gallery of `model` (app/graph_gallery.json, measured by bench/studies/graph_gallery.py): its prompts as
    a gr.Dataset's samples, and each one's label: the prompt, the answer and its probability."""
    try:
        data = json.loads(GALLERY.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return [], []
    entries = data.get(getattr(model, "name", ""), [])
    return ([[e["prompt"]] for e in entries],
            [f"{e['prompt']} → {e['answer'].strip()} (p {e['p']:.2f})" for e in entries])


def answer_line(graph: Any) -> str:
    """#graph-answer: the model's top tokens (the graph's logit nodes, with their probabilities), what the graph
    explains, and a plain warning when the top token answers nothing (a function word) or the model is unsure;
    also what the graph put in front of the prompt."""
    logits = graph.nodes[graph.nodes["kind"] == "logit"].sort_values("probability", ascending=False)
    if not len(logits):
        return ""
    top = [(str(t), float(p)) for t, p in zip(logits["token"], logits["probability"], strict=True)]
    first, p = top[0]
    rest = ", ".join(f"{t!r} ({q:.2f})" for t, q in top[1:4])
    line = (f"**The model's answer: {first!r}** (p {p:.2f}); then {rest}. The graph explains these logits, "
            f"{first!r} first.")
    if first.strip().lower() in NOT_AN_ANSWER or p < UNSURE_P:
        why = "a function word, not an answer" if first.strip().lower() in NOT_AN_ANSWER else "an unsure guess"
        line += (f" **Note:** the top token {first!r} is {why} (p {p:.2f}): if the prompt asks for something else, "
                 "this model does not say it here, and the graph has nothing of it to explain. The gallery's "
                 "prompts are ones it answers.")
    tokens = list(graph.tokens)
    if tokens:
        line += f" The graph reads {len(tokens)} tokens, starting with {tokens[0]!r} (position 0)."
    return line
