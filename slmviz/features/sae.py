"""The SAE object: sparse autoencoders and transcoders with SAELens's formulas, parameter names and file format.

An SAE reads one hook and reconstructs it; a transcoder reads one hook (the MLP's input, `blocks.L.mlp.hook_in`)
and predicts another (`blocks.L.hook_mlp_out`). Formulas (SAELens 6.x; docs/features.md):

    x' = x - b_dec if apply_b_dec_to_input else x
    h  = x' @ W_enc + b_enc                                   # hook_sae_acts_pre
    relu:     f = relu(h)
    topk:     f = relu(topk_k(h)), every other entry 0
    jumprelu: f = relu(h) * 1[h > threshold]                  # hook_sae_acts_post
    x_hat = f @ W_dec + b_dec (+ x @ W_skip.T for a skip / affine transcoder)

Shapes: W_enc [d_in, d_sae], b_enc [d_sae], W_dec [d_sae, d_out], b_dec [d_out], threshold [d_sae],
W_skip [d_out, d_in] (SAELens's orientation; Gemma Scope 2's `affine_skip_connection` is its transpose).

Files: `save(folder)` writes SAELens 6's `cfg.json` + `sae_weights.safetensors` (formats.saelens), which
`sae_lens.SAE.load_from_disk` reads (bench/peers/sae_lens_roundtrip.py checks it); `load(folder)` reads them back. Other
layouts (Gemma Scope 2, circuit-tracer's sets) are read by their format modules into the same plain data, a `spec`
(the settings: SAE.spec) and SAELens-named tensors, from which `from_state` builds the SAE: it never knows which file
it came from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..errors import SAEError, check_feature, check_k
from ..formats import saelens
from ..formats.saelens import canonical_architecture
from ..hooks import hook_shape, layer_of


def _topk(h: torch.Tensor, k: int) -> torch.Tensor:
    """relu of the k largest entries of each row, every other entry 0 (SAELens's TopK: topk first, then relu)."""
    values, indices = torch.topk(h, k=k, dim=-1, sorted=False)
    return torch.zeros_like(h).scatter_(-1, indices, values.relu())


def weight_size(weight: str, dim: int, doc: str | None = None) -> property:
    """A read-only size read off dimension `dim` of the parameter named `weight` (SAE.d_in is W_enc's dim 0).

    A coder stores no size beside its weights, so a size can never disagree with the tensors it describes."""
    return property(lambda self: getattr(self, weight).shape[dim], doc=doc)


class SAE(torch.nn.Module):
    """A sparse autoencoder or transcoder: `encode` x [..., d_in] -> f [..., d_sae], `decode` f -> x_hat [..., d_out].

    Parameters carry SAELens's names and shapes, so a state dict moves to and from SAELens key for key.
    `hook_name` is the slmviz hook it reads and `hook_name_out` the one it writes (equal for an SAE).
    Computation runs in the SAE's dtype (the input is cast to it) and results come back in the input's dtype.

    Conventions that fail silently when changed:
    - W_dec is [d_sae, d_out] and x_hat = f @ W_dec (SAELens's orientation). A file holding its transpose is
      refused by from_state's shape check, which names both shapes (nothing could tell if d_sae == d_out).
    - topk keeps the k largest *pre-activations* and then applies relu (SAELens); relu-then-topk picks the same
      set except on ties at 0, but topk of |h| would keep negative ones.
    - jumprelu is relu(h) * 1[h > threshold] with a strict `>`: `>=` turns on every feature whose threshold is 0.
    - b_dec is subtracted from the input only when `apply_b_dec_to_input` (SAELens's default True for SAEs it trains;
      Gemma Scope 2 and transcoders False). Getting it wrong shifts every pre-activation by b_dec @ W_enc.
    """

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        d_out: int | None = None,
        architecture: str = "relu",
        k: int | None = None,
        hook_name: str = "",
        hook_name_out: str | None = None,
        apply_b_dec_to_input: bool = False,
        skip: bool = False,
        rescale_acts_by_decoder_norm: bool = False,
        reshape_activations: str = "none",
        dtype: torch.dtype = torch.float32,
        metadata: dict[str, Any] | None = None,
    ):
        super().__init__()
        d_out = d_in if d_out is None else d_out
        arch, arch_skip = canonical_architecture(architecture)
        skip = skip or arch_skip
        for what, n in (("d_in", d_in), ("d_sae", d_sae), ("d_out", d_out)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise SAEError(f"{what} must be a positive integer, got {n!r}")
        if arch == "topk":
            if k is None or not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise SAEError(f"a topk SAE needs k, a positive integer (at most d_sae={d_sae}); got k={k!r}")
            if k > d_sae:
                raise SAEError(f"k={k} is larger than d_sae={d_sae}: a topk SAE keeps k of its d_sae features")
        elif k is not None and arch != "jumprelu":  # a BatchTopK SAE saved as jumprelu may remember its k
            raise SAEError(f"k is only for a topk SAE, not {arch!r}")
        if apply_b_dec_to_input and d_in != d_out:
            raise SAEError(
                f"apply_b_dec_to_input needs d_in == d_out (b_dec is subtracted from the input); got d_in={d_in}, "
                f"d_out={d_out} (a transcoder: set apply_b_dec_to_input=False, as SAELens requires)"
            )
        if reshape_activations not in ("none", "hook_z"):
            raise SAEError(f"reshape_activations must be 'none' or 'hook_z', got {reshape_activations!r}")
        self.architecture = arch
        self.k = k
        self.hook_name = hook_name
        self.hook_name_out = hook_name if hook_name_out is None else hook_name_out
        self.apply_b_dec_to_input = bool(apply_b_dec_to_input)
        self.rescale_acts_by_decoder_norm = bool(rescale_acts_by_decoder_norm)
        self.reshape_activations = reshape_activations
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.model = None  # set by load_sae(model=...): logit_effects reads its unembedding
        # Spliced into a forward (saes=[...]): add the error term back, so outputs equal the model's (features.splice).
        self.use_error_term = True
        p = torch.nn.Parameter
        self.W_enc = p(torch.zeros(d_in, d_sae, dtype=dtype))
        self.b_enc = p(torch.zeros(d_sae, dtype=dtype))
        self.W_dec = p(torch.zeros(d_sae, d_out, dtype=dtype))
        self.b_dec = p(torch.zeros(d_out, dtype=dtype))
        self.threshold = p(torch.zeros(d_sae, dtype=dtype)) if arch == "jumprelu" else None
        self.W_skip = p(torch.zeros(d_out, d_in, dtype=dtype)) if skip else None

    # ---- sizes -------------------------------------------------------------------------------------------------
    d_in = weight_size("W_enc", 0, "Width of the hook it reads.")
    d_sae = weight_size("W_enc", 1, "Number of features.")
    d_out = weight_size("W_dec", 1, "Width of the hook it writes (equal to d_in for an SAE).")

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def is_transcoder(self) -> bool:
        return self.hook_name != self.hook_name_out or self.d_in != self.d_out or self.W_skip is not None

    def __repr__(self) -> str:
        kind = "transcoder" if self.is_transcoder else "SAE"
        k = f", k={self.k}" if self.architecture == "topk" else ""
        hooks = self.hook_name if not self.is_transcoder else f"{self.hook_name} -> {self.hook_name_out}"
        return f"SAE({self.architecture} {kind}, {hooks}, d_in={self.d_in}, d_sae={self.d_sae}, d_out={self.d_out}{k})"

    def check_model(self, model: Any) -> None:
        """The SAE's hooks exist in this model's family and have its widths (d_in at hook_name, d_out at
        hook_name_out); else an SAEError saying which, and what the model has instead."""
        valid = model.hook_names
        family = getattr(model.cfg, "model_type", "this model")
        for what, name, width in (("reads", self.hook_name, self.d_in), ("writes", self.hook_name_out, self.d_out)):
            if name not in valid:
                local = name.split(".", 2)[-1]
                layers = sorted({layer_of(n) for n in valid if n.endswith("." + local)})
                hint = (f"; this model has {local} at layers 0..{layers[-1]}" if layers
                        else f"; {family} models have no '{local}' hook (see model.hook_names)")
                raise SAEError(f"{self!r} {what} {name!r}, which {model.name!r} ({family}) does not have{hint}")
            shape = hook_shape(name, model.cfg, 1)[1:]
            have = math.prod(shape)
            if have != width:
                dims = "x".join(map(str, shape))
                raise SAEError(
                    f"{self!r} {what} {width} values per token at {name!r}, but that hook is {dims} = {have} wide "
                    f"on {model.name!r} ({family}, d_model={model.cfg.d_model}); this SAE was made for another model"
                )

    # ---- the formulas ------------------------------------------------------------------------------------------
    def _flat_input(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d_in] (or [..., h, d_head] for a hook_z SAE, flattened like SAELens's reshape_fn_in)."""
        if x.is_inference() and torch.is_grad_enabled() and self.W_enc.requires_grad:
            x = x.clone()  # a trace's tensors come from inference mode; autograd may not record them otherwise
        hook_z = self.reshape_activations == "hook_z" and x.dim() >= 2
        if x.shape[-1] != self.d_in and hook_z and x.shape[-2] * x.shape[-1] == self.d_in:
            x = x.flatten(-2)  # [..., h, d_head] -> [..., h*d_head]
        if x.shape[-1] != self.d_in:
            raise SAEError(f"input's last dimension is {x.shape[-1]}, this SAE reads d_in={self.d_in}")
        return x

    def encode_pre(self, x: torch.Tensor) -> torch.Tensor:
        """h = x' @ W_enc + b_enc, with x' = x - b_dec when apply_b_dec_to_input: [..., d_in] -> [..., d_sae]."""
        x = self._flat_input(x).to(self.dtype)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc  # [..., d_in] -> [..., d_sae]

    def activate(self, h: torch.Tensor) -> torch.Tensor:
        """The architecture's activation on pre-activations h [..., d_sae] (in the SAE's dtype)."""
        if self.architecture == "relu":
            return h.relu()
        if self.architecture == "topk":
            if self.rescale_acts_by_decoder_norm:  # SAELens: select on h * |W_dec[f]|, decode divides it back out
                h = h * self.W_dec.norm(dim=-1)
            return _topk(h, self.k)
        return h.relu() * (h > self.threshold).to(h.dtype)  # strict '>', as SAELens and Gemma Scope

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations f [..., d_sae] of x [..., d_in], in x's dtype."""
        return self.activate(self.encode_pre(x)).to(x.dtype)

    def decode(self, f: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """x_hat = f @ W_dec + b_dec [..., d_out] (+ x @ W_skip.T when this is a skip transcoder and x is given)."""
        g = f.to(self.dtype)
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            g = g / self.W_dec.norm(dim=-1)
        out = g @ self.W_dec + self.b_dec  # [..., d_sae] -> [..., d_out]
        if self.W_skip is not None and x is not None:
            out = out + self._flat_input(x).to(self.dtype) @ self.W_skip.T  # [..., d_in] -> [..., d_out]
        return out.to(f.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The reconstruction x_hat [..., d_out] of x (with the skip connection, if any)."""
        return self.decode(self.encode(x), x)

    # ---- splicing (hooks.build_context calls these; see features.splice) -------------------------------------------
    def splice_fns(self, ctx: Any) -> dict[str, Any]:
        """{hook name: fn} splicing this SAE into a forward run with hook context `ctx`."""
        from .splice import splice_fns

        return splice_fns(self, ctx)

    def shown_rows(self, x: torch.Tensor, first: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        """Which rows of one batch this SAE's features count on: bool [n] (activations.sae_rows, the rule training
        and evaluate_sae use). x [n, d_in] is the SAE's input, `others` its target for a transcoder, `first` [n]
        True at each window's first position. slmviz.scan calls it (duck-typed: scans may not import features)
        and zeroes hook_sae_acts_post on the dropped rows; without it every feature's top contexts would be the
        attention sink's massive first rows, and its density would count them."""
        from .activations import sae_rows

        return sae_rows(x, first, *others)

    def splice_dims(self) -> dict[str, tuple[str, ...]]:
        """SAELens's hook names under `hook_name_out` -> their dims (d_sae_in, d_sae, d_sae_out: `splice_sizes`)."""
        from .splice import splice_dims

        return splice_dims(self)

    def splice_sizes(self) -> dict[str, int]:
        from .splice import splice_sizes

        return splice_sizes(self)

    # ---- what a feature writes ---------------------------------------------------------------------------------
    def decoder_rows(self) -> dict[str, torch.Tensor]:
        """{hook written: [d_sae, d_out]}: d output / d feature at every hook the features write (one for an SAE;
        a CLT layer's features write several, CLTLayer.decoder_rows)."""
        return {self.hook_name_out: self.W_dec}

    def residual_direction(self, feature: int, model: Any = None) -> torch.Tensor:
        """[d_model]: what feature f writes into the residual stream (W_dec[f]; through W_O for an attn.hook_z SAE)."""
        f = check_feature(self, feature)
        row = self.W_dec[f].detach().float()
        model = model if model is not None else self.model
        if self.hook_name_out.endswith("attn.hook_z"):
            if model is None:
                raise SAEError("an attn.hook_z SAE's residual direction needs the model's W_O: pass model=")
            layer = layer_of(self.hook_name_out)
            w_o = model.decoder.params.layers[layer].w_o
            return w_o.float() @ row.to(w_o.device)  # [d_model, h*d_head] @ [h*d_head]
        if model is not None and row.numel() != model.cfg.d_model:
            raise SAEError(f"{self!r} writes {self.hook_name_out!r}, which is not the residual stream's width "
                           f"({model.cfg.d_model}); logit effects need a residual-width (or attn.hook_z) SAE")
        return row

    def logit_effects(self, feature: int, k: int = 10, model: Any = None) -> pd.DataFrame:
        """The k tokens W_dec[f] @ W_U promotes most and the k it suppresses most (a dashboard's logit effects).

        W_U is the unembedding with the final norm's weight folded in (TransformerLens's fold_ln, so the numbers
        match Neuronpedia's); the final norm's division by the RMS is left out, as there. Needs the model: pass
        model=, or load the SAE with load_sae(..., model=m). Columns: kind ("promoted" | "suppressed"), rank,
        token_id, token, effect."""
        model = model if model is not None else self.model
        if model is None:
            raise SAEError("logit_effects needs the model: pass model=, or load the SAE with load_sae(..., model=m)")
        k = check_k(k)
        from ..variants import resolve_variant

        direction = self.residual_direction(feature, model)
        decoder = model.decoder
        factor = decoder.final_norm_factor(decoder.conventions(resolve_variant(None, model.cfg))).float()
        unembed = decoder.params.unembed
        effects = (unembed.float() @ (direction.to(unembed.device) * factor)).cpu()  # [vocab, d_model] @ [d_model]
        k = min(k, effects.numel())
        rows = []
        for kind, ids in (("promoted", effects.topk(k).indices), ("suppressed", (-effects).topk(k).indices)):
            for rank, (tid, tok) in enumerate(zip(ids.tolist(), model.to_strings(ids.tolist()), strict=True)):
                rows.append((kind, rank, tid, tok, float(effects[tid])))
        return pd.DataFrame(rows, columns=["kind", "rank", "token_id", "token", "effect"])

    def nearest(self, feature: int, k: int = 10) -> pd.DataFrame:
        """The k other features whose decoder rows have the largest cosine with W_dec[f]: rank, feature, cosine."""
        f = check_feature(self, feature)
        k = min(check_k(k), self.d_sae - 1)
        w = self.W_dec.detach().float()
        unit = w / w.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        cos = unit @ unit[f]  # [d_sae]
        cos[f] = -math.inf
        values, ids = cos.topk(k)
        return pd.DataFrame({"rank": range(k), "feature": ids.tolist(), "cosine": values.tolist()})

    @property
    def labels(self) -> dict[int, str]:
        """Edited labels {feature: text}: set one and `label` returns it instead of the automatic one."""
        return self.__dict__.setdefault("_labels", {})

    def label(self, feature: int, scan: Any = None, model: Any = None) -> str:
        """The feature's label: the edited one if set (`labels`), else an automatic one from the tokens it fires
        on in `scan` and the tokens it promotes, starting "[auto] " (features.labels; AttributionGraph.labels
        gives its feature nodes the same ones)."""
        from .labels import auto_labels

        f = check_feature(self, feature)
        if self.labels.get(f):
            return self.labels[f]
        return auto_labels(self, [f], model=model, scan=scan)[f]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a Ray scan's spec) without the model it was loaded for."""
        state = self.__dict__.copy()
        state["model"] = None
        return state

    # ---- state: what a file format reads and writes -------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """SAELens's safetensors keys -> tensors (threshold only for jumprelu, W_skip only for skip transcoders)."""
        out = {"W_enc": self.W_enc, "b_enc": self.b_enc, "W_dec": self.W_dec, "b_dec": self.b_dec}
        if self.threshold is not None:
            out["threshold"] = self.threshold
        if self.W_skip is not None:
            out["W_skip"] = self.W_skip
        return {k: v.detach() for k, v in out.items()}

    def spec(self) -> dict[str, Any]:
        """The settings beside the tensors: the constructor's arguments other than the sizes (which the tensors'
        shapes give), so `SAE.from_state(sae.tensors(), **sae.spec())` is the same SAE. What formats write."""
        return {"architecture": self.architecture, "k": self.k, "skip": self.W_skip is not None,
                "hook_name": self.hook_name, "hook_name_out": self.hook_name_out,
                "apply_b_dec_to_input": self.apply_b_dec_to_input,
                "rescale_acts_by_decoder_norm": self.rescale_acts_by_decoder_norm,
                "reshape_activations": self.reshape_activations, "dtype": self.dtype, "metadata": dict(self.metadata)}

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor], architecture: str = "relu", copy: bool = True,
                   **kwargs: Any) -> SAE:
        """An SAE from SAELens-named tensors; shapes and finiteness are checked and each problem named.

        `kwargs` are the constructor's (k, hook_name, hook_name_out, apply_b_dec_to_input, metadata, ...: SAE.spec);
        d_in, d_sae and d_out come from W_enc and W_dec, the dtype from W_enc unless dtype= is given. Other tensors
        in `state` are ignored. `copy=False` makes the tensors the SAE's parameters (converted only where the dtype
        differs): for a loader's freshly read tensors, which nothing else holds; the default copies."""
        arch, arch_skip = canonical_architecture(architecture)
        need = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if arch == "jumprelu" else [])
        if arch_skip or kwargs.get("skip"):
            need.append("W_skip")
        missing = [n for n in need if n not in state]
        if missing:
            raise SAEError(f"missing tensors {missing} for a {architecture} SAE (found {sorted(state)})")
        for n, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise SAEError(f"tensor {n!r} is a {type(t).__name__}, not a torch.Tensor")
        w_enc, w_dec = state["W_enc"], state["W_dec"]
        if w_enc.dim() != 2 or w_dec.dim() != 2:
            raise SAEError(
                "W_enc must be [d_in, d_sae] and W_dec [d_sae, d_out]; "
                f"got {tuple(w_enc.shape)} and {tuple(w_dec.shape)}"
            )
        d_in, d_sae = w_enc.shape
        d_out = w_dec.shape[1]
        expected = {
            "W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_out), "b_dec": (d_out,),
            "threshold": (d_sae,), "W_skip": (d_out, d_in),
        }
        for n in need:
            if tuple(state[n].shape) != expected[n]:
                raise SAEError(
                    f"tensor {n!r} has shape {tuple(state[n].shape)}, expected {expected[n]} "
                    f"(W_enc is [d_in, d_sae] = {tuple(w_enc.shape)}, W_dec [d_sae, d_out] = {tuple(w_dec.shape)})"
                )
            if not state[n].is_floating_point():
                raise SAEError(f"tensor {n!r} has dtype {state[n].dtype}; SAE weights are floating point")
            if not torch.isfinite(state[n]).all():
                bad = int((~torch.isfinite(state[n])).sum())
                raise SAEError(f"tensor {n!r} holds {bad} non-finite values (nan or inf)")
        dtype = kwargs.pop("dtype", None) or w_enc.dtype
        with torch.device("meta"):  # no weights allocated: the state's tensors become them
            sae = cls(int(d_in), int(d_sae), int(d_out), architecture=architecture, dtype=dtype, **kwargs)
        sae.load_state_dict({n: state[n].to(dtype, copy=copy).contiguous() for n in sae.tensors()}, assign=True)
        return sae

    def save(self, folder: str | Path) -> Path:
        """Write SAELens's format: folder/cfg.json + folder/sae_weights.safetensors (formats.saelens). Returns the
        folder."""
        return saelens.write_sae(folder, self.spec(), self.tensors())

    @classmethod
    def load(cls, folder: str | Path) -> SAE:
        """Read a SAELens folder (cfg.json + sae_weights.safetensors) written by `save` or by SAELens."""
        spec, tensors, _ = saelens.read_sae(folder)
        return cls.from_state(tensors, copy=False, **spec)

    # ---- random initialisation (tests, benchmarks, training's starting point) ------------------------------------
    @classmethod
    def random(cls, d_in: int, d_sae: int, seed: int = 0, scale: float = 1.0, **kwargs: Any) -> SAE:
        """An SAE with random weights (W_dec rows of norm `scale`, W_enc ~ N(0, 1/d_in), small random biases)."""
        sae = cls(d_in, d_sae, **kwargs)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w = torch.randn(sae.d_sae, sae.d_out, generator=g)
            sae.W_dec.copy_(w / w.norm(dim=-1, keepdim=True) * scale)
            sae.W_enc.copy_(torch.randn(sae.d_in, sae.d_sae, generator=g) / math.sqrt(sae.d_in))
            sae.b_enc.copy_(0.1 * torch.randn(sae.d_sae, generator=g))
            sae.b_dec.copy_(0.1 * torch.randn(sae.d_out, generator=g))
            if sae.threshold is not None:
                sae.threshold.copy_(0.1 * torch.rand(sae.d_sae, generator=g))
            if sae.W_skip is not None:
                sae.W_skip.copy_(torch.randn(sae.d_out, sae.d_in, generator=g) / math.sqrt(sae.d_in))
        return sae
