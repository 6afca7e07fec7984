"""A set of transcoders that together replace a model's MLPs: the *replacement model* attribution graphs are built on.

    ts = slmviz.load_transcoders("runs/smollm2_plt", model=m)   # or TranscoderSet([tc0, tc1, ...])
    ts.kind, ts.layers, ts.d_sae                                # "plt"; layers covered; features per layer
    t = m.trace(prompt, saes=ts)                                 # every coder spliced, error terms on: exact
    g = slmviz.attribution_graph(prompt, transcoders=ts, model=m)

A per-layer transcoder set (PLT) holds one transcoder per layer it covers: layer L's features read the layer's
input hook (`blocks.L.mlp.hook_in`) and write only into `blocks.L.hook_mlp_out`. A cross-layer transcoder (CLT)
answers the same questions, with features that write into every later layer too. What the attribution graph asks of
a set, and nothing else, is here:

- `read_hook(L)` / `write_hook(L)`: where layer L's features read and where layer L's MLP output is replaced;
- `encode(L, x)`, `reconstruct(L, inputs)`: the features and the predicted MLP output;
- `writes(L, features, acts)`: the vectors the active features add to each MLP output they write (decoder rows);
- `encoder_rows(L, features)`: the vectors a feature's pre-activation reads its input through;
- `frozen_forward(...)`: the local replacement model of one prompt (attention and norms frozen), linear in its
  sources.

A set iterates over its coders as SAEs (`for sae in ts`), so everything that takes `saes=[...]` (trace, generate,
scan, patch) takes a set as it is.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..features.sae import SAE, SAEError

READ_HOOK = "blocks.{L}.mlp.hook_in"  # what a PLT reads: the MLP's input after its norm's weight (DESIGN.md)
WRITE_HOOK = "blocks.{L}.hook_mlp_out"
_IN = re.compile(r"blocks\.(\d+)\.mlp\.hook_in")
_OUT = re.compile(r"blocks\.(\d+)\.hook_mlp_out")


class TranscoderSetError(SAEError):
    """A set that cannot be a replacement model: a coder at another site, two for one layer, mismatched widths, files
    missing or doubled, a set made for another model. The message names the layer or file."""


def coder_layer(sae: Any, where: str = "") -> int:
    """The layer a transcoder replaces: it must read `blocks.L.mlp.hook_in` and write `blocks.L.hook_mlp_out`.

    Why so strict: an SAE of the residual stream, or a transcoder that reads `ln2.hook_normalized` (before the norm's
    weight), runs at the right width and gives a graph of nothing (DESIGN.md, "blocks.L.mlp.hook_in")."""
    hook_in, hook_out = str(getattr(sae, "hook_name", "")), str(getattr(sae, "hook_name_out", ""))
    m_in, m_out = _IN.fullmatch(hook_in), _OUT.fullmatch(hook_out)
    if not (m_in and m_out and m_in.group(1) == m_out.group(1)):
        raise TranscoderSetError(
            f"{where}{sae!r} reads {hook_in!r} and writes {hook_out!r}; a transcoder set needs transcoders that "
            f"read blocks.L.mlp.hook_in and write blocks.L.hook_mlp_out of the same layer L (an SAE of another site "
            f"cannot replace an MLP)")
    return int(m_in.group(1))


class TranscoderSet(Sequence):
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
            if not all(hasattr(sae, a) for a in ("W_enc", "W_dec", "hook_name", "hook_name_out", "encode")):
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
        self.coders: dict[int, SAE] = dict(sorted(by_layer.items()))
        self.name = name
        self.metadata: dict[str, Any] = dict(metadata or {})

    # ---- what it covers ----------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return list(self.coders)

    @property
    def d_model(self) -> int:
        return next(iter(self.coders.values())).d_in

    @property
    def d_sae(self) -> int:
        """Features per layer (the largest, if the layers' widths differ)."""
        return max(s.d_sae for s in self.coders.values())

    @property
    def n_features(self) -> int:
        return sum(s.d_sae for s in self.coders.values())

    def __len__(self) -> int:
        return len(self.coders)

    def __getitem__(self, i: int) -> SAE:  # type: ignore[override]
        return list(self.coders.values())[i]

    def __iter__(self) -> Iterator[SAE]:
        return iter(self.coders.values())

    def __contains__(self, layer: object) -> bool:
        return layer in self.coders

    def __repr__(self) -> str:
        layers = self.layers
        span = f"layers {layers[0]}..{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else \
            f"layers {layers}"
        arch = sorted({s.architecture for s in self.coders.values()})
        skip = " skip" if any(s.W_skip is not None for s in self.coders.values()) else ""
        name = f"{self.name!r}: " if self.name else ""
        return f"TranscoderSet({name}{self.kind}, {len(layers)} {span}, d_sae {self.d_sae}, {'/'.join(arch)}{skip})"

    def coder(self, layer: int) -> SAE:
        if layer not in self.coders:
            raise TranscoderSetError(f"this set has no transcoder at layer {layer} (it covers {self.layers})")
        return self.coders[layer]

    def coder_name(self, layer: int) -> str:
        """A coder's name in a graph's transcoder list: its bundled/hub name when it has one, else its hooks."""
        sae = self.coders[layer]
        meta = getattr(sae, "metadata", {}) or {}
        if meta.get("name") or meta.get("release"):
            return str(meta.get("name") or meta.get("release"))
        return f"{self.name}/layer_{layer}" if self.name else f"{sae.hook_name}->{sae.hook_name_out}"

    @property
    def names(self) -> list[str]:
        return [self.coder_name(L) for L in self.coders]

    def read_hook(self, layer: int) -> str:
        """The hook layer `layer`'s features read (for a layer without a coder: where one would read)."""
        return self.coders[layer].hook_name if layer in self.coders else READ_HOOK.format(L=layer)

    def write_hook(self, layer: int) -> str:
        return WRITE_HOOK.format(L=layer)

    def check_model(self, model: Any) -> None:
        """The set fits `model`: every coder's layer exists and its width is the model's d_model."""
        cfg = model.cfg
        for layer, sae in self.coders.items():
            if layer >= cfg.n_layers:
                raise TranscoderSetError(f"{sae!r} is for layer {layer}; {model.name!r} has layers "
                                         f"0..{cfg.n_layers - 1}: a set for another model")
            if sae.d_in != cfg.d_model or sae.d_out != cfg.d_model:
                raise TranscoderSetError(
                    f"{sae!r} has d_in={sae.d_in}, d_out={sae.d_out}, but {model.name!r}'s d_model is "
                    f"{cfg.d_model}: a set for another model")

    def save(self, folder: Any, format: str = "slmviz") -> Any:
        """Write the set to `folder`: slmviz's layout (transcoder_set.json + one SAELens folder per layer) or
        format="circuit-tracer" (config.yaml + layer_{L}.safetensors); features.transcoder_io says what each holds.
        Returns the folder."""
        from ..formats.transcoder_io import save_transcoders

        return save_transcoders(self, folder, format)

    # ---- the replacement: features, their writes and reads ----------------------------------------------------
    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s feature activations [..., d_sae] of its input x [..., d_model]."""
        return self.coder(layer).encode(x)

    def reconstruct(self, layer: int, acts: Mapping[int, torch.Tensor], inputs: Mapping[int, torch.Tensor]
                    ) -> torch.Tensor:
        """The predicted MLP output of `layer` [..., d_model] from the features (`acts[L]` [..., d_sae]) and the
        inputs (`inputs[L]` [..., d_model]) of the layers that write there; for a PLT, the layer's own."""
        return self.coder(layer).decode(acts[layer], inputs[layer])

    def writes(self, layer: int, features: torch.Tensor, acts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """[(target layer, vectors [n, d_model] fp32)]: what the active `features` of `layer` (activations `acts`
        [n]) add to the MLP output of each layer they write. A PLT writes its own layer only.

        A topk coder with rescale_acts_by_decoder_norm divides its activation by |W_dec[f]| before decoding
        (SAE.decode), so the vector it writes is (a / |W_dec[f]|) W_dec[f]."""
        sae = self.coder(layer)
        w = sae.W_dec.detach()[features].float()  # [n, d_model]
        a = acts.float()
        if sae.architecture == "topk" and sae.rescale_acts_by_decoder_norm:
            a = a / w.norm(dim=-1)
        return [(layer, a[:, None] * w)]

    def encoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """[n, d_model] fp32: the vectors the pre-activations of `features` read the layer's input through (W_enc's
        columns; b_dec is never subtracted from a transcoder's input)."""
        return self.coder(layer).W_enc.detach()[:, features].T.float()

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s linear skip path x · W_skipᵀ [..., d_model] (zeros without a coder or W_skip): the part of
        the replacement that depends on the input, and so carries gradients between layers."""
        sae = self.coders.get(layer)
        if sae is None or getattr(sae, "W_skip", None) is None:
            return torch.zeros_like(x)
        return (x.to(sae.W_skip.dtype) @ sae.W_skip.T).to(x.dtype)  # [..., d_in] -> [..., d_out]

    # ---- the local replacement model of one prompt --------------------------------------------------------------
    def frozen_forward(
        self, model: Any, state: Any, embed: torch.Tensor, deltas: Sequence[torch.Tensor], grad: bool = False,
        last_layer: int | None = None, hooks: Mapping[str, Any] | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The local replacement model on a batch: embed [b, pos, d_model] enters the residual stream in place of the
        tokens' embeddings, and layer L's MLP output is

            prompt's mlp_out[L] - skip(prompt's input[L]) + skip(input[L]) + deltas[L]      [b, pos, d_model]

        (the prompt's output, its skip path live, plus an edit), under the prompt's attention patterns and norm
        scales (`state`: circuits.replacement.PromptState). With embed = the prompt's and deltas = 0 it reproduces
        the prompt's run; it is linear in (embed, deltas). Returns (what each layer's features read [b, pos,
        d_model] per layer, ln_final's output [b, pos, d_model]). `last_layer`: run blocks 0..last_layer only
        (what feature targets up to that layer read) and return None for ln_final's output. `hooks`: more hook fns
        {name: fn(x, name)} (batched: x is [b, ...]) run in the same forward after the freezing ones, to read values
        inside it (graphs.qk reads hook_rot_q / hook_rot_k, graphs.head_loadings each head's attn.hook_result).
        """
        return local_replacement_forward(self, model, state, embed, deltas, grad, last_layer, hooks)


def local_replacement_forward(ts: Any, model: Any, state: Any, embed: torch.Tensor, deltas: Sequence[torch.Tensor],
                              grad: bool = False, last_layer: int | None = None,
                              hooks: Mapping[str, Any] | None = None
                              ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`frozen_forward` of any set (a TranscoderSet, a CrossLayerTranscoder): what it needs of the set is where each
    layer reads and writes (`read_hook`, `write_hook`) and its skip path (`skip`, zeros where there is none). Layer
    L's MLP output is the prompt's, minus the skip of the prompt's input, plus the skip of the live input, plus
    deltas[L]; the features' writes are constants of the prompt, so an edit reaches them through deltas."""
    from ..hooks import build_context
    from ..model.norm import unhooked
    from ..variants import resolve_variant

    cfg, dec = model.cfg, model.decoder
    b = embed.shape[0]
    reads: list[torch.Tensor | None] = [None] * cfg.n_layers

    def frozen(x: torch.Tensor, name: str) -> torch.Tensor:
        return state.frozen[name].expand_as(x)

    def inject(x: torch.Tensor, name: str) -> torch.Tensor:
        return embed

    def read_in(layer: int):
        def fn(x: torch.Tensor, name: str) -> None:
            reads[layer] = x
        return fn

    def replace_out(layer: int):
        def fn(x: torch.Tensor, name: str) -> torch.Tensor:
            live = ts.skip(layer, reads[layer])
            return (state.mlp_out[layer] - ts.skip(layer, state.mlp_in[layer]) + live + deltas[layer]).to(x.dtype)
        return fn

    fns: dict[str, Any] = {name: frozen for name in state.frozen}
    fns["hook_embed"] = inject
    for layer in range(cfg.n_layers):
        fns[ts.read_hook(layer)] = read_in(layer)
        fns[ts.write_hook(layer)] = replace_out(layer)
    for name, fn in (hooks or {}).items():  # after the freezing fn of the same name, which must decide the value
        fns[name] = [fns[name], fn] if name in fns else fn
    ctx = build_context(model.hook_names, [], fns, batched=True)
    v = resolve_variant(None, cfg)
    ids = state.ids[None].expand(b, -1)
    stop = cfg.n_layers - 1 if last_layer is None else last_layer
    resid = dec.forward(ids, ctx, v, grad=grad, stop_after_layer=stop)  # [b, pos, d_model]
    if last_layer is not None:
        return [t for t in reads if t is not None], None
    with torch.enable_grad() if grad else torch.inference_mode():
        scale = state.final_scale.expand(b, -1, -1)
        normed = dec.final_norm(resid, dec.conventions(v), lambda s: scale.to(s.dtype), unhooked)
    return [t for t in reads if t is not None], normed


def as_transcoder_set(transcoders: Any) -> TranscoderSet:
    """`transcoders=` as a set: a TranscoderSet as it is, one transcoder or a list of them wrapped."""
    if isinstance(transcoders, TranscoderSet) or hasattr(transcoders, "frozen_forward"):
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
