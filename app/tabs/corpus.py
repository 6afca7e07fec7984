"""The Corpus tab: what a neuron or head responds to across the bundled corpus.

The tab shows a scan of the bundled corpus (verses of the King James Bible, slmviz.corpora.verses) by the session's
model, app/scans.py's: computed once per server by a background job the first visitor starts (others wait for the
same job, with its progress bar; Cancel leaves it, and it stops once no one waits), then read from disk or memory,
never recomputed per visitor. Its size (SLMVIZ_CORPUS_DOCS, default APP_CORPUS_DOCS verses, every k-th verse
of the whole book so all of it is represented) keeps the first scan to a few minutes on 2 cores (README,
"Corpus scans"). Pick a hook and a feature; the strips are its top activating contexts, coloured by the
feature's activation; clicking one loads its verse as the prompt. The Patch tab's mean ablation takes its
means from the same verses (`CorpusScans.means`). No torch code here: slmviz.scan and slmviz.plots.scan do
the work.
"""

from __future__ import annotations

from typing import Any

import gradio as gr

from slmviz import Scan
from slmviz.hooks import layer_of
from slmviz.plots.scan import STRIP_CLASS, examples_html, histogram

from ..fast_mode import SCAN_COST, dtype_for, fast_checkbox
from ..models import AppContext
from ..scans import SCANS, all_hooks, corpus_docs, corpus_size, hooks_for, scan_hooks, wait_for_scan
from ..shared import Queues, guard_number, html_click_js, readable_errors, session

CLICK_JS = html_click_js(STRIP_CLASS, "rank", "doc")  # a strip's click: its rank and verse


def strongest(s: Scan, hook: str, k: int = 8) -> list[int]:
    return [int(i) for i in s.max(hook).nan_to_num(float("-inf")).topk(min(k, s.max(hook).numel())).indices]


def build_corpus_tab(ctx: AppContext, prompt: gr.Textbox, source: gr.State, queues: Queues) -> None:
    """The "Corpus" tab, built inside the page's gr.Tabs; `prompt` is the page's prompt box (clicks fill it),
    `source` the session's model. Waiting for a scan runs in its own queue (`queues.jobs`): the scan itself is a
    background job, so neither holds up other visitors' model requests."""
    model = ctx.store.get()
    hooks = all_hooks(model)
    first = " and ".join(map(str, sorted({layer_of(h) for h in scan_hooks(model)})))
    with gr.Tab("Corpus", id="tab-corpus") as tab:
        gr.Markdown(
            f"Top activating contexts of one feature across {corpus_size()} verses of the King James Bible "
            "(every k-th verse), scanned once per model and cached; the first visit computes it. A feature is "
            "an MLP neuron, a head's ‖z‖, or a head's strongest attention to an earlier token (not the first). "
            f"Every layer can be picked: layers {first} "
            "are scanned first, any other layer when you pick it (with its progress). "
            "Click a strip to load its verse as the prompt.")
        with gr.Row():
            hook = gr.Dropdown(hooks, value=hooks[0], label="hook", elem_id="corpus-hook", scale=3)
            feature = gr.Number(value=0, precision=0, label="feature", elem_id="corpus-feature", scale=1)
            guard_number(feature, "The feature", lo=0, whole=True)
            show_btn = gr.Button("Show", elem_id="corpus-show", scale=1)
            load_btn = gr.Button("Load the scan", elem_id="corpus-load", scale=1)
            cancel_btn = gr.Button("Cancel", elem_id="corpus-cancel", scale=1)
        fast = fast_checkbox("corpus-fast", SCAN_COST)
        status = gr.Markdown("Open this tab to load the scan (the first visit computes it).", elem_id="corpus-status")
        with gr.Row():
            with gr.Column(scale=3):
                strips = gr.HTML(elem_id="corpus-examples", js_on_load=CLICK_JS)
            with gr.Column(scale=2):
                hist = gr.Plot(show_label=False, elem_id="corpus-histogram")

    @readable_errors
    def load(hook_name: str, source_name: str | None, fast_scan: bool | None, request: gr.Request,
             progress=gr.Progress()):  # noqa: B008 - gradio reads this default
        m = ctx.model(source_name, dtype=dtype_for(fast_scan))
        names = all_hooks(m)
        hook_name = hook_name if hook_name in names else names[0]
        layer = layer_of(hook_name)
        running = (f"Scanning the corpus at layer {layer} (once per model and layer; everyone else's requests go "
                   "on). **Cancel** stops waiting.", gr.skip(), gr.skip(), gr.skip(), gr.skip())
        s, docs = yield from wait_for_scan(lambda who: SCANS.hook_scan(m, hook_name, who), session(request),
                                           progress, 5, running)
        best = strongest(s, hook_name)
        yield (_status(s, hook_name, best, fast_scan), gr.Dropdown(choices=names, value=hook_name), best[0],
               examples_html(s, hook_name, best[0], docs), histogram(s, hook_name, best[0]))

    @readable_errors
    def show(hook_name: str, index: float | None, source_name: str | None, fast_scan: bool | None):
        s, docs = _hook_scan(ctx.model(source_name, dtype=dtype_for(fast_scan)), hook_name)
        i = _index(s, hook_name, index)
        return _status(s, hook_name, strongest(s, hook_name), fast_scan), examples_html(s, hook_name, i, docs), \
            histogram(s, hook_name, i)

    @readable_errors
    def pick(evt: gr.EventData, source_name: str | None):
        docs = corpus_docs(corpus_size())  # the same verses in either precision
        doc = int(getattr(evt, "doc", -1))
        if not 0 <= doc < len(docs):
            raise gr.Error("Click a strip to load its verse")
        return docs[doc]

    def cancel(request: gr.Request) -> str:
        SCANS.jobs.leave(session(request), kind="scan")
        return "Cancelled. The scan stops unless another visitor is waiting for it; press **Load the scan** to " \
               "start again."

    def model_changed(source_name: str | None):
        names = all_hooks(ctx.model(source_name))
        return (gr.Dropdown(choices=names, value=names[0]), "Model changed: press **Load the scan** to see its "
                "corpus scan (the first visit computes it).", "", None)

    outputs = [status, hook, feature, strips, hist]
    shown = {"show_progress_on": strips}  # one progress bar, where the strips will appear
    opened = [tab.select(load, [hook, source, fast], outputs, api_name="corpus_load", **shown, **queues.jobs),
              hook.input(load, [hook, source, fast], outputs, api_name="corpus_hook", **shown, **queues.jobs),
              load_btn.click(load, [hook, source, fast], outputs, api_name="corpus_reload", **shown, **queues.jobs),
              fast.input(load, [hook, source, fast], outputs, api_name="corpus_fast", **shown, **queues.jobs)]
    cancel_btn.click(cancel, None, status, cancels=opened, api_name="corpus_cancel", **queues.light)
    source.change(model_changed, source, [hook, status, strips, hist], api_visibility="private", **queues.light)
    gr.on([show_btn.click, feature.submit], show, [hook, feature, source, fast], [status, strips, hist],
          api_name="corpus_show", **queues.light)
    strips.click(pick, source, prompt, api_name="corpus_pick", **queues.light)


def _hook_scan(model: Any, hook: str) -> tuple[Scan, list[str]]:
    if hook not in all_hooks(model):
        raise gr.Error(f"{hook!r} is not one of {model.name}'s hooks here: pick one from the list")
    found = SCANS.finished(model, hooks_for(model, hook))
    if found is None:
        raise gr.Error(f"The corpus scan of {model.name} at {hook} is not loaded yet: press Load the scan")
    return found


def _index(s: Scan, hook: str, index: float | None) -> int:
    n = s.features[hook]["n"]
    i = int(index or 0)
    if not 0 <= i < n:
        raise gr.Error(f"feature must be between 0 and {n - 1} for {hook}")
    return i


def _status(s: Scan, hook: str, best: list[int], fast: bool | None = False) -> str:
    i = s.info
    precision = "bf16 " if fast else ""
    return (f"{precision}Scan of {i['documents']} verses ({i['tokens']} tokens) in {i['seconds']:.0f} s "
            f"({i['tokens_per_s']:.0f} tokens/s). **{hook}**: {s.features[hook]['n']} features "
            f"({s.features[hook]['what']}); hardest-firing: {', '.join(map(str, best))}.")
