"""The SAE error type and the argument checks that features modules share without importing the SAE class (so a
module the SAE itself calls, such as dashboard through labels, does not import it back: tests/test_layout.py)."""

from __future__ import annotations

from typing import Any

import torch


class SAEError(ValueError):
    """A bad SAE file, configuration or tensor: the message names what is wrong and what would be right."""


def check_feature(sae: Any, feature: Any) -> int:
    """A feature index as an int in 0..d_sae-1, or a clear error."""
    if isinstance(feature, bool) or not isinstance(feature, int | torch.Tensor) or (
            isinstance(feature, torch.Tensor) and feature.numel() != 1):
        raise SAEError(f"a feature is an integer index in 0..{sae.d_sae - 1}, got {feature!r}")
    f = int(feature)
    if not 0 <= f < sae.d_sae:
        raise SAEError(f"feature {f} is out of range: this SAE has d_sae={sae.d_sae} features (0..{sae.d_sae - 1})")
    return f


def _check_k(k: Any) -> int:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SAEError(f"k must be a positive integer, got {k!r}")
    return k
