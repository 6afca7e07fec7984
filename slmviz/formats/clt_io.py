"""Cross-layer transcoder files: circuit-tracer 0.5.0's layout and Gemma Scope 2's `clt/` folders, both ways.

    clt = load_clt("folder", model=m)                 # either layout, found by its files
    clt.save("out", format="circuit-tracer")          # W_enc_{L} / W_dec_{L}.safetensors + config.yaml
    clt.save("out", format="gemma-scope-2")           # params_layer_{L}.safetensors + config.json

circuit-tracer (transcoder/cross_layer_transcoder.py: `to_safetensors`, `load_clt`):

    W_enc_{L}.safetensors   W_enc_{L} [d_sae, d_model] (the transpose of slmviz's), b_enc_{L} [d_sae],
                            b_dec_{L} [d_model] (the bias of layer L's output), threshold_{L} [d_sae] (JumpReLU only)
    W_dec_{L}.safetensors   W_dec_{L} [d_sae, n_layers - L, d_model]: slot i writes layer L + i
    config.yaml             model_kind: cross_layer_transcoder, feature_input_hook, feature_output_hook (optional
                            for load_clt, which defaults to hook_resid_mid / hook_mlp_out; slmviz writes it always)

circuit-tracer's JumpReLU is h · 1[h > θ] and slmviz's (SAELens's) relu(h) · 1[h > θ]: the same for θ ≥ 0, so a
negative threshold is refused both ways. It has no TopK and reads no skip path from these files: a TopK CLT is saved
with `model_kind: slmviz_topk_cross_layer_transcoder` (circuit-tracer then refuses it by name instead of running it
as ReLU) and a skip CLT only as Gemma Scope 2.

Gemma Scope 2 (`clt/width_{W}_l0_{size}[_affine]/`, one file per layer, as circuit-tracer's load_gemma_scope_2_clt
reads them):

    params_layer_{L}.safetensors   w_enc [d_model, d_sae], b_enc [d_sae], b_dec [d_model], threshold [d_sae],
                                   w_dec [d_sae, n_layers, d_model] (slots j < L unused: circuit-tracer slices
                                   w_dec[:, L:], and so does slmviz; slmviz writes zeros there),
                                   affine_skip_connection [d_model, d_model] (x @ it, `_affine` folders only)
    config.json                    optional; hf_hook_point_in / _out name the transformers modules when present

Gemma Scope 2's CLTs read the pre-MLP norm's output (`blocks.L.mlp.hook_in`).

circuit-tracer 0.5.0's load_gemma_scope_2_clt loops `for layer_idx in range(max(paths.keys()))`: with the layers
0..n-1 it reads 0..n-2 and drops the last layer's file, then stacks w_dec of n slots into a CLT of n - 1 layers
(tests/test_clt_io.py pins that slmviz reads every layer: a folder of n files is a CLT of n layers).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..features.sae import SAEError, read_safetensors, refuse_pickle
from ..replacement.clt import CLTError, CrossLayerTranscoder, input_hook_local

CT_CONFIG = "config.yaml"
CT_KIND = "cross_layer_transcoder"
CT_TOPK_KIND = "slmviz_topk_cross_layer_transcoder"
GS_CONFIG = "config.json"
GS_FILE = "params_layer_{L}.safetensors"
GS_SKIP = "affine_skip_connection"
FORMATS = ("circuit-tracer", "gemma-scope-2")
# circuit-tracer's output hook names for the MLP's output (TransformerLens's hook_mlp_out, its ReplacementMLP's
# mlp.hook_out): both are what slmviz calls blocks.L.hook_mlp_out.
OUTPUT_HOOKS = ("hook_mlp_out", "mlp.hook_out")
_CT_ENC = re.compile(r"W_enc_(\d+)\.safetensors$")
_CT_DEC = re.compile(r"W_dec_(\d+)\.safetensors$")
_GS = re.compile(r"params_layer_(\d+)\.safetensors$")
# Gemma Scope 2's config.json hook points -> the local hook a CLT reads.
_HF_INPUT = {re.compile(r"pre_feedforward_layernorm\.output$"): "mlp.hook_in",
             re.compile(r"post_attention_layernorm\.output$"): "mlp.hook_in"}


def is_clt_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a CLT in either layout (W_enc_0.safetensors, or params_layer_0.safetensors)."""
    folder = Path(folder)
    return folder.is_dir() and ((folder / "W_enc_0.safetensors").is_file() or (folder / "W_dec_0.safetensors")
                                .is_file() or (folder / GS_FILE.format(L=0)).is_file())


def load_clt(folder: str | os.PathLike, model: Any = None, input_hook: str | None = None,
             dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
    """A CLT from a circuit-tracer or Gemma Scope 2 folder (module docstring). `input_hook` overrides the file's
    (circuit-tracer's default without a config.yaml is hook_resid_mid; Gemma Scope 2's mlp.hook_in). With `model`,
    the layer count, width and input hook must fit it (CLTError naming the folder), and the CLT moves to its
    device. `dtype`: the CLT's (default: the files')."""
    folder = Path(folder)
    refuse_pickle(folder)
    if not folder.is_dir():
        raise CLTError(f"{folder}: no such folder (a CLT folder holds W_enc_{{L}}.safetensors + "
                       f"W_dec_{{L}}.safetensors, or {GS_FILE.format(L='{L}')})")
    names = [p.name for p in folder.iterdir()]
    if any(_CT_ENC.match(n) or _CT_DEC.match(n) for n in names):
        clt = load_circuit_tracer_clt(folder, input_hook, dtype)
    elif any(_GS.match(n) for n in names):
        clt = load_gemma_scope_2_clt(folder, input_hook, dtype)
    else:
        for n in sorted(names):
            refuse_pickle(folder / n)
        raise CLTError(f"{folder}: no CLT here; expected circuit-tracer's W_enc_{{L}}.safetensors + "
                       f"W_dec_{{L}}.safetensors or Gemma Scope 2's {GS_FILE.format(L='{L}')}; found "
                       f"{sorted(names)[:10]}")
    if model is not None:
        clt.check_model(model, where=f"{folder}: ")
        clt.to(getattr(model, "device", "cpu"))
        clt.model = model
    return clt


def _layers(folder: Path, pattern: re.Pattern, template: str) -> int:
    """n_layers of a folder of per-layer files: they must be 0..n-1, each missing one named."""
    found = sorted(int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name)))
    if not found:
        raise CLTError(f"{folder}: no {template.format(L='{L}')} files")
    missing = [template.format(L=L) for L in range(max(found) + 1) if L not in found]
    if missing:
        raise CLTError(f"{folder}: missing {missing} (a CLT has one per layer, 0..{max(found)})")
    return max(found) + 1


def _tensor(raw: dict[str, torch.Tensor], key: str, path: Path, shape: tuple[int, ...], what: str) -> torch.Tensor:
    if key not in raw:
        raise CLTError(f"{path}: no tensor {key!r} (found {sorted(raw)})")
    t = raw[key]
    if tuple(t.shape) != shape:
        raise CLTError(f"{path}: {key} has shape {tuple(t.shape)}, expected {list(shape)} ({what})")
    if not t.is_floating_point() or not torch.isfinite(t).all():
        raise CLTError(f"{path}: {key} must hold finite floating-point values")
    return t


def _read(path: Path) -> dict[str, torch.Tensor]:
    try:
        return read_safetensors(path)
    except SAEError as e:
        raise CLTError(str(e)) from e


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        cfg = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise CLTError(f"{path}: not valid YAML ({e})") from e
    if not isinstance(cfg, dict):
        raise CLTError(f"{path}: expected a mapping, got {type(cfg).__name__}")
    return cfg


def _input_hook(name: str, where: Path) -> str:
    try:
        return input_hook_local(str(name))
    except CLTError as e:
        raise CLTError(f"{where}: feature_input_hook {name!r}: {e}") from e


def _check_threshold(threshold: torch.Tensor, where: Path) -> None:
    if (threshold < 0).any():
        raise CLTError(f"{where}: {int((threshold < 0).sum())} negative JumpReLU thresholds; circuit-tracer computes "
                       f"h·1[h > θ] and slmviz relu(h)·1[h > θ], which differ below 0")


def load_circuit_tracer_clt(folder: str | os.PathLike, input_hook: str | None = None,
                            dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
    """circuit-tracer's `W_enc_{L}` / `W_dec_{L}` files (+ config.yaml) as a CrossLayerTranscoder."""
    folder = Path(folder)
    cfg = _yaml(folder / CT_CONFIG) if (folder / CT_CONFIG).is_file() else {}
    kind = cfg.get("model_kind", CT_KIND)
    if kind not in (CT_KIND, CT_TOPK_KIND):
        raise CLTError(f"{folder / CT_CONFIG}: model_kind {kind!r}, not a cross-layer transcoder ({CT_KIND}); a "
                       f"per-layer set (transcoder_set) loads with slmviz.load_transcoders")
    out_hook = cfg.get("feature_output_hook", "hook_mlp_out")
    if out_hook not in OUTPUT_HOOKS:
        raise CLTError(f"{folder / CT_CONFIG}: feature_output_hook {out_hook!r}; a CLT writes the MLP's output "
                       f"({' or '.join(OUTPUT_HOOKS)}, slmviz's blocks.L.hook_mlp_out)")
    n = max(_layers(folder, _CT_ENC, "W_enc_{L}.safetensors"), _layers(folder, _CT_DEC, "W_dec_{L}.safetensors"))
    for template in ("W_enc_{L}.safetensors", "W_dec_{L}.safetensors"):
        missing = [template.format(L=L) for L in range(n) if not (folder / template.format(L=L)).is_file()]
        if missing:
            raise CLTError(f"{folder}: missing {missing} (a CLT of {n} layers has W_enc_L and W_dec_L for each)")
    first = folder / "W_enc_0.safetensors"
    raw0 = _read(first)
    if "W_enc_0" not in raw0 or raw0["W_enc_0"].dim() != 2:
        raise CLTError(f"{first}: no 2-d tensor 'W_enc_0' [d_sae, d_model] (found {sorted(raw0)})")
    d_sae, d_model = raw0["W_enc_0"].shape
    jump = "threshold_0" in raw0
    arch = "topk" if kind == CT_TOPK_KIND else "jumprelu" if jump else "relu"
    hook = input_hook or _input_hook(cfg.get("feature_input_hook", "hook_resid_mid"), folder / CT_CONFIG)
    slm = cfg.get("slmviz") or {}
    clt = CrossLayerTranscoder(n, int(d_model), int(d_sae), architecture=arch, k=slm.get("k"), input_hook=hook,
                               dtype=dtype or raw0["W_enc_0"].dtype, name=str(slm.get("name", "")),
                               metadata={**(slm.get("metadata") or {}), "source": "circuit-tracer",
                                         "folder": str(folder)})
    with torch.no_grad():
        for L in range(n):
            path = folder / f"W_enc_{L}.safetensors"
            raw = raw0 if L == 0 else _read(path)
            clt.W_enc[L] = _tensor(raw, f"W_enc_{L}", path, (d_sae, d_model), "[d_sae, d_model]").T
            clt.b_enc[L] = _tensor(raw, f"b_enc_{L}", path, (d_sae,), "[d_sae]")
            clt.b_dec[L] = _tensor(raw, f"b_dec_{L}", path, (d_model,), "[d_model]")
            if jump:
                threshold = _tensor(raw, f"threshold_{L}", path, (d_sae,), "[d_sae], as layer 0's file has one")
                _check_threshold(threshold, path)
                clt.threshold[L] = threshold
            path = folder / f"W_dec_{L}.safetensors"
            clt.W_dec[L].copy_(_tensor(_read(path), f"W_dec_{L}", path, (d_sae, n - L, d_model),
                                       f"[d_sae, n_layers - {L}, d_model] for layer {L} of {n}"))
    return clt


def _gs_input_hook(config: dict[str, Any], where: Path) -> str:
    point = config.get("hf_hook_point_in")
    if not point:
        return "mlp.hook_in"
    for pattern, hook in _HF_INPUT.items():
        if pattern.search(str(point)):
            return hook
    raise CLTError(f"{where}: hf_hook_point_in {point!r}; slmviz reads Gemma Scope 2 CLTs on the pre-MLP norm's "
                   f"output (pre_feedforward_layernorm.output, blocks.L.mlp.hook_in)")


def load_gemma_scope_2_clt(folder: str | os.PathLike, input_hook: str | None = None,
                           dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
    """Gemma Scope 2's `params_layer_{L}.safetensors` (+ config.json) as a CrossLayerTranscoder: every file, the last
    layer's included (module docstring)."""
    folder = Path(folder)
    config: dict[str, Any] = {}
    if (folder / GS_CONFIG).is_file():
        try:
            config = json.loads((folder / GS_CONFIG).read_text())
        except json.JSONDecodeError as e:
            raise CLTError(f"{folder / GS_CONFIG}: not valid JSON ({e})") from e
        arch = str(config.get("architecture", "jump_relu"))
        if "jump" not in arch:
            raise CLTError(f"{folder / GS_CONFIG}: architecture {arch!r}; Gemma Scope 2's CLTs are JumpReLU")
    n = _layers(folder, _GS, GS_FILE)
    first = folder / GS_FILE.format(L=0)
    raw0 = _read(first)
    if "w_enc" not in raw0 or raw0["w_enc"].dim() != 2:
        raise CLTError(f"{first}: no 2-d tensor 'w_enc' [d_model, d_sae] (found {sorted(raw0)})")
    d_model, d_sae = raw0["w_enc"].shape
    affine = GS_SKIP in raw0
    if config.get("affine_connection") and not affine or folder.name.endswith("_affine") and not affine:
        raise CLTError(f"{first}: an affine CLT, but no {GS_SKIP}")
    hook = input_hook or _gs_input_hook(config, folder / GS_CONFIG)
    meta = {"source": "gemma-scope-2", "folder": str(folder)}
    meta.update({k: v for k, v in config.items() if isinstance(v, str | int | float | bool)})
    clt = CrossLayerTranscoder(n, int(d_model), int(d_sae), architecture="jumprelu", input_hook=hook, skip=affine,
                               dtype=dtype or raw0["w_enc"].dtype, name=folder.name, metadata=meta)
    with torch.no_grad():
        for L in range(n):
            path = folder / GS_FILE.format(L=L)
            raw = raw0 if L == 0 else _read(path)
            clt.W_enc[L] = _tensor(raw, "w_enc", path, (d_model, d_sae), "[d_model, d_sae]")
            clt.b_enc[L] = _tensor(raw, "b_enc", path, (d_sae,), "[d_sae]")
            clt.b_dec[L] = _tensor(raw, "b_dec", path, (d_model,), "[d_model]")
            threshold = _tensor(raw, "threshold", path, (d_sae,), "[d_sae]")
            _check_threshold(threshold, path)
            clt.threshold[L] = threshold
            w_dec = _tensor(raw, "w_dec", path, (d_sae, n, d_model),
                            f"[d_sae, n_layers, d_model] with n_layers = {n}, the folder's count of files")
            clt.W_dec[L].copy_(w_dec[:, L:])
            if affine:
                clt.W_skip[L] = _tensor(raw, GS_SKIP, path, (d_model, d_model), "[d_model, d_model]").T
    return clt


def save_clt(clt: CrossLayerTranscoder, folder: str | os.PathLike, format: str = "circuit-tracer") -> Path:
    """Write `clt` in `format` (module docstring); returns the folder."""
    if format not in FORMATS:
        raise CLTError(f"format must be one of {FORMATS}, got {format!r}")
    folder = Path(folder)
    if clt.threshold is not None:
        _check_threshold(clt.threshold.detach(), folder)
    folder.mkdir(parents=True, exist_ok=True)
    n = clt.n_layers
    if format == "gemma-scope-2":
        if clt.architecture != "jumprelu":
            raise CLTError(f"Gemma Scope 2's CLT files are JumpReLU; this CLT is {clt.architecture} (save it with "
                           f"format='circuit-tracer')")
        if clt.input_hook != "mlp.hook_in":
            raise CLTError(f"Gemma Scope 2's CLTs read the pre-MLP norm's output (mlp.hook_in); this one reads "
                           f"{clt.input_hook} (save it with format='circuit-tracer')")
        for L in range(n):
            w_dec = torch.zeros(clt.d_sae, n, clt.d_model, dtype=clt.dtype)
            w_dec[:, L:] = clt.W_dec[L].detach()
            tensors = {"w_enc": clt.W_enc[L], "b_enc": clt.b_enc[L], "b_dec": clt.b_dec[L],
                       "threshold": clt.threshold[L], "w_dec": w_dec}
            if clt.W_skip is not None:
                tensors[GS_SKIP] = clt.W_skip[L].T
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                      str(folder / GS_FILE.format(L=L)))
        config = {"architecture": "jump_relu", "affine_connection": clt.W_skip is not None, "n_layers": n,
                  "d_sae": clt.d_sae, "hf_hook_point_in": "model.layers.{L}.pre_feedforward_layernorm.output",
                  "hf_hook_point_out": "model.layers.{L}.post_feedforward_layernorm.output"}
        (folder / GS_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        return folder
    if clt.W_skip is not None:
        raise CLTError("circuit-tracer 0.5.0's load_clt reads no skip path from W_enc_L / W_dec_L files, so it would "
                       "run this CLT without one; save it with format='gemma-scope-2'")
    for L in range(n):
        enc = {f"W_enc_{L}": clt.W_enc[L].T, f"b_enc_{L}": clt.b_enc[L], f"b_dec_{L}": clt.b_dec[L]}
        if clt.threshold is not None:
            enc[f"threshold_{L}"] = clt.threshold[L]
        save_file({k: v.detach().contiguous().cpu() for k, v in enc.items()}, str(folder / f"W_enc_{L}.safetensors"))
        save_file({f"W_dec_{L}": clt.W_dec[L].detach().contiguous().cpu()}, str(folder / f"W_dec_{L}.safetensors"))
    _write_ct_config(clt, folder)
    return folder


def _write_ct_config(clt: CrossLayerTranscoder, folder: Path) -> None:
    import yaml

    cfg = {
        "model_kind": CT_TOPK_KIND if clt.architecture == "topk" else CT_KIND,
        # TransformerLens names as circuit-tracer writes them: hook_resid_mid is TL's; mlp.hook_in is slmviz's own
        # blocks.L.mlp.hook_in (the MLP's input after its norm's weight), circuit-tracer's ReplacementMLP.hook_in.
        "feature_input_hook": clt.input_hook,
        "feature_output_hook": "hook_mlp_out",
        "scan": None,
        "slmviz": {"architecture": clt.architecture, "k": clt.k, "n_layers": clt.n_layers, "d_sae": clt.d_sae,
                   "name": clt.name,
                   "metadata": {k: v for k, v in clt.metadata.items() if isinstance(v, str | int | float | bool)}},
    }
    (folder / CT_CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=False))
