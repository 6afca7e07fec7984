"""slmviz's own layout of a per-layer transcoder set, both ways: `transcoder_set.json` ({format, kind, name, layers,
model, metadata}) and one SAELens folder per layer, `layer_{L}/` (cfg.json + sae_weights.safetensors: formats.saelens),
so each layer also opens alone with slmviz.load_sae or SAELens.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import SAEError, TranscoderSetError
from .files import read_json, write_json
from .saelens import read_sae, write_sae

SET_FILE = "transcoder_set.json"
_LAYER_FOLDER = re.compile(r"layer_(\d+)$")


def holds_transcoder_set(folder: Path) -> bool:
    return (folder / SET_FILE).is_file()


def read_transcoder_set(folder: Path) -> tuple[dict[str, Any], dict[int, tuple[dict[str, Any], dict[str, Any], Path]]]:
    """({name, metadata}, {layer: (spec, tensors, file)}): every layer transcoder_set.json lists, and no other."""
    meta = read_json(folder / SET_FILE, TranscoderSetError)
    layers = [int(L) for L in meta.get("layers", [])]
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := _LAYER_FOLDER.fullmatch(p.name)) and p.is_dir()}
    missing = [L for L in layers if L not in found]
    if missing:
        raise TranscoderSetError(f"{folder / SET_FILE} lists layers {missing} but {folder} has no "
                                 f"{', '.join(f'layer_{L}/' for L in missing)}")
    extra = sorted(set(found) - set(layers))
    if extra:
        raise TranscoderSetError(f"{folder} holds layer folders {extra} that {SET_FILE} does not list (a set "
                                 "mixed with another run's files?)")
    kind = meta.get("kind", "plt")
    if kind != "plt":
        raise TranscoderSetError(f"{folder / SET_FILE}: kind {kind!r}; this layout holds per-layer sets ('plt')")
    coders = {}
    for L in layers:
        try:
            coders[L] = read_sae(found[L])
        except SAEError as e:
            raise TranscoderSetError(f"{found[L]}: {e}") from e
    info = {"name": str(meta.get("name", "")),
            "metadata": {**meta.get("metadata", {}), "model": meta.get("model"), "folder": str(folder)}}
    return info, coders


def write_transcoder_set(folder: Path, info: dict[str, Any], coders: dict[int, tuple[dict[str, Any], dict[str, Any]]]
                         ) -> Path:
    """Write `coders` ({layer: (SAE.spec, SAE.tensors)}) and transcoder_set.json (last: a folder without it holds no
    finished set); `info`: {name, model, metadata}."""
    folder.mkdir(parents=True, exist_ok=True)
    for layer, (spec, tensors) in coders.items():
        write_sae(folder / f"layer_{layer}", spec, tensors)
    write_json(folder / SET_FILE, {"format": 1, "kind": "plt", "name": info.get("name", ""), "layers": list(coders),
                                   "model": info.get("model"), "metadata": info.get("metadata", {})})
    return folder
