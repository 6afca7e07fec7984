"""Loading weights: the only module that knows HF parameter names. safetensors only, never pickle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import ArchConfig
from ..model.params import DecoderParams, LayerParams


class WeightsError(ValueError):
    """A model folder's weights are missing, corrupt, or do not fit its config."""


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a transformers folder: model.safetensors or the shards its index names."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsError(f"{index} is not a valid safetensors index (expected a 'weight_map'): {e!r}") from e
        for shard in shards:
            # Shards must sit in the folder itself: an index naming "../x" must not read files elsewhere.
            if not isinstance(shard, str) or Path(shard).name != shard or not shard.endswith(".safetensors"):
                raise WeightsError(f"{index} names the shard {shard!r}; expected a *.safetensors file in {folder}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise WeightsError(
            f"{folder} holds only pickle weights (*.bin/*.pt); slmviz loads safetensors only, because "
            "unpickling runs arbitrary code. Convert with transformers: "
            "model.save_pretrained(dir, safe_serialization=True)"
        )
    raise WeightsError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder, memory-mapped by safetensors; a corrupt file is a WeightsError."""
    tensors: dict[str, torch.Tensor] = {}
    for path in safetensors_files(folder):
        if not path.exists():
            raise WeightsError(f"Missing weight shard {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    tensors[key] = f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightsError(f"Cannot read {path} (corrupt or truncated safetensors file?): {e}") from e
    return tensors


def _strip_prefix(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # Checkpoints saved from the bare base model lack the "model." prefix.
    return {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in tensors.items()}


# HF's per-layer norm names -> slmviz's slots, by where the checkpoint's norms sit. The same HF name means
# different norms in different families: LLaMA's `post_attention_layernorm` is the norm *before the MLP*
# (it normalises the residual after attention), while Gemma's and OLMo-2's is the norm applied to the
# attention output. Mapping it by name alone loads every Gemma/OLMo-2 norm into the wrong place, and the
# model still runs. Pinned by tests/test_conventions.py::test_norm_weights_map_by_placement_not_by_name.
NORM_WEIGHT_NAMES: dict[str, dict[str, str]] = {
    "pre": {"ln1": "input_layernorm", "ln2": "post_attention_layernorm"},
    "output": {"ln1_post": "post_attention_layernorm", "ln2_post": "post_feedforward_layernorm"},
    "sandwich": {"ln1": "input_layernorm", "ln1_post": "post_attention_layernorm",
                 "ln2": "pre_feedforward_layernorm", "ln2_post": "post_feedforward_layernorm"},
}


def qk_norm_width(cfg: ArchConfig, n_heads: int) -> int:
    """Size of a QK-norm weight: d_head per head (Qwen3, Gemma), or n_heads · d_head over the whole
    projection (OLMo-2, which normalises q_proj's output before splitting it into heads)."""
    return cfg.d_head * (n_heads if cfg.qk_norm == "projection" else 1)


def build_params(cfg: ArchConfig, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> DecoderParams:
    """Copy HF tensors key for key into DecoderParams, checking every shape against the config.

    Every tensor, norm weights included, is cast to `dtype` (round to nearest even), as transformers'
    `from_pretrained(dtype=...)` casts every parameter: a Gemma norm's (1 + w) is then computed in fp32 from the
    bf16-rounded w, exactly as Gemma3RMSNorm does. Keeping the norm weights in fp32 in a bf16 model would be
    *more* precise and differ from transformers in bf16 by one rounding of w.
    """
    tensors = _strip_prefix(tensors)
    h, g, dh, d, m = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model, cfg.d_mlp

    def take(name: str, shape: tuple[int, ...], copy: bool = True) -> torch.Tensor:
        if name not in tensors:
            raise WeightsError(f"Weight {name!r} is missing from the checkpoint (config says {cfg.model_type})")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise WeightsError(f"Weight {name!r} has shape {tuple(t.shape)}, but the config implies {shape}")
        # An owned copy, never a view into the memory-mapped file: a view would keep the whole mapping
        # (all 538 MB of SmolLM2's pages) resident. `fused` copies its parts itself, so they are not copied twice.
        return t.to(dtype=dtype, copy=copy)

    def maybe(name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return take(name, shape) if present else None

    def fused(*names_and_shapes: tuple[str, tuple[int, int]]) -> torch.Tensor:
        # [out, in] HF matrices stacked into one [sum(out), in] matrix (see model/params.py for why).
        return torch.cat([take(name, shape, copy=False) for name, shape in names_and_shapes], dim=0).to(dtype)

    def cat_b(*bs: torch.Tensor | None) -> torch.Tensor | None:
        return None if bs[0] is None else torch.cat(bs).contiguous()

    layers = []
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        a, mlp = pre + "self_attn.", pre + "mlp."
        slots = NORM_WEIGHT_NAMES[cfg.norm_placement]
        norms = {slot: take(f"{pre}{hf_name}.weight", (d,)) for slot, hf_name in slots.items()}
        qk = cfg.qk_norm != "none"
        layers.append(
            LayerParams(
                ln1=norms.get("ln1"),
                ln2=norms.get("ln2"),
                ln1_post=norms.get("ln1_post"),
                ln2_post=norms.get("ln2_post"),
                q_norm=maybe(a + "q_norm.weight", (qk_norm_width(cfg, h),), qk),
                k_norm=maybe(a + "k_norm.weight", (qk_norm_width(cfg, g),), qk),
                w_qkv=fused((a + "q_proj.weight", (h * dh, d)), (a + "k_proj.weight", (g * dh, d)),
                            (a + "v_proj.weight", (g * dh, d))),
                b_qkv=cat_b(maybe(a + "q_proj.bias", (h * dh,), cfg.qkv_bias),
                            maybe(a + "k_proj.bias", (g * dh,), cfg.qkv_bias),
                            maybe(a + "v_proj.bias", (g * dh,), cfg.qkv_bias)),
                w_o=take(a + "o_proj.weight", (d, h * dh)),
                b_o=maybe(a + "o_proj.bias", (d,), cfg.o_bias),
                w_gate_up=fused((mlp + "gate_proj.weight", (m, d)), (mlp + "up_proj.weight", (m, d))),
                b_gate_up=cat_b(maybe(mlp + "gate_proj.bias", (m,), cfg.mlp_bias),
                                maybe(mlp + "up_proj.bias", (m,), cfg.mlp_bias)),
                w_down=take(mlp + "down_proj.weight", (d, m)),
                b_down=maybe(mlp + "down_proj.bias", (d,), cfg.mlp_bias),
            )
        )
    embed = take("model.embed_tokens.weight", (cfg.vocab_size, d))
    if cfg.tie_embeddings or "lm_head.weight" not in tensors:
        if not cfg.tie_embeddings:
            raise WeightsError("lm_head.weight is missing and the config does not tie embeddings")
        # Tied: logits = x · E^T, and E [vocab, d_model] is already the [out, in] layout: one matrix, held once.
        unembed = embed
    else:
        unembed = take("lm_head.weight", (cfg.vocab_size, d))
    return DecoderParams(embed=embed, layers=layers, ln_final=take("model.norm.weight", (d,)), unembed=unembed)


def load_params(cfg: ArchConfig, folder: Path, dtype: torch.dtype = torch.float32) -> DecoderParams:
    return build_params(cfg, read_tensors(folder), dtype)
