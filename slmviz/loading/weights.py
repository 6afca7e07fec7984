"""Loading weights: the only module that knows HF parameter names. safetensors only, never pickle."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import FAMILIES, ArchConfig
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


def conv1d_to_linear(w: torch.Tensor) -> torch.Tensor:
    """GPT-2's Conv1D weight [in, out] as an nn.Linear weight [out, in]: its transpose.

    GPT-2 stores every projection (c_attn, c_proj, c_fc) as `x @ W + b` with W [in, out]; slmviz keeps
    nn.Linear's [out, in]. Copying it untransposed fails the shape check only where in != out: a square
    c_proj [d, d] loads silently and every attention output is then multiplied by the wrong matrix.
    Pinned by tests/test_families_gpt2_neox_gemma2.py::test_gpt2_conv1d_weights_are_transposed.
    """
    return w.t()


def neox_qkv_rows(w: torch.Tensor, n_heads: int, d_head: int) -> torch.Tensor:
    """GPT-NeoX's fused query_key_value rows (or bias) reordered to slmviz's q | k | v blocks.

    NeoX lays its [3·h·dh, d] weight out per head: head i's rows are [q_i, k_i, v_i], each dh long (transformers
    views the output as [.., h, 3·dh] and chunks the last dim). GPT-2's c_attn is the other layout, all q
    then all k then all v. Reading NeoX's rows as q | k | v runs, and mixes every head's q, k and v.
    Pinned by tests/test_families_gpt2_neox_gemma2.py::test_neox_fused_qkv_is_laid_out_per_head.
    """
    per_head = w.reshape(n_heads, 3, d_head, *w.shape[1:])  # [h, 3, dh, (d)]
    return per_head.transpose(0, 1).reshape(w.shape)  # [3, h, dh, (d)] -> q rows, k rows, v rows


class _Reader:
    """Takes HF tensors by name, checking each shape against the config, cast to `dtype` (see build_params)."""

    def __init__(self, cfg: ArchConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
        self.cfg, self.tensors, self.dtype = cfg, tensors, dtype

    def take(self, name: str, shape: tuple[int, ...], copy: bool = True, stored: tuple[int, ...] | None = None,
             fix: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """`stored`: the shape in the file when it differs (Conv1D's [in, out]); `fix` turns it into `shape`."""
        if name not in self.tensors:
            raise WeightsError(f"Weight {name!r} is missing from the checkpoint (config says {self.cfg.model_type})")
        t = self.tensors[name]
        if tuple(t.shape) != (stored or shape):
            raise WeightsError(f"Weight {name!r} has shape {tuple(t.shape)}, but the config implies {stored or shape}")
        if fix is not None:
            return fix(t).to(dtype=self.dtype).contiguous()
        # An owned copy, never a view into the memory-mapped file: a view would keep the whole mapping
        # (all 538 MB of SmolLM2's pages) resident. `fused` copies its parts itself, so they are not copied twice.
        return t.to(dtype=self.dtype, copy=copy)

    def maybe(self, name: str, shape: tuple[int, ...], present: bool) -> torch.Tensor | None:
        return self.take(name, shape) if present else None

    def fused(self, *names_and_shapes: tuple[str, tuple[int, int]]) -> torch.Tensor:
        # [out, in] HF matrices stacked into one [sum(out), in] matrix (see model/params.py for why).
        return torch.cat([self.take(n, s, copy=False) for n, s in names_and_shapes], dim=0).to(self.dtype)

    def unembed(self, embed: torch.Tensor, name: str) -> torch.Tensor:
        cfg = self.cfg
        if cfg.tie_embeddings or name not in self.tensors:
            if not cfg.tie_embeddings:
                raise WeightsError(f"{name} is missing and the config does not tie embeddings")
            # Tied: logits = x · E^T, and E [vocab, d_model] is already the [out, in] layout: one matrix, held once.
            return embed
        return self.take(name, (cfg.vocab_size, cfg.d_model))


def _cat_b(*bs: torch.Tensor | None) -> torch.Tensor | None:
    return None if bs[0] is None else torch.cat(bs).contiguous()


def llama_params(r: _Reader) -> DecoderParams:
    """LLaMA-style names (model.layers.i.self_attn.q_proj, mlp.gate_proj, ...): llama, mistral, qwen2, qwen3,
    olmo2, gemma2, gemma3_text."""
    cfg = r.cfg
    r.tensors = _strip_prefix(r.tensors)
    h, g, dh, d, m = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model, cfg.d_mlp
    layers = []
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}."
        a, mlp = pre + "self_attn.", pre + "mlp."
        slots = NORM_WEIGHT_NAMES[cfg.norm_placement]
        norms = {slot: r.take(f"{pre}{hf_name}.weight", (d,)) for slot, hf_name in slots.items()}
        qk = cfg.qk_norm != "none"
        layers.append(
            LayerParams(
                ln1=norms.get("ln1"),
                ln2=norms.get("ln2"),
                ln1_post=norms.get("ln1_post"),
                ln2_post=norms.get("ln2_post"),
                q_norm=r.maybe(a + "q_norm.weight", (qk_norm_width(cfg, h),), qk),
                k_norm=r.maybe(a + "k_norm.weight", (qk_norm_width(cfg, g),), qk),
                w_qkv=r.fused((a + "q_proj.weight", (h * dh, d)), (a + "k_proj.weight", (g * dh, d)),
                              (a + "v_proj.weight", (g * dh, d))),
                b_qkv=_cat_b(r.maybe(a + "q_proj.bias", (h * dh,), cfg.qkv_bias),
                             r.maybe(a + "k_proj.bias", (g * dh,), cfg.qkv_bias),
                             r.maybe(a + "v_proj.bias", (g * dh,), cfg.qkv_bias)),
                w_o=r.take(a + "o_proj.weight", (d, h * dh)),
                b_o=r.maybe(a + "o_proj.bias", (d,), cfg.o_bias),
                w_gate_up=r.fused((mlp + "gate_proj.weight", (m, d)), (mlp + "up_proj.weight", (m, d))),
                b_gate_up=_cat_b(r.maybe(mlp + "gate_proj.bias", (m,), cfg.mlp_bias),
                                 r.maybe(mlp + "up_proj.bias", (m,), cfg.mlp_bias)),
                w_down=r.take(mlp + "down_proj.weight", (d, m)),
                b_down=r.maybe(mlp + "down_proj.bias", (d,), cfg.mlp_bias),
            )
        )
    embed = r.take("model.embed_tokens.weight", (cfg.vocab_size, d))
    return DecoderParams(embed=embed, layers=layers, ln_final=r.take("model.norm.weight", (d,)),
                         unembed=r.unembed(embed, "lm_head.weight"))


def gpt2_params(r: _Reader) -> DecoderParams:
    """GPT-2's names (transformer.h.i.attn.c_attn, mlp.c_fc, ln_1, wte, wpe, ln_f): Conv1D weights [in, out]
    (conv1d_to_linear), one fused c_attn with all q, then all k, then all v, LayerNorm weights and biases."""
    cfg = r.cfg
    r.tensors = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v
                 for k, v in r.tensors.items()}
    d, m = cfg.d_model, cfg.d_mlp
    layers = []
    for i in range(cfg.n_layers):
        pre = f"transformer.h.{i}."
        layers.append(LayerParams(
            ln1=r.take(pre + "ln_1.weight", (d,)), ln2=r.take(pre + "ln_2.weight", (d,)),
            norm_biases={"ln1": r.take(pre + "ln_1.bias", (d,)), "ln2": r.take(pre + "ln_2.bias", (d,))},
            w_qkv=r.take(pre + "attn.c_attn.weight", (3 * d, d), stored=(d, 3 * d), fix=conv1d_to_linear),
            b_qkv=r.take(pre + "attn.c_attn.bias", (3 * d,)),
            w_o=r.take(pre + "attn.c_proj.weight", (d, d), stored=(d, d), fix=conv1d_to_linear),
            b_o=r.take(pre + "attn.c_proj.bias", (d,)),
            w_gate_up=r.take(pre + "mlp.c_fc.weight", (m, d), stored=(d, m), fix=conv1d_to_linear),
            b_gate_up=r.take(pre + "mlp.c_fc.bias", (m,)),
            w_down=r.take(pre + "mlp.c_proj.weight", (d, m), stored=(m, d), fix=conv1d_to_linear),
            b_down=r.take(pre + "mlp.c_proj.bias", (d,)),
        ))
    embed = r.take("transformer.wte.weight", (cfg.vocab_size, d))
    return DecoderParams(
        embed=embed, layers=layers, ln_final=r.take("transformer.ln_f.weight", (d,)),
        unembed=r.unembed(embed, "lm_head.weight"), ln_final_bias=r.take("transformer.ln_f.bias", (d,)),
        pos_embed=r.take("transformer.wpe.weight", (cfg.max_position_embeddings, d)),
    )


def gpt_neox_params(r: _Reader) -> DecoderParams:
    """GPT-NeoX's names (gpt_neox.layers.i.attention.query_key_value, mlp.dense_h_to_4h, embed_in, embed_out):
    the fused QKV laid out per head (neox_qkv_rows), LayerNorm weights and biases, an untied embed_out."""
    cfg = r.cfg
    r.tensors = {k if k.startswith(("gpt_neox.", "embed_out.")) else f"gpt_neox.{k}": v for k, v in r.tensors.items()}
    h, dh, d, m = cfg.n_heads, cfg.d_head, cfg.d_model, cfg.d_mlp

    def qkv(t: torch.Tensor) -> torch.Tensor:
        return neox_qkv_rows(t, h, dh)

    layers = []
    for i in range(cfg.n_layers):
        pre = f"gpt_neox.layers.{i}."
        a = pre + "attention."
        layers.append(LayerParams(
            ln1=r.take(pre + "input_layernorm.weight", (d,)), ln2=r.take(pre + "post_attention_layernorm.weight", (d,)),
            norm_biases={"ln1": r.take(pre + "input_layernorm.bias", (d,)),
                         "ln2": r.take(pre + "post_attention_layernorm.bias", (d,))},
            w_qkv=r.take(a + "query_key_value.weight", (3 * d, d), fix=qkv),
            b_qkv=r.take(a + "query_key_value.bias", (3 * d,), fix=qkv) if cfg.qkv_bias else None,
            w_o=r.take(a + "dense.weight", (d, d)),
            b_o=r.maybe(a + "dense.bias", (d,), cfg.o_bias),
            w_gate_up=r.take(pre + "mlp.dense_h_to_4h.weight", (m, d)),
            b_gate_up=r.take(pre + "mlp.dense_h_to_4h.bias", (m,)),
            w_down=r.take(pre + "mlp.dense_4h_to_h.weight", (d, m)),
            b_down=r.take(pre + "mlp.dense_4h_to_h.bias", (d,)),
        ))
    embed = r.take("gpt_neox.embed_in.weight", (cfg.vocab_size, d))
    return DecoderParams(
        embed=embed, layers=layers, ln_final=r.take("gpt_neox.final_layer_norm.weight", (d,)),
        unembed=r.unembed(embed, "embed_out.weight"), ln_final_bias=r.take("gpt_neox.final_layer_norm.bias", (d,)),
    )


# Family.weights -> the function that maps that naming scheme's HF tensors onto DecoderParams.
WEIGHT_LAYOUTS: dict[str, Callable[[_Reader], DecoderParams]] = {
    "llama": llama_params, "gpt2": gpt2_params, "gpt_neox": gpt_neox_params,
}


def build_params(cfg: ArchConfig, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> DecoderParams:
    """Copy HF tensors key for key into DecoderParams, checking every shape against the config, through the
    family's weight layout (config.FAMILIES[...].weights).

    Every tensor, norm weights included, is cast to `dtype` (round to nearest even), as transformers'
    `from_pretrained(dtype=...)` casts every parameter: a Gemma norm's (1 + w) is then computed in fp32 from the
    bf16-rounded w, exactly as Gemma3RMSNorm does. Keeping the norm weights in fp32 in a bf16 model would be
    *more* precise and differ from transformers in bf16 by one rounding of w.
    """
    return WEIGHT_LAYOUTS[FAMILIES[cfg.model_type].weights](_Reader(cfg, dict(tensors), dtype))


def load_params(cfg: ArchConfig, folder: Path, dtype: torch.dtype = torch.float32) -> DecoderParams:
    return build_params(cfg, read_tensors(folder), dtype)
