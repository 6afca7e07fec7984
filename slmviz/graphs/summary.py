"""A pruned attribution graph told as a short story: its kept features grouped into a few supernodes, the edges
between the groups, and each group checked by turning it off.

    s = g.summarize(max_groups=12)     # GraphSummary of a pruned graph (g.prune())
    s.groups                           # name, label, members, kind, layers, positions, influence
    s.edges                            # source, target, weight: group names; sums of the member edges, exactly
    s.check()                          # name, predicted, measured, agree (+ measured_prob, negligible)
    s.apply()                          # the groups become the workbench's supernodes (a person's edits win)

**Groups.** The most influential kept features (those that together hold COVER of the kept features' influence,
at most MAX_CLUSTERED) are clustered by average linkage into at most `max_groups` groups; the rest stay
ungrouped and `coverage` says how much influence the groups hold. The distance between two features mixes
(`METHODS`, weights in `distance_matrix`):
- their influence-weighted edge profiles: what they feed, each target weighted by its own influence on the logits,
  signed, and what feeds them (cosine);
- their decoder directions (cosine): features that write the same thing mean the same thing;
- where they sit: a different position, and layers far apart, cost extra, as a person groups by column;
- what they do to the target ("signed"): a feature whose removal lowers the target's logit and one whose removal
  raises it (removal_effects, the graph's linear model) are kept apart, so a group pushes one way and its check's
  sign means something; a group that mixes both is a sum of opposite effects whose sign flips with any
  nonlinearity.
bench/studies/summary.py compares the methods on real prompts; the default is the one it chose.
The embeddings (one group per position), the error nodes (one group) and the logits (one group per logit) are
groups of their own kinds, so that the group edges carry every kept edge between grouped nodes.

**Checks.** Each feature group is set to 0 in two runs (graphs.intervene's, with the frozen run made once):
`predicted`, the constrained run (the graph's local replacement model: attention, norms and errors frozen), and
`measured`, a free run of the model; each the change of the target token's demeaned logit (the graph's target:
demeaned_change). `agree`: the same sign.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..features.labels import AUTO
from ..hooks import build_context
from ..progress import ProgressLike, as_progress
from ..variants import resolve_variant
from .derived import kept_adjacency, node_index, node_influence
from .frozen import AttributionGraphError
from .intervene import constrained_hooks, feature_edits
from .workbench import coders

KINDS = ("features", "embedding", "error", "logit")
METHODS = ("profile", "decoder", "both", "both+place", "signed")
DEFAULT_METHOD = "both+place"  # bench/studies/summary.py chose it (bench/results/summary_*.md)
COVER = 0.9  # the share of the kept features' influence the clustered features hold
MAX_CLUSTERED = 4096  # features clustered at most: the distance matrix is quadratic in them
SIGN_SPLIT = 0.5  # method "signed": the extra distance between a feature that helps the target and one that hurts it
NEGLIGIBLE = 0.1  # |predicted logit change| below this: a group whose sign says little (the goals skip it)
NAME_CHARS = 36  # a group's name: its label, cut here


class SummaryError(AttributionGraphError):
    """Bad input to a summary: max_groups below 1, a check target that is not one token of the vocabulary."""


@dataclass
class GraphSummary:
    """A graph's story (see the module docstring): `groups` and `edges` (DataFrames), `coverage` (the share of the
    kept features' influence the feature groups hold), `note` (why there is little to tell, when there is),
    `checks` (the last `check`'s frame) and `seconds` (what each step took)."""

    graph: Any = field(repr=False)
    groups: pd.DataFrame
    edges: pd.DataFrame
    coverage: float
    method: str
    note: str = ""
    checks: pd.DataFrame | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def feature_groups(self) -> pd.DataFrame:
        return self.groups[self.groups["kind"] == "features"]

    def check(self, target: int | str | None = None, progress: ProgressLike = None) -> pd.DataFrame:
        """Turn each feature group off (its features set to 0) and compare the target's demeaned logit change in the
        graph's linear model (`predicted`, a constrained intervention) with a free run (`measured`). `target`: a token
        id or a token string (exactly one token); default the model's top token. Columns: name, predicted, measured,
        agree, measured_prob (the target's probability change in the free run), negligible (|predicted| <
        NEGLIGIBLE). attrs: target (id), target_token, logit and probability (the target's, unchanged run)."""
        t0 = time.perf_counter()
        self.checks = check_groups(self.graph, self.feature_groups, target, progress)
        self.seconds["check"] = time.perf_counter() - t0
        return self.checks

    def apply(self) -> GraphSummary:
        """Make the feature groups the workbench's supernodes (graphs.workbench.apply_groups): earlier automatic
        ones are replaced; a person's supernodes, and the nodes in them, stay as they are."""
        from .workbench import apply_groups

        apply_groups(self.graph, [[r.name, *r.members] for r in self.feature_groups.itertuples()], self.to_dict())
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: groups, edges, checks (None before `check`), coverage, method, note."""
        def records(df: pd.DataFrame | None) -> list[dict[str, Any]] | None:
            if df is None:
                return None
            return [{k: _plain(v) for k, v in row.items()} for row in df.to_dict("records")]

        checks = None
        if self.checks is not None:
            checks = {"target": _plain(self.checks.attrs.get("target")),
                      "target_token": self.checks.attrs.get("target_token"),
                      "logit": _plain(self.checks.attrs.get("logit")),
                      "probability": _plain(self.checks.attrs.get("probability")),
                      "rows": records(self.checks)}
        return {"groups": records(self.groups), "edges": records(self.edges), "checks": checks,
                "coverage": self.coverage, "method": self.method, "note": self.note}

    def __repr__(self) -> str:
        n = len(self.feature_groups)
        return f"GraphSummary({n} feature groups holding {100 * self.coverage:.0f} % of the features' influence)"


def _plain(v: Any) -> Any:
    """numpy scalars and arrays as Python values (json.dumps takes them)."""
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_plain(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# --- grouping ---------------------------------------------------------------------------------------------------
def summarize(graph: Any, max_groups: int = 12, method: str = DEFAULT_METHOD, apply: bool = True,
              progress: ProgressLike = None) -> GraphSummary:
    """The GraphSummary of `graph` (pruned with its defaults first if it is not pruned). `apply`: make the groups
    the workbench's supernodes at once (GraphSummary.apply)."""
    if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
        raise SummaryError(f"max_groups must be a whole number of at least 1, got {max_groups!r}")
    if method not in METHODS:
        raise SummaryError(f"method must be one of {METHODS}, got {method!r}")
    p = as_progress(progress, "summarize")
    t0 = time.perf_counter()
    g = graph if graph.influence is not None else graph.prune()
    nodes = g.nodes
    kinds = nodes["kind"].to_numpy()
    kept = g.node_mask.numpy()
    influence = node_influence(g).double().numpy()
    feats = np.nonzero((kinds == "feature") & kept)[0]
    chosen = clustered_features(feats, influence)
    p.update(0, 3, "step", "grouping features")
    clusters = cluster(distance_matrix(g, chosen, method), max_groups) if len(chosen) else []
    p.update(1, 3, "step", "labelling groups")
    held = float(sum(influence[chosen[c]].sum() for c in clusters))
    total = float(influence[feats].sum())
    coverage = held / total if total > 0 else 0.0
    note = ""
    if len(feats) == 0:
        covered = sorted(coders(g)) if g.transcoders is not None else []
        note = ("This graph keeps no feature: " + (f"its transcoders cover layers {covered}, and none of their "
                "features survived pruning; prune with a higher node_threshold" if covered else
                "its transcoders cover no layer") + ". The story is tokens, errors and logits only.")
    rows = _feature_group_rows(g, [chosen[c] for c in clusters], influence)
    rows += _other_group_rows(g, kinds, kept, influence)
    member_rows = [r.pop("rows") for r in rows]
    groups = pd.DataFrame(rows, columns=["name", "label", "members", "kind", "layers", "positions", "influence"])
    groups.attrs["rows"] = member_rows
    p.update(2, 3, "step", "group edges")
    edges = group_edges(g, groups, member_rows)
    s = GraphSummary(g, groups, edges, coverage, method, note, seconds={"summarize": time.perf_counter() - t0})
    if graph is not g:
        s.graph = g
    if apply:
        s.apply()
    p.finish()
    return s


def clustered_features(feats: np.ndarray, influence: np.ndarray, cover: float = COVER,
                       cap: int = MAX_CLUSTERED) -> np.ndarray:
    """The most influential of `feats` (node rows) that together hold `cover` of their influence, at most `cap`,
    most influential first."""
    if len(feats) == 0:
        return feats
    order = feats[np.argsort(-influence[feats], kind="stable")]
    share = np.cumsum(influence[order]) / max(influence[order].sum(), 1e-30)
    n = int(np.searchsorted(share, cover)) + 1
    return order[:min(n, cap, len(order))]


def decoder_directions(graph: Any, rows: np.ndarray) -> torch.Tensor | None:
    """[n, d] each feature's decoder row (what it writes; a CLT's to its own layer), None where the graph holds no
    transcoders."""
    tcs = coders(graph)
    if not tcs:
        return None
    nodes = graph.nodes
    out = []
    for L, f in zip(nodes["layer"].to_numpy()[rows], nodes["feature"].to_numpy()[rows], strict=True):
        w = tcs[int(L)].W_dec.detach()
        out.append((w[int(f)] if w.dim() == 2 else w[int(f)].reshape(-1)).float().cpu())
    return torch.stack(out)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def distance_matrix(graph: Any, rows: np.ndarray, method: str = DEFAULT_METHOD) -> np.ndarray:
    """[n, n] distances between the features at node rows `rows`, in [0, ~3]: 1 - cosine of their edge profiles
    (method "profile"), of their decoder rows ("decoder"), their mean ("both"), plus a placement cost ("both+place":
    0.25 at another position, and 0.25 x the layer gap over the graph's layers)."""
    a = kept_adjacency(graph).double()
    infl = node_influence(graph).double()
    idx = torch.as_tensor(rows, dtype=torch.long)
    # what each feature feeds, each target weighted by its influence, signed; and what feeds it
    out = _unit_rows((a[:, idx] * infl[:, None]).T)
    inp = _unit_rows(a[idx, :])
    profile = (out @ out.T + 0.5 * (inp @ inp.T)) / 1.5
    dist = 1 - profile
    if method != "profile":
        dec = decoder_directions(graph, rows)
        dec_dist = 1 - (_unit_rows(dec.double()) @ _unit_rows(dec.double()).T) if dec is not None else dist
        dist = dec_dist if method == "decoder" else (dist + dec_dist) / 2
    if method in ("both+place", "signed"):
        layer = torch.as_tensor(graph.nodes["layer"].to_numpy()[rows], dtype=torch.float64)
        pos = torch.as_tensor(graph.nodes["position"].to_numpy()[rows], dtype=torch.float64)
        dist = dist + 0.25 * (pos[:, None] != pos[None, :]) + 0.25 * (layer[:, None] - layer[None, :]).abs() / max(
            graph.n_layers, 1)
    d = dist.numpy().copy()
    if method == "signed":
        sign = np.sign(removal_effects(graph)[rows])
        d += SIGN_SPLIT * (sign[:, None] != sign[None, :])
    np.fill_diagonal(d, 0.0)
    return d


def removal_effects(graph: Any, target_row: int | None = None) -> np.ndarray:
    """[nodes] how much removing each node changes the target logit's value (default the top logit, the graph's
    first logit node), by the kept graph's linear model: a node's edges carry its value, so removing it moves each
    target by its edge, and a feature moved by d moves its own targets by d / its activation times their edges;
    summed over every path (edges run forward in layers and positions, so the sum ends). This is what the
    constrained intervention computes as long as no feature crosses its threshold (tests/test_summary.py)."""
    nodes = graph.nodes
    kinds = nodes["kind"].to_numpy()
    kept = graph.node_mask.numpy()
    if target_row is None:
        logits = np.nonzero((kinds == "logit") & kept)[0]
        if not len(logits):
            return np.zeros(len(nodes))
        target_row = int(logits[0])

    def make() -> np.ndarray:
        a = kept_adjacency(graph).double()  # [target, source]
        act = torch.as_tensor(np.nan_to_num(nodes["activation"].to_numpy(dtype=np.float64)))
        features = torch.as_tensor((kinds == "feature") & kept)
        per_unit = torch.where(features & (act != 0), 1.0 / torch.where(act != 0, act, 1.0), 0.0)
        seed = torch.zeros(len(nodes), dtype=torch.float64)
        seed[target_row] = 1.0
        through = torch.zeros_like(seed)  # d(target) / d(scale of each node's value)
        for _ in range(len(nodes) + 1):  # a path visits each node once: this many rounds always converge
            nxt = a.T @ (seed + through * per_unit)
            if torch.equal(nxt, through):
                break
            through = nxt
        return -through.numpy()
    return graph.derived(f"removal_effects_{target_row}", make)


def cluster(dist: np.ndarray, n_clusters: int) -> list[np.ndarray]:
    """Average-linkage agglomerative clusters of a distance matrix, merged down to at most `n_clusters`: lists of
    indices into it, each ascending, the clusters in order of their first (most influential) member.

    The whole tree is built by the nearest-neighbour chain (O(n^2): follow each cluster's nearest until two are
    each other's, merge those), then its merges are replayed lowest first until `n_clusters` remain. Average linkage
    is reducible (a merge never brings a third cluster closer than the closer of the two were), so the chain finds
    exactly the merges of the greedy closest-pair-first algorithm; their heights never decrease up the tree, so
    replaying by height is a valid order. Ties go to the lowest indices: the result is deterministic."""
    n = len(dist)
    merges = _average_linkage_tree(dist) if n > n_clusters else []
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for _, _, a, b in sorted(merges)[:max(n - n_clusters, 0)]:
        ra, rb = root(a), root(b)
        parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return [np.array(groups[r]) for r in sorted(groups)]


def _average_linkage_tree(dist: np.ndarray) -> list[tuple[float, int, int, int]]:
    """Every merge of average linkage over `dist`, as (height, order, a, b): a and b are the lowest index of each of
    the two clusters merged (the nearest-neighbour chain; see cluster)."""
    n = len(dist)
    d = dist.astype(np.float64).copy()
    np.fill_diagonal(d, np.inf)
    size = np.ones(n)
    alive = np.ones(n, dtype=bool)
    merges: list[tuple[float, int, int, int]] = []
    chain: list[int] = []
    while len(merges) < n - 1:
        if not chain:
            chain.append(int(np.argmax(alive)))
        a = chain[-1]
        b = int(np.argmin(d[a]))
        if len(chain) > 1 and d[a, chain[-2]] <= d[a, b]:
            b = chain[-2]  # a tie with the previous link: merge, or the chain could cycle
        if len(chain) > 1 and b == chain[-2]:
            chain.pop()
            chain.pop()
            i, j = min(a, b), max(a, b)
            merges.append((float(d[i, j]), len(merges), i, j))
            merged = (size[i] * d[i] + size[j] * d[j]) / (size[i] + size[j])  # Lance-Williams, average linkage
            d[i, :], d[:, i] = merged, merged
            d[i, i] = np.inf
            d[j, :], d[:, j] = np.inf, np.inf
            size[i] += size[j]
            alive[j] = False
        else:
            chain.append(b)
    return merges


def _feature_group_rows(g: Any, clusters: list[np.ndarray], influence: np.ndarray) -> list[dict[str, Any]]:
    nodes = g.nodes
    ids = nodes["node_id"].to_numpy()
    total = _influence_total(g, influence)
    clusters = sorted(clusters, key=lambda rows: -float(influence[rows].sum()))
    labels = g.labels if len(clusters) else {}
    scores = label_scores_of(g)
    rows, used = [], set(ids.tolist())
    for rows_ in clusters:
        member_ids = ids[rows_].tolist()
        label = group_label(member_ids, labels, scores, influence[rows_])
        name = _unique(label or f"group {len(rows) + 1}", used)
        rows.append({"rows": rows_, "name": name, "label": label, "members": member_ids, "kind": "features",
                     "layers": sorted({int(x) for x in nodes["layer"].to_numpy()[rows_]}),
                     "positions": sorted({int(x) for x in nodes["position"].to_numpy()[rows_]}),
                     "influence": float(influence[rows_].sum()) / total})
    return rows


def label_scores_of(g: Any) -> dict[str, float]:
    try:
        return dict(g.label_scores)
    except Exception:  # noqa: BLE001 - a graph without a deep scan: labels rank by influence only
        return {}


def group_label(member_ids: list[str], labels: dict[str, str], scores: dict[str, float],
                influence: np.ndarray) -> str:
    """A group's label: its best-scored member's label (the most influential member's where no member has a
    score), the AUTO mark dropped. Members with the same label count once."""
    order = np.argsort(-np.asarray(influence), kind="stable")
    ranked = [member_ids[i] for i in order]
    scored = [m for m in ranked if m in scores and not math.isnan(scores[m])]
    best = max(scored, key=lambda m: scores[m]) if scored else (ranked[0] if ranked else None)
    text = labels.get(best, "") if best is not None else ""
    return text[len(AUTO):] if text.startswith(AUTO) else text


def _unique(text: str, used: set[str]) -> str:
    base = " ".join(text.split())[:NAME_CHARS].strip() or "group"
    name, k = base, 2
    while name in used:
        name, k = f"{base} #{k}", k + 1
    used.add(name)
    return name


def _influence_total(g: Any, influence: np.ndarray) -> float:
    kinds = g.nodes["kind"].to_numpy()
    total = float(influence[(kinds != "logit") & g.node_mask.numpy()].sum())
    return total if total > 0 else 1.0


def _other_group_rows(g: Any, kinds: np.ndarray, kept: np.ndarray, influence: np.ndarray) -> list[dict[str, Any]]:
    """One group per kept embedding (position), one for every kept error node, one per logit."""
    nodes = g.nodes
    ids, layers, positions = (nodes[c].to_numpy() for c in ("node_id", "layer", "position"))
    tokens = nodes["token"].to_numpy()
    total = _influence_total(g, influence)
    out = []
    for i in np.nonzero((kinds == "embedding") & kept)[0]:
        out.append({"rows": np.array([i]), "name": f"tok {int(positions[i])} {tokens[i]!r}",
                    "label": f"token {tokens[i]!r}",
                    "members": [ids[i]], "kind": "embedding", "layers": [-1], "positions": [int(positions[i])],
                    "influence": float(influence[i]) / total})
    err = np.nonzero((kinds == "error") & kept)[0]
    if len(err):
        out.append({"rows": err, "name": "errors", "label": "what the transcoders miss", "members": ids[err].tolist(),
                    "kind": "error", "layers": sorted({int(x) for x in layers[err]}),
                    "positions": sorted({int(x) for x in positions[err]}),
                    "influence": float(influence[err].sum()) / total})
    probs = nodes["probability"].to_numpy()
    for i in np.nonzero((kinds == "logit") & kept)[0]:
        out.append({"rows": np.array([i]), "name": f"logit {tokens[i]!r}",
                    "label": f"says {tokens[i]!r} (p={float(probs[i]):.3f})",
                    "members": [ids[i]], "kind": "logit", "layers": [int(layers[i])],
                    "positions": [int(positions[i])], "influence": float(probs[i])})
    return out


def group_edges(g: Any, groups: pd.DataFrame, rows: list[np.ndarray]) -> pd.DataFrame:
    """source, target, weight between groups: the sum of the kept edges from any member of the source group to any
    member of the target group (float64 sums of the pruned graph's kept adjacency; no self-loops), largest |weight|
    first, zero sums left out. `rows`: each group's node rows. By row, not by id: circuit-tracer's ids collide
    (derived.first_rows), and an error node whose id names a layer-0 feature still carries its own edges."""
    n_groups, n_nodes = len(groups), len(g.nodes)
    member = torch.zeros(n_groups, n_nodes, dtype=torch.float64)
    for k, r in enumerate(rows):
        member[k, torch.as_tensor(np.asarray(r), dtype=torch.long)] = 1.0
    a = kept_adjacency(g).double()  # [target, source]
    w = member @ a @ member.T  # [target group, source group]
    w.fill_diagonal_(0.0)
    t, s = torch.nonzero(w, as_tuple=True)
    names = groups["name"].to_numpy()
    weights = w[t, s].numpy()
    df = pd.DataFrame({"source": names[s.numpy()], "target": names[t.numpy()], "weight": weights})
    return df.iloc[np.argsort(-np.abs(weights), kind="stable")].reset_index(drop=True)


# --- checks -----------------------------------------------------------------------------------------------------
def target_token(model: Any, target: int | str | None, logits: torch.Tensor) -> int:
    """The token id a check follows: the model's top token (None), an id of the vocabulary, or a string that is
    exactly one token; SummaryError otherwise."""
    vocab = int(logits.shape[-1])
    if target is None:
        return int(torch.argmax(logits))
    if isinstance(target, str):
        ids = model.encode(target)
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if len(ids) != 1:
            raise SummaryError(f"{target!r} is {len(ids)} tokens for this model; a check follows one token (mind "
                               f"the leading space: ' Paris' and 'Paris' differ)")
        return int(ids[0])
    if isinstance(target, bool) or not isinstance(target, (int, np.integer)) or not 0 <= int(target) < vocab:
        raise SummaryError(f"the check target must be a token id in [0, {vocab}) or a token string, got "
                           f"{target!r}")
    return int(target)


def demeaned_change(new: torch.Tensor, old: torch.Tensor, t: int) -> float:
    """The change of token t's logit minus the mean logit: what the graph's logit target measures (its rows explain
    a demeaned logit). Why not the raw logit: a free run moves every logit together as the final norm's scale
    follows the edit, a shift no probability sees and the graph does not model, and it can flip the raw change's
    sign (tests/test_summary.py pins the check to this)."""
    delta = (new - old).double()
    return float(delta[t] - delta.mean())


CHECK_BATCH = 16  # groups per batched forward: [16, pos, d_sae] activations per layer stay small on every model


def check_groups(graph: Any, groups: pd.DataFrame, target: int | str | None = None,
                 progress: ProgressLike = None) -> pd.DataFrame:
    """GraphSummary.check's frame (see there). Both runs are graphs.intervene's (constrained and free, every
    transcoder spliced, error terms on), with the prompt's frozen values and logits computed once for all groups;
    the groups run side by side, one row of a batched forward each (free and constrained: two forwards a batch),
    which is what tests/test_summary.py pins against one intervention a group."""
    model, tcs = graph.model, coders(graph)
    if model is None or not tcs:
        raise SummaryError("This graph does not hold its model and transcoders (slmviz.attribution_graph keeps "
                           "them); build it again to check its summary")
    p = as_progress(progress, "check summary")
    ids = torch.tensor(graph.input_ids)
    saes = list(tcs.values())
    acts = {L: f"{sae.hook_name_out}.hook_sae_acts_post" for L, sae in tcs.items()}
    frozen = [n for part in constrained_hooks(model, tcs).values() for n in part]
    edits = [group_edits(graph, members) for members in groups["members"]]
    n = len(groups)
    chunks = [range(a, min(a + CHECK_BATCH, n)) for a in range(0, n, CHECK_BATCH)]
    with torch.inference_mode():
        p.update(0, n + 1, "group", "the prompt's own runs")
        before = model.trace(ids, saes=saes, names=frozen)
        keep = {name: before[name] for name in frozen}
        constrained_base = before.logits[-1].double()
        free_base = model.logits(ids)[-1].double()
        t = target_token(model, target, free_base)
        base_prob = torch.softmax(free_base, -1)[t]
        p.update(1, n + 1, "group")
        free, constrained = [], []
        for chunk in chunks:
            rows = [edits[k] for k in chunk]
            free.append(_batched_run(model, ids, saes, _batched_edits(rows, acts), {}, len(rows)))
            constrained.append(_batched_run(model, ids, saes, _batched_edits(rows, acts), keep, len(rows)))
            p.update(chunk[-1] + 2, n + 1, "group", str(groups["name"].iloc[chunk[-1]]))
    free_t = torch.cat(free) if free else torch.zeros(0, free_base.numel(), dtype=torch.float64)
    constrained_t = torch.cat(constrained) if constrained else free_t
    out = []
    for k, name in enumerate(groups["name"]):
        predicted = demeaned_change(constrained_t[k], constrained_base, t)
        measured = demeaned_change(free_t[k], free_base, t)
        out.append({"name": name, "predicted": predicted, "measured": measured,
                    "agree": bool(np.sign(predicted) == np.sign(measured)),
                    "measured_prob": float(torch.softmax(free_t[k], -1)[t] - base_prob),
                    "negligible": abs(predicted) < NEGLIGIBLE})
    df = pd.DataFrame(out, columns=["name", "predicted", "measured", "agree", "measured_prob", "negligible"])
    df.attrs.update({"target": t, "target_token": model.to_strings([t])[0], "logit": float(free_base[t]),
                     "probability": float(base_prob)})
    return df


def group_edits(graph: Any, members: list[str]) -> dict[int, list[tuple[int, int, float]]]:
    """{layer: [(position, feature, 0.0)]}: a group's feature members turned off (the embedding, error and logit
    members of other kinds of group are not features and are never set)."""
    kinds, index = graph.nodes["kind"].to_numpy(), node_index(graph)
    return feature_edits(graph, {m: 0.0 for m in members if kinds[index[m]] == "feature"})


def _batched_edits(rows: list[dict[int, list[tuple[int, int, float]]]], acts: dict[int, str]) -> dict[str, Any]:
    """Hooks on each layer's hook_sae_acts_post [b, pos, d_sae] setting row b's group's features to their values."""
    hooks: dict[str, Any] = {}
    for L, name in acts.items():
        cells = [(b, p, f, v) for b, row in enumerate(rows) for p, f, v in row.get(L, [])]
        if not cells:
            continue
        b, p, f, v = zip(*cells, strict=True)
        where, values = (torch.tensor(b), torch.tensor(p), torch.tensor(f)), torch.tensor(v)

        def put(x: torch.Tensor, name: str, where: tuple = where, values: torch.Tensor = values) -> torch.Tensor:
            x = x.clone()
            x[where] = values.to(x.dtype)
            return x

        hooks[name] = put
    return hooks


def _batched_run(model: Any, ids: torch.Tensor, saes: list[Any], hooks: dict[str, Any],
                 keep: dict[str, torch.Tensor], b: int) -> torch.Tensor:
    """The last position's logits [b, vocab] (fp64) of one forward of b copies of the prompt, row k edited by
    `hooks`' row k; `keep` {hook: the prompt's value}: frozen in every row (the constrained run), {} for a free
    run."""
    hooks = dict(hooks)
    for name, value in keep.items():
        # value[-n:]: with last_only the final norm sees the last position only (x [b, 1, 1], value [pos, 1]); for
        # every other hook x.shape[1] is value.shape[0] and the slice is all of it
        hooks.setdefault(name, lambda x, name, value=value: value[-x.shape[1]:].expand(x.shape))
    ctx = build_context(model.hook_names, [], hooks, batched=True, saes=saes)
    batch = ids.unsqueeze(0).expand(b, -1)
    return model.decoder.forward(batch, ctx, resolve_variant(None, model.cfg), last_only=True)[:, -1].double()


__all__ = ["COVER", "DEFAULT_METHOD", "KINDS", "METHODS", "NEGLIGIBLE", "GraphSummary", "SummaryError",
           "check_groups", "cluster", "distance_matrix", "group_edges", "removal_effects", "summarize"]
