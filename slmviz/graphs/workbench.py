"""Reading an attribution graph as Neuronpedia's graph viewer lets people: pins, the subgraph of the pinned nodes
with its scores, supernodes, and feature labels; saved in circuit-tracer's graph JSON as that viewer stores them.

    g.pin("1_12_3", "0_40_2"); g.pin_top(10)       # by node id; the n most influential features
    g.supernode("say Paris", ["1_12_3", "1_7_5"])  # a named group of nodes
    sg = g.subgraph()                              # the pinned nodes, supernodes collapsed: .nodes, .links, .scores
    g.label("1_12_3", "says Paris"); g.labels      # edited labels win over the automatic ones
    g.save_json("graph.json"); g.load_json("graph.json")   # qParams (pinnedIds, supernodes) and clerp

**Subgraph scores (Neuronpedia's rule).** The pinned features stay features; every unpinned feature merges into
the error node of its layer and position (its outgoing edges are added to that error node's, its incoming ones
dropped, as an error node has none). circuit-tracer's replacement and completeness scores
(attribution_prune.graph_scores) of that merged graph are the subgraph's: pinning every feature gives the graph's
own scores; pinning none leaves only the tokens' direct edges into the logits free of error nodes. The
adjacency is the graph's kept one (its prune masks applied), which is what its JSON holds.

**Supernodes.** `[name, *node_ids]`, Neuronpedia's qParams form. In the subgraph a supernode is one node; the
edge between two supernodes (or a supernode and a node) is the sum of its members' edges.

**Labels.** A feature's label is per feature (layer, index), so every position of it shares one: an edited one
(`label(node, text)`) wins, then the transcoder's own edited label (`SAE.labels`), then the automatic one
(features.labels: the tokens it fires on in the feature scan given by `use_scans`, the tokens it promotes).
Labels go into each feature node's `clerp` in the JSON; loading the JSON back keeps the edited ones only (an
automatic one is recomputed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..features.labels import auto_labels, is_automatic
from .frozen import AttributionGraphError
from .prune import compute_influence, graph_scores, normalize_matrix


class WorkbenchError(AttributionGraphError):
    """Bad input to the workbench: an unknown node id, an empty or duplicate supernode, a JSON for another graph."""


def coders(graph: Any) -> dict[int, Any]:
    """{layer: transcoder} of the set the graph was built from (empty if it does not hold it)."""
    ts = graph.transcoders
    if ts is None:
        return {}
    return dict(getattr(ts, "coders", ts))


# --- node ids ---------------------------------------------------------------------------------------------------
def node_index(graph: Any) -> dict[str, int]:
    """{node_id: row} of every node of the graph (kept or not)."""
    cached = graph.__dict__.get("_node_index")
    if cached is None or len(cached) != len(graph.nodes):
        cached = {}
        for i, nid in enumerate(graph.nodes["node_id"].tolist()):
            # circuit-tracer's ids collide where a layer-0 feature "0_{f}_{p}" meets the error node "0_{L}_{p}" of
            # layer L = f: the feature (listed first) keeps the id.
            cached.setdefault(nid, i)
        graph.__dict__["_node_index"] = cached
    return cached


def checked_ids(graph: Any, node_ids: Any) -> list[str]:
    """The ids as a list of strings, each a node of the graph (WorkbenchError naming the first that is not)."""
    if isinstance(node_ids, str):
        node_ids = [node_ids]
    ids = [str(n).strip() for n in node_ids]
    index = node_index(graph)
    for nid in ids:
        if nid not in index:
            example = ", ".join(graph.nodes["node_id"].head(3))
            raise WorkbenchError(f"{nid!r} is not a node of this graph (node ids look like {example}: feature "
                                 f"layer_feature_position, error 0_layer_position, E_token_position, logits "
                                 f"{graph.n_layers + 1}_token_position)")
    return ids


def feature_key(graph: Any, node_id: str) -> str:
    """'layer_feature' of a feature node (what a label belongs to); WorkbenchError for another kind."""
    row = graph.nodes.iloc[node_index(graph)[node_id]]
    if row.kind != "feature":
        raise WorkbenchError(f"{node_id!r} is a {row.kind} node; only features have labels")
    return f"{int(row.layer)}_{int(row.feature)}"


# --- pins -------------------------------------------------------------------------------------------------------
def pin(graph: Any, *node_ids: str) -> list[str]:
    """Add the nodes to the pins (all checked before any is added); returns the pins."""
    ids = checked_ids(graph, [n for group in node_ids for n in ([group] if isinstance(group, str) else group)])
    for nid in ids:
        if nid not in graph.pinned:
            graph.pinned.append(nid)
    return list(graph.pinned)


def unpin(graph: Any, *node_ids: str) -> list[str]:
    """Remove the nodes from the pins and from every supernode (a supernode left empty goes)."""
    ids = set(checked_ids(graph, [n for group in node_ids for n in ([group] if isinstance(group, str) else group)]))
    graph.pinned[:] = [n for n in graph.pinned if n not in ids]
    graph.supernodes[:] = [[s[0], *[m for m in s[1:] if m not in ids]] for s in graph.supernodes
                           if any(m not in ids for m in s[1:])]
    return list(graph.pinned)


def clear(graph: Any) -> None:
    """No pins, no supernodes (labels stay)."""
    graph.pinned.clear()
    graph.supernodes.clear()


def node_influence(graph: Any) -> torch.Tensor:
    """Each node's influence on the logits (circuit-tracer's, through the kept adjacency; the logits' own
    probability added), as prune computes it."""
    def make() -> torch.Tensor:
        a = kept_adjacency(graph)
        n_logits = len(graph.logit_probabilities)
        weights = torch.zeros(a.shape[0])
        weights[a.shape[0] - n_logits:] = graph.logit_probabilities.float()
        return compute_influence(normalize_matrix(a), weights) + weights
    return _cached(graph, "_node_influence", make)


def top_features(graph: Any, n: int) -> list[str]:
    """The ids of the n kept feature nodes with the largest influence on the logits."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise WorkbenchError(f"n must be a positive whole number, got {n!r}")
    influence = node_influence(graph).numpy()
    kinds = graph.nodes["kind"].to_numpy()
    rows = np.nonzero((kinds == "feature") & graph.node_mask.numpy())[0]
    order = rows[np.argsort(-influence[rows], kind="stable")][:n]
    return graph.nodes["node_id"].to_numpy()[order].tolist()


def pin_top(graph: Any, n: int, logit: bool = False) -> list[str]:
    """Pin the n most influential kept features (see top_features); returns them. `logit`: pin the most probable
    logit too, so that the subgraph ends at the answer."""
    top = top_features(graph, n)
    logits = graph.nodes.loc[graph.nodes["kind"] == "logit", "node_id"]
    pin(graph, top + ([logits.iloc[0]] if logit and len(logits) else []))
    return top


# --- supernodes -------------------------------------------------------------------------------------------------
def supernode(graph: Any, name: str, members: Any = None) -> list[str]:
    """Group `members` (default: the pinned nodes in no supernode yet) under `name`; members are pinned too. A node
    belongs to one supernode at most: it leaves any other. Returns [name, *members]."""
    name = str(name or "").strip()
    if not name:
        raise WorkbenchError("A supernode needs a name")
    if any(s[0] == name for s in graph.supernodes):
        raise WorkbenchError(f"There is already a supernode named {name!r}; pick another name")
    if members is None:
        grouped = {m for s in graph.supernodes for m in s[1:]}
        members = [n for n in graph.pinned if n not in grouped]
    ids = list(dict.fromkeys(checked_ids(graph, members)))
    if not ids:
        raise WorkbenchError(f"The supernode {name!r} has no members: pin nodes first, or name them")
    pin(graph, ids)
    taken = set(ids)
    graph.supernodes[:] = [[s[0], *[m for m in s[1:] if m not in taken]] for s in graph.supernodes
                           if any(m not in taken for m in s[1:])]
    group = [name, *ids]
    graph.supernodes.append(group)
    return group


def remove_supernode(graph: Any, name: str) -> None:
    """Ungroup the supernode `name` (its members stay pinned)."""
    if not any(s[0] == name for s in graph.supernodes):
        raise WorkbenchError(f"No supernode is named {name!r}")
    graph.supernodes[:] = [s for s in graph.supernodes if s[0] != name]


# --- subgraph scores --------------------------------------------------------------------------------------------
def _cached(graph: Any, name: str, make: Any) -> Any:
    """A value computed once per graph and mask objects (prune returns a new graph with new masks)."""
    key = (id(graph.adjacency), id(graph.node_mask), id(graph.edge_mask))
    hit = graph.__dict__.get(name)
    if hit is None or hit[0] != key:
        hit = (key, make())
        graph.__dict__[name] = hit
    return hit[1]


def kept_adjacency(graph: Any) -> torch.Tensor:
    """The adjacency with the prune masks applied (what the graph's JSON links hold)."""
    def make() -> torch.Tensor:
        keep = graph.edge_mask & graph.node_mask[:, None] & graph.node_mask[None, :]
        return torch.where(keep, graph.adjacency, torch.zeros(()))
    return _cached(graph, "_kept_adjacency", make)


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
    pinned = graph.pinned if pinned is None else checked_ids(graph, pinned)
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
    labels = feature_labels(graph, graph.pinned)
    group_of = {m: s[0] for s in graph.supernodes for m in s[1:]}
    units: dict[str, list[str]] = {}
    for nid in graph.pinned:
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


# --- labels -----------------------------------------------------------------------------------------------------
def set_label(graph: Any, node_id: str, text: str | None) -> None:
    """Edit the label of a feature node's feature (every position of it); an empty text goes back to automatic."""
    (nid,) = checked_ids(graph, [node_id])
    key = feature_key(graph, nid)
    text = (text or "").strip()
    if text and not is_automatic(text):
        graph.user_labels[key] = text
    else:
        graph.user_labels.pop(key, None)


def feature_labels(graph: Any, node_ids: Any = None) -> dict[str, str]:
    """{node_id: label} of the feature nodes among `node_ids` (default: every kept feature node)."""
    nodes = graph.nodes
    if node_ids is None:
        rows = np.nonzero((nodes["kind"] == "feature").to_numpy() & graph.node_mask.numpy())[0]
    else:
        index = node_index(graph)
        rows = [index[n] for n in node_ids if nodes["kind"].iat[index[n]] == "feature"]
    part = nodes.iloc[list(rows)]
    cache = graph.__dict__.setdefault("_auto_labels", {})
    transcoders = coders(graph)
    scans = graph.scans or {}
    missing: dict[int, set[int]] = {}
    for layer, feature in zip(part["layer"].tolist(), part["feature"].tolist(), strict=True):
        key = (int(layer), int(feature), id(scans.get(int(layer))))
        if key not in cache:
            missing.setdefault(int(layer), set()).add(int(feature))
    for layer, feats in missing.items():
        sae = transcoders.get(layer)
        if sae is None:
            continue
        made = auto_labels(sae, sorted(feats), model=graph.model, scan=scans.get(layer))
        for f, text in made.items():
            cache[(layer, f, id(scans.get(layer)))] = text
    out = {}
    for nid, layer, feature in zip(part["node_id"], part["layer"].tolist(), part["feature"].tolist(), strict=True):
        layer, feature = int(layer), int(feature)
        sae = transcoders.get(layer)
        edited = graph.user_labels.get(f"{layer}_{feature}") or (sae.labels.get(feature) if sae is not None
                                                                 and hasattr(sae, "labels") else None)
        out[nid] = edited or cache.get((layer, feature, id(scans.get(layer))), "")
    return out


# --- the JSON's qParams and clerp -------------------------------------------------------------------------------
def annotate_json(graph: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Put the graph's pins and supernodes in `data`'s qParams (Neuronpedia's pinnedIds, supernodes), each listed
    feature node's label in its clerp, and what the graph was made for in metadata["info"] (model, transcoders),
    which load_json checks."""
    listed = [n["node_id"] for n in data["nodes"] if n["feature_type"] == "cross layer transcoder"]
    labels = feature_labels(graph, [n for n in listed if n in node_index(graph)])
    for node in data["nodes"]:
        if node["node_id"] in labels:
            node["clerp"] = labels[node["node_id"]]
    data["qParams"]["pinnedIds"] = list(graph.pinned)
    data["qParams"]["supernodes"] = [list(s) for s in graph.supernodes]
    data["metadata"]["info"] = {"generator": {"name": "slmviz"}, "model": graph.model_name,
                                "transcoders": list(graph.transcoder_names)}
    return data


def read_json(source: Any) -> dict[str, Any]:
    """A graph JSON from a path, a JSON string or a dict."""
    if isinstance(source, dict):
        return source
    try:
        text = Path(source).read_text() if not str(source).lstrip().startswith("{") else str(source)
        data = json.loads(text)
    except (OSError, ValueError) as e:
        raise WorkbenchError(f"Could not read a graph JSON from {str(source)[:80]!r}: {e}") from None
    if not isinstance(data, dict) or not {"metadata", "nodes"} <= set(data):
        raise WorkbenchError("This is not an attribution graph JSON (circuit-tracer's has metadata, qParams, nodes, "
                             "links)")
    return data


def load_json(graph: Any, source: Any) -> Any:
    """Apply a saved graph JSON's pins, supernodes and edited labels to `graph`, after checking it was made for
    the same model, transcoders and prompt (WorkbenchError otherwise, and the graph is left as it was)."""
    data = read_json(source)
    meta = data.get("metadata") or {}
    info = meta.get("info") or {}
    model = info.get("model")
    if model is not None and graph.model_name and model != graph.model_name:
        raise WorkbenchError(f"This JSON was made for the model {model!r}; this graph is of {graph.model_name!r}")
    saved_tc = meta.get("transcoder_list")
    if saved_tc is not None and list(saved_tc) != list(graph.transcoder_names):
        raise WorkbenchError(f"This JSON was made with the transcoders {', '.join(map(str, saved_tc)) or 'none'}; "
                             f"this graph's are {', '.join(graph.transcoder_names)}")
    tokens = meta.get("prompt_tokens")
    if tokens is not None and list(tokens) != list(graph.tokens):
        raise WorkbenchError(f"This JSON is the graph of another prompt ({meta.get('prompt')!r}); this graph is "
                             f"of {graph.prompt!r}")
    q = data.get("qParams") or {}
    pins = [str(n) for n in q.get("pinnedIds") or []]
    groups = q.get("supernodes") or []
    checked_ids(graph, pins)
    names: set[str] = set()
    for s in groups:
        if not isinstance(s, list) or len(s) < 2:
            raise WorkbenchError(f"A supernode is [name, node id, ...]; got {s!r}")
        if s[0] in names:
            raise WorkbenchError(f"Two supernodes are named {s[0]!r}")
        names.add(s[0])
        checked_ids(graph, s[1:])
    edited = {}
    index = node_index(graph)
    for node in data.get("nodes") or []:
        nid, clerp = node.get("node_id"), node.get("clerp") or ""
        if nid in index and node.get("feature_type") == "cross layer transcoder" and not is_automatic(clerp):
            edited[feature_key(graph, nid)] = clerp
    # every check passed: now replace the state
    graph.pinned[:] = list(dict.fromkeys(pins + [m for s in groups for m in s[1:]]))
    graph.supernodes[:] = [[str(s[0]), *map(str, s[1:])] for s in groups]
    graph.user_labels.clear()
    graph.user_labels.update(edited)
    return graph


__all__ = ["Subgraph", "WorkbenchError", "annotate_json", "clear", "feature_labels", "load_json",
           "merged_adjacency", "node_influence", "pin", "pin_top", "remove_supernode", "set_label", "subgraph",
           "subgraph_scores", "supernode", "top_features", "unpin"]
