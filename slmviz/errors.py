"""The errors of sparse coders, replacement models and their files: one family, so that a caller catches one class.

    SAEError                  a bad SAE / transcoder: its file, configuration, tensors or arguments
      TranscoderSetError      a set that cannot replace a model's MLPs: a coder at another site, files missing
        CLTError              a cross-layer transcoder that cannot be built, read or spliced

Every one is a ValueError (bad input, never a bug), and each message names the file, tensor, layer or argument at
fault and what would be right. The file-format modules (slmviz.formats) raise the class of the object they read or
write, so a caller that asked for a CLT catches CLTError whichever layout the folder has. This module sits below
every part that raises them and imports nothing of slmviz.

Also here: the two argument checks every coder and every view of its features share (a feature index, a count k).
"""

from __future__ import annotations

from typing import Any

import torch


class SAEError(ValueError):
    """A bad SAE file, configuration or tensor: the message names what is wrong and what would be right."""


class TranscoderSetError(SAEError):
    """A set that cannot be a replacement model: a coder at another site, two for one layer, mismatched widths, files
    missing or doubled, a set made for another model. The message names the layer or file."""


class CLTError(TranscoderSetError):
    """A CLT that cannot be built or spliced: bad shapes, a hook the model lacks, a layer count of another model.
    The message names the tensor, file or hook."""


def check_feature(coder: Any, feature: Any) -> int:
    """A feature index of `coder` (anything with d_sae) as an int in 0..d_sae-1, or an SAEError saying why not."""
    if isinstance(feature, bool) or not isinstance(feature, int | torch.Tensor) or (
            isinstance(feature, torch.Tensor) and feature.numel() != 1):
        raise SAEError(f"a feature is an integer index in 0..{coder.d_sae - 1}, got {feature!r}")
    f = int(feature)
    if not 0 <= f < coder.d_sae:
        raise SAEError(f"feature {f} is out of range: this SAE has d_sae={coder.d_sae} features "
                       f"(0..{coder.d_sae - 1})")
    return f


def check_k(k: Any) -> int:
    """A count of rows or tokens to show (k=...) as a positive int, or an SAEError."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise SAEError(f"k must be a positive integer, got {k!r}")
    return k
