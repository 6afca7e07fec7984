"""`slmviz.load_sae`: an SAE or transcoder from a bundled name, a SAELens folder, a Gemma Scope 2 folder, or the hub.

    sae = slmviz.load_sae("resid_post_l15", model=m)     # a bundled SAE (slmviz.bundled_saes(m))
    sae = slmviz.load_sae("folder", model=m)            # SAELens: cfg.json + sae_weights.safetensors
    sae = slmviz.load_sae("folder", model=g)            # Gemma Scope 2: params.safetensors (+ config.json)
    sae = slmviz.load_sae("google/gemma-scope-2-270m-pt", subfolder="resid_post/layer_9_width_16k_l0_medium", model=g)

Which layout a folder holds is read from its files; the format modules (formats.saelens, formats.gemma_scope) turn
it into a spec and tensors, and the SAE is built from those alone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import SAEError
from ..formats import gemma_scope, hub, saelens
from ..formats.files import refuse_pickle, refuse_pickles_in
from .bundled import bundled_sae_folder
from .sae import SAE


def load_sae(source: str | os.PathLike | SAE, model: Any = None, subfolder: str | None = None) -> SAE:
    """An SAE / transcoder from a bundled SAE's name (with model=), a SAELens folder, a Gemma Scope 2 folder, or a
    hub id (+ subfolder).

    With `model=`, the SAE's hooks must exist in the model's family and their widths match d_in / d_out (clear
    errors otherwise), and the SAE keeps a reference to the model (`logit_effects` reads its unembedding).
    Nothing is downloaded unless `source` is a hub id (owner/name) that is not a local folder.
    """
    if isinstance(source, SAE):
        sae = source
    elif not isinstance(source, str | os.PathLike):
        raise TypeError(f"load_sae takes a folder, a hub id or an SAE, not {type(source).__name__}")
    else:
        path = Path(source) / subfolder if subfolder else Path(source)
        bundled = bundled_sae_folder(str(source), model) if subfolder is None else None
        if bundled is not None:  # a bundled SAE's name (slmviz.bundled_saes(model)): a plain word, never a path
            sae = load_folder(bundled)
        elif path.exists():
            sae = load_folder(path)
        elif _is_hub_id(str(source)) and subfolder:
            sae = load_folder(hub.download(str(source), subfolder))
        elif _is_hub_id(str(source)):
            raise SAEError(f"no folder {str(source)!r} here; for an SAE on the hub, pass the folder inside the repo "
                           "as subfolder=, e.g. load_sae('google/gemma-scope-2-270m-pt', "
                           "subfolder='resid_post/layer_9_width_16k_l0_medium')")
        else:
            raise SAEError(
                f"{str(path)!r} is neither a folder (SAELens: {saelens.CFG_FILENAME} + {saelens.WEIGHTS_FILENAME}; "
                f"Gemma Scope 2: {gemma_scope.SAE_FILE}) nor a hub id like 'google/gemma-scope-2-270m-pt' with "
                "subfolder="
            )
    if model is not None:
        sae.check_model(model)
        sae.to(getattr(model, "device", "cpu"))  # the splice runs where the model's activations are
        sae.model = model
    return sae


def load_folder(path: str | os.PathLike) -> SAE:
    """A local SAELens or Gemma Scope 2 folder (or one of their weight files); pickles are refused."""
    path = Path(path)
    refuse_pickle(path)
    expected = (f"{saelens.CFG_FILENAME} + {saelens.WEIGHTS_FILENAME} (SAELens) or {gemma_scope.SAE_FILE} "
                f"(+ {gemma_scope.CONFIG}) (Gemma Scope 2)")
    if path.is_file():
        if path.name not in (saelens.WEIGHTS_FILENAME, gemma_scope.SAE_FILE):
            raise SAEError(f"{path}: expected a folder holding {expected}")
        path = path.parent
    for layout in (saelens, gemma_scope):
        if layout.holds_sae(path):
            spec, tensors, _ = layout.read_sae(path)
            return SAE.from_state(tensors, copy=False, **spec)
    refuse_pickles_in(path)
    raise SAEError(f"{path}: no SAE here; expected {expected}; found {sorted(p.name for p in path.iterdir())[:10]}")


def _is_hub_id(source: str) -> bool:
    from ..model_api import HUB_ID_PATTERN

    return bool(HUB_ID_PATTERN.match(source))
