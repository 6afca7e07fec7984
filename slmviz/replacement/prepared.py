"""A model's prepared replacement models, by name: `slmviz prepare --transcoders plt` trains them into
$SLMVIZ_CACHE/transcoders/{model}/{kind}/, and `slmviz.load_transcoders("plt", model=m)` finds them there.
"""

from __future__ import annotations

from typing import Any

from ..formats.checkpoint import run_finished
from ..formats.clt_io import is_clt_folder
from ..formats.transcoder_io import CT_CONFIG, SET_FILE
from ..loading.bundled import prepared_dir

PREPARED = ("plt", "clt")  # names of a model's prepared sets (each in loading.bundled.prepared_dir)


def prepared_ready(model: Any, kind: str) -> bool:
    """Whether the model's prepared `kind` set ("plt", "clt") is finished and can be loaded: a PLT set's file is
    written at its run's end; a CLT's files are, and then its checkpoint says finished (so a CLT killed while its
    files were written is not taken for one)."""
    folder = prepared_dir(model, kind)
    if kind == "clt":
        return is_clt_folder(folder) and run_finished(folder) is not False
    return (folder / SET_FILE).is_file() or (folder / CT_CONFIG).is_file()
