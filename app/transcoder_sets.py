"""A model's full transcoder set in the Circuits tab: offered as one choice of the attribution graph, or built.

The set is the one `slmviz prepare --transcoders plt` makes (slmviz.features.prepared): a per-layer transcoder at
every layer, kept in $SLMVIZ_CACHE/transcoders/{model}/plt. When it is there, the tab's transcoder picker offers it
as one choice ("full set: 30 per-layer transcoders"), picked alone (every layer already has its transcoder, so a
single transcoder beside it would be a second one for its layer). It is loaded once per model and kept in memory
(SmolLM2's: about 600 MB), and each layer's coder is pinned in the Features tab's SAE store under the set's name for
that layer (`{set name}/layer_{L}`), so a node's feature card and the workbench find it like any transcoder.

When it is not there, the tab offers to build it: a long job in app/scan_jobs.py's RUNNER worker (other sessions'
requests are served meanwhile), shared by every session that presses Build for the same model, its progress in
gr.Progress and the status line: the model's own chat and prose written first when the recipe's corpus is "mixed"
(once per model, features.generated_corpus), then the tokens trained per layer with the layers' mean and worst
explained variance, then the feature scan prepared with the set. Cancel stops it at the
next training step, the checkpoint stays, and Build again resumes from it (train_transcoders' resume).

The recipe is the model's fixed one (features.prepared.RECIPES); $SLMVIZ_SET_RECIPE (JSON, set by whoever starts the
server) overrides it, and is what gives a model without a recipe its set (`d_sae`, `k`, `tokens`, and `corpus`: a
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

from slmviz.features.dashboard import acts_hook
from slmviz.features.generated_corpus import chat_corpus
from slmviz.features.prepared import CORPUS, REQUIRED, load_set_scan, prepare_transcoders, recipe
from slmviz.features.transcoder_io import CT_CONFIG, SET_FILE, load_transcoders, prepared_dir

from .corpus_tab import SCANS, session
from .handlers import Handlers, readable_errors
from .scan_jobs import RUNNER, JobCancelled, wait

KIND = "plt"  # the prepared set the tab offers ("clt" comes with the cross-layer transcoders)
RECIPE_ENV = "SLMVIZ_SET_RECIPE"
BUILD_KIND = "transcoder-set"  # the build's Cancel leaves only this kind of job
# A graph over the full set keeps at most this many features, the most influential (attribution_graph's
# max_feature_nodes, circuit-tracer's option; docs/features.md's example value): with 30 layers of k=64 features a
# 16-token prompt has ~30k active ones, whose dense adjacency alone would be ~3.6 GB, past the tab's 4 GiB budget.
MAX_FEATURE_NODES = 4096


def set_ready(model: Any) -> bool:
    """Whether the model's prepared set is there (a finished run: its set file is written at the end)."""
    folder = prepared_dir(model, KIND)
    return (folder / SET_FILE).is_file() or (folder / CT_CONFIG).is_file()


def set_label(model: Any) -> str:
    """The picker's choice for the model's full set (a prepared set covers every layer). The same before and after
    the set is built: Gradio checks a value against the choices the session's page was built with."""
    return f"full set: {model.cfg.n_layers} per-layer transcoders"


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


class TranscoderSets:
    """The full sets on offer, loaded once per model; the Build and Cancel handlers of the tab's build panel."""

    def __init__(self, handlers: Handlers, features: Any = None,
                 offered: Callable[[Any], list[str]] | None = None):
        self.h = handlers
        self.features = features  # app.features_tab.FeatureHandlers: its SAE store gets the coders pinned
        self.offered = offered or self.choices  # every choice of the picker (the Circuits tab's single ones too)
        self._loaded: dict[str, tuple[Any, dict[int, str]]] = {}  # model key -> (set, {layer: coder name})
        self._lock = threading.Lock()

    @staticmethod
    def _key(model: Any) -> str:
        return f"{model.name}|{model.path}"

    def choices(self, model: Any) -> list[str]:
        """The picker's choice for the model's full set: offered once built, or while it can be built (picked
        then, it says to build it)."""
        if set_ready(model):
            return [set_label(model)]
        try:
            self.args(model)
        except ValueError:
            return []
        return [set_label(model)]

    @staticmethod
    def is_set(model: Any, name: str) -> bool:
        return name == set_label(model)

    def ticked(self, model: Any) -> list[str]:
        """The picker's value when the page loads: the set alone once built."""
        return [set_label(model)] if set_ready(model) else []

    def load(self, model: Any) -> tuple[Any, dict[int, str]]:
        """(the model's full set, {layer: its coder's name}), loaded on first use and kept; every coder pinned in
        the Features tab's store under that name."""
        self.check(model)
        return self._load(model)

    @staticmethod
    def check(model: Any) -> None:
        if not set_ready(model):
            raise ValueError(f"{model.name} has no {set_label(model)} yet: press 'Build the full transcoder set' "
                             "(it is trained once, then kept in $SLMVIZ_CACHE), or pick single transcoders")

    @readable_errors
    def refresh(self, source: str | None) -> Any:
        """On page load: tick the set when it was built since the server started (else leave the picker)."""
        ticked = self.ticked(self.h.model(source))
        return gr.update(value=ticked) if ticked else gr.skip()

    def _load(self, model: Any) -> tuple[Any, dict[int, str]]:
        key = self._key(model)
        with self._lock:  # one load per model, however many sessions ask at once
            if key not in self._loaded:
                ts = load_transcoders(KIND, model=model)
                names = {layer: ts.coder_name(layer) for layer in ts.layers}
                scanned = load_set_scan(model, KIND)  # prepared with the set: no card waits for a scan
                if self.features is not None:
                    from .features_tab import DASHBOARD_ROWS, TOP_K

                    for layer, name in names.items():
                        entry = self.features.saes.pin(model, name, ts.coder(layer))
                        if scanned is not None:
                            SCANS.provide(model, [acts_hook(entry.sae)], scanned, TOP_K, entry.key + DASHBOARD_ROWS)
                self._loaded[key] = (ts, names)
            return self._loaded[key]

    def args(self, model: Any) -> dict[str, Any]:
        """The recipe the Build button trains with: the model's own, with $SLMVIZ_SET_RECIPE over it."""
        overrides = recipe_overrides()
        try:
            return recipe(model, KIND, overrides)
        except ValueError:
            raise ValueError(f"{model.name} has no recipe for a full transcoder set; whoever starts the server can "
                             f"give one: {RECIPE_ENV}='{{\"d_sae\": ..., \"k\": ..., \"tokens\": ...}}' "
                             f"({', '.join(REQUIRED)} at least; slmviz.train_transcoders' arguments)") from None

    def panel(self, model: Any) -> tuple[bool, str]:
        """(whether to show the Build button, the status line) for the model: shown while no set is there."""
        if set_ready(model):
            return False, ""
        try:
            a = self.args(model)
            what = (f"Build it: per-layer transcoders at all {model.cfg.n_layers} layers, {a['d_sae']:,} features "
                    f"each, k {a['k']}, {a['tokens']:,} tokens (a long job: other sessions go on; Cancel keeps "
                    "the checkpoint and Build resumes it).")
        except ValueError as e:
            what = str(e)
        return True, (f"**{model.name} has no full transcoder set yet**, so the graph's layers without a transcoder "
                      f"are all error nodes. {what}")

    @readable_errors
    def offer(self, source: str | None) -> tuple:
        """The build panel for the session's model (its Build and Cancel buttons, its status line)."""
        shown, text = self.panel(self.h.model(source))
        return gr.update(visible=shown), gr.update(visible=shown), text

    @readable_errors
    def build(self, source: str | None, request: gr.Request,
              progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """Train (or resume) the model's full set as a shared long job; then offer it in the picker, alone."""
        model = self.h.model(source, progress)
        args = self.args(model)
        who = session(request)
        n_layers = model.cfg.n_layers

        def work(report: Callable[..., None]) -> str:
            if args.get("corpus", CORPUS) in ("mixed", "chat"):  # the model's own text, written once per model
                chat_corpus(model, progress=lambda done, total: report(
                    0.1 * done / max(total, 1), f"Writing the training corpus, the model's own chat and prose: "
                    f"{done} of {total} seed prompts (once per model; Cancel keeps what is written)"))
            report(0.1, f"Training transcoders at all {n_layers} layers from one forward per batch")

            def trained(stats: dict[str, Any]) -> None:  # raises JobCancelled once no one waits: training stops
                done, total = stats["tokens"] // n_layers, stats["total"] // n_layers
                report(0.1 + 0.8 * stats["tokens"] / max(stats["total"], 1),
                       f"trained {done:,} of {total:,} tokens per layer, mean explained variance "
                       f"{stats['explained_variance']:.3f}, worst layer {stats['worst_explained_variance']:.3f}")

            def scanned(done: int, total: int) -> None:
                report(0.9 + 0.08 * done / max(total, 1), f"Scanning the set's features over {done:,} of {total:,} "
                       "documents (their cards' top contexts, prepared once)")

            prepare_transcoders(model, KIND, progress=trained, scan_progress=scanned, **args)
            report(0.98, "Loading the set")
            ts, _ = self.load(model)
            return repr(ts)

        job = RUNNER.join((BUILD_KIND, self._key(model)), work, who, kind=BUILD_KIND)
        said = ""
        try:
            for _ in wait(job, who, progress):
                if job.desc != said:
                    said = job.desc
                    yield gr.skip(), f"Building: {said}", gr.skip(), gr.skip()
        except JobCancelled:
            raise gr.Error("Cancelled; the checkpoint is kept: press Build to resume from it",
                           print_exception=False) from None
        label = set_label(model)
        yield (gr.CheckboxGroup(choices=self.offered(model), value=[label]),
               f"Built {job.result}: pick **{label}** and build the graph.", gr.update(visible=False),
               gr.update(visible=False))

    def cancel(self, request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=BUILD_KIND)  # also for an API client, whose request Gradio cannot stop
        return "Cancelled; the checkpoint is kept: press Build to resume from it."
