"""slmviz: look inside a small language model and break it on purpose.

    import slmviz
    m = slmviz.load()                                  # bundled SmolLM2-135M-Instruct, offline
    t = slmviz.trace("The capital of France is", model=m)
    t["blocks.0.attn.hook_pattern"]                    # [n_heads, pos_q, pos_k]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .ablation import ablation
from .bundled import bundled_models
from .compare import compare
from .config import ArchConfig, UnsupportedModelError
from .hooks import HookError, HookNameError, hook_names
from .model_api import GenerationStep, Model, load
from .patching import PatchResult, patch
from .scan import Scan, scan
from .tokens import PromptError
from .trace import Trace, TraceFormatError
from .variants import PRESETS, Variant, describe, resolve_variant, variants
from .weights import WeightsError

__all__ = [
    "ArchConfig", "GenerationStep", "HookError", "HookNameError", "Model", "PRESETS", "PatchResult", "PromptError",
    "Trace", "ablation", "patch",
    "TraceFormatError", "UnsupportedModelError", "Variant", "WeightsError", "bundled_models", "compare", "describe",
    "hook_names",
    "load", "resolve_variant", "trace", "variants",
    "Scan", "scan",
]


def trace(
    text_or_ids: str | Sequence[int] | torch.Tensor,
    model: Model | None = None,
    hooks=None,
    names=None,
    chat: bool = False,
    variant=None,
) -> Trace:
    """Trace one prompt; `model` defaults to the bundled `slmviz.load()`."""
    return (model or load()).trace(text_or_ids, variant=variant, hooks=hooks, names=names, chat=chat)

