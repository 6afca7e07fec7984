"""Building attribution graphs over transcoder features (circuit-tracer's `attribute`); the result is
graphs.graph.AttributionGraph.

    g = slmviz.attribution_graph("The capital of France is", transcoders=[tc3, tc6], model=m)
    g.nodes            # DataFrame: one row per node (kind feature | error | embedding | logit, layer, position, ...)
    g.links            # DataFrame: source, target, weight (node ids), every nonzero edge

Nodes, in circuit-tracer's order: the active features (layer, position, feature), one error node per (layer,
position) for every layer (a layer without a transcoder is all error), one embedding per position, and the top
logits at the last position (up to `max_n_logits` with cumulative probability `desired_logit_prob`). In the local
replacement model (graphs.frozen) every target (a feature's pre-activation, a demeaned logit) is linear in the
sources, so the edge weight A[t, s] is source s's direct effect on target t:

    feature / error / embedding source s at (layer Ls, position ps), vector v_s written into the residual stream;
    target t read through vector u_t (W_enc[:, f] at blocks.Lt.mlp.hook_in, or W_U[tok] - mean(W_U) after ln_final)
    A[t, s] = v_s · ∂(u_t · read_t) / ∂(what enters the residual at Ls, ps)

computed like circuit-tracer: one backward per batch of targets, each row's gradient injected at its own target
(circuit-tracer runs `batch_size` copies of the prompt forward; here one copy, the backward vmapped over the rows).
Σ_s A[t, s] + constant[t] is the target's value.

The work is split around one `context.AttributionContext` (the prompt's run, its features, targets and node
layout): `budget` (the memory budget), `targets` (what is attributed: the top logits, or any `select(model, state)`,
the seam for other targets), `backward` (the backward passes), `selection` (a capped graph's features), `nodes`
(constants and the node table). This module is the entry point and its progress.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch

from ..progress import Progress, ProgressLike, as_progress
from ..tokens import PromptError
from .backward import attribute_rows  # noqa: F401  (re-exported: tests and bench import them from here)
from .budget import (  # noqa: F401
    DEFAULT_MEMORY_BUDGET_GB,
    PARTIAL_INFLUENCE_CHUNK,
    estimate_memory_bytes,
    graph_memory_bytes,
    largest_cap,
)
from .context import AttributionContext
from .frozen import (  # noqa: F401  (Writes, writes_values: re-exported, as bench/studies/longest_prompt.py imports them)
    AttributionGraphError,
    PromptState,
    Writes,
    active_features,
    checked_transcoders,
    demeaned_unembed,
    prompt_state,
    writes_values,
)
from .graph import AttributionGraph
from .nodes import WRITE_CHUNK, node_table, replacement_constant  # noqa: F401
from .selection import attribute_most_influential, partial_influences  # noqa: F401
from .targets import AttributionTargets, LogitTargets, TargetSet, TokenTargets, salient_logits  # noqa: F401


def prepend_special(tokenizer: Any, ids: torch.Tensor) -> torch.Tensor:
    """circuit-tracer 0.5's ensure_tokenized: unless the prompt already starts with a special token, put one in
    front (the tokenizer's BOS, else PAD, else EOS, else its first special id; ids 0 are skipped, as its
    `filter(None, ...)` does). Position 0 carries massive activations in these models (an attention sink) and its
    features and error are zeroed anyway (`zero_bos`), so a dummy token there keeps the prompt's first real token
    in the graph. A tokenizer without special tokens (toy models) leaves the ids as they are."""
    if tokenizer is None:
        return ids
    special = [int(i) for i in (getattr(tokenizer, "all_special_ids", None) or [])]
    if len(ids) and int(ids[0]) in special:
        return ids
    candidates = [getattr(tokenizer, a, None) for a in ("bos_token_id", "pad_token_id", "eos_token_id")] + special
    first = next(filter(None, candidates), None)
    return ids if first is None else torch.cat([ids.new_tensor([int(first)]), ids])


def attribution_graph(
    prompt: str | list[int] | torch.Tensor,
    transcoders: Any = None,
    model: Any = None,
    *,
    max_n_logits: int = 10,
    desired_logit_prob: float = 0.95,
    batch_size: int = 64,
    prepend_bos: bool = True,
    zero_bos: bool = True,
    memory_budget_gb: float = DEFAULT_MEMORY_BUDGET_GB,
    chat: bool = False,
    vmap: bool = True,
    progress: ProgressLike = True,
    max_feature_nodes: int | None = None,
    update_interval: int = 4,
    targets: AttributionTargets | None = None,
) -> AttributionGraph:
    """The attribution graph of one prompt over `transcoders` (slmviz SAEs reading blocks.L.mlp.hook_in and writing
    blocks.L.hook_mlp_out; any subset of layers). See the module docstring for the semantics.

    `prepend_bos`: put a special token in front unless the prompt starts with one (`prepend_special`).
    `zero_bos`: drop position 0's features and errors (circuit-tracer 0.5 always does; the embedding stays).
    `memory_budget_gb`: refuse (AttributionGraphError, with the estimate) a prompt whose graph would need more.
    `batch_size`: targets attributed per backward pass; more is faster and uses more memory.
    `vmap`: run the forward once and vmap each backward over its targets (False: `batch_size` copies of the prompt,
    as circuit-tracer does; the same numbers, see attribute_rows).
    The graph is computed in the model's dtype: load it in fp32 (the default) for exact edges; in bf16, Σ edges +
    constant misses the targets by bf16's rounding (a few percent of a logit on SmolLM2).

    `progress`: slmviz.progress's contract (True: a tqdm bar; False / None: nothing; fn(ProgressUpdate); a Progress
    part of a caller's job), reported after each backward batch with the targets (adjacency rows: logits, then
    features) attributed so far, in a part named "attribution" (unit "target"); the backwards are nearly all of
    the time. An exception raised by the sink stops the computation there and propagates as it is (the app's Cancel:
    app/jobs.py's JobCancelled); the frames it unwound are cleared on the way out, so the exception a caller
    keeps does not keep the adjacency or the autograd graph alive.

    `targets`: what the graph explains (graphs.targets): default LogitTargets(max_n_logits, desired_logit_prob),
    circuit-tracer's top logits; TokenTargets([" Austin"]) for named tokens; any object with
    select(model, state) -> TargetSet.

    `max_feature_nodes`: keep at most this many features, the most influential ones (circuit-tracer's option of
    the same name): the logits are attributed first, then features in rounds of `update_interval` x `batch_size`,
    each round taking the unvisited features of highest influence on the logits through the rows attributed so
    far. The graph's nodes are the chosen features (the others' direct effects move into each target's `constant`,
    so Σ edges + constant is still every target's value). With a full set of transcoders the dense adjacency grows
    with the square of the active features; this is what keeps a long prompt within the memory budget (whose
    error names the largest cap that fits).
    """
    if max_feature_nodes is not None and (not isinstance(max_feature_nodes, int) or max_feature_nodes < 1):
        raise AttributionGraphError(f"max_feature_nodes must be a positive integer or None, got {max_feature_nodes!r}")
    try:
        return _attribution_graph(prompt, transcoders, model, max_n_logits, desired_logit_prob, batch_size,
                                  prepend_bos, zero_bos, memory_budget_gb, chat, vmap, progress, max_feature_nodes,
                                  update_interval, targets)
    except BaseException as e:
        # A traceback keeps every frame it passed through, and with them their locals: the dense adjacency,
        # the prompt's activations, a suspended backward's autograd graph. Clearing them frees that memory as
        # soon as the exception is raised, however long the caller (a job runner keeping it to show) holds it.
        traceback.clear_frames(e.__traceback__)
        raise


def _attribution_graph(prompt: Any, transcoders: Any, model: Any, max_n_logits: int, desired_logit_prob: float,
                       batch_size: int, prepend_bos: bool, zero_bos: bool, memory_budget_gb: float, chat: bool,
                       vmap: bool, progress: ProgressLike, max_feature_nodes: int | None = None,
                       update_interval: int = 4, targets: AttributionTargets | None = None) -> AttributionGraph:
    if model is None:
        from ..model_api import load

        model = load()
    cfg = model.cfg
    ts = checked_transcoders(transcoders, model)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise AttributionGraphError(f"batch_size must be a positive integer, got {batch_size!r}")
    if not 0 < desired_logit_prob <= 1 or not isinstance(max_n_logits, int) or max_n_logits < 1:
        raise AttributionGraphError(
            f"max_n_logits must be a positive integer and desired_logit_prob in (0, 1]; got {max_n_logits!r}, "
            f"{desired_logit_prob!r}")
    ids = model.encode(prompt, chat)
    if prepend_bos:
        ids = prepend_special(model.tokenizer, ids)
    if len(ids) == 0:
        raise PromptError("the prompt is empty: an attribution graph needs at least one token")
    ctx = AttributionContext.build(model, ts, ids, targets or LogitTargets(max_n_logits, desired_logit_prob),
                                   zero_bos, batch_size, vmap)
    n_feat, n_logits, n_pos = ctx.n_features, ctx.n_targets, ctx.n_pos
    cap = n_feat if max_feature_nodes is None else min(max_feature_nodes, n_feat)
    bytes_per = torch.finfo(model.dtype).bits // 8
    values = ctx.writes.values()
    estimate = graph_memory_bytes(n_pos, n_feat, n_logits, cap, batch_size, cfg, bytes_per, vmap, values)
    budget = memory_budget_gb * 2**30
    if estimate > budget:
        fits = largest_cap(budget, n_pos, n_feat, n_logits, batch_size, cfg, bytes_per, vmap, values)
        hint = f", pass max_feature_nodes={fits} (the most influential features; this prompt has {n_feat})" \
            if fits > 0 else ""
        raise AttributionGraphError(
            f"this prompt ({n_pos} tokens, {n_feat} active features, {ctx.n_nodes} nodes) needs about "
            f"{estimate / 2**30:.2f} GiB for its attribution graph, over the memory budget of "
            f"{memory_budget_gb:g} GiB: "
            f"shorten the prompt, lower batch_size, or raise memory_budget_gb{hint}")

    # Phase 1 and 2, once for the logits (every layer) and once for the features (up to the last transcoder's
    # layer only): one forward of the batch, a zero leaf added wherever a source writes to read gradients at, then
    # one backward per batch of targets, row b's gradient injected at its own target only.
    job = as_progress(progress, "attribution_graph")
    with _Reporter(job.part("attribution", 0.97), n_logits + cap) as report:
        adjacency = ctx.attribute_all(report) if cap == n_feat else ctx.attribute_capped(cap, update_interval, report)
    job.part("constant", 0.03).say("each target's constant")
    # Target values (what the rows sum to with `constant`), from the prompt's own run.
    graph = AttributionGraph(
        prompt=prompt if isinstance(prompt, str) else "".join(model.to_strings(ids)),
        tokens=model.to_strings(ids), input_ids=[int(i) for i in ids], nodes=ctx.node_table(), adjacency=adjacency,
        constant=ctx.constant(), target_values=ctx.target_values(), logit_probabilities=ctx.targets.probabilities,
        n_layers=cfg.n_layers, model_name=str(getattr(model, "name", "")), zero_bos=zero_bos,
        transcoder_names=ts.names, model=model, transcoders=ts)
    job.finish()
    return graph


class _Reporter:
    """attribution_graph's progress over all its targets (adjacency rows filled), reported to its Progress part;
    it never goes back (where the vmap fallback redoes a phase's rows, it waits to pass them)."""

    def __init__(self, part: Progress, total: int):
        self.part, self.total = part, total
        self.done = 0

    def __enter__(self) -> Callable[[int], None]:
        return self.report

    def report(self, done: int) -> None:
        done = min(done, self.total)
        if done > self.done:
            self.done = done
            self.part.update(done, self.total, "target")

    def __exit__(self, *exc: object) -> None:
        pass


__all__ = ["AttributionGraph", "AttributionGraphError", "LogitTargets", "TokenTargets", "attribution_graph"]
