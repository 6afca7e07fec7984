"""slmviz: look inside a small language model and break it on purpose.

    import slmviz
    m = slmviz.load()                                  # bundled SmolLM2-135M-Instruct, offline
    t = slmviz.trace("The capital of France is", model=m)
    t["blocks.0.attn.hook_pattern"]                    # [n_heads, pos_q, pos_k]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .circuits.circuit import Circuit, circuit, patch_edges
from .circuits.graph import graph_edges
from .config import ArchConfig, UnsupportedModelError
from .errors import CLTError, SAEError, TranscoderSetError
from .features.bundled import bundled_saes
from .features.evaluate import evaluate_sae
from .features.load import load_sae
from .features.sae import SAE
from .features.steer import steer
from .graphs.attribution import AttributionGraph, AttributionGraphError, attribution_graph
from .graphs.summary import GraphSummary, SummaryError
from .hooks import HookError, HookNameError, hook_names
from .interventions.ablation import ablation
from .interventions.compare import compare
from .interventions.patching import patch
from .interventions.result import PatchResult
from .loading.bundled import bundled_models
from .loading.weights import WeightsError
from .model_api import GenerationStep, Model, load
from .replacement.clt import CrossLayerTranscoder
from .replacement.evaluate import evaluate_transcoders
from .replacement.load import load_transcoders
from .replacement.transcoder_set import TranscoderSet
from .scans.scan import Scan, scan
from .tokens import PromptError
from .trace import Trace, TraceFormatError
from .training.train import train_sae, train_transcoders
from .variants import PRESETS, Variant, describe, resolve_variant, variants

__version__ = "0.3.0"

__all__ = [
    "__version__",
    "ArchConfig", "GenerationStep", "HookError", "HookNameError", "Model", "PRESETS", "PatchResult", "PromptError",
    "Trace", "ablation", "patch",
    "TraceFormatError", "UnsupportedModelError", "Variant", "WeightsError", "bundled_models", "compare", "describe",
    "hook_names",
    "load", "resolve_variant", "trace", "variants",
    "Scan", "scan",
    "SAE", "SAEError", "load_sae", "steer",
    "bundled_saes", "evaluate_sae", "train_sae",
    "TranscoderSet", "TranscoderSetError", "load_transcoders", "train_transcoders", "evaluate_transcoders",
    "CrossLayerTranscoder", "CLTError",
    "Circuit", "circuit", "graph_edges", "patch_edges",
    "AttributionGraph", "AttributionGraphError", "attribution_graph", "GraphSummary", "SummaryError",
]


def trace(
    text_or_ids: str | Sequence[int] | torch.Tensor,
    model: Model | None = None,
    hooks=None,
    names=None,
    chat: bool = False,
    variant=None,
    saes=None,
) -> Trace:
    """Trace one prompt; `model` defaults to the bundled `slmviz.load()`. `saes`: SAEs spliced in (load_sae)."""
    return (model or load()).trace(text_or_ids, variant=variant, hooks=hooks, names=names, chat=chat, saes=saes)

