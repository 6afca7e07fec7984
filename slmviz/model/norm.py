"""Normalisation: RMSNorm (faithful), mean-centred LayerNorm (variant), or none (variant); the (1 + w) weight."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from .params import one_thread


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
    if bias is not None and not hooked and statistics is layer_statistics and x.dtype == torch.float32:
        return torch.layer_norm(x, weight.shape, weight, bias, eps)  # transformers' nn.LayerNorm, bit for bit
    if not hooked and statistics is rms_statistics:
        if x.dtype == torch.float32:
            out = torch.rms_norm(x, weight.shape, weight, eps)
        else:
            normalized = torch.rms_norm(x.float(), weight.shape, None, eps)
            out = (weight * normalized).to(x.dtype) if weight_in_fp32 else weight * normalized.to(x.dtype)
        return out if bias is None else out + bias  # a bias only with rms_for_layernorm on a LayerNorm family
    dtype = x.dtype
    with hooked_norm_threads(x):
        centred, var = statistics(x.float())
        var_eps = var + eps
        scale = torch.sqrt(var_eps).to(dtype) if on_scale is not unhooked else None
    replaced_scale = None
    if scale is not None:
        hooked_scale = on_scale(scale)  # a hook fn (user code, an SAE) runs on every thread, outside the block
        replaced_scale = None if hooked_scale is scale else hooked_scale
    with hooked_norm_threads(x):
        # Multiply by the reciprocal like the reference; only a replaced scale divides.
        normalized = centred * torch.rsqrt(var_eps) if replaced_scale is None else centred / replaced_scale.float()
        shown = normalized.to(dtype)
    seen = on_normalized(shown)
    with hooked_norm_threads(x):
        weighted = normalized if seen is shown else seen.float()
        out = (weight * weighted).to(dtype) if weight_in_fp32 else weight * seen
        return out if bias is None else out + bias


# ATen splits an elementwise op or a reduction over threads only past this many elements (at::internal::GRAIN_SIZE),
# and a reduction over the last dim splits one row over threads only when that row alone is longer.
_GRAIN = 32768


def hooked_norm_threads(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Where the hooked norm's own ops run: on one thread (params.one_thread) when each row is shorter than
    ATen's grain; otherwise on every thread.

    A trace that reads ln1/ln2's scale or normalized value computes each norm as ~7 ops over [pos, d_model]
    (mean, centring, square, mean, rsqrt, weight, bias) where transformers' LayerNorm is one kernel. Each op over
    more than the grain is an OpenMP fork/join; on a busy machine (more runnable processes than cores) each join
    waits until the OS runs the other thread again: with two norms a layer, that is what put a LayerNorm family's
    trace behind transformers' eager forward (bench/results/families.md). On one thread the values
    are the same bit for bit: elementwise ops do not depend on the split, and a reduction over the last dim gives
    each row to one thread either way while rows are shorter than the grain (past it ATen splits a row, and the
    sums would round differently, so such rows keep every thread).
    Pinned by tests/test_families_fast_paths.py::test_hooked_norms_give_the_same_values_on_one_thread.
    """
    return one_thread(x.device) if x.shape[-1] < _GRAIN else contextlib.nullcontext()


def skip_norm(x: torch.Tensor, on_scale: Callable[[torch.Tensor], torch.Tensor] = unhooked,
              on_normalized: Callable[[torch.Tensor], torch.Tensor] = unhooked) -> torch.Tensor:
    """The `no_norm` variant: the value passes unchanged (no weight either). Hooks see scale = 1."""
    if on_scale is not unhooked:
        on_scale(torch.ones(x.shape[:-1] + (1,), dtype=x.dtype, device=x.device))
    return on_normalized(x)
