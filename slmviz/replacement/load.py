"""slmviz.load_transcoders: a replacement model by prepared name or from a folder in any layout slmviz reads."""

from __future__ import annotations

import os
from typing import Any

from ..formats.clt_io import is_clt_folder
from ..formats.transcoder_io import CT_CONFIG, SET_FILE, load_set_folder
from .prepared import PREPARED, prepared_dir
from .transcoder_set import TranscoderSetError


def load_transcoders(source: str | os.PathLike, model: Any = None, width: str | None = None,
                     l0: str | None = None) -> Any:
    """A transcoder set from a prepared set's name ("plt", "clt": this model's, in $SLMVIZ_CACHE) or a folder in
    slmviz's, circuit-tracer's or Gemma Scope 2's layout (formats.transcoder_io). With `model=`, every coder is
    checked against the model (hooks, widths) and keeps a reference to it."""
    if isinstance(source, str) and source in PREPARED:
        if model is None:
            raise TranscoderSetError(f"load_transcoders({source!r}) loads a model's prepared set: pass model=")
        folder = prepared_dir(model, source)
        if not (folder / SET_FILE).is_file() and not (folder / CT_CONFIG).is_file() and not is_clt_folder(folder):
            raise TranscoderSetError(
                f"{model.name!r} has no prepared {source.upper()} set yet ({folder} is empty); build it once with "
                f"`slmviz prepare --transcoders {source} --model {model.name}` (docs/features.md says how long it "
                f"takes), or load a folder: slmviz.load_transcoders('path/to/set', model=m)")
        source = folder
    return load_set_folder(source, model=model, width=width, l0=l0)
