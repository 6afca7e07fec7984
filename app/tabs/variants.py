"""The Break it and Generate tabs: flip a convention a reimplementation can silently get wrong, and see what changes.

Break it compares the faithful model with a variant on the page's prompt (next tokens, KL per position, the residual
stream, attention, greedy continuations), or runs every preset at once; Generate streams both continuations token
by token. The variant's widgets come from app/variant_fields.py (one per Variant field, filled by a preset).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr
import pandas as pd
from gradio.context import Context

from slmviz import PRESETS, Model, plots
from slmviz import compare as compare_variants
from slmviz.analysis.diff import divergence
from slmviz.plots.trace import NEXT_TOKEN_COLUMNS

from ..models import MAX_NEW_TOKENS, AppContext, app_hooks, first_layer, head_choices, head_value, layer_value
from ..shared import Queues, display_frame, guard_number, readable_errors, to_plot
from ..variant_fields import (
    VARIANT_FIELDS,
    applicable_presets,
    default_preset,
    describe_variant,
    split_inputs,
    variant_from_fields,
    variant_widgets,
    widget_value,
)


class VariantHandlers:
    """The Break it and Generate tabs' handlers."""

    def __init__(self, ctx: AppContext):
        self.ctx = ctx

    @readable_errors
    def preset(self, name: str, source: str | None = None) -> tuple:
        """Fill the field widgets from a preset that applies to this session's model."""
        model = self.ctx.store.get(source)
        offered = applicable_presets(model)
        if name not in offered:
            known = "is not a preset" if name not in PRESETS else f"does not apply to {model.name}"
            raise ValueError(f"{name!r} {known}; the presets for {model.name} are: {', '.join(offered)}")
        v = PRESETS[name].variant
        return (*[widget_value(f, getattr(v, f)) for f in VARIANT_FIELDS], describe_variant(v))

    # Gradio finds gr.Progress by a parameter's default among the positional parameters, so `progress` comes
    # first and the widget values follow as *inputs (see split_inputs).
    @readable_errors
    def compare(self, progress: gr.Progress = gr.Progress(), *inputs: Any) -> tuple:  # noqa: B008
        """Inputs: prompt, chat, the Variant fields, layer, head, max_new_tokens, source."""
        (prompt, chat), field_widgets, (layer, head, max_new_tokens, source) = split_inputs(inputs, 2, 4)
        n_new = self.ctx.checked_new_tokens(max_new_tokens)
        model = self.ctx.model(source, progress)
        variant = variant_from_fields(field_widgets, model)
        layer_i, head_i = layer_value(layer, model.cfg.n_layers), head_value(head)
        if head_i is None:
            head_i = 0  # side by side, one head each: the all-heads grid twice would not fit
        progress(0.15, desc="Tracing the faithful model")
        faithful = self.ctx.trace(model, prompt, chat)
        progress(0.3, desc=f"Tracing {variant.label() or 'faithful'}")
        broken = model.trace(faithful.input_ids, variant=variant, names=app_hooks)
        progress(0.45, desc="Comparing")
        figs = [plots.kl_per_position(faithful, broken),
                plots.residual_norms(faithful, other=broken, log_y=True),
                plots.variant_diff(faithful, broken),
                plots.attention(faithful, layer_i, head_i),
                plots.attention(broken, layer_i, head_i)]
        progress(0.6, desc="Greedy continuation, faithful")
        cont_faithful = continuation(model, faithful.input_ids, n_new)
        progress(0.8, desc="Greedy continuation, variant")
        cont_broken = continuation(model, faithful.input_ids, n_new, variant=variant)
        bad = broken.first_nonfinite()
        note = f"\n\n⚠ Values stopped being finite at `{bad}` (fp32 overflow)." if bad else ""
        if variant.changes() == {"kv_position_bug": True}:
            note += "\n\nThis bug only affects cached decoding: the prefill is identical; compare the continuations."
        return (verdict_text(divergence(faithful, broken)) + "\n\n" + describe_variant(variant) + note,
                display_frame(plots.next_token_table(faithful, 10)), display_frame(plots.next_token_table(broken, 10)),
                *[to_plot(f) for f in figs], cont_faithful, cont_broken)

    @readable_errors
    def compare_all(self, prompt: str, chat: bool, source: str | None,
                    progress: gr.Progress = gr.Progress()) -> pd.DataFrame:  # noqa: B008
        model = self.ctx.model(source, progress)
        ids = model.encode(self.ctx.checked_prompt(prompt, model), chat=bool(chat))
        names = [n for n in applicable_presets(model) if n != "faithful"]
        rows = []
        for i, name in enumerate(names):
            progress((i, len(names)), desc=f"Variant {name}", unit="variants")
            rows.append(compare_variants(ids, variants=[name], model=model))
        frame = pd.concat(rows, ignore_index=True)
        return display_frame(frame)

    @readable_errors
    def generate(self, *inputs: Any) -> Iterator[tuple[str, str]]:
        """Inputs: prompt, chat, the Variant fields, max_new_tokens, temperature, top_k, seed, source."""
        (prompt, chat), field_widgets, (max_new_tokens, temperature, top_k, seed, source) = split_inputs(inputs, 2, 5)
        n_new = self.ctx.checked_new_tokens(max_new_tokens)
        if temperature is None or not 0 <= float(temperature) <= 5:
            raise ValueError(f"Temperature must be between 0 and 5, got {temperature!r}")
        k = None if top_k in (None, 0) else int(top_k)
        if k is not None and k < 0:
            raise ValueError(f"top-k must be 0 (off) or a positive whole number, got {top_k!r}")
        seed_i = None if seed is None or seed == "" else int(seed)
        model = self.ctx.model(source)
        variant = variant_from_fields(field_widgets, model)
        ids = model.encode(self.ctx.checked_prompt(prompt, model), chat=bool(chat))
        kwargs = dict(temperature=float(temperature), top_k=k, seed=seed_i)
        streams = [model.stream(ids, n_new, **kwargs), model.stream(ids, n_new, variant=variant, **kwargs)]
        texts = ["", ""]
        steps = [0, 0]
        live = [True, True]
        while any(live):
            for i, stream in enumerate(streams):
                if not live[i]:
                    continue
                try:
                    texts[i] = next(stream).text
                    steps[i] += 1
                except StopIteration:
                    live[i] = False
                    texts[i] += stopped_note(model, steps[i], n_new)
                except FloatingPointError as e:  # a variant whose logits overflow cannot be sampled
                    texts[i] += f"\n[stopped: {e}]"
                    live[i] = False
            yield texts[0], texts[1]


def stopped_note(model: Model, steps: int, n_new: int) -> str:
    """What a continuation that ended before `n_new` tokens says: it stopped at end-of-text (the stream's only
    early stop), and after how many tokens; "" when it ran its length."""
    if steps >= n_new:
        return ""
    eos = getattr(model.tokenizer, "eos_token", None) or "end-of-text"
    return f"{'' if steps == 0 else chr(10)}[stopped at end-of-text: the next token was {eos} after {steps} tokens]"


def continuation(model: Model, ids: Any, n_new: int, **kwargs: Any) -> str:
    """The greedy continuation as text, saying so when it stopped at end-of-text (an empty box says nothing)."""
    text, steps = "", 0
    for step in model.stream(ids, n_new, **kwargs):
        text, steps = step.text, steps + 1
    return text + stopped_note(model, steps, n_new)


def verdict_text(d: dict) -> str:
    """The Break-it verdict in numbers (analysis.diff.divergence): KL, top-1 agreement, the first layer whose
    residual stream moves by more than the stated threshold."""
    kl = lambda x: "∞" if x == float("inf") else f"{x:.3g}"  # noqa: E731
    layer = (f"the residual stream first differs by more than {d['threshold']:.0%} (relative L2, after a block) "
             f"at **layer {d['first_layer']}**" if d["first_layer"] is not None else
             f"no layer's residual stream differs by more than {d['threshold']:.0%} (relative L2)")
    same = d["kl_mean"] == 0 and d["top1_agree"] == d["positions"] and d["first_layer"] is None
    return (f"**Verdict{': nothing changed' if same else ''}.** KL(faithful ‖ variant) **{kl(d['kl_last'])} nats** "
            f"at the last position (mean {kl(d['kl_mean'])} over {d['positions']} positions); top-1 agreement "
            f"**{d['top1_agree']}/{d['positions']}** positions ({d['top1_agree'] / d['positions']:.0%}); {layer}.")


@dataclass(frozen=True)
class VariantPickers:
    """What a model switch resets in these tabs: the preset, the field widgets, the attention layer and head."""

    preset: gr.Dropdown
    fields: list[gr.components.Component]
    layer: gr.Slider
    head: gr.Dropdown

    @staticmethod
    def updates(model: Model) -> tuple[Any, Any, Any]:
        """(preset, layer, head) for a newly loaded model: the presets that apply to it, its layers and heads."""
        presets = applicable_presets(model)
        return (gr.Dropdown(choices=presets, value=default_preset(presets)),
                gr.Slider(minimum=0, maximum=model.cfg.n_layers - 1, value=first_layer(model), step=1),
                gr.Dropdown(choices=head_choices(model)[1:], value="0"))


def build_variant_tabs(ctx: AppContext, prompt: gr.Textbox, chat: gr.Checkbox, source: gr.State,
                       queues: Queues) -> VariantPickers:
    """The Break it and Generate tabs, inside the page's gr.Tabs; `prompt` and `chat` are the page's."""
    vh = VariantHandlers(ctx)
    model = ctx.store.get()
    with gr.Tab("Break it", id="tab-break"):
        with gr.Column(elem_id="variant"):
            with gr.Row():
                presets = applicable_presets(model)  # only those that change this model
                preset = gr.Dropdown(presets, value=default_preset(presets), label="preset",
                                     elem_id="variant-preset", scale=2)
                break_layer = gr.Slider(0, model.cfg.n_layers - 1, value=first_layer(model), step=1,
                                        label="attention layer")
                break_head = gr.Dropdown(head_choices(model)[1:], value="0", label="attention head")
                break_new = gr.Slider(1, MAX_NEW_TOKENS, value=20, step=1, label="continuation tokens")
            description = gr.Markdown(elem_id="variant-description")
            with gr.Accordion("Fields (a preset fills them; change any to compose your own variant)", open=False):
                field_inputs = variant_widgets(model)
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
            top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)", elem_id="generate-top-k")
            guard_number(top_k, "top-k", lo=0, whole=True)
            seed = gr.Number(value=0, precision=0, label="seed")
        gen_btn = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Row():
            gen_faithful = gr.Textbox(label="faithful", lines=10, interactive=False, elem_id="generate-faithful")
            gen_broken = gr.Textbox(label="variant", lines=10, interactive=False, elem_id="generate-variant")

    preset.change(vh.preset, [preset, source], [*field_inputs, description], api_name="preset", **queues.light)
    page = Context.root_block  # the page's load fills the fields from the first preset
    if page is not None:
        page.load(vh.preset, [preset, source], [*field_inputs, description], api_visibility="private")
    compare_btn.click(
        vh.compare, [prompt, chat, *field_inputs, break_layer, break_head, break_new, source],
        [verdict, next_faithful, next_broken, kl_plot, overlay_plot, diff_plot, att_faithful, att_broken,
         cont_faithful, cont_broken], api_name="compare", **queues.decode)
    compare_all_btn.click(vh.compare_all, [prompt, chat, source], all_table, api_name="compare_all",
                          **queues.decode)
    gen_btn.click(vh.generate, [prompt, chat, *field_inputs, gen_new, temperature, top_k, seed, source],
                  [gen_faithful, gen_broken], api_name="generate", **queues.decode)
    return VariantPickers(preset, field_inputs, break_layer, break_head)
