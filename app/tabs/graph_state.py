"""One session's state in the Graph tab: the attribution graph it built and what is derived from it, one typed
object (the tab's gr.State holds it; None until a graph is built).

Every handler of the tab (app/tabs/graph_attribution.py, graph_workbench.py, graph_cards.py, graph_qk.py,
graph_summary.py) reads and changes this object; the workbench's pins, supernodes and labels live on `graph`
itself (slmviz.graphs.workbench), so a saved JSON carries them. The caches are kept here, named, rather than as
keys a module adds to a shared dict.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from ..shared import READABLE_ERRORS, readable_message

log = logging.getLogger("slmviz.app")


@dataclass
class GraphState:
    """The session's graph and what the tab derives from it.

    graph: the unpruned AttributionGraph (slmviz.attribution_graph).
    layers: {layer: the name of the transcoder that reads it}; a layer not here is all error nodes.
    model: the slmviz model it was built on.
    seconds: how long building it took.
    scores: its replacement and completeness scores (graph.scores()).
    picked: the transcoders ticked when it was built (the names of the picker).
    cap: max_feature_nodes when a full set capped the features, else None.
    pruned_at / pruned: the graph pruned at the thresholds `pruned_at` (kept between calls: it carries the
      workbench state too).
    error_norms: ([n_layers, pos] norm of what each layer's transcoder misses, [n_layers, pos] MLP output norm),
      from one traced run, for the error nodes' cards.
    summary, checked, summary_at, seconds_summary: the pruned graph's GraphSummary (slmviz.graphs.summary) once
      made, its check's table, the thresholds it was made at and how long making and checking it took.
    focus: node ids the full graph draws highlighted (a summary box clicked: its members).
    """

    graph: Any
    layers: dict[int, str]
    model: Any
    seconds: float = 0.0
    scores: dict[str, float] = field(default_factory=dict)
    picked: list[str] = field(default_factory=list)
    cap: int | None = None
    pruned_at: tuple[float, float] | None = None
    pruned: Any = None
    error_norms: tuple[Any, Any] | None = None
    summary: Any = None
    checked: Any = None
    summary_at: tuple[float, float] | None = None
    seconds_summary: float = 0.0
    focus: list[str] = field(default_factory=list)

    def prune(self, thresholds: tuple[float, float]) -> Any:
        """The graph pruned at (node, edge) thresholds, pruned again only when they change."""
        if self.pruned is None or self.pruned_at != thresholds:
            self.pruned, self.pruned_at = self.graph.prune(*thresholds), thresholds
        return self.pruned

    @property
    def over(self) -> str:
        """The transcoders it is built over, as the status line names them."""
        return ", ".join(self.picked) if self.picked else ", ".join(self.layers[k] for k in sorted(self.layers))


def built(state: GraphState | None, what: str = "use the workbench") -> GraphState:
    """The session's state, or a readable error saying to build the graph first."""
    if not isinstance(state, GraphState):
        raise ValueError(f"Build the attribution graph first (the button above), then {what}")
    return state


def keeps_work(n_outputs: int, said: int | None = None) -> Callable[[Callable], Callable]:
    """A handler of the tab whose user mistakes keep the person's work in the page: a readable error
    (shared.READABLE_ERRORS, or a Cancel's gr.Error) becomes a gr.Warning toast and one log line, every one of the
    `n_outputs` panels keeps what it showed (gr.skip()), and the status output at index `said` (if any) gets the
    message in place of a stale "Running ..." line. Other exceptions go on to shared.readable_errors (outermost),
    which logs their traceback.

    An API client (gradio_client sends `x-gradio-user: api`) still gets the error: a script must know its call
    failed, and it has no panels to keep. The handler needs a `request: gr.Request` parameter for this to tell.

    Use under @readable_errors:  @readable_errors @keeps_work(4, said=3) def handler(...)."""

    def from_api(args: tuple, kwargs: dict) -> bool:
        request = next((a for a in (*args, *kwargs.values()) if isinstance(a, gr.Request)), None)
        headers = getattr(request, "headers", None) or {}
        return headers.get("x-gradio-user") == "api"

    def kept(e: Exception) -> Any:
        message = readable_message(e) if not isinstance(e, gr.Error) else str(e.message)
        log.info("user error: %s", message)
        gr.Warning(message)
        outputs = [gr.skip() for _ in range(n_outputs)]
        if said is not None:
            outputs[said] = f"**Not done:** {message}"
        return outputs[0] if n_outputs == 1 else tuple(outputs)

    def wrap(fn: Callable) -> Callable:
        if inspect.isgeneratorfunction(fn):
            @functools.wraps(fn)
            def gen_wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
                try:
                    yield from fn(*args, **kwargs)
                except (*READABLE_ERRORS, gr.Error) as e:
                    if from_api(args, kwargs):
                        raise
                    yield kept(e)

            return gen_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except (*READABLE_ERRORS, gr.Error) as e:
                if from_api(args, kwargs):
                    raise
                return kept(e)

        return wrapper

    return wrap
