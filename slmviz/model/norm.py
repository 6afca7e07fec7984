"""Normalisation: RMSNorm (faithful), mean-centred LayerNorm (variant), or none (variant); the (1 + w) weight."""

from __future__ import annotations

from collections.abc import Callable

import torch


def rms_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm's (centred input, variance): (x, mean(x²)). No mean is subtracted.

    This is what every LLaMA/Qwen2/Mistral checkpoint was trained with. Subtracting the mean
    (LayerNorm) runs fine with the same weights and silently changes every activation;
    pinned by tests/test_conventions.py::test_rms_norm_does_not_subtract_the_mean.
    """
    return x, x.pow(2).mean(-1, keepdim=True)


def layer_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm's (centred input, variance): (x - mean, biased variance), as torch's F.layer_norm.

    What GPT-2 and GPT-NeoX (Pythia) were trained with, with a learned bias added after the weight
    (`normalize`'s bias). Dropping the mean (RMSNorm, the `rms_for_layernorm` variant) runs with the same
    weights and shifts every normalised value by its row's mean; on an RMSNorm family the centring is the
    `layer_norm` variant. The centring is linear (x - mean = C x), so attribution with the scale frozen
    stays exact. Pinned by tests/test_families_gpt2_neox_gemma2.py::test_layer_norm_centres_and_adds_its_bias.
    """
    centred = x - x.mean(-1, keepdim=True)
    return centred, centred.pow(2).mean(-1, keepdim=True)


NORM_STATISTICS = {"rms": rms_statistics, "layer": layer_statistics}


def unhooked(x: torch.Tensor) -> torch.Tensor:
    """The callback for a norm value nobody reads: returns it unchanged.

    `normalize` checks for it by identity, so the block passes it (not a lambda) when no hook wants the
    scale or the normalized value, and the norm may then skip computing what only a hook would see.
    """
    return x


def norm_weight(weight: torch.Tensor, offset: float, in_fp32: bool) -> torch.Tensor:
    """The factor a norm multiplies by: (offset + w), in fp32 when the family applies its weight in fp32.

    Gemma stores w around 0 and multiplies by (1 + w) (`offset` 1, `in_fp32`: `(1.0 + w.float())`,
    Gemma3RMSNorm); LLaMA-style checkpoints store the factor itself (offset 0). Dropping the 1 (the
    `no_norm_offset` variant) runs and multiplies every normalised value by a number near 0; adding it in
    bf16 instead of fp32 rounds 1 + w to 8 bits of mantissa. Pinned by
    tests/test_conventions.py::test_gemma_norms_multiply_by_one_plus_w.
    """
    # Callers memoise the factor, and the first call may come from an inference_mode run: computed as a normal
    # tensor, so a later run with autograd on (grad=True) may save it for backward.
    with torch.inference_mode(False):
        if in_fp32:
            weight = weight.float()
        return weight + offset if offset else weight


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_type: str = "rms",
    on_scale: Callable[[torch.Tensor], torch.Tensor] = unhooked,
    on_normalized: Callable[[torch.Tensor], torch.Tensor] = unhooked,
    weight_in_fp32: bool = False,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight · (centred / sqrt(var + eps)) (+ bias, LayerNorm families), with TransformerLens's hook points.

    `weight` is the factor from `norm_weight`. `on_scale` sees scale = sqrt(var + eps) [..., 1], the
    divisor; `on_normalized` sees the normalized input *before* the learned weight. Computed in fp32 as
    `x * rsqrt(var + eps)` like transformers' LlamaRMSNorm (in bf16 the mean of squares rounds, and
    dividing instead of multiplying by the reciprocal moves the last bit). The weight multiplies after the
    cast back to the input dtype (LLaMA), or before it, in fp32, with `weight_in_fp32` (Gemma, OLMo-2).
    If a hook replaces the scale, the replacement is what divides.
    When neither part is hooked (both callbacks are `unhooked`), an fp32 RMSNorm is one call to
    `torch.rms_norm` (the same arithmetic inside ATen, bit-identical to LlamaRMSNorm in fp32) instead of
    seven Python-dispatched ops: ~2x cheaper for the one-row norms of a decoding step. In bf16 / fp16 the
    normalisation runs the same way on the fp32 upcast (bit-identical to `x.float() * rsqrt(...)`), and the
    weight multiplies after or before the cast back exactly as below.
    Pinned by tests/test_conventions.py::test_rms_norm_matches_transformers_bit_for_bit and, in bf16,
    tests/test_dtype.py::test_bf16_matches_transformers_bf16_within_its_own_eager_vs_sdpa_difference.
    """
    statistics = NORM_STATISTICS[norm_type]
    hooked = on_scale is not unhooked or on_normalized is not unhooked
    if bias is not None:
        if not hooked and statistics is layer_statistics and x.dtype == torch.float32:
            return torch.layer_norm(x, weight.shape, weight, bias, eps)  # transformers' nn.LayerNorm, bit for bit
        return normalize(x, weight, eps, norm_type, on_scale, on_normalized, weight_in_fp32) + bias
    if not hooked and statistics is rms_statistics:
        if x.dtype == torch.float32:
            return torch.rms_norm(x, weight.shape, weight, eps)
        normalized = torch.rms_norm(x.float(), weight.shape, None, eps)
        return (weight * normalized).to(x.dtype) if weight_in_fp32 else weight * normalized.to(x.dtype)
    dtype = x.dtype
    centred, var = statistics(x.float())
    var_eps = var + eps
    replaced_scale = None
    if on_scale is not unhooked:
        scale = torch.sqrt(var_eps).to(dtype)
        hooked_scale = on_scale(scale)
        replaced_scale = None if hooked_scale is scale else hooked_scale
    # Multiply by the reciprocal like the reference; only a replaced scale divides.
    normalized = centred * torch.rsqrt(var_eps) if replaced_scale is None else centred / replaced_scale.float()
    shown = normalized.to(dtype)
    seen = on_normalized(shown)
    if weight_in_fp32:
        return (weight * (normalized if seen is shown else seen.float())).to(dtype)
    return weight * seen


def skip_norm(x: torch.Tensor, on_scale: Callable[[torch.Tensor], torch.Tensor] = unhooked,
              on_normalized: Callable[[torch.Tensor], torch.Tensor] = unhooked) -> torch.Tensor:
    """The `no_norm` variant: the value passes unchanged (no weight either). Hooks see scale = 1."""
    if on_scale is not unhooked:
        on_scale(torch.ones(x.shape[:-1] + (1,), dtype=x.dtype, device=x.device))
    return on_normalized(x)
