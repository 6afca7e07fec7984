"""Scans of the bundled corpus, shared by every tab and session: the Corpus tab's, the Patch tab's means for mean
ablation, and the feature scans behind the Features tab's cards.

The corpus is the King James Bible's verses (slmviz.corpora.verses), every k-th one so all of it is represented:
SLMVIZ_CORPUS_DOCS of them (default APP_CORPUS_DOCS, which keeps a first scan to a few minutes on 2 cores). Each
scan is computed once per server by a long job of app/jobs.py (the first visitor starts it, others wait for the
same job), saved under $SLMVIZ_SCAN_CACHE (default $SLMVIZ_CACHE/scans), and from then on read from disk or
memory, never recomputed per visitor.
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

from slmviz import Scan
from slmviz import scan as scan_corpus
from slmviz.corpora.verses import bundled_corpus
from slmviz.hooks import layer_hook_name, layer_of
from slmviz.loading.bundled import cache_dir
from slmviz.progress import Progress
from slmviz.scans.scan import FORMAT_VERSION

from .jobs import RUNNER, Job, Jobs
from .shared import skips, wait_or_say

APP_CORPUS_DOCS = 1000
HOOK_KINDS = ("mlp.hook_post", "attn.hook_z", "attn.hook_pattern")
TOP_K = 10  # contexts kept per feature by the Corpus tab's scan
SCAN_CANCELLED = "The scan was cancelled; press Load the scan to start it again"


def corpus_size() -> int:
    return int(os.environ.get("SLMVIZ_CORPUS_DOCS", APP_CORPUS_DOCS))


def scan_hooks(model: Any) -> list[str]:
    """An MLP, a z and a pattern hook at a quarter and at half of the depth: the forward stops at half."""
    n = model.cfg.n_layers
    layers = sorted({n // 4, n // 2})
    return [layer_hook_name(layer, kind) for layer in layers for kind in HOOK_KINDS]


def all_hooks(model: Any) -> list[str]:
    """Every layer's MLP, z and pattern hook, as the Corpus tab offers them (the tab scan's layers first)."""
    first = scan_hooks(model)
    every = [layer_hook_name(layer, kind) for layer in range(model.cfg.n_layers) for kind in HOOK_KINDS]
    return first + [h for h in every if h not in first]


def hooks_for(model: Any, hook: str) -> list[str]:
    """The hooks scanned together with `hook`: the tab scan's when it is one of them, else its layer's three (a
    scan on demand: the forward stops after that layer)."""
    if hook in scan_hooks(model):
        return scan_hooks(model)
    layer = layer_of(hook)
    return [layer_hook_name(layer, kind) for kind in HOOK_KINDS]


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

    Each scan is a background job (app/jobs.py) keyed by its cache folder: the first visitor to ask
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

        def work(progress: Progress) -> tuple[Scan, list[str]]:
            docs = corpus_docs(n)
            if _on_disk(folder):
                progress.say("reading the cached scan")
                return Scan.load(folder), docs
            scanned = progress.part(f"Scanning {len(docs)} verses with {model.name} ({_layers(hooks)})", 1.0)
            scanned.say("")
            s = scan_corpus(docs, hooks=hooks, top_k=top_k, model=model, saes=list(saes) or None, progress=scanned)
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

    def hook_scan(self, model: Any, hook: str, who: str) -> Job:
        """The scan that holds `hook` (hooks_for): the tab scan, or its layer's, started on demand."""
        return self.join(model, hooks_for(model, hook), who)

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
    layers = sorted({layer_of(h) for h in hooks if h.startswith("blocks.")})
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


SCANS = CorpusScans(RUNNER)  # queued with every other long job of the server (app/jobs.py)


def wait_for_scan(start: Callable[[str], Job], who: str, progress: Any, n_outputs: int, running: Any = None,
                  cancelled: str = SCAN_CANCELLED) -> Iterator[Any]:
    """Join (or start) a scan job and wait for it, yielding `running` first if it is not done yet (e.g. a status
    line) and no-op updates of the n outputs meanwhile; return its (Scan, docs). A cancelled scan ends the
    request with the toast `cancelled`."""
    job = start(who)
    if running is not None and not job.done.is_set():
        yield running
    for _ in wait_or_say(job, who, progress, cancelled):
        yield skips(n_outputs)
    return job.result
