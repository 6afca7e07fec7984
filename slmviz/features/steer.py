"""Steering with SAE features, and what a feature writes: its logit effects and its nearest features.

    hooks = slmviz.steer(sae, {feature: strength})        # for trace / generate / stream
    m.generate("...", hooks=hooks)
    sae.logit_effects(feature, k=10)                       # tokens W_dec[f] @ W_U promotes / suppresses most
    sae.nearest(feature, k=10)                             # features whose decoder rows point the same way

Steering is Neuronpedia's: add strength * W_dec[f] to the hook the SAE writes, at every position, prompt and
generated tokens alike (a hook fn sees the prompt at the prefill, then one new position per decoding step).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SAEError, check_feature
from .sae import SAE


def steer(sae: SAE, strengths: Mapping[int, float]) -> dict[str, Any]:
    """{sae.hook_name_out: fn} adding Σ strength · W_dec[f] at every position (Neuronpedia's steering).

    The hook the SAE writes is where its decoder rows live (a transcoder's is hook_mlp_out; an attn.hook_z SAE's
    vector is added to z, reshaped to [h, d_head]). Strength 0 changes nothing. Combine with other hooks by
    merging dicts; splicing the SAE as well (saes=[sae]) lets it see the steered activation."""
    if not isinstance(strengths, Mapping) or not strengths:
        raise SAEError("steer() takes {feature: strength}, e.g. {123: 8.0}")
    vector = torch.zeros(sae.d_out, dtype=sae.dtype, device=sae.W_dec.device)
    for feature, strength in strengths.items():
        f = check_feature(sae, feature)
        if isinstance(strength, bool) or not isinstance(strength, int | float) or not math.isfinite(strength):
            raise SAEError(f"the strength of feature {f} must be a finite number, got {strength!r}")
        vector += float(strength) * sae.W_dec[f].detach()

    def add(x: torch.Tensor, name: str) -> torch.Tensor:
        delta = vector.to(device=x.device, dtype=x.dtype)
        if x.shape[-1] != delta.shape[-1]:  # an attn.hook_z SAE: [..., h, d_head]
            delta = delta.view(x.shape[-2:])
        return x + delta

    add.__qualname__ = f"steer({sae.hook_name_out}, {dict(strengths)})"
    return {sae.hook_name_out: add}
