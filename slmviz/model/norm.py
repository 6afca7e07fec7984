"""Normalisation: RMSNorm (faithful), mean-centred LayerNorm (variant), or none (variant)."""

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
    """LayerNorm's (centred input, variance): (x - mean, biased variance). The `layer_norm` variant."""
    centred = x - x.mean(-1, keepdim=True)
    return centred, centred.pow(2).mean(-1, keepdim=True)


NORM_STATISTICS = {"rms": rms_statistics, "layer": layer_statistics}


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_type: str = "rms",
    on_scale: Callable[[torch.Tensor], torch.Tensor] = _identity,
    on_normalized: Callable[[torch.Tensor], torch.Tensor] = _identity,
) -> torch.Tensor:
    """weight · (centred / sqrt(var + eps)), with TransformerLens's hook points on the parts.

    `on_scale` sees scale = sqrt(var + eps) [pos, 1], the divisor; `on_normalized` sees the
    normalized input *before* the learned weight. Computed in fp32 as `x * rsqrt(var + eps)` like
    transformers' LlamaRMSNorm (in bf16 the mean of squares rounds, and dividing instead of multiplying
    by the reciprocal moves the last bit); the weight multiplies after the cast back to the input dtype,
    again like the reference. If a hook replaces the scale, the replacement is what divides.
    Pinned by tests/test_conventions.py::test_rms_norm_matches_transformers_bit_for_bit.
    """
    dtype = x.dtype
    centred, var = NORM_STATISTICS[norm_type](x.float())
    scale = torch.sqrt(var + eps).to(dtype)
    hooked_scale = on_scale(scale)
    if hooked_scale is scale:
        normalized = centred * torch.rsqrt(var + eps)
    else:
        normalized = centred / hooked_scale.float()
    normalized = on_normalized(normalized.to(dtype))
    return weight * normalized


def skip_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    norm_type: str = "rms",
    on_scale: Callable[[torch.Tensor], torch.Tensor] = _identity,
    on_normalized: Callable[[torch.Tensor], torch.Tensor] = _identity,
) -> torch.Tensor:
    """The `no_norm` variant: the value passes unchanged (no weight either). Hooks see scale = 1."""
    on_scale(torch.ones(x.shape[:-1] + (1,), dtype=x.dtype))
    return on_normalized(x)
