"""Gemma Scope 2's files: SAE and transcoder folders, the every-layer transcoder sets, and the cross-layer transcoders.

**SAE / transcoder folders** `{site}[_all]/layer_{L}_width_{W}_l0_{size}[_affine]/`, read by `read_sae`:
`params.safetensors` (w_enc [d_in, d_sae], w_dec [d_sae, d_out], b_enc, b_dec, threshold, and affine_skip_connection
[d_in, d_out] for affine transcoders) and sometimes a `config.json` (architecture "jump_relu", hf_hook_point_in /
hf_hook_point_out naming the transformers module it was trained on, affine_connection). Without config.json, site and
layer come from the folder's name. Every one is JumpReLU with apply_b_dec_to_input False. Sites map to slmviz hooks by
what the transformers module computes:

    resid_post   model.layers.L.output                            blocks.L.hook_resid_post
    attn_out     model.layers.L.self_attn.o_proj input            blocks.L.attn.hook_z, flattened to [pos, h*d_head]
    mlp_out      model.layers.L.post_feedforward_layernorm output blocks.L.hook_mlp_out
    transcoder   pre_feedforward_layernorm output ->              blocks.L.mlp.hook_in -> blocks.L.hook_mlp_out
                 post_feedforward_layernorm output

What breaks if a row changes: the SAE still runs wherever the width matches, and encodes another activation.
`mlp.hook_in` (after the norm's (1 + w) weight) is the transcoder's input; `ln2.hook_normalized` (before it)
has the same width and gives garbage features (model.block.mlp_input). Gemma's hook_mlp_out is after the
post-MLP norm, as `post_feedforward_layernorm.output` is, so the mlp_out row needs no norm of its own.

**Every-layer sets** (`transcoder_all/`), read by `read_transcoder_set`: one such folder per layer; `width=` / `l0=`
choose among several per layer.

**Cross-layer transcoders** `clt/width_{W}_l0_{size}[_affine]/`, read by `read_clt` and written by `write_clt`, one
file per layer, as circuit-tracer's load_gemma_scope_2_clt reads them:

    params_layer_{L}.safetensors   w_enc [d_model, d_sae], b_enc [d_sae], b_dec [d_model], threshold [d_sae],
                                   w_dec [d_sae, n_layers, d_model] (slots j < L unused: circuit-tracer slices
                                   w_dec[:, L:], and so does slmviz; slmviz writes zeros there),
                                   affine_skip_connection [d_model, d_model] (x @ it, `_affine` folders only)
    config.json                    optional; hf_hook_point_in / _out name the transformers modules when present;
                                   slmviz_name (slmviz's own key) the CLT's name (clt_name)

Gemma Scope 2's CLTs read the pre-MLP norm's output (`blocks.L.mlp.hook_in`). circuit-tracer 0.5.0's
load_gemma_scope_2_clt loops `for layer_idx in range(max(paths.keys()))`: with the layers 0..n-1 it reads 0..n-2 and
drops the last layer's file, then stacks w_dec of n slots into a CLT of n - 1 layers (tests/test_clt_io.py pins that
slmviz reads every layer: a folder of n files is a CLT of n layers).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CLTError, SAEError, TranscoderSetError
from .checkpoint import CheckpointError, read_checkpoint
from .circuit_tracer import check_clt_tensor, clt_layer_count, refuse_negative_thresholds
from .files import read_json, read_safetensors, write_json, write_safetensors

SAE_FILE = "params.safetensors"
CONFIG = "config.json"
SAE_KEYS = ("w_enc", "w_dec", "b_enc", "b_dec", "threshold")
SKIP = "affine_skip_connection"  # [d_in, d_out]: W_skip is its transpose
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
CLT_FILE = "params_layer_{L}.safetensors"
CLT_NAME_KEY = "slmviz_name"  # the CLT's name in its config.json (slmviz's own key: other readers ignore it)
_CLT_FILE = re.compile(r"params_layer_(\d+)\.safetensors$")
# Gemma Scope 2's config.json hook points a CLT may read -> the local hook slmviz reads it at.
_CLT_INPUT = {re.compile(r"pre_feedforward_layernorm\.output$"): "mlp.hook_in",
              re.compile(r"post_attention_layernorm\.output$"): "mlp.hook_in"}


# ---- one SAE or transcoder ---------------------------------------------------------------------------------------
def holds_sae(folder: Path) -> bool:
    return (folder / SAE_FILE).is_file()


def site_of(folder: Path, config: dict[str, Any] | None) -> tuple[str, int]:
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


def read_sae(folder: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """(spec, tensors, weights file) of a Gemma Scope 2 folder: a JumpReLU SAE / (affine) transcoder on slmviz's hooks
    (module docstring), its tensors in slmviz's (SAELens's) names and orientation."""
    folder = Path(folder)
    config = None
    if (folder / CONFIG).is_file():
        config = read_json(folder / CONFIG)
        arch = config.get("architecture", "jump_relu")
        if arch != "jump_relu":
            raise SAEError(f"{folder}: Gemma Scope 2 architecture {arch!r} is not supported (only 'jump_relu')")
    site, layer = site_of(folder, config)
    raw = read_safetensors(folder / SAE_FILE)
    missing = [k for k in SAE_KEYS if k not in raw]
    if missing:
        raise SAEError(f"{folder / SAE_FILE}: missing {missing}; Gemma Scope 2 files hold {list(SAE_KEYS)} "
                       f"(+ {SKIP} for affine transcoders); found {sorted(raw)}")
    affine = SKIP in raw
    wants_affine = bool(config.get("affine_connection")) if config else folder.name.endswith("_affine")
    if wants_affine and not affine:
        raise SAEError(f"{folder}: an affine transcoder, but {SAE_FILE} has no {SKIP}")
    if affine and site != "transcoder":
        raise SAEError(f"{folder}: {SKIP} only belongs to a transcoder, not a {site} SAE")
    tensors = {"W_enc": raw["w_enc"], "W_dec": raw["w_dec"], "b_enc": raw["b_enc"], "b_dec": raw["b_dec"],
               "threshold": raw["threshold"]}
    if affine:
        skip = raw[SKIP]
        if skip.dim() != 2:
            raise SAEError(f"{SKIP} must be [d_in, d_out], got {tuple(skip.shape)}")
        tensors["W_skip"] = skip.T.contiguous()  # stored [d_in, d_out]; SAELens's W_skip is [d_out, d_in]
    hook_in, hook_out = (h.format(L=layer) if h else None for h in SITE_HOOKS[site])
    metadata = {"source": "gemma-scope-2", "site": site, "layer": layer, "folder": folder.name}
    if config:
        metadata.update({k: v for k, v in config.items() if isinstance(v, str | int | float | bool)})
    spec = {"architecture": "jumprelu", "skip": affine, "hook_name": hook_in, "hook_name_out": hook_out,
            "apply_b_dec_to_input": False, "reshape_activations": "hook_z" if site == "attn_out" else "none",
            "metadata": metadata}
    return spec, tensors, folder / SAE_FILE


# ---- every-layer transcoder sets -----------------------------------------------------------------------------------
def holds_transcoder_set(folder: Path) -> bool:
    return any(FOLDER_NAME.match(p.name) for p in folder.iterdir() if p.is_dir())


def read_transcoder_set(folder: Path, width: str | None = None, l0: str | None = None
                        ) -> tuple[dict[str, Any], dict[int, tuple[dict[str, Any], dict[str, torch.Tensor], Path]]]:
    """({name, metadata}, {layer: (spec, tensors, file)}) of an every-layer folder (transcoder_all/): one
    layer_{L}_width_{W}_l0_{size}[_affine] folder per layer; `width` / `l0` pick among several."""
    by_layer: dict[int, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        m = FOLDER_NAME.match(p.name)
        if not (m and p.is_dir() and holds_sae(p)):
            continue
        if (width and m.group(2) != width) or (l0 and m.group(3) != l0):
            continue
        by_layer.setdefault(int(m.group(1)), []).append(p)
    if not by_layer:
        raise TranscoderSetError(f"{folder}: no layer_L_width_W_l0_S folder with {SAE_FILE}"
                                 + (f" for width={width!r} l0={l0!r}" if width or l0 else ""))
    doubled = {L: [p.name for p in ps] for L, ps in by_layer.items() if len(ps) > 1}
    if doubled:
        raise TranscoderSetError(f"{folder}: several transcoders for one layer ({doubled}); choose one with "
                                 "width= and l0= (e.g. load_transcoders(folder, width='16k', l0='small'))")
    missing = [L for L in range(max(by_layer) + 1) if L not in by_layer]
    if missing:
        raise TranscoderSetError(f"{folder}: no transcoder for layers {missing}")
    coders = {}
    for L, (p,) in sorted(by_layer.items()):
        try:
            spec, tensors, path = read_sae(p)
        except SAEError as e:
            raise TranscoderSetError(f"{p}: {e}") from e
        if spec["metadata"]["site"] != "transcoder":
            raise TranscoderSetError(f"{p}: a {spec['metadata']['site']} SAE, not a transcoder")
        coders[L] = (spec, tensors, path)
    info = {"name": f"gemma-scope-2/{folder.name}", "metadata": {"source": "gemma-scope-2", "folder": str(folder)}}
    return info, coders


# ---- cross-layer transcoders ---------------------------------------------------------------------------------------
def holds_clt(folder: Path) -> bool:
    return (folder / CLT_FILE.format(L=0)).is_file()


def _clt_input_hook(config: dict[str, Any], where: Path) -> str:
    point = config.get("hf_hook_point_in")
    if not point:
        return "mlp.hook_in"
    for pattern, hook in _CLT_INPUT.items():
        if pattern.search(str(point)):
            return hook
    raise CLTError(f"{where}: hf_hook_point_in {point!r}; slmviz reads Gemma Scope 2 CLTs on the pre-MLP norm's "
                   f"output (pre_feedforward_layernorm.output, blocks.L.mlp.hook_in)")


def read_clt(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(spec, tensors) of a CLT folder (module docstring), in CrossLayerTranscoder's names (CrossLayerTranscoder.
    tensors): every file, the last layer's included."""
    config: dict[str, Any] = {}
    if (folder / CONFIG).is_file():
        config = read_json(folder / CONFIG, CLTError)
        arch = str(config.get("architecture", "jump_relu"))
        if "jump" not in arch:
            raise CLTError(f"{folder / CONFIG}: architecture {arch!r}; Gemma Scope 2's CLTs are JumpReLU")
    n = clt_layer_count(folder, _CLT_FILE, CLT_FILE)
    first = folder / CLT_FILE.format(L=0)
    raw = read_safetensors(first, CLTError)
    if "w_enc" not in raw or raw["w_enc"].dim() != 2:
        raise CLTError(f"{first}: no 2-d tensor 'w_enc' [d_model, d_sae] (found {sorted(raw)})")
    d_model, d_sae = raw["w_enc"].shape
    affine = SKIP in raw
    if config.get("affine_connection") and not affine or folder.name.endswith("_affine") and not affine:
        raise CLTError(f"{first}: an affine CLT, but no {SKIP}")
    spec = {"architecture": "jumprelu", "input_hook": _clt_input_hook(config, folder / CONFIG),
            "name": clt_name(folder, config),
            "metadata": {"source": "gemma-scope-2", "folder": str(folder),
                         **{k: v for k, v in config.items()
                            if isinstance(v, str | int | float | bool) and k != CLT_NAME_KEY}}}
    per_layer: dict[str, list[torch.Tensor]] = {"W_enc": [], "b_enc": [], "b_dec": [], "threshold": []}
    if affine:
        per_layer["W_skip"] = []
    tensors: dict[str, Any] = {}
    for L in range(n):
        path = folder / CLT_FILE.format(L=L)
        raw = raw if L == 0 else read_safetensors(path, CLTError)

        def get(key: str, shape: tuple[int, ...], what: str, raw=raw, path=path) -> torch.Tensor:
            return check_clt_tensor(raw, key, path, shape, what)

        per_layer["W_enc"].append(get("w_enc", (d_model, d_sae), "[d_model, d_sae]"))
        per_layer["b_enc"].append(get("b_enc", (d_sae,), "[d_sae]"))
        per_layer["b_dec"].append(get("b_dec", (d_model,), "[d_model]"))
        per_layer["threshold"].append(refuse_negative_thresholds(get("threshold", (d_sae,), "[d_sae]"), path))
        w_dec = get("w_dec", (d_sae, n, d_model), f"[d_sae, n_layers, d_model] with n_layers = {n}, the folder's "
                    "count of files")
        tensors[f"W_dec_{L}"] = w_dec[:, L:].contiguous()
        if affine:
            per_layer["W_skip"].append(get(SKIP, (d_model, d_model), "[d_model, d_model]").T)
    return spec, {**{k: torch.stack(v) for k, v in per_layer.items()}, **tensors}


def clt_name(folder: Path, config: dict[str, Any]) -> str:
    """The name the CLT in a Gemma Scope 2 `folder` loads with: config.json's CLT_NAME_KEY (write_clt writes it);
    else, for a folder 0.2.0 trained (its config.json names nothing), the name in the header of the finished training
    run's checkpoint beside the files; else the folder's name.

    Why: an attribution graph records the name of the set it was built with, and load_json refuses the graph against
    a set of another name; a CLT saved in this layout and loaded back under its folder's name would no longer take
    back its own graphs (tests/test_saved_files.py pins 0.2.0's graph_clt.json against its clt/ folder)."""
    if config.get(CLT_NAME_KEY):
        return str(config[CLT_NAME_KEY])
    try:
        run = read_checkpoint(folder, tensors=False)
    except CheckpointError:
        run = None  # a checkpoint this version cannot read names nothing; the CLT's own files still load
    if run is not None and run.finished and run.config.get("name"):
        return str(run.config["name"])
    return folder.name


def write_clt(folder: Path, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write a CLT's `params_layer_{L}.safetensors` + config.json (module docstring). Only a JumpReLU CLT reading
    mlp.hook_in has this form."""
    if spec["architecture"] != "jumprelu":
        raise CLTError(f"Gemma Scope 2's CLT files are JumpReLU; this CLT is {spec['architecture']} (save it with "
                       f"format='circuit-tracer')")
    if spec["input_hook"] != "mlp.hook_in":
        raise CLTError(f"Gemma Scope 2's CLTs read the pre-MLP norm's output (mlp.hook_in); this one reads "
                       f"{spec['input_hook']} (save it with format='circuit-tracer')")
    refuse_negative_thresholds(tensors["threshold"], folder)
    n, d_model, d_sae = tensors["W_enc"].shape
    skip = tensors.get("W_skip")
    folder.mkdir(parents=True, exist_ok=True)
    for L in range(n):
        w_dec = torch.zeros(d_sae, n, d_model, dtype=tensors["W_enc"].dtype)
        w_dec[:, L:] = tensors[f"W_dec_{L}"]
        layer = {"w_enc": tensors["W_enc"][L], "b_enc": tensors["b_enc"][L], "b_dec": tensors["b_dec"][L],
                 "threshold": tensors["threshold"][L], "w_dec": w_dec}
        if skip is not None:
            layer[SKIP] = skip[L].T
        write_safetensors(layer, folder / CLT_FILE.format(L=L))
    write_json(folder / CONFIG, {
        "architecture": "jump_relu", "affine_connection": skip is not None, "n_layers": n, "d_sae": d_sae,
        "hf_hook_point_in": "model.layers.{L}.pre_feedforward_layernorm.output",
        "hf_hook_point_out": "model.layers.{L}.post_feedforward_layernorm.output",
        **({CLT_NAME_KEY: spec["name"]} if spec.get("name") else {})})
    return folder
