"""ArchConfig: the architecture facts of a checkpoint, in one vocabulary, read from a HF config once.

HF names (`hidden_size`, `num_key_value_heads`, ...) are translated here and nowhere else; the rest of
slmviz speaks `d_model, n_heads, n_kv_heads, d_head, d_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
SUPPORTED_ACTIVATIONS = ("silu",)


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option slmviz does not reimplement."""


@dataclass(frozen=True)
class ArchConfig:
    model_type: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    # RoPE scaling as HF stores it (rope_type + its parameters); {"rope_type": "default"} if none.
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    # Mistral limits each query to the last `sliding_window` keys; None means full causal attention.
    sliding_window: int | None = None
    act: str = "silu"

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def context_length(self) -> int:
        """Longest sequence the checkpoint is meant to run: dynamic NTK RoPE stretches it by `factor`."""
        if self.rope_scaling.get("rope_type") == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling["factor"])
        return self.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchConfig:
        return cls(**d)


def _rope_parameters(hf: Any) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from either transformers 5's `rope_parameters` or 4.x's `rope_scaling`."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    legacy = dict(getattr(hf, "rope_scaling", None) or {})
    merged = {**legacy, **params}
    theta = merged.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10_000.0
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported; slmviz supports {list(SUPPORTED_ROPE_TYPES)}"
        )
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return float(theta), {"rope_type": rope_type, **merged}


_POSITIVE_SIZES = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "max_position_embeddings",
)


def _check_positive(key: str, value: Any) -> None:
    # A zero or missing size would otherwise surface as a ZeroDivisionError or a torch shape error.
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedModelError(f"config.json: {key}={value!r}; it must be a positive integer")


def check_sizes(get: Callable[[str], Any]) -> None:
    """Raise UnsupportedModelError naming the first size that is not a positive integer.

    `get(key)` reads a transformers config attribute or a raw config.json entry; a missing
    num_key_value_heads means one KV head per query head, as in transformers.
    """
    for key in _POSITIVE_SIZES:
        _check_positive(key, get(key))
    if get("num_key_value_heads") is not None:
        _check_positive("num_key_value_heads", get("num_key_value_heads"))


def config_from_hf(hf: Any) -> ArchConfig:
    """Translate a transformers config (LlamaConfig, Qwen2Config, MistralConfig) into an ArchConfig.

    Raises UnsupportedModelError naming what is supported for anything else.
    """
    model_type = getattr(hf, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; slmviz reimplements {list(SUPPORTED_ARCHITECTURES)}"
        )
    act = getattr(hf, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only {list(SUPPORTED_ACTIVATIONS)}")
    check_sizes(lambda key: getattr(hf, key, None))
    n_heads = hf.num_attention_heads
    n_kv_heads = getattr(hf, "num_key_value_heads", None) or n_heads
    if n_heads % n_kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv_heads}"
        )
    # An explicit head_dim may differ from hidden_size / heads (e.g. Mistral-Nemo); None means derive it.
    d_head = getattr(hf, "head_dim", None) or hf.hidden_size // n_heads
    theta, scaling = _rope_parameters(hf)

    attention_bias = bool(getattr(hf, "attention_bias", False))
    # Qwen2 always has q/k/v biases and never an o bias; LLaMA's attention_bias covers all four.
    qkv_bias = True if model_type == "qwen2" else attention_bias
    o_bias = False if model_type == "qwen2" else attention_bias

    sliding_window = getattr(hf, "sliding_window", None)
    if model_type == "qwen2":
        # Qwen2 stores a window but only applies it with use_sliding_window, and then only to upper layers.
        if getattr(hf, "use_sliding_window", False):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=True is not supported")
        sliding_window = None
    if model_type == "llama":
        sliding_window = None

    return ArchConfig(
        model_type=model_type,
        vocab_size=hf.vocab_size,
        d_model=hf.hidden_size,
        n_layers=hf.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_head=d_head,
        d_mlp=hf.intermediate_size,
        norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta,
        max_position_embeddings=int(hf.max_position_embeddings),
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=int(sliding_window) if sliding_window else None,
        act=act,
    )
