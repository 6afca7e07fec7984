"""The runs behind circuits: capture every source's write, patch any set of edges in one forward, and take the
gradient of the metric with respect to every destination's input.

Sources write into the residual stream and destinations read it (circuits.graph), so the residual a destination v
reads is the sum of the writes of the sources before it, plus terms no source owns and that are the same in every
run (o_proj's bias on pre-norm families: no head owns it; down_proj's is part of the MLP's write). Patching edge
(u, v) therefore means adding (a_u^corrupted - a_u) to v's input, and only v's: the input hooks (hooks.INPUT_HOOKS)
give every head's query, every KV group's key and value, and the MLP their own copy of the residual.

Which a_u: the value of u *in the patched run itself* (EAP-IG's evaluate_graph: its clean hooks subtract the
activations of the run they fire in). For a single edge, or edges into one destination, that is u's clean value;
when an edge into u is patched too, u's own output has moved and the edge carries the corrupted value in place
of the moved one. This is what makes the identities exact: patching every edge gives each destination
sum_u a_u^corrupted (+ the shared terms) = its corrupted input, so the run is the corrupted run; patching none
is the clean run. Subtracting u's *clean-run* value instead would double count whatever an earlier patch moved.
A destination all of whose edges are patched gets the corrupted run's input itself (not the sum, which equals it
up to rounding), and a row patching no edge or every edge reads the clean or corrupted metric directly.

Heads under a norm after attention (OLMo-2, Gemma 3) write ln_post(sum_h result_h) into the residual, which is not
a sum of per-head terms; `head_writes` splits it into them with the run's own norm scale (the norm is linear once
its scale is fixed), so the writes still add up to hook_attn_out exactly. EAP-IG instead re-applies the post-norm
to the patched sum; the two agree for one edge to first order, not exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..hooks import build_context, layer_hook_name, layer_of
from ..metrics import Metric, as_float
from ..model.block import norm_slots
from ..progress import ProgressLike, as_progress
from ..variants import resolve_variant
from .graph import ComponentGraph

ROW_BYTES = 256 * 2**20  # memory for the per-row source writes of one patched batch ([rows, n_src, pos, d_model])
GRAD_TOKENS = 512  # rows x positions of one forward + backward


# --- one prompt pair, prepared -------------------------------------------------------------------------
@dataclass
class Writes:
    """Every source's write into the residual stream in one run, and what each kind of destination reads there."""

    sources: torch.Tensor  # [n_src, pos, d_model]: input, a0.h0 ... m0, a1.h0, ...
    resid_pre: torch.Tensor  # [n_layers, pos, d_model]: what layer L's heads read (before their norm)
    resid_mid: torch.Tensor  # [n_layers, pos, d_model]: what layer L's MLP reads
    final: torch.Tensor  # [pos, d_model]: the last block's resid_post, the logits' input
    keys: torch.Tensor  # [n_layers, g, pos, d_head]: keys after RoPE (a KV cache of the run's first positions)
    values: torch.Tensor  # [n_layers, g, pos, d_head]


@dataclass
class PairRun:
    """One clean / corrupted pair: its ids, its metric, and both runs' writes."""

    clean_ids: torch.Tensor  # [pos]
    corrupted_ids: torch.Tensor  # [pos]
    metric: Metric
    answer: int | None  # the built-in logit difference's tokens (answer None: a metric fn)
    wrong: int | None
    clean: Writes
    corrupted: Writes
    clean_metric: float
    corrupted_metric: float
    embeds: tuple[torch.Tensor, torch.Tensor] | None = field(repr=False, default=None)  # (clean, corrupted) hook_embed
    _difference: torch.Tensor | None = field(repr=False, default=None)
    _shared: int | None = field(repr=False, default=None)

    @property
    def n_pos(self) -> int:
        return self.clean_ids.numel()

    @property
    def builtin(self) -> bool:
        return self.answer is not None

    @property
    def last_only(self) -> bool:
        """The metric reads the last position only: the built-in logit difference, or a fn marked
        `fn.last_only = True` (the tasks' metrics), which then sees logits [1, vocab]."""
        return self.builtin or bool(getattr(self.metric, "last_only", False))

    @property
    def difference(self) -> torch.Tensor:
        """a_u^corrupted - a_u^clean [n_src, pos, d_model], computed once."""
        if self._difference is None:
            self._difference = self.corrupted.sources - self.clean.sources
        return self._difference

    @property
    def shared(self) -> int:
        """The first position at which any source writes differently in the two runs (n_pos if none).

        Before it the two runs are bit for bit the same, so every patched run is the clean run there (an edge
        adds exactly 0) and starts at this position, reading the earlier keys and values from a cache. Computed
        once: every patched batch asks it of each of its rows."""
        if self._shared is None:
            differs = self.difference.flatten(2).ne(0).any(-1).any(0)  # [pos]
            first = differs.nonzero()
            self._shared = int(first[0]) if first.numel() else self.n_pos
        return self._shared


def check_conventions(model: Any) -> Any:
    """The faithful conventions, refused where the residual stream is not a sum of writes (it never is under
    post-norm, N(x + F(x)), where the stream itself is renormalised)."""
    c = model.decoder.conventions(resolve_variant(None, model.cfg))
    if c.norm not in ("pre", "output", "sandwich"):
        raise ValueError(f"Circuits need a residual stream that is a sum of writes; norm placement {c.norm!r} is not")
    return c


def head_writes(model: Any, layer: int, result: torch.Tensor, post_scale: torch.Tensor | None) -> torch.Tensor:
    """Each head's write into the residual stream [b, pos, h, d_model] from attn.hook_result [b, pos, h, d_model].

    Pre-norm families: the result itself (o_proj's bias, the same in every run, belongs to no source).
    A norm after attention (OLMo-2's output norm, Gemma's sandwich) writes w * (sum_h r_h + b_o) / scale, linear in
    the r_h once the run's scale is fixed: head h's write is w * (r_h + b_o / h) / scale, and the writes sum to
    hook_attn_out. Leaving the post-norm out would make the heads' writes miss the norm's weight and scale (on
    Gemma, factors of 10-100), and every edge out of a head would be scored in the wrong units.
    Pinned by tests/test_circuits_edges.py::test_head_writes_sum_to_attn_out.
    """
    c = check_conventions(model)
    if c.norm == "pre":
        return result
    block = model.decoder.blocks[layer]
    slot = norm_slots(c.norm, "ln1", model.cfg.has_pre_norms, model.cfg.has_post_norms)[1]
    weight = block.norm_factor(slot, c.norm_offset, c.norm_weight_in_fp32)  # [d_model]
    b_o = block.p.b_o
    shares = result.float() if b_o is None else result.float() + b_o.float() / model.cfg.n_heads
    out = shares / post_scale.float()[..., None, :] * weight.float()  # [b, pos, h, d] / [b, pos, 1, 1]
    return out.to(result.dtype)


def post_scale_hook(model: Any, layer: int) -> str | None:
    """The hook whose scale `head_writes` needs (None on pre-norm families)."""
    c = check_conventions(model)
    if c.norm == "pre":
        return None
    slot = norm_slots(c.norm, "ln1", model.cfg.has_pre_norms, model.cfg.has_post_norms)[1]
    return layer_hook_name(layer, f"{slot}.hook_scale")


def capture(model: Any, graph: ComponentGraph, ids: torch.Tensor, reads: str = "all"
            ) -> tuple[list[Writes], torch.Tensor, torch.Tensor]:
    """Run a batch of prompts [b, pos] of one length; return each one's Writes, what its metric reads (`outputs`,
    see `metric_outputs`) and the embeddings [b, pos, d_model] (hook_embed)."""
    cfg = model.cfg
    n_layers = cfg.n_layers
    b, n_pos = ids.shape
    d = cfg.d_model
    z = dict(dtype=model.dtype, device=model.decoder.device)  # the writes stay where the model runs
    sources = torch.empty(b, graph.n_src, n_pos, d, **z)
    resid_pre = torch.empty(b, n_layers, n_pos, d, **z)
    resid_mid = torch.empty_like(resid_pre)
    keys = torch.empty(b, n_layers, cfg.n_kv_heads, n_pos, cfg.d_head, **z)
    values = torch.empty_like(keys)
    stash: dict[str, torch.Tensor] = {}
    hooks: dict[str, Callable] = {"hook_embed": _put(sources, 0)}
    for layer in range(n_layers):
        scale = post_scale_hook(model, layer)
        hooks[layer_hook_name(layer, "attn.hook_result")] = _keep(stash)
        if scale is not None:
            hooks[scale] = _keep(stash)
        hooks[layer_hook_name(layer, "hook_attn_out")] = _write_heads(model, layer, graph, sources, stash, scale)
        hooks[layer_hook_name(layer, "hook_mlp_out")] = _put(sources, graph.mlp_source(layer))
        hooks[layer_hook_name(layer, "hook_resid_pre")] = _put(resid_pre, layer)
        hooks[layer_hook_name(layer, "hook_resid_mid")] = _put(resid_mid, layer)
        hooks[layer_hook_name(layer, "attn.hook_rot_k")] = _put(keys, layer, transpose=True)
        hooks[layer_hook_name(layer, "attn.hook_v")] = _put(values, layer, transpose=True)
    final: dict[str, torch.Tensor] = {}
    hooks[layer_hook_name(n_layers - 1, "hook_resid_post")] = lambda x, name: final.__setitem__("x", x)
    ctx = build_context(model.hook_names, [], hooks, batched=True)
    outputs = model.decoder.forward(ids, ctx, resolve_variant(None, cfg), **metric_outputs(model, reads))
    writes = [Writes(sources[i], resid_pre[i], resid_mid[i], final["x"][i], keys[i], values[i]) for i in range(b)]
    return writes, outputs, sources[:, 0]


def reads_of(pairs: Sequence[PairRun]) -> str:
    """What the metrics of a batch read: "answer" (all built-in: two logits of the last position), "last" (fns
    marked last_only) or "all" (the logits of every position)."""
    if all(r.builtin for r in pairs):
        return "answer"
    return "last" if all(r.last_only for r in pairs) else "all"


def metric_outputs(model: Any, reads: str) -> dict[str, Any]:
    """The decoder's arguments for what the metric reads: the built-in logit difference needs no unembedding of the
    whole vocabulary (a forward that stops after the last block; `answer_logit_diff` reads two rows of W_U)."""
    if reads == "answer":
        return {"stop_after_layer": model.cfg.n_layers - 1}
    return {"last_only": reads == "last"}


def outputs_metrics(model: Any, pairs: Sequence[PairRun], outputs: torch.Tensor, reads: str) -> torch.Tensor:
    """Each row's metric from the decoder's outputs under `metric_outputs(reads)`, float64 [b]."""
    if reads == "answer":
        return answer_logit_diff(model, pairs, outputs[:, -1])
    return row_metrics(pairs, outputs)


def answer_logit_diff(model: Any, pairs: Sequence[PairRun], resid: torch.Tensor) -> torch.Tensor:
    """logit(answer) - logit(wrong) of each row from the last position's resid_post [b, d_model], float64 [b]: the
    final norm, then only the answer's and wrong token's rows of the unembedding (and the softcap, if any), as the
    decoder computes those two logits. Gemma's unembedding is 640 MiB: reading two rows of it instead of all of it
    (forward and backward) is most of what a gradient run costs there."""
    decoder = model.decoder
    c = decoder.conventions(resolve_variant(None, model.cfg))
    x = decoder.final_norm(resid[:, None], c)[:, 0].float()  # [b, d]
    unembed = decoder.params.unembed  # [vocab, d]
    cap = model.cfg.final_logit_softcap

    def logit(ids: list[int]) -> torch.Tensor:
        value = (x * unembed[torch.tensor(ids)].float()).sum(-1)  # [b]
        return value if cap is None else torch.tanh(value / cap) * cap

    value = logit([r.answer for r in pairs]).double()
    wrong = [r.wrong for r in pairs]
    if any(w is not None for w in wrong):
        has = torch.tensor([w is not None for w in wrong], device=value.device)
        value = value - torch.where(has, logit([w or 0 for w in wrong]).double(), 0.0)
    return value


def _put(into: torch.Tensor, index: int, transpose: bool = False) -> Callable:
    """A hook storing its [b, pos, ...] value at into[:, index] ([b, pos, k, d] values as [b, k, pos, d] when
    `transpose`)."""

    def fn(x: torch.Tensor, name: str) -> None:
        into[:, index] = x.transpose(1, 2) if transpose else x

    return fn


def _keep(stash: dict[str, torch.Tensor]) -> Callable:
    """A hook storing its value in `stash` under its name (read later by _write_heads)."""

    def fn(x: torch.Tensor, name: str) -> None:
        stash[name] = x

    return fn


def _write_heads(model: Any, layer: int, graph: ComponentGraph, into: torch.Tensor, stash: dict[str, torch.Tensor],
                 scale_name: str | None) -> Callable:
    """A hook on hook_attn_out that writes layer L's head writes (from the stashed result and post-norm scale)."""
    result_name = layer_hook_name(layer, "attn.hook_result")
    heads = slice(graph.head_source(layer, 0), graph.head_source(layer, 0) + graph.n_heads)

    def fn(x: torch.Tensor, name: str) -> None:
        writes = head_writes(model, layer, stash.pop(result_name), stash.pop(scale_name) if scale_name else None)
        into[:, heads] = writes.transpose(1, 2)  # [b, pos, h, d] -> [b, h, pos, d]

    return fn


# --- patched runs --------------------------------------------------------------------------------------
def start_layer(graph: ComponentGraph, mask: torch.Tensor) -> int:
    """The first layer whose block reads a patched edge (n_layers: only edges into the logits)."""
    targets = mask.any(0).nonzero()
    return graph.n_layers if targets.numel() == 0 else graph.target_layer(int(targets[0]))


def patched_metrics(model: Any, graph: ComponentGraph, runs: Sequence[PairRun], masks: Sequence[torch.Tensor],
                    shortcuts: bool = True, progress: ProgressLike = None) -> torch.Tensor:
    """The metric of every pair with every edge set patched: float64 [n_sets, n_pairs].

    masks: Bool [n_src, n_dst] each, True at the edges that carry the corrupted run's value. Rows (set, pair) of
    pairs with one length run as batches; each batch starts at the first layer any of its rows patches (before it
    every row is the clean run, read from the clean run's resid_pre) and, with the built-in metric, at the first
    position where the two runs differ (PairRun.shared). `shortcuts`: a set with no edge is the clean metric and one
    with every edge the corrupted metric, exactly, without a run (tests turn this off to check the runs).
    progress: slmviz.progress's contract, counted in patched runs ("run" rows of (set, pair)).
    """
    bar = as_progress(progress, "patched runs")
    real = graph.real()
    out = torch.full((len(masks), len(runs)), float("nan"), dtype=torch.float64)
    todo: list[tuple[int, int, int]] = []  # (start layer, set, pair)
    for s in range(len(masks)):
        mask = masks[s] & real
        n = int(mask.sum())
        for p, run in enumerate(runs):
            if shortcuts and n == 0:
                out[s, p] = run.clean_metric
            elif shortcuts and n == graph.n_edges:
                out[s, p] = run.corrupted_metric
            else:
                todo.append((start_layer(graph, mask), s, p))
    done, total = 0, len(todo)
    by_length: dict[int, list[tuple[int, int, int]]] = {}
    for row in todo:
        by_length.setdefault(runs[row[2]].n_pos, []).append(row)
    for n_pos, rows in by_length.items():
        rows.sort()
        # the positions a batch runs: none before the group's first difference (a batch of some of its rows
        # starts there or later, so this bounds every batch's size)
        n_run = n_pos - run_from([runs[p] for _, _, p in rows])
        per_row = graph.n_src * n_run * model.cfg.d_model * model.dtype.itemsize * 3  # current, corrupted, one gather
        chunk = max(1, ROW_BYTES // per_row)
        for i in range(0, len(rows), chunk):
            part = rows[i:i + chunk]
            values = _patched_batch(model, graph, runs, masks, part, real)
            for (_, s, p), v in zip(part, values, strict=True):
                out[s, p] = v
            done += len(part)
            bar.update(done, total, unit="run")
    return out


def _patched_batch(model: Any, graph: ComponentGraph, runs: Sequence[PairRun], masks: Sequence[torch.Tensor],
                   rows: list[tuple[int, int, int]], real: torch.Tensor) -> list[float]:
    cfg = model.cfg
    n_layers = cfg.n_layers
    start = min(min(r[0] for r in rows), n_layers - 1)
    pairs = [runs[p] for _, _, p in rows]
    reads = reads_of(pairs)
    first = run_from(pairs)
    at = slice(first, None)
    b = len(rows)
    m = torch.stack([masks[s] & real for _, s, _ in rows]).to(model.decoder.device)  # [b, n_src, n_dst]
    corrupted = _rows(pairs, lambda r: r.corrupted.sources[:, at])  # [b, n_src, pos', d], read only
    # a_u^corrupted - a_u of this run: the clean writes' difference until a patch moves a source, then updated as
    # the source writes again (_Sources)
    diff = torch.stack([r.difference[:, at] for r in pairs])  # [b, n_src, pos', d]
    sources = _Sources(corrupted, diff)
    stash: dict[str, torch.Tensor] = {}

    def corrupted_input(what: str, layer: int) -> Callable[[], torch.Tensor]:
        return lambda: _rows(pairs, lambda r: getattr(r.corrupted, what)[layer, at])  # [b, pos', d]

    hooks: dict[str, Callable] = {}
    for layer in range(start, n_layers):
        slices = graph.target_slices(layer)
        qkv = slice(slices["q"].start, slices["v"].stop)
        reader = _Reader(m[:, :graph.attn_prefix(layer), qkv], diff, corrupted_input("resid_pre", layer))
        splits = {"q": (0, cfg.n_heads), "k": (cfg.n_heads, cfg.n_kv_heads),
                  "v": (cfg.n_heads + cfg.n_kv_heads, cfg.n_kv_heads)}
        for kind, (offset, count) in splits.items():
            hooks[layer_hook_name(layer, f"hook_{kind}_input")] = reader.part(offset, count)
        scale = post_scale_hook(model, layer)
        hooks[layer_hook_name(layer, "attn.hook_result")] = _keep(stash)
        if scale is not None:
            hooks[scale] = _keep(stash)
        hooks[layer_hook_name(layer, "hook_attn_out")] = _write_heads(model, layer, graph, sources, stash, scale)
        mlp_reads = "resid_pre" if graph.parallel else "resid_mid"  # a parallel block's MLP reads its input
        mlp = _Reader(m[:, :graph.mlp_prefix(layer), slices["mlp"]], diff, corrupted_input(mlp_reads, layer))
        hooks[layer_hook_name(layer, "hook_mlp_in")] = mlp.part(0, 1)
        hooks[layer_hook_name(layer, "hook_mlp_out")] = _put(sources, graph.mlp_source(layer))
    logits_reader = _Reader(m[:, :, graph.logits_target:], diff, lambda: _rows(pairs, lambda r: r.corrupted.final[at]))
    hooks[layer_hook_name(n_layers - 1, "hook_resid_post")] = logits_reader.part(0, 1)
    ctx = build_context(model.hook_names, [], hooks, batched=True)
    x = torch.stack([r.clean.resid_pre[start, at] for r in pairs])  # [b, pos', d]
    cache = None
    if first:
        cache = model.decoder.new_cache(pairs[0].n_pos, b)
        for layer in range(start, n_layers):  # the clean run's keys and values of the shared positions
            cache.k[layer][:, :, :first] = torch.stack([r.clean.keys[layer, :, :first] for r in pairs])
            cache.v[layer][:, :, :first] = torch.stack([r.clean.values[layer, :, :first] for r in pairs])
        cache.length = first
    variant = resolve_variant(None, cfg)
    outputs = model.decoder.forward_from(x, start, ctx, variant, cache=cache, **metric_outputs(model, reads))
    return outputs_metrics(model, pairs, outputs, reads).tolist()


def run_from(pairs: Sequence[PairRun]) -> int:
    """The first position a patched batch of these pairs (of one length) runs: the earliest at which any of them
    differs (PairRun.shared) when their metrics read the last position only, else 0; the last position always runs
    (the metric reads it)."""
    first = min(r.shared for r in pairs) if reads_of(pairs) != "all" else 0
    return min(first, pairs[0].n_pos - 1)


def _rows(pairs: Sequence[PairRun], part: Callable[[PairRun], torch.Tensor]) -> torch.Tensor:
    """[b, ...]: part(pair) of each row, for reading only. Rows of one pair (a faithfulness curve, many edge sets of
    one prompt pair) share one tensor, expanded without a copy: stacking SmolLM2's corrupted writes [301, pos, 576]
    once per row cost as much as a layer of the forward."""
    if all(r is pairs[0] for r in pairs):
        one = part(pairs[0])
        return one[None].expand(len(pairs), *one.shape)
    return torch.stack([part(r) for r in pairs])


class _Sources:
    """Where a patched run's writes go: `into[:, index] = value` keeps diff[:, index] = corrupted - value."""

    def __init__(self, corrupted: torch.Tensor, diff: torch.Tensor):
        self.corrupted, self.diff = corrupted, diff

    def __setitem__(self, key: tuple, value: torch.Tensor) -> None:
        self.diff[key] = self.corrupted[key] - value


class _Reader:
    """The hooks of one group of destinations read at one point (a layer's q, k and v inputs; its MLP input; the
    logits' input): each adds its patched edges' a_u^corrupted - a_u to the value it sees.

    mask: Bool [b, n, k], the patched edges from the n sources this point reads into its k destinations; diff
    [b, n_src, pos, d] holds a_u^corrupted - a_u for the sources written so far. Computed for the whole group
    when its first hook fires (no source writes in between), as one batched product. A destination with at
    most half of its edges patched gets `x + sum_patched diff`; one with more gets the equal
    `corrupted input - sum_unpatched diff` (a destination's input is its sources' writes plus terms the same in
    both runs), so the sum always runs over the smaller set and rounds least. One with no edge patched keeps
    its value bit for bit, and one with every edge patched gets the corrupted run's input itself.
    """

    def __init__(self, mask: torch.Tensor, diff: torch.Tensor, corrupted_input: Callable[[], torch.Tensor]):
        self.mask, self.diff, self.corrupted_input = mask, diff, corrupted_input
        self.active = bool(mask.any())
        self.out: torch.Tensor | None = None  # [b, pos, k, d]: the group's new inputs, set by its first hook

    def part(self, offset: int, count: int) -> Callable:
        def fn(x: torch.Tensor, name: str) -> torch.Tensor | None:
            if not self.active:
                return None
            if self.out is None:
                self.out = self._compute(x[:, :, 0] if x.dim() == 4 else x)
            # contiguous: the per-head norm that reads it (Block.split_qkv) falls off ATen's fused rms_norm onto
            # its composite ops for a strided view, ~40x slower on [10, 5, 9, 576], most of a faithfulness row
            out = self.out[:, :, offset:offset + count].contiguous()  # [b, pos, count, d]
            return out if x.dim() == 4 else out[:, :, 0]

        return fn

    def _compute(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, pos, d]: the residual every destination of the group sees -> their inputs [b, pos, k, d]."""
        mask = self.mask  # [b, n, k]
        b, n, k = mask.shape
        patched = mask.sum(1)  # [b, k]
        complement = patched * 2 > n  # [b, k]: sum over the unpatched edges instead
        weights = torch.where(complement[:, None, :], -(~mask).to(x.dtype), mask.to(x.dtype))  # [b, n, k]
        diff = self.diff[:, :n].reshape(b, n, -1)  # [b, n, pos * d], a view
        delta = torch.bmm(weights.transpose(1, 2), diff).view(b, k, *x.shape[1:]).transpose(1, 2)  # [b, pos, k, d]
        corrupted = self.corrupted_input()[:, :, None] if bool(complement.any()) else None  # [b, pos, 1, d]
        if corrupted is None:
            base = x[:, :, None]
        elif bool(complement.all()):
            base = corrupted
        else:
            base = torch.where(complement[:, None, :, None], corrupted, x[:, :, None])
        # A destination with no edge patched has all-zero weights (delta exactly 0: base + delta == x), and one with
        # every edge patched sums over no unpatched edge (delta exactly 0: == its corrupted input); so no
        # torch.where is needed to keep them exact (each was one more pass over [b, pos, k, d] per layer).
        # The one exception is a non-finite difference (0 * inf), which only a diverged run has.
        return base + delta


def row_metrics(pairs: Sequence[PairRun], logits: torch.Tensor) -> torch.Tensor:
    """Each row's metric, float64 [b] (a tensor that keeps autograd's graph when the logits have one).

    The built-in logit difference reads the last position of every row at once; a metric fn sees one row's
    logits [pos, vocab]."""
    if all(r.builtin for r in pairs):
        last = logits[:, -1].double()  # [b, vocab]
        rows = torch.arange(len(pairs))
        answer = torch.tensor([r.answer for r in pairs])
        value = last[rows, answer]
        wrong = [r.wrong for r in pairs]
        if any(w is not None for w in wrong):
            has = torch.tensor([w is not None for w in wrong], device=last.device)
            value = value - torch.where(has, last[rows, torch.tensor([w or 0 for w in wrong])], 0.0)
        return value
    values = []
    for r, row in zip(pairs, logits, strict=True):
        v = r.metric(row)
        values.append(v.reshape(()).double().to(logits.device) if isinstance(v, torch.Tensor)
                      else torch.tensor(as_float(v), dtype=torch.float64, device=logits.device))
    return torch.stack(values)


# --- gradients ------------------------------------------------------------------------------------------
def gradient_scores(model: Any, graph: ComponentGraph, runs: Sequence[PairRun], alphas: Sequence[float],
                    progress: ProgressLike = None) -> torch.Tensor:
    """sum over pairs and alphas of (a_u^corrupted - a_u^clean) . d metric / d (input of v), float64 [n_src, n_dst].

    Each alpha is one run of the pair whose input embeddings are e_corrupted + alpha (e_clean - e_corrupted):
    alpha 1 is the clean run (EAP), alphas k / steps for k = 0 .. steps - 1 are EAP-IG's (hannamw/EAP-IG's
    get_scores_eap_ig: the corrupted end included, the clean end not). Sums over d_model and positions; the caller
    divides by the number of pairs and of alphas. progress: slmviz.progress's contract, counted in backward runs.
    """
    bar = as_progress(progress, "edge gradients")
    scores = torch.zeros(graph.n_src, graph.n_dst, dtype=torch.float64)
    rows = [(p, a) for p in range(len(runs)) for a in alphas]
    by_length: dict[int, list[tuple[int, float]]] = {}
    for row in rows:
        by_length.setdefault(runs[row[0]].n_pos, []).append(row)
    done = 0
    for n_pos, group in by_length.items():
        chunk = max(1, GRAD_TOKENS // n_pos)
        for i in range(0, len(group), chunk):
            part = group[i:i + chunk]
            _gradient_batch(model, graph, runs, part, scores)
            done += len(part)
            bar.update(done, len(rows), unit="run")
    return scores


def _gradient_batch(model: Any, graph: ComponentGraph, runs: Sequence[PairRun], rows: list[tuple[int, float]],
                    scores: torch.Tensor) -> None:
    cfg = model.cfg
    pairs = [runs[p] for p, _ in rows]
    reads = reads_of(pairs)
    # Positions before the first difference have a zero source difference, so their gradients add nothing: the run
    # starts there, with the clean run's keys and values of the earlier positions (the same in every row: the two
    # embeddings, and so every interpolation, agree there bit for bit).
    first = min(min(r.shared for r in pairs), pairs[0].n_pos - 1) if reads != "all" else 0
    at = slice(first, None)
    clean_e = torch.stack([r.embeds[0][at] for r in pairs])  # [b, pos', d]
    corrupted_e = torch.stack([r.embeds[1][at] for r in pairs])
    alpha = torch.tensor([a for _, a in rows], dtype=clean_e.dtype, device=clean_e.device)[:, None, None]
    # alpha 1 is the clean run itself (c + 1 * (e - c) rounds away from e); alpha 0 gives c exactly.
    embeds = torch.where(alpha == 1, clean_e, corrupted_e + alpha * (clean_e - corrupted_e))  # [b, pos', d]
    inputs: dict[str, torch.Tensor] = {}

    def grab(x: torch.Tensor, name: str) -> torch.Tensor:
        # A fresh node the forward must read (an unedited input hook is bypassed), and what autograd differentiates.
        inputs[name] = y = x.clone()
        return y

    hooks: dict[str, Callable] = {}
    for layer in range(cfg.n_layers):
        for kind in ("hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in"):
            hooks[layer_hook_name(layer, kind)] = grab
    last = layer_hook_name(cfg.n_layers - 1, "hook_resid_post")
    hooks[last] = grab
    ctx = build_context(model.hook_names, [], hooks, batched=True)
    cache = None
    if first:
        cache = model.decoder.new_cache(pairs[0].n_pos, len(rows))
        for layer in range(cfg.n_layers):
            cache.k[layer][:, :, :first] = torch.stack([r.clean.keys[layer, :, :first] for r in pairs])
            cache.v[layer][:, :, :first] = torch.stack([r.clean.values[layer, :, :first] for r in pairs])
        cache.length = first
    x = embeds.detach().requires_grad_()  # the leaf autograd starts from: hook_embed's value, from position `first`
    outputs = model.decoder.forward_from(x, 0, ctx, resolve_variant(None, cfg), grad=True, cache=cache,
                                         **metric_outputs(model, reads))
    values = outputs_metrics(model, pairs, outputs, reads)
    if not values.requires_grad:
        raise ValueError("EAP differentiates the metric: it must return a tensor computed from the logits "
                         "(e.g. logits[-1, a] - logits[-1, b]), not a float")
    names = list(inputs)
    grads = torch.autograd.grad(values.sum(), [inputs[n] for n in names], allow_unused=True)
    # Sum each pair's rows (its alphas, consecutive rows) first, then one contraction with that pair's differences.
    pair_ids = list(dict.fromkeys(p for p, _ in rows))
    counts = [sum(1 for q, _ in rows if q == p) for p in pair_ids]
    diff = torch.stack([runs[p].difference[:, at] for p in pair_ids])  # [P, n_src, pos', d]
    diff = diff.float()
    diff = diff.transpose(0, 1).reshape(graph.n_src, -1)  # [n_src, P * pos * d]
    # [P * pos * d, n_dst]: each destination's summed gradient
    columns = torch.zeros(diff.shape[1], graph.n_dst, device=diff.device)
    for name, grad in zip(names, grads, strict=True):
        if grad is None:
            continue
        grad = grad.float()
        per_pair = grad if len(counts) == len(rows) else torch.stack([part.sum(0) for part in grad.split(counts)])
        if name == last:
            targets = slice(graph.logits_target, graph.logits_target + 1)
        else:
            layer, kind = layer_of(name), name.split(".")[2]
            targets = graph.target_slices(layer)["mlp" if kind == "hook_mlp_in" else kind.split("_")[1]]
        if per_pair.dim() == 3:
            per_pair = per_pair[:, :, None]  # [P, pos, 1, d]
        columns[:, targets] = per_pair.transpose(2, 3).reshape(-1, per_pair.shape[2])  # [P * pos * d, k]
    # One GEMM for every (source, destination) pair, summed over pairs, positions and d_model; the sources a
    # destination does not read (later in the forward pass) are dropped.
    scores += (diff @ columns).double().cpu() * graph.real()  # the scores table lives on the CPU
