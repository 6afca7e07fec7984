"""A model's full transcoder sets for the attribution graph: each offered as one choice of its picker, or built.

The set is the one `slmviz prepare --transcoders plt` makes (slmviz.training.prepare): a per-layer transcoder at
every layer, kept in $SLMVIZ_CACHE/transcoders/{model}/plt. When it is there, the tab's transcoder picker offers it
as one choice ("full set: 30 per-layer transcoders"), picked alone (every layer already has its transcoder, so a
single transcoder beside it would be a second one for its layer). It is loaded once per model and kept in memory
(SmolLM2's: about 600 MB), and each layer's coder is pinned in the server's SAE store (app/saes.py) under the set's
name for that layer (`{set name}/layer_{L}`), so a node's feature card and the workbench find it like any transcoder.
Its cards read the feature scan prepared with it; when that scan is missing or cannot be read, the cards say so, the
graph still draws, and the Graph tab offers to rebuild it (scan_problem, use_scan; app/tabs/graph_scan.py).

Its cross-layer transcoder (`slmviz prepare --transcoders clt`, in .../clt) is offered the same way once it is
there ("cross-layer transcoder: 30 layers"): its layer L's features are pinned as ts.feature_coder(L) (for the CLT,
its encoder exactly, each feature's writes summed into one decoder row), so a card shows the CLT's own activations and
the feature's whole direct path to the logits. The tab does not build a CLT (hours of training, not minutes): that
is `prepare`'s job.

When the per-layer set is not there, the tab offers to build it: a long job in app/jobs.py's RUNNER worker
(other sessions' requests are served meanwhile), shared by every session that presses Build for the same model, its
progress in gr.Progress and the status line: the model's own chat and prose written first when the recipe's corpus
is "mixed" (once per model, slmviz.corpora.generated), then the tokens trained per layer with the layers' mean and
worst explained variance, then the feature scan prepared with the set. Cancel stops it at the next training step,
the checkpoint stays, and Build again resumes from it (train_transcoders' resume; the status says from how many
tokens per layer).

Once a set is loaded (its first graph, or right after its build), its **deep scan** (slmviz.features.deep_scan: a
million tokens of the set's own corpus, labels with measured scores) starts in a thread of its own
(BackgroundDeepScan): not in the job runner, whose one worker it would hold for hours, and at a lower CPU priority,
so every session's requests go first. It resumes where a stopped one left off, `deep_scan_status` says where it is
(slmviz.progress's update), `cancel_deep_scan` stops it at its next batch, and when it is done every layer's card
reads it (until then the cards say they read the small scan) and `deep_labels` gives its labels. It starts only for
a set trained on a named corpus (a list of texts given in $SLMVIZ_SET_RECIPE has no million tokens to read), and not
at all when $SLMVIZ_DEEP_SCAN is 0 (a server that must not spend its cores on it).

The recipe is the model's fixed one (slmviz.training.prepare.RECIPES); $SLMVIZ_SET_RECIPE (JSON, set by whoever starts
the server) overrides it, and is what gives a model without a recipe its set (`d_sae`, `k`, `tokens`, and `corpus`: a
corpus name or a list of texts): the tiny models of the tests build a tiny set in seconds this way. A visitor
cannot change it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

import slmviz
from slmviz.features.deep_scan import DEEP_TOKENS
from slmviz.features.prepared_scans import BackgroundDeepScan, load_deep_labels, load_set_scan, set_corpus
from slmviz.formats.checkpoint import trained_tokens
from slmviz.progress import Progress
from slmviz.replacement.prepared import prepared_dir, prepared_ready
from slmviz.training.prepare import CORPUS, REQUIRED, prepare_transcoders, recipe  # noqa: F401 - CORPUS: graph_scan's

from .jobs import RUNNER
from .models import AppContext
from .saes import SAEStore, provide_feature_scan, unreadable_scan
from .shared import progress_line, readable_errors, session, wait_or_say

KIND = "plt"  # the full per-layer set: built by the tab's first Build button, ticked first
QUICK = "plt-quick"  # the quick per-layer set (minutes, not hours): built by the Graph tab's #graph-build-quick
KINDS = ("plt", "clt", QUICK)  # the prepared sets the tab offers once there, in the order it prefers them
BUILT_HERE = (KIND, QUICK)  # the sets the tab builds (a CLT is `slmviz prepare`'s: hours of training)
RECIPE_ENV = "SLMVIZ_SET_RECIPE"
BUILD_KIND = "transcoder-set"  # the build's Cancel leaves only this kind of job
# A graph over the full set keeps at most this many features, the most influential (attribution_graph's
# max_feature_nodes, circuit-tracer's option; docs/features.md's example value): with 30 layers of k=64 features a
# 16-token prompt has ~30k active ones, whose dense adjacency alone would be ~3.6 GB, past the tab's 4 GiB budget.
MAX_FEATURE_NODES = 4096
REBUILD_BUTTON = "Rebuild the scan"  # the Graph tab's button (app/tabs/graph_scan.py), named by the cards
DEEP_SCAN_ENV = "SLMVIZ_DEEP_SCAN"  # "0" (or off, no, false): no background deep scan


def set_ready(model: Any, kind: str = KIND) -> bool:
    """Whether the model's prepared `kind` set is there (a finished run: replacement.prepared.prepared_ready)."""
    return prepared_ready(model, kind)


def set_label(model: Any, kind: str = KIND) -> str:
    """The picker's choice for the model's prepared `kind` set (it covers every layer). The same before and after
    the set is built: Gradio checks a value against the choices the session's page was built with."""
    if kind == "clt":
        return f"cross-layer transcoder: {model.cfg.n_layers} layers"
    if kind == QUICK:
        return f"quick set: {model.cfg.n_layers} per-layer transcoders"
    return f"full set: {model.cfg.n_layers} per-layer transcoders"


def set_kind(model: Any, name: str) -> str | None:
    """The kind of prepared set the picker's choice `name` is, or None for a single transcoder."""
    return next((kind for kind in KINDS if name == set_label(model, kind)), None)


def recipe_overrides() -> dict[str, Any]:
    """$SLMVIZ_SET_RECIPE's overrides of the recipe ({} when unset)."""
    text = os.environ.get(RECIPE_ENV, "").strip()
    if not text:
        return {}
    try:
        found = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"${RECIPE_ENV} is not valid JSON ({e}); it holds train_transcoders arguments, e.g. "
                         '{"d_sae": 4096, "k": 64, "tokens": 500000}') from None
    if not isinstance(found, dict):
        raise ValueError(f"${RECIPE_ENV} must be a JSON object of train_transcoders arguments, got {text[:80]!r}")
    return found


def deep_scan_wanted() -> bool:
    """Whether a loaded set starts its deep scan in the background ($SLMVIZ_DEEP_SCAN, on unless 0/off/no/false)."""
    return os.environ.get(DEEP_SCAN_ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def _deep_enough(scanned: tuple[Any, list[str]] | None) -> bool:
    """Whether the scan the cards read is a finished deep scan of DEEP_TOKENS or more (nothing left to start)."""
    return scanned is not None and bool(scanned[0].info.get("deep")) and scanned[0].n_tokens >= DEEP_TOKENS


class TranscoderSets:
    """The full sets on offer, loaded once per model; the Build and Cancel handlers of the tab's build panel."""

    def __init__(self, ctx: AppContext, saes: SAEStore, offered: Callable[[Any], list[str]] | None = None):
        self.ctx = ctx
        self.saes = saes  # the coders get pinned in it, so a node's card finds them like any transcoder
        self.offered = offered or self.choices  # every choice of the picker (the single transcoders too)
        self._loaded: dict[tuple[str, str], tuple[Any, dict[int, str]]] = {}  # (model, kind) -> (set, names)
        self._lock = threading.Lock()
        self._building: dict[str, tuple[str, Any]] = {}  # model -> (kind, job) of its latest build
        self._scan_problems: dict[tuple[str, str], str | None] = {}  # (model, kind) -> why its cards lack its scan
        self._deep: dict[tuple[str, str], BackgroundDeepScan] = {}  # (model, kind) -> its background deep scan
        self._deep_labels: dict[tuple[str, str], Any] = {}  # (model, kind) -> its deep scan's LabelTable

    @staticmethod
    def _key(model: Any) -> str:
        return f"{model.name}|{model.path}"

    def choices(self, model: Any) -> list[str]:
        """The picker's choices for the model's prepared sets: each once built, or while it can be built (picked
        then, it says how): the per-layer set by the Build button, the CLT by `slmviz prepare`. Offered before it
        is built, a choice is there when it is: Gradio checks a value against the choices a page was built with."""
        found = []
        for kind in KINDS:
            if not set_ready(model, kind):
                try:
                    self.args(model, kind) if kind in BUILT_HERE else recipe(model, kind)
                except ValueError:
                    continue
            found.append(set_label(model, kind))
        return found

    @staticmethod
    def is_set(model: Any, name: str) -> bool:
        return set_kind(model, name) is not None

    def ticked(self, model: Any) -> list[str]:
        """The picker's value when the page loads: the best set that is ready, alone (KINDS' order: the full
        per-layer set, the CLT, the quick set); [] when none is."""
        return next(([set_label(model, kind)] for kind in KINDS if set_ready(model, kind)), [])

    def load(self, model: Any, kind: str = KIND) -> tuple[Any, dict[int, str]]:
        """(the model's prepared `kind` set, {layer: its coder's name}), loaded on first use and kept; every coder
        pinned in the SAE store under that name."""
        self.check(model, kind)
        return self._load(model, kind)

    @staticmethod
    def check(model: Any, kind: str = KIND) -> None:
        if set_ready(model, kind):
            return
        if kind == "clt":
            raise ValueError(f"{model.name} has no {set_label(model, kind)} yet: it is trained once by "
                             f"'slmviz prepare --transcoders clt --model {model.name}' (hours on a CPU), then kept "
                             "in $SLMVIZ_CACHE; pick the per-layer set or single transcoders meanwhile")
        button = "Build the quick transcoder set" if kind == QUICK else "Build the full transcoder set"
        raise ValueError(f"{model.name} has no {set_label(model, kind)} yet: press '{button}' (it is trained once, "
                         "then kept in $SLMVIZ_CACHE), or pick single transcoders")

    @readable_errors
    def refresh(self, source: str | None) -> Any:
        """On page load: tick the set when it was built since the server started (else leave the picker). The
        choices come with it: the page was built with the sets ready then, and a value outside its choices is
        dropped."""
        model = self.ctx.model(source)
        ticked = self.ticked(model)
        return gr.update(choices=self.offered(model), value=ticked) if ticked else gr.skip()

    def _load(self, model: Any, kind: str) -> tuple[Any, dict[int, str]]:
        key = (self._key(model), kind)
        with self._lock:  # one load per model and kind, however many sessions ask at once
            if key not in self._loaded:
                ts = slmviz.load_transcoders(kind, model=model)
                # a card reads one layer's features (a CLT's: its encoder, each feature's writes summed), pinned under
                # the name `prepare` gives the set's layers
                names = {layer: f"{model.name}-{kind}/layer_{layer}" for layer in ts.layers}
                entries = [self.saes.pin(model, name, ts.feature_coder(layer)) for layer, name in names.items()]
                self._loaded[key] = (ts, names)
                scanned = self._read_scan(model, kind, entries)
                if deep_scan_wanted() and not _deep_enough(scanned):
                    self._start_deep(model, kind, ts)
            return self._loaded[key]

    def _read_scan(self, model: Any, kind: str, entries: list[Any]) -> tuple[Any, list[str]] | None:
        """The scan prepared with the set, served as each coder's card scan (no card waits). When it is missing or
        cannot be read, the cards say so (and scan the bundled verses on demand), the graph still draws, and
        scan_problem says why: the Graph tab then offers to rebuild it (app/tabs/graph_scan.py). Called by _load,
        holding self._lock."""
        try:
            scanned, why = load_set_scan(model, kind), None
        except Exception as e:  # noqa: BLE001 - a damaged scan (ScanFormatError, or a folder it cannot open)
            cause = e.__cause__ or e  # what the reader said, without the server's paths
            scanned, why = None, f"{type(cause).__name__}: {cause}"
        for entry in entries:
            if scanned is not None:
                provide_feature_scan(model, entry, scanned)
            elif why is not None:
                unreadable_scan(entry, why, fix=f"press '{REBUILD_BUTTON}' beside the card to write it again")
        problem = None if scanned is not None else (
            f"its prepared scan could not be read ({why})" if why is not None else "it has no prepared scan")
        self._scan_problems[(self._key(model), kind)] = problem
        return scanned

    # --- the deep scan -------------------------------------------------------------------------------------------
    def start_deep_scan(self, model: Any, kind: str = KIND) -> BackgroundDeepScan | None:
        """Start the deep scan of the model's `kind` set in the background (loading the set first), or return the
        one running or done; None for a set trained on a list of texts (set_corpus). Resumes a stopped one."""
        ts, _ = self.load(model, kind)
        with self._lock:
            return self._start_deep(model, kind, ts)

    def _start_deep(self, model: Any, kind: str, ts: Any) -> BackgroundDeepScan | None:
        """Holding self._lock: the running (or finished) deep scan of the set, else a new one started."""
        key = (self._key(model), kind)
        job = self._deep.get(key)
        if job is not None and (job.running or job.result is not None):
            return job
        corpus = set_corpus(model, kind)
        if corpus is None:
            return None
        job = BackgroundDeepScan(model, ts, kind, corpus=corpus, on_done=lambda found: self._use_deep(model, kind,
                                                                                                    found))
        self._deep[key] = job
        return job.start()

    def _use_deep(self, model: Any, kind: str, found: tuple[Any, list[str]]) -> None:
        """The finished deep scan: every layer's card reads it from now on, in every session (its note says so), and
        its labels are kept for deep_labels. Runs in the scan's thread."""
        try:
            labels = load_deep_labels(model, kind)
        except Exception:  # noqa: BLE001 - unreadable labels: the cards still read the scan
            labels = None
        with self._lock:
            _, names = self._loaded[(self._key(model), kind)]
            self._deep_labels[(self._key(model), kind)] = labels
            self._scan_problems[(self._key(model), kind)] = None
        for name in names.values():
            provide_feature_scan(model, self.saes.get(model, name), found)

    def deep_scan(self, model: Any, kind: str = KIND) -> BackgroundDeepScan | None:
        """The model's `kind` set's background deep scan started by this server (running, done or stopped), or None."""
        with self._lock:
            return self._deep.get((self._key(model), kind))

    def deep_scan_status(self, model: Any, kind: str = KIND) -> str:
        """One line on the set's deep scan: its bar while it runs (shared.progress_line of its slmviz.progress
        update), done, cancelled or why it stopped; or that the cards read the small scan until one is built."""
        job = self.deep_scan(model, kind)
        if job is None:
            return "The cards read the set's small scan; its deep scan has not been started."
        if job.running and not job.cancelled:
            return progress_line(job.update, "Deep scan (the cards read the small scan until it is done)")
        return job.status()

    def cancel_deep_scan(self, model: Any, kind: str = KIND) -> str:
        """Stop the set's deep scan at its next batch (it resumes from its last finished shard when started again)."""
        job = self.deep_scan(model, kind)
        if job is None or not job.running:
            return "No deep scan of this set is running."
        job.cancel()
        return ("Cancelling the deep scan: it stops at its next batch and resumes from its last shard when started "
                "again.")

    def deep_labels(self, model: Any, kind: str = KIND) -> Any:
        """The set's deep scan's LabelTable (labels and their measured scores), or None before it exists or where it
        cannot be read."""
        key = (self._key(model), kind)
        with self._lock:
            if self._deep_labels.get(key) is not None:
                return self._deep_labels[key]
        try:
            labels = load_deep_labels(model, kind)
        except Exception:  # noqa: BLE001 - a damaged table: no labels, the cards say which scan they read
            return None
        with self._lock:
            self._deep_labels[key] = labels
        return labels

    def scan_problem(self, model: Any, kind: str) -> str | None:
        """Why the cards of the model's loaded `kind` set do not read its prepared scan ("it has no prepared scan",
        or that it could not be read and why), or None: they read it, or the set is not loaded yet (the first graph
        over it loads it and reads its scan)."""
        with self._lock:
            return self._scan_problems.get((self._key(model), kind))

    def use_scan(self, model: Any, kind: str, found: tuple[Any, list[str]]) -> None:
        """A rebuilt scan of the loaded `kind` set: each layer's card reads it from now on (saying it was rebuilt),
        in every session, without a restart; the set's scan_problem is cleared."""
        _, names = self.load(model, kind)
        for name in names.values():
            provide_feature_scan(model, self.saes.get(model, name), found, rebuilt=True)
        with self._lock:
            self._scan_problems[(self._key(model), kind)] = None

    def args(self, model: Any, kind: str = KIND) -> dict[str, Any]:
        """The recipe a Build button trains `kind` with: the model's own, with $SLMVIZ_SET_RECIPE over it."""
        overrides = recipe_overrides()
        try:
            return recipe(model, kind, overrides)
        except ValueError:
            what = "quick" if kind == QUICK else "full"
            raise ValueError(f"{model.name} has no recipe for a {what} transcoder set; whoever starts the server can "
                             f"give one: {RECIPE_ENV}='{{\"d_sae\": ..., \"k\": ..., \"tokens\": ...}}' "
                             f"({', '.join(REQUIRED)} at least; slmviz.train_transcoders' arguments)") from None

    def panel(self, model: Any, kind: str = KIND) -> tuple[bool, str]:
        """(whether to show `kind`'s Build button, the status line) for the model. The full set's panel shows while
        the full set is not there; the quick set's while neither is and the model has a quick recipe."""
        if set_ready(model, KIND) or set_ready(model, kind):
            return False, ""
        try:
            a = self.args(model, kind)
        except ValueError as e:
            if kind == QUICK:
                return False, ""  # no quick recipe for this model: the full set's panel says how to get a set
            return True, f"**{model.name} has no full transcoder set yet**. {e}"
        what = "quick" if kind == QUICK else "full"
        return True, (f"**{model.name} has no {what} transcoder set yet**, so the graph's layers without a "
                      f"transcoder are all error nodes. Build it: per-layer transcoders at all {model.cfg.n_layers} "
                      f"layers, {a['d_sae']:,} features each, k {a['k']}, {a['tokens']:,} tokens (a long job: other "
                      "sessions go on; Cancel keeps the checkpoint and Build resumes it).")

    @readable_errors
    def offer(self, source: str | None) -> tuple:
        """The build panel for the session's model (its Build and Cancel buttons, its status line)."""
        shown, text = self.panel(self.ctx.model(source))
        return gr.update(visible=shown), gr.update(visible=shown), text

    @readable_errors
    def offer_quick(self, source: str | None) -> tuple:
        """The quick set's build panel for the session's model (its Build and Cancel buttons, its status line)."""
        shown, text = self.panel(self.ctx.model(source), QUICK)
        return gr.update(visible=shown), gr.update(visible=shown), text

    @readable_errors
    def build(self, source: str | None, request: gr.Request) -> Iterator[tuple]:
        """Train (or resume) the model's full set as a shared long job; then offer it in the picker, alone."""
        yield from self._build(KIND, source, request)

    @readable_errors
    def build_quick(self, source: str | None, request: gr.Request) -> Iterator[tuple]:
        """Train (or resume) the model's quick set as a shared long job; then offer it in the picker, alone."""
        yield from self._build(QUICK, source, request)

    def _start(self, model: Any, kind: str, work: Callable[..., Any], who: str) -> Any:
        """Join (or start) the model's build of `kind`. One build per model at a time, whatever its kind: a build of
        the other kind while one runs is refused, saying which (the two would share the cores for hours, and each
        writes its own checkpoint, so neither is at risk; the second simply waits for the first to finish)."""
        with self._lock:
            running = self._building.get(self._key(model))
            if running is not None and running[0] != kind and not running[1].done.is_set():
                raise ValueError(f"The {set_label(model, running[0])} of {model.name} is being built now (one build "
                                 f"per model at a time): press Build again for the {set_label(model, kind)} once it "
                                 "is done, or cancel that build first")
            job = RUNNER.join((BUILD_KIND, self._key(model), kind), work, who, kind=BUILD_KIND)
            self._building[self._key(model)] = (kind, job)
            return job

    def _build(self, kind: str, source: str | None, request: gr.Request) -> Iterator[tuple]:
        """The build's one bar is its status line (shared.progress_line: phase, count, time left from the measured
        rate), not gr.Progress's overlay, which would cover the picker and restart its timer at every report. Build
        is disabled while the job runs (given back on an error) and Cancel enabled."""
        model = self.ctx.model(source)
        args = self.args(model, kind)
        who = session(request)

        def work(progress: Progress) -> str:
            resumed = trained_tokens(prepared_dir(model, kind))  # where Build resumes a cancelled build
            since = f", resumed from its checkpoint at {resumed:,} tokens per layer" if resumed else ""
            ts = prepare_transcoders(model, kind, progress=progress.part("build", 0.98), **args)
            progress.part("loading the set", 1.0).say(repr(ts))
            self.load(model, kind)
            return repr(ts) + since

        job = self._start(model, kind, work, who)
        busy = (gr.update(interactive=False), gr.update(interactive=True))
        yield gr.skip(), progress_line(None, "Building"), *busy
        said = ""
        try:
            for _ in wait_or_say(job, who, None, "Cancelled; the checkpoint is kept: press Build to resume from it"):
                line = progress_line(job.update, "Building") if job.update is not None else f"Building: {job.desc}"
                if line != said:
                    said = line
                    yield gr.skip(), line, gr.skip(), gr.skip()
        except Exception:
            yield gr.skip(), gr.skip(), gr.update(interactive=True), gr.skip()  # Build again; the message says why
            raise
        label = set_label(model, kind)
        yield (gr.CheckboxGroup(choices=self.offered(model), value=[label]),
               f"Built {job.result}: pick **{label}** and build the graph.", gr.update(visible=False),
               gr.update(visible=False))

    def cancel(self, request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=BUILD_KIND)  # also for an API client, whose request Gradio cannot stop
        return "Cancelled; the checkpoint is kept: press Build to resume from it."

    def cancel_and_offer(self, request: gr.Request) -> tuple:
        """Cancel, and give Build back (the running build disabled it): for a Cancel wired to (status, Build)."""
        return self.cancel(request), gr.update(interactive=True)
