"""The "Circuits" tab: which edges between components carry the answer, and attribution graphs over features.

Layout and handlers of one tab, built inside the page's gr.Tabs by `build_circuits_tab`. Like the rest of app/, it
turns widget values into slmviz calls (`slmviz.circuit`, `Circuit.faithfulness`, `slmviz.patch_edges`, the task
generators of slmviz.circuits.tasks, `slmviz.attribution_graph`) and returns figures; no torch code beyond building
edge masks. Element ids for tests outside the repo: #circuit-clean, #circuit-corrupted, #circuit-run,
#circuit-graph (the graph's plot), #circuit-faithfulness (plus #circuit-answer, #circuit-wrong, #circuit-task,
#circuit-task-fill, #circuit-method, #circuit-steps, #circuit-cancel, #circuit-status, #circuit-top, #circuit-edges,
#circuit-edge, #circuit-edge-run, #circuit-edge-text, #circuit-edge-table, #circuit-attr-* for the attribution
graph, and #circuit-set-build, #circuit-set-cancel, #circuit-set-status for building the model's full transcoder set:
app/transcoder_sets.py, which also offers the built set as one choice of #circuit-attr-transcoders).

Clicking an edge: plotly's click is not a Gradio event, and an edge is a line (plotly reports clicks on its two end
points only), so the top edges are also a gr.Dataframe: selecting a row runs that edge's exact patch, alone and as the
top-n circuit without it (one batched forward of three edge sets).

Scoring (EAP, EAP-IG, exact), the faithfulness curve and the attribution graph are long jobs: they run in
app/scan_jobs.py's worker, waited for in the page's "jobs" queue, so another session's Run is served meanwhile.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr
import pandas as pd
import plotly.graph_objects as go
import torch
from gradio.context import Context

import slmviz
from slmviz.circuits import tasks
from slmviz.circuits.circuit import Circuit
from slmviz.circuits.graph import ComponentGraph
from slmviz.graphs.attribution import DEFAULT_MEMORY_BUDGET_GB
from slmviz.interventions.patching import suggest_answers

from .corpus_tab import SCANS, session
from .features_tab import FEATURE_CLICK_JS
from .handlers import Handlers, display_frame, readable_errors, to_plot
from .scan_jobs import RUNNER, Job, JobCancelled, wait
from .transcoder_sets import MAX_FEATURE_NODES, TranscoderSets, set_kind
from .workbench import build_workbench

EXAMPLE_CLEAN = "When Mary and John went to the store, John gave a drink to"
EXAMPLE_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
EXAMPLE_ANSWER, EXAMPLE_WRONG = " Mary", " John"
METHOD_CHOICES = [("EAP (one forward and one backward)", "eap"),
                  ("EAP-IG (one forward and backward per step)", "eap-ig"),
                  ("exact (one patched run per edge; small graphs only)", "exact")]
TASK_CHOICES = [("IOI: indirect object identification", "ioi"), ("induction: a repeated random sequence", "induction"),
                ("greater-than: years, digit by digit", "greater-than")]
# `exact` patches one edge per run: Gemma 3 270M's 5,644 edges took 293 s and 383 s (two runs) for one IOI pair on
# this 2-core machine while other work loaded it (load average ~10); SmolLM2 has 12x as many edges (70,651).
# Above this the tab says so and offers EAP / EAP-IG.
EXACT_MAX_EDGES = 6000
MAX_STEPS = 50
DEFAULT_TOP, MAX_TOP = 30, 300
REFINE_SIZES = 6  # sizes tried between the last one short of 80 % and the first one reaching it (one more batch)
JOB_KIND, ATTR_KIND = "circuit", "attribution"  # each Cancel button leaves its own kind of job
ATTR_PROMPT = "The capital of France is"
# No cap on the prompt's length beyond the model's own: attribution_graph reports each backward batch, so a long
# graph shows its progress and Cancel stops it at the next batch. What bounds it is memory (the dense adjacency
# grows with the square of the nodes, ~160 per token on SmolLM2 with both transcoders): attribution_graph refuses a
# prompt whose estimate exceeds ATTR_MEMORY_GB, saying the estimate (SmolLM2, both transcoders: 97 tokens 3.58 GiB,
# 131 tokens 5.79 GiB, so the 4 GiB default stops near 100 tokens). Measured here over both SmolLM2 transcoders
# (tokens with the BOS): 6 tokens 5 s, 15 tokens 31 s, 25 tokens 36 s, on a 2-core machine at load average ~10.
ATTR_MEMORY_GB = DEFAULT_MEMORY_BUDGET_GB
NODE_THRESHOLD, EDGE_THRESHOLD = 0.95, 0.98  # SmolLM2's two transcoders: 0.8 keeps error nodes only

# A click on a feature node of the attribution graph (plotly's click is not a Gradio event): copy its node id
# (customdata[0]) into #circuit-attr-node and press #circuit-attr-open. Re-attached for a few seconds after every
# redraw; removeAllListeners keeps it to one handler per plot div.
NODE_CLICK_JS = """
() => {
  const attach = () => {
    const div = document.querySelector('#circuit-attr-graph .js-plotly-plot');
    if (!div || !div.on) return;
    if (div.removeAllListeners) div.removeAllListeners('plotly_click');
    div.on('plotly_click', (ev) => {
      const hit = (ev.points || []).find((p) => p.customdata && p.customdata[1] === 'feature');
      const box = document.querySelector('#circuit-attr-node textarea, #circuit-attr-node input');
      if (!hit || !box) return;
      const d = hit.customdata;
      box.value = String(d[0]);
      box.dispatchEvent(new Event('input', {bubbles: true}));
      setTimeout(() => document.querySelector('#circuit-attr-open').click(), 150);
    });
  };
  let tries = 0;
  const timer = setInterval(() => { attach(); if (++tries > 20) clearInterval(timer); }, 300);
}
"""

INTRO = """Which **edges** carry the answer: which head's output, read by which later head's query, key or value, or
by which MLP. Each edge is scored for how much the metric (logit(answer) − logit(wrong) at the last position) moves
when that edge alone carries the *corrupted* prompt's value instead of the clean one (EAP, EAP-IG, or exact
patching). The graph draws the top *n* edges layer by layer (width |score|, blue raises the metric, red lowers
it; solid into a query, dashed into a key, dotted into a value); the curve beside it keeps only the top *n* edges
clean and patches every other one from the corrupted run (1 = the clean metric, 0 = the corrupted one).
**Select an edge in the table** to patch it exactly, alone and as the top-*n* circuit without it."""

ATTR_INTRO = """For one prompt with transcoders loaded: the active transcoder features at each position, one error node
per layer and position (what the transcoders miss; a layer without a transcoder is all error), the token embeddings
and the top logits, joined by their direct effects with attention patterns and norm scales frozen
(circuit-tracer's semantics). **Click a feature node** in the plot, or select one in the table, to open its page
(the Features tab's card)."""


# --- the task generators ------------------------------------------------------------------------
def _text(model: Any, x: Any) -> str:
    """A prompt or answer as text: strings as they are, token ids decoded."""
    if x is None or isinstance(x, str):
        return x or ""
    ids = [x] if isinstance(x, int) else [int(i) for i in x]
    return model.tokenizer.decode(ids) if model.tokenizer is not None else " ".join(map(str, ids))


def task_pair(model: Any, name: str, pair: int) -> dict[str, Any]:
    """Pair number `pair` of a built-in task for `model` (the task's generator with seed=pair): what the boxes show,
    and the task's own values (token ids for induction, the metric for greater-than) used while the boxes still
    show exactly this pair."""
    task = tasks.task(name, model, n=1, seed=pair)
    raw = {"clean": task.clean[0], "corrupted": task.corrupted[0],
           "answer": task.answers[0] if task.answers else None, "wrong": task.wrongs[0] if task.wrongs else None,
           "metric": task.metrics[0] if task.metrics else None}
    shown = tuple(_text(model, raw[k]) for k in ("clean", "corrupted", "answer", "wrong"))
    details = task.details[0] if task.details else {}
    if raw["metric"] is not None:
        note = (f"{task.name}, pair {pair}: scored by the task's own metric, P(tens digit > {details.get('tens')}) "
                "− P(tens digit < it) at the last position (leave answer and wrong empty to keep it).")
    else:
        note = f"{task.name}, pair {pair}: {task.description}."
    return {"task": name, "pair": pair, "shown": shown, "model": model.name, **raw, "note": note}


# --- figures ------------------------------------------------------------------------------------
def faithfulness_figure(curve: pd.DataFrame, smallest: int | None, n: int | None = None) -> go.Figure:
    """The library's faithfulness curve, with the smallest circuit found to recover 80 % and the slider's n marked."""
    from slmviz.plots.circuits import faithfulness_curve

    fig = faithfulness_curve(curve)
    # on a log axis plotly.js places a shape at the data value but an annotation at log10 of it
    marks = [(smallest, f"80 %: {smallest} edges", "#2471a3", "dash", 1.0)] if smallest is not None else []
    if n:
        marks.append((n, f"top {n}", "#888", "dot", 0.06))
    for value, text, colour, dash, y in marks:
        x = max(value, 0.5)
        fig.add_shape(type="line", x0=x, x1=x, y0=0, y1=1, xref="x", yref="y domain",
                      line={"dash": dash, "color": colour})
        fig.add_annotation(x=math.log10(x), y=y, xref="x", yref="y domain", text=text, showarrow=False,
                           xanchor="left", yanchor="top" if y > 0.5 else "bottom", font={"color": colour})
    fig.update_layout(height=420, margin={"l": 60, "r": 20, "t": 60, "b": 50})
    return fig


def edges_table(c: Circuit, n: int) -> pd.DataFrame:
    """The top-n edges as the table whose rows are selected: rank, source, target, score."""
    top = c.top(n)
    return pd.DataFrame({"rank": range(1, len(top) + 1), "source": top["source"], "target": top["target"],
                         "score": [round(float(s), 5) for s in top["score"]]})


def _top_n(value: Any, total: int) -> int:
    try:
        n = int(round(float(value)))
    except (TypeError, ValueError):
        raise ValueError(f"The number of top edges must be a whole number, got {value!r}") from None
    if n < 1:
        raise ValueError(f"The number of top edges must be at least 1, got {n}")
    return min(n, total)  # a small model's graph may have fewer edges than the slider's range


class CircuitHandlers:
    """The tab's handlers; models come from the page's Handlers, transcoders from the Features tab's SAE store."""

    def __init__(self, handlers: Handlers, features: Any = None):
        self.h = handlers
        self.features = features  # app.features_tab.FeatureHandlers: its SAE store and feature card
        self.sets = TranscoderSets(handlers, features, offered=self.transcoders)  # the model's full set

    # --- inputs --------------------------------------------------------------------------------
    @readable_errors
    def fill(self, name: str | None, pair: float | None, source: str | None) -> tuple:
        """Fill the four boxes from a built-in task's generator for this session's model."""
        if name not in tasks.TASKS:
            raise ValueError(f"Pick a task: {', '.join(tasks.TASKS)}")
        try:
            index = int(pair or 0)
        except (TypeError, ValueError):
            raise ValueError(f"The pair number must be a whole number, got {pair!r}") from None
        if index < 0:
            raise ValueError(f"The pair number must be 0 or more, got {index}")
        found = task_pair(self.h.model(source), name, index)
        return (*found["shown"], found, found["note"])

    def _inputs(self, model: Any, clean: str, corrupted: str, answer: str, wrong: str,
                bound: dict | None) -> dict[str, Any]:
        """What slmviz.circuit gets: the task's own values while the boxes show its pair unchanged (token ids for
        induction, the metric for greater-than), else the boxes' text; an empty answer is suggested from the first
        token where the prompts differ, as in the Patch tab."""
        boxes = (clean or "", corrupted or "", answer or "", wrong or "")
        if bound and bound.get("model") == model.name and tuple(bound["shown"]) == boxes:
            return {"clean": bound["clean"], "corrupted": bound["corrupted"], "answer": bound["answer"],
                    "wrong": bound["wrong"], "metric": bound["metric"], "note": bound["note"]}
        clean, corrupted = self.h.checked_prompt(clean, model), self.h.checked_prompt(corrupted, model)
        if not (answer or "").strip():
            answer, wrong = suggest_answers(model, clean, corrupted)
        return {"clean": clean, "corrupted": corrupted, "answer": answer, "wrong": wrong or None, "metric": None,
                "note": ""}

    # --- the component graph --------------------------------------------------------------------
    @readable_errors
    def run(self, clean: str, corrupted: str, answer: str, wrong: str, method: str, steps: float | None,
            top_n: float | None, bound: dict | None, source: str | None, request: gr.Request,
            progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """Score every edge, then the faithfulness curve and the smallest circuit recovering 80 %: one long job."""
        model = self.h.model(source, progress)
        graph_edges = ComponentGraph.of(model).n_edges
        if method not in ("eap", "eap-ig", "exact"):
            raise ValueError(f"Pick a method: eap, eap-ig or exact (got {method!r})")
        if method == "exact" and graph_edges > EXACT_MAX_EDGES:
            raise ValueError(
                f"exact patches one edge per run: {model.name} has {graph_edges:,} edges, more than this app runs "
                f"({EXACT_MAX_EDGES:,}: Gemma 3 270M's 5,644 took 5-6 minutes on two cores). Use EAP or EAP-IG "
                f"here, or "
                f"slmviz.circuit(..., method='exact') in a notebook.")
        n_steps = int(steps or 0)
        if method == "eap-ig" and not 1 <= n_steps <= MAX_STEPS:
            raise ValueError(f"EAP-IG's steps must be between 1 and {MAX_STEPS}, got {steps!r}")
        n = _top_n(top_n, graph_edges)
        inputs = self._inputs(model, clean, corrupted, answer, wrong, bound)
        what = {"eap": "EAP", "eap-ig": f"EAP-IG ({n_steps} steps)", "exact": "exact patching"}[method]

        def work(report: Callable[..., None]) -> dict[str, Any]:
            started = time.perf_counter()
            report(0.02, f"{what}: scoring {graph_edges:,} edges")
            c = slmviz.circuit(inputs["clean"], inputs["corrupted"], answer=inputs["answer"], wrong=inputs["wrong"],
                               metric=inputs["metric"], model=model, method=method, steps=max(n_steps, 1),
                               progress=lambda done, total: report(0.02 + 0.6 * done / max(total, 1),
                                                                   f"{what}: {done}/{total}"))
            scored_s = time.perf_counter() - started
            report(0.65, "The faithfulness curve: every edge outside the top n patched, all sizes in one batch")
            curve = c.faithfulness(progress=lambda done, total: report(
                0.65 + 0.2 * done / max(total, 1), f"The faithfulness curve: {done}/{total} sizes"))
            report(0.88, "The smallest circuit recovering 80 %")
            smallest = c.smallest(0.8, count=REFINE_SIZES, curve=curve)
            return {"circuit": c, "curve": curve, "smallest": smallest, "model": model, "inputs": inputs,
                    "scored_s": scored_s, "total_s": time.perf_counter() - started}

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        said = ""
        for _ in self._waiting(job, session(request), progress):
            if job.desc != said:  # the status line follows the job (what gradio_client sees as it runs)
                said = job.desc
                yield gr.skip(), gr.skip(), f"Running: {said}", gr.skip(), gr.skip(), gr.skip(), gr.skip()
        found = job.result
        c = found["circuit"]
        shown_answer = _text(model, inputs["answer"]) if inputs["answer"] is not None else answer
        shown_wrong = _text(model, inputs["wrong"]) if inputs["wrong"] is not None else wrong
        yield (to_plot(c.plot(n)), to_plot(faithfulness_figure(found["curve"], found["smallest"], n)),
               self._status(found), found, display_frame(edges_table(c, n)), shown_answer, shown_wrong)

    @staticmethod
    def _status(found: dict[str, Any]) -> str:
        c, smallest = found["circuit"], found["smallest"]
        total = c.graph.n_edges
        recovered = (f"the smallest circuit found to recover 80 % of the clean − corrupted gap has **{smallest:,}** "
                     f"of {total:,} edges" if smallest is not None else
                     f"no circuit size tried recovers 80 % of the gap (of {total:,} edges)")
        note = f" {found['inputs']['note']}" if found["inputs"].get("note") else ""
        return (f"**{c.method}{f', {c.steps} steps' if c.steps else ''}**: {c.metric_name} is {c.clean:.3f} on the "
                f"clean prompt and {c.corrupted:.3f} on the corrupted one; {recovered}. Scored in "
                f"{found['scored_s']:.1f} s, done in {found['total_s']:.1f} s.{note}")

    @staticmethod
    def _waiting(job: Job, who: str, progress: Any) -> Iterator[None]:
        try:
            yield from wait(job, who, progress)
        except JobCancelled:
            raise gr.Error("Cancelled; press Run to start again", print_exception=False) from None

    @staticmethod
    def _need(found: dict | None) -> dict[str, Any]:
        if not found:
            raise ValueError("Run the circuit first (press Run), then pick the top n or an edge")
        return found

    @readable_errors
    def redraw(self, found: dict | None, top_n: float | None) -> tuple:
        """The slider: the graph, the curve's marker and the table for another top n (no model run)."""
        if not found:
            return gr.skip(), gr.skip(), gr.skip()
        c = found["circuit"]
        n = _top_n(top_n, c.graph.n_edges)
        return (to_plot(c.plot(n)), to_plot(faithfulness_figure(found["curve"], found["smallest"], n)),
                display_frame(edges_table(c, n)))

    @readable_errors
    def select_edge(self, evt: gr.SelectData, found: dict | None, top_n: float | None) -> tuple:
        """A row of the top-edges table was selected: its edge's exact patches."""
        row = evt.row_value or []
        if len(row) < 3:
            raise ValueError("Select a row of the edge table")
        edge = f"{row[1]}->{row[2]}"
        return (edge, *self.edge(found, edge, top_n))

    @readable_errors
    def edge(self, found: dict | None, edge: str, top_n: float | None) -> tuple[str, pd.DataFrame]:
        """One edge's exact patch, alone and as the top-n circuit without it, beside the top-n circuit itself:
        three edge sets in one batched forward (slmviz.patch_edges)."""
        found = self._need(found)
        c: Circuit = found["circuit"]
        if not (edge or "").strip():
            raise ValueError("Name an edge as 'source->target', e.g. 'a3.h1->a5.h2<q>' (or select a table row)")
        graph = c.graph
        s, t = graph.index_of(edge.strip())  # an unknown name: a message naming the close ones
        name = f"{graph.sources[s]}->{graph.targets[t]}"
        n = _top_n(top_n, graph.n_edges)
        top = c.top(n)
        in_circuit = graph.mask(list(zip(top["source"], top["target"], strict=True)))
        inside = bool(in_circuit[s, t])
        alone = torch.zeros_like(in_circuit)
        alone[s, t] = True
        without = in_circuit.clone()
        without[s, t] = False
        real = graph.real()
        inputs = found["inputs"]
        values = slmviz.patch_edges(inputs["clean"], inputs["corrupted"], edges=torch.stack(
            [alone, real & ~in_circuit, real & ~without]), answer=inputs["answer"], wrong=inputs["wrong"],
            metric=inputs["metric"], model=found["model"])
        span = c.clean - c.corrupted

        def norm(v: float) -> float:
            return (v - c.corrupted) / span if span else float("nan")

        rows = [
            ("this edge alone patched (every other edge clean)", 1, values[0], norm(values[0])),
            (f"the top-{n} circuit (every edge outside it patched)", graph.n_edges - n, values[1], norm(values[1])),
            (f"the top-{n} circuit without this edge", graph.n_edges - n + int(inside), values[2], norm(values[2])),
        ]
        table = pd.DataFrame(rows, columns=["run", "edges patched", c.metric_name, "normalized"])
        score = c.score(name)
        where = (f"rank {int((c.edges['score'].abs() > abs(score)).sum()) + 1}" if score else "score 0")
        text = (f"**{name}** ({c.method} score {score:.4g}, {where}). Alone, its corrupted value moves "
                f"{c.metric_name} from {c.clean:.3f} to {values[0]:.3f} (Δ {values[0] - c.clean:+.3f}). The top-{n} "
                f"circuit gives {values[1]:.3f} (normalized {norm(values[1]):.2f}); without this edge, "
                f"{values[2]:.3f} (normalized {norm(values[2]):.2f})"
                + ("." if inside else f": the edge is not in the top {n}, so both are the same circuit."))
        return text, display_frame(table)

    # --- attribution graphs -------------------------------------------------------------------
    def transcoders(self, model: Any) -> list[str]:
        """The transcoders on offer for `model` (bundled, $SLMVIZ_SAE_DIRS, loaded in the Model tab), then its full
        set when prepared (app/transcoder_sets.py), one choice."""
        if self.features is None:
            return self.sets.choices(model)
        names = []
        for name in self.features.saes.names(model):
            try:
                if self.features.saes.get(model, name).sae.is_transcoder:
                    names.append(name)
            except Exception:  # noqa: BLE001 - one that does not load is simply not offered
                continue
        return names + self.sets.choices(model)

    def ticked(self, model: Any, offered: list[str]) -> list[str]:
        """What the picker ticks first: the full set alone when there is one, else every single transcoder."""
        return self.sets.ticked(model) or [n for n in offered if not self.sets.is_set(model, n)]

    @readable_errors
    def transcoder_choices(self, source: str | None) -> gr.CheckboxGroup:
        model = self.h.model(source)
        names = self.transcoders(model)
        return gr.CheckboxGroup(choices=names, value=self.ticked(model, names))

    @readable_errors
    def attribution(self, prompt: str, names: list[str] | None, node_threshold: float | None,
                    edge_threshold: float | None, source: str | None, request: gr.Request,
                    progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The prompt's attribution graph over the picked transcoders (a long job), pruned by influence."""
        model = self.h.model(source, progress)
        text = self.h.checked_prompt(prompt, model)
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
        thresholds = _thresholds(node_threshold, edge_threshold)
        model.encode(text)  # too long for the model: a readable error now, not from the job
        full = [n for n in names if self.sets.is_set(model, n)]
        if full and len(names) > 1:
            raise ValueError(f"{full[0]!r} already has a transcoder at every layer: pick it alone, or untick it to "
                             f"pick {', '.join(n for n in names if n != full[0])}")
        kind = set_kind(model, full[0]) if full else None
        if kind:
            self.sets.check(model, kind)  # not built yet: a readable error now, not from the job
        entries = [] if full else [self.features.saes.get(model, n) for n in names]
        layers: dict[int, str] = {}
        for entry in entries:
            layer = int(entry.sae.hook_name.split(".")[1])
            if layer in layers:
                raise ValueError(f"{layers[layer]} and {entry.name} both read layer {layer}; pick one per layer")
            layers[layer] = entry.name

        def work(report: Callable[..., None]) -> dict[str, Any]:
            started = time.perf_counter()
            transcoders = [e.sae for e in entries]
            if full:  # loaded once per model (the first graph waits for it), then kept
                report(0.01, f"Loading the {full[0]}")
                transcoders, names_of = self.sets.load(model, kind)
                layers.update(names_of)
            report(0.02, f"The attribution graph over {', '.join(names)}: one forward, then one backward per batch "
                         "of targets (the top logits, then every active feature)")

            def attributed(done: int, total: int) -> None:  # raises JobCancelled once no one waits: the graph stops
                report(0.02 + 0.96 * done / max(total, 1), f"attributed {done:,} of {total:,} targets (the top "
                       "logits, then the active features), one backward per batch")

            cap = MAX_FEATURE_NODES if full else None  # a full set: the most influential features only
            graph = slmviz.attribution_graph(text, transcoders=transcoders, model=model, max_feature_nodes=cap,
                                             memory_budget_gb=ATTR_MEMORY_GB, progress=attributed)
            return {"graph": graph, "layers": layers, "model": model, "seconds": time.perf_counter() - started,
                    "scores": graph.scores(), "picked": names, "cap": cap}

        job = RUNNER.submit(work, session(request), kind=ATTR_KIND)
        said = ""
        for _ in self._waiting(job, session(request), progress):
            if job.desc != said:
                said = job.desc
                yield gr.skip(), gr.skip(), gr.skip(), f"Running: {said}", gr.skip()
        found = job.result
        yield (*self._pruned(found, *thresholds), found)

    def _pruned(self, found: dict[str, Any], node_threshold: float, edge_threshold: float) -> tuple:
        """(plot, feature table, JSON file, status) of the graph pruned at these thresholds."""
        graph = found["graph"]
        pruned = graph.prune(node_threshold, edge_threshold)
        path = pruned.save_json(self.h.output_path("attribution-graph.json"))
        nodes = pruned.kept_nodes
        counts = nodes["kind"].value_counts()
        scores = found.get("scores") or {}
        over = (", ".join(found["picked"]) if "picked" in found else
                ", ".join(found["layers"][k] for k in sorted(found["layers"])))
        scored = (f"**Replacement score {scores['replacement']:.3f}, completeness {scores['completeness']:.3f}** "
                  "(circuit-tracer's scores of the unpruned graph: the share of the influence that avoids error "
                  "nodes, and of each node's inputs that are not errors; 1 when the transcoders explain "
                  "everything). " if scores else "")
        capped = f" (at most {found['cap']:,}, the most influential: max_feature_nodes)" if found.get("cap") else ""
        status = (f"{scored}**{graph.prompt!r}**: {graph.n_features} active features{capped} over {over}; computed in "
                  f"{found['seconds']:.1f} s. Pruned to {node_threshold:g} of the influence on the logits (edges "
                  f"{edge_threshold:g}): {int(counts.get('feature', 0))} features, {int(counts.get('error', 0))} "
                  f"error nodes, {int(counts.get('embedding', 0))} embeddings, {int(counts.get('logit', 0))} "
                  f"logits. Select a feature to open its page; the JSON is circuit-tracer's graph format.")
        fig = pruned.plot()
        for trace in fig.data:  # an edge's end points sit on its nodes: hovering and clicking there means the node
            if trace.mode == "lines":
                trace.hoverinfo = "skip"
        return to_plot(fig), display_frame(feature_table(pruned, found["layers"])), str(path), status

    @readable_errors
    def reprune(self, found: dict | None, node_threshold: float | None, edge_threshold: float | None) -> tuple:
        """The threshold sliders: prune the graph again (no model run)."""
        if not found:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return self._pruned(found, *_thresholds(node_threshold, edge_threshold))

    @readable_errors
    def open_feature(self, found: dict | None, node: str, source: str | None, request: gr.Request,
                     progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """A feature node ('layer_feature_position', or 'layer, feature'): its page, the Features tab's card
        (its corpus contexts come from that tab's feature scan, run once per transcoder)."""
        if not found:
            raise ValueError("Build the attribution graph first, then select a feature")
        numbers = [int(x) for x in re.findall(r"\d+", node or "")]
        if len(numbers) < 2:
            raise ValueError(f"A feature node is 'layer_feature_position' (its id) or 'layer, feature'; got {node!r}")
        layer, feature = numbers[:2]
        if layer not in found["layers"]:
            raise ValueError(f"Layer {layer} has no transcoder in this graph (its nodes there are error nodes); "
                             f"the transcoders read layers {', '.join(map(str, sorted(found['layers'])))}")
        name = found["layers"][layer]
        for f, card in self.features.show(name, feature, source, request, progress):
            if isinstance(card, str):  # else a no-op update while the feature scan runs
                yield card, name, f"{layer}_{f}"
            else:
                yield gr.skip(), name, gr.skip()

    @readable_errors
    def select_feature(self, evt: gr.SelectData, found: dict | None, source: str | None, request: gr.Request,
                       progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        row = evt.row_value or []
        if len(row) < 2:
            raise ValueError("Select a row of the feature table")
        yield from self.open_feature(found, f"{row[0]}, {row[1]}", source, request, progress)


def _thresholds(node_threshold: Any, edge_threshold: Any) -> tuple[float, float]:
    values = []
    for what, v in (("node", node_threshold), ("edge", edge_threshold)):
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"The {what} threshold must be a number in (0, 1], got {v!r}") from None
        if not 0 < x <= 1:
            raise ValueError(f"The {what} threshold must be in (0, 1] (a fraction of the influence), got {x}")
        values.append(x)
    return values[0], values[1]


def feature_table(pruned: Any, layers: dict[int, str]) -> pd.DataFrame:
    """The kept feature nodes, most influential first: layer, feature, position, token, activation, transcoder."""
    nodes = pruned.kept_nodes
    nodes = nodes[nodes["kind"] == "feature"]
    if pruned.influence is not None:
        order = pruned.influence.numpy()[nodes.index.to_numpy()].argsort(kind="stable")
        nodes = nodes.iloc[order]
    return pd.DataFrame({"layer": nodes["layer"].astype(int), "feature": nodes["feature"].astype(int),
                         "position": nodes["position"].astype(int), "token": nodes["token"],
                         "activation": nodes["activation"].round(3), "transcoder": nodes["layer"].map(layers)})


def build_circuits_tab(handlers: Handlers, source: gr.State, model_kw: dict, light_kw: dict, job_kw: dict,
                       features: Any = None) -> None:
    """The Circuits tab, inside the page's `with gr.Tabs():`. Long work waits in the "jobs" queue (job_kw)."""
    ch = CircuitHandlers(handlers, features)
    with gr.Tab("Circuits", id="tab-circuits"):
        gr.Markdown(INTRO)
        with gr.Row():
            clean = gr.Textbox(label="clean prompt", value=EXAMPLE_CLEAN, lines=2, elem_id="circuit-clean")
            corrupted = gr.Textbox(label="corrupted prompt (same number of tokens)", value=EXAMPLE_CORRUPTED,
                                   lines=2, elem_id="circuit-corrupted")
        with gr.Row():
            answer = gr.Textbox(label="answer (one token; empty = suggested)", value=EXAMPLE_ANSWER,
                                elem_id="circuit-answer")
            wrong = gr.Textbox(label="wrong (one token)", value=EXAMPLE_WRONG, elem_id="circuit-wrong")
            task = gr.Dropdown(TASK_CHOICES, value="ioi", label="built-in task", elem_id="circuit-task")
            pair = gr.Number(value=0, precision=0, minimum=0, label="pair number", elem_id="circuit-task-pair",
                             min_width=100)
            fill_btn = gr.Button("Fill from the task", elem_id="circuit-task-fill")
        with gr.Row():
            method = gr.Radio(METHOD_CHOICES, value="eap", label="method", elem_id="circuit-method", scale=3,
                              info=f"exact runs on graphs of up to {EXACT_MAX_EDGES:,} edges: Gemma 3 270M has "
                                   "5,644, SmolLM2 70,651")
            steps = gr.Slider(1, MAX_STEPS, value=5, step=1, label="EAP-IG steps", elem_id="circuit-steps", scale=1)
        with gr.Row():
            run_btn = gr.Button("Run", variant="primary", elem_id="circuit-run")
            cancel_btn = gr.Button("Cancel", elem_id="circuit-cancel")
        status = gr.Markdown(elem_id="circuit-status")
        bound = gr.State(None, time_to_live=3600)  # the task pair the boxes were filled with
        found = gr.State(None, time_to_live=3600)  # the last run: Circuit, curve, smallest, inputs
        top_n = gr.Slider(1, MAX_TOP, value=DEFAULT_TOP, step=1, label="top n edges (graph, table, circuit)",
                          elem_id="circuit-top")
        with gr.Row():
            with gr.Column(scale=3):
                graph_plot = gr.Plot(show_label=False, elem_id="circuit-graph")
            with gr.Column(scale=2):
                curve_plot = gr.Plot(show_label=False, elem_id="circuit-faithfulness")
        gr.Markdown("**Select an edge** (a row) to run its exact patch, alone and as the circuit without it; or type "
                    "one as `source->target`.")
        with gr.Row():
            with gr.Column(scale=2):
                edges = gr.Dataframe(label="top edges", interactive=False, elem_id="circuit-edges",
                                     headers=["rank", "source", "target", "score"], latex_delimiters=[],
                                     max_height=420)
            with gr.Column(scale=3):
                with gr.Row():
                    edge_box = gr.Textbox(label="edge", placeholder="a23.h3->logits", elem_id="circuit-edge",
                                          scale=3)
                    edge_btn = gr.Button("Patch this edge", elem_id="circuit-edge-run", scale=1)
                edge_text = gr.Markdown(elem_id="circuit-edge-text")
                edge_table = gr.Dataframe(label="exact edge patching", interactive=False,
                                          headers=["run", "edges patched", "metric", "normalized"],
                                          elem_id="circuit-edge-table", latex_delimiters=[])
        with gr.Accordion("Attribution graph: transcoder features of one prompt", open=True):
            gr.Markdown(ATTR_INTRO)
            offered = ch.transcoders(handlers.store.get())
            with gr.Row():
                attr_prompt = gr.Textbox(label="prompt", value=ATTR_PROMPT, elem_id="circuit-attr-prompt", scale=3)
                attr_names = gr.CheckboxGroup(offered, value=ch.ticked(handlers.store.get(), offered),
                                              label="transcoders", elem_id="circuit-attr-transcoders", scale=2)
            no_set, said = ch.sets.panel(handlers.store.get())  # app/transcoder_sets.py: build the full set
            set_status = gr.Markdown(said, elem_id="circuit-set-status")
            with gr.Row():
                set_build = gr.Button("Build the full transcoder set", elem_id="circuit-set-build", visible=no_set)
                set_cancel = gr.Button("Cancel the build", elem_id="circuit-set-cancel", visible=no_set)
            with gr.Row():
                node_threshold = gr.Slider(0.5, 1.0, value=NODE_THRESHOLD, step=0.01, elem_id="circuit-attr-nodes-kept",
                                           label="node threshold (fraction of the influence on the logits kept)")
                edge_threshold = gr.Slider(0.5, 1.0, value=EDGE_THRESHOLD, step=0.01, label="edge threshold",
                                           elem_id="circuit-attr-edges-kept")
            with gr.Row():
                attr_btn = gr.Button("Build the attribution graph", variant="primary", elem_id="circuit-attr-run")
                attr_cancel = gr.Button("Cancel", elem_id="circuit-attr-cancel")
            attr_status = gr.Markdown(elem_id="circuit-attr-status")
            attr_found = gr.State(None, time_to_live=3600)
            attr_plot = gr.Plot(show_label=False, elem_id="circuit-attr-graph")
            with gr.Row():
                with gr.Column(scale=3):
                    attr_nodes = gr.Dataframe(label="feature nodes, most influential first (select one)",
                                              interactive=False, elem_id="circuit-attr-nodes", latex_delimiters=[],
                                              headers=["layer", "feature", "position", "token", "activation",
                                                       "transcoder"], max_height=360)
                with gr.Column(scale=2):
                    attr_json = gr.File(label="the graph (circuit-tracer's JSON)", elem_id="circuit-attr-json")
                    with gr.Row():
                        node_box = gr.Textbox(label="feature node (click one in the graph, or layer_feature_position)",
                                              elem_id="circuit-attr-node", scale=3)
                        open_btn = gr.Button("Open its page", elem_id="circuit-attr-open", scale=1)
            opened = gr.State(None)  # the transcoder whose card is open (its nearest features link to it)
            opened_feature = gr.State(None)  # the Features tab's handler also returns the feature number
            card = gr.HTML(elem_id="circuit-feature-card", js_on_load=FEATURE_CLICK_JS)
            redraw_workbench = build_workbench(handlers, features, attr_found, node_threshold, edge_threshold,
                                               light_kw, job_kw)

    fill_outputs = [clean, corrupted, answer, wrong, bound, status]
    gr.on([fill_btn.click, task.input], ch.fill, [task, pair, source], fill_outputs, api_name="circuit_task",
          **light_kw)
    ran = run_btn.click(ch.run, [clean, corrupted, answer, wrong, method, steps, top_n, bound, source],
                        [graph_plot, curve_plot, status, found, edges, answer, wrong], api_name="circuit_run",
                        **job_kw)

    def cancel(request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)  # also for an API client, whose request Gradio cannot stop
        return "Cancelled."

    cancel_btn.click(cancel, None, status, cancels=[ran], api_name="circuit_cancel", **light_kw)
    top_n.release(ch.redraw, [found, top_n], [graph_plot, curve_plot, edges], api_name="circuit_top", **light_kw)
    edges.select(ch.select_edge, [found, top_n], [edge_box, edge_text, edge_table], api_visibility="private",
                 **model_kw)
    gr.on([edge_btn.click, edge_box.submit], ch.edge, [found, edge_box, top_n], [edge_text, edge_table],
          api_name="circuit_edge", **model_kw)
    attr_outputs = [attr_plot, attr_nodes, attr_json, attr_status, attr_found]
    built = attr_btn.click(ch.attribution, [attr_prompt, attr_names, node_threshold, edge_threshold, source],
                           attr_outputs, api_name="circuit_attribution", **job_kw)

    def cancel_attribution(request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=ATTR_KIND)
        SCANS.jobs.leave(session(request), kind="scan")  # a feature page waiting for its transcoder's scan
        return "Cancelled."

    repruned = gr.on([node_threshold.release, edge_threshold.release], ch.reprune,
                     [attr_found, node_threshold, edge_threshold], attr_outputs[:4], api_name="circuit_prune",
                     **light_kw)
    redraw_workbench(built, repruned)  # app/workbench.py: pins, subgraph, supernodes, labels, interventions
    on_card = {"show_progress_on": card}  # the scan's progress on the card, not on the node box
    opening = [attr_nodes.select(ch.select_feature, [attr_found, source], [card, opened, node_box],
                                 api_visibility="private", **on_card, **job_kw),
               gr.on([open_btn.click, node_box.submit], ch.open_feature, [attr_found, node_box, source],
                     [card, opened, node_box], api_name="circuit_feature", **on_card, **job_kw)]
    if features is not None:  # the card's nearest features open their own page, as in the Features tab
        opening.append(card.click(features.open, [opened, source], [opened_feature, card],
                                  api_visibility="private", **on_card, **job_kw))
    attr_cancel.click(cancel_attribution, None, attr_status, cancels=[built, *opening],
                      api_name="circuit_attribution_cancel", **light_kw)
    attr_plot.change(None, None, None, js=NODE_CLICK_JS)
    building = set_build.click(ch.sets.build, source, [attr_names, set_status, set_build, set_cancel],
                               api_name="circuit_set_build", **job_kw)
    source.change(ch.sets.offer, source, [set_build, set_cancel, set_status], api_visibility="private", **light_kw)
    page = Context.root_block  # a set built since the server started: ticked, and no Build button, on page load
    if page is not None:
        page.load(ch.sets.refresh, source, attr_names, api_visibility="private")
        page.load(ch.sets.offer, source, [set_build, set_cancel, set_status], api_visibility="private")
    set_cancel.click(ch.sets.cancel, None, set_status, cancels=[building], api_name="circuit_set_cancel",
                     **light_kw)
    source.change(lambda: (None, None, None), None, [found, bound, attr_found], api_visibility="private", **light_kw)
    source.change(ch.transcoder_choices, source, attr_names, api_visibility="private", **light_kw)
