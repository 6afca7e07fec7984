"""The slmviz Gradio app: layout and launch. Handlers live in app/handlers.py.

Run it with `make app`, `python -m slmviz.cli app [--port N] [--model HUB_ID] [--allow-local-models]`,
or `python app/main.py` (the Hugging Face Space's app_file). It serves 127.0.0.1:7860 by default
($GRADIO_SERVER_PORT or --port override it), runs offline on the bundled model, and its page loads
nothing from any other host (system fonts, plotly.js bundled by Gradio, analytics off).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script (a Space's app_file `app/main.py`): import as the package `app`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    __package__ = "app"  # PEP 366: the relative imports below resolve inside app/
    import app  # noqa: F401 - the parent package must be imported before its modules

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # no telemetry or version-check requests

import gradio as gr  # noqa: E402 - after the analytics switch above

from slmviz.model_api import Model  # noqa: E402
from slmviz.plots.trace import NEXT_TOKEN_COLUMNS, STAGE_NAMES  # noqa: E402
from slmviz.variants import BASE  # noqa: E402

from .circuits_tab import build_circuits_tab  # noqa: E402
from .features_tab import FeatureHandlers, build_features_tab, build_sae_loader  # noqa: E402
from .handlers import (  # noqa: E402
    FIELD_CHOICES,
    FIELD_HELP,
    FIELD_LABELS,
    MAX_NEW_TOKENS,
    MAX_PROMPT_TOKENS,
    OWN,
    VARIANT_FIELDS,
    Example,
    Handlers,
    ModelStore,
    applicable_presets,
    default_preset,
    field_applies,
    field_kind,
    head_choices,
    model_line,
    widget_value,
)
from .patch_tab import build_patch_tab  # noqa: E402

EXAMPLES_FILE = Path(__file__).resolve().parent / "examples.json"  # inside the package, so the wheel has it
DEFAULT_PORT = 7860
MODEL_CONCURRENCY = 1  # one forward pass at a time: two cores, one shared model
LOAD_CONCURRENCY = 1  # one model load at a time, in its own queue: a minute-long first load never holds "model"
# Long work (corpus scans, patch sweeps, feature scans) runs in app/scan_jobs.py's worker, one job at a time;
# the request that waits for it holds a "jobs" slot, never a "model" one, so short requests go on meanwhile.
JOB_WAITERS = 8
# Calls that decode (Generate, Compare's continuations, Steer) or run every preset take seconds, not the fraction
# of a second a Run takes: they wait in a queue of their own, one at a time, so a Run from another session is served
# beside them instead of behind them. Two threads may then use one model at once; its forward keeps no state
# between calls (params.one_thread's thread count is restored by whichever call set it).
DECODE_CONCURRENCY = 1
LIGHT_CONCURRENCY = 4  # re-plotting a stored trace and filling presets never run the model

THEME = gr.themes.Default(
    font=[gr.themes.Font("system-ui"), gr.themes.Font("ui-sans-serif"), "sans-serif"],
    font_mono=[gr.themes.Font("ui-monospace"), gr.themes.Font("Consolas"), "monospace"],
)
CSS = """
#status { min-height: 1.5em; }
.field-row { gap: 6px; }
"""

INTRO = """# slmviz: look inside a small language model, then break it

Type a prompt and press **Run**. Tokens appear below the prompt; the tabs show where each token looks
(**Attention**), how big the residual stream grows (**Residual stream**), what the model would say if it
stopped after each layer (**Logit lens**), and its **Next token** guess. **Break it** flips one of the
conventions a reimplementation can silently get wrong and shows what changes; **Generate** streams text
from the faithful and the broken model side by side."""


def load_examples(path: Path = EXAMPLES_FILE) -> list[Example]:
    """The example prompts of app/examples.json: prompt, chat template on/off, what to look for."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [Example(e["prompt"], bool(e.get("chat", False)), e.get("why", "")) for e in data]


def build(handlers: Handlers) -> gr.Blocks:
    """The page. Every event has an api_name so gradio_client can call it."""
    model = handlers.store.get()
    n_layers = model.cfg.n_layers
    first_layer = min(1, n_layers - 1)  # layer 1: past the embedding-only patterns of layer 0
    model_kw = {"concurrency_limit": MODEL_CONCURRENCY, "concurrency_id": "model"}
    light_kw = {"concurrency_limit": LIGHT_CONCURRENCY, "concurrency_id": "light"}
    load_kw = {"concurrency_limit": LOAD_CONCURRENCY, "concurrency_id": "load"}
    scan_kw = {"concurrency_limit": JOB_WAITERS, "concurrency_id": "jobs"}
    decode_kw = {"concurrency_limit": DECODE_CONCURRENCY, "concurrency_id": "decode"}
    features = FeatureHandlers(handlers)
    with gr.Blocks(title="slmviz", analytics_enabled=False, delete_cache=(1800, 3600)) as demo:
        source = gr.State("")  # this session's model ("" = the startup model)
        trace = gr.State(None, time_to_live=3600)  # the last Run's trace, re-plotted without re-running
        gr.Markdown(INTRO)
        with gr.Row(equal_height=True):
            model_picker = gr.Dropdown(handlers.model_choices(), value=handlers.store.startup_name(), scale=1,
                                       label="Model (bundled, offline)", elem_id="model-picker", min_width=280)
            model_status = gr.Markdown(model_line(model, handlers.store.startup_note), elem_id="model-status")
        with gr.Row():
            with gr.Column(scale=4):
                prompt = gr.Textbox(label=f"Prompt (up to {model.max_tokens} tokens)", lines=3, elem_id="prompt",
                                    value="The capital of France is", max_length=model.max_tokens * 16)
            with gr.Column(scale=1, min_width=200):
                chat = gr.Checkbox(label="chat template", value=False, elem_id="chat",
                                   info="Wrap the prompt as one user turn of the instruct model's chat format")
                run_btn = gr.Button("Run", variant="primary", elem_id="run")
        examples = gr.Dropdown([(e.label(), i) for i, e in enumerate(handlers.examples)], value=None,
                               label="Example prompts (pick one, then Run)", elem_id="examples")
        status = gr.Markdown("", elem_id="status")
        tokens = gr.HTML(elem_id="tokens")

        with gr.Tabs():
            with gr.Tab("Attention", id="tab-attention"):
                with gr.Row():
                    layer = gr.Slider(0, n_layers - 1, value=first_layer, step=1, label="layer", elem_id="layer")
                    head = gr.Dropdown(head_choices(model), value="all", label="head", elem_id="head")
                attention_plot = gr.Plot(show_label=False, elem_id="attention-plot")
            with gr.Tab("Residual stream", id="tab-residual"):
                with gr.Row():
                    stages = gr.CheckboxGroup(scale=3, choices=[(label, s) for s, label in STAGE_NAMES.items()],
                                              value=list(STAGE_NAMES), label="stages", elem_id="stages")
                    per_position = gr.Checkbox(label="one line per position", value=False)
                    log_y = gr.Checkbox(label="log scale", value=False)
                    include_first = gr.Checkbox(label="show the first token", value=True,
                                                info="Its norm is often far larger (the attention sink)")
                residual_plot = gr.Plot(show_label=False, elem_id="residual-plot")
            with gr.Tab("Logit lens", id="tab-lens"):
                lens_plot = gr.Plot(show_label=False, elem_id="logit-lens-plot")
            with gr.Tab("Next token", id="tab-next"):
                next_token = gr.Dataframe(label="Most likely next tokens", interactive=False, elem_id="next-token",
                                          headers=list(NEXT_TOKEN_COLUMNS), latex_delimiters=[])
                with gr.Row():
                    save_btn = gr.Button("Save the trace (.safetensors)", elem_id="save-trace")
                    trace_file = gr.File(label="trace (residual stream + attention patterns)", elem_id="trace-file")
            with gr.Tab("Break it", id="tab-break"):
                with gr.Column(elem_id="variant"):
                    with gr.Row():
                        presets = applicable_presets(model)  # only those that change this model
                        preset = gr.Dropdown(presets, value=default_preset(presets), label="preset",
                                             elem_id="variant-preset", scale=2)
                        break_layer = gr.Slider(0, n_layers - 1, value=first_layer, step=1, label="attention layer")
                        break_head = gr.Dropdown(head_choices(model)[1:], value="0", label="attention head")
                        break_new = gr.Slider(1, MAX_NEW_TOKENS, value=20, step=1, label="continuation tokens")
                    description = gr.Markdown(elem_id="variant-description")
                    with gr.Accordion("Fields (a preset fills them; change any to compose your own variant)",
                                      open=False):
                        field_inputs = _variant_fields(model)
                    compare_btn = gr.Button("Compare faithful vs variant", variant="primary", elem_id="compare")
                with gr.Column(elem_id="variant-diff"):
                    verdict = gr.Markdown(elem_id="variant-verdict")
                    with gr.Row():
                        next_faithful = gr.Dataframe(label="faithful: next token", interactive=False,
                                                     headers=list(NEXT_TOKEN_COLUMNS), latex_delimiters=[])
                        next_broken = gr.Dataframe(label="variant: next token", interactive=False,
                                                   headers=list(NEXT_TOKEN_COLUMNS), latex_delimiters=[])
                    kl_plot = gr.Plot(show_label=False, elem_id="kl-plot")
                    overlay_plot = gr.Plot(show_label=False, elem_id="residual-overlay-plot")
                    diff_plot = gr.Plot(show_label=False, elem_id="diff-plot")
                    with gr.Row():
                        att_faithful = gr.Plot(show_label=False, elem_id="attention-faithful")
                        att_broken = gr.Plot(show_label=False, elem_id="attention-variant")
                    with gr.Row():
                        cont_faithful = gr.Textbox(label="faithful: greedy continuation", lines=4, interactive=False)
                        cont_broken = gr.Textbox(label="variant: greedy continuation", lines=4, interactive=False)
                with gr.Accordion("Every preset at once", open=False):
                    gr.Markdown("Runs each preset on the prompt: KL from faithful (nats), how often the top token "
                                "agrees, the first layer whose residual stream moves by more than 1 %, and where "
                                "values stopped being finite.")
                    compare_all_btn = gr.Button("Compare every preset", elem_id="compare-all")
                    all_table = gr.Dataframe(label="every preset against faithful", interactive=False,
                                             elem_id="compare-all-table", latex_delimiters=[])
            with gr.Tab("Generate", id="tab-generate"):
                gr.Markdown("Streams a continuation token by token from the faithful model and from the variant "
                            "set in **Break it**. Temperature 0 is greedy; a seed makes sampling repeatable.")
                with gr.Row():
                    gen_new = gr.Slider(1, MAX_NEW_TOKENS, value=48, step=1, label="max new tokens")
                    temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature")
                    top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)")
                    seed = gr.Number(value=0, precision=0, label="seed")
                gen_btn = gr.Button("Generate", variant="primary", elem_id="generate")
                with gr.Row():
                    gen_faithful = gr.Textbox(label="faithful", lines=10, interactive=False,
                                              elem_id="generate-faithful")
                    gen_broken = gr.Textbox(label="variant", lines=10, interactive=False, elem_id="generate-variant")
            build_patch_tab(handlers, source, model_kw, light_kw, scan_kw)
            build_circuits_tab(handlers, source, model_kw, light_kw, scan_kw, features)
            with gr.Tab("Model", id="tab-model"):
                allowed = "a hub id (owner/name)" + (" or a local folder" if handlers.store.allow_local else "")
                gr.Markdown(f"Load another model ({allowed}), or pick a bundled one above; leave empty for the "
                            "startup model. Supported: llama, qwen2, mistral, qwen3, olmo2 and gemma3_text "
                            "checkpoints in safetensors.")
                with gr.Row():
                    model_box = gr.Textbox(label="model", placeholder="HuggingFaceTB/SmolLM2-135M-Instruct",
                                           elem_id="model-source", scale=4)
                    load_btn = gr.Button("Load", elem_id="load-model", scale=1)
                sae_loader = build_sae_loader(features)
            from .corpus_tab import build_corpus_tab
            build_corpus_tab(handlers, prompt, source, model_kw, light_kw, scan_kw)
            build_features_tab(features, prompt, chat, source, sae_loader, model_kw, light_kw, scan_kw, load_kw,
                               decode_kw)

        # --- events ---
        examples.input(handlers.example, [examples], [prompt, chat], api_name="example", **light_kw)
        run_inputs = [prompt, chat, layer, head, stages, per_position, log_y, include_first, source]
        run_outputs = [tokens, attention_plot, residual_plot, next_token, status, trace]
        ran = gr.on([run_btn.click, prompt.submit], handlers.run, run_inputs, run_outputs, api_name="run", **model_kw)
        ran.success(handlers.logit_lens, [trace], lens_plot, api_name="logit_lens", **model_kw)
        gr.on([layer.change, head.change], handlers.attention, [trace, layer, head], attention_plot,
              api_name="attention", **light_kw)
        residual_inputs = [trace, stages, per_position, log_y, include_first]
        gr.on([w.change for w in residual_inputs[1:]], handlers.residual, residual_inputs, residual_plot,
              api_name="residual", **light_kw)
        save_btn.click(handlers.save_trace, [trace], trace_file, api_name="save_trace", **light_kw)

        preset.change(handlers.preset, [preset, source], [*field_inputs, description], api_name="preset", **light_kw)
        demo.load(handlers.preset, [preset, source], [*field_inputs, description], api_visibility="private")
        compare_btn.click(
            handlers.compare, [prompt, chat, *field_inputs, break_layer, break_head, break_new, source],
            [verdict, next_faithful, next_broken, kl_plot, overlay_plot, diff_plot, att_faithful, att_broken,
             cont_faithful, cont_broken], api_name="compare", **decode_kw)
        compare_all_btn.click(handlers.compare_all, [prompt, chat, source], all_table, api_name="compare_all",
                              **decode_kw)
        gen_btn.click(handlers.generate,
                      [prompt, chat, *field_inputs, gen_new, temperature, top_k, seed, source],
                      [gen_faithful, gen_broken], api_name="generate", **decode_kw)
        model_outputs = [model_status, source, layer, head, break_layer, break_head, model_picker, preset,
                         *field_inputs, prompt]
        load_btn.click(handlers.load_model, [model_box], model_outputs, api_name="load_model", **load_kw)
        model_picker.input(handlers.load_model, [model_picker], model_outputs, api_name="pick_model", **load_kw)
    return demo


def _variant_fields(model: Model) -> list[gr.components.Component]:
    """One input per Variant field, in the dataclass's order, with the docstring's line as help; fields that
    cannot change `model` are hidden (and shown again when a model they apply to is loaded)."""
    inputs = []
    with gr.Row(elem_classes="field-row"):
        for name in VARIANT_FIELDS:
            value, kind = widget_value(name, getattr(BASE, name)), field_kind(name)
            kw = {"label": FIELD_LABELS[name], "info": FIELD_HELP.get(name, ""), "elem_id": f"variant-{name}",
                  "min_width": 220, "visible": field_applies(name, model)}
            if kind == "choice":
                choices = [(c, c) for c in FIELD_CHOICES[name]]
                if getattr(BASE, name) is None:
                    choices.insert(0, ("the checkpoint's own", OWN))
                inputs.append(gr.Radio(choices, value=value, **kw))
            elif kind in ("flag", "keep"):
                if kind == "keep":
                    kw["label"] += " (untick to remove)"
                inputs.append(gr.Checkbox(value=value, **kw))
            else:  # rope_theta: a number, empty = the checkpoint's own base
                kw["label"] += " (empty = the checkpoint's own)"
                inputs.append(gr.Number(value=None, minimum=0, **kw))
    return inputs


def launch(
    port: int | None = None,
    host: str = "127.0.0.1",
    allow_local_models: bool = False,
    model: str | None = None,
    max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    prevent_thread_lock: bool = False,
) -> gr.Blocks:
    """Load the startup model, build the page and serve it (blocks unless prevent_thread_lock).

    port: None → $GRADIO_SERVER_PORT, else 7860. model: a hub id, or a local folder when
    allow_local_models (the CLI's --allow-local-models). Limits are enforced on the server.
    """
    if port is None:
        port = int(os.environ.get("GRADIO_SERVER_PORT", DEFAULT_PORT))
    store = ModelStore(model, allow_local=allow_local_models, max_prompt_tokens=max_prompt_tokens)
    handlers = Handlers(store, max_new_tokens=max_new_tokens, examples=load_examples())
    print(f"slmviz app: loading {model or 'the default model'} ...", flush=True)
    demo = build(handlers)
    demo.queue(default_concurrency_limit=MODEL_CONCURRENCY, max_size=32)
    demo.launch(
        server_name=host, server_port=port, theme=THEME, css=CSS, show_error=False, quiet=False,
        prevent_thread_lock=prevent_thread_lock, footer_links=["api", "settings"], run_history=False,
    )
    return demo


if __name__ == "__main__":
    # On a Space, GRADIO_SERVER_NAME is 0.0.0.0 and GRADIO_SERVER_PORT is set by the platform.
    launch(host=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"), model=os.environ.get("SLMVIZ_MODEL") or None)
