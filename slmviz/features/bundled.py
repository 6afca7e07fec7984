"""The SAEs and transcoders that ship inside the package.

    slmviz.bundled_saes(m)                       # ['resid_post_l15', 'transcoder_l6', ...] for SmolLM2
    sae = slmviz.load_sae("resid_post_l15", model=m)

They live in slmviz/features/bundled/<model name>/<sae name>/ as SAELens folders (cfg.json + sae_weights.safetensors),
their tensors stored in fp16 (cfg.json says float32: they load and run in fp32). They ship as files rather than being
trained by `slmviz prepare`, because training them takes CPU-hours that a fresh `make test` or Space start cannot
spend, while the files total under 40 MB; the exact command that trained each one is in its cfg.json
(metadata.training_command) and in docs/features.md ("Bundled SAEs"). The corpus they were trained on:
slmviz.corpora.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..formats.saelens import holds_sae

BUNDLED_DIR = Path(__file__).parent / "bundled"


def bundled_saes(model: Any) -> list[str]:
    """Names of the SAEs that ship for `model` (a Model or a model name); `load_sae(name, model=m)` loads one."""
    folder = BUNDLED_DIR / _model_name(model)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if holds_sae(p))


def bundled_sae_folder(name: str, model: Any) -> Path | None:
    """The folder of bundled SAE `name` for `model`, or None when no bundled SAE has that name (load_sae then reads
    `name` as a path or a hub id). A name is a plain word, never a path: 'resid_post_l15', not './resid_post_l15'."""
    if model is None or not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    folder = BUNDLED_DIR / _model_name(model) / name
    return folder if holds_sae(folder) else None


def _model_name(model: Any) -> str:
    return model if isinstance(model, str) else str(getattr(model, "name", ""))
