"""slmviz's own training checkpoint, `out/checkpoint.safetensors`: one format for every trainer (train_sae,
train_transcoders of either kind).

The tensors of each coder a run trains sit under a prefix naming the coder (`sae.W_enc`, `L3.W_enc`, `clt.W_dec_0`,
...); the safetensors header's metadata holds, under HEADER_KEY, one JSON object:

    {"format": 2, "config": {the run's configuration},
     "coders": {name: {"cursor": {...}, "scale_in": [...], "scale_out": [...]}}}

The file is written to a temporary name, fsynced and renamed, so a run killed at any moment leaves the previous
checkpoint whole. A finished run's checkpoint keeps its header alone (its object is saved beside it).

0.2.0's three trainers each wrote a header key of their own (OLD_KEYS); `upgrade_0_2` maps such a file into this
format, so their interrupted runs resume and their finished sets still load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import SAEError
from ..hooks import layer_hook_name

CHECKPOINT = "checkpoint.safetensors"
HEADER_KEY = "slmviz_train"
FORMAT = 2
# The header key each trainer of 0.2.0 wrote: train_sae, train_transcoders(kind="plt"), and (kind="clt").
OLD_KEYS = ("slmviz_train_state", "slmviz_train_set_state", "slmviz_train_clt_state")


class CheckpointError(SAEError):
    """out/ holds another run's checkpoint, or a file that is not one: the message says what differs and what to do.
    An SAEError (so a ValueError), as 0.2.0's was: a caller that catches the coders' errors catches it too."""


@dataclass
class Checkpoint:
    """A run's state as its checkpoint holds it: the configuration (JSON), each coder's cursor and scales, and the
    tensors by prefixed name ({} when read without them, or for a finished run)."""

    config: dict[str, Any]
    coders: dict[str, dict[str, Any]]
    tensors: dict[str, torch.Tensor]

    @property
    def finished(self) -> bool:
        return all(bool(c["cursor"]["finished"]) for c in self.coders.values())


def write_checkpoint(out: str | os.PathLike, checkpoint: Checkpoint) -> None:
    """out/checkpoint.safetensors, atomically (temporary file, fsync, rename)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    header = {"format": FORMAT, "config": checkpoint.config, "coders": checkpoint.coders}
    tmp = out / (CHECKPOINT + ".tmp")
    save_file(checkpoint.tensors, str(tmp), metadata={HEADER_KEY: json.dumps(header)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / CHECKPOINT)


def read_checkpoint(out: str | os.PathLike, tensors: bool = True) -> Checkpoint | None:
    """The checkpoint in `out` (0.2.0's upgraded), or None when there is none. `tensors=False` reads the header
    alone (a run's tensors can be gigabytes; a finished run's arguments and cursors are in the header)."""
    from safetensors import safe_open

    path = Path(out) / CHECKPOINT
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            found = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118 (not a dict)
        if HEADER_KEY in metadata:
            header = json.loads(metadata[HEADER_KEY])
            if header.get("format") != FORMAT:
                raise ValueError(f"format {header.get('format')!r}, this version reads {FORMAT}")
            return Checkpoint(header["config"], header["coders"], found)
        for key in OLD_KEYS:
            if key in metadata:
                return upgrade_0_2(key, json.loads(metadata[key]), found)
        raise ValueError(f"no {HEADER_KEY!r} in its header")
    except Exception as e:
        raise CheckpointError(f"{path} is not a training checkpoint this version reads ({e}); train into another "
                              "out= folder") from e


def upgrade_0_2(key: str, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Checkpoint:
    """A checkpoint 0.2.0 wrote under `key` (OLD_KEYS), in this format: the one place that knows 0.2.0's layouts.

    - train_sae (`slmviz_train_state`): one coder "sae"; its config's hook / hook_out become `hooks`;
    - train_transcoders' PLT (`slmviz_train_set_state`): coders "L{layer}" (already its tensors' prefix), the set's
      kind, layers and name over the layers' configs, which differ only in their hooks;
    - the CLT (`slmviz_train_clt_state`): one coder "clt"; n_layers, d_model and input_hook become `hooks`, d_in
      and d_out; pre_act_coefficient, added after its first checkpoints, defaults to 0 (none).
    Every coder's scales become per-layer lists, its dead-feature counters [layers, d_sae] and its BatchTopK
    threshold [layers]; Adam's state keeps its indices (each coder keeps 0.2.0's parameter order).
    What goes wrong otherwise: a run 0.2.0 left half way restarts from nothing, or a set it prepared is refused."""
    if key == "slmviz_train_set_state":
        layers = {int(L): v for L, v in meta["layers"].items()}
        first = layers[min(layers)]["config"]
        config = {**_without(first, "hook", "hook_out"), "kind": "plt", "name": meta["set"]["name"],
                  "hooks": [[v["config"]["hook"], v["config"]["hook_out"]] for _, v in sorted(layers.items())]}
        coders = {f"L{L}": v for L, v in layers.items()}
    elif key == "slmviz_train_clt_state":
        old = meta["config"]
        hooks = [[layer_hook_name(L, old["input_hook"]), layer_hook_name(L, "hook_mlp_out")]
                 for L in range(old["n_layers"])]
        config = {**_without(old, "n_layers", "d_model", "input_hook"), "kind": "clt", "hooks": hooks,
                  "d_in": old["d_model"], "d_out": old["d_model"]}
        coders = {"clt": meta}
        tensors = {f"clt.{k}": v for k, v in tensors.items()}
    else:
        old = meta["config"]
        config = {**_without(old, "hook", "hook_out"), "kind": "sae", "name": "", "hooks": [[old["hook"],
                                                                                               old["hook_out"]]]}
        coders = {"sae": meta}
        tensors = {f"sae.{k}": v for k, v in tensors.items()}
    config.setdefault("pre_act_coefficient", 0.0)
    states = {}
    for name, state in coders.items():
        one = not isinstance(state["scale_in"], list)
        states[name] = {"cursor": state["cursor"], "scale_in": [state["scale_in"]] if one else state["scale_in"],
                        "scale_out": [state["scale_out"]] if one else state["scale_out"]}
        for field, shape in (("since_fired", (-1, config["d_sae"])), ("threshold", (-1,))):
            if f"{name}.{field}" in tensors:
                tensors[f"{name}.{field}"] = tensors[f"{name}.{field}"].reshape(shape)
    return Checkpoint(config, states, tensors)


def _without(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in keys}


def run_finished(out: str | os.PathLike) -> bool | None:
    """Whether the run in `out` finished (its object saved), from the checkpoint's header alone; None without a
    checkpoint. Trainers write their object before the finished checkpoint, so a run killed while saving it is not
    taken for a finished one."""
    checkpoint = read_checkpoint(out, tensors=False)
    return None if checkpoint is None else checkpoint.finished


def trained_tokens(out: str | os.PathLike) -> int | None:
    """The tokens per coder the run in `out` has trained (the mean of its coders' cursors: per layer for a set), or
    None without a checkpoint: where a resumed run starts. Reads the header alone."""
    checkpoint = read_checkpoint(out, tensors=False)
    if checkpoint is None:
        return None
    return sum(c["cursor"]["tokens"] for c in checkpoint.coders.values()) // max(len(checkpoint.coders), 1)
