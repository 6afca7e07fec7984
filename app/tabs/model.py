"""The Model tab: switch the session to another model (a bundled one, a hub id, or a local folder with
--allow-local-models), and load an SAE or transcoder for it.

A model switch changes much of the page (the layer and head pickers, the presets that apply, the variant fields,
the prompt's limit); app/main.py, which knows the page, hands in what to update. A load runs in its own queue
("load"), so a first Gemma load (dequantizing, about a minute) does not hold up other sessions' runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

import slmviz
from slmviz.config import SUPPORTED_ARCHITECTURES
from slmviz.loading.bundled import is_prepared, model_dir
from slmviz.loading.bundled import prepare as prepare_bundled

from ..models import AppContext, model_line
from ..saes import SAEStore
from ..shared import readable_errors, session


class ModelHandlers:
    """Loading a model or an SAE for the session. `switched(model, key)` gives the page's updates for a newly
    loaded model (everything after the status line and the session's source)."""

    def __init__(self, ctx: AppContext, saes: SAEStore, switched: Callable[[slmviz.Model, str], tuple]):
        self.ctx = ctx
        self.saes = saes
        self.switched = switched

    @readable_errors
    def load_model(self, source: str | None,
                   progress: gr.Progress = gr.Progress(track_tqdm=True)) -> tuple:  # noqa: B008
        """Switch this session to `source` (a bundled name, a hub id, a folder; empty = the startup model);
        track_tqdm shows transformers' own progress bars."""
        store = self.ctx.store
        key = store.key(source)
        name = key or store.startup_name()
        if not store.is_loaded(key):
            if name in slmviz.bundled_models() and not is_prepared(model_dir(name)):
                self.prepare(name, progress)
            progress(0.9, desc=f"Loading {name} (memory-mapping its weights)")
        model = store.get(key)
        return (model_line(model), key, *self.switched(model, key))

    @staticmethod
    def prepare(name: str, progress: Any) -> None:
        """Dequantize a bundled model on first use, each step of slmviz.loading.bundled.prepare shown as progress."""
        steps = iter((0.05, 0.15, 0.75, 0.85))
        progress(0.02, desc=f"Preparing {name} once (dequantizing its GGUF, about a minute)")
        prepare_bundled(name, log=lambda line: progress(next(steps, 0.85), desc=f"{name}: {line}"))

    @readable_errors
    def load_sae(self, text: str, subfolder: str, source: str | None, request: gr.Request = None,
                 progress: gr.Progress = gr.Progress()) -> tuple:  # noqa: B008
        """The SAE loader: load it for this session's model, then pick it in the Features tab."""
        model = self.ctx.model(source)
        progress(0.2, desc=f"Loading the SAE for {model.name}")
        entry = self.saes.load(model, text, subfolder)
        names = self.saes.names(model, session(request))
        return (f"Loaded **{entry.name}**: {entry.sae!r}, for {model.name}. Pick it in the **Features** tab.",
                gr.Dropdown(choices=names, value=entry.name))


@dataclass(frozen=True)
class ModelTab:
    """The tab's inputs and buttons (app/main.py wires them: their outputs are all over the page)."""

    model_box: gr.Textbox
    load: gr.Button
    sae_box: gr.Textbox
    sae_subfolder: gr.Textbox
    sae_load: gr.Button
    sae_status: gr.Markdown


def build_model_tab(ctx: AppContext, saes: SAEStore) -> ModelTab:
    """The Model tab's layout, inside the page's gr.Tabs."""
    with gr.Tab("Model", id="tab-model"):
        allowed = "a hub id (owner/name)" + (" or a local folder" if ctx.store.allow_local else "")
        gr.Markdown(f"Load another model ({allowed}), or pick a bundled one above; leave empty for the "
                    f"startup model. Supported: {', '.join(SUPPORTED_ARCHITECTURES)} checkpoints in safetensors.")
        with gr.Row():
            model_box = gr.Textbox(label="model", placeholder="HuggingFaceTB/SmolLM2-135M-Instruct",
                                   elem_id="model-source", scale=4)
            load_btn = gr.Button("Load", elem_id="load-model", scale=1)
        sae_allowed = "a hub id (owner/name) with its subfolder" + (
            ", or a local SAE folder" if saes.allow_local else "")
        gr.Markdown(f"Load an SAE or transcoder for the session's model: {sae_allowed} (SAELens or Gemma Scope 2 "
                    "format, safetensors only); then browse it in the **Features** tab.")
        with gr.Row():
            sae_box = gr.Textbox(label="SAE", placeholder="google/gemma-scope-2-270m-pt", elem_id="sae-source",
                                 scale=3)
            sae_sub = gr.Textbox(label="subfolder (hub)", placeholder="resid_post/layer_9_width_16k_l0_medium",
                                 elem_id="sae-subfolder", scale=3)
            sae_btn = gr.Button("Load the SAE", elem_id="load-sae", scale=1)
        sae_status = gr.Markdown(elem_id="sae-status")
    return ModelTab(model_box, load_btn, sae_box, sae_sub, sae_btn, sae_status)
