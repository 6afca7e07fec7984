"""circuit-tracer's graph JSON (utils/create_graph_files.py and frontend/graph_models.py of circuit-tracer 0.5.0).

    {"metadata": {slug, scan, transcoder_list, prompt_tokens, prompt, node_threshold, schema_version},
     "qParams": {pinnedIds, supernodes, linkType, clickedId, sg_pos},
     "nodes": [{node_id, feature, layer, ctx_idx, feature_type, token_prob, is_target_logit, run_idx,
                reverse_ctx_idx, jsNodeId, clerp, influence, activation}, ...],
     "links": [{source, target, weight}, ...]}

Node ids, as circuit-tracer's frontend expects them: feature "{layer}_{feature}_{pos}", error "0_{layer}_{pos}",
embedding "E_{token id}_{pos}", logit "{n_layers + 1}_{token id}_{pos}". A feature's `feature` field is the Cantor
pairing of (layer, feature index); its `feature_type` is "cross layer transcoder" even for a per-layer transcoder
(what circuit-tracer writes). Only kept nodes with a kept edge are listed, plus every embedding and logit.
One difference: circuit-tracer names a custom transcoder list's scan "custom-" + Python's hash() of the joined names,
which is salted per process; here the number is a stable SHA-1 prefix, so the same transcoders give the same scan.
"""

from __future__ import annotations

import hashlib
from typing import Any

SCHEMA_VERSION = 1


def cantor_pairing(x: int, y: int) -> int:
    """circuit-tracer's unique integer for a (layer, feature) pair: (x + y)(x + y + 1)/2 + y."""
    return (x + y) * (x + y + 1) // 2 + y


def process_token(token: str) -> str:
    return token


def custom_scan(names: list[str]) -> str:
    digest = hashlib.sha1("-".join(names).encode()).hexdigest()[:15]
    return f"custom-{int(digest, 16)}"


def _node(row: Any, influence: float | None, n_layers: int, first_logit: bool) -> dict[str, Any]:
    kind, layer, pos, feature = row.kind, int(row.layer), int(row.position), int(row.feature)
    base = {"token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0, "clerp": "",
            "influence": influence, "activation": None}
    if kind == "feature":
        return {**base, "node_id": f"{layer}_{feature}_{pos}", "feature": cantor_pairing(layer, feature),
                "layer": str(layer), "ctx_idx": pos, "feature_type": "cross layer transcoder",
                "jsNodeId": f"{layer}_{feature}-0", "activation": float(row.activation)}
    if kind == "error":
        return {**base, "node_id": f"0_{layer}_{pos}", "feature": -1, "layer": str(layer), "ctx_idx": pos,
                "feature_type": "mlp reconstruction error", "jsNodeId": f"{layer}_{pos}-0"}
    if kind == "embedding":
        return {**base, "node_id": f"E_{feature}_{pos}", "feature": pos, "layer": "E", "ctx_idx": pos,
                "feature_type": "embedding", "jsNodeId": f"E_{feature}-{pos}"}
    p = float(row.probability)
    return {**base, "node_id": f"{n_layers + 1}_{feature}_{pos}", "feature": feature, "layer": str(n_layers + 1),
            "ctx_idx": pos, "feature_type": "logit", "token_prob": p, "is_target_logit": first_logit,
            "jsNodeId": f"L_{feature}-{pos}", "clerp": f'Output "{row.token}" (p={p:.3f})', "influence": None}


ORDER = ["node_id", "feature", "layer", "ctx_idx", "feature_type", "token_prob", "is_target_logit", "run_idx",
         "reverse_ctx_idx", "jsNodeId", "clerp", "influence", "activation"]


def graph_json(graph: Any, slug: str = "slmviz-graph", scan: str | None = None) -> dict[str, Any]:
    """The JSON dict of a pruned AttributionGraph (its node_mask, edge_mask and influence)."""
    nodes: dict[int, dict[str, Any]] = {}
    first_logit = int((graph.nodes["kind"] != "logit").sum())
    for i in graph.node_mask.nonzero().flatten().tolist():
        row = graph.nodes.iloc[i]
        node = _node(row, float(graph.influence[i]), graph.n_layers, i == first_logit)
        nodes[i] = {k: node[k] for k in ORDER}
    dsts, srcs = graph.edge_mask.numpy().nonzero()
    weights = graph.adjacency.numpy()[dsts, srcs].tolist()
    links = [{"source": nodes[s]["node_id"], "target": nodes[d]["node_id"], "weight": w}
             for s, d, w in zip(srcs.tolist(), dsts.tolist(), weights, strict=True) if s in nodes and d in nodes]
    connected = {link["source"] for link in links} | {link["target"] for link in links}
    used = [n for n in nodes.values() if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")]
    transcoders = list(graph.transcoder_names)
    metadata = {
        "slug": slug, "scan": scan if scan is not None else custom_scan(transcoders), "transcoder_list": transcoders,
        "prompt_tokens": [process_token(t) for t in graph.tokens], "prompt": graph.prompt,
        "node_threshold": graph.node_threshold, "schema_version": SCHEMA_VERSION,
    }
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": ""}
    return {"metadata": metadata, "qParams": qparams, "nodes": used, "links": links}
