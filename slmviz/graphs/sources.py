"""What each source node of an attribution graph writes into its replacement model, rebuilt from the graph's model,
transcoder set and prompt: the vectors that QK attributions (qk.py) and head loadings (head_loadings.py) trace
through the frozen forward.

A graph keeps its edges, not its nodes' vectors. They come back exactly from the calls attribution_graph made: the
prompt's run (`prompt_state`) and the set's active features and error terms (`active_features`, with the graph's own
`zero_bos`). Where a source enters the replacement model (TranscoderSet.frozen_forward):

    embedding at position p     embed[p]                      (hook_embed, Gemma's scale included)
    error of layer L at p       deltas[L][p] += error[L][p]   (the MLP output the set misses)
    feature of layer L at p     deltas[j][p] += a · W_dec ... for each layer j it writes (j = L for a PLT)

What no node writes (b_dec, the attention and MLP biases) stays in the forward as a constant; the decompositions call
it the `bias` node and compute it as the whole minus the nodes, never assume it. Position 0's features and errors,
which a graph built with zero_bos leaves out of its edges, are a choice of each decomposition (`score_sources`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..hooks import layer_hook_name
from .derived import node_index
from .frozen import AttributionGraphError, PromptState, Writes, active_features, checked_transcoders, prompt_state
from .workbench import feature_labels

BIAS = "bias"  # the node id of what no node writes, one per side of a decomposition


@dataclass
class GraphSources:
    """The rebuilt sources of one graph: `state` (the prompt's frozen run), every active feature (`f_layer`,
    `f_pos`, `f_idx`, `f_act` [n], in attribution_graph's order), their `writes`, and `errors` [n_layers, pos,
    d_model] (fp32, zero at position 0 with zero_bos), on the model's device."""

    model: Any
    ts: Any
    state: PromptState
    f_layer: torch.Tensor
    f_pos: torch.Tensor
    f_idx: torch.Tensor
    f_act: torch.Tensor
    writes: Writes
    errors: torch.Tensor

    @property
    def n_pos(self) -> int:
        return len(self.state.ids)

    def feature_index(self) -> dict[tuple[int, int, int], int]:
        """{(layer, feature, position): index among the active features}."""
        keys = zip(self.f_layer.tolist(), self.f_idx.tolist(), self.f_pos.tolist(), strict=True)
        return {k: i for i, k in enumerate(keys)}

    def leaves(self, batch: int = 1, requires_grad: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(embed [batch, pos, d_model], deltas: n_layers zeros [batch, pos, d_model]) in the model's dtype: the
        prompt's own inputs of the frozen forward, with which it reproduces the prompt's run."""
        dtype, dev = self.model.dtype, self.state.embed.device
        embed = self.state.embed[None].expand(batch, -1, -1).clone().requires_grad_(requires_grad)
        shape = (batch, self.n_pos, self.state.embed.shape[-1])
        deltas = [torch.zeros(shape, dtype=dtype, device=dev, requires_grad=requires_grad)
                  for _ in range(self.model.cfg.n_layers)]
        return embed, deltas


def graph_sources(graph: Any, zero_bos: bool | None = None) -> GraphSources:
    """Rebuild `graph`'s sources from the model and set it holds (AttributionGraphError if it holds none, or if its
    feature nodes are not the set's active features on its prompt: a set changed since the graph was built).

    `zero_bos`: leave position 0's features and errors out, as the graph did (None: the graph's own choice, which
    reproduces its edges); False keeps them (score_sources)."""
    model, transcoders = graph.model, graph.transcoders
    if model is None or transcoders is None:
        raise AttributionGraphError("This graph does not hold its model and transcoders (slmviz.attribution_graph "
                                    "keeps them); build it again to look inside its attention")
    zero_bos = graph.zero_bos if zero_bos is None else zero_bos
    # kept in the graph's cache: every QK attribution or head loading of the graph reads the same run (the key names
    # the model and set objects, so a graph given another set rebuilds)
    name = f"sources:{id(model)}:{id(transcoders)}:{zero_bos}"
    return graph.derived(name, lambda: _rebuilt_sources(graph, model, transcoders, zero_bos))


def _rebuilt_sources(graph: Any, model: Any, transcoders: Any, zero_bos: bool) -> GraphSources:
    ts = checked_transcoders(transcoders, model)
    ids = torch.tensor(graph.input_ids, dtype=torch.long)
    state = prompt_state(model, ids, ts)
    f_layer, f_pos, f_idx, f_act, _, writes, errors = active_features(ts, state, model.cfg.n_layers, zero_bos)
    sources = GraphSources(model, ts, state, f_layer, f_pos, f_idx, f_act, writes, errors)
    index = sources.feature_index()
    feats = graph.nodes[graph.nodes["kind"] == "feature"]
    missing = [nid for nid, key in zip(feats["node_id"], zip(feats["layer"], feats["feature"], feats["position"],
                                                                 strict=True), strict=True)
               if tuple(map(int, key)) not in index]
    if missing:
        raise AttributionGraphError(f"{len(missing)} feature nodes of this graph (e.g. {missing[0]!r}) are not active "
                                    f"in its transcoders on its prompt: the set changed since the graph was built; "
                                    f"build the graph again")
    return sources


def score_sources(graph: Any) -> GraphSources:
    """The sources a QK attribution splits a score over: the graph's, with position 0's features and error kept
    even where the graph left them out of its edges (zero_bos). They count towards the error nodes of their layers
    at position 0 (a feature there merges like any feature the graph does not hold, or stands alone with full=True),
    so the `bias` node holds the biases alone.

    Why: position 0 carries the model's massive activations (the attention sink), and most heads read it. Left out,
    its MLP outputs would land in `bias` on both sides and make it the largest node of nearly every score, saying
    nothing about where they come from. Head loadings keep the graph's own choice instead: their edges must be the
    graph's. Pinned by tests/test_qk.py::test_the_bias_node_is_what_the_biases_alone_propagate."""
    return graph_sources(graph, zero_bos=False)


@dataclass
class SourceNodes:
    """The nodes a decomposition splits into, in this order: features, one error node per (layer, position), one
    embedding per position, and `bias`. `table`: node_id, kind, layer, position, feature, in_graph (whether the
    node is one of the graph's kept nodes). `feature_node` [n active features]: the node each active feature's
    writes count towards (its own, or the error node of its layer and position where it is merged)."""

    table: pd.DataFrame
    feature_node: torch.Tensor
    error_offset: int
    embed_offset: int

    @property
    def bias(self) -> int:
        return len(self.table) - 1


def source_nodes(graph: Any, sources: GraphSources, full: bool = False) -> SourceNodes:
    """The decomposition's nodes. A feature is its own node when the graph keeps it (its prune mask), or, with
    `full`, whenever it is active; otherwise it merges into the error node of its layer and position, as in the
    workbench's subgraph scores (a cross-layer feature, which writes several layers, into its own layer's). Error
    nodes and embeddings are always listed, kept or not: what they write has nowhere else to go."""
    n_layers, n_pos = sources.model.cfg.n_layers, sources.n_pos
    nodes, mask = graph.nodes, graph.node_mask.numpy()
    kept_keys = {(int(r.layer), int(r.feature), int(r.position)) for r in nodes[(nodes["kind"] == "feature").to_numpy()
                                                                               & mask].itertuples()}
    keys = list(zip(sources.f_layer.tolist(), sources.f_idx.tolist(), sources.f_pos.tolist(), strict=True))
    own = [full or k in kept_keys for k in keys]
    n_own = int(sum(own))
    error_offset, embed_offset = n_own, n_own + n_layers * n_pos
    feature_node = torch.tensor([0] * len(keys), dtype=torch.long)
    rows: list[dict[str, Any]] = []
    for i, ((layer, feat, pos), is_own) in enumerate(zip(keys, own, strict=True)):
        if is_own:
            feature_node[i] = len(rows)
            rows.append({"node_id": f"{layer}_{feat}_{pos}", "kind": "feature", "layer": layer, "position": pos,
                         "feature": feat, "in_graph": (layer, feat, pos) in kept_keys})
        else:
            feature_node[i] = error_offset + layer * n_pos + pos
    kept_ids = set(zip(nodes.loc[mask, "kind"], nodes.loc[mask, "node_id"], strict=True))  # a layer-0 feature's id
    # 0_f_p can also be an error node's 0_L_p (circuit-tracer's ids), hence the kind
    for layer in range(n_layers):
        for pos in range(n_pos):
            nid = f"0_{layer}_{pos}"
            rows.append({"node_id": nid, "kind": "error", "layer": layer, "position": pos, "feature": -1,
                         "in_graph": ("error", nid) in kept_ids})
    for pos, tok in enumerate(graph.input_ids):
        nid = f"E_{int(tok)}_{pos}"
        rows.append({"node_id": nid, "kind": "embedding", "layer": -1, "position": pos, "feature": int(tok),
                     "in_graph": ("embedding", nid) in kept_ids})
    rows.append({"node_id": BIAS, "kind": BIAS, "layer": -1, "position": -1, "feature": -1, "in_graph": False})
    table = pd.DataFrame(rows, columns=["node_id", "kind", "layer", "position", "feature", "in_graph"])
    return SourceNodes(table, feature_node.to(sources.state.embed.device), error_offset, embed_offset)


def node_contributions(sources: GraphSources, nodes: SourceNodes, grad_embed: torch.Tensor,
                       grad_layers: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """[rows, n_nodes] fp32: each row's gradient (`grad_embed` [rows, pos, d_model] at the embedding, `grad_layers[L]`
    [rows, pos, d_model] at layer L's MLP output, None where nothing flows) times what each node writes there,
    summed over the places it writes. The bias column is left 0 for the caller to fill (the whole minus the nodes).

    A feature's writes are grouped by (layer, position): each group is one [rows, d] @ [d, n] product; multiplying
    [rows, pos, d] by every write of a layer would multiply by every other position too."""
    w = sources.writes
    rows, n_pos = grad_embed.shape[0], sources.n_pos
    out = torch.zeros(rows, len(nodes.table), device=grad_embed.device)
    per_feature = torch.zeros(rows, len(sources.f_layer), device=grad_embed.device)
    write_pos = sources.f_pos[w.node]
    for layer, grad in enumerate(grad_layers):
        if grad is None:
            continue
        grad = grad.float()
        on_layer = (w.layer == layer).nonzero(as_tuple=True)[0]
        for pos in write_pos[on_layer].unique().tolist():
            idx = on_layer[write_pos[on_layer] == pos]
            per_feature.index_add_(1, w.node[idx], (grad[:, pos] @ w.table[w.row[idx]].T) * w.scale[idx])
        at = nodes.error_offset + layer * n_pos
        out[:, at:at + n_pos] += torch.einsum("rpd,pd->rp", grad, sources.errors[layer])
    out.index_add_(1, nodes.feature_node, per_feature)
    out[:, nodes.embed_offset:nodes.embed_offset + n_pos] = torch.einsum(
        "rpd,pd->rp", grad_embed.float(), sources.state.embed.float())
    return out


def dead_ends(n_layers: int, held: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Callable]:
    """Hooks that hand what the frozen forward computes and throws away its value alone (`held`: the primal of a
    forward-mode dual, or a detached tensor), so that neither pass spends work on it: the MLP (its output is
    replaced by the prompt's plus the skip path, which the set reads from the MLP's input before this hook runs:
    the hooks given to frozen_forward run after its own) and the queries and keys (the pattern they would make is
    replaced by the prompt's). The values are unchanged, and so is what reaches a target or a read (tests compare QK
    attributions and head loadings with the model's own run and brute-force recomputations)."""
    names = [layer_hook_name(layer, local) for layer in range(n_layers)
             for local in ("mlp.hook_in", "attn.hook_q", "attn.hook_k")]
    return {name: (lambda x, _name: held(x)) for name in names}


def source_tangents(sources: GraphSources, node: pd.Series) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(embed [1, pos, d_model], deltas) holding only what graph node `node` (a row of graph.nodes: a feature, an
    error or an embedding) writes, in the model's dtype: the direction a forward-mode pass pushes through the frozen
    forward to follow that one node."""
    embed, deltas = sources.leaves()
    embed = torch.zeros_like(embed)
    kind, layer, pos = str(node["kind"]), int(node["layer"]), int(node["position"])
    if kind == "embedding":
        embed[0, pos] = sources.state.embed[pos]
    elif kind == "error":
        deltas[layer][0, pos] = sources.errors[layer][pos].to(deltas[layer].dtype)
    elif kind == "feature":
        i = sources.feature_index()[(layer, int(node["feature"]), pos)]
        w = sources.writes
        for j in (w.node == i).nonzero(as_tuple=True)[0].tolist():
            deltas[int(w.layer[j])][0, pos] += w.vec(torch.tensor([j], device=w.node.device))[0].to(embed.dtype)
    else:
        raise AttributionGraphError(f"{node['node_id']!r} is a {kind} node, which writes nothing into the model")
    return embed, deltas


def labels_of(graph: Any, table: pd.DataFrame) -> np.ndarray:
    """A label per row of a node table: a feature's (graph.labels: edited, else automatic; "" for a feature the
    graph does not hold), the token of an embedding, "error L{layer}" of an error node, "bias" of the bias node."""
    index = node_index(graph)
    feats = [n for n, k in zip(table["node_id"], table["kind"], strict=True) if k == "feature" and n in index]
    feature_label = feature_labels(graph, feats) if feats else {}
    tokens = graph.tokens
    out = []
    for nid, kind, layer, pos in zip(table["node_id"], table["kind"], table["layer"], table["position"], strict=True):
        if kind == "feature":
            out.append(feature_label.get(nid, ""))
        elif kind == "embedding":
            out.append(tokens[int(pos)])
        elif kind == "error":
            out.append(f"error L{int(layer)}")
        else:
            out.append(BIAS)
    return np.array(out, dtype=object)


__all__ = ["BIAS", "GraphSources", "SourceNodes", "dead_ends", "graph_sources", "labels_of", "node_contributions",
           "score_sources", "source_nodes", "source_tangents"]
