"""Interventions on an attribution graph's features: set features to values at their positions and rerun the model
(circuit-tracer's feature_intervention), constrained or free.

    g.intervene({"1_12_3": 0.0}, constrained=True)         # new logits at the last position: tensor [vocab]
    r = intervene(g, {"say Paris": "-1x"}, constrained=False, continuation=8)
    r.logits, r.original, r.crossed, r.top(), r.continuation

Values are interventions, not modes: `{node_id or supernode name: value}` goes in, logits come out.
A value is a number (the feature's new activation) or a multiple of the node's activation in the prompt: "0",
"-1x", "2x", "0.5x" (also "−1×"). A supernode sets each of its feature members.

Both modes run the real model with every transcoder of the graph spliced in (`m.trace(ids, saes=...)`, error terms
on) and the edited features written at `{hook_name_out}.hook_sae_acts_post`. They differ in what is frozen, which is
the table FROZEN below, applied through ordinary hook fns that return the prompt's own values:

- **constrained**: every attention pattern (`attn.hook_pattern`), every norm's divisor (`*.hook_scale`), each
  transcoder's error term (`hook_sae_error`) and the MLP output of each layer without a transcoder
  (`hook_mlp_out`, all error in the graph) are the prompt's. Every other feature is recomputed by its encoder from
  its (changed) input. This is the graph's local replacement model, so setting a feature moves every target by the
  sum over paths of the edges taken per unit of each intermediate feature's activation, as long as no feature
  crosses its threshold (turns on or off, or leaves a topk set); `crossed` names those that do.
- **free**: nothing frozen: the model recomputes attention, norms and the MLPs, and the error term follows the
  new MLP input (x_out - recons of the unedited transcoder, recomputed).

The greedy `continuation` always runs free (a new token has no frozen pattern), with the edit applied to the
prompt's positions in the prefill only.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ..hooks import layer_hook_name
from .derived import node_index
from .frozen import AttributionGraphError, frozen_names
from .workbench import checked_ids, coders

FROZEN = {  # mode -> what keeps the prompt's value (see the module docstring)
    True: ("attention patterns", "norm scales", "transcoder error terms", "MLP outputs of layers without one"),
    False: (),
}


class InterventionError(AttributionGraphError):
    """Bad input to an intervention: a node that is not a feature, a value that is not a finite number."""


class ThresholdCrossed(UserWarning):
    """A constrained intervention turned features on or off: its result leaves the graph's linear model."""


@dataclass
class Intervention:
    """The result of `intervene`: `logits` [vocab] at the last position with the edit, `original` [vocab] without;
    `values` {node_id: activation set}; `crossed` the features ('layer_feature_position', with "on"/"off") whose
    activity changed in a constrained run; `continuation` / `original_continuation` the greedy texts (if asked)."""

    logits: torch.Tensor
    original: torch.Tensor
    values: dict[str, float]
    constrained: bool
    crossed: list[str] = field(default_factory=list)
    continuation: str | None = None
    original_continuation: str | None = None
    tokens: Any = None  # fn(ids) -> strings, to name the top tokens

    def top(self, k: int = 10) -> pd.DataFrame:
        """The k top tokens before and after: rank, token, logit, prob, new token, new logit, new prob."""
        out = {}
        for what, logits in (("", self.original), ("new ", self.logits)):
            probs = torch.softmax(logits.float(), -1)
            top = probs.topk(min(k, probs.numel()))
            ids = top.indices.tolist()
            names = self.tokens(ids) if self.tokens else [str(i) for i in ids]
            out[f"{what}token"] = names
            out[f"{what}logit"] = [round(float(logits[i]), 4) for i in ids]
            out[f"{what}prob"] = [round(float(p), 4) for p in top.values]
        return pd.DataFrame({"rank": range(len(out["token"])), **out})


def parse_value(value: Any, activation: float, node_id: str) -> float:
    """A number, or a multiple of the node's activation ("2x", "-1x", "0.5×"), as the activation to set."""
    text = str(value).strip().replace("−", "-").replace("×", "x").replace(" ", "") if isinstance(value, str) else None
    try:
        if text is not None and text.lower().endswith("x"):
            x = float(text[:-1]) * activation
        else:
            x = float(text if text is not None else value)
    except (TypeError, ValueError):
        raise InterventionError(f"The value for {node_id!r} must be a number or a multiple like '2x' or '-1x', got "
                                f"{value!r}") from None
    if not math.isfinite(x):
        raise InterventionError(f"The value for {node_id!r} must be a finite number, got {value!r}")
    return x


def resolve(graph: Any, values: dict[str, Any]) -> dict[str, float]:
    """{feature node_id: activation to set} from {node_id or supernode name: value} (all checked first)."""
    if not isinstance(values, dict) or not values:
        raise InterventionError("An intervention is a dict {node_id or supernode name: value}, with at least one")
    groups = {s[0]: s[1:] for s in graph.workbench.supernodes}
    nodes = graph.nodes
    index = node_index(graph)
    out: dict[str, float] = {}
    for key, value in values.items():
        if key in groups and key not in index:
            members = [m for m in groups[key] if nodes["kind"].iat[index[m]] == "feature"]
            if not members:
                raise InterventionError(f"The supernode {key!r} has no feature among its members; only features can "
                                        f"be set")
        else:
            members = checked_ids(graph, [key])
            kind = nodes["kind"].iat[index[members[0]]]
            if kind != "feature":
                raise InterventionError(f"{key!r} is a {kind} node; only feature nodes can be set (an error node is "
                                        f"what the transcoders miss, it has no activation to change)")
        for m in members:
            out[m] = parse_value(value, float(nodes["activation"].iat[index[m]]), m)
    return out


def constrained_hooks(model: Any, transcoders: dict[int, Any]) -> dict[str, list[str]]:
    """The hooks a constrained run keeps at the prompt's values (FROZEN), by part: "patterns" (every attention
    pattern), "scales" (every norm's divisor) and "errors" (each transcoder's error term, and the MLP output of each
    layer without a transcoder). Summary checks freeze the same hooks; bench/studies/summary_disagreement.py frees
    them part by part."""
    names = frozen_names(model.hook_names)
    errors = [f"{sae.hook_name_out}.hook_sae_error" for sae in transcoders.values()]
    errors += [layer_hook_name(L, "hook_mlp_out") for L in range(model.cfg.n_layers) if L not in transcoders]
    return {"patterns": [n for n in names if n.endswith("attn.hook_pattern")],
            "scales": [n for n in names if n.endswith("hook_scale")], "errors": errors}


def feature_edits(graph: Any, chosen: dict[str, float]) -> dict[int, list[tuple[int, int, float]]]:
    """{layer: [(position, feature, value)]} of {feature node_id: value} (summary checks build theirs here too)."""
    nodes, index = graph.nodes, node_index(graph)
    by_layer: dict[int, list[tuple[int, int, float]]] = {}
    for nid, v in chosen.items():
        r = nodes.iloc[index[nid]]
        by_layer.setdefault(int(r.layer), []).append((int(r.position), int(r.feature), v))
    return by_layer


def _edit_fn(edits: list[tuple[int, int, float]], n_pos: int | None = None):
    """A hook on hook_sae_acts_post [pos, d_sae] setting f[p, feature] = value. With n_pos, only on a call that
    sees all n_pos prompt positions (generation's prefill), not on the steps after it."""
    def fn(x: torch.Tensor, name: str) -> torch.Tensor:
        if n_pos is not None and x.shape[0] != n_pos:
            return x
        x = x.clone()
        for p, f, v in edits:
            x[p, f] = v
        return x
    return fn


def intervene(graph: Any, values: dict[str, Any], constrained: bool = True, continuation: int = 0) -> Intervention:
    """Set features of `graph` and rerun its model (see the module docstring); `continuation`: greedy tokens to
    generate with and without the edit (0: none)."""
    model, transcoders = graph.model, coders(graph)
    if model is None or not transcoders:
        raise InterventionError("This graph does not hold its model and transcoders (slmviz.attribution_graph "
                                "keeps them); build it again to intervene")
    chosen = resolve(graph, values)
    by_layer = feature_edits(graph, chosen)
    saes = list(transcoders.values())
    ids = torch.tensor(graph.input_ids)
    acts = {L: f"{sae.hook_name_out}.hook_sae_acts_post" for L, sae in transcoders.items()}
    hooks: dict[str, Any] = {acts[L]: _edit_fn(e) for L, e in by_layer.items()}
    crossed: list[str] = []
    with torch.inference_mode():
        if constrained:
            frozen = [n for part in constrained_hooks(model, transcoders).values() for n in part]
            before = model.trace(ids, saes=saes, names=[*frozen, *acts.values()])
            keep = {n: before[n] for n in frozen}
            for n in frozen:
                hooks.setdefault(n, lambda x, name: keep[name])
            after = model.trace(ids, saes=saes, names=list(acts.values()), hooks=hooks)
            crossed = _crossed(before, after, acts, by_layer)
            original = before.logits[-1]
        else:
            after = model.trace(ids, saes=saes, names=[], hooks=hooks)
            original = model.logits(ids)[-1]
        new = after.logits[-1]
    result = Intervention(logits=new.detach().clone(), original=original.detach().clone(), values=chosen,
                          constrained=constrained, crossed=crossed, tokens=model.to_strings)
    if continuation:
        n = int(continuation)
        gen_hooks = {acts[L]: _edit_fn(e, len(ids)) for L, e in by_layer.items()}
        result.continuation = model.generate(ids, n, saes=saes, hooks=gen_hooks)
        result.original_continuation = model.generate(ids, n)
    return result


def _crossed(before: Any, after: Any, acts: dict[int, str], by_layer: dict[int, list]) -> list[str]:
    """'layer_feature_position on|off' of each feature whose activity changed, the set ones excepted."""
    out = []
    for layer, name in acts.items():
        was, now = before[name] > 0, after[name] > 0  # [pos, d_sae]
        changed = was != now
        for p, f, _ in by_layer.get(layer, []):
            changed[p, f] = False
        for p, f in torch.nonzero(changed).tolist():
            out.append(f"{layer}_{f}_{p} {'on' if now[p, f] else 'off'}")
    return out


def intervene_logits(graph: Any, values: dict[str, Any], constrained: bool = True) -> torch.Tensor:
    """AttributionGraph.intervene: the new logits [vocab]; a ThresholdCrossed warning names any feature that turned
    on or off in a constrained run."""
    r = intervene(graph, values, constrained=constrained)
    if r.crossed:
        shown = ", ".join(r.crossed[:8]) + (f" and {len(r.crossed) - 8} more" if len(r.crossed) > 8 else "")
        warnings.warn(f"{len(r.crossed)} features crossed their threshold, so the result leaves the graph's linear "
                      f"model: {shown}", ThresholdCrossed, stacklevel=3)
    return r.logits


__all__ = ["FROZEN", "Intervention", "InterventionError", "ThresholdCrossed", "intervene", "intervene_logits",
           "parse_value"]
