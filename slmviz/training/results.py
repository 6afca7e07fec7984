"""The object each kind of run saves and returns: one SAE (kind "sae", SAELens's layout), a TranscoderSet of every
layer's coder ("plt", slmviz's layout), or one CrossLayerTranscoder ("clt": Gemma Scope 2's layout with a skip path,
circuit-tracer's without). `load_result` reads a finished run's object back instead of training again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..features.sae import SAE
from ..replacement.load import load_transcoders
from ..replacement.transcoder_set import TranscoderSet
from .config import TrainConfig


def coder_metadata(cfg: TrainConfig, coder: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """What one coder's object records beside its training figures: the caller's metadata (and, for a set's coder,
    which layer of which set it is)."""
    if cfg.kind == "plt":
        return {**metadata, "name": f"{cfg.name}/layer_{coder.removeprefix('L')}"}
    return dict(metadata)


def package(cfg: TrainConfig, objects: dict[str, Any], metadata: dict[str, Any]) -> Any:
    """The run's object from its coders' (Objective.result, by coder name)."""
    if cfg.kind != "plt":
        (only,) = objects.values()
        return only
    coders = {int(name.removeprefix("L")): coder for name, coder in objects.items()}
    set_config = {"kind": cfg.kind, "layers": list(coders), "name": cfg.name}
    return TranscoderSet(coders, name=cfg.name,
                         metadata={"trained_by": "slmviz.train_transcoders", **metadata, "set_config": set_config})


def save_result(cfg: TrainConfig, result: Any, out: Path) -> None:
    if cfg.kind == "clt":
        result.save(out, format="gemma-scope-2" if result.W_skip is not None else "circuit-tracer")
    else:
        result.save(out)


def load_result(cfg: TrainConfig, out: Path, model: Any) -> Any:
    """A finished run's object, as its run would have returned it (on the model's device)."""
    if cfg.kind == "sae":
        return SAE.load(out).to(model.decoder.device)
    return load_transcoders(out, model=model)


def to_device(cfg: TrainConfig, result: Any, device: Any) -> Any:
    for coder in (list(result) if cfg.kind == "plt" else [result]):
        coder.to(device)
    return result
