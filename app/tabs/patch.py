"""The "Patch" tab: activation patching, attribution, direct logit attribution and ablation in the browser.

Layout and handlers of one tab, built inside the page's gr.Tabs by `build_patch_tab`. Like the rest of app/,
it turns widget values into slmviz calls (`patch_steps`, `Trace.logit_attribution`, `ablation`) and returns
figures; no torch code. Element ids (the browser tests find them): #patch-clean, #patch-corrupted, #patch-run,
#patch-plot (plus #patch-cell, #patch-cell-show, #patch-cell-top, #patch-heads-plot, #patch-dla-plot,
#patch-dla-heads-plot, #patch-cancel, #patch-status, #patch-ablate, ...).

Clicking a heatmap cell: plotly's click event is not a Gradio event, so a few lines of page JavaScript copy
the cell's customdata [layer, position, head] into #patch-cell and press #patch-cell-show.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import gradio as gr
import pandas as pd

import slmviz
from slmviz import plots
from slmviz.hooks import layer_hook_name
from slmviz.interventions.attribution import exact_correlation
from slmviz.interventions.patching import DIRECTIONS, patch_steps, suggest_answers
from slmviz.interventions.sites import SITES
from slmviz.plots.patch import logit_attribution_bars

from ..fast_mode import SWEEP_COST, dtype_for, fast_checkbox
from ..jobs import RUNNER, JobProgress
from ..models import AppContext
from ..scans import SCANS, wait_for_scan
from ..shared import (
    EXAMPLE_ANSWER,
    EXAMPLE_WRONG,
    PICK_CELL,
    Queues,
    busy_while,
    display_frame,
    plot_click_js,
    prompt_pair,
    readable_errors,
    session,
    to_plot,
    wait_or_say,
)

SITE_CHOICES = [(f"{name}: {site.description}", name) for name, site in SITES.items()]
METHOD_CHOICES = [("exact (one patched run per cell, batched)", "exact"),
                  ("attribution (gradient estimate, one forward + one backward)", "attribution")]
NOT_ABLATED = "Not ablated: the message above says why; the tables below are the last ablation's."
REDRAW_EVERY_S = 0.75  # a sweep in progress redraws its partial heatmap at most this often
ABLATION_TOKENS = 20

INTRO = """Which layer and position carry the information that makes the model say the **answer** rather than the
**wrong** token? Run the *corrupted* prompt, paste in one activation from the *clean* prompt at a time, and see
how much of the clean answer comes back (1 = all of it, 0 = none; TransformerLens's activation patching).
The example pair swaps the second name of an indirect-object sentence. **Click a cell** to see that patched
run's next tokens. Both prompts must have the same number of tokens."""

CLICK_JS = plot_click_js(["patch-plot"], "patch-cell", "patch-cell-show", PICK_CELL)  # a cell: its [layer, pos, head]
JOB_KIND = "patch"  # the tab's Cancel leaves only this kind of job
CANCELLED = "Cancelled; press Run the sweep to start again"


class PatchHandlers:
    """The tab's handlers; model access and limits come from the page's AppContext."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    def _prompts(self, clean: str, corrupted: str, source: str | None, progress: Any = None,
                 fast: bool | None = False) -> tuple:
        model = self.ctx.model(source, progress, dtype_for(fast))
        return model, self.ctx.checked_prompt(clean, model), self.ctx.checked_prompt(corrupted, model)

    @readable_errors
    def suggest(self, clean: str, corrupted: str, source: str | None) -> tuple[str, str]:
        model, clean, corrupted = self._prompts(clean, corrupted, source)
        return suggest_answers(model, clean, corrupted)

    @readable_errors
    def sweep(self, clean: str, corrupted: str, answer: str, wrong: str, site: str, direction: str, method: str,
              fast: bool | None, source: str | None, request: gr.Request,
              progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The sweep is a long job (app/jobs.py's RUNNER), waited for here in the page's "jobs" queue: other
        sessions' requests are served while it runs. The partial heatmap is redrawn as cells finish; Cancel
        closes this wait, which stops the job at its next batch of cells. `fast`: on the model's bf16 copy
        (app/fast_mode.py)."""
        model, clean, corrupted = self._prompts(clean, corrupted, source, progress, fast)

        def work(progress: JobProgress) -> tuple[slmviz.PatchResult, str, str, str]:
            ans, wro = (answer, wrong) if (answer or "").strip() else suggest_answers(model, clean, corrupted)
            started = time.perf_counter()
            kw = dict(answer=ans, wrong=wro or None, site=site, model=model, direction=direction)
            if method == "attribution":
                progress.part("attribution patching (one forward, one backward)", 0.1).say("")
                result = slmviz.patch(clean, corrupted, method="attribution", **kw)
                estimate_s = time.perf_counter() - started
                sweep = progress.part("the exact sweep, to measure the estimate", 1.0)
                exact = slmviz.patch(clean, corrupted, **kw,
                                     progress=sweep)
                note = (f"Attribution estimate in {estimate_s:.1f} s; its correlation with the exact sweep "
                        f"(computed too, {time.perf_counter() - started - estimate_s:.1f} s) is "
                        f"r = {exact_correlation(result, exact):.2f}.")
                return result, note, ans, wro
            result = None
            sweep = progress.part(f"patching {site}", 1.0)
            for result in patch_steps(clean, corrupted, method="exact", **kw):
                progress.publish(result)
                sweep.update(result.done, result.total, unit="cell")
            assert result is not None
            return result, f"Done in {time.perf_counter() - started:.1f} s.", ans, wro

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        last = 0.0
        for _ in wait_or_say(job, session(request), progress, CANCELLED):
            partial = job.partial
            if partial is not None and time.monotonic() - last >= REDRAW_EVERY_S:
                last = time.monotonic()
                yield to_plot(partial.plot()), self._status(partial, "Running...", model), partial, gr.skip(), gr.skip()
        result, note, answer, wrong = job.result
        yield to_plot(result.plot()), self._status(result, note, model), result, answer, wrong

    @staticmethod
    def _status(r: slmviz.PatchResult, note: str, model: slmviz.Model) -> str:
        precision = ", bf16" if str(getattr(model, "dtype", "")) == "torch.bfloat16" else ""
        return (f"**{r.site}** ({r.direction}, {r.method}{precision}): {r.metric_name} is {r.clean:.3f} on the "
                f"clean prompt and {r.corrupted:.3f} on the corrupted one; {r.done}/{r.total} cells. {note}")

    @readable_errors
    def cell(self, result: slmviz.PatchResult | None, cell: str) -> tuple[pd.DataFrame, str]:
        if result is None:
            raise ValueError("Run a sweep first, then click a cell of the heatmap")
        numbers = [int(x) for x in re.findall(r"-?\d+", cell or "")]
        if len(numbers) < 2:
            raise ValueError(f"A cell is 'layer, position[, head]' (click the heatmap to fill it), got {cell!r}")
        layer, position, head = (numbers + [-1])[:3]
        dims = result.dims
        if dims == ("layer", "head"):  # the heads site: customdata is [layer, -1, head]
            position, head = None, head if head >= 0 else position
        elif len(dims) == 2:
            head = None
        trace = result.run_cell(layer, position, head)
        index = tuple(i for i in (layer, position, head) if i is not None)
        value = float(result.values[index])
        where = f"layer {layer}" + (f", position {position} ({trace.tokens[position]!r})" if position is not None
                                    else "") + (f", head {head}" if head is not None else "")
        text = (f"Patched **{result.site}** at {where}: {result.metric_name} = {value:.3f} "
                f"(normalized {float(result.normalized[index]):.2f}). Next tokens of that patched run:")
        return display_frame(plots.next_token_table(trace, 10)), text

    @readable_errors
    def heads_and_attribution(self, clean: str, corrupted: str, answer: str, wrong: str, direction: str,
                              fast: bool | None, source: str | None, request: gr.Request,
                              progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """Every head's z patched at all positions, then direct logit attribution: a long job, like `sweep`."""
        model, clean, corrupted = self._prompts(clean, corrupted, source, progress, fast)

        def work(progress: JobProgress) -> tuple:
            ans, wro = (answer, wrong) if (answer or "").strip() else suggest_answers(model, clean, corrupted)
            patched = progress.part("patching every head's z at all positions", 0.8)
            patched.say("")
            heads = slmviz.patch(clean, corrupted, answer=ans, wrong=wro or None, site="heads", model=model,
                                 direction=direction,
                                 progress=patched)
            progress.part("direct logit attribution on the clean prompt", 1.0).say("")
            trace = model.trace(clean)
            by_layer = trace.logit_attribution(ans, wro or None, by="layer")
            by_head = trace.logit_attribution(ans, wro or None, by="head")
            fig_heads = logit_attribution_bars(by_head, top=20)
            fig_heads.update_layout(title={"text": "Direct logit attribution: the 20 largest heads (clean prompt)"})
            return to_plot(heads.plot()), to_plot(logit_attribution_bars(by_layer)), to_plot(fig_heads)

        job = RUNNER.submit(work, session(request), kind=JOB_KIND)
        for _ in wait_or_say(job, session(request), progress, CANCELLED):
            yield gr.skip(), gr.skip(), gr.skip()
        yield job.result

    @readable_errors
    def ablation_means(self, heads: str, neurons: str, kind: str, source: str | None, request: gr.Request,
                       progress: gr.Progress = gr.Progress()) -> Iterator[str]:  # noqa: B008
        """Mean ablation's means: scanned over the Corpus tab's verses once per model and hook (a background
        job, waited for here in the "scan" queue, so the model queue stays free meanwhile)."""
        hooks = ablated_hooks(heads, neurons)
        if kind != "mean" or not hooks:  # nothing to scan (ablate() says what is missing)
            yield "Ablating..."
            return
        model = self.ctx.model(source)
        s, docs = yield from wait_for_scan(lambda who: SCANS.means(model, hooks, who), session(request), progress, 1)
        yield f"Means of {', '.join(hooks)} over {len(docs)} verses of the bundled corpus: ready. Ablating..."

    @readable_errors
    def ablate(self, prompt: str, heads: str, neurons: str, kind: str, source: str | None,
               progress: gr.Progress = gr.Progress()) -> tuple:  # noqa: B008
        model = self.ctx.model(source, progress)
        prompt = self.ctx.checked_prompt(prompt, model)
        head_pairs, neuron_pairs = parse_pairs(heads, "heads"), parse_pairs(neurons, "neurons")
        reference, n_docs = None, 0
        if kind == "mean" and ablated_hooks(heads, neurons):
            found = SCANS.finished_means(model, ablated_hooks(heads, neurons))
            if found is None:
                raise ValueError("The corpus means for this ablation are not computed yet: press Ablate (over the "
                                 "API, call /patch_ablate_means with the same heads, neurons and kind first)")
            reference, n_docs = found[0], len(found[1])
        progress(0.2, desc="Building the ablation hooks")
        hooks = slmviz.ablation(heads=head_pairs, neurons=neuron_pairs, kind=kind, reference=reference, model=model)
        progress(0.4, desc="Tracing with and without the ablation")
        before, after = model.trace(prompt, names=[]), model.trace(prompt, names=[], hooks=hooks)
        progress(0.6, desc="Greedy continuations")
        text_before = model.generate(prompt, ABLATION_TOKENS)
        text_after = model.generate(prompt, ABLATION_TOKENS, hooks=hooks)
        what = ", ".join([f"head {L}.{h}" for L, h in head_pairs] + [f"neuron {L}.{n}" for L, n in neuron_pairs])
        status = (f"{kind.capitalize()}-ablated {what}"
                  + (f" (means over {n_docs} verses of the bundled corpus)" if kind == "mean" else "") + ".")
        return (display_frame(plots.next_token_table(before, 10)), display_frame(plots.next_token_table(after, 10)),
                text_before, text_after, status)


def ablated_hooks(heads: str | None, neurons: str | None) -> list[str]:
    """The hooks an ablation of these heads (z) and neurons (MLP post) replaces, sorted."""
    return sorted({layer_hook_name(layer, "attn.hook_z") for layer, _ in parse_pairs(heads, "heads")}
                  | {layer_hook_name(layer, "mlp.hook_post") for layer, _ in parse_pairs(neurons, "neurons")})


def parse_pairs(text: str | None, what: str) -> list[tuple[int, int]]:
    """'3.1, 5.7' (or '3:1 5:7') -> [(3, 1), (5, 7)]: layer.head or layer.neuron."""
    text = (text or "").strip()
    if not text:
        return []
    pairs = re.findall(r"(\d+)\s*[.:]\s*(\d+)", text)
    leftover = re.sub(r"(\d+)\s*[.:]\s*(\d+)|[\s,;]", "", text)
    if not pairs or leftover:
        raise ValueError(f"{what}: write layer.index pairs separated by commas, e.g. '3.1, 5.7'; got {text!r}")
    return [(int(a), int(b)) for a, b in pairs]


def build_patch_tab(ctx: AppContext, source: gr.State, queues: Queues) -> None:
    """The Patch tab, inside the page's `with gr.Tabs():`. Model work shares the page's model queue; a long job's
    request waits in the "jobs" queue, never the "model" one."""
    ph = PatchHandlers(ctx)
    with gr.Tab("Patch", id="tab-patch"):
        gr.Markdown(INTRO)
        clean, corrupted = prompt_pair("patch")
        with gr.Row():
            answer = gr.Textbox(label="answer token", value=EXAMPLE_ANSWER, elem_id="patch-answer",
                                info="One token, with its leading space; empty = suggested")
            wrong = gr.Textbox(label="wrong token", value=EXAMPLE_WRONG, elem_id="patch-wrong")
            suggest_btn = gr.Button("Suggest from the first differing token", elem_id="patch-suggest")
        with gr.Row():
            site = gr.Dropdown(SITE_CHOICES, value="resid_pre", label="what to patch", elem_id="patch-site", scale=3)
            direction = gr.Radio(list(DIRECTIONS), value="denoise", label="direction", elem_id="patch-direction",
                                 info="denoise: clean into corrupted; noise: corrupted into clean")
            method = gr.Radio(METHOD_CHOICES, value="exact", label="method", elem_id="patch-method")
            fast = fast_checkbox("patch-fast", SWEEP_COST)
        with gr.Row():
            run_btn = gr.Button("Run the sweep", variant="primary", elem_id="patch-run")
            cancel_btn = gr.Button("Cancel", elem_id="patch-cancel")
        status = gr.Markdown(elem_id="patch-status")
        result = gr.State(None, time_to_live=3600)
        patch_plot = gr.Plot(show_label=False, elem_id="patch-plot")
        with gr.Row():
            cell = gr.Textbox(label="cell: layer, position[, head] (click the heatmap)", elem_id="patch-cell",
                              scale=3)
            cell_btn = gr.Button("Show this patched run", elem_id="patch-cell-show", scale=1)
        cell_text = gr.Markdown(elem_id="patch-cell-text")
        cell_top = gr.Dataframe(label="next tokens of the patched run", interactive=False, elem_id="patch-cell-top",
                                latex_delimiters=[])
        with gr.Row():
            heads_plot = gr.Plot(show_label=False, elem_id="patch-heads-plot")
            dla_plot = gr.Plot(show_label=False, elem_id="patch-dla-plot")
        dla_heads_plot = gr.Plot(show_label=False, elem_id="patch-dla-heads-plot")
        with gr.Accordion("Ablation: knock out heads or neurons of the clean prompt", open=False):
            with gr.Row():
                ablate_heads = gr.Textbox(label="heads (layer.head, ...)", value="", elem_id="patch-ablate-heads",
                                          placeholder="e.g. 14.3, 20.1")
                ablate_neurons = gr.Textbox(label="MLP neurons (layer.neuron, ...)", value="",
                                            elem_id="patch-ablate-neurons", placeholder="e.g. 5.77")
                kind = gr.Radio(["zero", "mean"], value="zero", label="replace with", elem_id="patch-ablate-kind",
                                info="mean: the unit's mean over the Corpus tab's verses (scanned once per layer)")
                ablate_btn = gr.Button("Ablate", elem_id="patch-ablate")
            ablate_status = gr.Markdown(elem_id="patch-ablate-status")
            with gr.Row():
                before_top = gr.Dataframe(label="next token, as is", interactive=False, latex_delimiters=[])
                after_top = gr.Dataframe(label="next token, ablated", interactive=False, latex_delimiters=[],
                                         elem_id="patch-ablate-top")
            with gr.Row():
                before_text = gr.Textbox(label="greedy continuation, as is", lines=3, interactive=False)
                after_text = gr.Textbox(label="greedy continuation, ablated", lines=3, interactive=False,
                                        elem_id="patch-ablate-text")

    suggest_btn.click(ph.suggest, [clean, corrupted, source], [answer, wrong], api_name="patch_suggest", **queues.model)
    swept = busy_while(run_btn, cancel_btn, lambda: run_btn.click(
        ph.sweep, [clean, corrupted, answer, wrong, site, direction, method, fast, source],
        [patch_plot, status, result, answer, wrong], api_name="patch_sweep", **queues.jobs))
    swept.success(ph.heads_and_attribution, [clean, corrupted, answer, wrong, direction, fast, source],
                  [heads_plot, dla_plot, dla_heads_plot], api_name="patch_heads", **queues.jobs)

    def cancel(request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)  # also for an API client, whose request Gradio cannot stop
        return "Cancelled."

    cancel_btn.click(cancel, None, status, cancels=[swept], api_name="patch_cancel", **queues.light)
    patch_plot.change(None, None, None, js=CLICK_JS)
    gr.on([cell_btn.click, cell.submit], ph.cell, [result, cell], [cell_top, cell_text], api_name="patch_cell",
          **queues.model)
    means = ablate_btn.click(ph.ablation_means, [ablate_heads, ablate_neurons, kind, source], ablate_status,
                             api_name="patch_ablate_means", **queues.jobs)
    ablated = means.success(ph.ablate, [clean, ablate_heads, ablate_neurons, kind, source],
                            [before_top, after_top, before_text, after_text, ablate_status], api_name="patch_ablate",
                            **queues.model)
    for step in (means, ablated):  # a refused ablation leaves no stale "Ablating...": the toast says why
        step.failure(lambda: NOT_ABLATED, None, ablate_status, api_visibility="private", **queues.light)
