"""slmviz's own training checkpoint, `out/checkpoint.safetensors`: a run's tensors, and in the safetensors header's
metadata, under one key, its configuration and data cursor as JSON. This module reads the header alone (a finished
run's file is read for its arguments, and an older one can still hold gigabytes of weights).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CHECKPOINT = "checkpoint.safetensors"
# The metadata key each trainer of 0.2.0 wrote: train_sae, train_transcoders(kind="plt"), and (kind="clt").
STATE_KEYS = ("slmviz_train_state", "slmviz_train_set_state", "slmviz_train_clt_state")


def read_header(out: str | os.PathLike) -> tuple[str, dict[str, Any]] | None:
    """(metadata key, its parsed JSON) of out/checkpoint.safetensors, or None when there is no checkpoint (or it
    holds none of STATE_KEYS)."""
    from safetensors import safe_open

    path = Path(out) / CHECKPOINT
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
    for key in STATE_KEYS:
        if key in metadata:
            return key, json.loads(metadata[key])
    return None


def run_finished(out: str | os.PathLike) -> bool | None:
    """Whether the run in `out` finished (its object saved), from the checkpoint's header alone; None without a
    checkpoint. Trainers write their object before the finished checkpoint, so a run killed while saving it is not
    taken for a finished one."""
    header = read_header(out)
    if header is None:
        return None
    key, meta = header
    cursors = [v["cursor"] for v in meta["layers"].values()] if "layers" in meta else [meta["cursor"]]
    return all(bool(c["finished"]) for c in cursors)
