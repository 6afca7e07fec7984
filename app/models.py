"""The models this server serves, and what every tab's handlers share: the model store, the limits on what one
request may ask, and the folder of files handed back. Session state lives in gr.State, never here.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import slmviz
from slmviz import Model, Trace, Variant, bundled_models
from slmviz.hooks import LAYER_HOOKS
from slmviz.loading.bundled import DEFAULT_MODEL_NAME, is_prepared, model_dir
from slmviz.loading.default_model import HUB_ID
from slmviz.model_api import HUB_ID_PATTERN, download_from_hub, load_folder
from slmviz.trace import RESIDUAL_STAGES

from .shared import OutputFolder

log = logging.getLogger("slmviz.app")

MAX_PROMPT_TOKENS = 512
MAX_NEW_TOKENS = 256
CHARS_PER_TOKEN_LIMIT = 16  # refuse absurdly long text before spending time tokenizing it
MODELS_KEPT = 2  # the startup model plus one other, so a Space's memory stays bounded
FAST_COPIES_KEPT = 1  # bf16 copies (the Patch and Corpus tabs' "fast (bf16)" switch), at half a model's memory each

# The page's traces capture what its figures read: the residual stream and the attention patterns.
APP_HOOK_SUFFIXES = (*RESIDUAL_STAGES.values(), "attn.hook_pattern")
assert all(s in LAYER_HOOKS for s in APP_HOOK_SUFFIXES)


def app_hooks(name: str) -> bool:
    return name.endswith(APP_HOOK_SUFFIXES)


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


class AppContext:
    """What every tab's handlers share on one server: its ModelStore, the limits on a request, and its output
    folder. One instance per server."""

    def __init__(self, store: ModelStore, max_new_tokens: int = MAX_NEW_TOKENS):
        self.store = store
        self.max_new_tokens = max_new_tokens
        self.outputs = OutputFolder()

    def model(self, source: str | None, progress: Any = None, dtype: str = "float32") -> Model:
        """The session's model (`source`; "" = the startup model), loaded on first use, in `dtype`."""
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

    def trace(self, model: Model, prompt: str, chat: bool, variant: Variant | None = None) -> Trace:
        """The prompt traced for the page's figures (app_hooks), after the prompt's checks."""
        return model.trace(self.checked_prompt(prompt, model), names=app_hooks, chat=bool(chat), variant=variant)

    def output_path(self, name: str) -> Path:
        """A fresh per-request file under this server's temporary folder."""
        return self.outputs.path(name)


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


# --- layers and heads as the pickers show them --------------------------------------------------
def head_value(head: str | int | None) -> int | None:
    """Dropdown value → head index; "all" (or empty) → None, the GQA grid."""
    if head is None or head == "" or head == "all":
        return None
    try:
        return int(head)
    except (TypeError, ValueError):
        raise ValueError(f"head must be a head number or 'all', got {head!r}") from None


def layer_value(layer: float | int | None, n: int) -> int:
    """The layer slider's value as a layer index of a model with `n` layers."""
    if layer is None or not float(layer).is_integer() or not 0 <= int(layer) < n:
        raise ValueError(f"layer must be a whole number in 0..{n - 1}, got {layer!r}")
    return int(layer)


def head_choices(model: Model) -> list[tuple[str, str]]:
    return [("all heads, by KV group", "all")] + [(f"head {h}", str(h)) for h in range(model.cfg.n_heads)]


def first_layer(model: Model) -> int:
    """The layer the sliders start on: layer 1, past the embedding-only patterns of layer 0."""
    return min(1, model.cfg.n_layers - 1)


def choice_label(name: str) -> str:
    """The model picker's label of a model: a bundled one says so, and whether its first use dequantizes it."""
    if name not in bundled_models():
        return name
    first_use = "" if is_prepared(model_dir(name)) else ", first use dequantizes it: about a minute"
    return f"{name} (bundled{first_use})"


def model_choices(store: ModelStore) -> list[tuple[str, str]]:
    """The model picker: the startup model (if --model named a non-bundled one), then every bundled model."""
    names = [store.startup_name()] if store.startup_name() not in bundled_models() else []
    names += bundled_models()
    return [(choice_label(n), n) for n in names]
