"""Transcoder sets on disk: slmviz's layout, circuit-tracer's, and Gemma Scope 2's every-layer folders.

    ts = slmviz.load_transcoders("runs/smollm2_plt", model=m)   # any of the layouts below, found by what it holds
    ts = slmviz.load_transcoders("plt", model=m)                # this model's prepared set in $SLMVIZ_CACHE
    ts.save("folder")                                           # slmviz's layout
    ts.save("folder", format="circuit-tracer")                  # circuit-tracer 0.5.0's transcoder_set

Layouts:
- **slmviz**: `transcoder_set.json` ({kind, name, model, layers, metadata}) and one SAELens folder per layer,
  `layer_{L}/` (cfg.json + sae_weights.safetensors): each layer also opens alone with load_sae or SAELens.
- **circuit-tracer** (0.5.0's `TranscoderSet.to_safetensors` + the `config.yaml` its loaders read):
  `config.yaml` (model_kind: transcoder_set, feature_input_hook, feature_output_hook, transcoders: [file per
  layer]) and `layer_{L}.safetensors` holding W_enc [d_sae, d_model] (circuit-tracer's orientation: F.linear;
  SAELens's and slmviz's is the transpose), W_dec [d_sae, d_model], b_enc, b_dec, optional
  `activation_function.threshold` (JumpReLU) and W_skip [d_model, d_model] (x @ W_skip.T, as here). Its hooks are
  TransformerLens names as circuit-tracer writes them: `mlp.hook_in` is the MLP's input after ln2's weight, which
  is slmviz's `blocks.L.mlp.hook_in` (TransformerLens folds the weight into the MLP's first matrix, so
  `ln2.hook_normalized` is the same point there); `mlp.hook_out` / `hook_mlp_out` is slmviz's
  `blocks.L.hook_mlp_out`. circuit-tracer loads only ReLU and JumpReLU coders, and needs one at every layer from
  0 to the last: a TopK set or a set with gaps is refused when saved in its format, with the reason.
- **Gemma Scope 2**: `transcoder_all/layer_{L}_width_{W}_l0_{size}[_affine]/params.safetensors` (+ config.json),
  one folder per layer (features.io.load_gemma_scope reads each); `width=` / `l0=` choose among several per layer.

Every file is checked before anything is returned (a half-loaded set never escapes): a missing layer, two files
for one layer, d_model or d_sae disagreeing between files, hooks this model does not have, a set made for another
model: each a TranscoderSetError naming the file.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ..features.sae import SAE, SAEError, read_safetensors, refuse_pickle
from ..replacement.transcoder_set import READ_HOOK, WRITE_HOOK, TranscoderSet, TranscoderSetError
from .clt_io import is_clt_folder, load_clt
from .sae_io import FOLDER_NAME, GEMMA_SCOPE_FILENAME, check_against_model, load_gemma_scope

SET_FILE = "transcoder_set.json"
CT_CONFIG = "config.yaml"
CT_LAYER = re.compile(r"layer_(\d+)\.safetensors$")
SLMVIZ_LAYER = re.compile(r"layer_(\d+)$")
FORMATS = ("slmviz", "circuit-tracer")
# circuit-tracer's hook names (TransformerLens, relative to a block) -> slmviz's, with {L} for the layer.
CT_INPUT_HOOKS = {"mlp.hook_in": READ_HOOK, "ln2.hook_normalized": READ_HOOK,
                  "hook_resid_mid": "blocks.{L}.hook_resid_mid"}
CT_OUTPUT_HOOKS = {"mlp.hook_out": WRITE_HOOK, "hook_mlp_out": WRITE_HOOK}


def load_set_folder(source: str | os.PathLike, model: Any = None, width: str | None = None,
                     l0: str | None = None) -> Any:
    """A transcoder set from a folder in slmviz's, circuit-tracer's or Gemma Scope 2's layout (module docstring).
    With `model=`, every coder is checked against the model (hooks, widths) and keeps a reference to it."""
    path = Path(source)
    if not path.is_dir():
        raise TranscoderSetError(f"{str(path)!r} is not a folder; a transcoder set is a folder (slmviz: {SET_FILE}; "
                                 f"circuit-tracer: {CT_CONFIG} + layer_L.safetensors; Gemma Scope 2: "
                                 "transcoder_all/layer_L_width_W_l0_S/), or 'plt' / 'clt' with model=")
    refuse_pickle(path)
    if is_clt_folder(path):  # a cross-layer transcoder, in circuit-tracer's or Gemma Scope 2's layout
        return load_clt(path, model=model)
    if (path / SET_FILE).is_file():
        ts = _load_slmviz(path)
    elif (path / CT_CONFIG).is_file():
        ts = _load_circuit_tracer(path, model)
    elif any(FOLDER_NAME.match(p.name) for p in path.iterdir() if p.is_dir()):
        ts = _load_gemma_scope_all(path, width, l0)
    else:
        found = sorted(p.name for p in path.iterdir())[:10]
        raise TranscoderSetError(f"{path}: no transcoder set here (no {SET_FILE}, no {CT_CONFIG}, no Gemma Scope 2 "
                                 f"layer_L_width_W_l0_S folders); found {found}")
    if model is not None:
        expected = ts.metadata.get("model")
        if expected and expected != model.name:
            raise TranscoderSetError(f"{path} is a set for {expected!r}, not {model.name!r}")
        ts.check_model(model)
        for layer in ts.layers:
            try:
                check_against_model(ts.coder(layer), model)
            except SAEError as e:
                raise TranscoderSetError(f"{path}, layer {layer}: {e}") from e
        for sae in ts:
            sae.to(getattr(model, "device", "cpu"))
            sae.model = model
    return ts


def save_transcoders(ts: TranscoderSet, folder: str | os.PathLike, format: str = "slmviz") -> Path:
    """Write `ts` to `folder` in slmviz's or circuit-tracer's layout (module docstring); returns the folder."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if format == "circuit-tracer":
        return _save_circuit_tracer(ts, folder)
    for layer, sae in ts.coders.items():
        sae.save(folder / f"layer_{layer}")
    meta = {"format": 1, "kind": ts.kind, "name": ts.name, "layers": ts.layers,
            "model": ts.metadata.get("model") or _model_of(ts),
            "metadata": {k: v for k, v in ts.metadata.items() if k != "model"}}
    tmp = folder / (SET_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n")
    os.replace(tmp, folder / SET_FILE)
    return folder


def _model_of(ts: TranscoderSet) -> str | None:
    names = {str((s.metadata or {}).get("model_name") or "") for s in ts}
    names.discard("")
    return names.pop() if len(names) == 1 else None


def _load_slmviz(folder: Path) -> TranscoderSet:
    try:
        meta = json.loads((folder / SET_FILE).read_text())
    except json.JSONDecodeError as e:
        raise TranscoderSetError(f"{folder / SET_FILE}: not valid JSON ({e})") from e
    layers = [int(L) for L in meta.get("layers", [])]
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := SLMVIZ_LAYER.fullmatch(p.name)) and p.is_dir()}
    missing = [L for L in layers if L not in found]
    if missing:
        raise TranscoderSetError(f"{folder / SET_FILE} lists layers {missing} but {folder} has no "
                                 f"{', '.join(f'layer_{L}/' for L in missing)}")
    extra = sorted(set(found) - set(layers))
    if extra:
        raise TranscoderSetError(f"{folder} holds layer folders {extra} that {SET_FILE} does not list (a set "
                                 "mixed with another run's files?)")
    coders = {}
    for L in layers:
        try:
            coders[L] = SAE.load(found[L])
        except SAEError as e:
            raise TranscoderSetError(f"{found[L]}: {e}") from e
    _check_widths(coders, {L: found[L] for L in layers})
    kind = meta.get("kind", "plt")
    if kind != "plt":
        raise TranscoderSetError(f"{folder / SET_FILE}: kind {kind!r}; this layout holds per-layer sets ('plt')")
    return TranscoderSet(coders, name=str(meta.get("name", "")),
                         metadata={**meta.get("metadata", {}), "model": meta.get("model"), "folder": str(folder)})


def _check_widths(coders: dict[int, SAE], files: dict[int, Path]) -> None:
    """Every file has the first one's d_model and d_sae; else the error names the file that differs."""
    first = next(iter(coders))
    ref = coders[first]
    for L, sae in coders.items():
        for what, a, b in (("d_model", (sae.d_in, sae.d_out), (ref.d_in, ref.d_out)), ("d_sae", sae.d_sae, ref.d_sae)):
            if a != b:
                raise TranscoderSetError(f"{files[L]}: {what} {a} differs from {files[first]}'s {b}; a set's files "
                                         "all come from one run")


# ---- circuit-tracer ----------------------------------------------------------------------------------------------
def _save_circuit_tracer(ts: TranscoderSet, folder: Path) -> Path:
    import yaml

    if getattr(ts, "kind", "plt") != "plt":
        raise TranscoderSetError("this writes circuit-tracer's per-layer transcoder_set; a CLT has its own format")
    layers = ts.layers
    if layers != list(range(layers[-1] + 1)):
        raise TranscoderSetError(f"circuit-tracer needs a transcoder at every layer from 0 to the last; this set "
                                 f"covers {layers}")
    for L, sae in ts.coders.items():
        if sae.architecture not in ("relu", "jumprelu"):
            raise TranscoderSetError(
                f"layer {L} is a {sae.architecture} coder: circuit-tracer 0.5.0 reads only ReLU and JumpReLU "
                "transcoders, so a TopK set has no circuit-tracer form (train with architecture='batchtopk', saved "
                "as JumpReLU)")
        if sae.hook_name != READ_HOOK.format(L=L):
            raise TranscoderSetError(f"layer {L} reads {sae.hook_name!r}; circuit-tracer's sets read mlp.hook_in")
    files = []
    for L, sae in ts.coders.items():
        state = {"W_enc": sae.W_enc.detach().T, "W_dec": sae.W_dec.detach(), "b_enc": sae.b_enc.detach(),
                 "b_dec": sae.b_dec.detach()}
        if sae.threshold is not None:
            state["activation_function.threshold"] = sae.threshold.detach()
        if sae.W_skip is not None:
            state["W_skip"] = sae.W_skip.detach()
        name = f"layer_{L}.safetensors"
        save_file({k: v.float().contiguous().cpu() for k, v in state.items()}, str(folder / name))
        files.append(name)
    config = {
        "model_kind": "transcoder_set",
        "model_name": ts.metadata.get("model") or _model_of(ts) or "",
        "scan": ts.name or "slmviz",
        # TransformerLens names, as circuit-tracer writes them; slmviz reads them as blocks.L.mlp.hook_in and
        # blocks.L.hook_mlp_out (module docstring).
        "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out",
        "slmviz_feature_input_hook": READ_HOOK,
        "slmviz_feature_output_hook": WRITE_HOOK,
        "transcoders": files,
    }
    (folder / CT_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False))
    return folder


def _load_circuit_tracer(folder: Path, model: Any) -> Any:
    import yaml

    try:
        config = yaml.safe_load((folder / CT_CONFIG).read_text()) or {}
    except yaml.YAMLError as e:
        raise TranscoderSetError(f"{folder / CT_CONFIG}: not valid YAML ({e})") from e
    kind = config.get("model_kind")
    if kind == "cross_layer_transcoder":
        try:
            from .clt_io import load_circuit_tracer_clt  # the cross-layer transcoder's own loader
        except ImportError as e:
            raise TranscoderSetError(f"{folder}: a cross-layer transcoder, which this version cannot load") from e
        return load_circuit_tracer_clt(folder)
    if kind != "transcoder_set":
        raise TranscoderSetError(f"{folder / CT_CONFIG}: model_kind {kind!r}; expected 'transcoder_set' or "
                                 "'cross_layer_transcoder'")
    hook_in, hook_out = str(config.get("feature_input_hook", "")), str(config.get("feature_output_hook", ""))
    if hook_in not in CT_INPUT_HOOKS or hook_out not in CT_OUTPUT_HOOKS:
        raise TranscoderSetError(
            f"{folder / CT_CONFIG}: feature_input_hook {hook_in!r} / feature_output_hook {hook_out!r} name hooks "
            f"slmviz has no counterpart for; it reads {sorted(CT_INPUT_HOOKS)} -> {sorted(CT_OUTPUT_HOOKS)}")
    read, write = CT_INPUT_HOOKS[hook_in], CT_OUTPUT_HOOKS[hook_out]
    if read != READ_HOOK:
        raise TranscoderSetError(f"{folder / CT_CONFIG}: per-layer transcoders reading {hook_in!r} are not "
                                 "supported (they must read the MLP's input, mlp.hook_in)")
    files = _ct_layer_files(folder, config)
    coders = {}
    for L, path in files.items():
        raw = read_safetensors(path)
        need = ["W_enc", "W_dec", "b_enc", "b_dec"]
        missing = [k for k in need if k not in raw]
        if missing:
            raise TranscoderSetError(f"{path}: missing {missing}; circuit-tracer's layer files hold {need} "
                                     "(+ activation_function.threshold, W_skip)")
        if raw["W_enc"].dim() != 2:
            raise TranscoderSetError(f"{path}: W_enc must be [d_sae, d_model], got {tuple(raw['W_enc'].shape)}")
        state = {"W_enc": raw["W_enc"].T.contiguous(), "W_dec": raw["W_dec"], "b_enc": raw["b_enc"],
                 "b_dec": raw["b_dec"]}
        arch = "relu"
        if "activation_function.threshold" in raw:
            state["threshold"], arch = raw["activation_function.threshold"], "jumprelu"
        skip = "W_skip" in raw
        if skip:
            state["W_skip"] = raw["W_skip"]
        try:
            coders[L] = SAE.from_state(state, architecture=arch, skip=skip, hook_name=read.format(L=L),
                                       hook_name_out=write.format(L=L), apply_b_dec_to_input=False,
                                       metadata={"source": "circuit-tracer", "name": f"{folder.name}/layer_{L}",
                                                 "model_name": config.get("model_name", "")})
        except SAEError as e:
            raise TranscoderSetError(f"{path}: {e}") from e
    _check_widths(coders, files)
    return TranscoderSet(coders, name=str(config.get("scan") or folder.name),
                         metadata={"source": "circuit-tracer", "folder": str(folder)})


def _ct_layer_files(folder: Path, config: dict[str, Any]) -> dict[int, Path]:
    """{layer: file}: config.yaml's `transcoders` list (index = layer; paths relative to the folder) when it has one,
    else the folder's layer_{L}.safetensors; every layer from 0 to the last present, one file each."""
    listed = config.get("transcoders")
    if listed:
        files: dict[int, Path] = {}
        for i, entry in enumerate(listed):
            p = Path(str(entry).removeprefix("file://"))
            p = p if p.is_absolute() else folder / p
            if not p.is_file():
                raise TranscoderSetError(f"{folder / CT_CONFIG} lists {entry!r} for layer {i}, which is not a file")
            files[i] = p
        return files
    found: dict[int, list[Path]] = {}
    for p in folder.iterdir():
        m = CT_LAYER.fullmatch(p.name)
        if m:
            found.setdefault(int(m.group(1)), []).append(p)
    if not found:
        raise TranscoderSetError(f"{folder}: {CT_CONFIG} lists no transcoders and there is no layer_L.safetensors")
    missing = [L for L in range(max(found) + 1) if L not in found]
    if missing:
        raise TranscoderSetError(f"{folder}: no layer file for layers {missing} (circuit-tracer needs every layer "
                                 f"from 0 to {max(found)})")
    return {L: ps[0] for L, ps in sorted(found.items())}


# ---- Gemma Scope 2 -------------------------------------------------------------------------------------------------
def _load_gemma_scope_all(folder: Path, width: str | None, l0: str | None) -> TranscoderSet:
    """Gemma Scope 2's every-layer folder (transcoder_all/): one layer_{L}_width_{W}_l0_{size}[_affine] folder per
    layer; `width` / `l0` pick among several."""
    by_layer: dict[int, list[Path]] = {}
    for p in sorted(folder.iterdir()):
        m = FOLDER_NAME.match(p.name)
        if not (m and p.is_dir() and (p / GEMMA_SCOPE_FILENAME).is_file()):
            continue
        if (width and m.group(2) != width) or (l0 and m.group(3) != l0):
            continue
        by_layer.setdefault(int(m.group(1)), []).append(p)
    if not by_layer:
        raise TranscoderSetError(f"{folder}: no layer_L_width_W_l0_S folder with {GEMMA_SCOPE_FILENAME}"
                                 + (f" for width={width!r} l0={l0!r}" if width or l0 else ""))
    doubled = {L: [p.name for p in ps] for L, ps in by_layer.items() if len(ps) > 1}
    if doubled:
        raise TranscoderSetError(f"{folder}: several transcoders for one layer ({doubled}); choose one with "
                                 "width= and l0= (e.g. load_transcoders(folder, width='16k', l0='small'))")
    missing = [L for L in range(max(by_layer) + 1) if L not in by_layer]
    if missing:
        raise TranscoderSetError(f"{folder}: no transcoder for layers {missing}")
    coders: dict[int, SAE] = {}
    files = {L: ps[0] for L, ps in by_layer.items()}
    for L, p in sorted(files.items()):
        try:
            sae = load_gemma_scope(p)
        except SAEError as e:
            raise TranscoderSetError(f"{p}: {e}") from e
        if sae.hook_name != READ_HOOK.format(L=L):
            raise TranscoderSetError(f"{p}: a {sae.metadata.get('site')} SAE, not a transcoder")
        coders[L] = sae
    _check_widths(coders, files)
    return TranscoderSet(coders, name=f"gemma-scope-2/{folder.name}",
                         metadata={"source": "gemma-scope-2", "folder": str(folder)})
