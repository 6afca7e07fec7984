"""Helpers every tab uses: readable errors, figures and tables for Gradio, waiting for a long job, the page's
click snippets, and the files a handler hands back. No layout, no model code.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
from gradio.components.plot import PlotData

import slmviz
from slmviz import plots
from slmviz.corpora.generated import chat_corpus, quick_corpus
from slmviz.corpora.named import MODEL_WRITTEN
from slmviz.progress import Progress, ProgressUpdate

from .jobs import Job, JobCancelled, wait

log = logging.getLogger("slmviz.app")

OUTPUT_TTL_S = 3600
# The prompt pair the Patch and Circuits tabs start with: an indirect-object sentence with its second name swapped.
EXAMPLE_CLEAN = "When Mary and John went to the store, John gave a drink to"
EXAMPLE_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
EXAMPLE_ANSWER, EXAMPLE_WRONG = " Mary", " John"


@dataclass(frozen=True)
class Queues:
    """The page's request queues, each as an event listener's keyword arguments (its concurrency_id and limit):
    `model` (short model work), `light` (no model run), `jobs` (waiting for a long job of app/jobs.py), `load`
    (loading a model), `decode` (seconds of decoding). app/main.py says why each is sized as it is."""

    model: dict[str, Any]
    light: dict[str, Any]
    jobs: dict[str, Any]
    load: dict[str, Any]
    decode: dict[str, Any]


# --- errors --------------------------------------------------------------------------------------
READABLE_ERRORS = (
    slmviz.PromptError, slmviz.UnsupportedModelError, slmviz.WeightsError, slmviz.TraceFormatError,
    ValueError, TypeError, KeyError, FileNotFoundError, FloatingPointError, IndexError,
)


def readable_message(e: BaseException) -> str:
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return str(text) or type(e).__name__


def readable_errors(fn: Callable) -> Callable:
    """Turn every exception into a gr.Error with a one-line message (never a traceback in the page).

    A user's mistake (READABLE_ERRORS, or a gr.Error raised on purpose) shows in the page as a gr.Warning, not as an
    error: the toast says what to change, and the error itself is raised unseen (visible=False) so that an API
    client still gets it and the request stops. The server log gets one line for it; a real fault (anything else)
    keeps its traceback there."""

    def convert(e: Exception) -> gr.Error:
        if isinstance(e, (gr.Error, *READABLE_ERRORS)):
            message = e.message if isinstance(e, gr.Error) else readable_message(e)
            if isinstance(e, gr.Error) and not e.visible:
                return e
            log.warning("user mistake in %s: %s", fn.__name__, message)
            gr.Warning(message)
            return gr.Error(message, print_exception=False, visible=False)
        log.exception("unexpected error in %s", fn.__name__)
        return gr.Error(f"Something went wrong ({type(e).__name__}: {e}). The app is still running; "
                        "try another input.", print_exception=False)

    if inspect.isgeneratorfunction(fn):
        @functools.wraps(fn)
        def gen_wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
            try:
                yield from fn(*args, **kwargs)
            except Exception as e:
                raise convert(e) from None

        return gen_wrapper

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise convert(e) from None

    return wrapper


def guard_number(box: gr.Number, what: str, lo: float | None = None, hi: float | None = None, whole: bool = False,
                 empty: str | None = None, above: bool = False) -> None:
    """The app's own range check of a number box, where it is typed: leaving the box (or Enter) with a value out of
    range warns in the app's words, naming the range, and puts back the box's last valid value. `above`: lo itself
    is out of range; `empty`: what an empty box means (None: it must hold a number). The box itself has no
    minimum / maximum (Gradio's check would refuse first, in its generic words, and keep the bad value)."""
    last = gr.State(box.value)
    lo_word = ("above " if above else "at least ") + f"{lo:g}" if lo is not None else ""
    if lo is not None and hi is not None and not above:
        range_words = f"between {lo:g} and {hi:g}"
    else:
        range_words = " and ".join(w for w in (lo_word, f"at most {hi:g}" if hi is not None else "") if w)
    kind = "a whole number" if whole else "a number"
    rule = f"{what} must be {kind}{' ' + range_words if range_words else ''}" + (
        f", or empty for {empty}" if empty else "")

    def check(value: Any, previous: Any) -> tuple:
        if value is None or value == "":
            if empty is not None:
                return gr.skip(), None
        else:
            x = float(value)
            if (not whole or x.is_integer()) and (lo is None or (x > lo if above else x >= lo)) and (
                    hi is None or x <= hi):
                return gr.skip(), value
        back = "empty" if previous in (None, "") else f"{previous:g}"
        log.warning("user mistake in %s: %s, got %s", what, rule, value)
        gr.Warning(f"{rule}; got {value if value not in (None, '') else 'nothing'}. It is back to {back}.")
        return previous, previous

    box.blur(check, [box, last], [box, last], api_visibility="private")  # queued: a warning travels on the queue


def busy_while(button: gr.Button, cancel: gr.Button, start: Callable[[], Any]) -> Any:
    """Bind a long job to `button` with `start()` (which calls `button.click(...)`) and return its event, with
    `button` disabled from its press until the job ends (done, failed or cancelled), so it is not asked for twice;
    Cancel stays enabled throughout.

    The listener that disables the button is bound before the job's own, because the page runs the listeners of one
    trigger in the order they were bound, each to its end (Gradio 6's frontend, Blocks.dispatch: it awaits a queued
    listener's whole stream before it starts the next). Bound after the job, it disabled the button only once the
    job had ended, at the moment the job's `.then` enabled it again; the two unqueued requests raced, and Run often
    stayed disabled after the run (tests/test_busy_browser.py)."""
    off, on = (lambda: gr.update(interactive=False)), (lambda: gr.update(interactive=True))
    button.click(off, None, button, api_visibility="private", queue=False)
    job = start()
    job.then(on, None, button, api_visibility="private", queue=False)
    cancel.click(on, None, button, api_visibility="private", queue=False)
    return job


# --- figures and tables --------------------------------------------------------------------------
def to_plot(fig: Any) -> PlotData:
    """A plotly figure for gr.Plot, carrying plots.FIGURE_CONFIG (modebar PNG download kept on)."""
    spec = json.loads(fig.to_json())
    spec["config"] = plots.FIGURE_CONFIG
    return PlotData(type="plotly", plot=json.dumps(spec))


def display_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """JSON-safe table: ±inf/NaN floats become text, missing values blank."""
    out = frame.copy()
    for col in out.columns:
        out[col] = [display_cell(v) for v in out[col]]
    return out


def display_cell(v: Any) -> Any:
    """One table cell as display_frame shows it: rounded to 4 places, ±inf as ±∞, NaN and missing blank."""
    if v is None or v is pd.NA:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if math.isinf(v):
            return "∞" if v > 0 else "-∞"
        return round(v, 4)
    return v


def parse_thresholds(node_threshold: Any, edge_threshold: Any) -> tuple[float, float]:
    """The attribution graph's two pruning sliders as (node, edge) fractions of the influence, each in (0, 1]."""
    values = []
    for what, v in (("node", node_threshold), ("edge", edge_threshold)):
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"The {what} threshold must be a number in (0, 1], got {v!r}") from None
        if not 0 < x <= 1:
            raise ValueError(f"The {what} threshold must be in (0, 1] (a fraction of the influence), got {x}")
        values.append(x)
    return values[0], values[1]


# --- sessions and long jobs ----------------------------------------------------------------------
def session(request: gr.Request | None) -> str:
    """Who waits for a job: the Gradio session (one browser tab, or one gradio_client)."""
    return getattr(request, "session_hash", None) or "anonymous"


def skips(n: int) -> Any:
    """A no-op update of a handler's n outputs (what a generator yields while it waits)."""
    return gr.skip() if n == 1 else tuple(gr.skip() for _ in range(n))


def wait_or_say(job: Job, who: str, progress: Any, cancelled: str) -> Iterator[None]:
    """jobs.wait for a handler: a cancelled job ends the request with the toast `cancelled` (what to press to
    start again), not with an error's traceback. Use as `yield from`, then read job.result."""
    try:
        yield from wait(job, who, progress)
    except JobCancelled:
        raise gr.Error(cancelled, print_exception=False) from None


def write_model_corpus(model: Any, corpus: str, progress: Progress, share: float | None = None) -> None:
    """In a long job, first write the model's own chat and prose when `corpus` is made of it
    (corpora.MODEL_WRITTEN; once per model, kept on disk), reported to `progress` (a part of the job: "chat corpus
    3 / 9 seed"; given a `share`, the next `share` of the job's progress) after each batch of seed prompts. A Cancel
    stops it between batches and keeps what is written."""
    if share is not None:
        progress = progress.part("chat corpus", share)
    if corpus not in MODEL_WRITTEN:
        return
    write = quick_corpus if corpus == "quick" else chat_corpus  # the quick set's: a few of the chat corpus's seeds
    write(model, progress=progress)


def progress_line(update: ProgressUpdate | None, doing: str, cells: int = 24) -> str:
    """A job's one bar as the status line shows it (Markdown): `████░░░░` 42 % · the update's phase, count, detail
    and time left (measured from the job's own rate, not Gradio's timer). Never an overlay over the controls."""
    if update is None:
        return f"{doing}: starting"
    filled = round(update.fraction * cells)
    return f"{doing}: `{'█' * filled}{'░' * (cells - filled)}` **{update.fraction:.1%}** · {update.text()}"


# --- files handed to the page --------------------------------------------------------------------
class OutputFolder:
    """Files the server hands back (saved traces, graph JSONs): one fresh folder per request under one temporary
    folder, made on first use and removed when the process exits; folders older than OUTPUT_TTL_S go."""

    def __init__(self) -> None:
        self._root: Path | None = None

    def path(self, name: str) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="slmviz-app-"))
            atexit.register(shutil.rmtree, self._root, True)
        now = time.time()
        for old in self._root.iterdir():
            if now - old.stat().st_mtime > OUTPUT_TTL_S:
                shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(dir=self._root)) / name


# --- layout pieces ---------------------------------------------------------------------------------
def prompt_pair(prefix: str) -> tuple[gr.Textbox, gr.Textbox]:
    """The clean and corrupted prompt boxes of a patching tab, side by side (#{prefix}-clean, #{prefix}-corrupted),
    filled with the example pair."""
    with gr.Row():
        clean = gr.Textbox(label="clean prompt", value=EXAMPLE_CLEAN, lines=2, elem_id=f"{prefix}-clean")
        corrupted = gr.Textbox(label="corrupted prompt (same number of tokens)", value=EXAMPLE_CORRUPTED, lines=2,
                               elem_id=f"{prefix}-corrupted")
    return clean, corrupted


# --- the page's click snippets -------------------------------------------------------------------
# What a click on a plotly point puts in the box: a JavaScript function of the clicked points returning the text,
# or nothing to ignore the click.
PICK_CELL = "(points) => points[0] && points[0].customdata && Array.from(points[0].customdata).join(', ')"
PICK_NODE = ("(points) => { const p = points.find((p) => p.customdata && p.customdata[0] !== undefined); "
             "return p && String(p.customdata[0]); }")
PICK_FEATURE = ("(points) => { const p = points.find((p) => p.customdata && p.customdata[1] === 'feature'); "
                "return p && String(p.customdata[0]); }")


def plot_click_js(plot_ids: Sequence[str], box_id: str, button_id: str, pick: str = PICK_NODE) -> str:
    """A click on a point of the plots `plot_ids`, as a Gradio event: `pick` turns the clicked points into text,
    which goes into the textbox `box_id`, and then `button_id` is pressed (plotly's click is not a Gradio event;
    a line is clickable only at its end points). Run it on the plot's change: it re-attaches for a few seconds
    after every redraw (Gradio may draw a new plot div), and removeAllListeners keeps one handler per div."""
    selectors = json.dumps([f"#{p} .js-plotly-plot" for p in plot_ids])
    box = json.dumps(f"#{box_id} textarea, #{box_id} input")
    button = json.dumps(f"#{button_id}")
    return f"""
() => {{
  const pick = {pick};
  const attach = (sel) => {{
    const div = document.querySelector(sel);
    if (!div || !div.on) return;
    if (div.removeAllListeners) div.removeAllListeners('plotly_click');
    div.on('plotly_click', (ev) => {{
      const text = pick(ev.points || []);
      const box = document.querySelector({box});
      if (!text || !box) return;
      box.value = text;
      box.dispatchEvent(new Event('input', {{bubbles: true}}));
      setTimeout(() => document.querySelector({button}).click(), 150);
    }});
  }};
  let tries = 0;
  const timer = setInterval(() => {{ {selectors}.forEach(attach); if (++tries > 20) clearInterval(timer); }}, 300);
}}
"""


def html_click_js(css_class: str, *keys: str) -> str:
    """gr.HTML's js_on_load: a click inside an element of `css_class` triggers the HTML's click event with the
    element's numeric data attributes `keys` (what the handler reads from gr.EventData)."""
    data = ", ".join(f"{k}: Number(s.dataset.{k})" for k in keys)
    return (f"element.addEventListener('click', (e) => {{ const s = e.target.closest('.{css_class}'); "
            f"if (s) trigger('click', {{{data}}}); }});")
