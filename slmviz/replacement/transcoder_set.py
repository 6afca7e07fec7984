"""A set of transcoders that together replace a model's MLPs: the *replacement model* attribution graphs are built on.

    ts = slmviz.load_transcoders("runs/smollm2_plt", model=m)   # or TranscoderSet([tc0, tc1, ...])
    ts.kind, ts.layers, ts.d_sae                                # "plt"; layers covered; features per layer
    t = m.trace(prompt, saes=ts)                                 # every coder spliced, error terms on: exact
    g = slmviz.attribution_graph(prompt, transcoders=ts, model=m)

A per-layer transcoder set (PLT) holds one transcoder per layer it covers: layer L's features read the layer's
input hook (`blocks.L.mlp.hook_in`) and write only into `blocks.L.hook_mlp_out`. It answers the replacement model's
questions (replacement.base.ReplacementSet: read and write hooks, encode, reconstruct, writes, encoder rows, skip,
the frozen forward) from its coders, and iterates over them as SAEs (`for sae in ts`), so everything that takes
`saes=[...]` (trace, generate, scan, patch) takes a set as it is.

Files: `save(folder)` hands each coder's spec and tensors to formats.slmviz (transcoder_set.json + one SAELens folder
per layer) or formats.circuit_tracer; replacement.load reads every layout back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import SAEError, TranscoderSetError
from ..features.sae import SAE
from ..formats import circuit_tracer
from ..formats import slmviz as slmviz_layout
from .base import READ_HOOK, ReplacementSet

_IN = re.compile(r"blocks\.(\d+)\.mlp\.hook_in")
_OUT = re.compile(r"blocks\.(\d+)\.hook_mlp_out")
FORMATS = {"slmviz": slmviz_layout.write_transcoder_set, "circuit-tracer": circuit_tracer.write_transcoder_set}


def coder_layer(sae: Any, where: str = "") -> int:
    """The layer a transcoder replaces: it must read `blocks.L.mlp.hook_in` and write `blocks.L.hook_mlp_out`.

    Why so strict: an SAE of the residual stream, or a transcoder that reads `ln2.hook_normalized` (before the norm's
    weight), runs at the right width and gives a graph of nothing (docs/hook-names.md, "blocks.L.mlp.hook_in")."""
    hook_in, hook_out = str(getattr(sae, "hook_name", "")), str(getattr(sae, "hook_name_out", ""))
    m_in, m_out = _IN.fullmatch(hook_in), _OUT.fullmatch(hook_out)
    if not (m_in and m_out and m_in.group(1) == m_out.group(1)):
        raise TranscoderSetError(
            f"{where}{sae!r} reads {hook_in!r} and writes {hook_out!r}; a transcoder set needs transcoders that "
            f"read blocks.L.mlp.hook_in and write blocks.L.hook_mlp_out of the same layer L (an SAE of another site "
            f"cannot replace an MLP)")
    return int(m_in.group(1))


class TranscoderSet(ReplacementSet, Sequence):
    """Per-layer transcoders (PLT), one per covered layer, as one object (module docstring).

    `coders`: a list of transcoders (each names its layer through its hooks) or {layer: transcoder}.
    `name`: what graphs call the set (their transcoder list); `metadata`: free-form, saved with the set.
    """

    kind = "plt"

    def __init__(self, coders: Sequence[SAE] | Mapping[int, SAE], name: str = "",
                 metadata: dict[str, Any] | None = None):
        items = list(coders.values()) if isinstance(coders, Mapping) else list(coders)
        if not items:
            raise TranscoderSetError("a transcoder set needs at least one transcoder")
        by_layer: dict[int, SAE] = {}
        for sae in items:
            if not isinstance(sae, SAE):
                raise TranscoderSetError(f"a transcoder set holds slmviz SAE objects (slmviz.load_sae), got {sae!r}")
            layer = coder_layer(sae)
            if layer in by_layer:
                raise TranscoderSetError(f"two transcoders for layer {layer}: {by_layer[layer]!r} and {sae!r}")
            by_layer[layer] = sae
        if isinstance(coders, Mapping):
            wrong = {k: coder_layer(v) for k, v in coders.items() if k != coder_layer(v)}
            if wrong:
                raise TranscoderSetError(f"layer keys do not match the transcoders' hooks: {wrong} (key: layer read)")
        widths = {(s.d_in, s.d_out) for s in by_layer.values()}
        if len(widths) > 1:
            raise TranscoderSetError(
                "the transcoders disagree on d_model: "
                + ", ".join(f"layer {L}: d_in {s.d_in}, d_out {s.d_out}" for L, s in sorted(by_layer.items())))
        self._coders: dict[int, SAE] = dict(sorted(by_layer.items()))
        self.name = name
        self.metadata: dict[str, Any] = dict(metadata or {})

    # ---- what it covers ----------------------------------------------------------------------------------------
    @property
    def coders(self) -> dict[int, SAE]:
        """{layer: its transcoder}."""
        return self._coders

    @property
    def layers(self) -> list[int]:
        return list(self._coders)

    @property
    def d_model(self) -> int:
        return next(iter(self._coders.values())).d_in

    @property
    def d_sae(self) -> int:
        """Features per layer (the largest, if the layers' widths differ)."""
        return max(s.d_sae for s in self._coders.values())

    @property
    def n_features(self) -> int:
        return sum(s.d_sae for s in self._coders.values())

    def __getitem__(self, i: int) -> SAE:  # type: ignore[override]
        return list(self._coders.values())[i]

    def __repr__(self) -> str:
        layers = self.layers
        span = f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else \
            f"layers {layers}"
        arch = sorted({s.architecture for s in self._coders.values()})
        skip = " skip" if any(s.W_skip is not None for s in self._coders.values()) else ""
        name = f"{self.name!r}: " if self.name else ""
        return f"TranscoderSet({name}{self.kind}, {len(layers)} {span}, d_sae {self.d_sae}, {'/'.join(arch)}{skip})"

    def coder(self, layer: int) -> SAE:
        if layer not in self._coders:
            raise TranscoderSetError(f"this set has no transcoder at layer {layer} (it covers {self.layers})")
        return self._coders[layer]

    def coder_name(self, layer: int) -> str:
        """A coder's name in a graph's transcoder list: its bundled/hub name when it has one, else its hooks."""
        sae = self._coders[layer]
        meta = sae.metadata or {}
        if meta.get("name") or meta.get("release"):
            return str(meta.get("name") or meta.get("release"))
        return f"{self.name}/layer_{layer}" if self.name else f"{sae.hook_name}->{sae.hook_name_out}"

    @property
    def names(self) -> list[str]:
        return [self.coder_name(L) for L in self._coders]

    def feature_coder(self, layer: int) -> SAE:
        """Layer `layer`'s transcoder itself."""
        return self.coder(layer)

    def read_hook(self, layer: int) -> str:
        """The hook layer `layer`'s features read (for a layer without a coder: where one would read)."""
        return self._coders[layer].hook_name if layer in self._coders else READ_HOOK.format(L=layer)

    # ---- the model it replaces, and files -------------------------------------------------------------------------
    @property
    def model(self) -> Any:
        """The model the set was loaded for (each coder keeps it: logit effects read its unembedding)."""
        return next(iter(self._coders.values())).model

    @model.setter
    def model(self, model: Any) -> None:
        for sae in self._coders.values():
            sae.model = model

    def check_model(self, model: Any, where: str = "") -> None:
        """The set fits `model`: every coder's layer exists, its width is the model's d_model, and its hooks are the
        model's (SAE.check_model)."""
        cfg = model.cfg
        for layer, sae in self._coders.items():
            if layer >= cfg.n_layers:
                raise TranscoderSetError(f"{where}{sae!r} is for layer {layer}; {model.name!r} has layers "
                                         f"0..{cfg.n_layers - 1}: a set for another model")
            if sae.d_in != cfg.d_model or sae.d_out != cfg.d_model:
                raise TranscoderSetError(
                    f"{where}{sae!r} has d_in={sae.d_in}, d_out={sae.d_out}, but {model.name!r}'s d_model is "
                    f"{cfg.d_model}: a set for another model")
            try:
                sae.check_model(model)
            except SAEError as e:  # a hook this model does not have
                raise TranscoderSetError(f"{where}layer {layer}: {e}") from e

    def to(self, device: Any) -> TranscoderSet:
        for sae in self._coders.values():
            sae.to(device)
        return self

    def save(self, folder: Any, format: str = "slmviz") -> Path:
        """Write the set to `folder`: slmviz's layout (transcoder_set.json + one SAELens folder per layer) or
        format="circuit-tracer" (config.yaml + layer_{L}.safetensors); formats.slmviz and formats.circuit_tracer
        say what each holds. Returns the folder."""
        if format not in FORMATS:
            raise TranscoderSetError(f"format must be one of {tuple(FORMATS)}, got {format!r}")
        info = {"name": self.name, "model": self.metadata.get("model") or self._model_name(),
                "metadata": {k: v for k, v in self.metadata.items() if k != "model"}}
        coders = {L: (sae.spec(), sae.tensors()) for L, sae in self._coders.items()}
        return FORMATS[format](Path(folder), info, coders)

    def _model_name(self) -> str | None:
        """The model every coder says it was trained on (metadata model_name), if they agree."""
        names = {str(s.metadata.get("model_name") or "") for s in self._coders.values()}
        names.discard("")
        return names.pop() if len(names) == 1 else None

    # ---- the replacement: features, their writes and reads ----------------------------------------------------
    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return self.coder(layer).encode(x)

    def reconstruct(self, layer: int, acts: Mapping[int, torch.Tensor], inputs: Mapping[int, torch.Tensor]
                    ) -> torch.Tensor:
        """For a PLT, the layer's own features and input: decode(acts[layer], inputs[layer])."""
        return self.coder(layer).decode(acts[layer], inputs[layer])

    def writes(self, layer: int, features: torch.Tensor, acts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """A PLT writes its own layer only: [(layer, a · W_dec[f])].

        A topk coder with rescale_acts_by_decoder_norm divides its activation by |W_dec[f]| before decoding
        (SAE.decode), so the vector it writes is (a / |W_dec[f]|) W_dec[f]."""
        sae = self.coder(layer)
        w = sae.W_dec.detach()[features].float()  # [n, d_model]
        a = acts.float()
        if sae.architecture == "topk" and sae.rescale_acts_by_decoder_norm:
            a = a / w.norm(dim=-1)
        return [(layer, a[:, None] * w)]

    def encoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """W_enc's columns (b_dec is never subtracted from a transcoder's input)."""
        return self.coder(layer).W_enc.detach()[:, features].T.float()

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x · W_skipᵀ of the layer's coder; zeros without a coder or W_skip."""
        sae = self._coders.get(layer)
        if sae is None or sae.W_skip is None:
            return torch.zeros_like(x)
        return (x.to(sae.W_skip.dtype) @ sae.W_skip.T).to(x.dtype)  # [..., d_in] -> [..., d_out]


def as_replacement(transcoders: Any) -> ReplacementSet:
    """`transcoders=` as a replacement set: a TranscoderSet or a CrossLayerTranscoder as it is, one transcoder or a
    list (or {layer: transcoder}) of them wrapped in a TranscoderSet."""
    if isinstance(transcoders, ReplacementSet):
        return transcoders
    if transcoders is None or (isinstance(transcoders, Sequence) and len(transcoders) == 0):
        raise TranscoderSetError(
            "attribution_graph needs transcoders=: features are what its nodes are. Load a set with "
            "slmviz.load_transcoders(name_or_folder, model=m), or one transcoder with slmviz.load_sae(name, model=m) "
            "(slmviz.bundled_saes(m) lists those that ship: transcoder_l6, ...)")
    if isinstance(transcoders, Mapping):
        return TranscoderSet(transcoders)
    if not isinstance(transcoders, Sequence):
        transcoders = [transcoders]
    return TranscoderSet(list(transcoders))
