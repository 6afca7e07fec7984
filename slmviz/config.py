"""ArchConfig: the architecture facts of a checkpoint, in one vocabulary, read from a HF config once.

HF names (`hidden_size`, `num_key_value_heads`, ...) are translated here and nowhere else; the rest of
slmviz speaks `d_model, n_heads, n_kv_heads, d_head, d_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu", "gelu_new")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types values


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or option slmviz does not reimplement."""


@dataclass(frozen=True)
class ArchConfig:
    """The sizes and conventions of one checkpoint (a saved Trace keeps it: to_dict / from_dict).

    The conventions its family fixes (FAMILIES):

    norm_placement: "pre" x + F(ln(x)) | "output" x + ln_post(F(x)) | "sandwich" x + ln_post(F(ln(x))).
    norm_offset: norms multiply by (offset + w); Gemma stores w around 0 and adds 1.
    norm_weight_in_fp32: the weight multiplies the fp32 normalised value before the cast back (Gemma,
        OLMo-2), rather than after it (LLaMA). Equal in fp32, one rounding apart in bf16.
    embed_scale: embeddings are multiplied by sqrt(d_model) (Gemma), in the weights' dtype.
    rope_in_fp32: RoPE's multiply-adds run in fp32 and the result is cast back (OLMo-2), rather than in the
        activations' dtype with cos/sin cast to it (LLaMA, Qwen, Gemma). Equal in fp32 (see rope.rotation_dtype).
    qk_norm: "none" | "head" RMSNorm over each head's d_head (Qwen3, Gemma) | "projection" over the
        whole q / k projection (OLMo-2).
    norm_type, norm_bias: LayerNorm with a bias (GPT-2, GPT-NeoX) instead of RMSNorm.
    positions: "rotary" | "learned" (GPT-2's absolute position embedding, `hook_pos_embed`).
    rotary_dim: partial rotary (GPT-NeoX): only the first rotary_dim dims of each head turn.
    parallel_residual: attention and MLP both read the block's input (GPT-NeoX).
    gated_mlp: the MLP has a gate projection (LLaMA, Gemma) or not (GPT-2, GPT-NeoX).
    attn_softcap, final_logit_softcap: Gemma 2's soft-capping of attention scores and logits.
    """

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
    # A sliding layer lets each query read itself and the `sliding_window` - 1 keys before it; None = no window.
    sliding_window: int | None = None
    act: str = "silu"
    # Per layer: "full_attention" or "sliding_attention"; None = every layer full, or every layer sliding
    # when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] | None = None
    # RoPE base of the sliding layers when it differs from rope_theta (Gemma 3: local 1e4, global 1e6).
    rope_local_theta: float | None = None
    # The family's conventions (FAMILIES; the docstring says what each means).
    norm_placement: str = "pre"
    norm_offset: float = 0.0
    norm_weight_in_fp32: bool = False
    embed_scale: bool = False
    qk_norm: str = "none"
    rope_in_fp32: bool = False
    # Scores are scaled by query_pre_attn_scalar ** -0.5 when set (Gemma), else d_head ** -0.5.
    query_pre_attn_scalar: float | None = None
    # logits = cap · tanh(logits / cap) when set (Gemma 2-style soft-capping; None for Gemma 3).
    final_logit_softcap: float | None = None
    # Attention scores = cap · tanh(scores / cap) before the mask when set (Gemma 2).
    attn_softcap: float | None = None
    # "rms" RMSNorm | "layer" mean-centred LayerNorm (GPT-2, GPT-NeoX); norm_bias: the norms add a learned bias.
    norm_type: str = "rms"
    norm_bias: bool = False
    # "rotary" RoPE inside attention | "learned" a learned absolute position embedding added to the token
    # embedding (GPT-2).
    positions: str = "rotary"
    # How many of each head's leading dims RoPE turns (GPT-NeoX's rotary_pct); None = all d_head.
    rotary_dim: int | None = None
    # x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX's use_parallel_residual) instead of the MLP reading resid_mid.
    parallel_residual: bool = False
    # True: down(act(gate(x)) · up(x)) (LLaMA, Gemma); False: down(act(up(x))), no gate (GPT-2, GPT-NeoX).
    gated_mlp: bool = True

    @property
    def rotary_dims(self) -> int:
        """How many leading dims of each head RoPE turns: all d_head unless the family rotates part (NeoX)."""
        return self.d_head if self.rotary_dim is None else self.rotary_dim

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

    def layer_type(self, layer: int) -> str:
        """FULL or SLIDING for one layer."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window is not None else FULL

    @property
    def has_sliding_layers(self) -> bool:
        return self.sliding_window is not None and any(self.layer_type(i) == SLIDING for i in range(self.n_layers))

    @property
    def mixes_layer_types(self) -> bool:
        """True when some layers slide and others attend globally (Gemma 3): plots label each layer."""
        return self.has_sliding_layers and any(self.layer_type(i) == FULL for i in range(self.n_layers))

    @property
    def has_pre_norms(self) -> bool:
        return self.norm_placement in ("pre", "sandwich")

    @property
    def has_post_norms(self) -> bool:
        return self.norm_placement in ("output", "sandwich")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArchConfig:
        d = dict(d)
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])  # JSON gives a list; the dataclass is frozen and hashable
        return cls(**d)


def _rope_parameters(hf: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any]]:
    """(theta, scaling dict) from either transformers 5's `rope_parameters` or 4.x's `rope_scaling`.

    Gemma 3 keeps one parameter set per layer type ({"full_attention": {...}, "sliding_attention": {...}}).
    """
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if FULL in params or SLIDING in params:
        params = dict(params.get(layer_type or FULL) or {})
    legacy = dict(getattr(hf, "rope_scaling", None) or {})
    merged = {**legacy, **params}
    theta = merged.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10_000.0
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling type {rope_type!r} is not supported; slmviz supports {list(SUPPORTED_ROPE_TYPES)}"
        )
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


def _partial_rotary_factor(scaling: dict[str, Any]) -> float:
    return float(scaling.pop("partial_rotary_factor", 1.0) or 1.0)


def _refuse(hf: Any, option: str, faithful: Any) -> None:
    """Refuse a checkpoint option slmviz does not reimplement, naming it (a silent ignore would change numbers)."""
    value = getattr(hf, option, faithful)
    if value is not None and value != faithful:
        raise UnsupportedModelError(f"{getattr(hf, 'model_type', '?')} with {option}={value!r} is not supported "
                                    f"(slmviz reimplements only {option}={faithful!r})")


def read_llama_like(hf: Any) -> dict[str, Any]:
    """The ArchConfig sizes and options of a LLaMA-style config (hidden_size, num_key_value_heads, rms_norm_eps,
    rope_parameters, q/k/v/o_proj): llama, mistral, qwen2, qwen3, olmo2, gemma3_text, gemma2."""
    # Gemma names it hidden_activation (and leaves hidden_act None).
    act = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", None) or "silu"
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
    if _partial_rotary_factor(scaling) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor != 1 is not supported for {hf.model_type}")
    attention_bias = bool(getattr(hf, "attention_bias", False))
    sliding_window = getattr(hf, "sliding_window", None)
    layer_types = getattr(hf, "layer_types", None)
    if layer_types is not None:
        layer_types = tuple(layer_types)
        if len(layer_types) != hf.num_hidden_layers or not set(layer_types) <= {FULL, SLIDING}:
            raise UnsupportedModelError(f"layer_types {list(layer_types)} are not {hf.num_hidden_layers} of "
                                        f"{[FULL, SLIDING]}")
        if SLIDING not in layer_types:
            sliding_window = None  # Qwen3 stores a window it never uses unless a layer slides
    local_theta = None
    if layer_types is not None and SLIDING in layer_types:
        local, local_scaling = _rope_parameters(hf, SLIDING)
        local_scaling.pop("partial_rotary_factor", None)
        if local_scaling.get("rope_type") != "default":
            raise UnsupportedModelError("RoPE scaling on sliding layers is not supported")
        local_theta = local if local != theta else None
    if getattr(hf, "use_bidirectional_attention", False):
        raise UnsupportedModelError("use_bidirectional_attention=True (an encoder) is not supported")
    return dict(
        vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_layers=hf.num_hidden_layers, n_heads=n_heads,
        n_kv_heads=n_kv_heads, d_head=d_head, d_mlp=hf.intermediate_size, norm_eps=float(hf.rms_norm_eps),
        rope_theta=theta, max_position_embeddings=int(hf.max_position_embeddings), rope_scaling=scaling,
        qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=int(sliding_window) if sliding_window else None, act=act, layer_types=layer_types,
        rope_local_theta=local_theta,
    )


def read_without_window(hf: Any) -> dict[str, Any]:
    """LLaMA and OLMo-2 configs may carry a sliding_window their transformers model never applies."""
    return {**read_llama_like(hf), "sliding_window": None, "layer_types": None}


def read_qwen2(hf: Any) -> dict[str, Any]:
    """Qwen2 always has q/k/v biases and never an o bias; it stores a window but applies it only with
    use_sliding_window, and then only to upper layers (refused)."""
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModelError("Qwen2 with use_sliding_window=True is not supported")
    return {**read_without_window(hf), "qkv_bias": True, "o_bias": False}


def read_gemma(hf: Any) -> dict[str, Any]:
    """Gemma 2 / 3: the score scale query_pre_attn_scalar ** -0.5, and soft-capping where the config sets it."""
    scalar = getattr(hf, "query_pre_attn_scalar", None)
    attn_cap = getattr(hf, "attn_logit_softcapping", None)
    final_cap = getattr(hf, "final_logit_softcapping", None)
    return {**read_llama_like(hf), "query_pre_attn_scalar": float(scalar) if scalar else None,
            "attn_softcap": float(attn_cap) if attn_cap else None,
            "final_logit_softcap": float(final_cap) if final_cap else None}


def read_gpt2(hf: Any) -> dict[str, Any]:
    """GPT-2's config (n_embd, n_layer, n_head, n_inner, layer_norm_epsilon, activation_function): one KV head
    per query head, biases everywhere, tied embeddings, learned positions. The options that change its
    attention and that slmviz does not reimplement are refused by name."""
    _refuse(hf, "scale_attn_by_inverse_layer_idx", False)
    _refuse(hf, "reorder_and_upcast_attn", False)
    _refuse(hf, "scale_attn_weights", True)
    _refuse(hf, "add_cross_attention", False)
    act = getattr(hf, "activation_function", "gelu_new")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"activation_function {act!r} is not supported; only {list(SUPPORTED_ACTIVATIONS)}")
    d, n_heads = hf.hidden_size, hf.num_attention_heads
    return _sizes_checked(dict(
        vocab_size=hf.vocab_size, d_model=d, n_layers=hf.num_hidden_layers, n_heads=n_heads, n_kv_heads=n_heads,
        d_head=d // n_heads, d_mlp=getattr(hf, "n_inner", None) or 4 * d, norm_eps=float(hf.layer_norm_epsilon),
        rope_theta=10_000.0, max_position_embeddings=int(hf.max_position_embeddings),
        qkv_bias=True, o_bias=True, mlp_bias=True, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", True)),
        act=act,
    ))


def read_gpt_neox(hf: Any) -> dict[str, Any]:
    """GPT-NeoX / Pythia: rope_parameters' partial_rotary_factor (rotary_pct) turns the first
    int(d_head · factor) dims of each head; use_parallel_residual; biases where attention_bias says."""
    act = getattr(hf, "hidden_act", "gelu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only {list(SUPPORTED_ACTIVATIONS)}")
    theta, scaling = _rope_parameters(hf)
    d, n_heads = hf.hidden_size, hf.num_attention_heads
    d_head = d // n_heads
    rotary_dim = int(d_head * _partial_rotary_factor(scaling))
    bias = bool(getattr(hf, "attention_bias", True))
    return _sizes_checked(dict(
        vocab_size=hf.vocab_size, d_model=d, n_layers=hf.num_hidden_layers, n_heads=n_heads, n_kv_heads=n_heads,
        d_head=d_head, d_mlp=hf.intermediate_size, norm_eps=float(hf.layer_norm_eps), rope_theta=theta,
        max_position_embeddings=int(hf.max_position_embeddings), rope_scaling=scaling, qkv_bias=bias, o_bias=bias,
        mlp_bias=True, tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), act=act,
        rotary_dim=None if rotary_dim == d_head else rotary_dim,
        parallel_residual=bool(getattr(hf, "use_parallel_residual", True)),
    ))


def _sizes_checked(fields: dict[str, Any]) -> dict[str, Any]:
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "d_mlp", "max_position_embeddings"):
        _check_positive(key, fields[key])
    if fields["d_model"] % fields["n_heads"]:
        raise UnsupportedModelError(f"hidden size {fields['d_model']} is not a multiple of {fields['n_heads']} heads")
    return fields


@dataclass(frozen=True)
class Family:
    """Everything slmviz knows about one model_type, registered in FAMILIES (docs/contributing.md, Adding a family).

    conventions: the ArchConfig fields the family fixes away from their LLaMA defaults (they win over `read`).
    read: hf config -> the ArchConfig sizes and options of one checkpoint, refusing options slmviz does not
        reimplement, by name.
    weights: the key in loading.weights.WEIGHT_LAYOUTS of the function that maps its HF parameter names.
    """

    conventions: dict[str, Any] = field(default_factory=dict)
    read: Callable[[Any], dict[str, Any]] = read_llama_like
    weights: str = "llama"


_GEMMA = {"norm_placement": "sandwich", "norm_offset": 1.0, "norm_weight_in_fp32": True, "embed_scale": True}
_LAYER_NORM = {"norm_type": "layer", "norm_bias": True, "gated_mlp": False}

# The families slmviz reimplements (docs/correctness.md, the families): one registration each.
FAMILIES: dict[str, Family] = {
    "llama": Family(read=read_without_window),
    "mistral": Family(),
    "qwen2": Family(read=read_qwen2),
    "qwen3": Family({"qk_norm": "head"}),
    "olmo2": Family({"norm_placement": "output", "norm_weight_in_fp32": True, "qk_norm": "projection",
                     "rope_in_fp32": True}, read=read_without_window),
    "gemma3_text": Family({**_GEMMA, "qk_norm": "head"}, read=read_gemma),
    "gemma2": Family(_GEMMA, read=read_gemma),
    "gpt2": Family({**_LAYER_NORM, "positions": "learned"}, read=read_gpt2, weights="gpt2"),
    "gpt_neox": Family(_LAYER_NORM, read=read_gpt_neox, weights="gpt_neox"),
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)


def config_from_hf(hf: Any) -> ArchConfig:
    """Translate a transformers config of a registered family (FAMILIES) into an ArchConfig.

    Raises UnsupportedModelError naming what is supported for anything else, and naming the option for a
    checkpoint option slmviz does not reimplement.
    """
    model_type = getattr(hf, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; slmviz reimplements {list(SUPPORTED_ARCHITECTURES)}"
        )
    family = FAMILIES[model_type]
    return ArchConfig(model_type=model_type, **{**family.read(hf), **family.conventions})
