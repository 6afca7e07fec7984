"""File safety and parsing that every format shares: pickles refused, safetensors, JSON and YAML read with errors
that name the file, and files written whole or not at all.

Each reader takes `error`, the exception class of the object being read (slmviz.errors: SAEError, TranscoderSetError,
CLTError), so a broken file inside a CLT folder is a CLTError like every other problem with that CLT.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import SAEError

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin", ".ckpt")


def refuse_pickle(path: str | os.PathLike, error: type[SAEError] = SAEError) -> None:
    """Refuse a pickle-based weights file by name: torch.load / pickle.load run arbitrary code from the file."""
    if Path(path).suffix.lower() in PICKLE_SUFFIXES:
        raise error(
            f"{path}: pickle-based weight files ({', '.join(PICKLE_SUFFIXES)}) are refused, since loading one runs "
            "arbitrary code; convert it to safetensors (cfg.json + sae_weights.safetensors, or params.safetensors)"
        )


def refuse_pickles_in(folder: Path, error: type[SAEError] = SAEError) -> None:
    """Refuse the first pickle among `folder`'s files (a folder holding only a pickle: say so, rather than 'no
    weights here')."""
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        refuse_pickle(p, error)


def read_safetensors(path: str | os.PathLike, error: type[SAEError] = SAEError) -> dict[str, torch.Tensor]:
    """Every tensor of a .safetensors file (a pickle file is refused, a missing or corrupt one is a clear error)."""
    from safetensors import safe_open

    path = Path(path)
    refuse_pickle(path, error)
    if not path.is_file():
        raise error(f"{path}: no such weights file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    except Exception as e:  # safetensors raises its own error types for a corrupt header
        raise error(f"{path}: not a readable safetensors file ({e})") from e


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write `tensors` as they are (detached, contiguous, on the CPU; dtypes unchanged)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))


def read_json(path: Path, error: type[SAEError] = SAEError) -> dict[str, Any]:
    """A JSON object from `path`, or `error` naming the file."""
    return _read_mapping(path, error, "JSON", json.loads, json.JSONDecodeError)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """`data` as indented JSON with a final newline, written to a temporary name and renamed: a reader never sees half
    a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def read_yaml(path: Path, error: type[SAEError] = SAEError) -> dict[str, Any]:
    """A YAML mapping from `path` (safe_load: no Python objects), or `error` naming the file; an empty file is {}."""
    import yaml

    return _read_mapping(path, error, "YAML", lambda text: yaml.safe_load(text) or {}, yaml.YAMLError)


def _read_mapping(path: Path, error: type[SAEError], language: str, parse: Callable[[str], Any],
                  invalid: type[Exception]) -> dict[str, Any]:
    try:
        data = parse(path.read_text())
    except invalid as e:
        raise error(f"{path}: not valid {language} ({e})") from e
    if not isinstance(data, dict):
        raise error(f"{path}: expected a {language} mapping, got {type(data).__name__}")
    return data


def write_yaml(path: Path, data: dict[str, Any]) -> None:
    """`data` as YAML in the order given (circuit-tracer's config.yaml)."""
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))


def swap_in_folder(tmp: Path, folder: Path) -> None:
    """Replace `folder` by the complete folder `tmp` (its sibling): the old one renamed aside, `tmp` renamed in,
    then the old one removed. A reader finds the old folder or the new one, never a half-written one. (A rename
    cannot replace a non-empty folder, so `folder` is absent between the two renames: a crash just there leaves no
    scan, which the next prepare writes again, never a damaged one.) If `tmp` cannot be renamed in, the old folder
    is put back; if another writer's complete copy got there first, that one is kept."""
    aside = folder.with_name(f".{folder.name}-old-{uuid.uuid4().hex[:8]}")
    try:
        folder.rename(aside)
    except FileNotFoundError:  # nothing there yet (or another writer moved it first)
        aside = None
    try:
        tmp.rename(folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not folder.exists():  # not another writer's copy: the rename itself failed; put the old one back
            if aside is not None:
                aside.rename(folder)
            raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
