"""The "break it" lab: a Variant is data the decoder reads, one field per silent convention.

Every field's faithful value is what LLaMA-style checkpoints were trained with. Changing one field
still runs and still produces fluent-looking numbers; only the output quality tells you something is
wrong. Each behaviour lives in a small table next to its convention in `slmviz.model` (e.g.
`ROTATIONS[variant.rope]`), so the model never branches on a variant's name.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

NORM_PLACEMENTS = ("pre", "post", "none")
NORM_TYPES = ("rms", "layer")
ROPE_PAIRINGS = ("rotate_half", "interleaved", "none")
GQA_MAPPINGS = ("grouped", "tile")
MLP_TYPES = ("swiglu", "standard")

_CHOICES: dict[str, tuple[str, ...]] = {
    "norm": NORM_PLACEMENTS,
    "norm_type": NORM_TYPES,
    "rope": ROPE_PAIRINGS,
    "gqa": GQA_MAPPINGS,
    "mlp": MLP_TYPES,
}


@dataclass(frozen=True)
class Variant:
    """Architecture conventions the decoder follows. `Variant()` is the faithful model.

    norm:       "pre" x + F(N(x)) (faithful) | "post" N(x + F(x)) | "none" (norms removed)
    norm_type:  "rms" (faithful) | "layer" (mean-centred LayerNorm with the same weights, no bias)
    rope:       "rotate_half" pairs (i, i+d/2) (faithful) | "interleaved" pairs (2i, 2i+1) | "none"
    rope_theta: None = the checkpoint's own base; a number overrides it
    gqa:        "grouped" query head i reads KV head i // (h/g) (faithful) | "tile" i % g
    causal:     True (faithful) | False: every position also sees the future
    mlp:        "swiglu" down(silu(gate)·up) (faithful) | "standard" down(silu(up)), gate unused
    kv_position_bug: False (faithful) | True: cached decoding re-derives each layer's position
                from a cache length the earlier layers already advanced (prefill unaffected)
    """

    norm: str = "pre"
    norm_type: str = "rms"
    rope: str = "rotate_half"
    rope_theta: float | None = None
    gqa: str = "grouped"
    causal: bool = True
    mlp: str = "swiglu"
    kv_position_bug: bool = False

    def __post_init__(self) -> None:
        for name, allowed in _CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"Variant.{name}={value!r} is not valid; choose one of {list(allowed)}")
        if self.rope_theta is not None and not (
            isinstance(self.rope_theta, int | float) and not isinstance(self.rope_theta, bool)
            and 1 < self.rope_theta < math.inf
        ):
            raise ValueError(f"Variant.rope_theta must be a finite number > 1 or None, got {self.rope_theta!r}")
        for name in ("causal", "kv_position_bug"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Variant.{name} must be True or False, got {getattr(self, name)!r}")

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


PRESETS: dict[str, Preset] = {
    "faithful": Preset(BASE, "Nothing changed: must equal transformers on the same weights."),
    "post_norm": Preset(
        replace(BASE, norm="post"),
        "Norm after the residual add, x = N(x + F(x)), as in the 2017 Transformer; LLaMA-style "
        "weights were trained pre-norm, x + F(N(x)), and both orders run without error.",
    ),
    "no_norm": Preset(
        replace(BASE, norm="none"),
        "Every RMSNorm removed (final one too): the residual stream's massive activations reach "
        "the sub-layers unscaled; easy to get by forgetting to call the norm.",
    ),
    "layer_norm": Preset(
        replace(BASE, norm_type="layer"),
        "Mean-centred LayerNorm instead of RMSNorm with the same weights: the two share a "
        "signature and differ only by subtracting the mean.",
    ),
    "rope_interleaved": Preset(
        replace(BASE, rope="interleaved"),
        "RoPE rotates pairs (2i, 2i+1) as in GPT-J / Meta's original code instead of HF's "
        "rotate_half pairs (i, i+d/2); which one a checkpoint needs depends on how its q/k rows were permuted.",
    ),
    "no_rope": Preset(
        replace(BASE, rope="none"),
        "No rotary embedding: attention loses all position information except the causal mask.",
    ),
    "rope_theta_10k": Preset(
        replace(BASE, rope_theta=10_000.0),
        "RoPE base 10 000 (the LLaMA-1 default) instead of the checkpoint's own (100 000 for "
        "SmolLM2): a hard-coded default that silently overrides the config.",
    ),
    "gqa_tile": Preset(
        replace(BASE, gqa="tile"),
        "Query head i reads KV head i % g instead of i // (h/g): both index a valid KV head, "
        "so nothing crashes, but every GQA checkpoint's head groups are scrambled.",
    ),
    "no_causal_mask": Preset(
        replace(BASE, causal=False),
        "Causal mask dropped: every position attends to the future, as in an encoder. The last "
        "query already sees every key, yet it changes too, because the keys it reads were built from the future.",
    ),
    "standard_ffn": Preset(
        replace(BASE, mlp="standard"),
        "Plain FFN down(silu(up(x))) on the trained weights, the SwiGLU gate path removed: "
        "shows what the gate contributes.",
    ),
    "kv_position_bug": Preset(
        replace(BASE, kv_position_bug=True),
        "During cached decoding each layer re-derives the new token's position from a shared "
        "cache length that earlier layers already advanced, so layer L uses position p+L. "
        "Prefill is unaffected: only generated tokens change.",
    ),
}

VariantLike = str | Variant | dict[str, Any] | None


def variants() -> dict[str, Variant]:
    """Preset name → Variant. Descriptions: `describe(name)` or `PRESETS[name].description`."""
    return {name: preset.variant for name, preset in PRESETS.items()}


def describe(name: str) -> str:
    return _preset(name).description


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        close = difflib.get_close_matches(str(name), list(PRESETS), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"Unknown variant {name!r}{hint}; presets are: {', '.join(PRESETS)}")
    return PRESETS[name]


def resolve_variant(variant: VariantLike) -> Variant:
    """Accept a preset name, a Variant, a dict of Variant fields, or None (faithful)."""
    if variant is None:
        return BASE
    if isinstance(variant, Variant):
        return variant
    if isinstance(variant, str):
        return _preset(variant).variant
    if isinstance(variant, dict):
        known = {f.name for f in fields(Variant)}
        unknown = set(variant) - known
        if unknown:
            raise ValueError(f"Unknown Variant field(s) {sorted(unknown)}; fields are: {sorted(known)}")
        return Variant(**variant)
    raise TypeError(f"variant must be a preset name, a Variant or a dict, not {type(variant).__name__}")
