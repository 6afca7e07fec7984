"""The Corpus tab: what a neuron or head responds to across the bundled corpus.

The tab shows a scan of the bundled corpus (verses of the King James Bible, slmviz.corpora.reading) by the session's
model. Each model's scan is computed once per server, by a background job the first visitor starts (others
wait for the same job, with its progress bar; Cancel leaves it, and it stops once no one waits), saved
under $SLMVIZ_SCAN_CACHE (default $SLMVIZ_CACHE/scans), and from then on read from disk or memory, never
recomputed per visitor. Its size (SLMVIZ_CORPUS_DOCS, default APP_CORPUS_DOCS verses, every k-th verse
of the whole book so all of it is represented) keeps the first scan to a few minutes on 2 cores (README,
"Corpus scans"). Pick a hook and a feature; the strips are its top activating contexts, coloured by the
feature's activation; clicking one loads its verse as the prompt. The Patch tab's mean ablation takes its
means from the same verses (`CorpusScans.means`). No torch code here: slmviz.scan and slmviz.plots.scan do
the work.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gradio as gr

from slmviz.corpora.verses import bundled_corpus
from slmviz.loading.bundled import cache_dir
from slmviz.plots.scan import STRIP_CLASS, examples_html, histogram
from slmviz.scans.scan import FORMAT_VERSION, Scan, scan

from .fast_mode import SCAN_COST, dtype_for, fast_checkbox
from .handlers import readable_errors
from .scan_jobs import RUNNER, Job, JobCancelled, Jobs, wait

APP_CORPUS_DOCS = 1000
HOOK_KINDS = ("mlp.hook_post", "attn.hook_z", "attn.hook_pattern")
TOP_K = 10  # contexts kept per feature by the tab's scan
CLICK_JS = (f"element.addEventListener('click', (e) => {{ const s = e.target.closest('.{STRIP_CLASS}'); "
            "if (s) trigger('click', {rank: Number(s.dataset.rank), doc: Number(s.dataset.doc)}); });")


def corpus_size() -> int:
    return int(os.environ.get("SLMVIZ_CORPUS_DOCS", APP_CORPUS_DOCS))


def scan_hooks(model: Any) -> list[str]:
    """An MLP, a z and a pattern hook at a quarter and at half of the depth: the forward stops at half."""
    n = model.cfg.n_layers
    layers = sorted({n // 4, n // 2})
    return [f"blocks.{layer}.{kind}" for layer in layers for kind in HOOK_KINDS]


def corpus_docs(n: int) -> list[str]:
    """Every k-th verse of the bundled corpus, n of them (deterministic: the same on every server)."""
    verses = bundled_corpus()
    step = max(1, len(verses) // n)
    return verses[::step][:n]


def scan_folder(model: Any, n: int, hooks: list[str], top_k: int = TOP_K, saes_key: str = "") -> Path:
    """The cache folder of a scan; `saes_key` names the SAEs spliced into it (their weights' fingerprint)."""
    root = Path(os.environ.get("SLMVIZ_SCAN_CACHE") or cache_dir() / "scans")
    dtype = str(getattr(model, "dtype", "torch.float32")).removeprefix("torch.")
    low_precision = [dtype] if dtype != "float32" else []  # a bf16 scan (the "fast" switch) is a scan of its own
    what = [model.name, str(model.path), hooks, n, FORMAT_VERSION] + ([top_k] if top_k != TOP_K else []) + (
        [saes_key] if saes_key else []) + low_precision
    key = hashlib.sha1(json.dumps(what).encode()).hexdigest()
    suffix = "".join(f"-{d}" for d in low_precision)
    return root / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', model.name)}-kjv{n}{suffix}-{key[:10]}"


class CorpusScans:
    """Scans of the bundled corpus, shared by every session: in memory, else on disk, else computed once.

    Each scan is a background job (app/scan_jobs.py) keyed by its cache folder: the first visitor to ask
    starts it, later visitors wait for the same job, and it holds no queue slot while it runs. `tab_scan`
    is the Corpus tab's (scan_hooks, TOP_K contexts); `means` serves the Patch tab's mean ablation, from the
    tab's scan when it covers the hooks, else from a scan of just those hooks over the same verses.
    """

    def __init__(self, jobs: Jobs | None = None) -> None:
        self.jobs = jobs if jobs is not None else Jobs()

    def join(self, model: Any, hooks: list[str], who: str, top_k: int = TOP_K, saes: tuple = (),
             saes_key: str = "") -> Job:
        """The scan of `hooks` (with `saes` spliced in, identified by `saes_key`: the Features tab's scans)."""
        n = corpus_size()
        folder = scan_folder(model, n, hooks, top_k, saes_key)

        def work(report: Callable[[float, str], None]) -> tuple[Scan, list[str]]:
            docs = corpus_docs(n)
            if _on_disk(folder):
                report(0.5, "reading the cached scan")
                return Scan.load(folder), docs
            what = f"Scanning {len(docs)} verses with {model.name} ({_layers(hooks)})"
            report(0.0, what)
            s = scan(docs, hooks=hooks, top_k=top_k, model=model, saes=list(saes) or None,
                     progress=lambda done, total: report(done / max(total or n, 1), what))
            _save_atomically(s, folder)
            return s, docs

        return self.jobs.join(folder, work, who, kind="scan")

    def finished(self, model: Any, hooks: list[str], top_k: int = TOP_K,
                 saes_key: str = "") -> tuple[Scan, list[str]] | None:
        return self.jobs.finished(scan_folder(model, corpus_size(), hooks, top_k, saes_key))

    def provide(self, model: Any, hooks: list[str], found: tuple[Scan, list[str]], top_k: int = TOP_K,
                saes_key: str = "") -> None:
        """A scan prepared elsewhere (a full transcoder set's, over its own corpus) served as this one: `join` and
        `finished` return it at once, and nothing is computed."""
        self.jobs.put(scan_folder(model, corpus_size(), hooks, top_k, saes_key), found, kind="scan")

    def tab_scan(self, model: Any, who: str) -> Job:
        return self.join(model, scan_hooks(model), who)

    def means(self, model: Any, hooks: list[str], who: str) -> Job:
        """A job whose Scan has the value mean of every hook in `hooks` (the tab's scan, if it has them)."""
        tab = scan_hooks(model)
        if set(hooks) <= set(tab) and (self.finished(model, tab) or _on_disk(scan_folder(model, corpus_size(), tab))):
            return self.join(model, tab, who)
        return self.join(model, sorted(hooks), who, top_k=1)

    def finished_means(self, model: Any, hooks: list[str]) -> tuple[Scan, list[str]] | None:
        """The finished scan `means(model, hooks)` waits for, else None."""
        tab = scan_hooks(model)
        found = self.finished(model, tab) if set(hooks) <= set(tab) else None
        return found or self.finished(model, sorted(hooks), top_k=1)


def _on_disk(folder: Path) -> bool:
    """A finished scan is saved there (_save_atomically renames a folder only once it is complete)."""
    return (folder / "scan.safetensors").is_file()


def _layers(hooks: list[str]) -> str:
    """'layers 7 and 15' for the progress line (the hook names are in the tab's dropdown)."""
    layers = sorted({int(h.split(".")[1]) for h in hooks if h.startswith("blocks.")})
    if not layers:
        return ", ".join(hooks)
    return ("layer " if len(layers) == 1 else "layers ") + " and ".join(map(str, layers))


def _save_atomically(s: Scan, folder: Path) -> None:
    """Write into a temporary sibling, then rename: a half-written scan is never read as a cached one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    s.save(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)


SCANS = CorpusScans(RUNNER)  # queued with every other long job of the server (app/scan_jobs.py)


def session(request: gr.Request | None) -> str:
    """Who waits for a scan: the Gradio session (one browser tab, or one gradio_client)."""
    return getattr(request, "session_hash", None) or "anonymous"


def strongest(s: Scan, hook: str, k: int = 8) -> list[int]:
    return [int(i) for i in s.max(hook).nan_to_num(float("-inf")).topk(min(k, s.max(hook).numel())).indices]


def build_corpus_tab(handlers: Any, prompt: gr.Textbox, source: gr.State, model_kw: dict, light_kw: dict,
                     scan_kw: dict) -> None:
    """The "Corpus" tab, built inside the page's gr.Tabs; `prompt` is the page's prompt box (clicks fill it),
    `source` the session's model. Waiting for a scan runs in its own queue (`scan_kw`): the scan itself is a
    background job, so neither holds up other visitors' model requests."""
    model = handlers.store.get()
    hooks = scan_hooks(model)
    with gr.Tab("Corpus", id="tab-corpus") as tab:
        gr.Markdown(
            f"Top activating contexts of one feature across {corpus_size()} verses of the King James Bible "
            "(every k-th verse), scanned once per model and cached; the first visit computes it. A feature is "
            "an MLP neuron, a head's ‖z‖, or a head's strongest attention to an earlier token (not the first). "
            "Click a strip to load its verse as the prompt.")
        with gr.Row():
            hook = gr.Dropdown(hooks, value=hooks[0], label="hook", elem_id="corpus-hook", scale=3)
            feature = gr.Number(value=0, precision=0, minimum=0, label="feature", elem_id="corpus-feature", scale=1)
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
        m = handlers.model(source_name, dtype=dtype_for(fast_scan))
        running = ("Scanning the corpus (its first visit computes the scan; everyone else's requests go on). "
                   "**Cancel** stops waiting.", gr.skip(), gr.skip(), gr.skip(), gr.skip())
        s, docs = yield from wait_for_scan(lambda who: SCANS.tab_scan(m, who), session(request), progress, 5, running)
        names = scan_hooks(m)
        hook_name = hook_name if hook_name in names else names[0]
        best = strongest(s, hook_name)
        yield (_status(s, hook_name, best, fast_scan), gr.Dropdown(choices=names, value=hook_name), best[0],
               examples_html(s, hook_name, best[0], docs), histogram(s, hook_name, best[0]))

    @readable_errors
    def show(hook_name: str, index: float | None, source_name: str | None, fast_scan: bool | None):
        s, docs = _tab_scan(handlers.model(source_name, dtype=dtype_for(fast_scan)))
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
        names = scan_hooks(handlers.model(source_name))
        return (gr.Dropdown(choices=names, value=names[0]), "Model changed: press **Load the scan** to see its "
                "corpus scan (the first visit computes it).", "", None)

    outputs = [status, hook, feature, strips, hist]
    shown = {"show_progress_on": strips}  # one progress bar, where the strips will appear
    opened = [tab.select(load, [hook, source, fast], outputs, api_name="corpus_load", **shown, **scan_kw),
              hook.input(load, [hook, source, fast], outputs, api_name="corpus_hook", **shown, **scan_kw),
              load_btn.click(load, [hook, source, fast], outputs, api_name="corpus_reload", **shown, **scan_kw),
              fast.input(load, [hook, source, fast], outputs, api_name="corpus_fast", **shown, **scan_kw)]
    cancel_btn.click(cancel, None, status, cancels=opened, api_name="corpus_cancel", **light_kw)
    source.change(model_changed, source, [hook, status, strips, hist], api_visibility="private", **light_kw)
    gr.on([show_btn.click, feature.submit], show, [hook, feature, source, fast], [status, strips, hist],
          api_name="corpus_show", **light_kw)
    strips.click(pick, source, prompt, api_name="corpus_pick", **light_kw)


def wait_for_scan(start: Callable[[str], Job], who: str, progress: Any, n_outputs: int,
                  running: Any = None) -> Iterator[Any]:
    """Join (or start) a scan job and wait for it, yielding `running` first if it is not done yet (e.g. a status
    line) and no-op updates of the n outputs meanwhile; return its (Scan, docs)."""
    job = start(who)
    if running is not None and not job.done.is_set():
        yield running
    try:
        yield from _no_updates(wait(job, who, progress), n_outputs)
    except JobCancelled:
        raise gr.Error("The scan was cancelled; press Load the scan to start it again") from None
    return job.result


def _no_updates(ticks: Iterator[None], n: int) -> Iterator[Any]:
    for _ in ticks:
        yield gr.skip() if n == 1 else tuple(gr.skip() for _ in range(n))


def _tab_scan(model: Any) -> tuple[Scan, list[str]]:
    found = SCANS.finished(model, scan_hooks(model))
    if found is None:
        raise gr.Error(f"The corpus scan of {model.name} is not loaded yet: press Load the scan")
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
