"""Patching sites: which hook a sweep patches, the axes of one cell, and the result's shape.

The table of sites and shapes is in slmviz.interventions.patching's docstring (and docs/interventions.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..hooks import layer_hook_name


@dataclass(frozen=True)
class Site:
    """One kind of activation a sweep patches: the block-local hook and the axes of one cell."""

    hook: str  # block-local hook name, e.g. "attn.hook_z"
    axes: tuple[str, ...]  # the result's dims after "layer": "position", "head" (h) or "kv_head" (g)
    description: str
    head_first: bool = False  # the hook tensor is [h, pos_q, pos_k] (the pattern), not [pos, heads, ...]

    def index(self, cell: tuple[int, ...]) -> tuple:
        """Where one cell (without its layer) sits in the batch-free hook tensor."""
        if self.axes == ("position",):
            return (cell[0],)  # [pos, d_model] -> row p
        if self.axes == ("head",):
            return (slice(None), cell[0])  # [pos, h, d_head] -> head h at every position
        pos, head = cell
        return (head, pos) if self.head_first else (pos, head)

    def cell_sums(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a batch-free per-element tensor (e.g. delta · gradient) over each cell: -> the cells' shape."""
        if self.head_first:
            return x.sum(-1).transpose(0, 1)  # [h, pos_q, pos_k] -> [pos, h]
        if self.axes == ("head",):
            return x.sum((0, -1))  # [pos, h, d_head] -> [h]
        return x.sum(-1)  # [pos, d_model] -> [pos]; [pos, h|g, d_head] -> [pos, h|g]


SITES: dict[str, Site] = {
    "resid_pre": Site("hook_resid_pre", ("position",), "the residual stream entering block L"),
    "resid_mid": Site("hook_resid_mid", ("position",), "the residual stream between attention and MLP"),
    "resid_post": Site("hook_resid_post", ("position",), "the residual stream leaving block L"),
    "attn_out": Site("hook_attn_out", ("position",), "the attention sub-layer's write into the residual"),
    "mlp_out": Site("hook_mlp_out", ("position",), "the MLP sub-layer's write into the residual"),
    "z": Site("attn.hook_z", ("position", "head"), "one head's attention-weighted values at one position"),
    "q": Site("attn.hook_q", ("position", "head"), "one head's query at one position (before RoPE)"),
    "pattern": Site("attn.hook_pattern", ("position", "head"),
                    "one head's attention row for query position p", head_first=True),
    "k": Site("attn.hook_k", ("position", "kv_head"), "one KV head's key at one position (before RoPE)"),
    "v": Site("attn.hook_v", ("position", "kv_head"), "one KV head's value at one position"),
    "heads": Site("attn.hook_z", ("head",), "one head's z at every position at once"),
}
"""Site name (`site=` of `slmviz.patch`) -> Site. A sweep at a site returns [n_layers, *axes]: `resid_pre`,
`resid_mid`, `resid_post`, `attn_out`, `mlp_out` -> [n_layers, pos]; `z`, `q`, `pattern` -> [n_layers, pos, h];
`k`, `v` -> [n_layers, pos, g] (KV groups, never padded to h); `heads` -> [n_layers, h]."""


def site_of(name: str) -> Site:
    if name not in SITES:
        raise ValueError(f"Unknown patching site {name!r}; sites are: {', '.join(SITES)}, and 'sae' (SAE features, "
                         "with saes=[...])")
    return SITES[name]


def axis_sizes(site: Site, cfg: Any, n_pos: int) -> tuple[int, ...]:
    """The result shape: [n_layers, *site axes]."""
    size = {"position": n_pos, "head": cfg.n_heads, "kv_head": cfg.n_kv_heads}
    return (cfg.n_layers, *(size[a] for a in site.axes))


def site_hook_name(site: Site, layer: int) -> str:
    return layer_hook_name(layer, site.hook)
