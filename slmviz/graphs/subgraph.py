"""The subgraph of a graph's pinned nodes, as Neuronpedia's graph viewer shows it: supernodes collapsed into one node
each, and the subgraph's replacement and completeness scores.

    g.pin_top(8, logit=True); g.supernode("capital", [...])
    sg = g.subgraph()                              # .nodes, .links, .scores, .plot()

**Subgraph scores (Neuronpedia's rule).** The pinned features stay features; every unpinned feature merges into
the error node of its layer and position (its outgoing edges are added to that error node's, its incoming ones
dropped, as an error node has none). circuit-tracer's replacement and completeness scores (prune.graph_scores) of
that merged graph are the subgraph's: pinning every feature gives the graph's own scores; pinning none leaves only
the tokens' direct edges into the logits free of error nodes. The adjacency is the graph's kept one (its prune
masks applied), which is what its JSON holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from .derived import kept_adjacency, node_index
from .prune import graph_scores
from .workbench import checked_ids, feature_labels


def merged_adjacency(graph: Any, pinned: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Neuronpedia's merge: (adjacency over [pinned features, errors, embeddings, logits], the rows of the graph
    they came from (an error's row stands for its merged group), the number of pinned features)."""
    a = kept_adjacency(graph)
    kinds = graph.nodes["kind"].to_numpy()
    index = node_index(graph)
    pinned_rows = {index[n] for n in pinned}
    n_feat = int((kinds == "feature").sum())
    layer, pos = graph.nodes["layer"].to_numpy(), graph.nodes["position"].to_numpy()
    n_pos = len(graph.tokens)
    keep = [i for i in range(n_feat) if i in pinned_rows] + list(range(n_feat, len(kinds)))
    rows = torch.tensor(keep)
    n_pinned = len(keep) - (len(kinds) - n_feat)
    merged = a[rows][:, rows]  # [kept, kept]: the pinned features, then every error, embedding and logit
    # each unpinned feature's outgoing edges now leave its error node; features the masks dropped have no edges
    kept_mask = graph.node_mask.numpy()
    unpinned = [i for i in range(n_feat) if i not in pinned_rows and kept_mask[i]]
    if unpinned:
        u = torch.tensor(unpinned)
        errs = torch.tensor(n_pinned + layer[unpinned].astype(np.int64) * n_pos + pos[unpinned].astype(np.int64))
        merged.index_add_(1, errs, a[rows][:, u])
    return merged, rows, n_pinned


def subgraph_scores(graph: Any, pinned: Any = None) -> dict[str, float]:
    """circuit-tracer's replacement and completeness of the graph with every unpinned feature merged into the error
    node of its layer and position (Neuronpedia's subgraph scores). `pinned`: node ids (default: the graph's pins;
    only the features among them matter)."""
    pinned = graph.workbench.pinned if pinned is None else checked_ids(graph, pinned)
    a, _, n_feat = merged_adjacency(graph, pinned)
    kinds = graph.nodes["kind"].to_numpy()
    return graph_scores(a, graph.logit_probabilities, n_feat, int((kinds == "error").sum()),
                        int((kinds == "embedding").sum()))


@dataclass
class Subgraph:
    """The pinned nodes of an attribution graph, each supernode one node. `nodes`: node_id (a supernode's name for
    a supernode), kind ("supernode" or the node's), label, layer, position (a supernode's: its members' mean),
    members (list of node ids); `links`: source, target, weight (summed over members), largest |weight| first;
    `scores`: Neuronpedia's subgraph replacement and completeness (subgraph_scores)."""

    nodes: pd.DataFrame
    links: pd.DataFrame
    scores: dict[str, float]
    prompt: str = ""
    tokens: tuple[str, ...] = ()
    n_layers: int = 0

    def __repr__(self) -> str:
        return (f"Subgraph({len(self.nodes)} nodes, {len(self.links)} links; replacement "
                f"{self.scores['replacement']:.3f}, completeness {self.scores['completeness']:.3f})")

    def plot(self, **kwargs: Any):
        """The subgraph's nodes by position and layer with their labels, edges width |weight| (plotly Figure)."""
        from ..plots.subgraph import subgraph_figure

        return subgraph_figure(self, **kwargs)


def subgraph(graph: Any) -> Subgraph:
    """The graph's pinned nodes and the edges among them, supernodes collapsed (edges summed over members)."""
    index = node_index(graph)
    a = kept_adjacency(graph)
    wb = graph.workbench
    labels = feature_labels(graph, wb.pinned)
    group_of = {m: s[0] for s in wb.supernodes for m in s[1:]}
    units: dict[str, list[str]] = {}
    for nid in wb.pinned:
        units.setdefault(group_of.get(nid, nid), []).append(nid)
    kind_of, layer_of = graph.nodes["kind"].to_numpy(), graph.nodes["layer"].to_numpy()
    pos_of, token_of = graph.nodes["position"].to_numpy(), graph.nodes["token"].to_numpy()
    groups = set(group_of.values())
    rows = []
    for unit, members in units.items():
        at = [index[m] for m in members]
        if unit in groups:
            rows.append({"node_id": unit, "kind": "supernode", "label": unit,
                         "layer": float(layer_of[at].mean()), "position": float(pos_of[at].mean()),
                         "members": members, "member_kinds": "/".join(sorted(set(kind_of[at])))})
        else:
            i = at[0]
            kind = str(kind_of[i])
            label = labels.get(unit) or (token_of[i] if kind in ("embedding", "logit") else
                                         f"error at layer {layer_of[i]}")
            rows.append({"node_id": unit, "kind": kind, "label": label, "layer": float(layer_of[i]),
                         "position": float(pos_of[i]), "members": members, "member_kinds": kind})
    nodes = pd.DataFrame(rows, columns=["node_id", "kind", "label", "layer", "position", "members", "member_kinds"])
    names = list(units)
    at = torch.tensor([index[m] for name in names for m in units[name]], dtype=torch.long)  # members' rows
    member = torch.zeros(len(names), len(at))  # [units, members]: 1 where a member belongs to a unit
    start = 0
    for u, name in enumerate(names):
        member[u, start:start + len(units[name])] = 1.0
        start += len(units[name])
    summed = member @ a[at][:, at] @ member.T  # [units, units]: target unit <- source unit, members' edges summed
    summed.fill_diagonal_(0.0)
    tgt, src = torch.nonzero(summed, as_tuple=True)
    links = [(names[s], names[t], float(summed[t, s])) for t, s in zip(tgt.tolist(), src.tolist(), strict=True)]
    links_df = pd.DataFrame(links, columns=["source", "target", "weight"])
    if len(links_df):
        links_df = links_df.iloc[np.argsort(-links_df["weight"].abs().to_numpy(), kind="stable")]
    return Subgraph(nodes=nodes, links=links_df.reset_index(drop=True), scores=subgraph_scores(graph),
                    prompt=graph.prompt, tokens=tuple(graph.tokens), n_layers=graph.n_layers)


__all__ = ["Subgraph", "merged_adjacency", "subgraph", "subgraph_scores"]
