"""circuit-tracer 0.5.0's files: per-layer transcoder sets and cross-layer transcoders, both ways.

**Per-layer sets** (`TranscoderSet.to_safetensors` + the `config.yaml` its loaders read): `config.yaml`
(model_kind: transcoder_set, feature_input_hook, feature_output_hook, transcoders: [file per layer]) and
`layer_{L}.safetensors` holding W_enc [d_sae, d_model] (circuit-tracer's orientation: F.linear; SAELens's and
slmviz's is the transpose), W_dec [d_sae, d_model], b_enc, b_dec, optional `activation_function.threshold` (JumpReLU)
and W_skip [d_model, d_model] (x @ W_skip.T, as in slmviz). Its hooks are TransformerLens names as circuit-tracer
writes them: `mlp.hook_in` is the MLP's input after ln2's weight, which is slmviz's `blocks.L.mlp.hook_in`
(TransformerLens folds the weight into the MLP's first matrix, so `ln2.hook_normalized` is the same point there);
`mlp.hook_out` / `hook_mlp_out` is slmviz's `blocks.L.hook_mlp_out`. circuit-tracer loads only ReLU and JumpReLU
coders, and needs one at every layer from 0 to the last: a TopK set or a set with gaps is refused when written, with
the reason.

**Cross-layer transcoders** (transcoder/cross_layer_transcoder.py: `to_safetensors`, `load_clt`):

    W_enc_{L}.safetensors   W_enc_{L} [d_sae, d_model] (the transpose of slmviz's), b_enc_{L} [d_sae],
                            b_dec_{L} [d_model] (the bias of layer L's output), threshold_{L} [d_sae] (JumpReLU only)
    W_dec_{L}.safetensors   W_dec_{L} [d_sae, n_layers - L, d_model]: slot i writes layer L + i
    config.yaml             model_kind: cross_layer_transcoder, feature_input_hook, feature_output_hook (optional
                            for load_clt, which defaults to hook_resid_mid / hook_mlp_out; slmviz writes it always)

circuit-tracer's JumpReLU is h · 1[h > θ] and slmviz's (SAELens's) relu(h) · 1[h > θ]: the same for θ ≥ 0, so a
negative threshold is refused both ways (`refuse_negative_thresholds`; Gemma Scope 2's CLT files, which
circuit-tracer reads too, likewise). It has no TopK and reads no skip path from these files: a TopK CLT is written
with `model_kind: slmviz_topk_cross_layer_transcoder` (circuit-tracer then refuses it by name instead of running it as
ReLU) and a skip CLT only as Gemma Scope 2.

Readers return plain data: a spec (the object's settings in slmviz's vocabulary) and tensors in slmviz's names and
orientation (SAE.tensors, CrossLayerTranscoder.tensors), every file checked before anything is returned.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CLTError, TranscoderSetError
from .files import read_safetensors, read_yaml, write_safetensors, write_yaml

CONFIG = "config.yaml"
SET_KIND = "transcoder_set"
CLT_KIND = "cross_layer_transcoder"
CLT_TOPK_KIND = "slmviz_topk_cross_layer_transcoder"
_LAYER_FILE = re.compile(r"layer_(\d+)\.safetensors$")
_ENC_FILE = re.compile(r"W_enc_(\d+)\.safetensors$")
_DEC_FILE = re.compile(r"W_dec_(\d+)\.safetensors$")
READ_HOOK = "blocks.{L}.mlp.hook_in"  # slmviz's name of circuit-tracer's mlp.hook_in (module docstring)
WRITE_HOOK = "blocks.{L}.hook_mlp_out"
# circuit-tracer's hook names (TransformerLens, relative to a block) -> slmviz's, with {L} for the layer.
SET_INPUT_HOOKS = {"mlp.hook_in": READ_HOOK, "ln2.hook_normalized": READ_HOOK,
                   "hook_resid_mid": "blocks.{L}.hook_resid_mid"}
OUTPUT_HOOKS = {"mlp.hook_out": WRITE_HOOK, "hook_mlp_out": WRITE_HOOK}
# The feature_input_hook values of a CLT slmviz reads, each at slmviz's hook of the same local name: hook_resid_mid
# (circuit-tracer's own CLTs, before the MLP's norm) and mlp.hook_in (after its weight, slmviz's and Gemma Scope 2's).
CLT_INPUT_HOOKS = ("mlp.hook_in", "hook_resid_mid")


# ---- per-layer transcoder sets -------------------------------------------------------------------------------------
def holds_transcoder_set(folder: Path) -> bool:
    return (folder / CONFIG).is_file()


def read_transcoder_set(folder: Path) -> tuple[dict[str, Any], dict[int, tuple[dict[str, Any], dict[str, Any], Path]]]:
    """({name, metadata}, {layer: (spec, tensors, file)}) of a circuit-tracer transcoder_set folder."""
    config = read_yaml(folder / CONFIG, TranscoderSetError)
    kind = config.get("model_kind")
    if kind in (CLT_KIND, CLT_TOPK_KIND):
        raise CLTError(f"{folder / CONFIG}: a cross-layer transcoder, but {folder} has no W_enc_0.safetensors or "
                       "W_dec_0.safetensors")
    if kind != SET_KIND:
        raise TranscoderSetError(f"{folder / CONFIG}: model_kind {kind!r}; expected {SET_KIND!r} or {CLT_KIND!r}")
    hook_in, hook_out = str(config.get("feature_input_hook", "")), str(config.get("feature_output_hook", ""))
    if hook_in not in SET_INPUT_HOOKS or hook_out not in OUTPUT_HOOKS:
        raise TranscoderSetError(
            f"{folder / CONFIG}: feature_input_hook {hook_in!r} / feature_output_hook {hook_out!r} name hooks "
            f"slmviz has no counterpart for; it reads {sorted(SET_INPUT_HOOKS)} -> {sorted(OUTPUT_HOOKS)}")
    read, write = SET_INPUT_HOOKS[hook_in], OUTPUT_HOOKS[hook_out]
    if read != READ_HOOK:
        raise TranscoderSetError(f"{folder / CONFIG}: per-layer transcoders reading {hook_in!r} are not "
                                 "supported (they must read the MLP's input, mlp.hook_in)")
    coders = {}
    for L, path in _layer_files(folder, config).items():
        raw = read_safetensors(path, TranscoderSetError)
        need = ["W_enc", "W_dec", "b_enc", "b_dec"]
        missing = [k for k in need if k not in raw]
        if missing:
            raise TranscoderSetError(f"{path}: missing {missing}; circuit-tracer's layer files hold {need} "
                                     "(+ activation_function.threshold, W_skip)")
        if raw["W_enc"].dim() != 2:
            raise TranscoderSetError(f"{path}: W_enc must be [d_sae, d_model], got {tuple(raw['W_enc'].shape)}")
        tensors = {"W_enc": raw["W_enc"].T.contiguous(), "W_dec": raw["W_dec"], "b_enc": raw["b_enc"],
                   "b_dec": raw["b_dec"]}
        if "activation_function.threshold" in raw:
            tensors["threshold"] = raw["activation_function.threshold"]
        if "W_skip" in raw:
            tensors["W_skip"] = raw["W_skip"]
        spec = {"architecture": "jumprelu" if "threshold" in tensors else "relu", "skip": "W_skip" in tensors,
                "hook_name": read.format(L=L), "hook_name_out": write.format(L=L), "apply_b_dec_to_input": False,
                "metadata": {"source": "circuit-tracer", "name": f"{folder.name}/layer_{L}",
                             "model_name": config.get("model_name", "")}}
        coders[L] = (spec, tensors, path)
    info = {"name": str(config.get("scan") or folder.name),
            "metadata": {"source": "circuit-tracer", "folder": str(folder)}}
    return info, coders


def _layer_files(folder: Path, config: dict[str, Any]) -> dict[int, Path]:
    """{layer: file}: config.yaml's `transcoders` list (index = layer; paths relative to the folder) when it has one,
    else the folder's layer_{L}.safetensors; every layer from 0 to the last present, one file each."""
    listed = config.get("transcoders")
    if listed:
        files: dict[int, Path] = {}
        for i, entry in enumerate(listed):
            p = Path(str(entry).removeprefix("file://"))
            p = p if p.is_absolute() else folder / p
            if not p.is_file():
                raise TranscoderSetError(f"{folder / CONFIG} lists {entry!r} for layer {i}, which is not a file")
            files[i] = p
        return files
    found: dict[int, list[Path]] = {}
    for p in folder.iterdir():
        m = _LAYER_FILE.fullmatch(p.name)
        if m:
            found.setdefault(int(m.group(1)), []).append(p)
    if not found:
        raise TranscoderSetError(f"{folder}: {CONFIG} lists no transcoders and there is no layer_L.safetensors")
    missing = [L for L in range(max(found) + 1) if L not in found]
    if missing:
        raise TranscoderSetError(f"{folder}: no layer file for layers {missing} (circuit-tracer needs every layer "
                                 f"from 0 to {max(found)})")
    return {L: ps[0] for L, ps in sorted(found.items())}


def write_transcoder_set(folder: Path, info: dict[str, Any], coders: dict[int, tuple[dict[str, Any], dict[str, Any]]]
                         ) -> Path:
    """Write `coders` ({layer: (SAE.spec, SAE.tensors)}) as config.yaml + layer_{L}.safetensors (fp32); `info`:
    {name, model}. Refused with the reason when circuit-tracer could not read the set back."""
    layers = list(coders)
    if layers != list(range(layers[-1] + 1)):
        raise TranscoderSetError(f"circuit-tracer needs a transcoder at every layer from 0 to the last; this set "
                                 f"covers {layers}")
    for L, (spec, _) in coders.items():
        if spec["architecture"] not in ("relu", "jumprelu"):
            raise TranscoderSetError(
                f"layer {L} is a {spec['architecture']} coder: circuit-tracer 0.5.0 reads only ReLU and JumpReLU "
                "transcoders, so a TopK set has no circuit-tracer form (train with architecture='batchtopk', saved "
                "as JumpReLU)")
        if spec["hook_name"] != READ_HOOK.format(L=L):
            raise TranscoderSetError(f"layer {L} reads {spec['hook_name']!r}; circuit-tracer's sets read mlp.hook_in")
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for L, (_, t) in coders.items():
        layer = {"W_enc": t["W_enc"].T, "W_dec": t["W_dec"], "b_enc": t["b_enc"], "b_dec": t["b_dec"]}
        if "threshold" in t:
            layer["activation_function.threshold"] = t["threshold"]
        if "W_skip" in t:
            layer["W_skip"] = t["W_skip"]
        name = f"layer_{L}.safetensors"
        write_safetensors({k: v.float() for k, v in layer.items()}, folder / name)
        files.append(name)
    write_yaml(folder / CONFIG, {
        "model_kind": SET_KIND,
        "model_name": info.get("model") or "",
        "scan": info.get("name") or "slmviz",
        # TransformerLens names, as circuit-tracer writes them; slmviz reads them as blocks.L.mlp.hook_in and
        # blocks.L.hook_mlp_out (module docstring).
        "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out",
        "slmviz_feature_input_hook": READ_HOOK,
        "slmviz_feature_output_hook": WRITE_HOOK,
        "transcoders": files,
    })
    return folder


# ---- cross-layer transcoders ---------------------------------------------------------------------------------------
def holds_clt(folder: Path) -> bool:
    return (folder / "W_enc_0.safetensors").is_file() or (folder / "W_dec_0.safetensors").is_file()


def clt_layer_count(folder: Path, pattern: re.Pattern, template: str) -> int:
    """n_layers of a folder of per-layer CLT files: they must be 0..n-1, each missing one named."""
    found = sorted(int(m.group(1)) for p in folder.iterdir() if (m := pattern.match(p.name)))
    if not found:
        raise CLTError(f"{folder}: no {template.format(L='{L}')} files")
    missing = [template.format(L=L) for L in range(max(found) + 1) if L not in found]
    if missing:
        raise CLTError(f"{folder}: missing {missing} (a CLT has one per layer, 0..{max(found)})")
    return max(found) + 1


def check_clt_tensor(raw: dict[str, torch.Tensor], key: str, path: Path, shape: tuple[int, ...], what: str
                     ) -> torch.Tensor:
    """raw[key], which must be there, of `shape` (`what` spells it out), finite and floating point; else a CLTError
    naming the file."""
    if key not in raw:
        raise CLTError(f"{path}: no tensor {key!r} (found {sorted(raw)})")
    t = raw[key]
    if tuple(t.shape) != shape:
        raise CLTError(f"{path}: {key} has shape {tuple(t.shape)}, expected {list(shape)} ({what})")
    if not t.is_floating_point() or not torch.isfinite(t).all():
        raise CLTError(f"{path}: {key} must hold finite floating-point values")
    return t


def refuse_negative_thresholds(threshold: torch.Tensor, where: Path) -> torch.Tensor:
    """`threshold` when every entry is ≥ 0, else a CLTError: circuit-tracer computes h·1[h > θ] and slmviz
    relu(h)·1[h > θ], which agree only for θ ≥ 0, so a file with a negative one would give other features there."""
    if (threshold < 0).any():
        raise CLTError(f"{where}: {int((threshold < 0).sum())} negative JumpReLU thresholds; circuit-tracer computes "
                       f"h·1[h > θ] and slmviz relu(h)·1[h > θ], which differ below 0")
    return threshold


def _clt_input_hook(name: str, where: Path) -> str:
    local = re.sub(r"^blocks\.\d+\.", "", name)  # a full name (blocks.3.hook_resid_mid) reads the same local hook
    if local not in CLT_INPUT_HOOKS:
        raise CLTError(f"{where}: feature_input_hook {name!r}: slmviz reads a CLT's features on one of "
                       f"{list(CLT_INPUT_HOOKS)} (per layer)")
    return local


def read_clt(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(spec, tensors) of circuit-tracer's `W_enc_{L}` / `W_dec_{L}` files (+ config.yaml), in CrossLayerTranscoder's
    names (CrossLayerTranscoder.tensors)."""
    cfg = read_yaml(folder / CONFIG, CLTError) if (folder / CONFIG).is_file() else {}
    kind = cfg.get("model_kind", CLT_KIND)
    if kind not in (CLT_KIND, CLT_TOPK_KIND):
        raise CLTError(f"{folder / CONFIG}: model_kind {kind!r}, not a cross-layer transcoder ({CLT_KIND}); a "
                       f"per-layer set ({SET_KIND}) loads with slmviz.load_transcoders")
    out_hook = cfg.get("feature_output_hook", "hook_mlp_out")
    if out_hook not in OUTPUT_HOOKS:
        raise CLTError(f"{folder / CONFIG}: feature_output_hook {out_hook!r}; a CLT writes the MLP's output "
                       f"({' or '.join(OUTPUT_HOOKS)}, slmviz's blocks.L.hook_mlp_out)")
    n = max(clt_layer_count(folder, _ENC_FILE, "W_enc_{L}.safetensors"),
            clt_layer_count(folder, _DEC_FILE, "W_dec_{L}.safetensors"))
    for template in ("W_enc_{L}.safetensors", "W_dec_{L}.safetensors"):
        missing = [template.format(L=L) for L in range(n) if not (folder / template.format(L=L)).is_file()]
        if missing:
            raise CLTError(f"{folder}: missing {missing} (a CLT of {n} layers has W_enc_L and W_dec_L for each)")
    first = folder / "W_enc_0.safetensors"
    raw = read_safetensors(first, CLTError)
    if "W_enc_0" not in raw or raw["W_enc_0"].dim() != 2:
        raise CLTError(f"{first}: no 2-d tensor 'W_enc_0' [d_sae, d_model] (found {sorted(raw)})")
    d_sae, d_model = raw["W_enc_0"].shape
    jump = "threshold_0" in raw
    slm = cfg.get("slmviz") or {}
    spec = {"architecture": "topk" if kind == CLT_TOPK_KIND else "jumprelu" if jump else "relu", "k": slm.get("k"),
            "input_hook": _clt_input_hook(str(cfg.get("feature_input_hook", "hook_resid_mid")), folder / CONFIG),
            "name": str(slm.get("name", "")),
            "metadata": {**(slm.get("metadata") or {}), "source": "circuit-tracer", "folder": str(folder)}}
    per_layer: dict[str, list[torch.Tensor]] = {"W_enc": [], "b_enc": [], "b_dec": []}
    if jump:
        per_layer["threshold"] = []
    tensors: dict[str, torch.Tensor] = {}
    for L in range(n):
        path = folder / f"W_enc_{L}.safetensors"
        raw = raw if L == 0 else read_safetensors(path, CLTError)
        per_layer["W_enc"].append(check_clt_tensor(raw, f"W_enc_{L}", path, (d_sae, d_model), "[d_sae, d_model]").T)
        per_layer["b_enc"].append(check_clt_tensor(raw, f"b_enc_{L}", path, (d_sae,), "[d_sae]"))
        per_layer["b_dec"].append(check_clt_tensor(raw, f"b_dec_{L}", path, (d_model,), "[d_model]"))
        if jump:
            threshold = check_clt_tensor(raw, f"threshold_{L}", path, (d_sae,), "[d_sae], as layer 0's file has one")
            per_layer["threshold"].append(refuse_negative_thresholds(threshold, path))
        path = folder / f"W_dec_{L}.safetensors"
        tensors[f"W_dec_{L}"] = check_clt_tensor(read_safetensors(path, CLTError), f"W_dec_{L}", path,
                                                 (d_sae, n - L, d_model),
                                                 f"[d_sae, n_layers - {L}, d_model] for layer {L} of {n}")
    return spec, {**{k: torch.stack(v) for k, v in per_layer.items()}, **tensors}


def write_clt(folder: Path, spec: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    """Write a CLT's W_enc_{L} / W_dec_{L}.safetensors + config.yaml (module docstring), refused for a skip CLT."""
    if "threshold" in tensors:
        refuse_negative_thresholds(tensors["threshold"], folder)
    if "W_skip" in tensors:
        raise CLTError("circuit-tracer 0.5.0's load_clt reads no skip path from W_enc_L / W_dec_L files, so it would "
                       "run this CLT without one; save it with format='gemma-scope-2'")
    n, _, d_sae = tensors["W_enc"].shape
    folder.mkdir(parents=True, exist_ok=True)
    for L in range(n):
        enc = {f"W_enc_{L}": tensors["W_enc"][L].T, f"b_enc_{L}": tensors["b_enc"][L],
               f"b_dec_{L}": tensors["b_dec"][L]}
        if "threshold" in tensors:
            enc[f"threshold_{L}"] = tensors["threshold"][L]
        write_safetensors(enc, folder / f"W_enc_{L}.safetensors")
        write_safetensors({f"W_dec_{L}": tensors[f"W_dec_{L}"]}, folder / f"W_dec_{L}.safetensors")
    architecture = spec["architecture"]
    write_yaml(folder / CONFIG, {
        "model_kind": CLT_TOPK_KIND if architecture == "topk" else CLT_KIND,
        # TransformerLens names as circuit-tracer writes them: hook_resid_mid is TL's; mlp.hook_in is slmviz's own
        # blocks.L.mlp.hook_in (the MLP's input after its norm's weight), circuit-tracer's ReplacementMLP.hook_in.
        "feature_input_hook": spec["input_hook"],
        "feature_output_hook": "hook_mlp_out",
        "scan": None,
        "slmviz": {"architecture": architecture, "k": spec["k"], "n_layers": n, "d_sae": d_sae, "name": spec["name"],
                   "metadata": {k: v for k, v in spec["metadata"].items() if isinstance(v, str | int | float | bool)}},
    })
    return folder

