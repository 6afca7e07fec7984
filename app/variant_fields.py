"""The Break-it tab's variant fields: one widget per Variant field, read from slmviz.variants, never retyped.

A Variant field's widget follows its type (field_kind); widget_value and field_value convert between the two, and
variant_from_fields turns the widgets back into a Variant that the model is checked against. The Model tab uses
field_applies and applicable_presets to show only what can change the model loaded.
"""

from __future__ import annotations

import math
import re
from dataclasses import fields
from typing import Any

import gradio as gr

import slmviz
from slmviz import PRESETS, Model, Variant, resolve_variant
from slmviz.variants import (
    BASE,
    GELU_FORMS,
    GQA_MAPPINGS,
    MLP_TYPES,
    NORM_PLACEMENTS,
    NORM_TYPES,
    QK_NORM_ORDERS,
    ROPE_PAIRINGS,
    VariantError,
    resolve,
)

from .shared import guard_number

# Variant fields in the "Break it" tab: choices come from slmviz.variants, never retyped.
FIELD_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": NORM_PLACEMENTS, "norm_type": NORM_TYPES, "rope": ROPE_PAIRINGS, "gqa": GQA_MAPPINGS, "mlp": MLP_TYPES,
    "qk_norm_order": QK_NORM_ORDERS, "gelu": GELU_FORMS,
}
FIELD_LABELS = {
    "norm": "Norm placement", "norm_type": "Norm type", "norm_offset": "Norm weight is (1 + w)",
    "embed_scale": "Embeddings × √d_model", "qk_norm": "QK-norm", "qk_norm_order": "QK-norm order",
    "rope": "RoPE pairing", "rope_theta": "RoPE base",
    "rope_local_as_global": "Sliding layers use the global RoPE base",
    "gqa": "GQA mapping", "causal": "Causal mask", "sliding_window": "Sliding window", "mlp": "MLP type",
    "gelu": "GELU form", "kv_position_bug": "KV position bug",
    "pos_embed": "Learned position embedding", "parallel_residual": "Parallel residual",
    "partial_rotary": "Partial rotary", "softcap": "Soft-capping",
}
VARIANT_FIELDS = [f.name for f in fields(Variant)]
OWN = "own"  # the radio choice for a field left at None: the checkpoint's own convention


def field_kind(name: str) -> str:
    """How a Variant field is edited, read from its type: "choice" (a radio; None = OWN), "keep" (a checkbox for
    `bool | None`: ticked = None, the checkpoint's own; unticked = False, removed), "flag" (bool), "number"."""
    kind = {f.name: f.type for f in fields(Variant)}[name]
    if name in FIELD_CHOICES:
        return "choice"
    return {"bool": "flag", "bool | None": "keep"}.get(str(kind), "number")


def widget_value(name: str, value: Any) -> Any:
    """A Variant field's value as its widget shows it (see field_kind)."""
    kind = field_kind(name)
    if kind == "choice":
        return OWN if value is None else value
    if kind == "keep":
        return value is not False
    return value


def field_value(name: str, value: Any) -> Any:
    """A widget's value back as the Variant field's (the inverse of widget_value); bad values are left for
    Variant to refuse with its own message."""
    kind = field_kind(name)
    if kind == "choice":
        return None if value in (None, "", OWN) else value
    if kind == "keep":
        return None if value in (True, None) else value
    if kind == "number":  # rope_theta: empty is the checkpoint's own base; 0 or below is refused, as Variant does
        if value is None or value == "":
            return None
        x = float(value)
        if not 1 < x < math.inf:
            raise ValueError(f"{FIELD_LABELS[name]} must be a number above 1, or empty for the checkpoint's own base; "
                             f"got {x:g}")
        return x
    return value


FAITHFUL_WIDGETS = [widget_value(f, getattr(BASE, f)) for f in VARIANT_FIELDS]


def field_help(doc: str | None = Variant.__doc__) -> dict[str, str]:
    """One line of help per Variant field, read from the Variant docstring ("name: text" blocks)."""
    help_: dict[str, str] = {}
    current = None
    for line in (doc or "").splitlines():
        m = re.match(r"\s*(\w+):\s+(.*)", line)
        if m and m.group(1) in VARIANT_FIELDS:
            current = m.group(1)
            help_[current] = m.group(2).strip()
        elif current and line.strip():
            help_[current] += " " + line.strip()
        else:
            current = None
    return help_


FIELD_HELP = field_help()


def variant_from_fields(values: list[Any] | tuple[Any, ...], model: Model | None = None) -> Variant:
    """The Break-it widgets (in VARIANT_FIELDS order) as a Variant, validated by Variant itself and, given a
    model, against it (a field it cannot honour is a VariantError naming the presets that apply)."""
    return resolve_variant({name: field_value(name, v) for name, v in zip(VARIANT_FIELDS, values, strict=True)},
                           model.cfg if model is not None else None)


def split_inputs(inputs: tuple[Any, ...], before: int, after: int) -> tuple[list, list, list]:
    """Positional event inputs → (the `before` widgets, the Variant field widgets, the `after` widgets).

    The handlers take the fields as *inputs so that a new Variant field needs no new parameter here; a caller
    sending the wrong number of values (e.g. an older client) gets the count, not an unpacking error."""
    expected = before + len(VARIANT_FIELDS) + after
    if len(inputs) != expected:
        raise ValueError(f"Expected {expected} inputs ({len(VARIANT_FIELDS)} variant fields: "
                         f"{', '.join(VARIANT_FIELDS)}), got {len(inputs)}")
    middle = before + len(VARIANT_FIELDS)
    return list(inputs[:before]), list(inputs[before:middle]), list(inputs[middle:])


def field_applies(name: str, model: Model) -> bool:
    """Show a field only where it can change something: some other value is accepted by this model and changes
    the conventions it runs with (gqa on Gemma's single KV head, norm_offset on SmolLM2: hidden)."""
    faithful = resolve(BASE, model.cfg)
    for value in _alternatives(name):
        try:
            v = resolve_variant({name: value}, model.cfg)
        except VariantError:
            continue
        if resolve(v, model.cfg) != faithful:
            return True
    return False


def _alternatives(name: str) -> list[Any]:
    base, kind = getattr(BASE, name), field_kind(name)
    if kind == "choice":
        return [c for c in FIELD_CHOICES[name] if c != base]
    if kind == "keep":
        return [False]
    if kind == "flag":
        return [not base]
    return [10_000.0, 1_000_000.0]  # rope_theta: one of them differs from any checkpoint's base


def applicable_presets(model: Model) -> list[str]:
    """The presets the Break-it tab offers for this model (slmviz.variants(model): those that change it)."""
    return list(slmviz.variants(model))


def describe_variant(v: Variant) -> str:
    """Markdown: the preset's one-line description, or each changed field with its help line."""
    name = v.label()
    if name in PRESETS:
        return f"**{name}**: {PRESETS[name].description}"
    lines = [f"**custom variant** ({name}):"]
    lines += [f"- `{k}={val}`: {FIELD_HELP.get(k, '')}" for k, val in v.changes().items()]
    return "\n".join(lines)


def default_preset(presets: list[str]) -> str:
    """The preset the Break-it tab starts on: RoPE pairing where the family has RoPE, else the first that applies
    (post_norm on GPT-2, whose positions are learned)."""
    return "rope_interleaved" if "rope_interleaved" in presets else next(p for p in presets if p != "faithful")


def variant_widgets(model: Model) -> list[gr.components.Component]:
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
                box = gr.Number(value=None, **kw)  # its range is checked in the app's words (field_value too)
                guard_number(box, FIELD_LABELS[name], lo=1, above=True, empty="the checkpoint's own base")
                inputs.append(box)
    return inputs


def faithful_updates(model: Model) -> list[Any]:
    """The field widgets back at faithful, each shown where it can change `model` (a model was loaded)."""
    return [gr.update(value=widget_value(f, getattr(BASE, f)), visible=field_applies(f, model))
            for f in VARIANT_FIELDS]
