"""Event handlers: widget values in, slmviz calls, figures and tables out. No torch code, no layout.

Every handler is wrapped by `readable_errors`, so a bad input becomes a one-line message in the page
(a gr.Error toast, or an AppError for gradio_client) and the server keeps serving.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd
from gradio.components.plot import PlotData

import slmviz
from slmviz import plots
from slmviz.corpora.generated import chat_corpus
from slmviz.corpora.named import MODEL_WRITTEN
from slmviz.hooks import LAYER_HOOKS
from slmviz.interventions.compare import compare as compare_variants
from slmviz.loading.bundled import DEFAULT_MODEL_NAME, bundled_models, is_prepared, model_dir
from slmviz.loading.bundled import prepare as prepare_bundled
from slmviz.loading.default_model import HUB_ID
from slmviz.model_api import HUB_ID_PATTERN, Model, download_from_hub, load_folder
from slmviz.trace import RESIDUAL_STAGES, Trace
from slmviz.variants import (
    BASE,
    GELU_FORMS,
    GQA_MAPPINGS,
    MLP_TYPES,
    NORM_PLACEMENTS,
    NORM_TYPES,
    PRESETS,
    QK_NORM_ORDERS,
    ROPE_PAIRINGS,
    Variant,
    VariantError,
    resolve,
    resolve_variant,
)

log = logging.getLogger("slmviz.app")

MAX_PROMPT_TOKENS = 512
MAX_NEW_TOKENS = 256
CHARS_PER_TOKEN_LIMIT = 16  # refuse absurdly long text before spending time tokenizing it
MODELS_KEPT = 2  # the startup model plus one other, so a Space's memory stays bounded
FAST_COPIES_KEPT = 1  # bf16 copies (the Patch and Corpus tabs' "fast (bf16)" switch), at half a model's memory each
OUTPUT_TTL_S = 3600

# The app captures what its figures read: the residual stream and the attention patterns.
APP_HOOK_SUFFIXES = (*RESIDUAL_STAGES.values(), "attn.hook_pattern")
assert all(s in LAYER_HOOKS for s in APP_HOOK_SUFFIXES)

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
    if kind == "number":
        return None if value in (None, "", 0) else float(value)
    return value


FAITHFUL_WIDGETS = [widget_value(f, getattr(BASE, f)) for f in VARIANT_FIELDS]


def app_hooks(name: str) -> bool:
    return name.endswith(APP_HOOK_SUFFIXES)


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


# --- errors --------------------------------------------------------------------------------------
READABLE_ERRORS = (
    slmviz.PromptError, slmviz.UnsupportedModelError, slmviz.WeightsError, slmviz.TraceFormatError,
    ValueError, TypeError, KeyError, FileNotFoundError, FloatingPointError, IndexError,
)


def write_model_corpus(model: Model, corpus: str, report: Callable[..., None], share: float = 0.0) -> None:
    """In a long job, first write the model's own chat and prose when `corpus` is made of it
    (corpora.MODEL_WRITTEN; once per model, kept on disk): `report(fraction, line)` after each batch of seed
    prompts, up to `share` of the job. A Cancel stops it between batches and keeps what is written."""
    if corpus not in MODEL_WRITTEN:
        return
    chat_corpus(model, progress=lambda done, total: report(
        share * done / max(total, 1), f"Writing the model's own chat and prose: {done} of {total} seed prompts "
        "(once per model; Cancel keeps what is written)"))


def readable_message(e: BaseException) -> str:
    text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
    return str(text) or type(e).__name__


def readable_errors(fn: Callable) -> Callable:
    """Turn every exception into a gr.Error with a one-line message (never a traceback in the page)."""

    def convert(e: Exception) -> gr.Error:
        if isinstance(e, gr.Error):
            return e
        if isinstance(e, READABLE_ERRORS):
            return gr.Error(readable_message(e), print_exception=False)
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


# --- models --------------------------------------------------------------------------------------
def on_space() -> bool:
    return bool(os.environ.get("SPACE_ID"))


class ModelStore:
    """The models this server may serve, loaded on first use and shared by all sessions.

    "" is the startup model: `startup` if given, else on a Space the hub's SmolLM2-135M-Instruct
    (falling back to the bundled copy), else the bundled one. Other sources are the bundled models by
    name (`slmviz.bundled_models()`), hub ids, or local folders only when `allow_local` (the CLI's
    --allow-local-models).

    Loading one model (Gemma's first use dequantizes for about a minute) holds only that model's own
    lock: requests for models already loaded, and loads of other models, go on meanwhile.
    """

    def __init__(self, startup: str | None = None, allow_local: bool = False,
                 max_prompt_tokens: int = MAX_PROMPT_TOKENS):
        self.allow_local = allow_local
        self.max_prompt_tokens = max_prompt_tokens
        self._startup = self._checked_source(startup) if startup else None
        self._models: OrderedDict[str, Model] = OrderedDict()
        self._copies: OrderedDict[str, Model] = OrderedDict()  # "key@bfloat16" -> a bf16 copy
        self._lock = threading.Lock()  # guards _models and _loading, never held while loading
        self._loading: dict[str, threading.Lock] = {}
        self.startup_note = ""

    def get(self, source: str | None = None, dtype: str = "float32") -> Model:
        """The model `source` names, in fp32, or a `dtype` copy of it ("bfloat16": app/fast_mode.py's switch).

        The fp32 models and the bf16 copies are kept apart (MODELS_KEPT, FAST_COPIES_KEPT), so switching to
        fast never evicts the startup model and a Space holds at most one extra half-size copy."""
        key = self.key(source)
        slot, kept, limit = (key, self._models, MODELS_KEPT) if dtype == "float32" else \
            (f"{key}@{dtype}", self._copies, FAST_COPIES_KEPT)
        with self._lock:
            if slot in kept:
                kept.move_to_end(slot)
                return kept[slot]
            loading = self._loading.setdefault(slot, threading.Lock())
        with loading:  # two sessions asking for the same new model load it once
            with self._lock:
                if slot in kept:
                    return kept[slot]
            model = self._load(key, dtype)
            model.max_tokens = min(model.max_tokens, self.max_prompt_tokens)
            with self._lock:
                kept[slot] = model
                self._loading.pop(slot, None)
                while len(kept) > limit:
                    oldest = next(k for k in kept if k != "")
                    del kept[oldest]
            return model

    def is_loaded(self, source: str | None) -> bool:
        with self._lock:
            return self.key(source) in self._models

    def key(self, source: str | None) -> str:
        text = (source or "").strip()
        if not text or text == self._startup or (text == DEFAULT_MODEL_NAME and self._startup is None):
            return ""  # the bundled default is the startup model unless --model named another
        return self._checked_source(text)

    def startup_name(self) -> str:
        """What the model picker shows for "": the --model source, else the bundled default."""
        return self._startup or DEFAULT_MODEL_NAME

    def _checked_source(self, text: str) -> str:
        text = text.strip()
        if text in bundled_models():
            return text
        if self.allow_local and Path(text).expanduser().is_dir():
            return str(Path(text).expanduser().resolve())
        if HUB_ID_PATTERN.match(text) and ".." not in text:
            return text
        if self.allow_local:
            raise FileNotFoundError(f"{text!r} is neither a model folder, a bundled model "
                                    f"({', '.join(bundled_models())}) nor a hub id of the form owner/name")
        if "/" in text and (text.startswith((".", "/", "~")) or Path(text).expanduser().exists()):
            raise ValueError("Local model folders are disabled; start the app with --allow-local-models to load one")
        raise ValueError(f"{text[:100]!r} is neither a bundled model ({', '.join(bundled_models())}) nor a Hugging "
                         "Face hub id of the form owner/name")

    def _load(self, key: str, dtype: str = "float32") -> Model:
        if key == "":
            if self._startup:
                return self._load(self._startup, dtype)
            if on_space():
                try:
                    return load_folder(download_from_hub(HUB_ID), name=HUB_ID, dtype=dtype)
                except Exception as e:  # offline Space, hub outage: the bundled copy is the same model
                    self.startup_note = f"could not fetch {HUB_ID} ({e}); using the bundled copy"
                    log.warning(self.startup_note)
            return slmviz.load(dtype=dtype)
        if key in bundled_models():
            return slmviz.load(key, dtype=dtype)
        if Path(key).is_absolute():
            return load_folder(Path(key), dtype=dtype)
        return load_folder(download_from_hub(key), name=key, dtype=dtype)


# --- small converters ----------------------------------------------------------------------------
def to_plot(fig: Any) -> PlotData:
    """A plotly figure for gr.Plot, carrying plots.FIGURE_CONFIG (modebar PNG download kept on)."""
    spec = json.loads(fig.to_json())
    spec["config"] = plots.FIGURE_CONFIG
    return PlotData(type="plotly", plot=json.dumps(spec))


def display_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """JSON-safe table: ±inf/NaN floats become text, missing values blank."""
    out = frame.copy()
    for col in out.columns:
        out[col] = [_cell(v) for v in out[col]]
    return out


def _cell(v: Any) -> Any:
    if v is None or v is pd.NA:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        if math.isinf(v):
            return "∞" if v > 0 else "-∞"
        return round(v, 4)
    return v


def head_value(head: str | int | None) -> int | None:
    """Dropdown value → head index; "all" (or empty) → None, the GQA grid."""
    if head is None or head == "" or head == "all":
        return None
    try:
        return int(head)
    except (TypeError, ValueError):
        raise ValueError(f"head must be a head number or 'all', got {head!r}") from None


def layer_value(layer: float | int | None, model: Model) -> int:
    n = model.cfg.n_layers
    if layer is None or not float(layer).is_integer() or not 0 <= int(layer) < n:
        raise ValueError(f"layer must be a whole number in 0..{n - 1}, got {layer!r}")
    return int(layer)


def head_choices(model: Model) -> list[tuple[str, str]]:
    return [("all heads, by KV group", "all")] + [(f"head {h}", str(h)) for h in range(model.cfg.n_heads)]


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


def model_line(model: Model, note: str = "") -> str:
    """The #model-status line: which model every tab is using."""
    cfg = model.cfg
    where = "Hugging Face Space" if on_space() else "local, offline"
    extra = f" Note: {note}." if note else ""
    kinds = ""
    if getattr(cfg, "mixes_layer_types", False):
        n_global = sum(cfg.layer_type(i) == "full_attention" for i in range(cfg.n_layers))
        kinds = f", {n_global} global / {cfg.n_layers - n_global} sliding-window layers"
    return (f"Model: **{model.name}** ({cfg.model_type}, {cfg.n_layers} layers{kinds}, {cfg.n_heads} query heads / "
            f"{cfg.n_kv_heads} KV heads, fp32 on CPU; {where}).{extra}")


def describe_variant(v: Variant) -> str:
    """Markdown: the preset's one-line description, or each changed field with its help line."""
    name = v.label()
    if name in PRESETS:
        return f"**{name}**: {PRESETS[name].description}"
    lines = [f"**custom variant** ({name}):"]
    lines += [f"- `{k}={val}`: {FIELD_HELP.get(k, '')}" for k, val in v.changes().items()]
    return "\n".join(lines)


def default_preset(presets: list[str]) -> str:
    """The preset the Break-it tab starts on: RoPE pairing (every family here has RoPE), else the first."""
    return "rope_interleaved" if "rope_interleaved" in presets else next(p for p in presets if p != "faithful")


def _choice_label(name: str) -> str:
    if name not in bundled_models():
        return name
    first_use = "" if is_prepared(model_dir(name)) else ", first use dequantizes it: about a minute"
    return f"{name} (bundled{first_use})"


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


# --- the handlers --------------------------------------------------------------------------------
class Handlers:
    """One instance per server; sessions share its ModelStore. Session state lives in gr.State."""

    def __init__(self, store: ModelStore, max_new_tokens: int = MAX_NEW_TOKENS, examples: list[Example] | None = None):
        self.store = store
        self.examples = examples or []
        self.max_new_tokens = max_new_tokens
        self._output_root: Path | None = None  # created on the first saved trace

    # helpers
    def model(self, source: str | None, progress: gr.Progress | None = None, dtype: str = "float32") -> Model:
        if progress is not None:
            progress(0.05, desc="Loading the model (first use only)")
        return self.store.get(source, dtype)

    def checked_prompt(self, prompt: str | None, model: Model) -> str:
        if prompt is None or not str(prompt).strip():
            raise slmviz.PromptError("The prompt is empty; type some text or pick an example")
        limit = model.max_tokens * CHARS_PER_TOKEN_LIMIT
        if len(prompt) > limit:
            raise slmviz.PromptError(f"The prompt is {len(prompt)} characters; the limit is {model.max_tokens} "
                                     f"tokens (at most {limit} characters)")
        return prompt

    def checked_new_tokens(self, n: float | int | None) -> int:
        if n is None or not float(n).is_integer() or not 1 <= int(n) <= self.max_new_tokens:
            raise ValueError(f"Max new tokens must be a whole number from 1 to {self.max_new_tokens}, got {n!r}")
        return int(n)

    def output_path(self, name: str) -> Path:
        """A fresh per-request file under this server's temporary folder; folders older than an hour go."""
        if self._output_root is None:
            self._output_root = Path(tempfile.mkdtemp(prefix="slmviz-app-"))
            atexit.register(shutil.rmtree, self._output_root, True)
        now = time.time()
        for old in self._output_root.iterdir():
            if now - old.stat().st_mtime > OUTPUT_TTL_S:
                shutil.rmtree(old, ignore_errors=True)
        return Path(tempfile.mkdtemp(dir=self._output_root)) / name

    def trace(self, model: Model, prompt: str, chat: bool, variant: Variant | None = None) -> Trace:
        return model.trace(self.checked_prompt(prompt, model), names=app_hooks, chat=bool(chat), variant=variant)

    # Run tab
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
        model = self.model(source, progress)
        layer_i, head_i = layer_value(layer, model), head_value(head)
        progress(0.3, desc="Tracing the prompt")
        trace = self.trace(model, prompt, chat)
        progress(0.7, desc="Drawing attention and the residual stream")
        attention = plots.attention(trace, layer_i, head_i)
        residual = plots.residual_norms(trace, tuple(stages or ()), per_position, log_y, include_first)
        table = display_frame(plots.next_token_table(trace, 10))
        status = (f"Traced {len(trace.tokens)} tokens through **{model.name}**"
                  f"{' (chat template)' if chat else ''}. Hover any plot for values; the camera icon saves a PNG.")
        return plots.tokens_html(trace), to_plot(attention), to_plot(residual), table, status, trace

    @readable_errors
    def logit_lens(self, trace: Trace | None) -> PlotData:
        """Runs after /run (the slowest figure: one unembedding per layer), so the others show first."""
        return to_plot(plots.logit_lens(self.need_trace(trace)))

    @readable_errors
    def attention(self, trace: Trace | None, layer: float, head: str) -> PlotData:
        trace = self.need_trace(trace)
        return to_plot(plots.attention(trace, layer_value(layer, trace._model), head_value(head)))

    @readable_errors
    def residual(self, trace: Trace | None, stages: list[str], per_position: bool, log_y: bool,
                 include_first: bool) -> PlotData:
        trace = self.need_trace(trace)
        return to_plot(plots.residual_norms(trace, tuple(stages or ()), per_position, log_y, include_first))

    @readable_errors
    def save_trace(self, trace: Trace | None) -> str:
        trace = self.need_trace(trace)
        path = self.output_path(f"slmviz-trace-{len(trace.tokens)}-tokens.safetensors")
        return str(trace.save(path))

    @staticmethod
    def need_trace(trace: Trace | None) -> Trace:
        if trace is None:
            raise ValueError("Run a prompt first")
        return trace

    # Break-it tab
    @readable_errors
    def preset(self, name: str, source: str | None = None) -> tuple:
        """Fill the field widgets from a preset that applies to this session's model."""
        model = self.store.get(source)
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
        n_new = self.checked_new_tokens(max_new_tokens)
        model = self.model(source, progress)
        variant = variant_from_fields(field_widgets, model)
        layer_i, head_i = layer_value(layer, model), head_value(head)
        if head_i is None:
            head_i = 0  # side by side, one head each: the all-heads grid twice would not fit
        progress(0.15, desc="Tracing the faithful model")
        faithful = self.trace(model, prompt, chat)
        progress(0.3, desc=f"Tracing {variant.label() or 'faithful'}")
        broken = model.trace(faithful.input_ids, variant=variant, names=app_hooks)
        progress(0.45, desc="Comparing")
        figs = [plots.kl_per_position(faithful, broken),
                plots.residual_norms(faithful, other=broken, log_y=True),
                plots.variant_diff(faithful, broken),
                plots.attention(faithful, layer_i, head_i),
                plots.attention(broken, layer_i, head_i)]
        progress(0.6, desc="Greedy continuation, faithful")
        cont_faithful = model.generate(faithful.input_ids, n_new)
        progress(0.8, desc="Greedy continuation, variant")
        cont_broken = model.generate(faithful.input_ids, n_new, variant=variant)
        bad = broken.first_nonfinite()
        note = f"\n\n⚠ Values stopped being finite at `{bad}` (fp32 overflow)." if bad else ""
        if variant.changes() == {"kv_position_bug": True}:
            note += "\n\nThis bug only affects cached decoding: the prefill is identical; compare the continuations."
        return (describe_variant(variant) + note,
                display_frame(plots.next_token_table(faithful, 10)), display_frame(plots.next_token_table(broken, 10)),
                *[to_plot(f) for f in figs], cont_faithful, cont_broken)

    @readable_errors
    def compare_all(self, prompt: str, chat: bool, source: str | None,
                    progress: gr.Progress = gr.Progress()) -> pd.DataFrame:  # noqa: B008
        model = self.model(source, progress)
        ids = model.encode(self.checked_prompt(prompt, model), chat=bool(chat))
        names = [n for n in applicable_presets(model) if n != "faithful"]
        rows = []
        for i, name in enumerate(names):
            progress((i, len(names)), desc=f"Variant {name}", unit="variants")
            rows.append(compare_variants(ids, variants=[name], model=model))
        frame = pd.concat(rows, ignore_index=True)
        return display_frame(frame)

    # Generate tab
    @readable_errors
    def generate(self, *inputs: Any) -> Iterator[tuple[str, str]]:
        """Inputs: prompt, chat, the Variant fields, max_new_tokens, temperature, top_k, seed, source."""
        (prompt, chat), field_widgets, (max_new_tokens, temperature, top_k, seed, source) = split_inputs(inputs, 2, 5)
        n_new = self.checked_new_tokens(max_new_tokens)
        if temperature is None or not 0 <= float(temperature) <= 5:
            raise ValueError(f"Temperature must be between 0 and 5, got {temperature!r}")
        k = None if top_k in (None, 0) else int(top_k)
        if k is not None and k < 0:
            raise ValueError(f"top-k must be 0 (off) or a positive whole number, got {top_k!r}")
        seed_i = None if seed is None or seed == "" else int(seed)
        model = self.model(source)
        variant = variant_from_fields(field_widgets, model)
        ids = model.encode(self.checked_prompt(prompt, model), chat=bool(chat))
        kwargs = dict(temperature=float(temperature), top_k=k, seed=seed_i)
        streams = [model.stream(ids, n_new, **kwargs), model.stream(ids, n_new, variant=variant, **kwargs)]
        texts = ["", ""]
        live = [True, True]
        while any(live):
            for i, stream in enumerate(streams):
                if not live[i]:
                    continue
                try:
                    texts[i] = next(stream).text
                except StopIteration:
                    live[i] = False
                except FloatingPointError as e:  # a variant whose logits overflow cannot be sampled
                    texts[i] += f"\n[stopped: {e}]"
                    live[i] = False
            yield texts[0], texts[1]

    # Model
    @readable_errors
    def load_model(self, source: str | None,
                   progress: gr.Progress = gr.Progress(track_tqdm=True)) -> tuple:  # noqa: B008
        """Switch this session to `source` (a bundled name, a hub id, a folder; empty = the startup model).

        Runs in its own queue ("load"), not the model queue, so a first Gemma load (dequantizing, about a
        minute) does not hold up other sessions' runs; track_tqdm shows transformers' own progress bars.
        """
        key = self.store.key(source)
        name = key or self.store.startup_name()
        if not self.store.is_loaded(key):
            if name in bundled_models() and not is_prepared(model_dir(name)):
                self.prepare(name, progress)
            progress(0.9, desc=f"Loading {name} (memory-mapping its weights)")
        model = self.store.get(key)
        return self.model_outputs(model, key)

    @staticmethod
    def prepare(name: str, progress: gr.Progress) -> None:
        """Dequantize a bundled model on first use, each step of slmviz.loading.bundled.prepare shown as progress."""
        steps = iter((0.05, 0.15, 0.75, 0.85))
        progress(0.02, desc=f"Preparing {name} once (dequantizing its GGUF, about a minute)")
        prepare_bundled(name, log=lambda line: progress(next(steps, 0.85), desc=f"{name}: {line}"))

    def model_outputs(self, model: Model, key: str) -> tuple:
        """Everything on the page that depends on the model: status, session source, layer and head pickers,
        the model picker, the presets that apply, and the variant fields (faithful, shown where they apply)."""
        n_layers = model.cfg.n_layers
        layer = gr.Slider(minimum=0, maximum=n_layers - 1, value=min(1, n_layers - 1), step=1)
        head = gr.Dropdown(choices=head_choices(model), value="all")
        head_single = gr.Dropdown(choices=head_choices(model)[1:], value="0")
        picked = key or self.store.startup_name()
        picker = gr.Dropdown(value=picked if picked in [v for _, v in self.model_choices()] else None)
        presets = applicable_presets(model)
        preset = gr.Dropdown(choices=presets, value=default_preset(presets))
        widgets = [gr.update(value=widget_value(f, getattr(BASE, f)), visible=field_applies(f, model))
                   for f in VARIANT_FIELDS]
        prompt = gr.Textbox(label=f"Prompt (up to {model.max_tokens} tokens)")
        return (model_line(model), key, layer, head, layer, head_single, picker, preset, *widgets, prompt)

    def model_choices(self) -> list[tuple[str, str]]:
        """The model picker: the startup model (if --model named a non-bundled one), then every bundled model."""
        names = ([self.store.startup_name()] if self.store.startup_name() not in bundled_models() else [])
        names += bundled_models()
        return [(_choice_label(n), n) for n in names]
