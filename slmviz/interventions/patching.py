"""Activation patching: which layer, position or head carries what makes the model prefer one answer?

Semantics are TransformerLens's `patching` module (`get_act_patch_resid_pre` and friends), so a sweep here
can be checked against one there: run the *target* prompt, overwrite one cell of one hook with the *source*
prompt's value at that cell, and read the metric (default `logit(answer) - logit(wrong)` at the last position).
Denoising (TL's default) patches clean into corrupted: a cell that restores the clean metric carries the
information. Noising patches corrupted into clean: a cell that destroys it is necessary.

    r = slmviz.patch(clean, corrupted, answer=" Mary", wrong=" John", site="resid_pre", model=m)
    r.values        # [n_layers, pos]: the metric after each single patch
    r.normalized    # (values - corrupted) / (clean - corrupted): 1 = fully restored, 0 = no effect

Sites and result shapes (docs/interventions.md); `h` query heads, `g` KV heads (never padded to h):

| site | hook | cell | values |
| --- | --- | --- | --- |
| resid_pre, resid_mid, resid_post, attn_out, mlp_out | blocks.L.hook_<site> | [p] | [n_layers, pos] |
| z, q | attn.hook_z / hook_q (q before RoPE, as TL) | [p, head] | [n_layers, pos, h] |
| pattern | attn.hook_pattern | query row p of head: [head, p, :] | [n_layers, pos, h] |
| k, v | attn.hook_k / hook_v (k before RoPE) | [p, kv head] | [n_layers, pos, g] |
| heads | attn.hook_z at every position | [:, head] | [n_layers, h] |

(TL returns its pattern sweep as [layer, head, dest_pos]; here it is [layer, pos, head] like z and q.)

Two engines compute the same numbers. `engine="per_cell"` is the straightforward method (one hooked forward
per cell, what TL does) and the reference the fast engine is tested against. `engine="batched"` (the default)
uses what a sweep shares: every patched run has the prompt's length, so many run as one batch; a run patched
at layer L equals the target run before L, so it starts from the target's cached resid_pre of layer L; a run
patched at position p equals the target at every position before p, so it starts there too, reading the
earlier keys and values from a KV cache; and a cell whose source and target values are bit-identical (every
position before the prompts' first differing token) is the identity patch, whose value is the target's metric.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..hooks import HookFn, build_context, layer_hook_name
from ..metrics import Metric, as_float, check_same_length, first_difference, logit_diff, single_token_id
from ..progress import ProgressLike, as_progress
from ..variants import Variant, VariantLike, resolve_variant
from .attribution import attribution_sweep
from .features import SITE as FEATURE_SITE
from .features import check_saes, feature_sweep
from .result import PatchResult, _writer
from .sites import Site, axis_sizes, site_hook_name, site_of

DIRECTIONS = ("denoise", "noise")
METHODS = ("exact", "attribution")
ENGINES = ("batched", "per_cell")
TOKENS_PER_BATCH = 4096  # rows x positions of one batched forward: [4096, 2 * d_mlp] fp32 is ~25 MB on SmolLM2


# --- the sweep -----------------------------------------------------------------------------------
def patch(
    clean: str | Sequence[int] | torch.Tensor,
    corrupted: str | Sequence[int] | torch.Tensor,
    answer: str | int | Metric | None = None,
    wrong: str | int | None = None,
    site: str = "resid_pre",
    model: Any = None,
    metric: Metric | None = None,
    direction: str = "denoise",
    method: str = "exact",
    engine: str | None = None,
    variant: VariantLike = None,
    chat: bool = False,
    progress: ProgressLike = None,
    saes: Sequence[Any] | None = None,
    top: int | None = None,
) -> PatchResult:
    """Patch every cell of `site` (see the module table) one at a time and return the sweep.

    answer / wrong: single-token strings (" Mary") or ids; the metric is logit(answer) - logit(wrong) at the
    last position. Or pass `metric=fn(logits [pos, vocab]) -> number` (or a callable as `answer`).
    direction: "denoise" runs corrupted and patches in clean (TL's default); "noise" the reverse.
    method: "exact" (one patched run per cell) or "attribution" (a first-order estimate for every cell
    from one forward and one backward pass; see slmviz.interventions.attribution).
    progress: slmviz.progress's contract (True: a tqdm bar; fn(ProgressUpdate); a caller's Progress part), one
    report as each cell finishes (unit "cell"); a sink that raises stops the sweep there.
    The prompts must have the same number of tokens.
    saes: SAEs spliced into every run (clean, corrupted and patched), as in `Model.trace`.
    site="sae" patches the SAEs' features (slmviz.interventions.features): one cell per (SAE, feature, position)
    active in either run, each estimated by attribution, and the `top` cells (default 20; 0 with
    method="attribution") also run exactly; returns a FeaturePatchResult.
    """
    job = as_progress(progress, "patch")
    result = None
    for result in patch_steps(clean, corrupted, answer, wrong, site, model, metric, direction, method, engine,
                              variant, chat, saes, top):
        job.update(result.done, result.total, unit="cell")
    assert result is not None
    return result


def patch_steps(
    clean: str | Sequence[int] | torch.Tensor,
    corrupted: str | Sequence[int] | torch.Tensor,
    answer: str | int | Metric | None = None,
    wrong: str | int | None = None,
    site: str = "resid_pre",
    model: Any = None,
    metric: Metric | None = None,
    direction: str = "denoise",
    method: str = "exact",
    engine: str | None = None,
    variant: VariantLike = None,
    chat: bool = False,
    saes: Sequence[Any] | None = None,
    top: int | None = None,
) -> Iterator[PatchResult]:
    """`patch`, yielding a partial PatchResult after each batch of cells (the app draws and cancels with it).

    The first yield has the two unpatched metrics and no cell; the last is the complete sweep.
    """
    if model is None:
        from ..model_api import load

        model = load()
    features = site == FEATURE_SITE
    s = None if features else site_of(site)
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if top is not None and not features:
        raise ValueError(f"top= is the number of feature cells to run exactly, for site='sae' only (site is {site!r})")
    if features:
        check_saes(saes, model)
        if method == "attribution" and top:
            raise ValueError("method='attribution' runs no cell exactly; use method='exact' with top=n")
    v = resolve_variant(variant)
    clean_ids, corrupted_ids = model.encode(clean, chat), model.encode(corrupted, chat)
    check_same_length(model, clean_ids, corrupted_ids)
    fn, name, default_metric = resolve_metric(model, answer, wrong, metric)
    target_ids, source_ids = (corrupted_ids, clean_ids) if direction == "denoise" else (clean_ids, corrupted_ids)

    if features:
        yield feature_sweep(model, saes, clean_ids, corrupted_ids, target_ids, source_ids, fn, name, default_metric,
                            direction, v, 0 if method == "attribution" else top, per_cell=engine == "per_cell")
        return
    assert s is not None

    if method == "attribution":
        yield attribution_sweep(model, s, site, clean_ids, corrupted_ids, target_ids, source_ids, fn, name,
                                direction, v, saes)
        return

    n_layers = model.cfg.n_layers
    site_names = [site_hook_name(s, layer) for layer in range(n_layers)]
    starts = [layer_hook_name(layer, "hook_resid_pre") for layer in range(n_layers)]
    source = model.trace(source_ids, variant=v, names=site_names, saes=saes)
    kv = [layer_hook_name(layer, f"attn.{hook}") for layer in range(n_layers) for hook in ("hook_rot_k", "hook_v")]
    target = model.trace(target_ids, variant=v, names=sorted(set(site_names + starts + kv)), saes=saes)
    clean_run, corrupted_run = (source, target) if direction == "denoise" else (target, source)
    shape = axis_sizes(s, model.cfg, target_ids.numel())
    cells = list(_cells(shape))
    result = PatchResult(
        site=site, values=torch.full(shape, float("nan"), dtype=torch.float64),
        clean=as_float(fn(clean_run.logits)), corrupted=as_float(fn(corrupted_run.logits)),
        tokens=target.tokens, source_tokens=source.tokens, direction=direction, method="exact",
        metric_name=name, done=0, total=len(cells),
        _run={"model": model, "target_ids": target_ids, "source_ids": source_ids, "variant": v, "saes": saes},
    )
    yield result
    base = as_float(fn(target.logits))
    engine = engine or "batched"
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    sweep = _batched if engine == "batched" else _per_cell
    for done_cells, values in sweep(model, s, cells, source.cache, target, fn, default_metric, base, v, saes):
        for cell, value in zip(done_cells, values, strict=True):
            result.values[cell] = value
        result.done += len(done_cells)
        yield result


def resolve_metric(model: Any, answer: str | int | Metric | None, wrong: str | int | None,
                   metric: Metric | None) -> tuple[Metric, str, bool]:
    """(metric fn, its display name, whether it is the built-in logit difference)."""
    if callable(answer) and metric is None:
        answer, metric = None, answer
    if metric is not None:
        if answer is not None or wrong is not None:
            raise ValueError("Pass either answer/wrong tokens or a metric fn, not both")
        if not callable(metric):
            raise ValueError(f"metric must be a fn(logits [pos, vocab]) -> number, got {type(metric).__name__}")
        return metric, getattr(metric, "__name__", "metric"), False
    if answer is None:
        raise ValueError("patch needs answer= (a single token, e.g. ' Mary'), optionally wrong=, or metric=fn")
    vocab = model.cfg.vocab_size
    a = single_token_id(model.tokenizer, answer, vocab, "answer")
    w = None if wrong is None else single_token_id(model.tokenizer, wrong, vocab, "wrong")
    if w == a:
        raise ValueError(f"answer and wrong are the same token ({answer!r}); the logit difference would be 0")
    show = model.to_strings
    name = f"logit({show([a])[0]!r})" + (f" - logit({show([w])[0]!r})" if w is not None else "")
    return logit_diff(a, w), name, True


def _cells(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every (layer, *cell) index of a result of this shape, layer-major (the order of TL's index_df)."""
    grid = torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij")
    for idx in torch.stack(grid, -1).reshape(-1, len(shape)).tolist():
        yield tuple(idx)


def _batch_writer(src: torch.Tensor, cells: list[tuple[tuple, tuple]]) -> HookFn:
    """Batched: row i of the [b, *shape] value gets src[source index] at its own target index (cells[i]).

    The two indices differ when the run starts after a shared prefix (positions shift by its length)."""

    def write(x: torch.Tensor, name: str) -> torch.Tensor:
        out = x.clone()
        for row, (src_index, dst_index) in enumerate(cells):
            out[row][dst_index] = src[src_index]
        return out

    return write


Sweep = Iterator[tuple[list[tuple[int, ...]], list[float]]]


def _per_cell(model: Any, site: Site, cells: list[tuple[int, ...]], source: dict[str, torch.Tensor], target: Any,
              metric: Metric, default_metric: bool, base: float, variant: Variant, saes: Any = None) -> Sweep:
    """The reference: one hooked forward of the whole target prompt per cell (TransformerLens's method)."""
    ids = target.input_ids
    for layer, *rest in cells:
        name = site_hook_name(site, layer)
        ctx = build_context(model.hook_names, [], {name: _writer(source[name], site.index(tuple(rest)))}, saes=saes)
        logits = model.decoder.forward(ids, ctx, variant)  # [pos, vocab]
        yield [(layer, *rest)], [as_float(metric(logits))]


def _batched(model: Any, site: Site, cells: list[tuple[int, ...]], source: dict[str, torch.Tensor], target: Any,
             metric: Metric, default_metric: bool, base: float, variant: Variant, saes: Any = None) -> Sweep:
    """Cells of one layer as batches of patched copies, each started from the target's state at that layer.

    Exact shortcuts, each an identity of the forward pass (tests/test_patching.py checks the result against
    `_per_cell` within 1e-5 on every site):
    - a run patched at layer L equals the target run before L: it starts from the target's resid_pre of L;
    - a cell whose source value equals the target's bit for bit is the identity patch: its value is `base`;
    - a run patched at position p or later equals the target run at every position before p (causal
      attention), so a batch whose earliest patched position is s runs positions s.. only, reading the
      target's keys and values of positions < s from a KV cache (`_shared_prefix`). Used with the built-in
      metric, which reads the last position only; a user's metric fn may read any position's logits.
    """
    n_pos = target.input_ids.numel()
    decoder = model.decoder
    conventions = decoder.conventions(variant)
    skip_prefix = default_metric and site.axes[0] == "position" and not conventions.kv_position_bug
    by_layer: dict[int, list[tuple[int, ...]]] = {}
    for cell in cells:
        by_layer.setdefault(cell[0], []).append(cell)
    for layer, layer_cells in by_layer.items():
        name = site_hook_name(site, layer)
        src, tgt = source[name], target.cache[name]
        same = {c for c in layer_cells if torch.equal(src[site.index(c[1:])], tgt[site.index(c[1:])])}
        if same:
            yield sorted(same), [base] * len(same)
        todo = sorted((c for c in layer_cells if c not in same), key=lambda c: c[1:])  # by position
        start = target.cache[layer_hook_name(layer, "hook_resid_pre")]  # [pos, d_model]
        i = 0
        while i < len(todo):
            prefix = todo[i][1] if skip_prefix else 0  # the batch's earliest patched position
            rows = max(1, TOKENS_PER_BATCH // (n_pos - prefix))
            chunk = todo[i:i + rows]
            i += len(chunk)
            moves = [(site.index(c[1:]), site.index((c[1] - prefix, *c[2:]))) for c in chunk]
            ctx = build_context(model.hook_names, [], {name: _batch_writer(src, moves)}, batched=True, saes=saes)
            x = start[prefix:].expand(len(chunk), n_pos - prefix, start.shape[-1])  # [b, pos - prefix, d_model]
            if prefix:
                cache = _shared_prefix(model, target, layer, prefix, len(chunk))
                logits = decoder.forward_from(x, layer, ctx, variant, last_only=True, cache=cache)  # [b, 1, vocab]
            else:
                logits = decoder.forward_from(x, layer, ctx, variant, last_only=default_metric)  # [b, pos, vocab]
            # the built-in metric reads a batch at once ([b]); a user's fn sees one run's logits [pos, vocab]
            yield chunk, metric(logits).tolist() if default_metric else [as_float(metric(row)) for row in logits]


def _shared_prefix(model: Any, target: Any, layer: int, n: int, batch: int) -> Any:
    """A KV cache holding the target run's keys (after RoPE) and values of positions < n for layers >= `layer`.

    Every row of the batch shares them: a patch at position >= n cannot change what came before it.
    """
    cache = model.decoder.new_cache(len(target.tokens), batch)
    for later in range(layer, model.cfg.n_layers):
        k = target.cache[layer_hook_name(later, "attn.hook_rot_k")][:n].transpose(0, 1)  # [n, g, dh] -> [g, n, dh]
        v = target.cache[layer_hook_name(later, "attn.hook_v")][:n].transpose(0, 1)
        cache.k[later][:, :, :n] = k  # [b, g, n, dh], the same prefix in every row
        cache.v[later][:, :, :n] = v
    cache.length = n
    return cache


Prompt = str | Sequence[int] | torch.Tensor


def suggest_answers(model: Any, clean: Prompt, corrupted: Prompt, chat: bool = False,
                    variant: VariantLike = None) -> tuple[str, str]:
    """(answer, wrong) from the prompts' first differing token: the two tokens there, ordered so that the clean
    prompt's next-token logit prefers the answer (IOI: swapping the second name makes the *other* name the answer).

    Refuses prompts of different lengths or without a differing token.
    """
    clean_ids, corrupted_ids = model.encode(clean, chat), model.encode(corrupted, chat)
    check_same_length(model, clean_ids, corrupted_ids)
    diff = first_difference(clean_ids, corrupted_ids)
    if diff is None:
        raise ValueError("The clean and corrupted prompts are the same tokens; change a word in one of them")
    a, b = int(clean_ids[diff]), int(corrupted_ids[diff])
    logits = model.trace(clean_ids, variant=variant, names=[]).logits[-1]
    answer, wrong = (a, b) if logits[a] >= logits[b] else (b, a)
    return tuple(model.to_strings([answer, wrong]))  # type: ignore[return-value]
