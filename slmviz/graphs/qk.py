"""QK attribution: why one attention head, at one query position, looks at one key position, split into pairs of
(query-side node, key-side node) of an attribution graph (Kamath et al., "Tracing Attention Computation Through
Feature Interactions", transformer-circuits.pub, 2025).

    qk = qk_attribution(g, layer=12, head=4, query=-1, key=3)   # or g.qk(...)
    qk.score, qk.pattern       # hook_attn_scores / hook_pattern of the model's own run at that entry
    qk.pairs                   # query_node, key_node, contribution, labels: largest |contribution| first
    qk.query_side, qk.key_side # node, contribution summed over the other side
    qk.plot()                  # the top query-side x key-side nodes as a heat map

**Why it splits exactly.** In the graph's linear model (attention patterns, norm scales, QK-norm scales and error
terms frozen at the prompt's values, the features' writes held), the query vector
`blocks.L.attn.hook_rot_q[query, head]` is an affine function of what every node writes into the residual stream:
the frozen ln1 divisor, W_q (+ its bias), the frozen q_norm divisor and RoPE at the query's position are all linear
(RoPE rotates by a fixed angle per position). So is the key vector `hook_rot_k[key, kv_head_of(head)]` at the key's
position. Write q = Σ_i q_i and k = Σ_j k_j over the nodes i, j plus one `bias` term per side (what no node writes:
b_dec, the attention and MLP biases; position 0's features and errors count towards its error nodes,
sources.score_sources); then

    score = scale · q · k = Σ_ij scale · q_i · k_j          scale = attention_scale(d_head, query_pre_attn_scalar)

and each pair's term is its contribution. q_i is one backward of d_head rows through the frozen forward from the
query vector (and k_j likewise, the two sides in one vmapped backward), multiplied by what node i writes where it
writes (sources.node_contributions); the bias term is the vector minus the nodes' sum, computed, never assumed.
Zeroing node i (constrained) moves the score by −(Σ_j scale q_i·k_j + Σ_j scale q_j·k_i) + scale q_i·k_i.

The score the pairs sum to is the linear model's (`linear_score`); it equals the model's own `score` to float
rounding, because the frozen forward run on the prompt's own inputs is the prompt's run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..hooks import build_context, layer_hook_name
from ..model.attention import attention_scale, kv_head_of
from ..variants import resolve_variant
from .frozen import AttributionGraphError
from .sources import GraphSources, SourceNodes, dead_ends, labels_of, node_contributions, score_sources, source_nodes

MAX_PAIRS = 10_000  # pairs listed by default; the rest are one row, so the listed contributions still sum exactly
OTHER_PAIRS = "(other pairs)"
PAIR_CHUNK = 2**22  # pair contributions computed at once while the largest are picked (32 MB of float64)


class QKAttributionError(AttributionGraphError):
    """Bad input to a QK attribution: a layer, head or position out of range, a masked entry (a key after the
    query, or outside a sliding window)."""


@dataclass
class QKAttribution:
    """The split of one attention score over pairs of graph nodes (module docstring).

    `score`, `pattern`: the model's own hook_attn_scores / hook_pattern at (layer, head, query, key); where the
    family soft-caps its scores (Gemma 2: cap · tanh(s / cap), model.attention.softcap), `score` is the score before
    the cap, the one bilinear in q and k that the pairs split, and `capped_score` the model's hook_attn_scores beside
    it (None for families without a cap);
    `linear_score`: the graph's linear model's score, what `pairs.contribution` sums to (equal to `score` to float
    rounding); `scale`: the score's factor (1/√d_head, Gemma's query_pre_attn_scalar^-0.5).
    `nodes`: node_id, kind (feature | error | embedding | bias), layer, position, feature, in_graph, label;
    `query_vectors` / `key_vectors` [n_nodes, d_head] (float64): each node's part of the rotated query / key vector
    (hook_rot_q / hook_rot_k, before the scale), rows in `nodes`' order; a node that cannot reach that side (a later
    position or layer) has a zero row. `pairs`, `query_side`, `key_side`: DataFrames (their docstrings)."""

    layer: int
    head: int
    query: int
    key: int
    kv_head: int
    score: float
    pattern: float
    linear_score: float
    scale: float
    nodes: pd.DataFrame
    query_vectors: torch.Tensor
    key_vectors: torch.Tensor
    pairs: pd.DataFrame
    query_side: pd.DataFrame
    key_side: pd.DataFrame
    full: bool = False
    tokens: list[str] = field(default_factory=list)
    capped_score: float | None = None

    def __repr__(self) -> str:
        return (f"QKAttribution(layer {self.layer} head {self.head}, query {self.query} -> key {self.key}: score "
                f"{self.score:.4g}, pattern {self.pattern:.3f}; {len(self.query_side)} query-side x "
                f"{len(self.key_side)} key-side nodes)")

    def frame(self) -> pd.DataFrame:
        """The pairs (query_node, key_node, contribution, labels), largest |contribution| first."""
        return self.pairs

    def plot(self, n: int = 12, **kwargs: Any):
        """The top `n` query-side x top `n` key-side nodes as a heat map of their pair contributions (plotly)."""
        from ..plots.qk import qk_figure

        query_rows, key_rows, block = top_block(self, n)
        return qk_figure(self, query_rows, key_rows, block, **kwargs)

    def to_json(self, n: int = 20) -> dict[str, Any]:
        """A compact record for a graph JSON's extra field (`qk_json`): the entry, its scores, the top `n` pairs and
        the top `n` nodes of each side."""
        return qk_json(self, n)


def qk_attribution(graph: Any, layer: int, head: int, query: int = -1, key: int = 0, full: bool = False,
                   max_pairs: int | None = MAX_PAIRS) -> QKAttribution:
    """The QK attribution of head `head` of layer `layer` at entry (query, key) of `graph`'s prompt (positions as in
    graph.nodes, negative ones from the end). `full`: every active feature is its own node (default: features the
    graph pruned away merge into the error node of their layer and position). `max_pairs`: the pairs listed (the
    largest |contribution| first); the others, if any, are one last row (OTHER_PAIRS) holding their sum, so the
    listed contributions sum to the score all the same (None: list every pair)."""
    model = graph.model
    if model is None:
        raise QKAttributionError("This graph does not hold its model (slmviz.attribution_graph keeps it); build it "
                                 "again to attribute its attention")
    layer, head, query, key = checked_entry(model.cfg, len(graph.input_ids), layer, head, query, key)
    if max_pairs is not None and (not isinstance(max_pairs, int) or isinstance(max_pairs, bool) or max_pairs < 1):
        raise QKAttributionError(f"max_pairs must be a positive whole number or None, got {max_pairs!r}")
    score, pattern, capped = model_entry(model, graph.input_ids, layer, head, query, key)
    sources = score_sources(graph)
    nodes = source_nodes(graph, sources, full)
    q_vecs, k_vecs = attention_vectors(sources, nodes, layer, head, query, key)
    cfg = model.cfg
    scale = attention_scale(cfg.d_head, cfg.query_pre_attn_scalar)
    q_total, k_total = q_vecs.sum(0), k_vecs.sum(0)
    linear_score = float(scale * (q_total @ k_total))
    on_q = torch.nonzero(q_vecs.abs().sum(1) > 0).flatten()  # nodes that reach the query vector
    on_k = torch.nonzero(k_vecs.abs().sum(1) > 0).flatten()
    table = nodes.table.copy()
    table["label"] = ""
    touched = torch.unique(torch.cat([on_q, on_k])).numpy()
    table.loc[touched, "label"] = labels_of(graph, table.iloc[touched])
    query_side = side_frame(table, on_q, scale * (q_vecs[on_q] @ k_total))
    key_side = side_frame(table, on_k, scale * (k_vecs[on_k] @ q_total))
    pairs = pairs_frame(table, on_q, on_k, scale * q_vecs[on_q], k_vecs[on_k], linear_score, max_pairs)
    return QKAttribution(layer=layer, head=head, query=query, key=key,
                         kv_head=kv_head_of(head, cfg.n_heads // cfg.n_kv_heads), score=score, pattern=pattern,
                         linear_score=linear_score, scale=scale, nodes=table, query_vectors=q_vecs,
                         key_vectors=k_vecs, pairs=pairs, query_side=query_side, key_side=key_side, full=full,
                         tokens=list(graph.tokens), capped_score=capped)


def checked_entry(cfg: Any, n_pos: int, layer: Any, head: Any, query: Any, key: Any) -> tuple[int, int, int, int]:
    """(layer, head, query, key) as non-negative ints, or QKAttributionError naming what is out of range; a key
    after the query is a masked entry (the causal mask: a score of -inf, nothing to attribute)."""
    def whole(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise QKAttributionError(f"{name} must be a whole number, got {v!r}")
        return int(v)

    layer, head, query, key = (whole(n, v) for n, v in (("layer", layer), ("head", head), ("query", query),
                                                        ("key", key)))
    if not 0 <= layer < cfg.n_layers:
        raise QKAttributionError(f"layer {layer} is out of range: the model has layers 0..{cfg.n_layers - 1}")
    if not 0 <= head < cfg.n_heads:
        raise QKAttributionError(f"head {head} is out of range: each layer has heads 0..{cfg.n_heads - 1}")
    for name, p in (("query", query), ("key", key)):
        if not -n_pos <= p < n_pos:
            raise QKAttributionError(f"{name} position {p} is out of range: the prompt has positions 0..{n_pos - 1} "
                                     f"(negative ones count from the end)")
    query, key = query % n_pos, key % n_pos
    if key > query:
        raise QKAttributionError(f"key {key} is after query {query}: the causal mask hides that entry (its score is "
                                 f"-inf), so there is nothing to attribute; pick a key at or before the query")
    return layer, head, query, key


def model_entry(model: Any, input_ids: Any, layer: int, head: int, query: int,
                key: int) -> tuple[float, float, float | None]:
    """(score, hook_pattern, capped score) of the model's own run at the entry (the run stops after that layer):
    score is hook_attn_scores, or, where the family soft-caps scores, the score before the cap (scale · rot_q · rot_k
    of that run) with hook_attn_scores as the capped score (else None).
    QKAttributionError where the entry is masked by a sliding window (a masked score holds -inf or the dtype's most
    negative value)."""
    names = [layer_hook_name(layer, "attn.hook_attn_scores"), layer_hook_name(layer, "attn.hook_pattern"),
             layer_hook_name(layer, "attn.hook_rot_q"), layer_hook_name(layer, "attn.hook_rot_k")]
    ids = torch.tensor(list(input_ids), dtype=torch.long)
    ctx = build_context(model.hook_names, names, batched=True)
    with torch.inference_mode():
        model.decoder.forward(ids[None], ctx, resolve_variant(None, model.cfg), stop_after_layer=layer)
    t = {name: ctx.store[name][0] for name in names}  # [h, pos_q, pos_k] each
    score = t[names[0]][head, query, key]
    if not torch.isfinite(score) or score <= torch.finfo(score.dtype).min:
        raise QKAttributionError(f"layer {layer} masks key {key} for query {query} (a sliding-window layer: it sees "
                                 f"the query's own token and the {model.cfg.sliding_window} - 1 before it); pick a "
                                 f"key inside the window")
    pattern = float(t[names[1]][head, query, key])
    cfg = model.cfg
    if cfg.attn_softcap is None:
        return float(score), pattern, None
    q, k = t[names[2]][query, head].double(), t[names[3]][key, kv_head_of(head, cfg.n_heads // cfg.n_kv_heads)].double()
    return float(attention_scale(cfg.d_head, cfg.query_pre_attn_scalar) * (q @ k)), pattern, float(score)


def attention_vectors(sources: GraphSources, nodes: SourceNodes, layer: int, head: int, query: int, key: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's part of the rotated query vector at (query, head) and key vector at (key, kv_head_of(head)) of
    layer `layer`, as ([n_nodes, d_head], [n_nodes, d_head]) float64 on the CPU, bias rows included.

    One forward of the frozen replacement model up to that layer, reading hook_rot_q / hook_rot_k (after the frozen
    QK-norm and RoPE at each side's own position: exactly what the scores multiply), then one backward of 2·d_head
    rows (vmapped; row by row where an op has no batching rule) to the embedding and to every earlier MLP output."""
    model, state = sources.model, sources.state
    cfg = model.cfg
    kv = kv_head_of(head, cfg.n_heads // cfg.n_kv_heads)
    read: dict[str, torch.Tensor] = {}

    def keep(side: str) -> Callable[[torch.Tensor, str], None]:
        def fn(x: torch.Tensor, name: str) -> None:
            read[side] = x
        return fn

    hooks = {**dead_ends(layer, torch.Tensor.detach),  # the layers before: their scores and MLPs go nowhere
             layer_hook_name(layer, "attn.hook_rot_q"): keep("q"), layer_hook_name(layer, "attn.hook_rot_k"): keep("k")}
    embed, deltas = sources.leaves(requires_grad=True)
    sources.ts.frozen_forward(model, state, embed, deltas, grad=True, last_layer=layer, hooks=hooks)
    rot_q, rot_k = read["q"], read["k"]  # [1, pos, h, dh], [1, pos, g, dh]
    dh, rows = cfg.d_head, 2 * cfg.d_head
    eye = torch.eye(dh, dtype=rot_q.dtype, device=rot_q.device)
    seed_q = torch.zeros((rows, *rot_q.shape), dtype=rot_q.dtype, device=rot_q.device)  # [2dh, 1, pos, h, dh]
    seed_k = torch.zeros((rows, *rot_k.shape), dtype=rot_k.dtype, device=rot_k.device)  # [2dh, 1, pos, g, dh]
    seed_q[:dh, 0, query, head] = eye
    seed_k[dh:, 0, key, kv] = eye
    inputs = [embed, *deltas[:layer]]  # what enters the residual stream before layer `layer`'s attention
    grads = batched_grads([rot_q, rot_k], inputs, [seed_q, seed_k])
    n_pos = sources.n_pos
    g_embed = grads[0].reshape(rows, n_pos, -1)
    g_layers = [None if g is None else g.reshape(rows, n_pos, -1) for g in grads[1:]]
    parts = node_contributions(sources, nodes, g_embed, g_layers).double().cpu()  # [2dh, n_nodes]
    q_vecs, k_vecs = parts[:dh].T.contiguous(), parts[dh:].T.contiguous()  # [n_nodes, dh] each
    # the bias: what the vector holds beyond every node's part (computed, not assumed: a test checks it against
    # the biases' own propagation)
    q_vecs[nodes.bias] = rot_q[0, query, head].detach().double().cpu() - q_vecs.sum(0)
    k_vecs[nodes.bias] = rot_k[0, key, kv].detach().double().cpu() - k_vecs.sum(0)
    return q_vecs, k_vecs


def batched_grads(outputs: list[torch.Tensor], inputs: list[torch.Tensor], seeds: list[torch.Tensor]
                  ) -> list[torch.Tensor | None]:
    """The gradients of `outputs` for each row of `seeds` ([rows, *output.shape] each), per input as [rows,
    *input.shape] (None where nothing flows): one vmapped backward (is_grads_batched), or, where an op has no
    batching rule, one backward per row (attribution.attribute_rows falls back the same way)."""
    try:
        return list(torch.autograd.grad(outputs, inputs, seeds, retain_graph=True, allow_unused=True,
                                        is_grads_batched=True))
    except RuntimeError as e:
        if "vmap" not in str(e) and "batch" not in str(e).lower():
            raise
    per_row = [torch.autograd.grad(outputs, inputs, [s[r] for s in seeds], retain_graph=True, allow_unused=True)
               for r in range(seeds[0].shape[0])]
    return [None if per_row[0][i] is None else torch.stack([g[i] for g in per_row]) for i in range(len(inputs))]


def side_frame(table: pd.DataFrame, rows: torch.Tensor, contribution: torch.Tensor) -> pd.DataFrame:
    """node, kind, layer, position, in_graph, label, contribution of the nodes `rows`, largest |contribution| first."""
    part = table.iloc[rows.numpy()]
    values = contribution.numpy()
    out = pd.DataFrame({"node": part["node_id"].to_numpy(), "kind": part["kind"].to_numpy(),
                        "layer": part["layer"].to_numpy(), "position": part["position"].to_numpy(),
                        "in_graph": part["in_graph"].to_numpy(), "label": part["label"].to_numpy(),
                        "contribution": values})
    return out.iloc[np.argsort(-np.abs(values), kind="stable")].reset_index(drop=True)


def pairs_frame(table: pd.DataFrame, on_q: torch.Tensor, on_k: torch.Tensor, q_scaled: torch.Tensor,
                k_vecs: torch.Tensor, linear_score: float, max_pairs: int | None) -> pd.DataFrame:
    """query_node, key_node, contribution, query_kind, key_kind, query_label, key_label of the `max_pairs` pairs of
    largest |contribution| (all of them with None), largest first; when some are left out, a last OTHER_PAIRS row
    holds their sum (the linear score minus the listed pairs), so the column sums to the linear score."""
    n_total = len(on_q) * len(on_k)
    limit = n_total if max_pairs is None else min(max_pairs, n_total)
    qi, kj, values = largest_pairs(q_scaled, k_vecs, limit)
    ids, kinds, labels = (table[c].to_numpy() for c in ("node_id", "kind", "label"))
    qn, kn = on_q.numpy()[qi], on_k.numpy()[kj]
    out = pd.DataFrame({"query_node": ids[qn], "key_node": ids[kn], "contribution": values,
                        "query_kind": kinds[qn], "key_kind": kinds[kn], "query_label": labels[qn],
                        "key_label": labels[kn]})
    if limit < n_total:
        rest = {"query_node": OTHER_PAIRS, "key_node": OTHER_PAIRS, "contribution": linear_score - float(values.sum()),
                "query_kind": "", "key_kind": "", "query_label": f"{n_total - limit} more pairs", "key_label": ""}
        out = pd.concat([out, pd.DataFrame([rest])], ignore_index=True)
    return out


def largest_pairs(q: torch.Tensor, k: torch.Tensor, n: int, chunk: int = PAIR_CHUNK
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row of q, row of k, q_i · k_j) of the n pairs of largest |q_i · k_j|, largest first (ties in row order),
    computed a block of rows at a time: an unpruned graph's pairs can number in the tens of millions."""
    n_q, n_k = q.shape[0], k.shape[0]
    if n == 0 or n_q == 0 or n_k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0)
    step = max(1, chunk // n_k)
    best_flat = torch.zeros(0, dtype=torch.long)
    best_val = torch.zeros(0, dtype=q.dtype)
    for start in range(0, n_q, step):
        block = (q[start:start + step] @ k.T).flatten()  # [rows, n_k] flattened
        top = torch.topk(block.abs(), min(n, block.numel()), sorted=False).indices
        best_flat = torch.cat([best_flat, top + start * n_k])
        best_val = torch.cat([best_val, block[top]])
        if len(best_flat) > n:
            keep = torch.topk(best_val.abs(), n, sorted=False).indices
            best_flat, best_val = best_flat[keep], best_val[keep]
    flat, values = best_flat.numpy(), best_val.numpy()
    order = np.lexsort((flat, -np.abs(values)))  # largest |value| first, then row-major order
    flat, values = flat[order], values[order]
    return flat // n_k, flat % n_k, values


def top_block(qk: QKAttribution, n: int = 12) -> tuple[pd.DataFrame, pd.DataFrame, np.ndarray]:
    """(the top `n` rows of query_side, of key_side, their pair contributions [n_q, n_k]): what the heat map shows,
    every pair among the sides' largest nodes whether or not `pairs` lists it."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise QKAttributionError(f"n must be a positive whole number, got {n!r}")
    at = {(k, nid): i for i, (k, nid) in enumerate(zip(qk.nodes["kind"], qk.nodes["node_id"], strict=True))}
    rows = {}
    for side in ("query", "key"):
        frame = getattr(qk, f"{side}_side").head(n)
        rows[side] = (frame, [at[k, nid] for k, nid in zip(frame["kind"], frame["node"], strict=True)])
    (q_frame, q_rows), (k_frame, k_rows) = rows["query"], rows["key"]
    block = qk.scale * (qk.query_vectors[q_rows] @ qk.key_vectors[k_rows].T)  # [n_q, n_k]
    return q_frame, k_frame, block.numpy()


def qk_json(qk: QKAttribution, n: int = 20) -> dict[str, Any]:
    """A QK attribution as JSON-ready data, for a graph JSON's extra `qk_attributions` field (workbench.QK_FIELD;
    circuit-tracer's server hands the file over as it is, and its viewer's save rewrites qParams only): the entry,
    score, pattern, linear score, and the top `n` rows of pairs and of each side."""
    def rows(df: pd.DataFrame, cols: list[str]) -> list[dict[str, Any]]:
        return [{c: (round(float(v), 6) if c == "contribution" else (v.item() if hasattr(v, "item") else v))
                 for c, v in zip(cols, r, strict=True)} for r in df[cols].head(n).itertuples(index=False)]

    side_cols = ["node", "label", "contribution"]
    return {"layer": qk.layer, "head": qk.head, "query": qk.query, "key": qk.key,
            "score": _finite(qk.score), "pattern": _finite(qk.pattern), "linear_score": _finite(qk.linear_score),
            "pairs": rows(qk.pairs, ["query_node", "key_node", "query_label", "key_label", "contribution"]),
            "query_side": rows(qk.query_side, side_cols), "key_side": rows(qk.key_side, side_cols)}


def _finite(x: float) -> float | None:
    return round(float(x), 6) if math.isfinite(x) else None


__all__ = ["MAX_PAIRS", "OTHER_PAIRS", "QKAttribution", "QKAttributionError", "qk_attribution", "qk_json",
           "top_block"]
