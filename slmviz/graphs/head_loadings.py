"""Head loadings: how much of one edge of an attribution graph flows through each attention head's output
(Kamath et al., "Tracing Attention Computation Through Feature Interactions", 2025).

    hl = head_loadings(g, "3_120_2", "8_77_6")   # or g.head_loadings(source_id, target_id)
    hl                    # DataFrame: layer, head, weight, one_hop; largest |weight| first
    hl.attrs["edge"]      # the edge's weight in the graph
    hl.attrs["multi_head"]   # the part of the edge that goes through two or more heads

**What a loading is.** The graph's linear model (patterns, norm scales and error terms frozen, the features'
writes held) carries an edge from a source at one position to a target at a later one only through attention:
every path between them passes at least one head. Head (l, h)'s loading is the edge minus the edge computed again
with that head's output (`attn.hook_result` of l, head h, at every position) removed: the sum over the paths that
pass through it. In a linear model that is

    loading(l, h) = Σ_pos  ∂target/∂result[l, pos, h] · (the change of result[l, pos, h] per unit of the source)

the first factor from one backward from the target (every head at once), the second from one forward-mode pass
(torch.autograd.forward_ad) pushing the source's vector through the frozen forward (every head at once).

**Paths through two heads.** A path that passes two heads (head A moves the source to a middle position, head B
on to the target) counts in both loadings, so the loadings sum to the edge only where no path uses two heads (a
target one layer above the source, for instance). `one_hop` is the part of each loading whose path uses that head
alone: the same product in a second copy of the prompt (row 1 of both passes' batch) where every head's output is
cut from the residual stream (each head still reads its input, and nothing that another head wrote); Σ one_hop is
the part of the edge carried by one head, and attrs["multi_head"] = edge - Σ one_hop the part carried by two or
more.

An edge within one position has no loadings to speak of (the residual stream carries it past every head), and is
refused with a clear error, as are node ids not in the graph and pairs of nodes with no edge between them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.autograd.forward_ad as fwAD

from ..hooks import layer_hook_name
from .derived import node_index
from .frozen import AttributionGraphError, demeaned_unembed
from .sources import GraphSources, dead_ends, graph_sources, source_tangents
from .workbench import checked_ids

SOURCE_KINDS = ("feature", "error", "embedding")
TARGET_KINDS = ("feature", "logit")


class HeadLoadingsError(AttributionGraphError):
    """Bad input to head loadings: a source that writes nothing (a logit), a target that reads nothing (an error or
    an embedding), an edge within one position, a source after its target."""


def head_loadings(graph: Any, source_id: str, target_id: str) -> pd.DataFrame:
    """The loading of every (layer, head) on the edge source -> target of `graph` (module docstring): a DataFrame of
    layer, head, weight (the part of the edge through that head's output), one_hop (the part of it whose path uses
    no other head), largest |weight| first. attrs: source, target, edge (the graph's weight), through_heads
    (Σ weight), one_hop (Σ one_hop), multi_head (edge − Σ one_hop: through two heads or more), multi_head_share
    (multi_head / edge)."""
    source, target = checked_edge(graph, source_id, target_id)
    sources = graph_sources(graph)
    weight, one_hop, edge = loadings(sources, source, target)
    cfg = sources.model.cfg
    layer, head = np.divmod(np.arange(cfg.n_layers * cfg.n_heads), cfg.n_heads)
    w, o = weight.flatten().numpy(), one_hop.flatten().numpy()
    out = pd.DataFrame({"layer": layer, "head": head, "weight": w, "one_hop": o})
    out = out.iloc[np.argsort(-np.abs(w), kind="stable")].reset_index(drop=True)
    index = node_index(graph)
    graph_edge = float(graph.adjacency[index[str(target["node_id"])], index[str(source["node_id"])]])
    multi = graph_edge - float(o.sum())
    out.attrs.update({"source": str(source["node_id"]), "target": str(target["node_id"]), "edge": graph_edge,
                      "recomputed_edge": edge, "through_heads": float(w.sum()), "one_hop": float(o.sum()),
                      "multi_head": multi, "multi_head_share": multi / graph_edge if graph_edge else 0.0})
    return out


def checked_edge(graph: Any, source_id: str, target_id: str) -> tuple[pd.Series, pd.Series]:
    """The graph's rows of the two nodes, after checking that an edge between them crosses positions forward
    (HeadLoadingsError, or the workbench's error for an unknown id, otherwise)."""
    if graph.model is None:
        raise HeadLoadingsError("This graph does not hold its model (slmviz.attribution_graph keeps it); build it "
                                "again to split its edges over heads")
    src_id, tgt_id = checked_ids(graph, [source_id, target_id])
    index = node_index(graph)
    source, target = graph.nodes.iloc[index[src_id]], graph.nodes.iloc[index[tgt_id]]
    if source["kind"] not in SOURCE_KINDS:
        raise HeadLoadingsError(f"{src_id!r} is a {source['kind']} node: an edge starts at a feature, an error or an "
                                f"embedding")
    if target["kind"] not in TARGET_KINDS:
        raise HeadLoadingsError(f"{tgt_id!r} is a {target['kind']} node: an edge ends at a feature or a logit")
    ps, pt = int(source["position"]), int(target["position"])
    if ps == pt:
        raise HeadLoadingsError(
            f"the edge {src_id} -> {tgt_id} stays at position {ps}: the residual stream carries it directly, past "
            f"every head, so it has no head loadings (they split edges between positions, which only attention "
            f"moves); pick a source at an earlier position than its target")
    if ps > pt:
        raise HeadLoadingsError(f"{src_id!r} (position {ps}) comes after {tgt_id!r} (position {pt}): the causal mask "
                                f"leaves no edge from a later position to an earlier one")
    if target["kind"] == "feature" and int(source["layer"]) >= int(target["layer"]):
        raise HeadLoadingsError(f"{src_id!r} writes at layer {int(source['layer'])}, after layer "
                                f"{int(target['layer'])}'s features read their input: no edge between them")
    return source, target


def loadings(sources: GraphSources, source: pd.Series, target: pd.Series
             ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(weight [n_layers, n_heads], one_hop [n_layers, n_heads], the edge recomputed) for one source and target
    (rows of graph.nodes), float64 on the CPU: the product of the backward from the target and the forward-mode
    tangent from the source at each head's output. Both run on a batch of two copies of the prompt: row 0 the full
    linear model, row 1 with every head's output cut from the residual stream (`cut_heads`)."""
    cfg = sources.model.cfg
    last = int(target["layer"]) if target["kind"] == "feature" else None
    tangents = result_tangents(sources, source, last)
    grads, grad_in = result_grads(sources, target, last)
    per_head = torch.zeros(2, cfg.n_layers, cfg.n_heads, dtype=torch.float64)
    for layer, g in grads.items():
        per_head[:, layer] = torch.einsum("bphd,bphd->bh", g.double(), tangents[layer].double()).cpu()
    # the edge itself: the full row's gradient at the source's inputs times what the source writes there
    embed, deltas = source_tangents(sources, source)
    edge = float(sum((g[0].double() * t[0].double()).sum() for g, t in zip(grad_in, [embed, *deltas], strict=True)
                     if g is not None))
    return per_head[0], per_head[1], edge


def cut_heads(x: torch.Tensor, held: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """attn.hook_result [2, pos, h, d_model] with row 1's heads cut from what follows: row 1 becomes `held(row 1)`,
    its value unchanged but carrying nothing upstream along (the forward-mode tangent dropped, or the backward
    detached), so that in row 1 every path between the source and the target passes one head at most."""
    return torch.cat([x[:1], held(x[1:])])


def _result_hooks(n_layers: int, fn: Callable[[int], Callable], held: Callable[[torch.Tensor], torch.Tensor]
                  ) -> dict[str, Callable]:
    """Each head's output read (or cut) by `fn(layer)`, and the frozen forward's dead ends held (dead_ends)."""
    hooks = {layer_hook_name(layer, "attn.hook_result"): fn(layer) for layer in range(n_layers)}
    hooks.update(dead_ends(n_layers, held))
    return hooks


def result_tangents(sources: GraphSources, source: pd.Series, last_layer: int | None) -> dict[int, torch.Tensor]:
    """{layer: [2, pos, h, d_model]}: how each head's output (attn.hook_result) moves per unit of the source, by
    forward-mode AD through the frozen forward (row 1: heads cut, so a head sees the source along head-free paths
    only)."""
    model, state = sources.model, sources.state
    tangents: dict[int, torch.Tensor] = {}
    embed_dir, delta_dirs = source_tangents(sources, source)
    base_embed, base_deltas = sources.leaves(batch=2)

    def read(layer: int) -> Callable[[torch.Tensor, str], torch.Tensor]:
        def fn(x: torch.Tensor, name: str) -> torch.Tensor:
            primal, tangent = fwAD.unpack_dual(x)
            tangents[layer] = torch.zeros_like(primal) if tangent is None else tangent.detach().clone()
            return cut_heads(x, lambda rows: fwAD.unpack_dual(rows).primal)
        return fn

    with fwAD.dual_level(), warnings.catch_warnings():
        # torch's first make_dual loads its forward-AD decompositions through torch.jit.script, which warns that
        # it is deprecated: torch's own business, not the caller's
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*deprecated", category=DeprecationWarning)
        embed = fwAD.make_dual(base_embed, embed_dir.expand(2, -1, -1))
        deltas = [fwAD.make_dual(b, t.expand(2, -1, -1)) for b, t in zip(base_deltas, delta_dirs, strict=True)]
        sources.ts.frozen_forward(model, state, embed, deltas, grad=True, last_layer=last_layer,
                                  hooks=_result_hooks(_layers_run(model, last_layer), read,
                                                      lambda x: fwAD.unpack_dual(x).primal))
    return tangents


def result_grads(sources: GraphSources, target: pd.Series, last_layer: int | None
                 ) -> tuple[dict[int, torch.Tensor], list[torch.Tensor | None]]:
    """({layer: ∂target/∂attn.hook_result [2, pos, h, d_model]}, the target's gradient at [embed, *deltas], each [2,
    pos, d_model]) by one backward (row 1: heads cut, so the gradient runs along head-free paths only). Each head's
    output gets a zero leaf added, at which the gradient is read."""
    model, state, ts = sources.model, sources.state, sources.ts
    leaves: dict[int, torch.Tensor] = {}

    def tap(layer: int) -> Callable[[torch.Tensor, str], torch.Tensor]:
        def fn(x: torch.Tensor, name: str) -> torch.Tensor:
            leaves[layer] = torch.zeros_like(x, requires_grad=True)
            return cut_heads(x, torch.Tensor.detach) + leaves[layer]
        return fn

    embed, deltas = sources.leaves(batch=2, requires_grad=True)
    reads, normed = ts.frozen_forward(model, state, embed, deltas, grad=True, last_layer=last_layer,
                                      hooks=_result_hooks(_layers_run(model, last_layer), tap, torch.Tensor.detach))
    pos = int(target["position"])
    if target["kind"] == "feature":
        layer = int(target["layer"])
        vec = ts.encoder_rows(layer, torch.tensor([int(target["feature"])], device=embed.device))[0]
        value = (reads[layer][:, pos].float() @ vec).sum()  # the two rows are independent copies
    else:
        unembed = model.decoder.params.unembed
        vec = demeaned_unembed(unembed, torch.tensor([int(target["feature"])], device=unembed.device))[0]
        value = (normed[:, pos].float() @ vec).sum()
    layers = sorted(leaves)
    grads = torch.autograd.grad(value, [leaves[L] for L in layers] + [embed, *deltas], allow_unused=True)
    by_layer = {L: (torch.zeros_like(leaves[L]) if g is None else g) for L, g in zip(layers, grads, strict=False)}
    return by_layer, list(grads[len(layers):])


def _layers_run(model: Any, last_layer: int | None) -> int:
    """How many blocks a frozen forward stopping after `last_layer` runs (all of them for None)."""
    return model.cfg.n_layers if last_layer is None else last_layer + 1


__all__ = ["HeadLoadingsError", "head_loadings"]
