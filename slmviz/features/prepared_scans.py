"""The feature scans prepared once into $SLMVIZ_CACHE, so that a feature card shows its top contexts at once: the scan
of a model's prepared transcoder set (every coder spliced at once; kept in the set's folder, `scan/`), and the scans
of its bundled SAEs (kept per SAE with the digest of the weights they were made with).

Every scan reads the same documents (`scan_docs`): the first SCAN_DOCS documents of the held-out split of the set's
corpus, each cut to its first SCAN_CHARS characters (the broad corpus's documents are whole source files), with
SCAN_TOP_K contexts per feature. What bounds them: a scan costs per token and per coder (the features' histograms
and top-k), so a set of 30 coders over 1,000 whole documents would take hours where 200 cut ones take minutes, and
at an L0 of 64 over 4,096 features a feature still fires hundreds of times in them: enough for its top 10 contexts
(docs/features.md, "Full transcoder sets").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..formats.files import swap_in_folder
from ..hooks import layer_of
from ..loading.bundled import cache_dir, prepared_dir
from ..progress import ProgressLike, ProgressUpdate
from ..scans.scan import ScanFormatError

CORPUS = "mixed"  # the corpus the prepared sets train on (training.prepare), whose held-out split the scans read
SCAN_DOCS, SCAN_CHARS, SCAN_TOP_K, SCAN_FOLDER = 200, 400, 10, "scan"


def scan_docs(model: Any, corpus: Any = CORPUS, n: int = SCAN_DOCS, chars: int = SCAN_CHARS) -> list[str]:
    """The documents a prepared scan reads: the first `n` of the corpus's held-out split (a corpus name), or of the
    file or list given, each cut to its first `chars` characters."""
    from ..corpora.named import resolve_corpus
    from ..corpora.reading import iter_documents

    return [doc[:chars] for doc in iter_documents(resolve_corpus(corpus, model, split="heldout"), limit=n)]


def prepare_set_scan(model: Any, ts: Any, kind: str = "plt", corpus: Any = CORPUS, n_docs: int = SCAN_DOCS,
                     progress: ProgressLike = True) -> tuple[Any, list[str]]:
    """The feature scan of every coder of the prepared set `ts` (slmviz.scan, the set spliced: error terms on, so
    each coder reads the model's own input, as when scanned alone), kept beside the set in
    $SLMVIZ_CACHE/transcoders/{model}/{kind}/scan with the documents it read; computed once, then read. A scan
    there that cannot be read (damaged) is computed again and swapped in whole: a scan stopped mid-way (an
    exception from `progress`, a crash) leaves the old folder as it was.
    Returns (Scan, docs): what a feature card takes (features.dashboard.feature_card(scan=, docs=))."""
    try:
        found = load_set_scan(model, kind)
    except ScanFormatError:
        found = None  # damaged: written again below
    if found is not None:
        return found
    docs = scan_docs(model, corpus, n_docs)
    s = _scan(model, list(ts), docs, progress)
    _save_scan(s, docs, set_scan_dir(model, kind))
    return s, docs


def set_scan_dir(model: Any, kind: str = "plt") -> Path:
    """Where the scan of the model's prepared `kind` set is kept: $SLMVIZ_CACHE/transcoders/{model}/{kind}/scan."""
    return prepared_dir(model, kind) / SCAN_FOLDER


def load_set_scan(model: Any, kind: str = "plt", deep: bool | None = None) -> tuple[Any, list[str]] | None:
    """(Scan, docs) prepared with the model's `kind` set: its deep scan once there is one (deep=None, the default;
    `scan.n_tokens` says how many tokens it read, `set_scan_source` which it is), else its small scan; None when
    there is none yet. deep=True / False: that one only. A scan there that cannot be read raises ScanFormatError,
    saying why (prepare_set_scan / prepare_deep_scan write it again)."""
    if deep is not False:
        found = _load_scan(deep_scan_dir(model, kind))
        if found is not None or deep:
            return found
    return _load_scan(set_scan_dir(model, kind))


def deep_scan_dir(model: Any, kind: str = "plt") -> Path:
    """Where the deep scan of the model's prepared `kind` set is kept, beside the small one."""
    from .deep_scan import DEEP_FOLDER

    return prepared_dir(model, kind) / DEEP_FOLDER


def set_scan_source(model: Any, kind: str = "plt") -> str | None:
    """Which scan load_set_scan reads for the set: "deep", "small", or None (none yet). By the files present
    (cheap: the app asks before every card); a damaged one still counts, and loading it says so."""
    for name, folder in (("deep", deep_scan_dir(model, kind)), ("small", set_scan_dir(model, kind))):
        if (folder / "scan.safetensors").is_file() and (folder / "docs.json").is_file():
            return name
    return None


def prepare_deep_scan(model: Any, ts: Any, kind: str = "plt", tokens: int | None = None, corpus: Any = CORPUS,
                      progress: ProgressLike = True, batch_tokens: int | None = None) -> tuple[Any, list[str]]:
    """The deep scan of the prepared set `ts` (features.deep_scan: at least `tokens`, default DEEP_TOKENS, of the
    set's own kind of text, with labels and their measured scores), kept in deep_scan_dir; computed once, then read.
    Resumable: a run that stopped (Cancel, a crash) goes on from the last shard it wrote. A deep scan there that
    cannot be read is computed again and swapped in whole. Returns (Scan, docs)."""
    from .deep_scan import DEEP_BATCH_TOKENS, DEEP_TOKENS, run_deep_scan

    tokens = DEEP_TOKENS if tokens is None else int(tokens)
    try:
        found = load_set_scan(model, kind, deep=True)
    except ScanFormatError:
        found = None  # damaged: written again below
    if found is not None and found[0].n_tokens >= tokens:
        return found
    coders = getattr(ts, "coders", None)
    if coders is None:  # a list of transcoders: each at the layer it reads
        coders = {layer_of(c.hook_name): c for c in ts}
    return run_deep_scan(model, coders, deep_scan_dir(model, kind), corpus, tokens=tokens,
                         batch_tokens=batch_tokens or DEEP_BATCH_TOKENS, progress=progress)


def load_deep_labels(model: Any, kind: str = "plt") -> Any:
    """The deep scan's LabelTable (labels and their scores) for the model's `kind` set, or None before it exists;
    ScanFormatError where it cannot be read."""
    from .deep_scan import LabelTable

    folder = deep_scan_dir(model, kind)
    if not (folder / "labels.parquet").is_file():
        return None
    try:
        return LabelTable.load(folder)
    except Exception as e:  # noqa: BLE001 - pyarrow and json each raise their own
        raise ScanFormatError(f"the deep scan's labels in {folder} could not be read ({type(e).__name__}: {e})") from e


def sae_scan_dir(model: Any, name: str) -> Path:
    """Where a bundled SAE's prepared feature scan is kept: $SLMVIZ_CACHE/feature_scans/{model}/{name}."""
    model_name = model if isinstance(model, str) else str(getattr(model, "name", ""))
    return cache_dir() / "feature_scans" / model_name / name


def weights_digest(sae: Any) -> str:
    """sha1 of an SAE's tensors: a prepared scan is read only for the weights it was made with."""
    h = hashlib.sha1()
    for name, tensor in sorted(sae.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def prepare_sae_scans(model: Any, saes: dict[str, Any] | None = None, corpus: Any = CORPUS, n_docs: int = SCAN_DOCS,
                      progress: ProgressLike = True) -> dict[str, Path]:
    """The feature scan of each SAE in `saes` ({name: SAE}; default: the model's bundled ones) over the same
    documents as a set's scan (scan_docs), kept in sae_scan_dir with its weights' digest; computed once per
    weights (and again when the one there cannot be read). Returns {name: folder}."""
    from .bundled import bundled_saes
    from .load import load_sae

    if saes is None:
        saes = {name: load_sae(name, model=model) for name in bundled_saes(model)}
    docs = None
    for name, sae in saes.items():
        try:
            found = load_sae_scan(model, name, sae)
        except ScanFormatError:
            found = None  # damaged: written again
        if found is None:
            docs = docs if docs is not None else scan_docs(model, corpus, n_docs)
            _save_scan(_scan(model, [sae], docs, progress), docs, sae_scan_dir(model, name),
                       weights=weights_digest(sae))
    return {name: sae_scan_dir(model, name) for name in saes}


def load_sae_scan(model: Any, name: str, sae: Any) -> tuple[Any, list[str]] | None:
    """(Scan, docs) prepared for the SAE `name` with these weights, or None (none yet, or other weights);
    ScanFormatError when it is there but cannot be read."""
    folder = sae_scan_dir(model, name)
    try:
        made_for = json.loads((folder / "weights.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return _load_scan(folder) if made_for == weights_digest(sae) else None


def _scan(model: Any, coders: list[Any], docs: list[str], progress: Any) -> Any:
    """slmviz.scan of `docs` with `coders` spliced, over each coder's feature activations."""
    from ..scans.scan import scan
    from .dashboard import acts_hook

    return scan(docs, hooks=[acts_hook(c) for c in coders], saes=coders, model=model, top_k=SCAN_TOP_K,
                progress=progress)


def _save_scan(s: Any, docs: list[str], folder: Path, weights: str | None = None) -> None:
    """The scan, its documents (and the weights it was made with) written aside, then swapped into `folder`
    (_swap_in): a half-written scan is never read, and a write that fails leaves the old folder as it was. An
    older one there (other weights, or damaged) is replaced."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        s.save(tmp)
        (tmp / "docs.json").write_text(json.dumps(docs), encoding="utf-8")
        if weights is not None:
            (tmp / "weights.json").write_text(json.dumps(weights), encoding="utf-8")
    except BaseException:  # a full disk, a KeyboardInterrupt: nothing half-written stays beside the scan
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in_folder(tmp, folder)


def _load_scan(folder: Path) -> tuple[Any, list[str]] | None:
    """(Scan, docs) saved in `folder`, None when none is there; ScanFormatError when its files are there but cannot
    be read (truncated, overwritten, from another format): whatever the readers raise, one error that says where."""
    from ..scans.scan import Scan

    if not (folder / "scan.safetensors").is_file() or not (folder / "docs.json").is_file():
        return None
    try:
        docs = json.loads((folder / "docs.json").read_text(encoding="utf-8"))
        if not isinstance(docs, list) or not all(isinstance(d, str) for d in docs):
            raise ValueError("docs.json is not a list of documents")
        return Scan.load(folder), docs
    except Exception as e:  # noqa: BLE001 - safetensors, pyarrow and json each raise their own
        raise ScanFormatError(f"the prepared scan in {folder} could not be read ({type(e).__name__}: {e})") from e


BACKGROUND_NICE = 10  # a background deep scan's thread yields the cores to the app's requests


# --- the set's own corpus, and the deep scan in the background (here, above features.deep_scan, which it runs) ----
def set_corpus(model: Any, kind: str) -> Any:
    """The corpus the model's prepared `kind` set was trained on, which its deep scan reads: the name (or file) its
    transcoder_set.json records ("quick", "mixed", ...); prepared_scans.CORPUS when it records none; None for a set
    trained on a list of texts (recorded as "custom": nothing to read again).

    Why not always CORPUS ("mixed"): the quick set trains on "quick", six of the model's chat seeds; reading "mixed"
    would first write the other eighty-nine (about an hour on this CPU) for text the set never trained on."""
    from ..corpora.named import NAMES
    from ..loading.bundled import prepared_dir

    try:
        meta = json.loads((prepared_dir(model, kind) / "transcoder_set.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return CORPUS
    name = (meta.get("metadata") or {}).get("corpus_name", CORPUS)
    if name == "custom":
        return None
    return name if name in NAMES or Path(str(name)).is_file() else CORPUS


class DeepScanCancelled(Exception):
    """Raised inside a background deep scan at its next progress report once it is cancelled (it resumes later)."""


class BackgroundDeepScan:
    """The deep scan of the model's prepared `kind` set (prepared_scans.prepare_deep_scan: resumable, cached) in a
    daemon thread of its own, so the first graph never waits for it and no request queue holds it:

        job = BackgroundDeepScan(m, ts, "plt-quick", on_done=use_it).start()
        job.status()     # "deep scan 123,456 / 1,000,000 tok · 180 tok/s · 1h 20m left"
        job.cancel()     # stops at its next progress report (every batch); the next start resumes it

    Progress is slmviz.progress's: `update` is the latest ProgressUpdate, and `progress` (a sink) sees each one too.
    The thread runs at nice BACKGROUND_NICE (Linux: the calling thread only; torch's own worker threads, if any, keep
    theirs), so the app's requests get the cores first. Another process scanning the same set makes the run end
    with DeepScanBusy as its `error` (nothing lost: that one finishes it). `on_done(Scan, docs)` runs in the thread
    once the scan is there."""

    def __init__(self, model: Any, ts: Any, kind: str, corpus: Any = None, tokens: int | None = None,
                 on_done: Callable[[tuple[Any, list[str]]], None] | None = None,
                 progress: Callable[[ProgressUpdate], None] | None = None):
        self.model, self.ts, self.kind = model, ts, kind
        self.corpus = set_corpus(model, kind) if corpus is None else corpus
        self.tokens, self.on_done, self.progress = tokens, on_done, progress
        self.update: ProgressUpdate | None = None
        self.result: tuple[Any, list[str]] | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.done = threading.Event()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._work, name=f"deep scan {kind}", daemon=True)

    def start(self) -> BackgroundDeepScan:
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Stop at the next progress report; what the finished shards scanned is kept, and a new start resumes."""
        self._cancel.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def status(self) -> str:
        """One line for a person: where it is, done, cancelled or why it stopped."""
        if self.result is not None:
            return f"deep scan done: {self.result[0].n_tokens:,} tokens"
        if self.cancelled:
            return "deep scan cancelled; it resumes from its last finished shard when started again"
        if self.error is not None:
            return f"deep scan stopped: {type(self.error).__name__}: {self.error}"
        if self.update is None:
            return "deep scan starting"
        return self.update.text()

    def _sink(self, update: ProgressUpdate) -> None:
        self.update = update
        if self.progress is not None:
            self.progress(update)
        if self._cancel.is_set():
            raise DeepScanCancelled("the deep scan was cancelled")

    def _work(self) -> None:
        with contextlib.suppress(AttributeError, OSError):  # Linux: a thread's id sets that thread's nice only
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
        try:
            self.result = prepare_deep_scan(self.model, self.ts, self.kind, tokens=self.tokens, corpus=self.corpus,
                                            progress=self._sink)
            if self.on_done is not None:
                self.on_done(self.result)
        except DeepScanCancelled:
            self.cancelled = True
        except Exception as e:  # noqa: BLE001 - a background thread has no caller to raise to: status() says it
            self.error = e
        finally:
            self.done.set()
