"""Attribution patching: a first-order estimate of every cell of a patching sweep from one forward and one backward.

For a cell with activation a, patching the source value in changes the metric by about

    (a_source - a_target) · ∂metric/∂a        (the gradient taken on the target run)

(Nanda, "Attribution Patching", 2023; Syed et al., 2023). One forward with autograd on (the decoder's
`grad=True`, the same code as every other run) and one backward give the gradient at every site of every layer,
so the whole sweep costs about three forwards instead of one per cell.

It is an estimate, and how good depends on how linear the model is over the patch: good for small activations
such as one head's z or one position's key, poor for the residual stream, where a patch replaces the whole
state of a position and everything downstream is far from linear. The correlation with the exact sweep is
measured by bench/perf/patching.py and recorded in bench/results/notes.md; `exact_correlation` measures it for one
result.
Where the two runs' activations are equal the estimate is exactly 0 (the delta is 0).
"""

from __future__ import annotations

from typing import Any

import torch

from ..hooks import build_context
from ..metrics import Metric, as_float
from ..variants import Variant
from .result import PatchResult
from .sites import Site, axis_sizes, site_hook_name


def gradients_at(model: Any, ids: torch.Tensor, names: list[str], metric: Metric, variant: Variant,
                 saes: Any = None, what: str = "Attribution",
                 ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor | None], torch.Tensor]:
    """(each of `names`' value {name: [b = 1, pos, ...]}, d metric / d that value for each of `names` (None where
    the metric does not depend on it), the metric) from one forward of `ids` with autograd on and one backward.
    `what` names the caller in the error a float metric gets."""
    acts: dict[str, torch.Tensor] = {}

    def leaf(x: torch.Tensor, name: str) -> torch.Tensor:
        return x.detach().requires_grad_()  # the root of the graph: the weights themselves need no gradient

    def grab(x: torch.Tensor, name: str) -> torch.Tensor:
        # A fresh node the rest of the forward must read: a value passed through unchanged may be bypassed
        # (q and k are rotated straight from the fused projection when no hook edits them).
        acts[name] = y = x.clone()
        return y

    ctx = build_context(model.hook_names, [], {"hook_embed": leaf, **{n: grab for n in names}}, batched=True,
                        saes=saes)
    logits = model.decoder.forward(ids[None], ctx, variant, grad=True)[0]  # [pos, vocab]
    value = metric(logits)
    if not (isinstance(value, torch.Tensor) and value.requires_grad):
        raise ValueError(f"{what} differentiates the metric: it must return a tensor computed from "
                         "the logits (e.g. logits[-1, a] - logits[-1, b]), not a float")
    grads = list(torch.autograd.grad(value.sum(), [acts[n] for n in names], allow_unused=True))
    return acts, grads, value.detach()


def attribution_sweep(model: Any, site: Site, site_name: str, clean_ids: torch.Tensor, corrupted_ids: torch.Tensor,
                      target_ids: torch.Tensor, source_ids: torch.Tensor, metric: Metric, metric_name: str,
                      direction: str, variant: Variant, saes: Any = None) -> PatchResult:
    """Every cell's estimate as a PatchResult: values = the target's metric + the first-order change."""
    names = [site_hook_name(site, layer) for layer in range(model.cfg.n_layers)]
    source = model.trace(source_ids, variant=variant, names=names, saes=saes)
    acts, grads, value = gradients_at(model, target_ids, names, metric, variant, saes, what="Attribution patching")
    shape = axis_sizes(site, model.cfg, target_ids.numel())
    estimate = torch.zeros(shape, dtype=torch.float64)
    for layer, (name, grad) in enumerate(zip(names, grads, strict=True)):
        if grad is None:  # the metric does not depend on this site (e.g. a layer past the read position)
            continue
        delta = source[name].double() - acts[name][0].detach().double()  # [*hook shape], batch-free
        estimate[layer] = site.cell_sums(delta * grad[0].double())
    base = as_float(value)
    clean_metric, corrupted_metric = _unpatched(model, metric, clean_ids, corrupted_ids, variant, direction, base,
                                                saes)
    return PatchResult(
        site=site_name, values=base + estimate, clean=clean_metric, corrupted=corrupted_metric,
        tokens=model.to_strings(target_ids), source_tokens=model.to_strings(source_ids), direction=direction,
        method="attribution", metric_name=metric_name, done=estimate.numel(), total=estimate.numel(),
        _run={"model": model, "target_ids": target_ids, "source_ids": source_ids, "variant": variant, "saes": saes},
    )


def _unpatched(model: Any, metric: Metric, clean_ids: torch.Tensor, corrupted_ids: torch.Tensor, variant: Variant,
               direction: str, target_metric: float, saes: Any = None) -> tuple[float, float]:
    """(clean, corrupted) metrics; the target's is already known from the gradient run."""
    other_ids = clean_ids if direction == "denoise" else corrupted_ids
    other = as_float(metric(model.trace(other_ids, variant=variant, names=[], saes=saes).logits))
    return (other, target_metric) if direction == "denoise" else (target_metric, other)


def exact_correlation(estimate: PatchResult, exact: PatchResult) -> float:
    """Pearson r between an attribution sweep and the exact sweep of the same site; also stored on `estimate`."""
    if estimate.values.shape != exact.values.shape or estimate.site != exact.site:
        raise ValueError(f"Compare sweeps of the same site and shape: {estimate.site} {tuple(estimate.values.shape)} "
                         f"vs {exact.site} {tuple(exact.values.shape)}")
    a, b = estimate.values.reshape(-1).double(), exact.values.reshape(-1).double()
    a, b = a - a.mean(), b - b.mean()
    denom = float(a.norm() * b.norm())
    r = float(a @ b) / denom if denom > 0 else float("nan")
    estimate.correlation = r
    return r
