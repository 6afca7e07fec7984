"""The "Circuits" tab: which edges between components carry the answer (EAP, EAP-IG, exact edge patching).

Layout and handlers of one tab, built inside the page's gr.Tabs by `build_circuits_tab`. Like the rest of app/, it
turns widget values into slmviz calls (`slmviz.circuit`, `Circuit.faithfulness`, `slmviz.patch_edges`, the task
generators of slmviz.circuits.tasks) and returns figures; no torch code beyond building edge masks. Element ids (the
browser tests and page scripts find them): #circuit-clean, #circuit-corrupted, #circuit-run, #circuit-graph (the
graph's plot), #circuit-faithfulness (plus #circuit-answer, #circuit-wrong, #circuit-task, #circuit-task-pair,
#circuit-task-fill, #circuit-method, #circuit-steps, #circuit-cancel, #circuit-status, #circuit-top, #circuit-edges,
#circuit-edge, #circuit-edge-run, #circuit-edge-text, #circuit-edge-table). The attribution graph over transcoder
features has a tab of its own (app/tabs/graph.py).

Clicking an edge: plotly's click is not a Gradio event, and an edge is a line (plotly reports clicks on its two end
points only), so the top edges are also a gr.Dataframe: selecting a row runs that edge's exact patch, alone and as the
top-n circuit without it (one batched forward of three edge sets).

Scoring (EAP, EAP-IG, exact) and the faithfulness curve are one long job: it runs in app/jobs.py's worker, waited
for in the page's "jobs" queue, so another session's Run is served meanwhile.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import gradio as gr
import pandas as pd
import plotly.graph_objects as go
import torch

import slmviz
from slmviz.circuits import tasks
from slmviz.circuits.graph import ComponentGraph
from slmviz.interventions.patching import suggest_answers
from slmviz.progress import Progress

from ..jobs import RUNNER
from ..models import AppContext
from ..shared import (
    EXAMPLE_ANSWER,
    EXAMPLE_WRONG,
    Queues,
    busy_while,
    display_frame,
    guard_number,
    prompt_pair,
    readable_errors,
    session,
    to_plot,
    wait_or_say,
)

METHOD_CHOICES = [("EAP (one forward and one backward)", "eap"),
                  ("EAP-IG (one forward and backward per step)", "eap-ig"),
                  ("exact (one patched run per edge; small graphs only)", "exact")]
TASK_CHOICES = [("IOI: indirect object identification", "ioi"), ("induction: a repeated random sequence", "induction"),
                ("greater-than: years, digit by digit", "greater-than")]
# `exact` patches one edge per run, so its time grows with the edges: offered up to Gemma 3 270M's 5,644, not
# SmolLM2's 70,651 (docs/app.md has the measured minutes). Above this the tab says so and offers EAP / EAP-IG.
EXACT_MAX_EDGES = 6000
MAX_STEPS = 50
DEFAULT_TOP, MAX_TOP = 30, 300
REFINE_SIZES = 6  # sizes tried between the last one short of 80 % and the first one reaching it (one more batch)
JOB_KIND = "circuit"  # the tab's Cancel leaves only this kind of job
CANCELLED = "Cancelled; press Run to start again"
INTRO = """Which **edges** carry the answer: which head's output, read by which later head's query, key or value, or
by which MLP. Each edge is scored for how much the metric (logit(answer) − logit(wrong) at the last position) moves
when that edge alone carries the *corrupted* prompt's value instead of the clean one (EAP, EAP-IG, or exact
patching). The graph draws the top *n* edges layer by layer (width |score|, blue raises the metric, red lowers
it; solid into a query, dashed into a key, dotted into a value); the curve beside it keeps only the top *n* edges
clean and patches every other one from the corrupted run (1 = the clean metric, 0 = the corrupted one).
**Select an edge in the table** to patch it exactly, alone and as the top-*n* circuit without it."""


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


def edges_table(c: slmviz.Circuit, n: int) -> pd.DataFrame:
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
    """The tab's handlers; models and limits come from the page's AppContext."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

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
        found = task_pair(self.ctx.model(source), name, index)
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
        clean, corrupted = self.ctx.checked_prompt(clean, model), self.ctx.checked_prompt(corrupted, model)
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
        model = self.ctx.model(source, progress)
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

        def work(progress: Progress) -> dict[str, Any]:
            started = time.perf_counter()
            scoring = progress.part(f"{what}: scoring {graph_edges:,} edges", 0.62)
            scoring.say("")
            c = slmviz.circuit(inputs["clean"], inputs["corrupted"], answer=inputs["answer"], wrong=inputs["wrong"],
                               metric=inputs["metric"], model=model, method=method, steps=max(n_steps, 1),
                               progress=scoring)
            scored_s = time.perf_counter() - started
            curve_part = progress.part("the faithfulness curve (every edge outside the top n patched)", 0.3)
            curve = c.faithfulness(progress=curve_part)
            progress.part("the smallest circuit recovering 80 %", 1.0).say("")
            smallest = c.smallest(0.8, count=REFINE_SIZES, curve=curve)
            return {"circuit": c, "curve": curve, "smallest": smallest, "model": model, "inputs": inputs,
                    "scored_s": scored_s, "total_s": time.perf_counter() - started}

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        said = ""
        for _ in wait_or_say(job, session(request), progress, CANCELLED):
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
        c: slmviz.Circuit = found["circuit"]
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

def build_circuits_tab(ctx: AppContext, source: gr.State, queues: Queues) -> None:
    """The Circuits tab, inside the page's `with gr.Tabs():`. Long work waits in the "jobs" queue."""
    ch = CircuitHandlers(ctx)
    with gr.Tab("Circuits", id="tab-circuits"):
        gr.Markdown(INTRO)
        clean, corrupted = prompt_pair("circuit")
        with gr.Row():
            answer = gr.Textbox(label="answer (one token; empty = suggested)", value=EXAMPLE_ANSWER,
                                elem_id="circuit-answer")
            wrong = gr.Textbox(label="wrong (one token)", value=EXAMPLE_WRONG, elem_id="circuit-wrong")
            task = gr.Dropdown(TASK_CHOICES, value="ioi", label="built-in task", elem_id="circuit-task",
                               min_width=360)  # wide enough for "induction: a repeated random sequence"
            pair = gr.Number(value=0, precision=0, label="pair number", elem_id="circuit-task-pair", min_width=100)
            guard_number(pair, "The pair number", lo=0, whole=True)
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
        graph_plot = gr.Plot(show_label=False, elem_id="circuit-graph")  # full width: a column per layer
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

    fill_outputs = [clean, corrupted, answer, wrong, bound, status]
    gr.on([fill_btn.click, task.input], ch.fill, [task, pair, source], fill_outputs, api_name="circuit_task",
          **queues.light)
    ran = busy_while(run_btn, cancel_btn, lambda: run_btn.click(
        ch.run, [clean, corrupted, answer, wrong, method, steps, top_n, bound, source],
        [graph_plot, curve_plot, status, found, edges, answer, wrong], api_name="circuit_run", **queues.jobs))

    def cancel(request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)  # also for an API client, whose request Gradio cannot stop
        return "Cancelled."

    cancel_btn.click(cancel, None, status, cancels=[ran], api_name="circuit_cancel", **queues.light)
    top_n.release(ch.redraw, [found, top_n], [graph_plot, curve_plot, edges], api_name="circuit_top", **queues.light)
    edges.select(ch.select_edge, [found, top_n], [edge_box, edge_text, edge_table], api_visibility="private",
                 **queues.model)
    gr.on([edge_btn.click, edge_box.submit], ch.edge, [found, edge_box, top_n], [edge_text, edge_table],
          api_name="circuit_edge", **queues.model)
    source.change(lambda: (None, None), None, [found, bound], api_visibility="private", **queues.light)
