"""The slmviz Gradio app: the page's layout and its launch. Each tab is a module of app/tabs/.

Run it with `make app`, `python -m slmviz.cli app [--port N] [--model HUB_ID] [--allow-local-models]`,
or `python app/main.py` (the Hugging Face Space's app_file). It serves 127.0.0.1:7860 by default
($GRADIO_SERVER_PORT or --port override it), runs offline on the bundled model, and its page loads
nothing from any other host (system fonts, plotly.js bundled by Gradio, analytics off). Ctrl-C closes it.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script (a Space's app_file `app/main.py`): import as the package `app`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "app"  # PEP 366: the relative imports below resolve inside app/
    import app  # noqa: F401 - the parent package must be imported before its modules

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no telemetry or version-check requests

import gradio as gr  # noqa: E402 - after the analytics switch above

import slmviz  # noqa: E402

from .models import (  # noqa: E402
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    AppContext,
    ModelStore,
    model_choices,
    model_line,
)
from .saes import SAEStore  # noqa: E402
from .shared import Queues  # noqa: E402
from .tabs.circuits import build_circuits_tab  # noqa: E402
from .tabs.corpus import build_corpus_tab  # noqa: E402
from .tabs.features import FeatureHandlers, build_features_tab  # noqa: E402
from .tabs.graph import build_graph_tab  # noqa: E402
from .tabs.model import ModelHandlers, build_model_tab  # noqa: E402
from .tabs.patch import build_patch_tab  # noqa: E402
from .tabs.run import Example, build_prompt_bar, build_run_tabs, load_examples, model_switch  # noqa: E402
from .tabs.variants import VariantPickers, build_variant_tabs  # noqa: E402
from .variant_fields import faithful_updates  # noqa: E402

DEFAULT_PORT = 7860
MODEL_CONCURRENCY = 1  # one forward pass at a time: two cores, one shared model
LOAD_CONCURRENCY = 1  # one model load at a time, in its own queue: a minute-long first load never holds "model"
# Long work (corpus scans, patch sweeps, feature scans) runs in app/jobs.py's worker, one job at a time; the
# request that waits for it holds a "jobs" slot, never a "model" one, so short requests go on meanwhile.
JOB_WAITERS = 8
# Calls that decode (Generate, Compare's continuations, Steer) or run every preset take seconds, not the fraction
# of a second a Run takes: they wait in a queue of their own, one at a time, so a Run from another session is served
# beside them instead of behind them. Two threads may then use one model at once; its forward keeps no state
# between calls (params.one_thread's thread count is restored by whichever call set it).
DECODE_CONCURRENCY = 1
LIGHT_CONCURRENCY = 4  # re-plotting a stored trace and filling presets never run the model
QUEUES = Queues(
    model={"concurrency_limit": MODEL_CONCURRENCY, "concurrency_id": "model"},
    light={"concurrency_limit": LIGHT_CONCURRENCY, "concurrency_id": "light"},
    jobs={"concurrency_limit": JOB_WAITERS, "concurrency_id": "jobs"},
    load={"concurrency_limit": LOAD_CONCURRENCY, "concurrency_id": "load"},
    decode={"concurrency_limit": DECODE_CONCURRENCY, "concurrency_id": "decode"},
)

THEME = gr.themes.Default(
    font=[gr.themes.Font("system-ui"), gr.themes.Font("ui-sans-serif"), "sans-serif"],
    font_mono=[gr.themes.Font("ui-monospace"), gr.themes.Font("Consolas"), "monospace"],
)
# A failed request's outputs keep what they showed: Gradio would cover each with a white "Error" panel, but the toast
# already says what went wrong (a user's mistake is a warning: app/shared.py's readable_errors).
CSS = """
#status { min-height: 1.5em; }
.field-row { gap: 6px; }
[data-testid="status-tracker"]:has(.error) { display: none !important; }
"""

INTRO = """# slmviz: look inside a small language model, then break it

Type a prompt and press **Run**. Tokens appear below the prompt; the tabs show where each token looks
(**Attention**), how big the residual stream grows (**Residual stream**), what the model would say if it
stopped after each layer (**Logit lens**), and its **Next token** guess. **Break it** flips one of the
conventions a reimplementation can silently get wrong and shows what changes; **Generate** streams text
from the faithful and the broken model side by side."""


def build(ctx: AppContext, examples: list[Example] | None = None) -> gr.Blocks:
    """The page. Every event has an api_name so gradio_client can call it."""
    model = ctx.store.get()
    examples = load_examples() if examples is None else examples
    saes = SAEStore(allow_local=ctx.store.allow_local)
    features = FeatureHandlers(ctx, saes)
    with gr.Blocks(title="slmviz", analytics_enabled=False, delete_cache=(1800, 3600)) as demo:
        source = gr.State("")  # this session's model ("" = the startup model)
        gr.Markdown(INTRO)
        with gr.Row(equal_height=True):
            model_picker = gr.Dropdown(model_choices(ctx.store), value=ctx.store.startup_name(), scale=1,
                                       label="Model (bundled, offline)", elem_id="model-picker", min_width=280)
            model_status = gr.Markdown(model_line(model, ctx.store.startup_note), elem_id="model-status")
        bar = build_prompt_bar(model, examples)
        with gr.Tabs():
            layer, head = build_run_tabs(ctx, examples, bar, source, QUEUES)
            variants = build_variant_tabs(ctx, bar.prompt, bar.chat, source, QUEUES)
            build_patch_tab(ctx, source, QUEUES)
            build_circuits_tab(ctx, source, QUEUES)
            build_graph_tab(ctx, saes, features, source, QUEUES)
            model_tab = build_model_tab(ctx, saes)
            build_corpus_tab(ctx, bar.prompt, source, QUEUES)
            sae_picker = build_features_tab(features, bar.prompt, bar.chat, source, QUEUES)

        def switched(m: slmviz.Model, key: str) -> tuple:
            """Everything on the page that depends on the model, after the status line and the session's source:
            the layer and head pickers, the model picker, the presets that apply, and the variant fields
            (faithful, shown where they apply), and the prompt's limit."""
            layer_update, head_update = model_switch(m)
            preset_update, break_layer_update, break_head_update = VariantPickers.updates(m)
            picked = key or ctx.store.startup_name()
            picker_update = gr.Dropdown(value=picked if picked in [v for _, v in model_choices(ctx.store)] else None)
            return (layer_update, head_update, break_layer_update, break_head_update, picker_update, preset_update,
                    *faithful_updates(m), gr.Textbox(label=f"Prompt (up to {m.max_tokens} tokens)"))

        mh = ModelHandlers(ctx, saes, switched)
        model_outputs = [model_status, source, layer, head, variants.layer, variants.head, model_picker,
                         variants.preset, *variants.fields, bar.prompt]
        model_tab.load.click(mh.load_model, [model_tab.model_box], model_outputs, api_name="load_model",
                             **QUEUES.load)
        model_picker.input(mh.load_model, [model_picker], model_outputs, api_name="pick_model", **QUEUES.load)
        gr.on([model_tab.sae_load.click, model_tab.sae_box.submit], mh.load_sae,
              [model_tab.sae_box, model_tab.sae_subfolder, source], [model_tab.sae_status, sae_picker],
              api_name="load_sae", **QUEUES.load)
    return demo


def launch(
    port: int | None = None,
    host: str = "127.0.0.1",
    allow_local_models: bool = False,
    model: str | None = None,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    prevent_thread_lock: bool = False,
    exit_on_interrupt: bool = False,
) -> gr.Blocks:
    """Load the startup model, build the page and serve it (blocks until Ctrl-C unless prevent_thread_lock).

    port: None → $GRADIO_SERVER_PORT, else 7860. model: a hub id, or a local folder when
    allow_local_models (the CLI's --allow-local-models). Limits are enforced on the server. exit_on_interrupt (the
    CLI's and `python -m app.main`'s): Ctrl-C ends the process within EXIT_GRACE_S, whatever is still running.
    """
    if port is None:
        port = int(os.environ.get("GRADIO_SERVER_PORT", DEFAULT_PORT))
    store = ModelStore(model, allow_local=allow_local_models, max_prompt_tokens=max_prompt_tokens)
    ctx = AppContext(store, max_new_tokens=max_new_tokens)
    print(f"slmviz app: loading {model or 'the default model'} ...", flush=True)
    demo = build(ctx)
    demo.queue(default_concurrency_limit=MODEL_CONCURRENCY, max_size=32)
    poll_queue_less(demo)
    demo.launch(
        server_name=host, server_port=port, theme=THEME, css=CSS, show_error=False, quiet=False,
        prevent_thread_lock=True, footer_links=["api", "settings"], run_history=False,
    )
    if not prevent_thread_lock:
        serve_until_interrupted(demo, exit_on_interrupt)
    return demo


QUEUE_POLL_S = 0.02  # how often an idle queue looks for a new event: what an event may wait before it starts
PROGRESS_POLL_S = 0.05  # how often it looks for a progress update to send: 20 a second at most


def poll_queue_less(demo: gr.Blocks) -> None:
    """Gradio's queue looks for a new event every millisecond while it has none, and for progress to send every
    10 ms (gradio 6.31: Queue.sleep_when_free, progress_update_sleep_when_free), so an idle server wakes a thousand
    times a second: a steady share of a core for nothing, on a laptop and in a Space alike (bench/results/notes.md,
    "Idle servers and pages"). Every QUEUE_POLL_S instead, which a request of this app (a tenth of a second and
    more) does not notice. Attributes of Gradio's queue, set only where they exist."""
    queue = getattr(demo, "_queue", None)
    for name, seconds in (("sleep_when_free", QUEUE_POLL_S), ("progress_update_sleep_when_free", PROGRESS_POLL_S)):
        if isinstance(getattr(queue, name, None), float):
            setattr(queue, name, max(getattr(queue, name), seconds))


def serve_until_interrupted(demo: gr.Blocks, exit_on_interrupt: bool = False) -> None:
    """Block while the app serves; on Ctrl-C (SIGINT) close the whole app, so that the process exits within a second.

    Gradio's own blocking loop (launch without prevent_thread_lock) answers Ctrl-C by stopping only the HTTP server,
    which then waits for the connections still open: the heartbeat stream that every open page and every
    gradio_client session keeps. Only Blocks.close ends those (it sets the app's stop event, and stops the queue
    and Gradio's file-serving thread pool), so each Ctrl-C sat out Gradio's 5 s join of the server's thread.
    Then the interpreter's last garbage collection walks the whole heap (the models, their tokenizers, Gradio,
    plotly: about half a million objects), which takes seconds more on a busy 2-core machine; gc.freeze() moves
    them out of its reach. They are freed with the process all the same, and the atexit handlers still run; launch
    returns after a Ctrl-C only for its caller to end. With `exit_on_interrupt`, exit_within bounds that end.
    Pinned by tests/test_app_shutdown.py.
    """
    interrupted = False
    try:
        while demo.is_running:
            time.sleep(0.1)
    except KeyboardInterrupt:
        interrupted = True
        print("slmviz app: Ctrl-C, closing", flush=True)
        if exit_on_interrupt:
            exit_within(EXIT_GRACE_S)
    demo.close()  # a no-op if something else closed it
    if interrupted:
        gc.freeze()  # the process is about to end (see above)


EXIT_GRACE_S = 3.0  # after Ctrl-C: what closing the app and the atexit handlers (saved traces' cleanup) may take


def exit_within(seconds: float) -> None:
    """End the process `seconds` from now, whatever still runs then (a daemon thread calls os._exit(0)).

    Why: the interpreter's exit waits for every thread that is not a daemon and for every atexit handler, which a
    library can add; a person pressing Ctrl-C on `make app` wants the port back all the same. The app's own cleanup
    normally finishes well inside the grace period, and then the process ends as usual, before this fires. (The
    test servers that once outlived Ctrl-C by 30 s had SIGINT ignored: tests/app_helpers.py, ANSWER_CTRL_C.)"""

    def end() -> None:
        time.sleep(seconds)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    threading.Thread(target=end, name="slmviz exit", daemon=True).start()


if __name__ == "__main__":
    # On a Space, GRADIO_SERVER_NAME is 0.0.0.0 and GRADIO_SERVER_PORT is set by the platform.
    launch(host=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), model=os.environ.get("SLMVIZ_MODEL") or None,
           exit_on_interrupt=True)
