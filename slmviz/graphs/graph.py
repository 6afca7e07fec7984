"""The attribution graph, the result `slmviz.attribution_graph` returns (graphs.attribution builds it):

    g.nodes            # DataFrame: one row per node (kind feature | error | embedding | logit, layer, position, ...)
    g.links            # DataFrame: source, target, weight (node ids), every nonzero edge
    g.scores()         # circuit-tracer's replacement and completeness
    p = g.prune(node_threshold=0.8, edge_threshold=0.98)   # a smaller AttributionGraph, by influence
    p.plot(); p.to_json(); p.save_json("graph.json")      # circuit-tracer's graph JSON

It holds data: the nodes, the adjacency and what checks and recomputes it (each target's constant and value, the
logit probabilities, the prune masks and influence), and the model and transcoder set it was built from, which
interventions rerun. What a person adds while reading it (pins, supernodes, labels, feature scans) is one
`Workbench` object, `g.workbench`, saved in the JSON; the workbench methods below hand it to graphs.workbench,
graphs.subgraph and graphs.intervene. Values read off the data (node index, kept adjacency, node influence) are
graphs.derived's, kept in the graph's own cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import torch

from ..progress import ProgressLike
from . import workbench as wb
from .graph_json import graph_json
from .head_loadings import head_loadings as edge_head_loadings
from .intervene import intervene_logits
from .prune import graph_scores, mean_path_length, prune_masks
from .qk import MAX_PAIRS, QKAttribution, qk_attribution
from .subgraph import Subgraph, subgraph
from .workbench import Workbench

KINDS = ("feature", "error", "embedding", "logit")
T = TypeVar("T")


@dataclass
class AttributionGraph:
    """An attribution graph: `adjacency` [n_nodes, n_nodes] (rows targets, columns sources, circuit-tracer's
    orientation and node order) and `nodes` (a DataFrame in that order). `links` lists the nonzero edges.

    `constant` [n_nodes]: each target's part carried by no node (biases, b_dec; 0 for non-targets), so that
    adjacency.sum(1) + constant == `target_values` (a feature's pre-activation minus b_enc, a demeaned logit).
    `node_mask` / `edge_mask` are all-True until `prune` returns a pruned copy; `influence` then holds the
    cumulative influence of each node (circuit-tracer's `cumulative_scores`).
    `model` / `transcoders`: what the graph was built from, so that interventions rerun it. `workbench`: the pins,
    supernodes, edited labels and feature scans (graphs.workbench.Workbench), shared with every pruned copy.
    """

    prompt: str
    tokens: list[str]
    input_ids: list[int]
    nodes: pd.DataFrame
    adjacency: torch.Tensor
    constant: torch.Tensor
    target_values: torch.Tensor
    logit_probabilities: torch.Tensor
    n_layers: int
    model_name: str = ""
    transcoder_names: list[str] = field(default_factory=list)
    node_mask: torch.Tensor | None = None
    edge_mask: torch.Tensor | None = None
    influence: torch.Tensor | None = None
    node_threshold: float | None = None
    # attribution_graph's zero_bos: position 0's features and errors left out of the nodes' vectors (qk and
    # head_loadings rebuild those vectors, and need to know)
    zero_bos: bool = True
    model: Any = field(default=None, repr=False, compare=False)
    transcoders: Any = field(default=None, repr=False, compare=False)
    workbench: Workbench = field(default_factory=Workbench, repr=False, compare=False)
    # graphs.derived's values, {name: (key, value)}: see `derived`
    _derived: dict[str, tuple[tuple[int, ...], Any]] = field(default_factory=dict, init=False, repr=False,
                                                             compare=False)

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if self.node_mask is None:
            self.node_mask = torch.ones(n, dtype=torch.bool)
        if self.edge_mask is None:
            self.edge_mask = self.adjacency != 0

    def __repr__(self) -> str:
        counts = self.nodes.loc[self.node_mask.numpy(), "kind"].value_counts()
        parts = ", ".join(f"{int(counts.get(k, 0))} {k}" for k in KINDS)
        return f"AttributionGraph({self.prompt!r}: {parts}; {int(self.edge_mask.sum())} links)"

    def derived(self, name: str, make: Callable[[], T]) -> T:
        """A value read off the graph's data (graphs.derived's node index, kept adjacency, influence), made once.
        Kept with the identity of the nodes frame, adjacency and masks it was made from: a graph whose mask or
        adjacency is replaced makes it again rather than returning a value of other data."""
        key = (id(self.nodes), id(self.adjacency), id(self.node_mask), id(self.edge_mask))
        hit = self._derived.get(name)
        if hit is None or hit[0] != key:
            hit = (key, make())
            self._derived[name] = hit
        return hit[1]

    @property
    def n_features(self) -> int:
        return int((self.nodes["kind"] == "feature").sum())

    @property
    def kept_nodes(self) -> pd.DataFrame:
        """The nodes the masks keep (all of them before `prune`)."""
        return self.nodes[self.node_mask.numpy()]

    @property
    def links(self) -> pd.DataFrame:
        """source, target (node ids) and weight of every kept edge (nonzero before pruning), largest |weight| first."""
        dst, src = torch.nonzero(self.edge_mask & self.node_mask[:, None] & self.node_mask[None, :], as_tuple=True)
        weights = self.adjacency[dst, src].numpy()
        ids = self.nodes["node_id"].to_numpy()
        df = pd.DataFrame({"source": ids[src.numpy()], "target": ids[dst.numpy()], "weight": weights})
        return df.iloc[np.argsort(-np.abs(weights), kind="stable")].reset_index(drop=True)

    def prune(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> AttributionGraph:
        """A copy keeping the nodes and edges that carry `node_threshold` / `edge_threshold` of the cumulative
        influence on the logits (circuit-tracer's prune_graph: logit-probability-weighted influence through the
        row-normalised |adjacency|; embeddings and logits always kept, features and errors left without a kept
        outgoing edge, and features without a kept incoming one, dropped until nothing changes). The copy carries
        this graph's workbench: pins, supernodes and labels made on either show on both."""
        kinds = self.nodes["kind"].to_numpy()
        n_logits = int((kinds == "logit").sum())
        n_tokens = int((kinds == "embedding").sum())
        node_mask, edge_mask, cumulative = prune_masks(
            self.adjacency, self.logit_probabilities, n_logits, n_tokens, self.n_features,
            node_threshold, edge_threshold)
        return AttributionGraph(
            prompt=self.prompt, tokens=self.tokens, input_ids=self.input_ids, nodes=self.nodes,
            adjacency=self.adjacency, constant=self.constant, target_values=self.target_values,
            logit_probabilities=self.logit_probabilities, n_layers=self.n_layers, model_name=self.model_name,
            transcoder_names=self.transcoder_names, node_mask=node_mask, edge_mask=edge_mask, influence=cumulative,
            node_threshold=node_threshold, zero_bos=self.zero_bos, model=self.model, transcoders=self.transcoders,
            workbench=self.workbench)

    def scores(self) -> dict[str, float]:
        """circuit-tracer's graph scores of the whole (unpruned) graph: `replacement` (the share of token-to-logit
        influence that avoids error nodes) and `completeness` (the influence-weighted share of each node's inputs
        that are not errors); 1.0 when the transcoders explain everything. See prune.graph_scores."""
        return graph_scores(self.adjacency, self.logit_probabilities, self.n_features, *self._error_and_token_counts())

    def mean_path_length(self) -> float:
        """The influence-weighted mean number of edges from a token to a logit over the unpruned graph
        (prune.mean_path_length); shorter paths are what a CLT buys over per-layer transcoders."""
        return mean_path_length(self.adjacency, self.logit_probabilities, self.n_features,
                                *self._error_and_token_counts())

    def _error_and_token_counts(self) -> tuple[int, int]:
        """(error nodes, embedding nodes): with n_features, where each kind's block starts in circuit-tracer's order."""
        kinds = self.nodes["kind"].to_numpy()
        return int((kinds == "error").sum()), int((kinds == "embedding").sum())

    def to_json(self, slug: str = "slmviz-graph", scan: str | None = None) -> dict[str, Any]:
        """circuit-tracer's graph JSON (create_graph_files' `{slug}.json`): metadata, qParams, nodes, links, with the
        workbench's pins and supernodes in qParams and the feature labels in each node's clerp.

        Without `prune`, it is pruned at thresholds 1.0 (the influence fields need a prune), like create_graph_files
        with node_threshold=1.0 and edge_threshold=1.0: nearly everything is kept, except the least influential
        nodes and edges whose cumulative share float rounding puts past 1.0."""
        g = self if self.influence is not None else self.prune(1.0, 1.0)
        return wb.annotate_json(g, graph_json(g, slug=slug, scan=scan))

    def save_json(self, path: str | Path, slug: str | None = None, scan: str | None = None) -> Path:
        """Write `to_json()` to `path` (circuit-tracer's frontend reads it; the slug defaults to the file's stem)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # compact: json.dumps with an indent runs its pure-Python encoder instead of the C one, and the app writes
        # this file at every prune of a graph of thousands of links
        path.write_text(json.dumps(self.to_json(slug=slug or path.stem, scan=scan), separators=(",", ":")))
        return path

    def load_json(self, source: Any) -> AttributionGraph:
        """Take the pins, supernodes and edited labels of a saved graph JSON (a path, a JSON string or a dict)
        made for this graph's model, transcoders and prompt; WorkbenchError, and nothing changed, otherwise."""
        return wb.load_json(self, source)

    # ---- the workbench (graphs.workbench, graphs.subgraph and graphs.intervene hold the logic) ---------------------
    @property
    def pinned(self) -> list[str]:
        """The pinned node ids (g.workbench.pinned)."""
        return self.workbench.pinned

    @property
    def supernodes(self) -> list[list[str]]:
        """The supernodes, [name, *node_ids] each (g.workbench.supernodes)."""
        return self.workbench.supernodes

    @property
    def user_labels(self) -> dict[str, str]:
        """The edited labels, {"layer_feature": text} (g.workbench.user_labels)."""
        return self.workbench.user_labels

    @property
    def scans(self) -> dict[int, Any]:
        """The feature scans the automatic labels read, {layer: Scan} (g.workbench.scans)."""
        return self.workbench.scans

    def pin(self, *node_ids: str) -> list[str]:
        """Pin nodes by id (an unknown id: WorkbenchError, nothing pinned); returns the pins. A pruned copy shares
        its pins, supernodes and labels with the graph it came from."""
        return wb.pin(self, *node_ids)

    def unpin(self, *node_ids: str) -> list[str]:
        """Unpin nodes by id; they leave their supernodes too. Returns the pins."""
        return wb.unpin(self, *node_ids)

    def clear_pins(self) -> None:
        """No pins and no supernodes (labels stay)."""
        wb.clear(self)

    def pin_top(self, n: int, logit: bool = False) -> list[str]:
        """Pin the n kept features with the largest influence on the logits (and the top logit if `logit`)."""
        return wb.pin_top(self, n, logit)

    def supernode(self, name: str, members: Any = None) -> list[str]:
        """Group nodes (default: the pinned ones in no supernode) under `name`; returns [name, *members]."""
        return wb.supernode(self, name, members)

    def subgraph(self) -> Subgraph:
        """The pinned nodes, supernodes collapsed, with Neuronpedia's subgraph scores (graphs.subgraph.Subgraph)."""
        return subgraph(self)

    @property
    def labels(self) -> dict[str, str]:
        """{node_id: label} of the kept feature nodes: edited ones, else automatic ones ("[auto] ..."), the same as
        SAE.label gives (features.labels)."""
        return wb.feature_labels(self)

    def label(self, node_id: str, text: str | None = None) -> str:
        """The label of a feature node; with `text`, set it first for every position of that feature ("" goes
        back to the automatic one)."""
        if text is not None:
            wb.set_label(self, node_id, text)
        return wb.feature_labels(self, [node_id]).get(node_id, "")

    @property
    def label_scores(self) -> dict[str, float]:
        """{node_id: score} of the kept feature nodes whose label has a measured score (features.labels' detection
        balanced accuracy on held-out text, from the deep scan given by `use_labels`); empty without one."""
        return wb.label_scores(self)

    def use_labels(self, table: Any) -> AttributionGraph:
        """The deep scan's labels with their scores (features.labels.LabelTable, or its frame): automatic labels
        and label_scores read them from now on (edited labels still win)."""
        wb.use_labels(self, table)
        return self

    def summarize(self, max_groups: int = 12, method: str | None = None, apply: bool = True,
                  progress: ProgressLike = None) -> Any:
        """A short story of this graph (graphs.summary.GraphSummary): its kept features in at most `max_groups`
        supernodes plus the embedding, error and logit groups, the edges between groups (sums of the member
        edges), and `check()` to turn each group off. `apply`: the groups become the workbench's supernodes (a
        person's win). Prunes with the defaults first if this graph is not pruned."""
        from .summary import DEFAULT_METHOD, summarize

        return summarize(self, max_groups=max_groups, method=method or DEFAULT_METHOD, apply=apply,
                         progress=progress)

    def use_scans(self, scans: dict[int, Any]) -> AttributionGraph:
        """Feature scans {layer: Scan of that transcoder's hook_sae_acts_post} for the automatic labels."""
        self.workbench.scans.update(scans)
        return self

    def intervene(self, values: dict[str, Any], constrained: bool = True) -> torch.Tensor:
        """Set features ({node_id or supernode name: value}; a number, or "0", "-1x", "2x") and rerun the model:
        the new logits at the last position, a tensor [vocab]. constrained: attention patterns, norm scales and
        error terms frozen at the prompt's (the graph's linear model while no feature crosses its threshold; a
        ThresholdCrossed warning names any that does); free: the model rerun. See graphs.intervene."""
        return intervene_logits(self, values, constrained=constrained)

    # ---- attention (graphs.qk, graphs.head_loadings) ---------------------------------------------------------------
    def qk(self, layer: int, head: int, query: int = -1, key: int = 0, full: bool = False,
           max_pairs: int | None = MAX_PAIRS) -> QKAttribution:
        """Why head `head` of layer `layer`, at position `query`, attends to position `key`: the pre-softmax score
        split exactly over pairs of (query-side node, key-side node) of this graph, plus a bias node per side
        (graphs.qk). The workbench keeps its record, which the graph JSON carries."""
        result = qk_attribution(self, layer, head, query, key, full=full, max_pairs=max_pairs)
        self.workbench.record_qk(result.to_json())
        return result

    def head_loadings(self, source_id: str, target_id: str) -> pd.DataFrame:
        """The part of the edge source -> target that flows through each head's output: a DataFrame of layer, head,
        weight, one_hop, with the edge and the share carried by two heads or more in its attrs
        (graphs.head_loadings)."""
        return edge_head_loadings(self, source_id, target_id)

    def plot(self, **kwargs: Any):
        """The kept nodes by position (x) and layer (y), edges width |weight| and colour sign (plotly Figure).
        Each node's customdata is [node_id, kind, layer, position, feature, hook]: a click opens a feature."""
        from ..plots.attribution import attribution_graph_figure

        return attribution_graph_figure(self, **kwargs)


__all__ = ["KINDS", "AttributionGraph"]
