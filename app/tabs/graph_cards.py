"""What the graph workbench shows, as HTML and tables: a node's card, the subgraph's status line, the kept
features' table, an intervention's result. Pure functions of the graph and its state; no Gradio events here.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch

from slmviz.features.dashboard import top_contexts
from slmviz.graphs.workbench import WorkbenchError, feature_labels, node_index
from slmviz.hooks import layer_hook_name

TOP_LOGITS = 10
EDGES_SHOWN = 6


def esc(x: Any) -> str:
    return html.escape(str(x))


def split_ids(text: str | None) -> list[str]:
    """Node ids or supernode names separated by commas (or new lines)."""
    parts = (text or "").replace("\n", ",").split(",")
    return [p.strip() for p in parts if p.strip()]


def label_score(graph: Any, node: str) -> float | None:
    """The measured score of the node's label (graph.label_scores: detection balanced accuracy), or None."""
    try:
        score = (getattr(graph, "label_scores", None) or {}).get(node)
    except Exception:  # noqa: BLE001 - a graph without a deep scan has no scores
        return None
    return None if score is None or score != score else float(score)


def is_feature(graph: Any, node: str) -> bool:
    index = node_index(graph)
    return node in index and graph.nodes["kind"].iat[index[node]] == "feature"


def kept_features(pruned: Any) -> pd.DataFrame:
    """The pruned graph's kept feature nodes, most influential first (its `influence` order, stable on ties)."""
    nodes = pruned.kept_nodes
    nodes = nodes[nodes["kind"] == "feature"]
    if pruned.influence is not None:
        order = pruned.influence.numpy()[nodes.index.to_numpy()].argsort(kind="stable")
        nodes = nodes.iloc[order]
    return nodes


def node_table(pruned: Any, labels: dict[str, str]) -> pd.DataFrame:
    """The kept feature nodes, most influential first: node, layer, position, token, activation, label, pinned."""
    nodes = kept_features(pruned)
    pinned = set(pruned.pinned)
    return pd.DataFrame({"node": nodes["node_id"], "layer": nodes["layer"].astype(int),
                         "position": nodes["position"].astype(int), "token": nodes["token"],
                         "activation": nodes["activation"].round(3),
                         "label": [labels.get(n, "") for n in nodes["node_id"]],
                         "pinned": ["yes" if n in pinned else "" for n in nodes["node_id"]]})


def subgraph_status(pruned: Any, sg: Any) -> str:
    if not len(sg.nodes):
        return "**Subgraph:** nothing pinned yet. Pin nodes (click one, then **Pin / unpin**), or pin the top n."
    s = sg.scores
    groups = "; ".join(f"**{esc(g[0])}**: {', '.join(g[1:])}" for g in pruned.supernodes) or "none"
    return (f"**Subgraph:** {len(pruned.pinned)} pinned nodes shown as {len(sg.nodes)} (supernodes collapsed), "
            f"{len(sg.links)} edges among them. Replacement score **{s['replacement']:.3f}**, completeness "
            f"**{s['completeness']:.3f}** (unpinned features merged into the error node of their layer and position). "
            f"Supernodes: {groups}. Pinned: {', '.join(pruned.pinned)}.")


def _edges_html(graph: Any, i: int, incoming: bool, labels: dict[str, str]) -> str:
    a = graph.adjacency
    weights = a[i] if incoming else a[:, i]
    k = min(EDGES_SHOWN, int((weights != 0).sum()))
    if k == 0:
        return "<p><i>none</i></p>"
    top = weights.abs().topk(k).indices.tolist()
    ids = graph.nodes["node_id"].to_numpy()
    kinds = graph.nodes["kind"].to_numpy()
    tokens = graph.nodes["token"].to_numpy()
    rows = "".join(
        f"<tr><td>{esc(ids[j])}</td><td>{esc(kinds[j])}</td><td>{esc(labels.get(ids[j]) or repr(tokens[j]))}</td>"
        f"<td style='text-align:right;color:{'#2471a3' if float(weights[j]) > 0 else '#c0392b'}'>"
        f"{float(weights[j]):+.4g}</td></tr>" for j in top)
    head = "<tr><th>node</th><th>kind</th><th>label / token</th><th>weight</th></tr>"
    return f"<table class='wb-table'>{head}{rows}</table>"


def _error_norms(found: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """[n_layers, pos]: the norm of what each layer's transcoder misses (a layer without one: its whole MLP output),
    and [n_layers, pos] of the MLP output's own norm; from one traced run of the graph's tokens, kept on the
    GraphState."""
    if found.error_norms is None:
        graph, model = found.graph, found.model
        coders = dict(getattr(graph.transcoders, "coders", {}) or {})
        names = [layer_hook_name(L, "hook_mlp_out") for L in range(graph.n_layers)]
        names += [f"{sae.hook_name_out}.hook_sae_error" for sae in coders.values()]
        t = model.trace(graph.input_ids, saes=list(coders.values()), names=names)
        out = torch.stack([t[layer_hook_name(L, "hook_mlp_out")].float().norm(dim=-1) for L in range(graph.n_layers)])
        err = out.clone()
        for L, sae in coders.items():
            err[L] = t[f"{sae.hook_name_out}.hook_sae_error"].float().norm(dim=-1)
        found.error_norms = (err, out)
    return found.error_norms


def node_card(found: Any, pruned: Any, node: str, coder: Callable[[int], tuple[Any, Any, str]]) -> str:
    """The card of one node: what it is, its label, its strongest edges, and per kind: a feature's top contexts
    (the cached feature scan) and logit effects, an error node's norm and the transcoder that misses it. `found`
    is the tab's GraphState; `coder(layer)` is (the layer's transcoder, its cached feature scan or None, where
    that scan's text comes from).
    """
    graph = found.graph
    index = node_index(graph)
    if node not in index:
        raise WorkbenchError(f"{node!r} is not a node of this graph")
    i = index[node]
    r = graph.nodes.iloc[i]
    labels = feature_labels(pruned)
    pinned = "pinned" if node in graph.pinned else "not pinned"
    head = (f"<h4>{esc(r.kind)} {esc(node)} <small>({pinned})</small></h4><p>layer {esc(r.layer)}, position "
            f"{esc(r.position)}, token <code>{esc(repr(r.token))}</code>")
    parts = []
    if r.kind == "feature":
        layer, feature = int(r.layer), int(r.feature)
        name = found.layers.get(layer, r.hook)
        head += f", activation <b>{float(r.activation):.4g}</b>; feature {feature} of <b>{esc(name)}</b></p>"
        score = label_score(graph, node)
        scored = (f" <small>(score {score:.2f}: how well the label's own tokens and contexts pick out where the "
                  "feature fires, on held-out text; 0.5 is chance)</small>" if score is not None else
                  " <small>(no score: scores come with the set's deep scan)</small>")
        head += f"<p>Label: <b>{esc(graph.label(node))}</b>{scored}</p>"
        sae, scan, source = coder(layer)
        if scan is not None and sae is not None:
            contexts = top_contexts(scan, sae, feature).head(5)
            rows = "".join(f"<li>{esc(c).replace('[[', '<b>').replace(']]', '</b>')} "
                           f"<small>({a:.3g})</small></li>" for c, a in zip(contexts["context"],
                                                                           contexts["activation"], strict=True))
            parts.append(f"<h5>Top activating contexts <small>({esc(source)})</small></h5>"
                         f"<ol>{rows or '<li><i>it never fired</i></li>'}</ol>")
        else:
            parts.append(f"<p><i>No feature scan yet for this transcoder ({esc(source.split(': ', 1)[-1])}): "
                         "<b>Open its page</b> below scans the bundled verses once; its top contexts then show "
                         "here.</i></p>")
        if sae is not None:
            effects = sae.logit_effects(feature, k=5, model=found.model)
            for kind in ("promoted", "suppressed"):
                toks = ", ".join(f"<code>{esc(repr(t))}</code> {e:+.3g}"
                                 for t, e in zip(effects.loc[effects.kind == kind, "token"],
                                                 effects.loc[effects.kind == kind, "effect"], strict=True))
                parts.append(f"<p>Logit effects, {kind}: {toks}</p>")
    elif r.kind == "error":
        layer, pos = int(r.layer), int(r.position)
        err, out = _error_norms(found)
        name = found.layers.get(layer)
        missing = (f"what <b>{esc(name)}</b> misses of this MLP output" if name else
                   "no transcoder at this layer: the whole MLP output is error")
        share = float(err[layer, pos]) / max(float(out[layer, pos]), 1e-12)
        head += (f"</p><p>Norm <b>{float(err[layer, pos]):.4g}</b> ({share:.0%} of the MLP output's norm "
                 f"{float(out[layer, pos]):.4g}): {missing}.</p>")
        if pos == 0:
            head += "<p><i>Position 0's errors are left out of the graph (zero_bos).</i></p>"
    elif r.kind == "logit":
        head += f", probability <b>{float(r.probability):.3f}</b></p>"
    else:
        head += "</p>"
    parts.append("<h5>Strongest incoming edges</h5>" + _edges_html(graph, i, True, labels))
    parts.append("<h5>Strongest outgoing edges</h5>" + _edges_html(graph, i, False, labels))
    return f"<div class='wb-card'>{head}{''.join(parts)}</div>"


def intervention_rows(r: Any, k: int = TOP_LOGITS) -> pd.DataFrame:
    """The tokens of the top k before or after the intervention (the original's first, then the new ones), each
    with its probability and logit before and after and their changes."""
    before, after = r.original.float(), r.logits.float()
    p0, p1 = torch.softmax(before, -1), torch.softmax(after, -1)
    ids = list(dict.fromkeys(p0.topk(k).indices.tolist() + p1.topk(k).indices.tolist()))
    names = r.tokens(ids) if callable(r.tokens) else [str(i) for i in ids]
    return pd.DataFrame({"token": names, "prob": p0[ids].tolist(), "new prob": p1[ids].tolist(),
                         "change": (p1[ids] - p0[ids]).tolist(), "logit": before[ids].tolist(),
                         "new logit": after[ids].tolist(), "logit change": (after[ids] - before[ids]).tolist(),
                         "rank": [int((p0 > p0[i]).sum()) for i in ids],
                         "new rank": [int((p1 > p1[i]).sum()) for i in ids]})


def _signed(x: float, digits: int = 3) -> str:
    colour = "#2471a3" if x > 0 else "#c0392b" if x < 0 else "#555"
    return f"<td style='text-align:right;color:{colour}'>{x:+.{digits}f}</td>".replace("-", "−")


def intervention_html(r: Any, targets: list[str], mode: str) -> str:
    """One table: the top tokens before and after, each with its probability and logit before, after and the
    change; then the greedy continuations, original and new."""
    rows = intervention_rows(r)
    body = "".join(
        f"<tr><td>{int(x['rank'])} → {int(x['new rank'])}</td><td><code>{esc(repr(x['token']))}</code></td>"
        f"<td style='text-align:right'>{x['prob']:.3f}</td><td style='text-align:right'>{x['new prob']:.3f}</td>"
        f"{_signed(x['change'])}<td style='text-align:right'>{x['logit']:.3f}</td>"
        f"<td style='text-align:right'>{x['new logit']:.3f}</td>{_signed(x['logit change'])}</tr>"
        for x in rows.to_dict("records"))
    table = ("<table class='wb-table graph-intervention-table'><tr><th>rank</th><th>token</th><th>prob</th>"
             "<th>new prob</th><th>change</th><th>logit</th><th>new logit</th><th>logit change</th></tr>"
             f"{body}</table>")
    values = ", ".join(f"{esc(k)} = {v:.4g}" for k, v in r.values.items())
    crossed = ""
    if r.crossed:
        shown = ", ".join(esc(c) for c in r.crossed[:12]) + (f" and {len(r.crossed) - 12} more"
                                                             if len(r.crossed) > 12 else "")
        crossed = (f"<p><b>{len(r.crossed)} features crossed their threshold</b>, so the result leaves the graph's "
                   f"linear model: {shown}</p>")
    return (f"<div class='wb-intervention'><p>Set {values} ({esc(mode)}; {len(targets)} target(s)).</p>{crossed}"
            f"<h5>The top tokens before and after</h5>{table}"
            f"<p>Greedy continuation, original: <code>{esc(r.original_continuation)}</code><br>"
            f"with the edit: <code>{esc(r.continuation)}</code></p>"
            f"<p><small>The continuation always runs free (new tokens have no frozen patterns), with the edit at the "
            f"prompt's positions.</small></p></div>")
