"""The "Features" tab: browse and steer the features of sparse autoencoders (SAEs) and transcoders.

Pick an SAE (#feature-sae) and a feature (#feature-id), press Show (#feature-show): #feature-card fills with the
feature's page: how often it fires and its quantile bands, its activation density, its top activating contexts
in a scan of the bundled corpus (the Corpus tab's verses, scanned once per model and SAE with the SAE spliced in
and cached like the Corpus tab's scans, as a long job of app/scan_jobs.py), its logit effects (W_dec[f] · W_U)
and its nearest features by decoder cosine. Below: the current prompt's strongest features at each token (click
a token, then a feature), a search for features that fire on, or promote, a token, and a steering panel (#steer-run)
that continues the prompt with and without the feature added, with the same seed.

Which SAEs the picker offers for the session's model:
- the bundled ones (slmviz.bundled_saes);
- every SAE folder under $SLMVIZ_SAE_DIRS (folders separated by the OS path separator; each one an SAE folder or a
  folder of SAE folders), set by whoever starts the server, so no --allow-local-models is needed for them;
- those loaded in the Model tab: a hub id (+ subfolder), or a local folder when the app runs with
  --allow-local-models. They are shared by every session of the server (at most MAX_LOADED_SAES kept).
- those the session trained itself in the tab's "Train an SAE" panel (listed for that session only; at most
  MAX_TRAINED_SAES per session, kept in memory, never written anywhere another session reads).
A picker value is only ever looked up among these: a client cannot make the server read another path.

Training (the "Train an SAE" panel): slmviz.train_sae on a hook of the session's model (a transcoder when a second
hook is given) over the bundled corpus, the broad one or "balanced" (half broad, half the model's own chat and prose,
which the job writes first when this model has none yet), at most MAX_TRAIN_TOKENS tokens. It runs as a long job in
app/scan_jobs.py's RUNNER worker, so other sessions' requests are served while it trains; gr.Progress and the
status line show its loss, explained variance, L0 and dead fraction after every step, and Cancel stops it at its
next step (the request's wait is closed, or, over the API, /sae_train_cancel leaves the job).

Bad input (an SAE for another model's width, a hook the family lacks, missing, mis-shaped or non-finite tensors,
a pickle, an unknown architecture, an unreachable hub, a feature out of range) is a one-line message from
slmviz.load_sae / the SAE object, shown as an error in the page; nothing the session had is lost.
The card, the prompt's features and the searches are the library's (slmviz.features.dashboard); a notebook shows
the same card (docs/features.md, "Dashboards in a notebook").
"""

from __future__ import annotations

import hashlib
import html
import itertools
import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from slmviz.errors import check_feature
from slmviz.features.bundled import bundled_saes
from slmviz.features.dashboard import acts_hook, feature_card, search_features, top_features
from slmviz.features.load import load_sae
from slmviz.features.prepared_scans import load_sae_scan
from slmviz.features.sae import SAE
from slmviz.features.steer import steer
from slmviz.formats.saelens import CFG_FILENAME
from slmviz.model_api import HUB_ID_PATTERN
from slmviz.plots.features import FEATURE_LINK, feature_list_html
from slmviz.plots.trace import show_token

from .corpus_tab import SCANS, corpus_size, session
from .handlers import Handlers, readable_errors, write_model_corpus
from .scan_jobs import RUNNER, JobCancelled, wait

log = logging.getLogger("slmviz.app")

SAE_DIRS_ENV = "SLMVIZ_SAE_DIRS"
MAX_LOADED_SAES = 6
TOP_K = 10  # contexts kept per feature by a feature scan
EFFECTS_K = 10  # tokens per side of the logit effects, and nearest features
PER_TOKEN = 8  # features listed per prompt token
TOKEN_CHIP = "slmviz-feature-token"
STEER_TOKENS = 24
DASHBOARD_ROWS = "+sae_rows"  # in a feature scan's cache key: slmviz.scan zeroes the rows SAE.shown_rows drops
GEMMA_SCOPE_WEIGHTS = "params.safetensors"
LINK_JS = ("element.addEventListener('click', (e) => {{ const s = e.target.closest('.{cls}'); "
           "if (s) trigger('click', {{{key}: Number(s.dataset.{key})}}); }});")
FEATURE_CLICK_JS = LINK_JS.format(cls=FEATURE_LINK, key="feature")
TOKEN_CLICK_JS = LINK_JS.format(cls=TOKEN_CHIP, key="pos")
MAX_TRAINED_SAES = 3  # per session: SAEs it trained, kept in memory
MAX_TRAIN_TOKENS = 500_000  # what the app trains on: minutes on 2 cores (the bundled SAEs took CPU-hours)
MAX_TRAIN_WIDTH = 16_384
TRAIN_CORPORA = {"bible": "the bundled corpus (King James Bible)",
                 "broad": "broad: Python stdlib, pydoc, package READMEs and licences, the Bible",
                 "balanced": "balanced: half broad, half the model's own chat (the bundled SAEs' corpus; its first "
                             "use writes the chat, ~40 min)"}
NO_SAE = "No SAE for this model yet: load one in the Model tab (a hub id, or a folder with --allow-local-models)."


@dataclass
class Entry:
    """One SAE on offer: its picker name, the SAE (loaded for one model) and its weights' fingerprint."""

    name: str
    sae: SAE
    key: str


def fingerprint(sae: SAE) -> str:
    """sha1 of the SAE's configuration and tensors: two SAEs with the same name never share a cached scan."""
    h = hashlib.sha1(repr(sae).encode())
    for name, tensor in sorted(sae.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def provide_prepared_scan(model: Any, entry: Entry) -> Entry:
    """A bundled SAE's feature scan prepared with the model's full set (features.prepared_scans.prepare_sae_scans: the
    set's corpus, modern prose and chat rather than King James verses), served as its card's scan: no visitor waits.
    Without one (or for other weights), the card scans the bundled verses on first use, as before."""
    if SCANS.finished(model, [acts_hook(entry.sae)], TOP_K, entry.key + DASHBOARD_ROWS) is None:
        found = load_sae_scan(model, entry.name, entry.sae)
        if found is not None:
            SCANS.provide(model, [acts_hook(entry.sae)], found, TOP_K, entry.key + DASHBOARD_ROWS)
    return entry


def sae_dirs() -> list[Path]:
    """The SAE folders under $SLMVIZ_SAE_DIRS (an SAE folder, or a folder of them), sorted by name."""
    found = []
    for root in filter(None, os.environ.get(SAE_DIRS_ENV, "").split(os.pathsep)):
        root = Path(root).expanduser()
        if _is_sae_folder(root):
            found.append(root)
        elif root.is_dir():
            found += sorted(p for p in root.iterdir() if _is_sae_folder(p))
    return found


def _is_sae_folder(path: Path) -> bool:
    return (path / CFG_FILENAME).is_file() or (path / GEMMA_SCOPE_WEIGHTS).is_file()


class SAEStore:
    """The SAEs this server offers, per model (module docstring), loaded on first use and shared by sessions."""

    def __init__(self, allow_local: bool = False):
        self.allow_local = allow_local
        self._loaded: OrderedDict[tuple[str, str], Entry] = OrderedDict()  # (model, name) -> Entry, LRU
        self._extra: dict[str, list[str]] = {}  # model -> names loaded in the Model tab, in order
        self._sources: dict[tuple[str, str], Any] = {}  # (model, name) -> what load_sae reads for it
        self._misfits: set[tuple[str, str]] = set()  # (model, folder) of $SLMVIZ_SAE_DIRS folders that do not fit
        self._trained: dict[tuple[str, str], OrderedDict[str, Entry]] = {}  # (model, session) -> its own SAEs
        self._trained_ids = itertools.count(1)
        self._pinned: dict[tuple[str, str], Entry] = {}  # (model, name) -> a full set's coder (app/transcoder_sets)
        self._lock = threading.Lock()

    @staticmethod
    def model_key(model: Any) -> str:
        return f"{model.name}|{model.path}"

    def names(self, model: Any, who: str | None = None) -> list[str]:
        """Bundled SAEs, then $SLMVIZ_SAE_DIRS folders that fit this model, then those loaded in the Model tab,
        then those session `who` trained."""
        m = self.model_key(model)
        names = list(bundled_saes(model))
        for folder in sae_dirs():
            name = folder.name
            if (m, str(folder)) in self._misfits:
                continue
            if (m, name) not in self._sources:
                try:  # listed only where it fits: hooks and widths checked against the model
                    self._keep(model, name, load_sae(folder, model=model), folder)
                except Exception as e:  # noqa: BLE001 - a bad folder is logged once and left out, never fatal
                    log.warning("SAE folder %s does not fit %s: %s", folder, model.name, e)
                    self._misfits.add((m, str(folder)))
                    continue
            names.append(name)
        with self._lock:
            names += [n for n in self._extra.get(m, []) if (m, n) in self._loaded]
            if who is not None:
                names += list(self._trained.get((m, who), {}))
        return list(dict.fromkeys(names))

    def add_trained(self, model: Any, who: str, sae: SAE) -> Entry:
        """An SAE session `who` trained: offered to that session only (names(model, who)), the oldest dropped
        beyond MAX_TRAINED_SAES."""
        arrow = f" -> {sae.hook_name_out}" if sae.is_transcoder else ""
        name = f"trained #{next(self._trained_ids)}: {sae.hook_name}{arrow}, {sae.d_sae} features, k {sae.k}"
        entry = Entry(name, sae, fingerprint(sae))
        with self._lock:
            mine = self._trained.setdefault((self.model_key(model), who), OrderedDict())
            mine[name] = entry
            while len(mine) > MAX_TRAINED_SAES:
                mine.popitem(last=False)
        return entry

    def pin(self, model: Any, name: str, sae: SAE) -> Entry:
        """A coder of a loaded transcoder set: found by `get` (its feature card, its scan) and never evicted, since
        its set stays loaded; not listed by `names` (the set is one choice of the Circuits tab)."""
        entry = Entry(name, sae, fingerprint(sae))
        with self._lock:
            self._pinned[(self.model_key(model), name)] = entry
        return entry

    def _trained_entry(self, m: str, name: str) -> Entry | None:
        with self._lock:
            for (model_key, _), mine in self._trained.items():
                if model_key == m and name in mine:
                    return mine[name]
        return None

    def get(self, model: Any, name: str | None) -> Entry:
        m = self.model_key(model)
        if not name:
            raise ValueError(NO_SAE if not self.names(model) else "Pick an SAE first")
        with self._lock:
            if (m, name) in self._loaded:
                self._loaded.move_to_end((m, name))
                return self._loaded[(m, name)]
            if (m, name) in self._pinned:
                return self._pinned[(m, name)]
        trained = self._trained_entry(m, name)
        if trained is not None:
            return trained
        if name in bundled_saes(model):
            return provide_prepared_scan(model, self._keep(model, name, load_sae(name, model=model)))
        source = self._sources.get((m, name))
        if source is None or name not in self.names(model):
            raise ValueError(f"{name!r} is not an SAE for {model.name}; pick one of: "
                             f"{', '.join(self.names(model)) or NO_SAE}")
        return self._keep(model, name, load_sae(source, model=model), source)

    def load(self, model: Any, source: str, subfolder: str | None = None) -> Entry:
        """An SAE from a hub id (+ subfolder), or a local folder when allow_local; its name is the source."""
        text = (source or "").strip()
        sub = (subfolder or "").strip() or None
        if not text:
            raise ValueError("Type a hub id (owner/name, with its subfolder) or, with --allow-local-models, a folder")
        path = Path(text).expanduser()
        if path.exists() or text.startswith((".", "/", "~")):
            if not self.allow_local:
                raise ValueError("Local SAE folders are disabled; start the app with --allow-local-models to load "
                                 f"one (or list it in ${SAE_DIRS_ENV} when starting the server)")
            where = path / sub if sub else path
            sae = load_sae(where.resolve() if where.exists() else where, model=model)
            name = str(where.resolve())
        elif HUB_ID_PATTERN.match(text) and ".." not in text:
            sae = load_sae(text, subfolder=sub, model=model)  # bounded time: $SLMVIZ_HUB_TIMEOUT
            name = f"{text}/{sub}" if sub else text
        else:
            raise ValueError(f"{text[:100]!r} is neither a hub id of the form owner/name nor a folder")
        entry = self._keep(model, name, sae, None)
        with self._lock:
            extra = self._extra.setdefault(self.model_key(model), [])
            if name not in extra:
                extra.append(name)
        return entry

    def _keep(self, model: Any, name: str, sae: SAE, source: Any = None) -> Entry:
        m = self.model_key(model)
        entry = Entry(name, sae, fingerprint(sae))
        with self._lock:
            if source is not None:
                self._sources[(m, name)] = source
            self._loaded[(m, name)] = entry
            self._loaded.move_to_end((m, name))
            while len(self._loaded) > MAX_LOADED_SAES:
                self._loaded.popitem(last=False)  # a bundled or $SLMVIZ_SAE_DIRS SAE is loaded again on demand
        return entry


class FeatureHandlers:
    """The tab's handlers; models come from the page's Handlers, SAEs from an SAEStore."""

    def __init__(self, handlers: Handlers):
        self.h = handlers
        self.saes = SAEStore(allow_local=handlers.store.allow_local)

    @readable_errors
    def choices(self, source: str | None, keep: str | None = None, request: gr.Request = None) -> gr.Dropdown:
        names = self.saes.names(self.h.model(source), session(request))
        value = keep if keep in names else (names[0] if names else None)
        return gr.Dropdown(choices=names, value=value)

    def _scan_job(self, model: Any, entry: Entry, who: str) -> Any:
        return SCANS.join(model, [acts_hook(entry.sae)], who, top_k=TOP_K, saes=(entry.sae,),
                          saes_key=entry.key + DASHBOARD_ROWS)

    def _wait_scan(self, model: Any, entry: Entry, who: str, progress: Any, n_outputs: int) -> Iterator[Any]:
        """Join (or start) the SAE's feature scan and wait for it, yielding no-op updates of the handler's
        n outputs meanwhile; return (Scan, docs)."""
        job = self._scan_job(model, entry, who)
        skip = gr.skip() if n_outputs == 1 else tuple(gr.skip() for _ in range(n_outputs))
        try:
            for _ in wait(job, who, progress):
                yield skip
        except JobCancelled:
            raise gr.Error("The feature scan was cancelled; press Show to start it again",
                           print_exception=False) from None
        return job.result

    def _card(self, model: Any, entry: Entry, feature: int, found: Any = None, note: str = "") -> str:
        scan, docs = found if found is not None else (None, None)
        return feature_card(entry.sae, feature, scan=scan, model=model, docs=docs, name=entry.name, k=EFFECTS_K,
                            note=note).html()

    @readable_errors
    def show(self, name: str | None, feature: float | None, source: str | None, request: gr.Request,
             progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The feature's page; its contexts and density come from the feature scan (computed on first use)."""
        model = self.h.model(source)
        entry = self.saes.get(model, name)
        f = check_feature(entry.sae, _whole(feature))
        who = session(request)
        if SCANS.finished(model, [acts_hook(entry.sae)], TOP_K, entry.key + DASHBOARD_ROWS) is None:
            yield f, self._card(model, entry, f, note=f"Scanning {corpus_size()} verses of the bundled corpus with "
                                "this SAE (first use only; everyone else's requests go on). The contexts and the "
                                "density appear when it is done.")
        found = yield from self._wait_scan(model, entry, who, progress, 2)
        yield f, self._card(model, entry, f, found)

    @readable_errors
    def open(self, evt: gr.EventData, name: str | None, source: str | None, request: gr.Request,
             progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """A click on a feature (nearest features, a token's features, search results): open its page."""
        yield from self.show(name, getattr(evt, "feature", None), source, request, progress)

    @readable_errors
    def prompt_features(self, prompt: str, chat: bool, name: str | None, source: str | None) -> tuple:
        model = self.h.model(source)
        entry = self.saes.get(model, name)
        found = prompt_features(model, entry.sae, self.h.checked_prompt(prompt, model), bool(chat))
        first = next((i for i, keep in enumerate(found["kept"]) if keep), 0)
        return prompt_tokens_html(found), token_features_html(found, len(found["tokens"]) - 1
                                                              if found["kept"][-1] else first), found

    @readable_errors
    def token(self, evt: gr.EventData, found: dict | None) -> str:
        if not found:
            raise ValueError("Press 'Features of the prompt' first")
        return token_features_html(found, int(getattr(evt, "pos", -1)))

    @readable_errors
    def token_at(self, found: dict | None, pos: float | None) -> str:
        """The same as clicking token `pos` (for gradio_client)."""
        if not found:
            raise ValueError("Press 'Features of the prompt' first")
        return token_features_html(found, _whole(pos))

    @readable_errors
    def search(self, name: str | None, token: str, mode: str, source: str | None, request: gr.Request,
               progress: gr.Progress = gr.Progress()) -> Iterator[str]:  # noqa: B008
        model = self.h.model(source)
        entry = self.saes.get(model, name)
        if not (token or "").strip():
            raise ValueError("Type a token to search for, e.g. ' God'")
        if mode == "promotes":
            table = search_features(entry.sae, token, by="promotes", model=model)
            items = [(r.feature, f"{r.effect:+.3g}") for r in table.itertuples()]
            what = f"Features whose logit effect on <code>{_esc(token)}</code> is largest"
        else:
            yield "Scanning the corpus for this SAE first..."
            scan, _ = yield from self._wait_scan(model, entry, session(request), progress, 1)
            table = search_features(entry.sae, token, by="fires", scan=scan)
            items = [(r.feature, f"{r.contexts} contexts, max {r.activation:.3g}") for r in table.itertuples()]
            what = f"Features whose top contexts sit on <code>{_esc(token)}</code>"
        if not items:
            yield f"<p>No feature found: {what[0].lower() + what[1:]}.</p>"
            return
        yield f"<p>{what} (click one to open its page):</p>" + feature_list_html(items)

    @readable_errors
    def steer(self, prompt: str, chat: bool, name: str | None, feature: float | None, strength: float | None,
              max_new_tokens: float | None, temperature: float | None, seed: float | None,
              source: str | None) -> tuple[str, str]:
        """The prompt continued as is and with strength × W_dec[feature] added at the SAE's hook, same seed."""
        model = self.h.model(source)
        entry = self.saes.get(model, name)
        f = check_feature(entry.sae, _whole(feature))
        n_new = self.h.checked_new_tokens(max_new_tokens)
        if temperature is None or not 0 <= float(temperature) <= 5:
            raise ValueError(f"Temperature must be between 0 and 5, got {temperature!r}")
        text = self.h.checked_prompt(prompt, model)
        ids = model.encode(text, chat=bool(chat))
        kwargs = dict(temperature=float(temperature), seed=None if seed in (None, "") else _whole(seed))
        hooks = steer(entry.sae, {f: float(strength) if strength is not None else 0.0})
        return model.generate(ids, n_new, **kwargs), model.generate(ids, n_new, hooks=hooks, **kwargs)

    @readable_errors
    def load(self, text: str, subfolder: str, source: str | None, request: gr.Request = None,
             progress: gr.Progress = gr.Progress()) -> tuple:  # noqa: B008
        """The Model tab's SAE loader: load it for this session's model, then pick it in the Features tab."""
        model = self.h.model(source)
        progress(0.2, desc=f"Loading the SAE for {model.name}")
        entry = self.saes.load(model, text, subfolder)
        names = self.saes.names(model, session(request))
        return (f"Loaded **{entry.name}**: {entry.sae!r}, for {model.name}. Pick it in the **Features** tab.",
                gr.Dropdown(choices=names, value=entry.name))

    def cancel(self, request: gr.Request) -> str:
        SCANS.jobs.leave(session(request), kind="scan")
        return "Cancelled. The scan stops unless another visitor is waiting for it; press **Show** to start again."

    @readable_errors
    def train(self, hook: str, hook_out: str, width: float | None, k: float | None, tokens: float | None,
              corpus: str, source: str | None, request: gr.Request,
              progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """Train an SAE (a transcoder when hook_out is given) as a long job in the RUNNER worker; the status line
        and gr.Progress show loss, explained variance, L0 and dead fraction after every step. When done, the
        SAE is offered in this session's picker (#feature-sae) and picked."""
        model = self.h.model(source)
        who = session(request)
        hook, out_hook = (hook or "").strip(), (hook_out or "").strip() or None
        if not hook:
            raise ValueError("Type the hook the SAE reads, e.g. blocks.3.hook_resid_post (or blocks.3.mlp.hook_in "
                             "with blocks.3.hook_mlp_out for a transcoder)")
        d_sae = _count(width, "width", MAX_TRAIN_WIDTH)
        k = _count(k, "k", d_sae)
        n = _count(tokens, "tokens", MAX_TRAIN_TOKENS)
        if corpus not in TRAIN_CORPORA:
            raise ValueError(f"Pick a corpus: one of {', '.join(TRAIN_CORPORA)}")
        batch = 1024 if n < 16_384 else 4096
        kw = dict(hook_out=out_hook, architecture="batchtopk" if out_hook else "topk", lr=2e-3, batch_tokens=batch,
                  buffer_tokens=min(65_536, max(batch, n)), dead_window=max(batch, min(100_000, n // 4)))

        def work(report: Callable[..., None]) -> SAE:
            from slmviz.training.train import train_sae

            out = Path(tempfile.mkdtemp(prefix="slmviz-train-"))
            try:
                write_model_corpus(model, corpus, report)
                report(0.0, f"Reading {TRAIN_CORPORA[corpus]}")
                return train_sae(model, hook=hook, corpus=train_corpus(corpus, model), d_sae=d_sae, k=k, tokens=n,
                                 out=out, progress=lambda st: report(st["tokens"] / st["total"], train_line(st), st),
                                 checkpoint_every=float("inf"), **kw)
            finally:
                shutil.rmtree(out, ignore_errors=True)  # the SAE is kept in memory for this session

        job = RUNNER.submit(work, who, kind="train")
        yield "Queued: training starts when the long job ahead of it (if any) is done.", gr.skip()
        try:
            for _ in wait(job, who, progress):
                if job.partial is not None:
                    yield f"Training: {train_line(job.partial)}", gr.skip()
        except JobCancelled:
            raise gr.Error("Training was cancelled; press Train to start again", print_exception=False) from None
        entry = self.saes.add_trained(model, who, job.result)
        line = train_line(job.partial) if job.partial is not None else ""
        yield (f"Trained **{entry.name}** on {n:,} tokens ({line}). It is picked in the SAE list above, for this "
               "session only.", gr.Dropdown(choices=self.saes.names(model, who), value=entry.name))

    def cancel_training(self, request: gr.Request) -> str:
        RUNNER.leave(session(request), kind="train")  # also for an API client, whose request Gradio cannot stop
        return "Training cancelled."

    def model_changed(self, source: str | None, request: gr.Request = None) -> tuple:
        names = self.saes.names(self.h.model(source), session(request))
        note = "" if names else NO_SAE
        return gr.Dropdown(choices=names, value=names[0] if names else None), note, "", "", None


def prompt_features(model: Any, sae: SAE, prompt: str, chat: bool = False, k: int = PER_TOKEN) -> dict[str, Any]:
    """slmviz's top_features of the prompt as plain lists for gr.State: tokens, features [pos][k], acts [pos][k],
    kept [pos] (False where SAE.shown_rows drops the row: the first position and massive ones)."""
    names = [acts_hook(sae), sae.hook_name] + ([sae.hook_name_out] if sae.is_transcoder else [])
    trace = model.trace(prompt, chat=chat, saes=[sae], names=list(dict.fromkeys(names)))
    table = top_features(trace, sae, k)
    by_pos = table.groupby("position", sort=True)
    return {"tokens": list(trace.tokens), "features": [g.feature.tolist() for _, g in by_pos],
            "acts": [g.activation.tolist() for _, g in by_pos], "kept": [bool(g.kept.iloc[0]) for _, g in by_pos],
            "sae": repr(sae)}


def prompt_tokens_html(found: dict[str, Any]) -> str:
    """The prompt as token chips, each shaded by its strongest feature's activation; click one for its features."""
    kept = [a[0] for a, keep in zip(found["acts"], found["kept"], strict=True) if keep and a]
    scale = max(kept, default=0.0) or 1.0
    chips = []
    for pos, (tok, acts, keep) in enumerate(zip(found["tokens"], found["acts"], found["kept"], strict=True)):
        alpha = min(max(acts[0], 0.0) / scale, 1.0) if keep and acts else 0.0
        note = f"strongest feature {found['features'][pos][0]}: {acts[0]:.3g}" if keep and acts else \
            "skipped: a window's first position or a massive activation (sae_rows)"
        chips.append(
            f'<span class="{TOKEN_CHIP}" data-pos="{pos}" title="position {pos}; {html.escape(note)}" '
            f'style="cursor:pointer;display:inline-block;border:1px solid #c8ccd2;border-radius:4px;padding:1px 5px;'
            f'margin:2px;background:rgba(255,140,0,{alpha:.2f});color:#111;font-family:ui-monospace,monospace;'
            f'font-size:13px{"" if keep else ";opacity:0.5"}">{html.escape(show_token(tok))}</span>'
        )
    return (f'<div class="slmviz-prompt-features"><div style="font-size:12px;color:#667">{len(found["tokens"])} '
            "tokens, shaded by their strongest feature; click a token for its features</div>" + "".join(chips)
            + "</div>")


def token_features_html(found: dict[str, Any], pos: int) -> str:
    """One token's strongest features as links (click one to open its page)."""
    if not 0 <= pos < len(found["tokens"]):
        raise ValueError(f"position {pos} is not a token of the prompt (0..{len(found['tokens']) - 1})")
    token = html.escape(show_token(found["tokens"][pos]))
    if not found["kept"][pos]:
        return (f"<p>Position {pos} (<code>{token}</code>) is skipped: it is a window's first position or carries a "
                "massive activation, where an SAE's features say nothing about the token (sae_rows).</p>")
    items = [(f, a) for f, a in zip(found["features"][pos], found["acts"][pos], strict=True) if a > 0]
    if not items:
        return f"<p>No feature fires at position {pos} (<code>{token}</code>).</p>"
    return (f"<p>Strongest features at position {pos} (<code>{token}</code>); click one to open its page:</p>"
            + feature_list_html([(f, f"{a:.3g}") for f, a in items]))


def train_corpus(name: str, model: Any = None) -> Any:
    """The texts a training run of the app reads: the bundled verses, or a named corpus's training split (broad;
    balanced is `model`'s own, features.corpora)."""
    if name == "bible":
        from slmviz.corpora.verses import bundled_corpus_path

        return str(bundled_corpus_path())
    from slmviz.corpora.named import resolve_corpus

    return str(resolve_corpus(name, model))


def train_line(stats: dict[str, Any]) -> str:
    """One step's figures: what gr.Progress and the status line show while an SAE trains."""
    return (f"{stats['tokens']:,}/{stats['total']:,} tokens, loss {stats['loss']:.4g}, explained variance "
            f"{stats['explained_variance']:.3f}, L0 {stats['l0']:.1f}, dead {100 * stats['dead_fraction']:.1f} %, "
            f"{stats['tokens_per_s']:,.0f} tokens/s")


def _count(value: Any, what: str, most: int) -> int:
    if value is None or value == "" or not float(value).is_integer() or not 1 <= int(value) <= most:
        raise ValueError(f"{what} must be a whole number from 1 to {most:,}, got {value!r}")
    return int(value)


def _whole(value: Any) -> int:
    if value is None or value == "" or not float(value).is_integer():
        raise ValueError(f"A feature is a whole number, got {value!r}")
    return int(value)


def _esc(text: str) -> str:
    return html.escape(text)


def build_sae_loader(fh: FeatureHandlers) -> tuple[gr.components.Component, ...]:
    """The Model tab's SAE loader, inside that tab's layout; its events are wired by build_features_tab."""
    allowed = "a hub id (owner/name) with its subfolder" + (
        ", or a local SAE folder" if fh.saes.allow_local else "")
    gr.Markdown(f"Load an SAE or transcoder for the session's model: {allowed} (SAELens or Gemma Scope 2 format, "
                "safetensors only); then browse it in the **Features** tab.")
    with gr.Row():
        box = gr.Textbox(label="SAE", placeholder="google/gemma-scope-2-270m-pt", elem_id="sae-source", scale=3)
        sub = gr.Textbox(label="subfolder (hub)", placeholder="resid_post/layer_9_width_16k_l0_medium",
                         elem_id="sae-subfolder", scale=3)
        button = gr.Button("Load the SAE", elem_id="load-sae", scale=1)
    status = gr.Markdown(elem_id="sae-status")
    return box, sub, button, status


def build_features_tab(fh: FeatureHandlers, prompt: gr.Textbox, chat: gr.Checkbox, source: gr.State,
                       loader: tuple, model_kw: dict, light_kw: dict, job_kw: dict, load_kw: dict,
                       decode_kw: dict | None = None) -> None:
    """The Features tab, inside the page's gr.Tabs. Waiting for a feature scan holds a "jobs" slot (job_kw);
    the model queue (model_kw) only serves the prompt's features, and steering decodes in the "decode" queue
    (decode_kw, app/main.py)."""
    model = fh.h.store.get()
    names = fh.saes.names(model)
    with gr.Tab("Features", id="tab-features") as tab:
        gr.Markdown(
            "The features of a sparse autoencoder (SAE) or transcoder: what makes one fire across "
            f"{corpus_size()} verses of the bundled corpus (scanned once per SAE and cached), which tokens it "
            "promotes, which features are its neighbours, and what it does to a continuation when added.")
        with gr.Row():
            picker = gr.Dropdown(names, value=names[0] if names else None, label="SAE", elem_id="feature-sae",
                                 scale=3, allow_custom_value=False)
            feature = gr.Number(value=0, precision=0, minimum=0, label="feature", elem_id="feature-id", scale=1)
            show_btn = gr.Button("Show", variant="primary", elem_id="feature-show", scale=1)
            cancel_btn = gr.Button("Cancel", elem_id="feature-cancel", scale=1)
        status = gr.Markdown("" if names else NO_SAE, elem_id="feature-status")
        card = gr.HTML(elem_id="feature-card", js_on_load=FEATURE_CLICK_JS)
        with gr.Accordion("The prompt's features: the strongest features at each token", open=True):
            with gr.Row():
                prompt_btn = gr.Button("Features of the prompt", elem_id="feature-prompt-run", scale=1)
                token_pos = gr.Number(value=None, precision=0, label="token position", elem_id="feature-token-pos",
                                      scale=1, visible=False)
            found = gr.State(None, time_to_live=3600)
            tokens = gr.HTML(elem_id="feature-tokens", js_on_load=TOKEN_CLICK_JS)
            token_features = gr.HTML(elem_id="feature-token-features", js_on_load=FEATURE_CLICK_JS)
        with gr.Accordion("Search: features that fire on, or promote, a token", open=False):
            with gr.Row():
                query = gr.Textbox(label="token", placeholder=" God", elem_id="feature-search", scale=2)
                mode = gr.Radio([("fire on it (top corpus contexts)", "fires"),
                                 ("promote it (logit effect)", "promotes")], value="promotes", label="features that",
                                elem_id="feature-search-mode", scale=2)
                search_btn = gr.Button("Search", elem_id="feature-search-run", scale=1)
            results = gr.HTML(elem_id="feature-search-results", js_on_load=FEATURE_CLICK_JS)
        with gr.Accordion("Steering: add the feature's decoder direction at every position", open=True):
            with gr.Row():
                steer_feature = gr.Number(value=0, precision=0, minimum=0, label="feature", elem_id="steer-feature")
                strength = gr.Slider(-200, 200, value=40, step=1, label="strength", elem_id="steer-strength")
                steer_new = gr.Slider(1, 64, value=STEER_TOKENS, step=1, label="new tokens", elem_id="steer-tokens")
                temperature = gr.Slider(0, 2, value=0.5, step=0.05, label="temperature", elem_id="steer-temperature")
                seed = gr.Number(value=0, precision=0, label="seed", elem_id="steer-seed")
            steer_btn = gr.Button("Steer", variant="primary", elem_id="steer-run")
            with gr.Row():
                default_text = gr.Textbox(label="default", lines=5, interactive=False, elem_id="steer-default")
                steered_text = gr.Textbox(label="steered", lines=5, interactive=False, elem_id="steer-steered")
        with gr.Accordion("Train an SAE on this model (minutes; other sessions keep being served)", open=False):
            layer = model.cfg.n_layers // 2
            with gr.Row():
                train_hook = gr.Textbox(value=f"blocks.{layer}.hook_resid_post", label="hook it reads",
                                        elem_id="sae-train-hook", scale=3)
                train_hook_out = gr.Textbox(value="", label="hook it predicts (a transcoder; empty: an SAE)",
                                            placeholder=f"blocks.{layer}.hook_mlp_out", elem_id="sae-train-hook-out",
                                            scale=3)
            with gr.Row():
                train_width = gr.Number(value=2048, precision=0, minimum=1, label="width (features)",
                                        elem_id="sae-train-width")
                train_k = gr.Number(value=32, precision=0, minimum=1, label="k (active per token)",
                                    elem_id="sae-train-k")
                train_tokens = gr.Number(value=100_000, precision=0, minimum=1, maximum=MAX_TRAIN_TOKENS,
                                         label="tokens", elem_id="sae-train-tokens")
                train_corpus_pick = gr.Radio([(v, k) for k, v in TRAIN_CORPORA.items()], value="bible",
                                             label="corpus", elem_id="sae-train-corpus")
            with gr.Row():
                train_btn = gr.Button("Train", variant="primary", elem_id="sae-train-run")
                train_cancel = gr.Button("Cancel", elem_id="sae-train-cancel")
            train_status = gr.Markdown(elem_id="sae-train-status")

    box, sub, load_btn, load_status = loader
    trained = train_btn.click(fh.train, [train_hook, train_hook_out, train_width, train_k, train_tokens,
                                         train_corpus_pick, source], [train_status, picker], api_name="sae_train",
                              show_progress_on=train_status, **job_kw)
    train_cancel.click(fh.cancel_training, None, train_status, cancels=[trained], api_name="sae_train_cancel",
                       **light_kw)
    shown = {"show_progress_on": card}
    show_events = [
        show_btn.click(fh.show, [picker, feature, source], [feature, card], api_name="feature_show", **shown,
                       **job_kw),
        feature.submit(fh.show, [picker, feature, source], [feature, card], api_name="feature_submit", **shown,
                       **job_kw),
    ]
    for html_box in (card, token_features, results):
        show_events.append(html_box.click(fh.open, [picker, source], [feature, card], api_visibility="private",
                                          **shown, **job_kw))
    cancel_btn.click(fh.cancel, None, status, cancels=show_events, api_name="feature_cancel", **light_kw)
    feature.change(lambda f: f, feature, steer_feature, api_visibility="private", **light_kw)
    prompt_btn.click(fh.prompt_features, [prompt, chat, picker, source], [tokens, token_features, found],
                     api_name="feature_prompt", **model_kw)
    tokens.click(fh.token, found, token_features, api_visibility="private", **light_kw)
    token_pos.submit(fh.token_at, [found, token_pos], token_features, api_name="feature_token", **light_kw)
    gr.on([search_btn.click, query.submit], fh.search, [picker, query, mode, source], results,
          api_name="feature_search", **job_kw)
    steer_btn.click(fh.steer, [prompt, chat, picker, steer_feature, strength, steer_new, temperature, seed, source],
                    [default_text, steered_text], api_name="steer", **(decode_kw or model_kw))
    gr.on([load_btn.click, box.submit], fh.load, [box, sub, source], [load_status, picker], api_name="load_sae",
          **load_kw)
    source.change(fh.model_changed, source, [picker, status, card, tokens, found], api_visibility="private",
                  **light_kw)
    tab.select(fh.choices, [source, picker], picker, api_visibility="private", **light_kw)
