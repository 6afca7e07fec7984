"""One SAE folder from the Hugging Face hub (SAELens or Gemma Scope 2 layout), fetched within a bounded time.

    folder = download("google/gemma-scope-2-270m-pt", "resid_post/layer_9_width_16k_l0_medium")

Only the layout's safetensors and JSON files are fetched; nothing is downloaded unless asked for by hub id.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from ..errors import SAEError
from . import gemma_scope, saelens

HUB_TIMEOUT_S = float(os.environ.get("SLMVIZ_HUB_TIMEOUT", "20"))  # the whole download attempt, not per request


def download(hub_id: str, subfolder: str | None, timeout_s: float = HUB_TIMEOUT_S) -> Path:
    """Fetch one SAE folder of a hub repo (SAELens or Gemma Scope 2 layout; safetensors and json only).

    The whole attempt is bounded by `timeout_s` (SLMVIZ_HUB_TIMEOUT): an unreachable hub is an error within it."""
    if not subfolder:
        raise SAEError(f"{hub_id!r}: a hub SAE needs subfolder=, e.g. 'resid_post/layer_9_width_16k_l0_medium'")
    if ".." in Path(subfolder).parts or Path(subfolder).is_absolute():
        raise SAEError(f"subfolder {subfolder!r} must be a relative path inside the repository")
    result: dict[str, Any] = {}

    def fetch() -> None:
        try:
            from huggingface_hub import hf_hub_download

            result["path"] = _fetch_folder(hf_hub_download, hub_id, subfolder, timeout_s)
        except Exception as e:  # the hub client raises many types (offline, 404, gated, timeouts)
            result["error"] = e

    worker = threading.Thread(target=fetch, name=f"load_sae {hub_id}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise SAEError(f"the Hugging Face hub did not answer for {hub_id}/{subfolder} within {timeout_s:.0f} s "
                       "(offline? set SLMVIZ_HUB_TIMEOUT to wait longer, or pass a local folder)")
    if "error" in result:
        e = result["error"]
        raise SAEError(f"could not fetch {hub_id}/{subfolder} from the Hugging Face hub: "
                       f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    return result["path"]


def _fetch_folder(hf_hub_download: Any, hub_id: str, subfolder: str, timeout_s: float) -> Path:
    """SAELens's two files if the folder has them, else Gemma Scope 2's (config.json is optional there)."""
    from huggingface_hub.utils import EntryNotFoundError

    def get(name: str) -> Path:
        return Path(hf_hub_download(hub_id, name, subfolder=subfolder, etag_timeout=min(10.0, timeout_s)))

    try:
        get(saelens.CFG_FILENAME)
        return get(saelens.WEIGHTS_FILENAME).parent
    except EntryNotFoundError:
        pass
    weights = get(gemma_scope.SAE_FILE)
    with contextlib.suppress(EntryNotFoundError):  # optional in Gemma Scope 2 folders
        get(gemma_scope.CONFIG)
    return weights.parent
