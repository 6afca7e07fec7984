"""Cross-layer transcoders (CLT, Ameisen et al. 2025): a replacement model whose features write every later MLP.

    clt = slmviz.load_transcoders("runs/smollm2_clt", model=m)   # or replacement.load.load_clt(folder, model=m)
    clt.kind, clt.layers, clt.d_sae                              # "clt"; every layer; features per layer
    t = m.trace(prompt, saes=clt)                                # spliced at every layer, error terms on: exact
    t["blocks.5.hook_mlp_out.hook_sae_recons"]                   # Σ over layers L ≤ 5 of what L's features write
    g = slmviz.attribution_graph(prompt, transcoders=clt, model=m)

Layer L's features read layer L's input hook (`blocks.L.mlp.hook_in`, Gemma Scope 2's, or `blocks.L.hook_resid_mid`,
circuit-tracer's CLTs) and write into `blocks.j.hook_mlp_out` for every j ≥ L:

    h_L = x_L @ W_enc[L] + b_enc[L]                       W_enc [n_layers, d_model, d_sae] (SAELens's orientation)
    f_L = relu(h_L) | relu(topk_k(h_L)) | relu(h_L) * 1[h_L > threshold[L]]
    y_j = Σ_{L ≤ j} f_L @ W_dec[L][:, j - L] + b_dec[j] (+ x_j @ W_skip[j].T)
                                                          W_dec[L] [d_sae, n_layers - L, d_model]

The object answers the questions a TranscoderSet answers (replacement.base.ReplacementSet: read_hook, encode,
reconstruct, writes, encoder_rows, skip, frozen_forward), so attribution_graph takes it as it is; a feature's
`writes` are one vector per layer it writes, and its edges sum over them.

Files: `save(folder, format=...)` hands `spec()` and `tensors()` to formats.circuit_tracer or formats.gemma_scope;
`from_state` builds a CLT from what their readers return (replacement.load.load_clt).

Splicing: iterating a CLT yields one unit per layer j (`CLTLayer`), reading layer j's input hook and writing
blocks.j.hook_mlp_out with SAELens's sub-hooks there (hook_sae_input / acts_pre / acts_post are layer j's own
features, hook_sae_recons is y_j). The units of one forward share the activations of the earlier layers through a
`_Forward` record that the first unit puts into the hook context, so an edit of layer 2's hook_sae_acts_post moves
the reconstruction of every layer from 2 on. With error terms (the default) every output equals the model's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import CLTError
from ..features.sae import SAE, _topk, weight_size
from ..formats import circuit_tracer, gemma_scope
from ..formats.saelens import canonical_architecture
from ..hooks import layer_hook_name
from .base import ReplacementSet

# The hooks a CLT's features may read (local names, after "blocks.L."), and why each.
INPUT_HOOKS = {
    "mlp.hook_in": "the MLP's input after its norm's weight (Gemma Scope 2's CLTs; what slmviz trains)",
    "hook_resid_mid": "the residual stream before the MLP's norm (circuit-tracer's CLTs)",
}
FORMATS = {"circuit-tracer": circuit_tracer.write_clt, "gemma-scope-2": gemma_scope.write_clt}


def input_hook_local(hook: str) -> str:
    """`mlp.hook_in` / `hook_resid_mid` from a local or full name (blocks.3.hook_resid_mid), or a clear error."""
    local = hook.split(".", 2)[2] if hook.startswith("blocks.") and hook.count(".") >= 2 else hook
    if local not in INPUT_HOOKS:
        raise CLTError(f"a CLT reads one of {list(INPUT_HOOKS)} (per layer), not {hook!r}")
    return local


class CrossLayerTranscoder(torch.nn.Module, ReplacementSet):
    """A cross-layer transcoder over layers 0..n_layers-1 (module docstring for the formulas).

    `architecture`: "relu" | "topk" (with `k`, per layer) | "jumprelu" (BatchTopK is saved as jumprelu).
    `input_hook`: "mlp.hook_in" or "hook_resid_mid" (what every layer's features read). `skip`: a per-layer affine
    skip path x_j @ W_skip[j].T into the same layer's output (Gemma Scope 2's `_affine` CLTs).
    """

    kind = "clt"

    def __init__(self, n_layers: int, d_model: int, d_sae: int, architecture: str = "jumprelu", k: int | None = None,
                 input_hook: str = "mlp.hook_in", skip: bool = False, dtype: torch.dtype = torch.float32,
                 name: str = "", metadata: dict[str, Any] | None = None):
        super().__init__()
        for what, n in (("n_layers", n_layers), ("d_model", d_model), ("d_sae", d_sae)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise CLTError(f"{what} must be a positive integer, got {n!r}")
        arch, arch_skip = canonical_architecture(architecture)
        if arch == "topk" and (not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= d_sae):
            raise CLTError(f"a topk CLT needs k, an integer in 1..d_sae={d_sae}; got k={k!r}")
        self.architecture = arch
        self.k = k
        self.input_hook = input_hook_local(input_hook)
        self.name = name
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.use_error_term = True  # as SAE.use_error_term: spliced, each output is the model's own
        p = torch.nn.Parameter
        self.W_enc = p(torch.zeros(n_layers, d_model, d_sae, dtype=dtype))
        self.b_enc = p(torch.zeros(n_layers, d_sae, dtype=dtype))
        self.threshold = p(torch.zeros(n_layers, d_sae, dtype=dtype)) if arch == "jumprelu" else None
        self.W_dec = torch.nn.ParameterList(
            [p(torch.zeros(d_sae, n_layers - L, d_model, dtype=dtype)) for L in range(n_layers)])
        self.b_dec = p(torch.zeros(n_layers, d_model, dtype=dtype))
        self.W_skip = p(torch.zeros(n_layers, d_model, d_model, dtype=dtype)) if (skip or arch_skip) else None
        self._units = [CLTLayer(self, L) for L in range(n_layers)]
        self.model = None  # set by attach (load_transcoders(model=...)): automatic labels read its unembedding
        self.labels: dict[int, dict[int, str]] = {}  # edited labels {layer: {feature: text}}

    # ---- sizes and coverage -------------------------------------------------------------------------------------
    n_layers = weight_size("W_enc", 0, "Layers 0..n_layers-1, each with d_sae features.")
    d_model = weight_size("W_enc", 1, "The model's d_model: the width every layer's features read and write.")
    d_sae = weight_size("W_enc", 2, "Features per layer.")

    @property
    def n_features(self) -> int:
        return self.n_layers * self.d_sae

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def layers(self) -> list[int]:
        return list(range(self.n_layers))

    @property
    def names(self) -> list[str]:
        """What a graph lists as its transcoders: the CLT once."""
        return [self.name or f"clt/{self.input_hook}"]

    def __getitem__(self, layer: int) -> CLTLayer:
        return self._units[layer]

    @property
    def coders(self) -> dict[int, CLTLayer]:
        """{layer: its splice unit}, as TranscoderSet.coders maps layers to coders (the workbench reads it)."""
        return dict(enumerate(self._units))

    def __repr__(self) -> str:
        name = f"{self.name!r}: " if self.name else ""
        k = f" k={self.k}" if self.architecture == "topk" else ""
        skip = " skip" if self.W_skip is not None else ""
        return (f"CrossLayerTranscoder({name}clt, {self.n_layers} layers reading {self.input_hook}, d_sae "
                f"{self.d_sae}, {self.architecture}{k}{skip})")

    def read_hook(self, layer: int) -> str:
        return layer_hook_name(layer, self.input_hook)

    def feature_coder(self, layer: int) -> SAE:
        """Layer `layer`'s features as an SAE: CLTLayer.feature_view (the CLT's encoder, each feature's writes summed
        into one decoder row)."""
        return self._units[layer].feature_view()

    def check_model(self, model: Any, where: str = "") -> None:
        """The CLT fits `model`: one encoder per layer of it, its d_model, an input hook it has. `where` (a file or
        folder) starts each message."""
        cfg = model.cfg
        name = getattr(model, "name", "the model")
        if self.n_layers != cfg.n_layers:
            raise CLTError(f"{where}a CLT of {self.n_layers} layers; {name!r} has {cfg.n_layers}: a CLT for another "
                           f"model (a CLT covers every layer)")
        if self.d_model != cfg.d_model:
            raise CLTError(f"{where}the CLT's d_model is {self.d_model}, {name!r}'s is {cfg.d_model}: a CLT for "
                           f"another model")
        missing = [h for h in (self.read_hook(0), self.write_hook(0)) if h not in set(model.hook_names)]
        if missing:
            raise CLTError(f"{where}the CLT reads {self.read_hook(0)!r} and writes {self.write_hook(0)!r}; "
                           f"{name!r} has no {missing[0]!r}")

    # ---- the formulas -------------------------------------------------------------------------------------------
    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_inference() and torch.is_grad_enabled() and self.W_enc.requires_grad:
            x = x.clone()  # a trace's tensors come from inference mode; autograd may not record them otherwise
        if x.shape[-1] != self.d_model:
            raise CLTError(f"input's last dimension is {x.shape[-1]}, this CLT reads d_model={self.d_model}")
        return x.to(self.dtype)

    def encode_pre(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """h = x @ W_enc[L] + b_enc[L]: [..., d_model] -> [..., d_sae] in the CLT's dtype."""
        return self._input(x) @ self.W_enc[layer] + self.b_enc[layer]  # [..., d_model] -> [..., d_sae]

    def activate(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        if self.architecture == "relu":
            return h.relu()
        if self.architecture == "topk":
            return _topk(h, self.k)
        return h.relu() * (h > self.threshold[layer]).to(h.dtype)  # strict '>', as SAELens and Gemma Scope

    def encode(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s feature activations [..., d_sae] of its input x [..., d_model], in x's dtype."""
        return self.activate(layer, self.encode_pre(layer, x)).to(x.dtype)

    def decode_into(self, layer: int, acts: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """`Σ_{L ≤ layer} acts[L] @ W_dec[L][:, layer - L] + b_dec[layer]` [..., d_model] (the CLT's dtype), over the
        layers L ≤ layer present in `acts` ([..., d_sae] each)."""
        out = self.b_dec[layer]
        for L, a in acts.items():
            if layer >= L:
                out = out + a.to(self.dtype) @ self.W_dec[L][:, layer - L]  # [..., d_sae] -> [..., d_model]
        return out

    def skip(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s affine skip x · W_skip[L]ᵀ [..., d_model] (zeros without W_skip), in x's dtype."""
        if self.W_skip is None:
            return torch.zeros_like(x)
        return (x.to(self.dtype) @ self.W_skip[layer].T).to(x.dtype)  # [..., d_in] -> [..., d_out]

    def reconstruct(self, layer: int, acts: Mapping[int, torch.Tensor], inputs: Mapping[int, torch.Tensor]
                    ) -> torch.Tensor:
        """y_layer [..., d_model]: what every layer L ≤ `layer` writes there, b_dec, and the skip of its input."""
        out = self.decode_into(layer, acts)
        if self.W_skip is not None:
            out = out + self.skip(layer, inputs[layer]).to(out.dtype)
        return out.to(inputs[layer].dtype) if layer in inputs else out

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Every layer's output [n_layers, ..., d_model] from every layer's input [n_layers, ..., d_model]."""
        acts = {L: self.activate(L, self.encode_pre(L, inputs[L])) for L in self.layers}
        return self.decode_all(acts, inputs)

    def decode_all(self, acts: Mapping[int, torch.Tensor], inputs: torch.Tensor | None = None) -> torch.Tensor:
        """[n_layers, ..., d_model]: each layer's f_L @ W_dec[L] (one product per L, [d_sae, (n - L) d_model]) added
        into the outputs L..n-1, plus b_dec (and the skips when `inputs` is given)."""
        first = next(iter(acts.values()))
        n, d = self.n_layers, self.d_model
        out = self.b_dec.reshape(n, *([1] * (first.dim() - 1)), d).expand(n, *first.shape[:-1], d).clone()
        for L, a in acts.items():
            w = self.W_dec[L].reshape(self.d_sae, (n - L) * d)
            y = (a.to(self.dtype) @ w).unflatten(-1, (n - L, d))  # [..., d_sae] -> [..., n - L, d_model]
            out[L:] = out[L:] + y.movedim(-2, 0)
        if self.W_skip is not None and inputs is not None:
            out = out + torch.einsum("l...i,loi->l...o", inputs.to(self.dtype), self.W_skip)
        return out

    # ---- what attribution asks --------------------------------------------------------------------------------------
    def writes(self, layer: int, features: torch.Tensor, acts: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """[(j, vectors [n, d_model] fp32)] for every j ≥ layer: `a · W_dec[layer][f, j - layer]`."""
        w = self.W_dec[layer].detach()[features].float()  # [n, n_layers - layer, d_model]
        a = acts.float()[:, None]
        return [(layer + i, a * w[:, i]) for i in range(w.shape[1])]

    def encoder_rows(self, layer: int, features: torch.Tensor) -> torch.Tensor:
        """[n, d_model] fp32: W_enc[layer]'s columns for `features`."""
        return self.W_enc.detach()[layer][:, features].T.float()

    # ---- state ------------------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """slmviz's names -> tensors: W_enc [n, d_model, d_sae], b_enc, threshold, b_dec [n, d_model], W_skip
        [n, d_out, d_in], and W_dec_{L} [d_sae, n - L, d_model] per layer."""
        out = {"W_enc": self.W_enc, "b_enc": self.b_enc, "b_dec": self.b_dec}
        if self.threshold is not None:
            out["threshold"] = self.threshold
        if self.W_skip is not None:
            out["W_skip"] = self.W_skip
        out.update({f"W_dec_{L}": w for L, w in enumerate(self.W_dec)})
        return {k: v.detach() for k, v in out.items()}

    def spec(self) -> dict[str, Any]:
        """The settings beside the tensors (the constructor's arguments but the sizes and skip, which the tensors
        give), so `CrossLayerTranscoder.from_state(clt.tensors(), **clt.spec())` is the same CLT. What formats
        write."""
        return {"architecture": self.architecture, "k": self.k, "input_hook": self.input_hook, "dtype": self.dtype,
                "name": self.name, "metadata": dict(self.metadata)}

    @classmethod
    def from_state(cls, tensors: dict[str, torch.Tensor], copy: bool = True, **spec: Any) -> CrossLayerTranscoder:
        """A CLT from tensors named as `tensors()` names them; n_layers, d_model and d_sae come from W_enc, the skip
        path from whether W_skip is there, the dtype from W_enc unless dtype= is given. `spec`: the constructor's
        other arguments (CrossLayerTranscoder.spec). `copy=False` makes the tensors the CLT's parameters (converted
        only where the dtype differs): for a loader's freshly read tensors, which nothing else holds."""
        w_enc = tensors.get("W_enc")
        if w_enc is None or w_enc.dim() != 3:
            raise CLTError(f"W_enc must be [n_layers, d_model, d_sae], got {None if w_enc is None else w_enc.shape}")
        n, d_model, d_sae = (int(x) for x in w_enc.shape)
        dtype = spec.pop("dtype", None) or w_enc.dtype
        with torch.device("meta"):  # no weights allocated: the tensors become them
            clt = cls(n, d_model, d_sae, skip="W_skip" in tensors, dtype=dtype, **spec)
        expected = {k: tuple(v.shape) for k, v in clt.tensors().items()}
        wrong = {k: tuple(tensors[k].shape) if k in tensors else None for k in expected
                 if k not in tensors or tuple(tensors[k].shape) != expected[k]}
        if wrong:
            raise CLTError(f"tensors of the wrong shape or missing for a CLT of {n} layers, d_model {d_model}, d_sae "
                           f"{d_sae}: {wrong} (expected {', '.join(f'{k} {expected[k]}' for k in wrong)})")
        state = {k.replace("W_dec_", "W_dec."): tensors[k].to(dtype, copy=copy).contiguous() for k in expected}
        clt.load_state_dict(state, assign=True)
        return clt

    def save(self, folder: Any, format: str = "circuit-tracer") -> Path:
        """Write the CLT: "circuit-tracer" (W_enc_{L} / W_dec_{L}.safetensors + config.yaml: formats.circuit_tracer)
        or "gemma-scope-2" (params_layer_{L}.safetensors + config.json: formats.gemma_scope). Returns the folder."""
        if format not in FORMATS:
            raise CLTError(f"format must be one of {tuple(FORMATS)}, got {format!r}")
        return FORMATS[format](Path(folder), self.spec(), self.tensors())

    @classmethod
    def random(cls, n_layers: int, d_model: int, d_sae: int, seed: int = 0, scale: float = 1.0, **kwargs: Any
               ) -> CrossLayerTranscoder:
        """Random weights (tests, benchmarks, training's start): decoder rows of norm `scale` / sqrt(n - L) per
        target layer, W_enc ~ N(0, 1/d_model), small biases and thresholds."""
        clt = cls(n_layers, d_model, d_sae, **kwargs)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            clt.W_enc.copy_(torch.randn(n_layers, d_model, d_sae, generator=g) / d_model ** 0.5)
            clt.b_enc.copy_(0.1 * torch.randn(n_layers, d_sae, generator=g))
            clt.b_dec.copy_(0.1 * torch.randn(n_layers, d_model, generator=g))
            for L, w in enumerate(clt.W_dec):
                r = torch.randn(d_sae, n_layers - L, d_model, generator=g)
                w.copy_(r / r.norm(dim=-1, keepdim=True) * scale / (n_layers - L) ** 0.5)
            if clt.threshold is not None:
                clt.threshold.copy_(0.1 * torch.rand(n_layers, d_sae, generator=g))
            if clt.W_skip is not None:
                clt.W_skip.copy_(torch.randn(n_layers, d_model, d_model, generator=g) / d_model ** 0.5)
        return clt


# ---- splicing: one unit per layer, sharing one forward's activations -----------------------------------------------
class _Forward:
    """What the units of one CLT share within one hook context: each layer's input, its (possibly edited)
    activations, and the activations the unedited CLT computes from the same input (the error term's).

    A new forward is seen when a layer's input arrives that is not after the last one seen (layers fire in order
    within one forward; generate's next step, or a patch run starting at a later layer, starts again), and it
    clears what the last one left."""

    def __init__(self, clt: CrossLayerTranscoder):
        self.clt = clt
        self.inputs: dict[int, torch.Tensor] = {}
        self.acts: dict[int, torch.Tensor] = {}
        self.clean: dict[int, torch.Tensor] = {}
        self.edited = False
        self.last = -1
        self.quiet: bool | None = None

    def arrive(self, layer: int, x: torch.Tensor) -> None:
        if layer <= self.last:
            self.inputs.clear()
            self.acts.clear()
            self.clean.clear()
            self.edited = False
        self.last = layer
        self.inputs[layer] = x

    def looked_at(self, ctx: Any) -> bool:
        """Whether anyone reads or edits any sub-hook of any of the CLT's layers in this context."""
        if self.quiet is None:
            self.quiet = not any(ctx.wants(n) for unit in self.clt for n in unit.splice_dims())
        return not self.quiet


def _shared(clt: CrossLayerTranscoder, ctx: Any) -> _Forward:
    """The `_Forward` record of `clt` in `ctx`: the one an earlier unit of the same CLT put there (its input-keeping
    fn carries it), else a new one."""
    for fns in ctx.fns.values():
        for fn in fns:
            rec = getattr(fn, "clt_forward", None)
            if rec is not None and rec.clt is clt:
                return rec
    return _Forward(clt)


class CLTLayer:
    """Layer `layer` of a CLT as something `saes=` splices: it reads the layer's input hook and writes
    blocks.{layer}.hook_mlp_out (module docstring). Sizes and hooks as an SAE's; the weights stay the CLT's."""

    def __init__(self, clt: CrossLayerTranscoder, layer: int):
        self.clt, self.layer = clt, layer

    hook_name = property(lambda self: self.clt.read_hook(self.layer))
    hook_name_out = property(lambda self: self.clt.write_hook(self.layer))
    d_in = property(lambda self: self.clt.d_model)
    d_out = property(lambda self: self.clt.d_model)
    d_sae = property(lambda self: self.clt.d_sae)
    dtype = property(lambda self: self.clt.dtype)
    architecture = property(lambda self: self.clt.architecture)
    is_transcoder = True

    @property
    def W_enc(self) -> torch.Tensor:
        return self.clt.W_enc[self.layer]

    @property
    def use_error_term(self) -> bool:
        return self.clt.use_error_term

    @use_error_term.setter
    def use_error_term(self, value: bool) -> None:
        self.clt.use_error_term = bool(value)

    @property
    def model(self) -> Any:
        return self.clt.model

    @property
    def labels(self) -> dict[int, str]:
        """Edited labels {feature: text} of this layer's features (SAE.labels)."""
        return self.clt.labels.setdefault(self.layer, {})

    def residual_direction(self, feature: int, model: Any = None) -> torch.Tensor:
        """[d_model]: everything feature f writes into the residual stream, `Σ_j W_dec[L][f, j - L]` (each write is
        added to the stream, so their sum is its direct path to the unembedding; SAE.residual_direction)."""
        if not 0 <= int(feature) < self.d_sae:
            raise CLTError(f"feature {feature} is out of range: layer {self.layer} has d_sae={self.d_sae} features")
        return self.clt.W_dec[self.layer][int(feature)].detach().float().sum(0)

    def feature_view(self) -> Any:
        """This layer's features as an SAE (features.sae.SAE), for what reads one feature at a time: dashboards,
        feature cards, labels. Its encoder is the CLT's layer exactly (the same W_enc, b_enc, threshold or k, read
        at the same hook), so its activations and top contexts are the CLT's. Its decoder row of feature f is
        residual_direction(f), the sum of f's writes into every later layer, so its logit effects and nearest
        neighbours are the feature's whole direct path.

        It is not a reconstruction of this layer's MLP output (that row holds the later layers' writes too): splice
        the CLT itself (saes=clt) to run the model on it. Built on each call, sharing no storage with the CLT."""
        clt, L = self.clt, self.layer
        view = SAE(clt.d_model, clt.d_sae, architecture=clt.architecture,
                   k=clt.k if clt.architecture == "topk" else None,
                   hook_name=self.hook_name, hook_name_out=self.hook_name_out, dtype=clt.dtype,
                   metadata={**clt.metadata, "clt_layer": L, "decoder": "each feature's writes summed over layers"})
        with torch.no_grad():
            view.W_enc.copy_(clt.W_enc[L])
            view.b_enc.copy_(clt.b_enc[L])
            view.W_dec.copy_(clt.W_dec[L].sum(1))  # [d_sae, n - L, d] -> [d_sae, d]
            view.b_dec.copy_(clt.b_dec[L])
            if view.threshold is not None:
                view.threshold.copy_(clt.threshold[L])
        view.requires_grad_(False)
        view.model = clt.model
        view.__dict__["_labels"] = self.labels  # SAE.labels' storage: edits of the view's labels are the CLT's
        return view

    def decoder_rows(self) -> dict[str, torch.Tensor]:
        """{hook written: [d_sae, d_model]} for every output this layer's features write (d output / d feature)."""
        return {self.clt.write_hook(self.layer + i): self.clt.W_dec[self.layer][:, i]
                for i in range(self.clt.n_layers - self.layer)}

    def __repr__(self) -> str:
        return (f"CLTLayer({self.layer} of {self.clt.n_layers}: {self.hook_name} -> {self.hook_name_out} and every "
                f"later hook_mlp_out, d_sae={self.d_sae})")

    def splice_dims(self) -> dict[str, tuple[str, ...]]:
        from ..features.splice import splice_dims

        return splice_dims(self)

    def splice_sizes(self) -> dict[str, int]:
        from ..features.splice import splice_sizes

        return splice_sizes(self)

    def shown_rows(self, x: torch.Tensor, first: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        """The row rule of training and scans (SAE.shown_rows)."""
        from ..features.activations import sae_rows

        return sae_rows(x, first, *others)

    def splice_fns(self, ctx: Any) -> dict[str, Any]:
        """{hook name: fn}: keep this layer's input when it fires; at its output, encode, decode every earlier
        layer's writes there, and put the error term back (features.splice's rules, over the shared record)."""
        from ..features.splice import sub_hook_names

        clt, layer = self.clt, self.layer
        rec = _shared(clt, ctx)
        names = sub_hook_names(self)
        # Edits of these change this layer's activations, so the error term needs the unedited ones.
        before_acts = [names[n] for n in ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post")]

        def keep_input(x: torch.Tensor, name: str) -> None:
            rec.arrive(layer, x)

        keep_input.clt_forward = rec  # type: ignore[attr-defined]  # how later units find the record

        def splice(x_out: torch.Tensor, name: str) -> torch.Tensor:
            error_term = clt.use_error_term
            if layer not in rec.inputs:
                raise CLTError(f"the CLT's layer {layer} wrote {name!r} before its input {self.hook_name!r} fired")
            if error_term and not rec.looked_at(ctx):
                return x_out  # nobody reads or edits the CLT's hooks: with error terms every output is x_out
            if x_out.device != clt.W_enc.device:
                raise CLTError(f"the CLT is on {clt.W_enc.device}, the model's activations on {x_out.device}: move "
                               f"it with clt.to(model.device)")
            missing = [L for L in range(layer) if L not in rec.acts]
            if missing and not error_term:
                raise CLTError(
                    f"this forward did not run the CLT's layers {missing} before layer {layer}, whose output without "
                    f"error terms is the sum of theirs: splice every layer (saes=clt) and run from the first")
            clean_in = clt._input(rec.inputs[layer])
            sae_in = ctx.fire(names["hook_sae_input"], clean_in)
            pre = ctx.fire(names["hook_sae_acts_pre"], clt.encode_pre(layer, sae_in))
            acts = ctx.fire(names["hook_sae_acts_post"], clt.activate(layer, pre))
            here = any(ctx.edits(n) for n in before_acts)
            rec.acts[layer] = acts
            rec.clean[layer] = clt.activate(layer, clt.encode_pre(layer, clean_in)) if here else acts
            rec.edited = rec.edited or here
            recons = ctx.fire(names["hook_sae_recons"], clt.decode_into(layer, rec.acts) + clt.skip(layer, sae_in))
            # (with layers missing, those left out write the same into recons and its clean value: their difference,
            # which is all the error term adds, is exact)
            if error_term and torch.is_grad_enabled():
                with torch.no_grad():  # a gradient flows through the CLT, the error term a constant (SAELens's rule)
                    error = x_out.to(clt.dtype) - (clt.decode_into(layer, rec.clean) + clt.skip(layer, clean_in))
                out = (recons + ctx.fire(names["hook_sae_error"], error)).to(x_out.dtype)
            elif error_term:
                edited = rec.edited or ctx.edits(names["hook_sae_recons"])
                clean = clt.decode_into(layer, rec.clean) + clt.skip(layer, clean_in) if edited else recons
                error = x_out.to(clt.dtype) - clean
                hooked = ctx.fire(names["hook_sae_error"], error)
                if hooked is not error:  # an edited error term: output = recons + that error
                    out = (recons + hooked).to(x_out.dtype)
                elif edited:  # x_out + (recons - clean) == recons + error, and exactly x_out when nothing changed
                    out = x_out + (recons - clean).to(x_out.dtype)
                else:
                    out = x_out
            else:
                out = recons.to(x_out.dtype)
            return ctx.fire(names["hook_sae_output"], out)

        return {self.hook_name: keep_input, self.hook_name_out: splice}
