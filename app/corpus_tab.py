"""The Corpus tab: what a neuron or head responds to across the bundled corpus.

The tab reads ONE scan of the bundled corpus (verses of the King James Bible, slmviz.corpus) by the startup
model, computed by the first visitor who opens the tab (with a progress bar), saved under
$SLMVIZ_SCAN_CACHE (default $SLMVIZ_CACHE/scans) and from then on read from disk or memory, never
recomputed per visitor. Its size (SLMVIZ_CORPUS_DOCS, default APP_CORPUS_DOCS verses, every k-th verse
of the whole book so all of it is represented) keeps the first scan to a few minutes on 2 cores (README,
"Corpus scans"). Pick a hook and a feature; the strips are its top activating contexts, coloured by the
feature's activation; clicking one loads its verse as the prompt. No torch code here: slmviz.scan and
slmviz.scan_plots do the work.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import gradio as gr

from app.handlers import readable_errors
from slmviz.bundled import cache_dir
from slmviz.corpus import bundled_corpus
from slmviz.scan import FORMAT_VERSION, Scan, scan
from slmviz.scan_plots import STRIP_CLASS, examples_html, histogram

APP_CORPUS_DOCS = 1000
HOOK_KINDS = ("mlp.hook_post", "attn.hook_z", "attn.hook_pattern")
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


def scan_folder(model: Any, n: int, hooks: list[str]) -> Path:
    root = Path(os.environ.get("SLMVIZ_SCAN_CACHE") or cache_dir() / "scans")
    key = hashlib.sha1(json.dumps([model.name, str(model.path), hooks, n, FORMAT_VERSION]).encode()).hexdigest()
    return root / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', model.name)}-kjv{n}-{key[:10]}"


class CorpusScans:
    """The one scan this server shows, shared by every session: in memory, else on disk, else computed once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scans: dict[Path, tuple[Scan, list[str]]] = {}

    def get(self, model: Any, progress: Any = None) -> tuple[Scan, list[str]]:
        n, hooks = corpus_size(), scan_hooks(model)
        folder = scan_folder(model, n, hooks)
        with self._lock:  # a second visitor during the first scan waits for it instead of starting another
            if folder not in self._scans:
                docs = corpus_docs(n)
                if (folder / "scan.safetensors").is_file():
                    s = Scan.load(folder)
                else:
                    report = (lambda done, total: progress(done / max(total or n, 1), desc=f"scanning {total} verses")
                              ) if progress else False
                    s = scan(docs, hooks=hooks, top_k=10, model=model, progress=report)
                    _save_atomically(s, folder)
                self._scans[folder] = (s, docs)
            return self._scans[folder]


def _save_atomically(s: Scan, folder: Path) -> None:
    """Write into a temporary sibling, then rename: a half-written scan is never read as a cached one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    s.save(tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)


SCANS = CorpusScans()


def strongest(s: Scan, hook: str, k: int = 8) -> list[int]:
    return [int(i) for i in s.max(hook).nan_to_num(float("-inf")).topk(min(k, s.max(hook).numel())).indices]


def build_corpus_tab(handlers: Any, prompt: gr.Textbox, model_kw: dict, light_kw: dict) -> None:
    """The "Corpus" tab, built inside the page's gr.Tabs; `prompt` is the page's prompt box (clicks fill it)."""
    model = handlers.store.get()
    hooks = scan_hooks(model)
    with gr.Tab("Corpus", id="tab-corpus") as tab:
        gr.Markdown(
            f"Top activating contexts of one feature across {corpus_size()} verses of the King James Bible "
            f"(every k-th verse), scanned once by **{model.name}** and cached. A feature is an MLP neuron, "
            "a head's ‖z‖, or a head's strongest attention to an earlier token (not the first). "
            "Click a strip to load its verse as the prompt.")
        with gr.Row():
            hook = gr.Dropdown(hooks, value=hooks[0], label="hook", elem_id="corpus-hook", scale=3)
            feature = gr.Number(value=0, precision=0, minimum=0, label="feature", elem_id="corpus-feature", scale=1)
            show_btn = gr.Button("Show", elem_id="corpus-show", scale=1)
        status = gr.Markdown("Open this tab to load the scan (the first visit computes it).", elem_id="corpus-status")
        with gr.Row():
            with gr.Column(scale=3):
                strips = gr.HTML(elem_id="corpus-examples", js_on_load=CLICK_JS)
            with gr.Column(scale=2):
                hist = gr.Plot(show_label=False, elem_id="corpus-histogram")

    @readable_errors
    def load(hook_name: str, progress=gr.Progress()):  # noqa: B008 - gradio reads this default
        s, docs = SCANS.get(handlers.store.get(), progress)
        best = strongest(s, hook_name)
        return (_status(s, hook_name, best), best[0], examples_html(s, hook_name, best[0], docs),
                histogram(s, hook_name, best[0]))

    @readable_errors
    def show(hook_name: str, index: float | None):
        s, docs = SCANS.get(handlers.store.get())
        i = _index(s, hook_name, index)
        return _status(s, hook_name, strongest(s, hook_name)), examples_html(s, hook_name, i, docs), \
            histogram(s, hook_name, i)

    @readable_errors
    def pick(evt: gr.EventData):
        _, docs = SCANS.get(handlers.store.get())
        doc = int(getattr(evt, "doc", -1))
        if not 0 <= doc < len(docs):
            raise gr.Error("Click a strip to load its verse")
        return docs[doc]

    tab.select(load, [hook], [status, feature, strips, hist], api_name="corpus_load", **model_kw)
    hook.input(load, [hook], [status, feature, strips, hist], api_name="corpus_hook", **model_kw)
    gr.on([show_btn.click, feature.submit], show, [hook, feature], [status, strips, hist], api_name="corpus_show",
          **light_kw)
    strips.click(pick, None, prompt, api_name="corpus_pick", **light_kw)


def _index(s: Scan, hook: str, index: float | None) -> int:
    n = s.features[hook]["n"]
    i = int(index or 0)
    if not 0 <= i < n:
        raise gr.Error(f"feature must be between 0 and {n - 1} for {hook}")
    return i


def _status(s: Scan, hook: str, best: list[int]) -> str:
    i = s.info
    return (f"Scan of {i['documents']} verses ({i['tokens']} tokens) in {i['seconds']:.0f} s "
            f"({i['tokens_per_s']:.0f} tokens/s). **{hook}**: {s.features[hook]['n']} features "
            f"({s.features[hook]['what']}); hardest-firing: {', '.join(map(str, best))}.")
