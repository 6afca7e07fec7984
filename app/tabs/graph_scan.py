"""The Graph tab's "Rebuild the scan": when the prepared set the graph uses (the full set, the CLT or the quick set)
has a feature scan that is missing or cannot be read, its cards say why (their top contexts then come from the
bundled King James verses), and a button beside the node card rebuilds that scan.

The rebuild is slmviz.features.prepared_scans.prepare_set_scan for that model and set, over the corpus the set was
trained on, as a shared long job of app/jobs.py's worker: other sessions are served meanwhile, every session that
presses it for the same model and set waits for the same job, its progress shows in gr.Progress and the status
line, and Cancel stops it at its next document. The scan is written aside and swapped in whole, so a cancelled or
failed rebuild leaves the old folder as it was. Once done, every card of the loaded set reads the new scan
(TranscoderSets.use_scan), in every session and without a restart, and says it was rebuilt; the session's graph,
pins and supernodes are kept, and the selected node's card is drawn again.

Element ids: #graph-rebuild-scan, #graph-rebuild-scan-cancel, #graph-rebuild-scan-status.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from slmviz.features.prepared_scans import prepare_set_scan
from slmviz.progress import ProgressUpdate

from ..jobs import RUNNER
from ..shared import Queues, readable_errors, session, wait_or_say, write_model_corpus
from ..transcoder_sets import CORPUS, REBUILD_BUTTON, TranscoderSets, set_kind, set_label

JOB_KIND = "set-scan"  # the panel's Cancel leaves only this kind of job
CANCELLED = f"Cancelled; the old scan is left as it was: press '{REBUILD_BUTTON}' to start again"


class ScanRebuild:
    """The handlers of the rebuild panel; the sets (loaded, their scans' state) are the Graph tab's
    TranscoderSets."""

    def __init__(self, sets: TranscoderSets):
        self.sets = sets
        self.ctx = sets.ctx

    @staticmethod
    def in_use(model: Any, names: list[str] | None) -> str | None:
        """The kind of the prepared set among the picker's ticked names (picked alone), or None."""
        return next((kind for kind in (set_kind(model, n) for n in names or []) if kind), None)

    def panel(self, model: Any, names: list[str] | None) -> tuple[bool, str]:
        """(whether to show the button, the status line): shown while the ticked set is loaded and its cards do not
        read its prepared scan (TranscoderSets.scan_problem)."""
        kind = self.in_use(model, names)
        problem = self.sets.scan_problem(model, kind) if kind else None
        if problem is None:
            return False, ""
        return True, (f"**No prepared scan for the cards of the {set_label(model, kind)}**: {problem}, so their top "
                      "contexts come from the bundled King James verses (once a feature's page is opened). "
                      f"'{REBUILD_BUTTON}' scans the set's features over its own corpus again (a long job: other "
                      "sessions go on, the graph stays; Cancel leaves the old scan as it was).")

    @readable_errors
    def offer(self, names: list[str] | None, source: str | None) -> tuple:
        """The panel for the session's ticked set: its button, its Cancel, its status line."""
        shown, text = self.panel(self.ctx.model(source), names)
        return gr.update(visible=shown), gr.update(visible=shown), text

    def corpus(self, model: Any, kind: str, ts: Any) -> Any:
        """What the set's scan reads (prepare_transcoders scans the corpus it trains on): the corpus named in the
        set's metadata, else its recipe's (with $SLMVIZ_SET_RECIPE over it: a list of texts, for a tiny model),
        else the default."""
        named = (getattr(ts, "metadata", None) or {}).get("corpus_name")
        if isinstance(named, str) and named != "custom":
            return named
        try:
            return self.sets.args(model, kind).get("corpus", CORPUS)
        except ValueError:  # no recipe for this model and kind
            return CORPUS

    @readable_errors
    def rebuild(self, names: list[str] | None, source: str | None, request: gr.Request,
                progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """Rebuild the scan of the ticked set as a shared long job; then its cards read it (and the panel hides)."""
        model = self.ctx.model(source, progress)
        kind = self.in_use(model, names)
        if kind is None:
            raise ValueError("Tick a prepared transcoder set (the full set, the cross-layer transcoder or the quick "
                             f"set) and build its graph: '{REBUILD_BUTTON}' rebuilds the scan of the set in use")
        self.sets.check(model, kind)  # not built: a readable error, saying how to build it
        label = set_label(model, kind)
        who = session(request)

        def work(report: Callable[..., None]) -> int | None:
            report(0.0, f"Loading the {label}")
            ts, _ = self.sets.load(model, kind)  # loaded (and its scan read) now if no graph loaded it yet
            if self.sets.scan_problem(model, kind) is None:
                return None  # its cards read its scan already (read when loaded, or rebuilt by another session)
            corpus = self.corpus(model, kind, ts)
            write_model_corpus(model, corpus, report, share=0.05)

            def scanned(u: ProgressUpdate) -> None:  # raises JobCancelled once no one waits: the scan stops
                report(0.05 + 0.93 * u.fraction, f"Scanning the {label}'s features (its cards' top contexts): "
                       f"{u.text()}")

            found = prepare_set_scan(model, ts, kind, corpus=corpus, progress=scanned)  # or the one there, if read
            self.sets.use_scan(model, kind, found)
            return len(found[1])

        job = RUNNER.join((JOB_KIND, f"{model.name}|{model.path}", kind), work, who, kind=JOB_KIND)
        said = ""
        for _ in wait_or_say(job, who, progress, CANCELLED):
            if job.desc != said:
                said = job.desc
                yield gr.skip(), gr.skip(), f"Rebuilding: {said}"
        said = (f"Rebuilt the scan of the {label}: {job.result:,} documents of its own corpus; its cards read it now."
                if job.result is not None else f"The cards of the {label} read its prepared scan: nothing to rebuild.")
        yield gr.update(visible=False), gr.update(visible=False), said

    def cancel(self, request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)  # also for an API client, whose request Gradio cannot stop
        return CANCELLED + "."


class RebuildPanel:
    """The panel's layout (laid out beside the node card by the workbench: `layout`) and its events."""

    def __init__(self, handlers: ScanRebuild, names: gr.CheckboxGroup, source: gr.State, queues: Queues):
        self.handlers, self.names, self.source, self.queues = handlers, names, source, queues
        self.shown: list[Any] = []

    def layout(self) -> Any:
        """The button, its Cancel and the status line, hidden until `offer` shows them; returns the rebuild's
        event (the workbench draws the selected node's card again after it)."""
        status = gr.Markdown(elem_id="graph-rebuild-scan-status")
        with gr.Row():
            button = gr.Button(REBUILD_BUTTON, elem_id="graph-rebuild-scan", visible=False, variant="primary")
            cancel = gr.Button("Cancel the rebuild", elem_id="graph-rebuild-scan-cancel", visible=False)
        self.shown = [button, cancel, status]
        rebuilt = button.click(self.handlers.rebuild, [self.names, self.source], self.shown,
                               api_name="graph_rebuild_scan", **self.queues.jobs)
        cancel.click(self.handlers.cancel, None, status, cancels=[rebuilt], api_name="graph_rebuild_scan_cancel",
                     **self.queues.light)
        return rebuilt

    def offer_after(self, built: Any, choices_changed: Any, refreshed: Any | None) -> None:
        """Show or hide the panel once a graph is built (its set is loaded then), when the picker changes, after
        the model's choices replace the picker's (`choices_changed`), and after the page load's refresh of them
        (`refreshed`: a set another session loaded).

        Why after, not beside, the events that replace the choices: an event started beside them sends the picker's
        old value, and if the new choices land first Gradio refuses it ("Value: 'transcoder_l6' is not in the list
        of choices", an error toast on switching to Gemma)."""
        inputs, light = [self.names, self.source], self.queues.light
        built.then(self.handlers.offer, inputs, self.shown, api_name="graph_rebuild_scan_offer", **light)
        self.names.input(self.handlers.offer, inputs, self.shown, api_visibility="private", **light)
        choices_changed.then(self.handlers.offer, inputs, self.shown, api_visibility="private", **light)
        if refreshed is not None:
            refreshed.then(self.handlers.offer, inputs, self.shown, api_visibility="private")
