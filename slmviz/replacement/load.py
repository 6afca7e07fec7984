"""`slmviz.load_transcoders`: a replacement model by prepared name, or from a folder in any layout slmviz reads,
found by what the folder holds:

    a CLT                 circuit-tracer's W_enc_{L} / W_dec_{L} files, or Gemma Scope 2's params_layer_{L} files
    a per-layer set       slmviz's transcoder_set.json, circuit-tracer's config.yaml + layer_{L}.safetensors, or Gemma
                          Scope 2's every-layer folders (layer_{L}_width_{W}_l0_{size}/)

The format modules read the files into specs and tensors; the objects are built from those alone, every file checked
before anything is returned (a half-loaded set never escapes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CLTError, SAEError, TranscoderSetError
from ..features.sae import SAE
from ..formats import circuit_tracer, gemma_scope
from ..formats import slmviz as slmviz_layout
from ..formats.files import refuse_pickle, refuse_pickles_in
from .base import ReplacementSet
from .clt import CrossLayerTranscoder
from .prepared import CLT_LAYOUTS, PREPARED, holds_clt, holds_replacement, prepared_dir
from .transcoder_set import TranscoderSet


def load_transcoders(source: str | os.PathLike, model: Any = None, width: str | None = None,
                     l0: str | None = None) -> ReplacementSet:
    """A transcoder set from a prepared set's name ("plt", "plt-quick", "clt": this model's, in $SLMVIZ_CACHE) or a
    folder in slmviz's, circuit-tracer's or Gemma Scope 2's layout (module docstring). With `model=`, the set is
    checked against the model (hooks, widths), moved to its device, and keeps a reference to it. `width` / `l0`
    choose among a Gemma Scope 2 folder's several transcoders per layer."""
    if isinstance(source, str) and source in PREPARED:
        if model is None:
            raise TranscoderSetError(f"load_transcoders({source!r}) loads a model's prepared set: pass model=")
        folder = prepared_dir(model, source)
        if not holds_replacement(folder):
            raise TranscoderSetError(
                f"{model.name!r} has no prepared {source.upper()} set yet ({folder} is empty); build it once with "
                f"`slmviz prepare --transcoders {source} --model {model.name}` (docs/features.md says how long it "
                f"takes), or load a folder: slmviz.load_transcoders('path/to/set', model=m)")
        source = folder
    path = Path(source)
    if not path.is_dir():
        raise TranscoderSetError(f"{str(path)!r} is not a folder; a transcoder set is a folder (slmviz: "
                                 f"{slmviz_layout.SET_FILE}; circuit-tracer: {circuit_tracer.CONFIG} + "
                                 "layer_L.safetensors; Gemma Scope 2: transcoder_all/layer_L_width_W_l0_S/), or a "
                                 f"prepared set's name ({', '.join(PREPARED)}) with model=")
    refuse_pickle(path, TranscoderSetError)
    if holds_clt(path):
        return load_clt(path, model=model)
    ts = _load_set(path, width, l0)
    if model is not None:
        expected = ts.metadata.get("model")
        if expected and expected != model.name:
            raise TranscoderSetError(f"{path} is a set for {expected!r}, not {model.name!r}")
        ts.attach(model, where=f"{path}, ")
    return ts


def load_clt(folder: str | os.PathLike, model: Any = None, input_hook: str | None = None,
             dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
    """A CLT from a circuit-tracer or Gemma Scope 2 folder (formats.circuit_tracer, formats.gemma_scope).
    `input_hook` overrides the file's (circuit-tracer's default without a config.yaml is hook_resid_mid; Gemma Scope
    2's mlp.hook_in). With `model`, the layer count, width and input hook must fit it (CLTError naming the folder),
    and the CLT moves to its device. `dtype`: the CLT's (default: the files')."""
    folder = Path(folder)
    refuse_pickle(folder, CLTError)
    if not folder.is_dir():
        raise CLTError(f"{folder}: no such folder (a CLT folder holds W_enc_{{L}}.safetensors + "
                       f"W_dec_{{L}}.safetensors, or {gemma_scope.CLT_FILE})")
    layout = next((layout for layout in CLT_LAYOUTS if layout.holds_clt(folder)), None)
    if layout is None:
        refuse_pickles_in(folder, CLTError)
        raise CLTError(f"{folder}: no CLT here; expected circuit-tracer's W_enc_{{L}}.safetensors + "
                       f"W_dec_{{L}}.safetensors or Gemma Scope 2's {gemma_scope.CLT_FILE}; found "
                       f"{sorted(p.name for p in folder.iterdir())[:10]}")
    spec, tensors = layout.read_clt(folder)
    if input_hook is not None:
        spec["input_hook"] = input_hook
    clt = CrossLayerTranscoder.from_state(tensors, copy=False, dtype=dtype, **spec)
    return clt.attach(model, where=f"{folder}: ") if model is not None else clt


def _load_set(folder: Path, width: str | None, l0: str | None) -> TranscoderSet:
    """The per-layer set in `folder`, in the first of SET_LAYOUTS it holds; every layer's file read and checked."""
    if slmviz_layout.holds_transcoder_set(folder):
        info, stored = slmviz_layout.read_transcoder_set(folder)
    elif circuit_tracer.holds_transcoder_set(folder):
        info, stored = circuit_tracer.read_transcoder_set(folder)
    elif gemma_scope.holds_transcoder_set(folder):
        info, stored = gemma_scope.read_transcoder_set(folder, width, l0)
    else:
        found = sorted(p.name for p in folder.iterdir())[:10]
        raise TranscoderSetError(f"{folder}: no transcoder set here (no {slmviz_layout.SET_FILE}, no "
                                 f"{circuit_tracer.CONFIG}, no Gemma Scope 2 layer_L_width_W_l0_S folders); found "
                                 f"{found}")
    coders, files = {}, {}
    for layer in list(stored):
        spec, tensors, files[layer] = stored.pop(layer)  # each layer's read tensors become its coder's, one by one
        try:
            coders[layer] = SAE.from_state(tensors, copy=False, **spec)
        except SAEError as e:
            raise TranscoderSetError(f"{files[layer]}: {e}") from e
    _check_widths(coders, files)
    return TranscoderSet(coders, name=info["name"], metadata=info["metadata"])


def _check_widths(coders: dict[int, SAE], files: dict[int, Path]) -> None:
    """Every file has the first one's d_model and d_sae; else the error names the file that differs."""
    first = next(iter(coders))
    ref = coders[first]
    for L, sae in coders.items():
        for what, a, b in (("d_model", (sae.d_in, sae.d_out), (ref.d_in, ref.d_out)), ("d_sae", sae.d_sae, ref.d_sae)):
            if a != b:
                raise TranscoderSetError(f"{files[L]}: {what} {a} differs from {files[first]}'s {b}; a set's files "
                                         "all come from one run")
