"""Circuits over components: score every edge (EAP, EAP-IG or exact patching), patch any set of edges, and measure
how faithful the top edges are.

    c = slmviz.circuit(clean, corrupted, answer=" Mary", wrong=" John", model=m, method="eap-ig", steps=5)
    c.edges                       # DataFrame: source, target, score, sorted by |score|
    c.faithfulness([10, 100])     # DataFrame: n_edges, metric, normalized
    slmviz.patch_edges(clean, corrupted, edges=[("m5", "logits")], answer=" Mary", wrong=" John", model=m)

Scores estimate how much the metric changes when the edge carries the corrupted run's value (so an edge the
answer depends on usually scores negative under the logit difference; order by |score|):
- "eap": (a_u^corrupted - a_u^clean) . d metric / d (input of v), the gradient taken on the clean run, summed over
  positions and d_model (Syed et al. 2023). One forward and one backward.
- "eap-ig": the same with the gradient averaged over `steps` runs whose input embeddings are
  e_corrupted + (k / steps)(e_clean - e_corrupted), k = 0 .. steps - 1 (hannamw/EAP-IG's get_scores_eap_ig: the
  corrupted end included, the clean end not, so steps=1 is the gradient of the corrupted run).
- "exact": the metric with that one edge patched minus the clean metric (one patched run per edge, batched): the
  reference, affordable on small models (SmolLM2 has 70,651 edges).
A dataset of pairs (lists of prompts) is summed as EAP-IG sums it: each pair's scores with its own metric, summed,
divided by the number of pairs (and of steps); `clean` / `corrupted` are the mean metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..metrics import check_same_length
from ..progress import ProgressLike
from .engine import (
    PairRun,
    capture,
    check_conventions,
    gradient_scores,
    outputs_metrics,
    patched_metrics,
    reads_of,
)
from .graph import ComponentGraph

METHODS = ("eap", "eap-ig", "exact")
Metric_ = Callable[[torch.Tensor], Any]  # logits [pos, vocab] -> a number (a tensor for the gradient methods)
CAPTURE_ROWS = 16  # prompts per capture forward


# --- inputs ----------------------------------------------------------------------------------------------
def _prompts(x: Any, role: str) -> tuple[list[Any], bool]:
    """(prompts, is a dataset): one prompt (a string, a list of ids, a 1-D tensor) or a list of them."""
    if isinstance(x, str) or isinstance(x, torch.Tensor) and x.dim() == 1:
        return [x], False
    if isinstance(x, Sequence) and x and all(isinstance(i, int) and not isinstance(i, bool) for i in x):
        return [x], False
    if isinstance(x, Sequence) and not isinstance(x, str) and len(x) > 0:
        return list(x), True
    raise ValueError(f"{role} must be a prompt (a string or token ids) or a non-empty list of prompts, got {x!r}")


def _per_pair(value: Any, n: int, role: str, dataset: bool) -> list[Any]:
    if dataset and isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{role} has {len(value)} entries for {n} prompt pairs; give one per pair, or one for all")
        return list(value)
    return [value] * n


def prepare(model: Any, clean: Any, corrupted: Any, answer: Any = None, wrong: Any = None,
            metric: Metric_ | None = None, chat: bool = False) -> tuple[list[PairRun], str]:
    """Tokenise, check and run every pair (clean and corrupted, batched by length): its PairRuns, the metric's name."""
    from ..interventions.patching import resolve_metric

    check_conventions(model)
    cleans, dataset = _prompts(clean, "clean")
    corrupteds, dataset_c = _prompts(corrupted, "corrupted")
    if dataset != dataset_c or len(cleans) != len(corrupteds):
        raise ValueError(f"clean and corrupted must both be one prompt or lists of the same length; got "
                         f"{len(cleans)} clean and {len(corrupteds)} corrupted")
    n = len(cleans)
    answers, wrongs = _per_pair(answer, n, "answer", dataset), _per_pair(wrong, n, "wrong", dataset)
    metrics = _per_pair(metric, n, "metric", dataset)
    graph = ComponentGraph.of(model)
    pending: list[dict[str, Any]] = []
    names = set()
    for c, k, a, w, fn in zip(cleans, corrupteds, answers, wrongs, metrics, strict=True):
        clean_ids, corrupted_ids = model.encode(c, chat), model.encode(k, chat)
        check_same_length(model, clean_ids, corrupted_ids)
        metric_fn, name, builtin = resolve_metric(model, a, w, fn)
        names.add(name)
        pending.append({"ids": (clean_ids, corrupted_ids), "metric": metric_fn,
                        "answer": metric_fn.answer if builtin else None, "wrong": metric_fn.wrong if builtin else None})
    runs: list[PairRun | None] = [None] * n
    by_length: dict[int, list[int]] = {}
    for i, item in enumerate(pending):
        by_length.setdefault(item["ids"][0].numel(), []).append(i)
    for group in by_length.values():
        for start in range(0, len(group), CAPTURE_ROWS // 2):
            part = group[start:start + CAPTURE_ROWS // 2]
            ids = torch.stack([pending[i]["ids"][0] for i in part] + [pending[i]["ids"][1] for i in part])
            shells = [PairRun(pending[i]["ids"][0], pending[i]["ids"][1], pending[i]["metric"], pending[i]["answer"],
                              pending[i]["wrong"], None, None, float("nan"), float("nan")) for i in part]
            reads = reads_of(shells)
            writes, outputs, embeds = capture(model, graph, ids, reads)  # clean rows, then corrupted rows
            values = outputs_metrics(model, shells + shells, outputs, reads)
            k = len(part)
            for j, (i, run) in enumerate(zip(part, shells, strict=True)):
                run.clean, run.corrupted, run.embeds = writes[j], writes[k + j], (embeds[j], embeds[k + j])
                run.clean_metric, run.corrupted_metric = float(values[j]), float(values[k + j])
                runs[i] = run
    builtin = all(item["answer"] is not None for item in pending)
    name = names.pop() if len(names) == 1 else ("logit(answer) - logit(wrong)" if builtin else "metric (one per pair)")
    return [r for r in runs if r is not None], name


# --- edge sets -------------------------------------------------------------------------------------------
def _edge_sets(graph: ComponentGraph, edges: Any) -> tuple[list[torch.Tensor], bool]:
    """(one Bool [n_src, n_dst] mask per set, whether one set was given). A set is a list of edges; an edge is a
    (source, target) pair or a 'source->target' string."""
    if isinstance(edges, torch.Tensor) and edges.dtype == torch.bool:
        masks = [edges] if edges.dim() == 2 else list(edges)
        for m in masks:
            if tuple(m.shape) != (graph.n_src, graph.n_dst):
                raise ValueError(f"An edge mask is Bool [n_src, n_dst] = [{graph.n_src}, {graph.n_dst}], "
                                 f"got {tuple(m.shape)}")
        return masks, edges.dim() == 2
    if isinstance(edges, str) or not isinstance(edges, Sequence | set | frozenset):
        raise ValueError(f"edges= takes a list of edges, e.g. [('m5', 'logits'), 'a3.h1->a5.h2<q>'], or a list of "
                         f"such lists; got {edges!r}")
    items = list(edges)
    many = bool(items) and all(isinstance(e, list | set | frozenset) for e in items)
    sets = items if many else [items]
    return [graph.mask(s) for s in sets], not many


class SingleEdges(Sequence):
    """One mask per edge of the graph, built when read (the dense masks of SmolLM2's 70,651 edges would be 10 GB)."""

    def __init__(self, graph: ComponentGraph):
        self.graph = graph
        self.src, self.dst = graph.edge_index()

    def __len__(self) -> int:
        return int(self.src.numel())

    def __getitem__(self, i):  # type: ignore[override]
        mask = torch.zeros(self.graph.n_src, self.graph.n_dst, dtype=torch.bool)
        mask[self.src[i], self.dst[i]] = True
        return mask


# --- the API ---------------------------------------------------------------------------------------------
def _model(model: Any) -> Any:
    if model is None:
        from ..model_api import load

        return load()
    return model


def _unpack_task(clean: Any, corrupted: Any, answer: Any, wrong: Any, metric: Any) -> tuple:
    """circuit(task) / patch_edges(task, edges=...) with a Task from slmviz.circuits.tasks."""
    if hasattr(clean, "clean") and hasattr(clean, "corrupted") and corrupted is None:
        task = clean
        return task.clean, task.corrupted, task.answers, task.wrongs, task.metrics
    if corrupted is None:
        raise ValueError("Give a corrupted prompt (or a Task from slmviz.circuits.tasks as the first argument)")
    return clean, corrupted, answer, wrong, metric


def patch_edges(clean: Any, corrupted: Any = None, edges: Any = (), answer: Any = None, wrong: Any = None,
                model: Any = None, metric: Metric_ | None = None, chat: bool = False) -> float | list[float]:
    """The metric of the clean run with exactly `edges` carrying the corrupted run's values.

    The input of each destination v becomes its value in this run plus the sum over the patched edges (u, v) of
    (a_u^corrupted - a_u), a_u being u's write in this run (u's clean write unless an edge into u is patched too;
    see slmviz.circuits.engine). Any set of edges is one forward pass; `edges` as a list of sets runs them as one
    batch and returns one metric per set. No edge gives the clean metric and every edge the corrupted one, exactly.
    Lists of prompts (a dataset) give the mean metric over the pairs.
    """
    model = _model(model)
    clean, corrupted, answer, wrong, metric = _unpack_task(clean, corrupted, answer, wrong, metric)
    graph = ComponentGraph.of(model)
    masks, single = _edge_sets(graph, edges)
    runs, _ = prepare(model, clean, corrupted, answer, wrong, metric, chat)
    values = patched_metrics(model, graph, runs, masks).mean(1).tolist()
    return values[0] if single else values


def circuit(clean: Any, corrupted: Any = None, answer: Any = None, wrong: Any = None, model: Any = None,
            method: str = "eap", steps: int = 5, metric: Metric_ | None = None, chat: bool = False,
            progress: ProgressLike = None) -> Circuit:
    """Score every edge of the model's component graph for making the clean run differ from the corrupted one.

    method: "eap" | "eap-ig" (with `steps`) | "exact" (see the module docstring). answer / wrong: single tokens (the
    metric is logit(answer) - logit(wrong) at the last position), or metric=fn(logits [pos, vocab]) -> number (a
    tensor, for the gradient methods). Lists of prompts (and of answers) score a dataset. A Task
    (slmviz.circuits.tasks) may stand for all of them: `circuit(ioi_task(m), model=m)`. progress: slmviz.progress's
    contract (True: a tqdm bar; a Progress part of a caller's job), counted in runs.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "eap-ig" and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    model = _model(model)
    clean, corrupted, answer, wrong, metric = _unpack_task(clean, corrupted, answer, wrong, metric)
    graph = ComponentGraph.of(model)
    runs, name = prepare(model, clean, corrupted, answer, wrong, metric, chat)
    n = len(runs)
    clean_mean = float(np.mean([r.clean_metric for r in runs]))
    corrupted_mean = float(np.mean([r.corrupted_metric for r in runs]))
    if method == "eap":
        scores = gradient_scores(model, graph, runs, [1.0], progress) / n
    elif method == "eap-ig":
        scores = gradient_scores(model, graph, runs, [k / steps for k in range(steps)], progress) / (n * steps)
    else:
        values = patched_metrics(model, graph, runs, SingleEdges(graph), progress=progress).mean(1)  # [n_edges]
        src, dst = graph.edge_index()
        scores = torch.zeros(graph.n_src, graph.n_dst, dtype=torch.float64)
        scores[src, dst] = values - clean_mean
    return Circuit(scores=scores, graph=graph, clean=clean_mean, corrupted=corrupted_mean, method=method,
                   steps=steps if method == "eap-ig" else None, metric_name=name, n_pairs=n, _model=model, _runs=runs)


# --- the result ------------------------------------------------------------------------------------------
@dataclass
class Circuit:
    """Scores of every edge of a component graph, and the runs to test circuits made of the top ones.

    `scores` [n_src, n_dst] (float64, 0 where there is no edge); `edges` the DataFrame view; `clean` / `corrupted`
    the metric of the two runs (means over a dataset).
    """

    scores: torch.Tensor
    graph: ComponentGraph
    clean: float
    corrupted: float
    method: str
    steps: int | None = None
    metric_name: str = "metric"
    n_pairs: int = 1
    _model: Any = field(default=None, repr=False, compare=False)
    _runs: list[PairRun] = field(default_factory=list, repr=False, compare=False)
    _edges: pd.DataFrame | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        steps = f", steps={self.steps}" if self.steps else ""
        return (f"Circuit({self.method}{steps}: {self.graph.n_edges} edges, {self.metric_name} clean {self.clean:.4g} "
                f"/ corrupted {self.corrupted:.4g}, {self.n_pairs} pair{'s' if self.n_pairs > 1 else ''})")

    @property
    def edges(self) -> pd.DataFrame:
        """DataFrame source, target, score: every edge, sorted by |score| (largest first; ties keep forward order)."""
        if self._edges is None:
            src, dst = self.graph.edge_index()
            values = self.scores[src, dst]
            order = torch.from_numpy(np.argsort(-values.abs().numpy(), kind="stable"))
            sources, targets = np.array(self.graph.sources), np.array(self.graph.targets)
            self._edges = pd.DataFrame({
                "source": sources[src[order].numpy()], "target": targets[dst[order].numpy()],
                "score": values[order].numpy(),
            })
        return self._edges

    def top(self, n: int) -> pd.DataFrame:
        """The n edges of largest |score|."""
        return self.edges.head(n).reset_index(drop=True)

    def score(self, edge: Any) -> float:
        """One edge's score: a (source, target) pair or a 'source->target' string."""
        return float(self.scores[self.graph.index_of(edge)])

    def _rank(self) -> torch.Tensor:
        """Long [n_src, n_dst]: each edge's place in `edges` (n_edges where there is no edge)."""
        src, dst = self.graph.edge_index()
        values = self.scores[src, dst]
        order = torch.from_numpy(np.argsort(-values.abs().numpy(), kind="stable"))
        rank = torch.full((self.graph.n_src, self.graph.n_dst), self.graph.n_edges, dtype=torch.long)
        rank[src[order], dst[order]] = torch.arange(order.numel())
        return rank

    def circuit_mask(self, n: int) -> torch.Tensor:
        """Bool [n_src, n_dst]: the top n edges."""
        return self._rank() < n

    def default_sizes(self, count: int = 12) -> list[int]:
        """0, then log-spaced sizes up to every edge."""
        total = self.graph.n_edges
        sizes = np.unique(np.round(np.geomspace(1, total, count - 1)).astype(int))
        return [0, *sizes.tolist()]

    def faithfulness(self, sizes: Sequence[int] | None = None,
                     progress: ProgressLike = None) -> pd.DataFrame:
        """DataFrame n_edges, metric, normalized: for each circuit size n, the clean run with every edge *outside* the
        top n patched from the corrupted run; normalized = (metric - corrupted) / (clean - corrupted).

        All sizes run as one batch. n = 0 gives exactly the corrupted metric and n = every edge exactly the clean
        one. `.attrs["smallest_80"]`: the smallest listed size whose normalized metric reaches 0.8 (None if none).
        """
        sizes = self.default_sizes() if sizes is None else [int(s) for s in sizes]
        total = self.graph.n_edges
        bad = [s for s in sizes if not 0 <= s <= total]
        if bad:
            raise ValueError(f"Circuit sizes must be in [0, {total}] (this graph's edges), got {bad}")
        if self._model is None or not self._runs:
            raise RuntimeError("This Circuit has no runs to patch (it was built without a model)")
        rank = self._rank()
        real = self.graph.real()
        masks = [real & (rank >= n) for n in sizes]
        metric = patched_metrics(self._model, self.graph, self._runs, masks, progress=progress).mean(1).numpy()
        span = self.clean - self.corrupted
        normalized = (metric - self.corrupted) / span if span != 0 else np.full_like(metric, np.nan)
        frame = pd.DataFrame({"n_edges": sizes, "metric": metric, "normalized": normalized})
        reached = frame[frame["normalized"] >= 0.8]
        frame.attrs["smallest_80"] = int(reached["n_edges"].min()) if len(reached) else None
        return frame

    def smallest(self, fraction: float = 0.8, count: int = 12, curve: pd.DataFrame | None = None) -> int | None:
        """The smallest circuit (top-n edges) found to recover `fraction` of the clean-corrupted gap: `count` log-spaced
        sizes (or the sizes of `curve`, a `faithfulness` frame already measured), then `count` sizes between the last
        one short of it and the first one reaching it (one more batch).

        Faithfulness need not grow monotonically with n; this is the smallest size that was measured to reach it.
        """
        frame = self.faithfulness(self.default_sizes(count)) if curve is None else curve
        ok = frame["normalized"] >= fraction
        if not ok.any():
            return None
        first = int(frame["n_edges"][ok].min())
        below = frame["n_edges"][(frame["n_edges"] < first)]
        low = int(below.max()) if len(below) else 0
        between = np.unique(np.linspace(low, first, count + 2).round().astype(int)[1:-1]).tolist()
        if not between:
            return first
        fine = self.faithfulness(between)
        hit = fine["n_edges"][fine["normalized"] >= fraction]
        return int(hit.min()) if len(hit) else first

    def plot(self, n: int = 50, **kwargs):
        """The top-n edges drawn layer by layer (input, heads, MLPs, logits): width |score|, colour sign."""
        from ..plots.circuits import circuit_graph

        return circuit_graph(self, n, **kwargs)

    def plot_faithfulness(self, sizes: Sequence[int] | None = None, **kwargs):
        """The faithfulness curve (normalized metric against circuit size) of `faithfulness(sizes)`."""
        from ..plots.circuits import faithfulness_curve

        return faithfulness_curve(self.faithfulness(sizes), **kwargs)
