"""SAELens 6's folder for one SAE or transcoder: `cfg.json` + `sae_weights.safetensors`, both ways.

    spec, tensors, path = read_sae("folder")       # what SAE.load builds an SAE from
    write_sae("folder", sae.spec(), sae.tensors())  # what SAE.save writes; sae_lens.SAE.load_from_disk reads it

The tensors carry SAELens's names and shapes, which are slmviz's: W_enc [d_in, d_sae], b_enc [d_sae], W_dec
[d_sae, d_out], b_dec [d_out], threshold [d_sae] (jumprelu), W_skip [d_out, d_in] (skip transcoders). A `spec` is
the SAE's settings in slmviz's vocabulary (SAE.spec: architecture relu | topk | jumprelu, skip, k, hooks,
apply_b_dec_to_input, ...); cfg.json spells them SAELens's way, which this module translates both ways:

- architecture: "standard" for a relu SAE, "*_transcoder" / "*_skip_transcoder" for transcoders (SAELens's classes);
- metadata: sae_lens_version >= 6.0 must be there, or load_from_disk takes the file for a pre-6 config and renames
  its keys; hook_name / hook_name_out live in metadata (pre-6 files: at the top, or `hook_point`);
- pre-6 files kept k in activation_fn_kwargs with activation_fn "topk".

slmviz's own set layout (formats.slmviz) is one of these folders per layer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import SAEError
from .files import read_json, read_safetensors, refuse_pickle, refuse_pickles_in, write_json, write_safetensors

CFG_FILENAME = "cfg.json"  # SAELens's SAE_CFG_FILENAME
WEIGHTS_FILENAME = "sae_weights.safetensors"  # SAELens's SAE_WEIGHTS_FILENAME

ARCHITECTURES = ("relu", "topk", "jumprelu")  # what slmviz computes
# SAELens's (and Gemma Scope's) architecture names -> (ours, has W_skip). SAELens writes "standard" for relu SAEs and
# the *_transcoder names for transcoders; whether a model is a transcoder otherwise follows from its hooks and shapes.
SAELENS_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "standard": ("relu", False),
    "relu": ("relu", False),
    "topk": ("topk", False),
    "jumprelu": ("jumprelu", False),
    "jump_relu": ("jumprelu", False),  # Gemma Scope 2's config.json spelling
    "transcoder": ("relu", False),
    "skip_transcoder": ("relu", True),
    "jumprelu_transcoder": ("jumprelu", False),
    "jumprelu_skip_transcoder": ("jumprelu", True),
}
NORMALIZATIONS = ("none",)  # SAELens's normalize_activations values that need nothing at run time
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The SAELens version whose cfg.json layout write_sae writes: load_from_disk treats a file without a version >= 6.0 as
# a pre-6 config and renames its keys, so the field must be there.
SAELENS_FORMAT_VERSION = "6.0.0"


def canonical_architecture(name: str) -> tuple[str, bool]:
    """A SAELens / Gemma Scope architecture name -> (relu | topk | jumprelu, has a skip connection).

    An unknown name is an error listing the supported ones: guessing (e.g. running a gated SAE as relu) runs and
    silently computes other features."""
    key = str(name).lower()
    if key not in SAELENS_ARCHITECTURES:
        raise SAEError(
            f"unknown SAE architecture {name!r}; supported: {', '.join(SAELENS_ARCHITECTURES)} "
            f"(slmviz computes {', '.join(ARCHITECTURES)}, with or without a skip connection)"
        )
    return SAELENS_ARCHITECTURES[key]


def holds_sae(folder: Path) -> bool:
    return (folder / CFG_FILENAME).is_file()


def read_sae(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """(spec, tensors, weights file) of a SAELens folder written by write_sae or by SAELens (6.x, or pre-6 keys)."""
    folder = Path(folder)
    refuse_pickle(folder)
    if not holds_sae(folder):
        refuse_pickles_in(folder)
        raise SAEError(f"{folder}: no {CFG_FILENAME}; a SAELens folder holds {CFG_FILENAME} and {WEIGHTS_FILENAME}")
    cfg = read_json(folder / CFG_FILENAME)
    tensors = read_safetensors(folder / WEIGHTS_FILENAME)
    if "scaling_factor" in tensors and not torch.all(tensors["scaling_factor"] == 1):
        raise SAEError("a finetuning scaling_factor other than 1 is not supported")
    return spec_of(cfg), tensors, folder / WEIGHTS_FILENAME


def spec_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """slmviz's SAE settings (SAE.spec) from a SAELens cfg.json dict."""
    meta = dict(cfg.get("metadata") or {})
    hook_name = meta.get("hook_name") or cfg.get("hook_name") or cfg.get("hook_point") or ""
    hook_name_out = meta.get("hook_name_out") or cfg.get("hook_name_out") or hook_name
    architecture = cfg.get("architecture", "standard")
    k = cfg.get("k")
    if k is None and cfg.get("activation_fn") == "topk":  # pre-6 configs kept k in activation_fn_kwargs
        architecture, k = "topk", (cfg.get("activation_fn_kwargs") or {}).get("k")
    norm = cfg.get("normalize_activations") or "none"
    if norm not in NORMALIZATIONS:
        raise SAEError(
            f"normalize_activations={norm!r} is not supported (slmviz reads {NORMALIZATIONS}): the SAE expects "
            "rescaled inputs, and feeding it raw activations would silently give other features"
        )
    dtype = DTYPES.get(str(cfg.get("dtype", "float32")).removeprefix("torch."))
    if dtype is None:
        raise SAEError(f"dtype {cfg.get('dtype')!r} is not one of {list(DTYPES)}")
    arch, skip = canonical_architecture(architecture)
    return {
        "architecture": arch,
        "k": int(k) if arch == "topk" and k is not None else None,
        "skip": skip,
        "hook_name": hook_name,
        "hook_name_out": hook_name_out,
        "apply_b_dec_to_input": bool(cfg.get("apply_b_dec_to_input", True)),
        "rescale_acts_by_decoder_norm": bool(cfg.get("rescale_acts_by_decoder_norm", False)),
        "reshape_activations": cfg.get("reshape_activations") or "none",
        "dtype": dtype,
        "metadata": meta,
    }


def cfg_of(spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """SAELens 6's cfg.json for an SAE with these settings (SAE.spec) and tensors (what load_from_disk reads)."""
    d_in, d_sae = tensors["W_enc"].shape
    d_out = tensors["W_dec"].shape[1]
    architecture = spec["architecture"]
    skip = "W_skip" in tensors
    name = {"relu": "standard", "topk": "topk", "jumprelu": "jumprelu"}[architecture]
    if spec["hook_name"] != spec["hook_name_out"] or d_in != d_out or skip:  # a transcoder (SAE.is_transcoder)
        if architecture == "topk":
            raise SAEError("SAELens has no topk transcoder format; save a topk transcoder as jumprelu instead")
        name = f"{'jumprelu_' if architecture == 'jumprelu' else ''}{'skip_' if skip else ''}transcoder"
    else:
        d_out = None
    metadata = {"sae_lens_version": SAELENS_FORMAT_VERSION, "sae_lens_training_version": SAELENS_FORMAT_VERSION}
    metadata.update(spec["metadata"])
    metadata.update(hook_name=spec["hook_name"], hook_name_out=spec["hook_name_out"], hook_head_index=None)
    cfg: dict[str, Any] = {
        "architecture": name,
        "d_in": int(d_in),
        "d_sae": int(d_sae),
        "dtype": next(k for k, v in DTYPES.items() if v == spec["dtype"]),
        "device": "cpu",
        "apply_b_dec_to_input": spec["apply_b_dec_to_input"],
        "normalize_activations": "none",
        "reshape_activations": spec["reshape_activations"],
        "metadata": metadata,
    }
    if architecture == "topk":
        cfg.update(k=spec["k"], rescale_acts_by_decoder_norm=spec["rescale_acts_by_decoder_norm"])
    if d_out is not None:
        cfg["d_out"] = int(d_out)
    return cfg


def write_sae(folder: str | os.PathLike, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write folder/cfg.json + folder/sae_weights.safetensors (the tensors as given: their dtype is the file's, while
    cfg.json's dtype is the spec's, the one the SAE runs in). Returns the folder."""
    folder = Path(folder)
    cfg = cfg_of(spec, tensors)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, folder / WEIGHTS_FILENAME)
    write_json(folder / CFG_FILENAME, cfg)
    return folder
