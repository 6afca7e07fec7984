"""The replacement model's one interface: what attribution graphs, splicing, patching, evaluation and the app ask of a
set of transcoders, answered alike by the per-layer set (TranscoderSet, "plt") and the cross-layer transcoder
(CrossLayerTranscoder, "clt"), so no caller asks which one it holds.

Layer L's features read the set's input hook at L (`read_hook(L)`: `blocks.L.mlp.hook_in`, or a CLT's
`hook_resid_mid`) and write MLP outputs (`write_hook(j)` = `blocks.j.hook_mlp_out`): a PLT feature its own layer's,
a CLT feature every layer from L on. Code that follows a feature's effect loops over `writes(L, ...)`, "where this
feature writes", and never over "if CLT" (circuit-tracer's shape: its per-layer set and CLT share one attribution
interface).

    ts.kind, ts.name, ts.layers, ts.d_model, ts.d_sae, ts.n_features, ts.names
    ts.read_hook(L), ts.write_hook(L)
    ts.encode(L, x)                   features [..., d_sae] of layer L's input x [..., d_model]
    ts.reconstruct(L, acts, inputs)   the predicted MLP output at L from every layer that writes there
    ts.writes(L, features, acts)      [(layer written, vectors [n, d_model])]: the decoder vectors, scaled
    ts.encoder_rows(L, features)      [n, d_model]: what each feature's pre-activation reads its input through
    ts.skip(L, x)                     the linear skip path at L (zeros where there is none)
    ts.compute_attribution_components(inputs)        what a graph needs of one prompt (implemented here)
    ts.frozen_forward(model, state, embed, deltas)   the local replacement model of one prompt (implemented here)
    for unit in ts: ...               one splice unit per layer (saes=ts in trace / generate / scan / patch)
    ts.coders                         {layer: its splice unit}
    ts.feature_coder(L)               layer L's features as an SAE (cards, dashboards, labels)
    ts.check_model(model), ts.attach(model), ts.save(folder, format=...)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

READ_HOOK = "blocks.{L}.mlp.hook_in"  # what a PLT reads: the MLP's input after its norm's weight (docs/hook-names.md)
WRITE_HOOK = "blocks.{L}.hook_mlp_out"  # what every layer's features write into: the MLP output they replace


@dataclass
class AttributionComponents:
    """What an attribution graph needs of the set for one prompt (circuit-tracer's compute_attribution_components):
    the active features, ordered by layer, position, feature; the vector each one's pre-activation reads its input
    through; where it writes and what, as one entry per (feature, layer written) pointing at its unit-activation
    vector, each distinct (feature, layer written) vector stored once in `decoder` (a feature fires at many
    positions; a CLT feature writes many layers); and the set's prediction of every MLP output it writes."""

    layer: torch.Tensor  # [n] long
    position: torch.Tensor  # [n] long
    feature: torch.Tensor  # [n] long
    activation: torch.Tensor  # [n] fp32
    encoder: torch.Tensor  # [n, d_model] fp32
    write_feature: torch.Tensor  # [w] long: which active feature (0..n-1) writes
    write_layer: torch.Tensor  # [w] long: the MLP output it writes
    write_row: torch.Tensor  # [w] long: its unit-activation vector's row in `decoder`
    decoder: torch.Tensor  # [r, d_model] fp32
    reconstruction: dict[int, torch.Tensor]  # {layer written: [pos, d_model] fp32}


class ReplacementSet(ABC):
    """A replacement model's transcoders (module docstring); subclasses fill in the abstract methods."""

    kind: str  # "plt" | "clt"
    name: str  # what graphs call the set
    metadata: dict[str, Any]

    # ---- what it covers -----------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def layers(self) -> list[int]:
        """The layers whose features the set has (those it reads at)."""

    @property
    @abstractmethod
    def d_model(self) -> int: ...

    @property
    @abstractmethod
    def d_sae(self) -> int:
        """Features per layer (the largest, if the layers' widths differ)."""

    @property
    @abstractmethod
    def n_features(self) -> int: ...

    @property
    @abstractmethod
    def names(self) -> list[str]:
        """What an attribution graph lists as its transcoders."""

    @property
    @abstractmethod
    def coders(self) -> dict[int, Any]:
        """{layer: its splice unit}: an SAE for a PLT, a CLTLayer for a CLT; each has hook_name, hook_name_out,
        d_sae, decoder_rows, labels and splice_fns."""

    def __iter__(self) -> Iterator[Any]:
        """The splice units, layer by layer: everything that takes saes=[...] takes a set as it is."""
        return iter(self.coders.values())

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, layer: object) -> bool:
        return layer in self.layers

    @abstractmethod
    def read_hook(self, layer: int) -> str:
        """The hook layer `layer`'s features read (for a layer without features: where they would read)."""

    def write_hook(self, layer: int) -> str:
        """The MLP output at `layer`, which features write into and the replacement model replaces."""
        return WRITE_HOOK.format(L=layer)

    # ---- the features, their reads and writes -------------------------------------------------------------------
    @abstractmethod
    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s feature activations [..., d_sae] of its input x [..., d_model], in x's dtype."""

    @abstractmethod
    def reconstruct(self, layer: int, acts: Mapping[int, torch.Tensor], inputs: Mapping[int, torch.Tensor]
                    ) -> torch.Tensor:
        """The predicted MLP output of `layer` [..., d_model] from the features (`acts[L]` [..., d_sae]) and inputs
        (`inputs[L]` [..., d_model]) of the layers that write there."""

    @abstractmethod
    def writes(self, layer: int, features: torch.Tensor, acts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """[(layer written, vectors [n, d_model] fp32)]: what the active `features` of `layer` (activations `acts`
        [n]) add to each MLP output they write."""

    @abstractmethod
    def encoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """[n, d_model] fp32: the vectors the pre-activations of `features` read the layer's input through."""

    @abstractmethod
    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s linear skip path [..., d_model] of its input x (zeros where there is none), in x's dtype:
        the part of the replacement that depends on the live input, and so carries gradients between layers."""

    @abstractmethod
    def feature_coder(self, layer: int) -> Any:
        """Layer `layer`'s features as an SAE, for what reads one feature at a time (dashboards, cards, labels)."""

    # ---- the model it replaces, and files ------------------------------------------------------------------------
    @abstractmethod
    def check_model(self, model: Any, where: str = "") -> None:
        """The set fits `model` (its layers, widths and hooks), else an error (TranscoderSetError, CLTError) that
        starts with `where` (a file or folder) and names the layer or hook at fault."""

    @abstractmethod
    def to(self, device: Any) -> ReplacementSet:
        """The set's weights moved to `device` (in place); returns the set."""

    @abstractmethod
    def save(self, folder: Any, format: str) -> Any:
        """Write the set in `format` (one of the layouts formats/ writes for it); returns the folder."""

    def attach(self, model: Any, where: str = "") -> ReplacementSet:
        """Check the set against `model`, move it to the model's device and keep a reference to the model (what
        automatic labels and logit effects read its unembedding from); returns the set."""
        self.check_model(model, where)
        self.to(getattr(model, "device", "cpu"))
        self.model = model
        return self

    def compute_attribution_components(self, inputs: Sequence[torch.Tensor], zero_bos: bool = False
                                       ) -> AttributionComponents:
        """AttributionComponents of one prompt, from `inputs[L]` [pos, d_model], what layer L's features read.
        `zero_bos` leaves out position 0's features (they stay in the reconstructions, as in the model)."""
        d_model, dev = inputs[0].shape[-1], inputs[0].device
        acts_by_layer: dict[int, torch.Tensor] = {}
        layers, positions, feats, values, enc = [], [], [], [], []
        for layer in self.layers:
            with torch.no_grad():
                acts = self.encode(layer, inputs[layer]).float()  # [pos, d_sae]
            acts_by_layer[layer] = acts
            shown = acts.clone()
            if zero_bos:
                shown[0] = 0
            pos, idx = torch.nonzero(shown, as_tuple=True)  # row-major: position, then feature
            layers.append(torch.full_like(pos, layer))
            positions.append(pos)
            feats.append(idx)
            values.append(shown[pos, idx])
            enc.append(self.encoder_rows(layer, idx))

        def cat(xs: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
            return torch.cat(xs) if xs else empty

        long0, float0 = torch.zeros(0, dtype=torch.long, device=dev), torch.zeros(0, device=dev)
        nodes, targets, rows, table = [], [], [], []
        start = n_rows = 0
        for layer, idx in zip(self.layers, feats, strict=True):
            node = torch.arange(start, start + len(idx), device=dev)
            distinct, which = idx.unique(return_inverse=True)  # a feature's rows once, however many positions it fires
            for target, v in self.writes(layer, distinct, torch.ones(len(distinct), device=dev)):  # unit activation
                nodes.append(node)
                targets.append(torch.full_like(node, target))
                rows.append(n_rows + which)
                table.append(v)
                n_rows += len(distinct)
            start += len(idx)
        write_layer = cat(targets, long0)
        inputs_by_layer = {L: inputs[L] for L in self.layers}
        with torch.no_grad():
            reconstruction = {L: self.reconstruct(L, acts_by_layer, inputs_by_layer).float()
                              for L in sorted({int(L) for L in write_layer.unique()} | set(self.layers))}
        return AttributionComponents(
            layer=cat(layers, long0), position=cat(positions, long0), feature=cat(feats, long0),
            activation=cat(values, float0), encoder=cat(enc, torch.zeros(0, d_model, device=dev)),
            write_feature=cat(nodes, long0), write_layer=write_layer, write_row=cat(rows, long0),
            decoder=cat(table, torch.zeros(0, d_model, device=dev)), reconstruction=reconstruction)

    # ---- the local replacement model of one prompt ----------------------------------------------------------------
    def frozen_forward(
        self, model: Any, state: Any, embed: torch.Tensor, deltas: Sequence[torch.Tensor], grad: bool = False,
        last_layer: int | None = None, hooks: Mapping[str, Any] | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The local replacement model on a batch: embed [b, pos, d_model] enters the residual stream in place of the
        tokens' embeddings, and layer L's MLP output is

            prompt's mlp_out[L] - skip(prompt's input[L]) + skip(input[L]) + deltas[L]      [b, pos, d_model]

        (the prompt's output, its skip path live, plus an edit), under the prompt's attention patterns and norm
        scales (`state`: graphs.frozen.PromptState). With embed = the prompt's and deltas = 0 it reproduces the
        prompt's run; it is linear in (embed, deltas). The features' writes, into their own layer or later ones,
        are constants of the prompt, so an edit reaches them through deltas. Returns (what each layer's features
        read [b, pos, d_model] per layer, ln_final's output [b, pos, d_model]). `last_layer`: run blocks
        0..last_layer only (what feature targets up to that layer read) and return None for ln_final's output.
        `hooks`: more hook fns {name: fn(x, name)} (batched: x is [b, ...]) run in the same forward after this
        method's own at the same name, to read or hold values inside it (graphs.qk reads hook_rot_q / hook_rot_k,
        graphs.head_loadings each head's attn.hook_result).
        """
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
                live = self.skip(layer, reads[layer])
                return (state.mlp_out[layer] - self.skip(layer, state.mlp_in[layer]) + live + deltas[layer]).to(x.dtype)
            return fn

        fns: dict[str, Any] = {name: frozen for name in state.frozen}
        fns["hook_embed"] = inject
        for layer in range(cfg.n_layers):
            fns[self.read_hook(layer)] = read_in(layer)
            fns[self.write_hook(layer)] = replace_out(layer)
        for name, fn in (hooks or {}).items():  # after this method's fn of the same name, which must see x first
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
