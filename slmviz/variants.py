"""The "break it" lab: a Variant is data the decoder reads, one field per silent convention.

Every field's faithful value is what LLaMA-style checkpoints were trained with. Changing one field
still runs and still produces fluent-looking numbers; only the output quality tells you something is
wrong. Each behaviour lives in a small table next to its convention in `slmviz.model` (e.g.
`ROTATIONS[variant.rope]`), so the model never branches on a variant's name.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

NORM_PLACEMENTS = ("pre", "output", "sandwich", "post", "none")
NORM_TYPES = ("rms", "layer")
ROPE_PAIRINGS = ("rotate_half", "interleaved", "none")
GQA_MAPPINGS = ("grouped", "tile")
MLP_TYPES = ("swiglu", "standard")
QK_NORM_ORDERS = ("before_rope", "after_rope")
GELU_FORMS = ("tanh", "exact")

# Fields whose None means "the checkpoint's own" accept these strings too.
_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": NORM_PLACEMENTS,
    "norm_type": NORM_TYPES,
    "rope": ROPE_PAIRINGS,
    "gqa": GQA_MAPPINGS,
    "mlp": MLP_TYPES,
    "qk_norm_order": QK_NORM_ORDERS,
    "gelu": GELU_FORMS,
}
_NONE_MEANS_OWN = ("norm", "norm_type", "qk_norm_order", "gelu")
_BOOLEANS = ("causal", "kv_position_bug", "rope_local_as_global")
_OPTIONAL_BOOLEANS = ("norm_offset", "embed_scale", "qk_norm", "sliding_window", "pos_embed", "parallel_residual",
                      "partial_rotary", "softcap")


@dataclass(frozen=True)
class Variant:
    """Architecture conventions the decoder follows. `Variant()` is the faithful model of any family.

    A field left at None means "what this checkpoint does"; `resolve(variant, cfg)` turns a Variant into
    the concrete `Conventions` the decoder reads.

    norm:       None (the checkpoint's own) | "pre" x + F(N(x)) | "output" x + N(F(x)) |
                "sandwich" x + N_post(F(N(x))) (Gemma only: needs both norm weights) | "post" N(x + F(x)) |
                "none" (norms removed, final one too; QK-norm stays)
    norm_type:  None (the checkpoint's own) | "rms" | "layer" (mean-centred LayerNorm with the same weights
                and biases: RMSNorm on a LayerNorm family is `rms_for_layernorm`)
    norm_offset: None | False: norms multiply by w instead of (1 + w) (Gemma only)
    embed_scale: None | False: embeddings are not multiplied by sqrt(d_model) (Gemma only)
    qk_norm:    None | False: the QK-norm is skipped (Gemma, Qwen3, OLMo-2)
    qk_norm_order: None (before RoPE, as trained) | "after_rope" (QK-norm models only)
    rope:       "rotate_half" pairs (i, i+d/2) (faithful) | "interleaved" pairs (2i, 2i+1) | "none"
    rope_theta: None = the checkpoint's own base; a number overrides it (the global layers' base where a
                model has two)
    rope_local_as_global: False | True: sliding layers use the global layers' RoPE base (Gemma)
    gqa:        "grouped" query head i reads KV head i // (h/g) (faithful) | "tile" i % g
    causal:     True (faithful) | False: every position also sees the future
    sliding_window: None | False: sliding layers attend to the whole prefix (Gemma, Mistral)
    mlp:        "swiglu" down(act(gate)·up) (faithful) | "standard" down(act(up)), gate unused
    gelu:       None | "exact": erf GELU where the checkpoint uses the tanh approximation (Gemma)
    kv_position_bug: False (faithful) | True: cached decoding re-derives each layer's position
                from a cache length the earlier layers already advanced (prefill unaffected); with learned
                positions the decoding step's position embedding loses the cache offset
    pos_embed:  None | False: the learned position embedding is not added (GPT-2)
    parallel_residual: None | False: the MLP reads resid_mid instead of the block's input (GPT-NeoX)
    partial_rotary: None | False: RoPE turns every dim of each head, not the first rotary_dim (GPT-NeoX)
    softcap:    None | False: attention scores and final logits are not soft-capped (Gemma 2)
    """

    norm: str | None = None
    norm_type: str | None = None
    norm_offset: bool | None = None
    embed_scale: bool | None = None
    qk_norm: bool | None = None
    qk_norm_order: str | None = None
    rope: str = "rotate_half"
    rope_theta: float | None = None
    rope_local_as_global: bool = False
    gqa: str = "grouped"
    causal: bool = True
    sliding_window: bool | None = None
    mlp: str = "swiglu"
    gelu: str | None = None
    kv_position_bug: bool = False
    pos_embed: bool | None = None
    parallel_residual: bool | None = None
    partial_rotary: bool | None = None
    softcap: bool | None = None

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value is None and name in _NONE_MEANS_OWN:
                continue
            if value not in allowed:
                own = " (or None: the checkpoint's own)" if name in _NONE_MEANS_OWN else ""
                raise ValueError(f"Variant.{name}={value!r} is not valid; choose one of {list(allowed)}{own}")
        if self.rope_theta is not None and not (
            isinstance(self.rope_theta, int | float) and not isinstance(self.rope_theta, bool)
            and 1 < self.rope_theta < math.inf
        ):
            raise ValueError(f"Variant.rope_theta must be a finite number > 1 or None, got {self.rope_theta!r}")
        for name in _BOOLEANS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Variant.{name} must be True or False, got {getattr(self, name)!r}")
        for name in _OPTIONAL_BOOLEANS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"Variant.{name} must be None (the checkpoint's own), True or False, "
                                 f"got {getattr(self, name)!r}")

    def changes(self) -> dict[str, Any]:
        """The fields that differ from the faithful model."""
        return {k: v for k, v in asdict(self).items() if v != getattr(BASE, k)}

    @property
    def is_faithful(self) -> bool:
        return not self.changes()

    def label(self) -> str:
        """Short human name: the preset it equals, else its changed fields."""
        for name, preset in PRESETS.items():
            if preset.variant == self:
                return name
        return ", ".join(f"{k}={v}" for k, v in self.changes().items())


BASE = Variant()


@dataclass(frozen=True)
class Preset:
    variant: Variant
    description: str
    # A preset named for one family's convention applies only where the checkpoint has it, even when its
    # fields would run elsewhere (pre_norm_only is norm="pre", which also moves OLMo-2's norms).
    needs: Callable[[Any], bool] | None = None


def _row(changes: dict[str, Any], description: str, needs: Callable[[Any], bool] | None = None) -> Preset:
    """One row of the preset table: the faithful Variant with `changes`, and what that breaks."""
    return Preset(replace(BASE, **changes), description, needs)


PRESETS: dict[str, Preset] = {
    # name: _row({the Variant fields it changes}, what that breaks)
    "faithful": _row({}, "Nothing changed: must equal transformers on the same weights."),
    "post_norm": _row({"norm": "post"},
        "Norm after the residual add, x = N(x + F(x)), as in the 2017 Transformer; LLaMA-style weights were trained "
        "pre-norm, x + F(N(x)), and both orders run without error."),
    "no_norm": _row({"norm": "none"},
        "Every RMSNorm removed (final one too): the residual stream's massive activations reach the sub-layers "
        "unscaled; easy to get by forgetting to call the norm."),
    "layer_norm": _row({"norm_type": "layer"},
        "Mean-centred LayerNorm instead of RMSNorm with the same weights: the two share a signature and differ only "
        "by subtracting the mean."),
    "rope_interleaved": _row({"rope": "interleaved"},
        "RoPE rotates pairs (2i, 2i+1) as in GPT-J / Meta's original code instead of HF's rotate_half pairs "
        "(i, i+d/2); which one a checkpoint needs depends on how its q/k rows were permuted."),
    "no_rope": _row({"rope": "none"},
        "No rotary embedding: attention loses all position information except the causal mask."),
    "rope_theta_10k": _row({"rope_theta": 10_000.0},
        "RoPE base 10 000 (the LLaMA-1 default) instead of the checkpoint's own (100 000 for SmolLM2): a hard-coded "
        "default that silently overrides the config."),
    "gqa_tile": _row({"gqa": "tile"},
        "Query head i reads KV head i % g instead of i // (h/g): both index a valid KV head, so nothing crashes, but "
        "every GQA checkpoint's head groups are scrambled."),
    "no_causal_mask": _row({"causal": False},
        "Causal mask dropped: every position attends to the future, as in an encoder. The last query already sees "
        "every key, yet it changes too, because the keys it reads were built from the future."),
    "standard_ffn": _row({"mlp": "standard"},
        "Plain FFN down(silu(up(x))) on the trained weights, the SwiGLU gate path removed: shows what the gate "
        "contributes."),
    "kv_position_bug": _row({"kv_position_bug": True},
        "During cached decoding each layer re-derives the new token's position from a shared cache length that "
        "earlier layers already advanced, so layer L uses position p+L (with learned positions, GPT-2: the new token "
        "is embedded at position 0, the cache offset lost). Prefill is unaffected: only generated tokens change."),
    # Family conventions: each applies only where the checkpoint has the convention it removes.
    "no_norm_offset": _row({"norm_offset": False},
        "Gemma stores each norm weight as w and multiplies by (1 + w); a port that reads it like a LLaMA weight "
        "multiplies by w, which is near 0, and squashes every normalised value."),
    "no_embed_scale": _row({"embed_scale": False},
        "Gemma multiplies its embeddings by sqrt(d_model) (about 25 for the 270M model) before the first block; the "
        "scale is not stored in the checkpoint, so a port that forgets it feeds tiny inputs."),
    "no_qk_norm": _row({"qk_norm": False},
        "The RMSNorm on queries and keys (Gemma, Qwen3: per head; OLMo-2: over the whole projection) is skipped; the "
        "weights exist, but nothing errors when they are never read."),
    "qk_norm_after_rope": _row({"qk_norm_order": "after_rope"},
        "QK-norm applied after the rotary embedding instead of before it: a per-head RMSNorm does not commute with "
        "RoPE once its weight is not uniform, so every score moves a little."),
    "rope_local_as_global": _row({"rope_local_as_global": True},
        "Gemma's sliding-window layers rotate with a local base (10 000) and its global layers with 1 000 000; here "
        "every layer uses the global base, as if the config had one rope_theta."),
    "pre_norm_only": _row({"norm": "pre"},
        "Gemma wraps each sub-layer in two norms, before and after; this keeps only the one before "
        "(the LLaMA block), so each sub-layer's output reaches the residual stream unnormalised.",
        needs=lambda cfg: cfg.norm_placement == "sandwich"),
    "gelu_exact": _row({"gelu": "exact"},
        "The exact (erf) GELU instead of the tanh approximation Gemma was trained with: the two differ by at most "
        "about 1e-3, a change that is easy to miss and still moves the logits."),
    "no_sliding_window": _row({"sliding_window": False},
        "Sliding-window layers attend to the whole prefix instead of the last W tokens. Identical on prompts shorter "
        "than the window (512 tokens for Gemma 3 270M); only longer prompts show it."),
    # GPT-2, GPT-NeoX (Pythia) and Gemma 2 (docs/variants.md, the field's families).
    "rms_for_layernorm": _row({"norm_type": "rms"},
        "RMSNorm where the checkpoint was trained with LayerNorm (GPT-2, Pythia): the mean is not subtracted, with "
        "the same weights and biases, so every normalised value shifts by the mean over its row.",
        needs=lambda cfg: cfg.norm_type == "layer"),
    "no_pos_embed": _row({"pos_embed": False},
        "GPT-2's learned position embedding is never added to the token embedding: attention keeps only the causal "
        "mask to tell positions apart."),
    "sequential_residual": _row({"parallel_residual": False},
        "Pythia runs attention and MLP side by side on the block's input, x + attn(ln1(x)) + mlp(ln2(x)); this "
        "feeds the MLP the residual after attention (the GPT-2 order), which the weights were not trained for."),
    "rotary_full": _row({"partial_rotary": False},
        "Pythia rotates only the first quarter of each head's dims (rotary_pct 0.25); this rotates all of them, with "
        "frequencies spread over the whole head, as a port that ignores rotary_pct does."),
    "no_softcap": _row({"softcap": False},
        "Gemma 2 squashes attention scores into ±50 and the final logits into ±30 with cap · tanh(x / cap); without "
        "it large scores and logits pass unbounded (what an SDPA or flash kernel without soft-capping computes)."),
}
"""Preset name -> Preset (its Variant and a one-line description of what it breaks), `faithful` first.

`slmviz.variants(model)` lists those that apply to a model; a preset that needs a convention the model lacks
is a VariantError naming the ones that do."""

VariantLike = str | Variant | dict[str, Any] | None


class VariantError(ValueError):
    """A variant asks for a convention the loaded model does not have (e.g. no_norm_offset on SmolLM2)."""


@dataclass(frozen=True)
class Conventions:
    """A Variant resolved against one checkpoint: every value concrete. The decoder reads only this.

    norm_offset: the norms multiply by (norm_offset + w). embed_scale: whether embeddings are multiplied
    by sqrt(d_model). qk_norm: "none" | "head" | "projection". rope_local_theta: the base of sliding
    layers. sliding_window: the window of sliding layers (None = they attend to the whole prefix).
    act: the MLP activation's name in slmviz.model.mlp.ACTIVATIONS.
    """

    norm: str
    norm_type: str
    norm_offset: float
    norm_weight_in_fp32: bool
    embed_scale: bool
    qk_norm: str
    qk_norm_after_rope: bool
    rope: str
    rope_theta: float
    rope_local_theta: float
    gqa: str
    causal: bool
    sliding_window: int | None
    mlp: str
    act: str
    kv_position_bug: bool
    positions: str = "rotary"
    rotary_dims: int = 0
    parallel_residual: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    norm_bias: bool = False


# Field → (does this checkpoint have the convention the field changes?, what it needs). A field set to
# anything but None on a model without the convention is a VariantError, never a silent no-op.
_NEEDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "norm_offset": (lambda cfg: cfg.norm_offset != 0, "norms that multiply by (1 + w) (Gemma)"),
    "embed_scale": (lambda cfg: cfg.embed_scale, "embeddings scaled by sqrt(d_model) (Gemma)"),
    "qk_norm": (lambda cfg: cfg.qk_norm != "none", "a QK-norm (Gemma, Qwen3, OLMo-2)"),
    "qk_norm_order": (lambda cfg: cfg.qk_norm != "none", "a QK-norm (Gemma, Qwen3, OLMo-2)"),
    "rope_local_as_global": (lambda cfg: cfg.rope_local_theta is not None,
                             "sliding layers with their own RoPE base (Gemma)"),
    "sliding_window": (lambda cfg: cfg.has_sliding_layers, "sliding-window layers (Gemma, Mistral)"),
    "gelu": (lambda cfg: cfg.act.startswith("gelu"), "a GELU MLP (Gemma)"),
    "mlp": (lambda cfg: cfg.gated_mlp, "a gated MLP (LLaMA, Qwen, Gemma)"),
    "rope": (lambda cfg: cfg.positions == "rotary", "rotary positions (every family but GPT-2)"),
    "rope_theta": (lambda cfg: cfg.positions == "rotary", "rotary positions (every family but GPT-2)"),
    "pos_embed": (lambda cfg: cfg.positions == "learned", "learned absolute positions (GPT-2)"),
    "parallel_residual": (lambda cfg: cfg.parallel_residual, "a parallel residual (GPT-NeoX)"),
    "partial_rotary": (lambda cfg: cfg.rotary_dim is not None, "partial rotary (GPT-NeoX)"),
    "softcap": (lambda cfg: cfg.attn_softcap is not None or cfg.final_logit_softcap is not None,
                "soft-capped attention scores or logits (Gemma 2)"),
}
_GELU = {("gelu_pytorch_tanh", "exact"): "gelu", ("gelu_new", "exact"): "gelu", ("gelu", "tanh"): "gelu_pytorch_tanh"}


def resolve(variant: Variant, cfg: Any) -> Conventions:
    """The concrete conventions `variant` gives on a checkpoint with ArchConfig `cfg`.

    Raises VariantError when a field needs something the checkpoint lacks (naming the presets that
    do apply), e.g. norm="sandwich" on a model with one norm per sub-layer.
    """
    problem = _missing_convention(variant, cfg)
    if problem:
        raise VariantError(f"{problem}. {_applicable_hint(cfg)}")
    global_theta = float(variant.rope_theta or cfg.rope_theta)
    local_theta = global_theta if (variant.rope_local_as_global or cfg.rope_local_theta is None) \
        else float(cfg.rope_local_theta)
    capped = variant.softcap is not False
    return Conventions(
        norm=variant.norm or cfg.norm_placement,
        norm_type=variant.norm_type or cfg.norm_type,
        norm_offset=0.0 if variant.norm_offset is False else float(cfg.norm_offset),
        norm_weight_in_fp32=cfg.norm_weight_in_fp32,
        embed_scale=cfg.embed_scale and variant.embed_scale is not False,
        qk_norm="none" if variant.qk_norm is False else cfg.qk_norm,
        qk_norm_after_rope=variant.qk_norm_order == "after_rope",
        rope=variant.rope if cfg.positions == "rotary" else "none",
        rope_theta=global_theta,
        rope_local_theta=local_theta,
        # g == 1 (MQA) or g == h (MHA): tiling and grouping read the same KV head, so gqa_tile changes nothing.
        gqa=variant.gqa if 1 < cfg.n_kv_heads < cfg.n_heads else "grouped",
        causal=variant.causal,
        sliding_window=None if variant.sliding_window is False else cfg.sliding_window,
        mlp=variant.mlp if cfg.gated_mlp else "plain",
        act=_GELU.get((cfg.act, variant.gelu), cfg.act),
        kv_position_bug=variant.kv_position_bug,
        positions="none" if variant.pos_embed is False else cfg.positions,
        rotary_dims=cfg.d_head if variant.partial_rotary is False else cfg.rotary_dims,
        parallel_residual=cfg.parallel_residual and variant.parallel_residual is not False,
        attn_softcap=cfg.attn_softcap if capped else None,
        final_softcap=cfg.final_logit_softcap if capped else None,
        norm_bias=cfg.norm_bias,
    )


def _missing_convention(variant: Variant, cfg: Any) -> str | None:
    """Why `variant` cannot run on this checkpoint, or None if it can."""
    for name, (has, what) in _NEEDS.items():
        value = getattr(variant, name)
        if value != getattr(BASE, name) and not has(cfg):
            return f"Variant.{name}={value!r} needs {what}; {cfg.model_type} has none"
    if (variant.norm == "post" and cfg.parallel_residual and variant.parallel_residual is not False):
        return ("Variant.norm='post' normalises the sum x + F(x) of one sub-layer, and a parallel residual "
                f"({cfg.model_type}) adds both sub-layers at once; combine it with sequential_residual")
    if variant.norm == "sandwich" and not (cfg.has_pre_norms and cfg.has_post_norms):
        return (f"Variant.norm='sandwich' needs norm weights before and after each sub-layer (Gemma); "
                f"{cfg.model_type} has one per sub-layer")
    return None


def applies(name: str, cfg: Any) -> bool:
    """True if preset `name` changes something on this checkpoint (faithful always applies).

    A preset applies when its fields are valid here and its conventions differ from the faithful ones:
    rope_theta_10k on a model whose base is 10 000, or gqa_tile on an MQA model, change nothing.
    """
    preset = _preset(name)
    if preset.variant.is_faithful:
        return True
    if preset.needs is not None and not preset.needs(cfg):
        return False
    return _missing_convention(preset.variant, cfg) is None and resolve(preset.variant, cfg) != resolve(BASE, cfg)


def _applicable_hint(cfg: Any) -> str:
    names = [n for n in PRESETS if n != "faithful" and applies(n, cfg)]
    return f"Presets that apply to {cfg.model_type}: {', '.join(names)}"


def variants(model: Any = None) -> dict[str, Variant]:
    """Preset name → Variant: all of them, or those that apply to `model` (a Model or an ArchConfig).

    Descriptions: `describe(name)` or `PRESETS[name].description`.
    """
    cfg = getattr(model, "cfg", model)
    return {name: preset.variant for name, preset in PRESETS.items() if cfg is None or applies(name, cfg)}


def describe(name: str) -> str:
    """The one-line description of preset `name`: what it changes and what that breaks.

    An unknown name is a ValueError listing the presets (and the closest one, for a typo)."""
    return _preset(name).description


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"Unknown variant {name!r}{hint}; presets are: {', '.join(PRESETS)}")
    return PRESETS[name]


def resolve_variant(variant: VariantLike, cfg: Any = None) -> Variant:
    """Accept a preset name, a Variant, a dict of Variant fields, or None (faithful).

    With `cfg` (the loaded model's ArchConfig), a preset that does not apply to it, or fields it
    cannot honour, are a VariantError naming the presets that do apply.
    """
    if variant is None:
        return BASE
    if isinstance(variant, Variant):
        v = variant
    elif isinstance(variant, str):
        v = _preset(variant).variant
        if cfg is not None and not applies(variant, cfg):
            raise VariantError(f"The preset {variant!r} does not apply to {cfg.model_type}: "
                               f"{_why_not(variant, cfg)}. {_applicable_hint(cfg)}")
    elif isinstance(variant, dict):
        known = {f.name for f in fields(Variant)}
        unknown = set(variant) - known
        if unknown:
            raise ValueError(f"Unknown Variant field(s) {sorted(unknown)}; fields are: {sorted(known)}")
        v = Variant(**variant)
    else:
        raise TypeError(f"variant must be a preset name, a Variant or a dict, not {type(variant).__name__}")
    if cfg is not None:
        resolve(v, cfg)  # raises VariantError for fields this model cannot honour
    return v


def _why_not(name: str, cfg: Any) -> str:
    preset = _preset(name)
    if preset.needs is not None and not preset.needs(cfg):
        return f"it is about a convention {cfg.model_type} does not have"
    return _missing_convention(preset.variant, cfg) or "on this model it changes nothing"
