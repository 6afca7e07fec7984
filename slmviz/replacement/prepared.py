"""A model's prepared replacement models, by name: `slmviz prepare --transcoders plt` trains them into
$SLMVIZ_CACHE/transcoders/{model}/{kind}/, and `slmviz.load_transcoders("plt", model=m)` finds them there. Also what
a folder holds, by its files (`holds_clt`, `holds_replacement`): what tells a finished set, and what load_transcoders
reads a folder's layout from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..formats import circuit_tracer, gemma_scope
from ..formats import slmviz as slmviz_layout
from ..formats.checkpoint import run_finished
from ..loading.bundled import prepared_dir

PREPARED = ("plt", "plt-quick", "clt")  # names of a model's prepared sets (training.prepare.RECIPES), each in
# loading.bundled.prepared_dir
CLT_LAYOUTS = (circuit_tracer, gemma_scope)
SET_LAYOUTS = (slmviz_layout, circuit_tracer, gemma_scope)


def holds_clt(folder: Path) -> bool:
    """Whether `folder` holds a CLT in either layout (its first layer's files)."""
    return folder.is_dir() and any(layout.holds_clt(folder) for layout in CLT_LAYOUTS)


def holds_replacement(folder: Path) -> bool:
    """Whether `folder` holds a CLT or a per-layer set in a layout slmviz reads."""
    return holds_clt(folder) or folder.is_dir() and any(layout.holds_transcoder_set(folder) for layout in SET_LAYOUTS)


def prepared_ready(model: Any, kind: str) -> bool:
    """Whether the model's prepared `kind` set ("plt", "plt-quick", "clt") is finished and can be loaded: a per-layer
    set's file is written at its run's end; a CLT's files are, and then its checkpoint says finished (so a CLT killed
    while its files were written is not taken for one)."""
    folder = prepared_dir(model, kind)
    if kind == "clt":
        return holds_clt(folder) and run_finished(folder) is not False
    return slmviz_layout.holds_transcoder_set(folder) or circuit_tracer.holds_transcoder_set(folder)
