"""Reading an attribution graph as Neuronpedia's graph viewer lets people: pins, supernodes and feature labels, saved
in circuit-tracer's graph JSON as that viewer stores them. The subgraph of the pinned nodes and its scores are in
`graphs.subgraph`; setting features and rerunning the model in `graphs.intervene`.

    g.pin("1_12_3", "0_40_2"); g.pin_top(10)       # by node id; the n most influential features
    g.supernode("say Paris", ["1_12_3", "1_7_5"])  # a named group of nodes
    g.label("1_12_3", "says Paris"); g.labels      # edited labels win over the automatic ones
    g.save_json("graph.json"); g.load_json("graph.json")   # qParams (pinnedIds, supernodes) and clerp

**State.** All of it is one `Workbench` object, `g.workbench`: the graph holds its data (nodes, edges, scores and
what recomputes them) and carries this beside it. A pruned copy carries the same object, so a pin made on either
shows on both. The functions here check node ids against the graph, then change the Workbench.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..features.labels import AUTO, auto_labels, is_automatic
from .derived import node_index, node_influence
from .frozen import AttributionGraphError

QK_FIELD = "qk_attributions"  # the graph JSON's extra field: circuit-tracer's viewer reads the fields it knows
QK_ENTRY = ("layer", "head", "query", "key")  # what names a QK record's attention entry
SUMMARY_FIELD = "slmviz_summary"  # the graph JSON's extra field: the automatic groups' names and the summary


class WorkbenchError(AttributionGraphError):
    """Bad input to the workbench: an unknown node id, an empty or duplicate supernode, a JSON for another graph."""


@dataclass
class Workbench:
    """What a person adds to a graph while reading it: `pinned` node ids, `supernodes` ([name, *node_ids]),
    `user_labels` ({"layer_feature": text}, labels a person wrote) and `scans` ({layer: feature Scan} that the
    automatic labels read), and `qk`: the QK attributions looked at (graphs.qk.qk_json records, one per attention
    entry). The JSON saves all but the scans (qParams pinnedIds and supernodes, clerp, and the extra field QK_FIELD);
    a scan is a file of its own.

    The methods take node ids already checked against the graph and keep two rules: a supernode's members are
    pinned, and a node belongs to one supernode at most."""

    pinned: list[str] = field(default_factory=list)
    supernodes: list[list[str]] = field(default_factory=list)
    user_labels: dict[str, str] = field(default_factory=dict)
    scans: dict[int, Any] = field(default_factory=dict, repr=False, compare=False)
    qk: list[dict[str, Any]] = field(default_factory=list, repr=False)
    # the supernodes a summary made (graphs.summary), by name, and the automatic ones a person removed: applying a
    # summary again replaces the first and leaves the second out, so a person's edits win
    auto: list[str] = field(default_factory=list)
    dismissed: list[str] = field(default_factory=list)
    summary: dict[str, Any] | None = field(default=None, repr=False)  # the last applied summary's to_dict()
    # the pins an automatic supernode made (its members a person had not pinned): applying a summary again, or
    # removing its group, takes them back, so a person's own pins are never lost or buried under a summary's
    auto_pinned: list[str] = field(default_factory=list)
    # the deep scan's labels and their scores, {(layer, feature): (label, score)} (features.labels.LabelTable):
    # where a feature has one, its automatic label is this one; not saved (a file of its own, like the scans)
    deep_labels: dict[tuple[int, int], tuple[str, float]] = field(default_factory=dict, repr=False, compare=False)
    # automatic labels made so far, {(layer, feature, id(scan)): label}: they depend on the set and the scan only,
    # so a pruned copy, which shares this object, does not make them again
    _auto_labels: dict[tuple[int, int, int], str] = field(default_factory=dict, init=False, repr=False,
                                                          compare=False)

    def pin(self, ids: Iterable[str]) -> None:
        """A person's pins: an id a summary had pinned becomes the person's (it stays when the summary goes)."""
        ids = list(ids)
        self._pin(ids)
        mine = set(ids)
        self.auto_pinned[:] = [n for n in self.auto_pinned if n not in mine]

    def _pin(self, ids: Iterable[str]) -> list[str]:
        """Pin `ids`; the ones that were not pinned before."""
        new = []
        for nid in ids:
            if nid not in self.pinned:
                self.pinned.append(nid)
                new.append(nid)
        return new

    def unpin(self, ids: Iterable[str]) -> None:
        """Out of the pins and of every supernode (a supernode left empty goes)."""
        gone = set(ids)
        self.pinned[:] = [n for n in self.pinned if n not in gone]
        self.auto_pinned[:] = [n for n in self.auto_pinned if n not in gone]
        self._leave_groups(gone)

    def clear(self) -> None:
        """No pins and no supernodes (labels stay)."""
        self.pinned.clear()
        self.supernodes.clear()
        self.auto.clear()
        self.auto_pinned.clear()

    def group(self, name: str, ids: list[str]) -> list[str]:
        """Make the supernode [name, *ids]: the members are pinned and leave any other supernode."""
        self.pin(ids)
        self._leave_groups(set(ids))
        group = [name, *ids]
        self.supernodes.append(group)
        return group

    def ungroup(self, name: str) -> None:
        """The supernode goes; a person's members stay pinned, an automatic one's pins go with it."""
        members = {m for s in self.supernodes if s[0] == name for m in s[1:]}
        self.supernodes[:] = [s for s in self.supernodes if s[0] != name]
        if name in self.auto:
            self.auto.remove(name)
            self.dismissed.append(name)
            self._drop_auto_pins(members)

    def _drop_auto_pins(self, ids: set[str]) -> None:
        """Unpin those of `ids` that only a summary pinned and no supernode now holds."""
        held = {m for s in self.supernodes for m in s[1:]}
        gone = {n for n in self.auto_pinned if n in ids and n not in held}
        self.pinned[:] = [n for n in self.pinned if n not in gone]
        self.auto_pinned[:] = [n for n in self.auto_pinned if n not in gone]

    def apply_auto(self, groups: list[list[str]], summary: dict[str, Any] | None = None) -> None:
        """Replace the automatic supernodes by `groups` ([name, *ids]) where a person has not spoken: a group a
        person removed (`dismissed`) is left out, nodes in a person's supernode stay there, and a name a person's
        supernode holds gets " (auto)" after it."""
        self.supernodes[:] = [s for s in self.supernodes if s[0] not in self.auto]
        self._drop_auto_pins(set(self.auto_pinned))
        mine = {m for s in self.supernodes for m in s[1:]}
        names = {s[0] for s in self.supernodes}
        self.auto[:] = []
        for name, *ids in groups:
            if name in self.dismissed:
                continue
            free = [m for m in ids if m not in mine]
            if not free:
                continue
            if name in names:
                name = f"{name} (auto)"
            self.auto_pinned += self._pin(free)
            self.supernodes.append([name, *free])
            self.auto.append(name)
            names.add(name)
        self.summary = summary

    def restore(self, pinned: list[str], supernodes: list[list[str]], user_labels: dict[str, str],
                qk: list[dict[str, Any]] | None = None, summary: dict[str, Any] | None = None) -> None:
        """Replace pins, supernodes, edited labels, QK records and the automatic groups' record (a loaded JSON's);
        the members of a supernode are pinned."""
        self.pinned[:] = list(dict.fromkeys(pinned + [m for s in supernodes for m in s[1:]]))
        self.supernodes[:] = [[str(s[0]), *map(str, s[1:])] for s in supernodes]
        self.user_labels.clear()
        self.user_labels.update(user_labels)
        self.qk[:] = list(qk or [])
        summary = summary or {}
        present = {s[0] for s in self.supernodes}
        self.auto[:] = [n for n in summary.get("auto", []) if n in present]
        self.auto_pinned[:] = [n for n in summary.get("auto_pinned", []) if n in self.pinned]
        self.dismissed[:] = list(summary.get("dismissed", []))
        self.summary = summary.get("summary")

    def record_qk(self, record: dict[str, Any]) -> None:
        """Keep a QK attribution's record, in place of an earlier one of the same entry (layer, head, query, key)."""
        entry = [record.get(k) for k in QK_ENTRY]
        self.qk[:] = [r for r in self.qk if [r.get(k) for k in QK_ENTRY] != entry] + [record]

    def _leave_groups(self, ids: set[str]) -> None:
        self.supernodes[:] = [[s[0], *[m for m in s[1:] if m not in ids]] for s in self.supernodes
                              if any(m not in ids for m in s[1:])]


def coders(graph: Any) -> dict[int, Any]:
    """{layer: transcoder} of the set the graph was built from (empty if it does not hold it)."""
    ts = graph.transcoders
    if ts is None:
        return {}
    return dict(getattr(ts, "coders", ts))


# --- node ids ---------------------------------------------------------------------------------------------------
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


def _flat(node_ids: tuple[Any, ...]) -> list[str]:
    """pin("a", "b") and pin(["a", "b"]) alike."""
    return [n for group in node_ids for n in ([group] if isinstance(group, str) else group)]


def feature_key(graph: Any, node_id: str) -> str:
    """'layer_feature' of a feature node (what a label belongs to); WorkbenchError for another kind."""
    row = graph.nodes.iloc[node_index(graph)[node_id]]
    if row.kind != "feature":
        raise WorkbenchError(f"{node_id!r} is a {row.kind} node; only features have labels")
    return f"{int(row.layer)}_{int(row.feature)}"


# --- pins -------------------------------------------------------------------------------------------------------
def pin(graph: Any, *node_ids: str) -> list[str]:
    """Add the nodes to the pins (all checked before any is added); returns the pins."""
    graph.workbench.pin(checked_ids(graph, _flat(node_ids)))
    return list(graph.workbench.pinned)


def unpin(graph: Any, *node_ids: str) -> list[str]:
    """Remove the nodes from the pins and from every supernode (a supernode left empty goes)."""
    graph.workbench.unpin(checked_ids(graph, _flat(node_ids)))
    return list(graph.workbench.pinned)


def clear(graph: Any) -> None:
    """No pins, no supernodes (labels stay)."""
    graph.workbench.clear()


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
    wb = graph.workbench
    name = str(name or "").strip()
    if not name:
        raise WorkbenchError("A supernode needs a name")
    if any(s[0] == name for s in wb.supernodes):
        raise WorkbenchError(f"There is already a supernode named {name!r}; pick another name")
    if members is None:
        grouped = {m for s in wb.supernodes for m in s[1:]}
        members = [n for n in wb.pinned if n not in grouped]
    ids = list(dict.fromkeys(checked_ids(graph, members)))
    if not ids:
        raise WorkbenchError(f"The supernode {name!r} has no members: pin nodes first, or name them")
    return wb.group(name, ids)


def apply_groups(graph: Any, groups: list[list[str]], summary: dict[str, Any] | None = None) -> None:
    """Make `groups` ([name, *node_ids], a summary's feature groups) the graph's automatic supernodes
    (Workbench.apply_auto: a person's supernodes and removals win); the ids are checked first."""
    for g in groups:
        checked_ids(graph, g[1:])
    graph.workbench.apply_auto([list(g) for g in groups], summary)


def remove_supernode(graph: Any, name: str) -> None:
    """Ungroup the supernode `name` (its members stay pinned); an automatic one stays out when a summary is
    applied again."""
    if not any(s[0] == name for s in graph.workbench.supernodes):
        raise WorkbenchError(f"No supernode is named {name!r}")
    graph.workbench.ungroup(name)


# --- labels -----------------------------------------------------------------------------------------------------
def set_label(graph: Any, node_id: str, text: str | None) -> None:
    """Edit the label of a feature node's feature (every position of it); an empty text goes back to automatic."""
    (nid,) = checked_ids(graph, [node_id])
    key = feature_key(graph, nid)
    text = (text or "").strip()
    if text and not is_automatic(text):
        graph.workbench.user_labels[key] = text
    else:
        graph.workbench.user_labels.pop(key, None)


def feature_labels(graph: Any, node_ids: Any = None) -> dict[str, str]:
    """{node_id: label} of the feature nodes among `node_ids` (default: every kept feature node)."""
    nodes, wb = graph.nodes, graph.workbench
    if node_ids is None:
        rows = np.nonzero((nodes["kind"] == "feature").to_numpy() & graph.node_mask.numpy())[0]
    else:
        index = node_index(graph)
        rows = [index[n] for n in node_ids if nodes["kind"].iat[index[n]] == "feature"]
    part = nodes.iloc[list(rows)]
    cache = wb._auto_labels
    transcoders = coders(graph)
    scans = wb.scans
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
        edited = wb.user_labels.get(f"{layer}_{feature}") or (sae.labels.get(feature) if sae is not None
                                                              and hasattr(sae, "labels") else None)
        deep = wb.deep_labels.get((layer, feature))
        out[nid] = edited or (AUTO + deep[0] if deep else cache.get((layer, feature, id(scans.get(layer))), ""))
    return out


def use_labels(graph: Any, table: Any) -> None:
    """Read automatic labels and their scores from the deep scan's LabelTable (or its frame: layer, feature, label,
    score)."""
    frame = getattr(table, "frame", table)
    graph.workbench.deep_labels.update({
        (int(L), int(f)): (str(text), float(score))
        for L, f, text, score in zip(frame["layer"], frame["feature"], frame["label"], frame["score"], strict=True)})


def label_scores(graph: Any) -> dict[str, float]:
    """{node_id: score} of the kept feature nodes with a deep-scan label (use_labels)."""
    deep = graph.workbench.deep_labels
    if not deep:
        return {}
    nodes = graph.nodes
    rows = np.nonzero((nodes["kind"] == "feature").to_numpy() & graph.node_mask.numpy())[0]
    out = {}
    for nid, L, f in zip(nodes["node_id"].to_numpy()[rows], nodes["layer"].to_numpy()[rows],
                         nodes["feature"].to_numpy()[rows], strict=True):
        hit = deep.get((int(L), int(f)))
        if hit is not None:
            out[str(nid)] = hit[1]
    return out


# --- the JSON's qParams and clerp -------------------------------------------------------------------------------
def annotate_json(graph: Any, data: dict[str, Any]) -> dict[str, Any]:
    """Put the graph's pins and supernodes in `data`'s qParams (Neuronpedia's pinnedIds, supernodes), each listed
    feature node's label in its clerp, what the graph was made for in metadata["info"] (model, transcoders), which
    load_json checks, and the QK records looked at in the extra field QK_FIELD (when there are any)."""
    wb = graph.workbench
    listed = [n["node_id"] for n in data["nodes"] if n["feature_type"] == "cross layer transcoder"]
    labels = feature_labels(graph, [n for n in listed if n in node_index(graph)])
    for node in data["nodes"]:
        if node["node_id"] in labels:
            node["clerp"] = labels[node["node_id"]]
    data["qParams"]["pinnedIds"] = list(wb.pinned)
    data["qParams"]["supernodes"] = [list(s) for s in wb.supernodes]
    data["metadata"]["info"] = {"generator": {"name": "slmviz"}, "model": graph.model_name,
                                "transcoders": list(graph.transcoder_names)}
    if wb.qk:
        data[QK_FIELD] = [dict(r) for r in wb.qk]
    if wb.auto or wb.dismissed or wb.summary is not None:
        data[SUMMARY_FIELD] = {"auto": list(wb.auto), "dismissed": list(wb.dismissed), "summary": wb.summary,
                               "auto_pinned": list(wb.auto_pinned)}
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
    """Apply a saved graph JSON's pins, supernodes, edited labels and QK records to `graph`, after checking it was
    made for the same model, transcoders and prompt (WorkbenchError otherwise, and the graph is left as it was)."""
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
    records = data.get(QK_FIELD) or []
    if not isinstance(records, list) or not all(isinstance(r, dict) and set(QK_ENTRY) <= set(r) for r in records):
        raise WorkbenchError(f"The JSON's {QK_FIELD} is a list of QK records, each naming its {', '.join(QK_ENTRY)}")
    summary = data.get(SUMMARY_FIELD)
    if summary is not None and not isinstance(summary, dict):
        raise WorkbenchError(f"The JSON's {SUMMARY_FIELD} is a dict of auto, dismissed and summary")
    graph.workbench.restore(pins, groups, edited, records, summary)  # every check passed: now replace the state
    return graph


__all__ = ["QK_FIELD", "SUMMARY_FIELD", "Workbench", "WorkbenchError", "annotate_json", "apply_groups",
           "checked_ids", "clear", "coders", "feature_key", "feature_labels", "label_scores", "load_json",
           "node_index", "pin", "pin_top", "read_json", "remove_supernode", "set_label", "supernode", "top_features",
           "unpin", "use_labels"]
