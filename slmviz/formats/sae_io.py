"""`slmviz.load_sae`: an SAE or transcoder from a SAELens folder, a Gemma Scope 2 folder, or the hub.

    sae = slmviz.load_sae("folder", model=m)            # SAELens: cfg.json + sae_weights.safetensors
    sae = slmviz.load_sae("folder", model=g)            # Gemma Scope 2: params.safetensors (+ config.json)
    sae = slmviz.load_sae("google/gemma-scope-2-270m-pt", subfolder="resid_post/layer_9_width_16k_l0_medium", model=g)

Gemma Scope 2 (DESIGN.md's site table): a folder `{site}/layer_{L}_width_{W}_l0_{size}[_affine]/` holding
`params.safetensors` (w_enc [d_in, d_sae], w_dec [d_sae, d_out], b_enc, b_dec, threshold, and
affine_skip_connection [d_in, d_out] for affine transcoders) and sometimes a `config.json` (architecture
"jump_relu", hf_hook_point_in / hf_hook_point_out naming the transformers module it was trained on,
affine_connection). Without config.json, site and layer come from the folder's name. Every one is JumpReLU with
apply_b_dec_to_input False. Sites map to slmviz hooks by what the transformers module computes:

    resid_post   model.layers.L.output                            blocks.L.hook_resid_post
    attn_out     model.layers.L.self_attn.o_proj input            blocks.L.attn.hook_z, flattened to [pos, h*d_head]
    mlp_out      model.layers.L.post_feedforward_layernorm output blocks.L.hook_mlp_out
    transcoder   pre_feedforward_layernorm output ->              blocks.L.mlp.hook_in -> blocks.L.hook_mlp_out
                 post_feedforward_layernorm output

What breaks if a row changes: the SAE still runs wherever the width matches, and encodes another activation.
`mlp.hook_in` (after the norm's (1 + w) weight) is the transcoder's input; `ln2.hook_normalized` (before it)
has the same width and gives garbage features (model.block.mlp_input). Gemma's hook_mlp_out is after the
post-MLP norm, as `post_feedforward_layernorm.output` is, so the mlp_out row needs no norm of its own.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Any

from ..features.bundled import bundled_sae_folder
from ..features.sae import (
    CFG_FILENAME,
    PICKLE_SUFFIXES,
    SAE,
    WEIGHTS_FILENAME,
    SAEError,
    read_safetensors,
    refuse_pickle,
)

GEMMA_SCOPE_FILENAME = "params.safetensors"
GEMMA_SCOPE_CONFIG = "config.json"
GEMMA_SCOPE_KEYS = ("w_enc", "w_dec", "b_enc", "b_dec", "threshold")
GEMMA_SCOPE_SKIP = "affine_skip_connection"  # [d_in, d_out]: W_skip is its transpose
SITES = ("resid_post", "attn_out", "mlp_out", "transcoder")
ALL_LAYERS = "_all"  # Gemma Scope 2's every-layer sets: transcoder_all/layer_{L}_..., resid_post_all/... (same files)
# site -> (hook read, hook written or None) for layer L.
SITE_HOOKS: dict[str, tuple[str, str | None]] = {
    "resid_post": ("blocks.{L}.hook_resid_post", None),
    "attn_out": ("blocks.{L}.attn.hook_z", None),
    "mlp_out": ("blocks.{L}.hook_mlp_out", None),
    "transcoder": ("blocks.{L}.mlp.hook_in", "blocks.{L}.hook_mlp_out"),
}
# transformers hook points (config.json's hf_hook_point_in / _out) -> site, by pattern.
HF_HOOK_POINTS = [
    (re.compile(r"model\.layers\.(\d+)\.output$"), "resid_post"),
    (re.compile(r"model\.layers\.(\d+)\.self_attn\.o_proj\.input$"), "attn_out"),
    (re.compile(r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.output$"), "transcoder"),
    (re.compile(r"model\.layers\.(\d+)\.post_feedforward_layernorm\.output$"), "mlp_out"),
]
FOLDER_NAME = re.compile(r"layer_(\d+)_width_([0-9]+[kmKM]?)_l0_([A-Za-z0-9.]+?)(_affine)?$")
HUB_TIMEOUT_S = float(os.environ.get("SLMVIZ_HUB_TIMEOUT", "20"))  # the whole download attempt, not per request


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
            sae = load_folder(download(str(source), subfolder))
        elif _is_hub_id(str(source)):
            raise SAEError(f"no folder {str(source)!r} here; for an SAE on the hub, pass the folder inside the repo "
                           "as subfolder=, e.g. load_sae('google/gemma-scope-2-270m-pt', "
                           "subfolder='resid_post/layer_9_width_16k_l0_medium')")
        else:
            raise SAEError(
                f"{str(path)!r} is neither a folder (SAELens: {CFG_FILENAME} + {WEIGHTS_FILENAME}; Gemma Scope 2: "
                f"{GEMMA_SCOPE_FILENAME}) nor a hub id like 'google/gemma-scope-2-270m-pt' with subfolder="
            )
    if model is not None:
        check_against_model(sae, model)
        sae.to(getattr(model, "device", "cpu"))  # the splice runs where the model's activations are
        sae.model = model
    return sae


def load_folder(path: str | os.PathLike) -> SAE:
    """A local SAELens or Gemma Scope 2 folder (or one of their weight files); pickles are refused."""
    path = Path(path)
    refuse_pickle(path)
    if path.is_file():
        if path.name in (WEIGHTS_FILENAME, GEMMA_SCOPE_FILENAME):
            path = path.parent
        else:
            raise SAEError(f"{path}: expected a folder holding {CFG_FILENAME} + {WEIGHTS_FILENAME} (SAELens) or "
                           f"{GEMMA_SCOPE_FILENAME} (Gemma Scope 2)")
    if (path / CFG_FILENAME).is_file():
        return SAE.load(path)
    if (path / GEMMA_SCOPE_FILENAME).is_file():
        return load_gemma_scope(path)
    for p in sorted(path.iterdir()):
        if p.suffix.lower() in PICKLE_SUFFIXES:
            refuse_pickle(p)
    raise SAEError(f"{path}: no SAE here; expected {CFG_FILENAME} + {WEIGHTS_FILENAME} (SAELens) or "
                   f"{GEMMA_SCOPE_FILENAME} (+ {GEMMA_SCOPE_CONFIG}) (Gemma Scope 2); found "
                   f"{sorted(p.name for p in path.iterdir())[:10]}")


def gemma_scope_site(folder: Path, config: dict[str, Any] | None) -> tuple[str, int]:
    """(site, layer) of a Gemma Scope 2 folder: from config.json's hf_hook_point_in / _out when it has them,
    else from the folder's name `{site}[_all]/layer_{L}_width_{W}_l0_{size}[_affine]` (`transcoder_all` is the set
    for every layer, `transcoder` the one for a few)."""
    if config and config.get("hf_hook_point_in"):
        point_in, point_out = str(config["hf_hook_point_in"]), config.get("hf_hook_point_out")
        for pattern, site in HF_HOOK_POINTS:
            match = pattern.search(point_in)
            if match:
                layer = int(match.group(1))
                if site == "transcoder" and not point_out:
                    raise SAEError(f"{folder}: config.json reads {point_in} but names no hf_hook_point_out")
                if site != "transcoder" and point_out and point_out != point_in:
                    raise SAEError(f"{folder}: config.json's hook points {point_in} -> {point_out} are not a "
                                   f"Gemma Scope 2 site ({', '.join(SITES)})")
                return site, layer
        raise SAEError(f"{folder}: config.json's hf_hook_point_in {point_in!r} is not one of Gemma Scope 2's "
                       f"sites ({', '.join(SITES)}); known hook points: {[p.pattern for p, _ in HF_HOOK_POINTS]}")
    match = FOLDER_NAME.match(folder.name)
    site = folder.parent.name.removesuffix(ALL_LAYERS)
    if not match or site not in SITES:
        raise SAEError(
            f"{folder}: without a config.json the folder must be named like Gemma Scope 2's "
            f"'{{site}}[{ALL_LAYERS}]/layer_{{L}}_width_{{W}}_l0_{{size}}[_affine]' with site one of {SITES}; got "
            f"'{site}/{folder.name}'"
        )
    return site, int(match.group(1))


def load_gemma_scope(folder: str | os.PathLike) -> SAE:
    """A Gemma Scope 2 folder as a JumpReLU SAE / (affine) transcoder on slmviz's hooks (module table)."""
    folder = Path(folder)
    config = None
    if (folder / GEMMA_SCOPE_CONFIG).is_file():
        try:
            config = json.loads((folder / GEMMA_SCOPE_CONFIG).read_text())
        except json.JSONDecodeError as e:
            raise SAEError(f"{folder / GEMMA_SCOPE_CONFIG}: not valid JSON ({e})") from e
        arch = config.get("architecture", "jump_relu")
        if arch != "jump_relu":
            raise SAEError(f"{folder}: Gemma Scope 2 architecture {arch!r} is not supported (only 'jump_relu')")
    site, layer = gemma_scope_site(folder, config)
    raw = read_safetensors(folder / GEMMA_SCOPE_FILENAME)
    missing = [k for k in GEMMA_SCOPE_KEYS if k not in raw]
    if missing:
        raise SAEError(f"{folder / GEMMA_SCOPE_FILENAME}: missing {missing}; Gemma Scope 2 files hold "
                       f"{list(GEMMA_SCOPE_KEYS)} (+ {GEMMA_SCOPE_SKIP} for affine transcoders); found {sorted(raw)}")
    affine = GEMMA_SCOPE_SKIP in raw
    wants_affine = bool(config.get("affine_connection")) if config else folder.name.endswith("_affine")
    if wants_affine and not affine:
        raise SAEError(f"{folder}: an affine transcoder, but {GEMMA_SCOPE_FILENAME} has no {GEMMA_SCOPE_SKIP}")
    if affine and site != "transcoder":
        raise SAEError(f"{folder}: {GEMMA_SCOPE_SKIP} only belongs to a transcoder, not a {site} SAE")
    state = {"W_enc": raw["w_enc"], "W_dec": raw["w_dec"], "b_enc": raw["b_enc"], "b_dec": raw["b_dec"],
             "threshold": raw["threshold"]}
    if affine:
        skip = raw[GEMMA_SCOPE_SKIP]
        if skip.dim() != 2:
            raise SAEError(f"{GEMMA_SCOPE_SKIP} must be [d_in, d_out], got {tuple(skip.shape)}")
        state["W_skip"] = skip.T.contiguous()  # stored [d_in, d_out]; SAELens's W_skip is [d_out, d_in]
    hook_in, hook_out = (h.format(L=layer) if h else None for h in SITE_HOOKS[site])
    metadata = {"source": "gemma-scope-2", "site": site, "layer": layer, "folder": folder.name}
    if config:
        metadata.update({k: v for k, v in config.items() if isinstance(v, str | int | float | bool)})
    return SAE.from_state(
        state,
        architecture="jumprelu_skip_transcoder" if affine else "jumprelu",
        hook_name=hook_in, hook_name_out=hook_out,
        apply_b_dec_to_input=False,
        reshape_activations="hook_z" if site == "attn_out" else "none",
        metadata=metadata,
    )


def check_against_model(sae: SAE, model: Any) -> None:
    """The SAE's hooks exist in this model's family and have its widths (d_in at hook_name, d_out at hook_name_out)."""
    from ..hooks import hook_shape

    valid = model.hook_names
    family = getattr(model.cfg, "model_type", "this model")
    for what, name, width in (("reads", sae.hook_name, sae.d_in), ("writes", sae.hook_name_out, sae.d_out)):
        if name not in valid:
            local = name.split(".", 2)[-1]
            layers = sorted({int(n.split(".")[1]) for n in valid if n.endswith("." + local)})
            hint = (f"; this model has {local} at layers 0..{layers[-1]}" if layers
                    else f"; {family} models have no '{local}' hook (see model.hook_names)")
            raise SAEError(f"{sae!r} {what} {name!r}, which {model.name!r} ({family}) does not have{hint}")
        shape = hook_shape(name, model.cfg, 1)[1:]
        have = math.prod(shape)
        if have != width:
            dims = "x".join(map(str, shape))
            raise SAEError(
                f"{sae!r} {what} {width} values per token at {name!r}, but that hook is {dims} = {have} wide on "
                f"{model.name!r} ({family}, d_model={model.cfg.d_model}); this SAE was made for another model"
            )


# --- the hub ----------------------------------------------------------------------------------------------------
def _is_hub_id(source: str) -> bool:
    from ..model_api import HUB_ID_PATTERN

    return bool(HUB_ID_PATTERN.match(source))


def download(hub_id: str, subfolder: str | None, timeout_s: float = HUB_TIMEOUT_S) -> Path:
    """Fetch one SAE folder of a hub repo (SAELens or Gemma Scope 2 layout; safetensors and json only).

    The whole attempt is bounded by `timeout_s` (SLMVIZ_HUB_TIMEOUT): an unreachable hub is an error within it."""
    if not subfolder:
        raise SAEError(f"{hub_id!r}: a hub SAE needs subfolder=, e.g. 'resid_post/layer_9_width_16k_l0_medium'")
    if ".." in Path(subfolder).parts or Path(subfolder).is_absolute():
        raise SAEError(f"subfolder {subfolder!r} must be a relative path inside the repository")
    result: dict[str, Any] = {}

    def fetch() -> None:
        try:
            from huggingface_hub import hf_hub_download

            result["path"] = _fetch_folder(hf_hub_download, hub_id, subfolder, timeout_s)
        except Exception as e:  # the hub client raises many types (offline, 404, gated, timeouts)
            result["error"] = e

    worker = threading.Thread(target=fetch, name=f"load_sae {hub_id}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise SAEError(f"the Hugging Face hub did not answer for {hub_id}/{subfolder} within {timeout_s:.0f} s "
                       "(offline? set SLMVIZ_HUB_TIMEOUT to wait longer, or pass a local folder)")
    if "error" in result:
        e = result["error"]
        raise SAEError(f"could not fetch {hub_id}/{subfolder} from the Hugging Face hub: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return result["path"]


def _fetch_folder(hf_hub_download: Any, hub_id: str, subfolder: str, timeout_s: float) -> Path:
    """SAELens's two files if the folder has them, else Gemma Scope 2's (config.json is optional there)."""
    from huggingface_hub.utils import EntryNotFoundError

    def get(name: str) -> Path:
        return Path(hf_hub_download(hub_id, name, subfolder=subfolder, etag_timeout=min(10.0, timeout_s)))

    try:
        get(CFG_FILENAME)
        return get(WEIGHTS_FILENAME).parent
    except EntryNotFoundError:
        pass
    weights = get(GEMMA_SCOPE_FILENAME)
    with contextlib.suppress(EntryNotFoundError):  # optional in Gemma Scope 2 folders
        get(GEMMA_SCOPE_CONFIG)
    return weights.parent
