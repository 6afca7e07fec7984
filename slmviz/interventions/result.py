"""PatchResult, what a sweep returns, and the one-cell patched run it can replay (`run_cell`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ..hooks import HookFn
from ..variants import VariantLike, resolve_variant
from .sites import SITES, axis_sizes, site_hook_name, site_of


# --- the result ----------------------------------------------------------------------------------
@dataclass
class PatchResult:
    """A sweep: the metric after each single patch, the two unpatched metrics, and how to read them.

    `values` has the site's shape (see the module table). Partial results (while a sweep runs) hold NaN
    in the cells not computed yet; `done`/`total` count cells.
    """

    site: str
    values: torch.Tensor
    clean: float
    corrupted: float
    tokens: list[str]  # the target run's tokens (the prompt being patched into)
    source_tokens: list[str]  # the prompt the patched values come from
    direction: str = "denoise"
    method: str = "exact"
    metric_name: str = "metric"
    done: int = 0
    total: int = 0
    correlation: float | None = None  # attribution only: Pearson r with the exact sweep, when measured
    # What re-runs one cell (run_cell): the model, both prompts' ids, the variant.
    _run: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def dims(self) -> tuple[str, ...]:
        return ("layer", *SITES[self.site].axes)

    @property
    def complete(self) -> bool:
        return self.done >= self.total

    @property
    def normalized(self) -> torch.Tensor:
        """(values - corrupted) / (clean - corrupted): 1 = the clean metric, 0 = the corrupted one.

        The same formula in both directions, so noising reads 1 = no effect and 0 = fully destroyed.
        NaN everywhere when the two runs have the same metric (nothing to restore).
        """
        span = self.clean - self.corrupted
        if span == 0:
            return torch.full_like(self.values, float("nan"))
        return (self.values - self.corrupted) / span

    def frame(self) -> pd.DataFrame:
        """One row per cell: layer, position, token, head, value, normalized (head or position NA when unused)."""
        dims = self.dims
        values, normalized = self.values.reshape(-1).tolist(), self.normalized.reshape(-1).tolist()
        grid = torch.stack(torch.meshgrid(*[torch.arange(s) for s in self.values.shape], indexing="ij"), -1)
        grid = grid.reshape(-1, len(dims)).tolist()
        col = {d: i for i, d in enumerate(dims)}
        head_dim = "head" if "head" in col else "kv_head" if "kv_head" in col else None
        rows = {
            "layer": [g[0] for g in grid],
            "position": [g[col["position"]] if "position" in col else pd.NA for g in grid],
            "token": [self.tokens[g[col["position"]]] if "position" in col else "" for g in grid],
            "head": [g[col[head_dim]] if head_dim else pd.NA for g in grid],
            "value": values,
            "normalized": normalized,
        }
        frame = pd.DataFrame(rows)
        frame["position"] = frame["position"].astype("Int64")
        frame["head"] = frame["head"].astype("Int64")
        return frame

    def plot(self, **kwargs):
        """The diverging heatmap (layers x tokens, centred at 0); see slmviz.plots.patch.patch_heatmap."""
        from ..plots.patch import patch_heatmap

        return patch_heatmap(self, **kwargs)

    def run_cell(self, layer: int, position: int | None = None, head: int | None = None):
        """The patched run of one cell as a full Trace (e.g. `.top_tokens()`): one hooked forward."""
        if not self._run:
            raise RuntimeError("This result does not know its model (it was built by hand); call slmviz.patch")
        r = self._run
        return patched_trace(r["model"], r["target_ids"], r["source_ids"], self.site, layer, position, head,
                             r["variant"], r.get("saes"))

    def __repr__(self) -> str:
        shape = "x".join(map(str, self.values.shape))
        return (f"PatchResult({self.site}, {self.method}, {self.direction}, [{shape}], clean={self.clean:.4g}, "
                f"corrupted={self.corrupted:.4g}, {self.done}/{self.total} cells)")



def _writer(src: torch.Tensor, index: tuple) -> HookFn:
    """A hook fn writing src's cell into the run's value (a copy: the run's own tensor is left alone)."""

    def write(x: torch.Tensor, name: str) -> torch.Tensor:
        out = x.clone()
        out[index] = src[index]
        return out

    return write


def patched_trace(model: Any, target_ids: torch.Tensor, source_ids: torch.Tensor, site: str, layer: int,
                  position: int | None = None, head: int | None = None, variant: VariantLike = None,
                  saes: Any = None):
    """Trace the target prompt with one cell of `site` replaced by the source prompt's value there.

    `head` is a query head for z/q/pattern/heads and a KV head for k/v; `position` is unused by `heads`.
    """
    s = site_of(site)
    if not 0 <= int(layer) < model.cfg.n_layers:
        raise ValueError(f"layer must be in 0..{model.cfg.n_layers - 1}, got {layer!r}")
    given = {"position": position, "head": head, "kv_head": head}
    sizes = axis_sizes(s, model.cfg, target_ids.numel())[1:]
    if any(given[a] is None or not 0 <= int(given[a]) < n for a, n in zip(s.axes, sizes, strict=True)):
        want = ", ".join(f"{a} in 0..{n - 1}" for a, n in zip(s.axes, sizes, strict=True))
        raise ValueError(f"site {site!r} takes a cell ({want}); got position={position!r}, head={head!r}")
    cell = tuple(int(given[a]) for a in s.axes)
    name = site_hook_name(s, int(layer))
    v = resolve_variant(variant)
    source = model.trace(source_ids, variant=v, names=[name], saes=saes)
    return model.trace(target_ids, variant=v, names=[], hooks={name: _writer(source[name], s.index(cell))}, saes=saes)
