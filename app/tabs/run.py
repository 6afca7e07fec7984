"""The Run tabs: Attention, Residual stream, Logit lens and Next token for the prompt at the top of the page.

Run traces the prompt once (the residual stream and the attention patterns, app.models.app_hooks) and keeps the
trace in the session's gr.State, so moving the layer or head slider, or ticking a residual stage, re-plots it
without running the model again. The example prompts (app/examples.json) fill the prompt box.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr
from gradio.components.plot import PlotData

from slmviz import Model, Trace, plots
from slmviz.plots.trace import NEXT_TOKEN_COLUMNS, STAGE_NAMES

from ..models import AppContext, first_layer, head_choices, head_value, layer_value
from ..shared import Queues, display_frame, readable_errors, to_plot

EXAMPLES_FILE = Path(__file__).resolve().parents[1] / "examples.json"  # inside the package, so the wheel has it


@dataclass(frozen=True)
class Example:
    """One example prompt (app/examples.json)."""

    prompt: str
    chat: bool = False
    why: str = ""

    def label(self) -> str:
        text = self.prompt.replace("\n", " ⏎ ")
        text = text if len(text) <= 60 else text[:57] + "..."
        return f"{text}{'  [chat]' if self.chat else ''}" + (f"  ({self.why})" if self.why else "")


def load_examples(path: Path = EXAMPLES_FILE) -> list[Example]:
    """The example prompts of app/examples.json: prompt, chat template on/off, what to look for."""
    data = json.loads(path.read_text(encoding="utf-8"))
    return [Example(e["prompt"], bool(e.get("chat", False)), e.get("why", "")) for e in data]


def need_trace(trace: Trace | None) -> Trace:
    if trace is None:
        raise ValueError("Run a prompt first")
    return trace


class RunHandlers:
    """The Run tabs' handlers: the prompt traced, its figures drawn from the trace kept in the session."""

    def __init__(self, ctx: AppContext, examples: list[Example]):
        self.ctx = ctx
        self.examples = examples

    @readable_errors
    def example(self, index: int | None) -> tuple[str, bool]:
        if index is None or not 0 <= int(index) < len(self.examples):
            raise ValueError(f"Pick one of the {len(self.examples)} example prompts")
        e = self.examples[int(index)]
        return e.prompt, e.chat

    @readable_errors
    def run(self, prompt: str, chat: bool, layer: float, head: str, stages: list[str], per_position: bool,
            log_y: bool, include_first: bool, source: str | None,
            progress: gr.Progress = gr.Progress()) -> tuple:  # noqa: B008 - Gradio injects progress this way
        model = self.ctx.model(source, progress)
        layer_i, head_i = layer_value(layer, model.cfg.n_layers), head_value(head)
        progress(0.3, desc="Tracing the prompt")
        trace = self.ctx.trace(model, prompt, chat)
        progress(0.7, desc="Drawing attention and the residual stream")
        attention = plots.attention(trace, layer_i, head_i)
        residual = plots.residual_norms(trace, tuple(stages or ()), per_position, log_y, include_first)
        table = display_frame(plots.next_token_table(trace, 10))
        status = (f"Traced {len(trace.tokens)} tokens through **{model.name}**"
                  f"{' (chat template)' if chat else ''}; {bos_note(model, trace, bool(chat))}. Hover any plot for "
                  "values; the camera icon saves a PNG.")
        return plots.tokens_html(trace), to_plot(attention), to_plot(residual), table, status, trace

    @readable_errors
    def logit_lens(self, trace: Trace | None) -> PlotData:
        """Runs after /run (the slowest figure: one unembedding per layer), so the others show first."""
        return to_plot(plots.logit_lens(need_trace(trace)))

    @readable_errors
    def attention(self, trace: Trace | None, layer: float, head: str) -> PlotData:
        trace = need_trace(trace)
        return to_plot(plots.attention(trace, layer_value(layer, trace.config.n_layers), head_value(head)))

    @readable_errors
    def residual(self, trace: Trace | None, stages: list[str], per_position: bool, log_y: bool,
                 include_first: bool) -> PlotData:
        trace = need_trace(trace)
        return to_plot(plots.residual_norms(trace, tuple(stages or ()), per_position, log_y, include_first))

    @readable_errors
    def save_trace(self, trace: Trace | None) -> str:
        trace = need_trace(trace)
        path = self.ctx.output_path(f"slmviz-trace-{len(trace.tokens)}-tokens.safetensors")
        return str(trace.save(path))


@dataclass(frozen=True)
class PromptBar:
    """The page's prompt row (above every tab): what the Run tabs read and write."""

    prompt: gr.Textbox
    chat: gr.Checkbox
    run: gr.Button
    examples: gr.Dropdown
    status: gr.Markdown
    tokens: gr.HTML


def build_prompt_bar(model: Model, examples: list[Example]) -> PromptBar:
    """The prompt box, the chat switch, Run, the example prompts, the status line and the tokens."""
    with gr.Row():
        with gr.Column(scale=4):
            prompt = gr.Textbox(label=f"Prompt (up to {model.max_tokens} tokens)", lines=3, elem_id="prompt",
                                value="The capital of France is", max_length=model.max_tokens * 16)
        with gr.Column(scale=1, min_width=200):
            chat = gr.Checkbox(label="chat template", value=False, elem_id="chat",
                               info="Wrap the prompt as one user turn of the instruct model's chat format")
            run_btn = gr.Button("Run", variant="primary", elem_id="run")
    picker = gr.Dropdown([(e.label(), i) for i, e in enumerate(examples)], value=None,
                         label="Example prompts (pick one, then Run)", elem_id="examples")
    status = gr.Markdown("", elem_id="status")
    tokens = gr.HTML(elem_id="tokens")
    return PromptBar(prompt, chat, run_btn, picker, status, tokens)


def build_run_tabs(ctx: AppContext, examples: list[Example], bar: PromptBar, source: gr.State,
                   queues: Queues) -> tuple[gr.Slider, gr.Dropdown]:
    """The Attention, Residual stream, Logit lens and Next token tabs, inside the page's gr.Tabs, and the events
    of the prompt bar; returns the layer slider and head picker (a model switch resets them)."""
    rh = RunHandlers(ctx, examples)
    model = ctx.store.get()
    with gr.Tab("Attention", id="tab-attention"):
        trace = gr.State(None, time_to_live=3600)  # the last Run's trace, re-plotted without re-running
        with gr.Row():
            layer = gr.Slider(0, model.cfg.n_layers - 1, value=first_layer(model), step=1, label="layer",
                              elem_id="layer")
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

    bar.examples.input(rh.example, [bar.examples], [bar.prompt, bar.chat], api_name="example", **queues.light)
    run_inputs = [bar.prompt, bar.chat, layer, head, stages, per_position, log_y, include_first, source]
    run_outputs = [bar.tokens, attention_plot, residual_plot, next_token, bar.status, trace]
    ran = gr.on([bar.run.click, bar.prompt.submit], rh.run, run_inputs, run_outputs, api_name="run",
                **queues.model)
    ran.success(rh.logit_lens, [trace], lens_plot, api_name="logit_lens", **queues.model)
    gr.on([layer.change, head.change], rh.attention, [trace, layer, head], attention_plot, api_name="attention",
          **queues.light)
    residual_inputs = [trace, stages, per_position, log_y, include_first]
    gr.on([w.change for w in residual_inputs[1:]], rh.residual, residual_inputs, residual_plot, api_name="residual",
          **queues.light)
    save_btn.click(rh.save_trace, [trace], trace_file, api_name="save_trace", **queues.light)
    return layer, head


def bos_note(model: Model, trace: Trace, chat: bool) -> str:
    """How the traced ids begin, said where they show: the tokenizer's own beginning-of-sequence token when it adds
    one (Gemma's <bos>), the chat template's first token, or none added (SmolLM2's tokenizer adds none to plain
    text: position 0 is the prompt's first token). The Run tab adds nothing of its own."""
    tok = model.tokenizer
    first = trace.tokens[0] if trace.tokens else ""
    if chat:
        return f"position 0 is the chat template's first token `{first}` (the template's own start, nothing added)"
    bos_id = getattr(tok, "bos_token_id", None)
    adds = bos_id is not None and int(trace.input_ids[0]) == int(bos_id) and tok("x")["input_ids"][:1] == [bos_id]
    if adds:
        return f"position 0 is the tokenizer's beginning-of-sequence token `{first}`, which it adds to every prompt"
    return "no beginning-of-sequence token is added (this tokenizer adds none): position 0 is the prompt's first token"


def model_switch(model: Model) -> tuple[Any, Any]:
    """The layer slider and head picker for a newly loaded model (its layers and heads)."""
    return (gr.Slider(minimum=0, maximum=model.cfg.n_layers - 1, value=first_layer(model), step=1),
            gr.Dropdown(choices=head_choices(model), value="all"))
