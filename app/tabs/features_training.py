"""The Features tab's "Train an SAE" panel: slmviz.train_sae on a hook of the session's model, in the browser.

It trains an SAE (a transcoder when a second hook is given) over the bundled corpus, the broad one or "balanced"
(half broad, half the model's own chat and prose, which the job writes first when this model has none yet), at
most MAX_TRAIN_TOKENS tokens. It runs as a long job of app/jobs.py, so other sessions' requests are served while it
trains; gr.Progress and the status line show its loss, explained variance, L0 and dead fraction after every step,
and Cancel stops it at its next step (the request's wait is closed, or, over the API, /sae_train_cancel leaves the
job). The SAE it trains is offered to that session alone (app/saes.py's SAEStore.add_trained) and picked.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gradio as gr

import slmviz
from slmviz.corpora.named import MODEL_WRITTEN
from slmviz.hooks import layer_hook_name
from slmviz.progress import ProgressUpdate

from ..jobs import RUNNER, JobProgress
from ..models import AppContext
from ..saes import SAEStore
from ..shared import (
    Queues,
    busy_while,
    guard_number,
    progress_line,
    readable_errors,
    session,
    wait_or_say,
    write_model_corpus,
)

MAX_TRAIN_TOKENS = 500_000  # what the app trains on: minutes on 2 cores (the bundled SAEs took CPU-hours)
MAX_TRAIN_WIDTH = 16_384
TRAIN_CORPORA = {"bible": "the bundled corpus (King James Bible)",
                 "broad": "broad: Python stdlib, pydoc, package READMEs and licences, the Bible",
                 "balanced": "balanced: half broad, half the model's own chat (the bundled SAEs' corpus; its first "
                             "use writes the chat, ~40 min)"}
JOB_KIND = "train"  # the panel's Cancel leaves only this kind of job


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


def train_detail(stats: dict[str, Any]) -> str:
    """A step's figures beside the progress bar's count of tokens (slmviz.progress's detail)."""
    return (f"loss {stats['loss']:.4g}, explained variance {stats['explained_variance']:.3f}, L0 {stats['l0']:.1f}, "
            f"dead {100 * stats['dead_fraction']:.1f} %, {stats['tokens_per_s']:,.0f} tokens/s")


def count(value: Any, what: str, most: int) -> int:
    """A whole number from 1 to `most`, or a message naming `what`."""
    if value is None or value == "" or not float(value).is_integer() or not 1 <= int(value) <= most:
        raise ValueError(f"{what} must be a whole number from 1 to {most:,}, got {value!r}")
    return int(value)


class TrainHandlers:
    """The panel's Train and Cancel; models come from the page's AppContext, the SAE goes to the SAEStore."""

    def __init__(self, ctx: AppContext, saes: SAEStore):
        self.ctx = ctx
        self.saes = saes

    @readable_errors
    def train(self, hook: str, hook_out: str, width: float | None, k: float | None, tokens: float | None,
              corpus: str, source: str | None, request: gr.Request) -> Iterator[tuple]:
        """Train an SAE (a transcoder when hook_out is given) as a long job in the RUNNER worker; the status line
        is its one progress bar (the tokens trained, the time left) with loss, explained variance, L0 and dead
        fraction after every step. When done, the
        SAE is offered in this session's picker (#feature-sae) and picked."""
        model = self.ctx.model(source)
        who = session(request)
        hook, out_hook = (hook or "").strip(), (hook_out or "").strip() or None
        if not hook:
            raise ValueError("Type the hook the SAE reads, e.g. blocks.3.hook_resid_post (or blocks.3.mlp.hook_in "
                             "with blocks.3.hook_mlp_out for a transcoder)")
        d_sae = count(width, "width", MAX_TRAIN_WIDTH)
        k = count(k, "k", d_sae)
        n = count(tokens, "tokens", MAX_TRAIN_TOKENS)
        if corpus not in TRAIN_CORPORA:
            raise ValueError(f"Pick a corpus: one of {', '.join(TRAIN_CORPORA)}")
        batch = 1024 if n < 16_384 else 4096
        kw = dict(hook_out=out_hook, architecture="batchtopk" if out_hook else "topk", lr=2e-3, batch_tokens=batch,
                  buffer_tokens=min(65_536, max(batch, n)), dead_window=max(batch, min(100_000, n // 4)))

        def work(progress: JobProgress) -> slmviz.SAE:
            out = Path(tempfile.mkdtemp(prefix="slmviz-train-"))
            written = corpus in MODEL_WRITTEN
            try:
                write_model_corpus(model, corpus, progress.part("chat corpus", 0.3 if written else 0.0))
                training = progress.part("training", 1.0)
                training.say(f"reading {TRAIN_CORPORA[corpus]}")

                def trained(u: ProgressUpdate) -> None:  # the stats kept beside the line: the page's chart reads them
                    progress.publish(u.stats)
                    training.update(u.done, u.total, u.unit, train_detail(u.stats), u.stats)

                return slmviz.train_sae(model, hook=hook, corpus=train_corpus(corpus, model), d_sae=d_sae, k=k,
                                        tokens=n, out=out, checkpoint_every=float("inf"), **kw, progress=trained)
            finally:
                shutil.rmtree(out, ignore_errors=True)  # the SAE is kept in memory for this session

        job = RUNNER.submit(work, who, kind=JOB_KIND)
        yield "Queued: training starts when the long job ahead of it (if any) is done.", gr.skip()
        said = ""
        for _ in wait_or_say(job, who, None, "Training was cancelled; press Train to start again"):
            line = progress_line(job.update, "Training") if job.update is not None else f"Queued: {job.desc}"
            if line != said:  # one bar for the job (its phase, count, EV and time left), in the status line
                said = line
                yield line, gr.skip()
        entry = self.saes.add_trained(model, who, job.result)
        line = train_line(job.partial) if job.partial is not None else ""
        yield (f"Trained **{entry.name}** on {n:,} tokens ({line}). It is picked in the SAE list above, for this "
               "session only.", gr.Dropdown(choices=self.saes.names(model, who), value=entry.name))

    @staticmethod
    def cancel(request: gr.Request) -> str:
        RUNNER.leave(session(request), kind=JOB_KIND)  # also for an API client, whose request Gradio cannot stop
        return "Training cancelled."


def build_training_panel(ctx: AppContext, saes: SAEStore, source: gr.State, picker: gr.Dropdown,
                         queues: Queues) -> None:
    """The panel, inside the Features tab's layout; a trained SAE is picked in `picker` (#feature-sae)."""
    th = TrainHandlers(ctx, saes)
    layer = ctx.store.get().cfg.n_layers // 2
    with gr.Accordion("Train an SAE on this model (minutes; other sessions keep being served)", open=False):
        with gr.Row():
            hook = gr.Textbox(value=layer_hook_name(layer, "hook_resid_post"), label="hook it reads",
                              elem_id="sae-train-hook", scale=3)
            hook_out = gr.Textbox(value="", label="hook it predicts (a transcoder; empty: an SAE)",
                                  placeholder=layer_hook_name(layer, "hook_mlp_out"), elem_id="sae-train-hook-out",
                                  scale=3)
        with gr.Row():
            width = gr.Number(value=2048, precision=0, label="width (features)", elem_id="sae-train-width")
            k = gr.Number(value=32, precision=0, label="k (active per token)", elem_id="sae-train-k")
            tokens = gr.Number(value=100_000, precision=0, label="tokens", elem_id="sae-train-tokens")
            corpus = gr.Radio([(v, c) for c, v in TRAIN_CORPORA.items()], value="bible", label="corpus",
                              elem_id="sae-train-corpus")
        with gr.Row():
            train_btn = gr.Button("Train", variant="primary", elem_id="sae-train-run")
            cancel_btn = gr.Button("Cancel", elem_id="sae-train-cancel")
        status = gr.Markdown(elem_id="sae-train-status")
        guard_number(width, "The width", lo=1, whole=True)
        guard_number(k, "k", lo=1, whole=True)
        guard_number(tokens, "The tokens", lo=1, hi=MAX_TRAIN_TOKENS, whole=True)

    # Train is disabled while its job runs (the status line is its progress); done, failed or cancelled, it is back
    trained = busy_while(train_btn, cancel_btn, lambda: train_btn.click(
        th.train, [hook, hook_out, width, k, tokens, corpus, source], [status, picker], api_name="sae_train",
        show_progress="hidden", **queues.jobs))
    cancel_btn.click(th.cancel, None, status, cancels=[trained], api_name="sae_train_cancel", **queues.light)
