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
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pandas as pd
import torch

from ..tokens import PromptError
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

DEFAULT_MEMORY_BUDGET_GB = 4.0
WRITE_CHUNK = 65_536  # writes materialised at once where every vector is needed (replacement_constant): 151 MB
Progress = bool | Callable[[int, int], None] | None  # a tqdm bar (True), nothing (False / None), fn(done, total)


def estimate_memory_bytes(n_nodes: int, n_pos: int, batch_size: int, cfg: Any, bytes_per: int = 4,
                          copies: int = 1) -> int:
    """What attribution_graph holds at its peak, on the safe side: the dense fp32 adjacency and the graph's
    boolean edge mask over it (5 bytes a pair: scores and path lengths read the adjacency a block at a time,
    prune.RowNormalizedAbs; pruning, g.prune, holds up to three more fp32 copies of the graph it prunes), the
    forward's saved activations for `copies` rows of the prompt (~16 d_model-wide values per token per layer, the
    patterns, the MLP's hidden layer while it runs), and each backward's gradients for `batch_size` targets (~4
    residual-sized tensors per layer: the vmapped grads, their fp32 copies, the buffers). docs/attribution-graphs.md
    ("Memory") sets it beside a measured peak."""
    adjacency = n_nodes * n_nodes * (4 + 1)
    per_token_layer = 16 * cfg.d_model + cfg.n_heads * n_pos + 3 * cfg.d_mlp
    forward = copies * n_pos * cfg.n_layers * per_token_layer * bytes_per
    grads = 4 * batch_size * n_pos * (cfg.n_layers + 1) * cfg.d_model * 4
    return adjacency + forward + grads


def salient_logits(logits: torch.Tensor, unembed: torch.Tensor, max_n_logits: int, desired_logit_prob: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """circuit-tracer's compute_salient_logits: the smallest top set whose cumulative probability reaches
    `desired_logit_prob`, at most `max_n_logits`; returns (ids [k], probs [k], demeaned unembedding rows [k, d]:
    frozen.demeaned_unembed)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_idx = torch.topk(probs, min(max_n_logits, probs.shape[-1]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), desired_logit_prob)) + 1
    top_p, top_idx = top_p[:cutoff], top_idx[:cutoff]
    return top_idx, top_p, demeaned_unembed(unembed, top_idx)


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
    progress: Progress = True,
    max_feature_nodes: int | None = None,
    update_interval: int = 4,
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

    `progress`: a tqdm bar (True, as `scan` and `train_sae`), nothing (False / None), or fn(done, total), called
    after each backward batch with the targets (adjacency rows: logits, then features) attributed so far; the
    backwards are nearly all of the time. An exception raised by fn stops the computation there and propagates
    as it is (the app's Cancel: app/scan_jobs.py's JobCancelled); the frames it unwound are cleared on the way
    out, so the exception a caller keeps does not keep the adjacency or the autograd graph alive.

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
                                  update_interval)
    except BaseException as e:
        # A traceback keeps every frame it passed through, and with them their locals: the dense adjacency,
        # the prompt's activations, a suspended backward's autograd graph. Clearing them frees that memory as
        # soon as the exception is raised, however long the caller (a job runner keeping it to show) holds it.
        traceback.clear_frames(e.__traceback__)
        raise


def _attribution_graph(prompt: Any, transcoders: Any, model: Any, max_n_logits: int, desired_logit_prob: float,
                       batch_size: int, prepend_bos: bool, zero_bos: bool, memory_budget_gb: float, chat: bool,
                       vmap: bool, progress: Progress, max_feature_nodes: int | None = None,
                       update_interval: int = 4) -> AttributionGraph:
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
    n_pos, n_layers = len(ids), cfg.n_layers
    state = prompt_state(model, ids, ts)
    f_layer, f_pos, f_idx, f_act, f_enc, writes, errors = active_features(ts, state, n_layers, zero_bos)
    n_feat = n_feat_all = len(f_layer)
    token_vecs = state.embed.float()  # [pos, d_model]

    unembed = model.decoder.params.unembed
    logit_idx, logit_p, logit_vecs = salient_logits(state.logits[-1], unembed, max_n_logits, desired_logit_prob)
    logit_p = logit_p.cpu()  # the graph's own tensors live on the CPU, whatever device the model runs on
    n_logits = len(logit_idx)
    err_off = n_feat
    tok_off = err_off + n_layers * n_pos
    logit_off = tok_off + n_pos
    n_nodes = logit_off + n_logits

    cap = n_feat if max_feature_nodes is None else min(max_feature_nodes, n_feat)
    bytes_per = torch.finfo(model.dtype).bits // 8
    estimate = graph_memory_bytes(n_pos, n_feat, n_logits, cap, batch_size, cfg, bytes_per, vmap, writes.values())
    budget = memory_budget_gb * 2**30
    if estimate > budget:
        fits = largest_cap(budget, n_pos, n_feat, n_logits, batch_size, cfg, bytes_per, vmap, writes.values())
        hint = f", pass max_feature_nodes={fits} (the most influential features; this prompt has {n_feat})" \
            if fits > 0 else ""
        raise AttributionGraphError(
            f"this prompt ({n_pos} tokens, {n_feat} active features, {n_nodes} nodes) needs about "
            f"{estimate / 2**30:.2f} GiB for its attribution graph, over the memory budget of "
            f"{memory_budget_gb:g} GiB: "
            f"shorten the prompt, lower batch_size, or raise memory_budget_gb{hint}")

    # Phase 1 and 2, once for the logits (every layer) and once for the features (up to the last transcoder's
    # layer only): one forward of the batch, a zero leaf added wherever a source writes to read gradients at, then
    # one backward per batch of targets, row b's gradient injected at its own target only.
    logit_targets = [(n_layers, n_pos - 1, logit_vecs[i], logit_off + i) for i in range(n_logits)]
    args = (batch_size, f_pos, writes, errors, token_vecs, err_off, tok_off, logit_off)
    with _Reporter(progress, n_logits + cap) as report:
        if cap == n_feat:
            adjacency = torch.zeros(n_nodes, n_nodes)
            feature_targets = [(int(f_layer[i]), int(f_pos[i]), f_enc[i], i) for i in range(n_feat)]
            for base, targets in ((0, logit_targets), (n_logits, feature_targets)):
                if targets:
                    attribute_rows(model, state, ts, targets, adjacency, *args, vmap=vmap,
                                   progress=lambda n, base=base: report(base + n))
        else:
            selected, adjacency = attribute_most_influential(
                model, state, ts, logit_targets, logit_p, f_layer, f_pos, f_enc, cap, n_nodes, args, vmap, report,
                update_interval)
            f_layer, f_pos, f_idx, f_act, f_enc = (t[selected] for t in (f_layer, f_pos, f_idx, f_act, f_enc))
            writes = writes.select(selected)
            n_feat = cap
            shift = n_feat_all - cap
            err_off, tok_off, logit_off, n_nodes = (x - shift for x in (err_off, tok_off, logit_off, n_nodes))

    # Target values (what the rows sum to with `constant`), from the prompt's own run.
    target_values = torch.zeros(n_nodes)
    if n_feat:
        mlp_in_rows = torch.stack([state.mlp_in[int(L)][int(p)].float() for L, p in zip(f_layer, f_pos, strict=True)])
        target_values[:n_feat] = (mlp_in_rows * f_enc).sum(-1)
    last = state.logits[-1].float()
    if cfg.final_logit_softcap is None:
        target_values[logit_off:] = last[logit_idx] - last.mean()
    else:  # the graph's logit is the one before the softcap
        pre = _pre_softcap(model, state)
        target_values[logit_off:] = pre[logit_idx] - pre.mean()
    constant = replacement_constant(model, state, ts, f_layer, f_pos, writes, errors, f_enc, logit_vecs,
                                    n_nodes, logit_off)
    feat_hook = [ts.write_hook(L) for L in f_layer.tolist()]
    nodes = node_table(model, ids, f_layer, f_pos, f_idx, f_act, feat_hook, n_layers, logit_idx, logit_p)
    return AttributionGraph(
        prompt=prompt if isinstance(prompt, str) else "".join(model.to_strings(ids)),
        tokens=model.to_strings(ids), input_ids=[int(i) for i in ids], nodes=nodes, adjacency=adjacency,
        constant=constant, target_values=target_values, logit_probabilities=logit_p, n_layers=n_layers,
        model_name=str(getattr(model, "name", "")), zero_bos=zero_bos,
        transcoder_names=ts.names, model=model, transcoders=ts)


PARTIAL_INFLUENCE_CHUNK = 2**26  # bytes of |rows| partial_influences takes at a time


def partial_influences(rows: torch.Tensor, logit_p: torch.Tensor, row_node: torch.Tensor,
                       max_iter: int = 128, chunk_bytes: int = PARTIAL_INFLUENCE_CHUNK) -> torch.Tensor:
    """circuit-tracer's compute_partial_influences: each node's influence on the logits through the rows attributed
    so far (rows [r, n_nodes], row r being node row_node[r]'s inputs), by power iteration on the row-normalised |rows|
    from the logit probabilities.

    Without a normalised copy of `rows`, which circuit-tracer makes: on a long prompt `rows` is the largest tensor a
    capped graph holds (the kept features' rows over every active feature), and its copy doubled the peak past the
    memory budget's estimate (docs/features.md, "The longest prompt"). The iteration only ever reads its vector
    at the row nodes, so it runs on the [r, r] block of the normalised |rows| over their columns, and the influence
    on every node is one product of the summed iterates with the normalised |rows|, a column chunk at a time. Equal
    to circuit-tracer's up to the order of float sums (tests/test_attribution_graph.py pins it)."""
    n_rows, n_nodes = rows.shape
    step = max(1, chunk_bytes // (4 * max(n_rows, 1)))
    row_sums = torch.zeros(n_rows)
    for s in range(0, n_nodes, step):
        row_sums += rows[:, s:s + step].abs().sum(1)
    inv = 1 / row_sums.clamp(min=1e-8)
    block = rows[:, row_node].abs().mul_(inv[:, None])  # [r, r]: normalised |rows| at the row nodes' columns
    start = torch.zeros(n_nodes)
    start[-len(logit_p):] = logit_p
    vec, summed = start[row_node], torch.zeros(n_rows)  # the iterate at the row nodes, and its sum over iterations
    for _ in range(max_iter):
        if not vec.any():
            break
        summed += vec
        vec = vec @ block
    weights = summed * inv
    influence = torch.empty(n_nodes)
    for s in range(0, n_nodes, step):
        influence[s:s + step] = weights @ rows[:, s:s + step].abs()
    return influence


def attribute_most_influential(model: Any, state: PromptState, ts: Any, logit_targets: list[tuple],
                               logit_p: torch.Tensor, f_layer: torch.Tensor, f_pos: torch.Tensor, f_enc: torch.Tensor,
                               cap: int, n_nodes: int, args: tuple, vmap: bool, report: Callable[[int], None],
                               update_interval: int) -> tuple[torch.Tensor, torch.Tensor]:
    """circuit-tracer's max_feature_nodes loop: attribute the logits, then `cap` features in rounds, each taking the
    unvisited features of highest partial influence. Returns (the chosen features' indices, sorted; the adjacency
    over the chosen features and every other node, rows and columns of unchosen features dropped)."""
    n_feat, n_logits = len(f_layer), len(logit_targets)
    batch_size = args[0]
    rows = torch.zeros(cap + n_logits, n_nodes)
    row_node = torch.zeros(cap + n_logits, dtype=torch.long)
    attribute_rows(model, state, ts, [(*t[:3], i) for i, t in enumerate(logit_targets)], rows, *args, vmap=vmap,
                   progress=report)
    row_node[:n_logits] = torch.tensor([t[3] for t in logit_targets])
    visited = torch.zeros(n_feat, dtype=torch.bool)
    st = n_logits
    while st - n_logits < cap:
        influence = partial_influences(rows[:st], logit_p, row_node[:st])
        rank = torch.argsort(influence[:n_feat], descending=True)
        pending = rank[~visited[rank]][: min(update_interval * batch_size, cap - (st - n_logits))]
        targets = [(int(f_layer[i]), int(f_pos[i]), f_enc[i], st + j) for j, i in enumerate(pending.tolist())]
        attribute_rows(model, state, ts, targets, rows, *args, vmap=vmap,
                       progress=lambda n, st=st: report(st + n))
        row_node[st:st + len(pending)] = pending
        visited[pending] = True
        st += len(pending)
    selected = visited.nonzero().flatten()
    columns = torch.cat([selected, torch.arange(n_feat, n_nodes)])
    position = torch.full((n_nodes,), -1, dtype=torch.long)
    position[columns] = torch.arange(len(columns))
    adjacency = torch.zeros(len(columns), len(columns))
    adjacency[position[row_node]] = rows[:, columns]
    return selected, adjacency


def graph_memory_bytes(n_pos: int, n_feat: int, n_logits: int, cap: int, batch_size: int, cfg: Any,
                       bytes_per: int = 4, vmap: bool = True, write_values: int = 0) -> int:
    """What attribution_graph's memory budget charges a prompt of `n_pos` tokens with `n_feat` active features, the
    `cap` most influential kept (max_feature_nodes):
    - estimate_memory_bytes over the kept nodes;
    - every active feature's encoder row (d_model values) and its four indices, held from phase 0 to the end;
    - `write_values` fp32-sized values for the features' writes (Writes.values: one d_model row per distinct
      feature and layer it writes, a CLT feature of layer L writing n_layers - L, plus a few indices per write);
    - while features are chosen, the rows of the kept features and logits over *every* node, 4 * (cap + n_logits)
      * all nodes: what grows with a long prompt's active features and bounds its length; and partial_influences'
      [rows, rows] block and column chunk (it never copies the rows themselves).
    bench/studies/longest_prompt.py measures a process's peak against it (docs/features.md, "The longest prompt", and
    docs/cross-layer-transcoders.md)."""
    cap = min(cap, n_feat)
    other = cfg.n_layers * n_pos + n_pos + n_logits  # error, embedding and logit nodes
    rows = min(batch_size, cap + n_logits)
    estimate = estimate_memory_bytes(other + cap, n_pos, rows, cfg, bytes_per, copies=1 if vmap else rows)
    estimate += n_feat * (4 * cfg.d_model + 4 * 8)
    if cap < n_feat:  # the rows attributed before the columns of unselected features are dropped
        held = 4 * (cap + n_logits) * (other + n_feat)
        estimate += held + 4 * (cap + n_logits) ** 2 + min(held, PARTIAL_INFLUENCE_CHUNK)
    return estimate + 4 * write_values


def largest_cap(budget: float, n_pos: int, n_feat: int, n_logits: int, batch_size: int, cfg: Any, bytes_per: int,
                vmap: bool, write_values: int) -> int:
    """The largest max_feature_nodes whose graph_memory_bytes fits `budget` (0 if none does), by bisection."""
    def need(cap: int) -> float:
        return graph_memory_bytes(n_pos, n_feat, n_logits, cap, batch_size, cfg, bytes_per, vmap, write_values)

    lo, hi = 0, n_feat
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if need(mid) <= budget else (lo, mid - 1)
    return lo


def attribute_rows(model: Any, state: PromptState, ts: Any, targets: list[tuple], adjacency: torch.Tensor,
                   batch_size: int, f_pos: torch.Tensor, writes: Writes, errors: torch.Tensor,
                   token_vecs: torch.Tensor, err_off: int, tok_off: int, logit_off: int, vmap: bool = True,
                   progress: Callable[[int], None] | None = None) -> None:
    """Fill adjacency's rows of `targets` [(layer read, position, read vector, node index)]: one forward of the
    replacement model up to the deepest layer they read, then one backward per `batch_size` of them, each row's
    gradient injected at its own target. `progress(n)` after each backward: n rows of `targets` are filled
    (called outside the vmap fallback's `except`, so whatever it raises propagates as it is).

    `vmap=True`: the forward runs one copy of the prompt and each backward is vmapped over its rows
    (`is_grads_batched`), so the forward (whose MLPs are computed, then replaced) costs one row, not
    `batch_size`. circuit-tracer runs `batch_size` copies instead; so does this function with vmap=False, and as
    the fallback where an op has no batching rule. The gradients are the same (tests compare both).
    """
    args = (model, state, ts, targets, adjacency, batch_size, f_pos, writes, errors, token_vecs, err_off, tok_off,
            logit_off)
    for one_row in ((True, False) if vmap else (False,)):
        batches = _attribute_rows(*args, one_row=one_row)
        try:
            while True:
                try:
                    done = next(batches)
                except StopIteration:
                    return
                except RuntimeError as e:  # an op without a batching rule: the fallback redoes every row
                    if not one_row or ("vmap" not in str(e) and "batch" not in str(e).lower()):
                        raise
                    break
                if progress is not None:
                    progress(done)
        finally:
            batches.close()  # a stop mid-way: the suspended backward's autograd graph goes now


def _attribute_rows(model: Any, state: PromptState, ts: Any, targets: list[tuple], adjacency: torch.Tensor,
                    batch_size: int, f_pos: torch.Tensor, writes: Writes, errors: torch.Tensor,
                    token_vecs: torch.Tensor, err_off: int, tok_off: int, logit_off: int,
                    one_row: bool) -> Iterator[int]:
    """attribute_rows' work, yielding the number of rows filled after each backward.

    A feature's edge into a target is the sum over the MLP outputs it writes of (gradient there) · (its vector
    there): the gradient at layer j's output is the same for every source writing j, so each layer's writes are one
    matrix product."""
    cfg, dtype, dev = model.cfg, model.dtype, state.embed.device
    n_layers, n_pos, n_nodes = cfg.n_layers, len(state.ids), adjacency.shape[1]
    top = max(t[0] for t in targets)
    rows = min(batch_size, len(targets))
    copies = 1 if one_row else rows
    embed_leaf = state.embed[None].expand(copies, -1, -1).clone().requires_grad_(True)  # [c, pos, d_model]
    deltas = [torch.zeros(copies, n_pos, cfg.d_model, dtype=dtype, device=dev, requires_grad=True)
              for _ in range(n_layers)]
    mlp_in, normed = ts.frozen_forward(model, state, embed_leaf, deltas, grad=True,
                                       last_layer=None if top == n_layers else top)
    reads = [*mlp_in, normed]  # what a target at layer L reads (n_layers: the logits)
    # The writes grouped by (layer written, position): each reads the gradient at its own position only, so one
    # [b, d] @ [d, n] product per group; [b, pos, d] @ [d, all writes of the layer] would multiply by every other
    # position too, pos times the work (a CLT feature writes every later layer, so its layers hold many writes).
    write_pos = f_pos[writes.node]  # [w]
    groups = [(layer, int(p), idx) for layer in range(n_layers)
              for p, idx in _by_position(write_pos, (writes.layer == layer).nonzero(as_tuple=True)[0])]
    n_feat = len(f_pos)
    for start in range(0, len(targets), rows):
        batch = targets[start:start + rows]
        inject: dict[int, torch.Tensor] = {}
        for b, (layer, pos, vec, _) in enumerate(batch):
            g = inject.setdefault(layer, torch.zeros(rows, n_pos, cfg.d_model, dtype=dtype, device=dev))
            g[b, pos] = vec.to(dtype)
        deepest = max(inject)
        shape = (rows, 1, n_pos, cfg.d_model) if one_row else (rows, n_pos, cfg.d_model)
        grads = torch.autograd.grad([reads[L] for L in inject], [embed_leaf, *deltas[:deepest]],
                                    [inject[L].view(shape) for L in inject], retain_graph=start + rows < len(targets),
                                    allow_unused=True, is_grads_batched=one_row)
        del inject
        # Each layer's gradient as [b, pos, d_model] fp32, replaced in the list one at a time: no stacked copy of
        # them all (rows x layers x pos x d_model, the largest thing a backward leaves; graph_memory_bytes).
        grads = list(grads)
        for i, g in enumerate(grads):
            grads[i] = None if g is None else g.reshape(rows, n_pos, cfg.d_model).float()
        g_embed, g_layers = grads[0], grads[1:]  # sources above the deepest target (None) get nothing
        block = torch.zeros(rows, n_nodes, device=dev)  # computed where the model runs, kept in `adjacency`
        feature_edges = torch.zeros(rows, n_feat, device=dev)
        for layer, p, idx in groups:
            if layer < deepest and g_layers[layer] is not None:
                m = (g_layers[layer][:, p] @ writes.table[writes.row[idx]].T) * writes.scale[idx]  # [b, n]
                feature_edges.index_add_(1, writes.node[idx], m)
        block[:, :n_feat] = feature_edges
        for layer, g in enumerate(g_layers):
            if g is not None:
                at = err_off + layer * n_pos
                block[:, at:at + n_pos] = torch.einsum("bpd,pd->bp", g, errors[layer])
        block[:, tok_off:logit_off] = torch.einsum("bpd,pd->bp", g_embed, token_vecs)
        del grads, g_embed, g_layers
        block = block.to(adjacency.device)
        for b, (_, _, _, node) in enumerate(batch):
            adjacency[node] = block[b]
        yield start + len(batch)


def _by_position(pos: torch.Tensor, sel: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(position, the entries of `sel` whose pos is it)], positions ascending."""
    if len(sel) == 0:
        return []
    p = pos[sel]
    order = torch.argsort(p, stable=True)
    values, counts = torch.unique_consecutive(p[order], return_counts=True)
    return list(zip(values.tolist(), torch.split(sel[order], counts.tolist()), strict=True))


class _Reporter:
    """attribution_graph's progress over all its targets (adjacency rows filled), shown as a tqdm bar or passed to
    fn(done, total); it never goes back (where the vmap fallback redoes a phase's rows, it waits to pass them)."""

    def __init__(self, progress: Progress, total: int):
        self.progress, self.total, self.bar = progress, total, None
        self.done = 0

    def __enter__(self) -> Callable[[int], None]:
        if self.progress is True:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, unit="target", desc="attribution_graph")
        return self.report

    def report(self, done: int) -> None:
        done = min(done, self.total)
        if done > self.done:
            self.done = done
            if self.bar is not None:
                self.bar.update(done - self.bar.n)
            elif callable(self.progress):
                self.progress(done, self.total)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def _pre_softcap(model: Any, state: PromptState) -> torch.Tensor:
    """The last position's logits before the final softcap: cap · atanh(logit / cap)."""
    cap = model.cfg.final_logit_softcap
    return torch.atanh((state.logits[-1].float() / cap).clamp(-1 + 1e-7, 1 - 1e-7)) * cap


def replacement_constant(model: Any, state: PromptState, ts: Any, f_layer: torch.Tensor, f_pos: torch.Tensor,
                         writes: Writes, errors: torch.Tensor, f_enc: torch.Tensor, logit_vecs: torch.Tensor,
                         n_nodes: int, logit_off: int) -> torch.Tensor:
    """Each target's value with every node removed: the replacement model run with the embeddings zeroed and every
    feature's and error's vector subtracted from the MLP outputs it writes (what remains is b_dec, biases, a zeroed
    BOS)."""
    cfg = model.cfg
    n_pos = len(state.ids)
    deltas = -errors.clone()
    for start in range(0, len(writes.node), WRITE_CHUNK):  # chunks: every vector at once is what Writes avoids
        idx = slice(start, start + WRITE_CHUNK)
        deltas.index_put_((writes.layer[idx], f_pos[writes.node[idx]]), -writes.vec(idx), accumulate=True)
    deltas = [d[None].to(model.dtype) for d in deltas]
    zero = torch.zeros(1, n_pos, cfg.d_model, dtype=model.dtype, device=state.embed.device)
    mlp_in, normed = ts.frozen_forward(model, state, zero, deltas)
    out = torch.zeros(n_nodes, device=state.embed.device)
    n_feat = len(f_layer)
    for i in range(n_feat):
        out[i] = mlp_in[int(f_layer[i])][0, int(f_pos[i])].float() @ f_enc[i]
    out[logit_off:] = logit_vecs @ normed[0, -1].float()
    return out.cpu()


def node_table(model: Any, ids: torch.Tensor, f_layer: torch.Tensor, f_pos: torch.Tensor, f_idx: torch.Tensor,
               f_act: torch.Tensor, feat_hook: list[str], n_layers: int, logit_idx: torch.Tensor,
               logit_p: torch.Tensor) -> pd.DataFrame:
    """One row per node in adjacency order, with circuit-tracer's node ids (frontend/graph_models.Node)."""
    n_pos = len(ids)
    strings = model.to_strings(ids)
    rows: list[dict[str, Any]] = []
    for L, p, f, a, hook in zip(f_layer.tolist(), f_pos.tolist(), f_idx.tolist(), f_act.tolist(), feat_hook,
                                strict=True):
        rows.append({"node_id": f"{L}_{f}_{p}", "kind": "feature", "layer": L, "position": p, "feature": f,
                     "activation": a, "hook": hook, "token": strings[p], "probability": math.nan})
    for L in range(n_layers):
        hook = f"blocks.{L}.hook_mlp_out"
        for p in range(n_pos):
            rows.append({"node_id": f"0_{L}_{p}", "kind": "error", "layer": L, "position": p, "feature": -1,
                         "activation": math.nan, "hook": hook, "token": strings[p], "probability": math.nan})
    for p in range(n_pos):
        rows.append({"node_id": f"E_{int(ids[p])}_{p}", "kind": "embedding", "layer": -1, "position": p,
                     "feature": int(ids[p]), "activation": math.nan, "hook": "hook_embed", "token": strings[p],
                     "probability": math.nan})
    logit_strings = model.to_strings(logit_idx)
    for i, (tok, prob) in enumerate(zip(logit_idx.tolist(), logit_p.tolist(), strict=True)):
        rows.append({"node_id": f"{n_layers + 1}_{tok}_{n_pos - 1}", "kind": "logit", "layer": n_layers,
                     "position": n_pos - 1, "feature": tok, "activation": math.nan, "hook": "logits",
                     "token": logit_strings[i], "probability": prob})
    return pd.DataFrame(rows, columns=["node_id", "kind", "layer", "position", "feature", "activation", "hook",
                                       "token", "probability"])


__all__ = ["AttributionGraph", "AttributionGraphError", "attribution_graph"]
