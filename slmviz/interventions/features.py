"""SAE features as a patch site: which features, at which positions, carry the difference between two prompts.

`slmviz.patch(clean, corrupted, ..., saes=[sae], site="sae")` is a sparse feature circuit in the sense of Marks et
al. (2024, "Sparse Feature Circuits"): its cells are (SAE, feature, position) for every feature active in either
run (hook_sae_acts_post > 0) at every position, and every SAE is spliced with its error term, so the model computes
exactly what it computes without SAEs and a feature's activation is one more place to intervene.

- **Attribution, every cell:** (f_source - f_target) . d metric / d f at the target run, f = `hook_sae_acts_post`.
  With the error term the SAE's output is x_out + (x_hat(f) - x_hat(f_target)), so d output / d f = W_dec and the
  downstream model, other SAEs included, is the model itself (their error terms pass everything through, the
  rule of Marks et al.'s error nodes). The gradient is therefore d metric / d(the hook the SAE writes) @ W_dec.T,
  from one forward and one backward of the target run without splicing. (Autograd through the splice itself
  holds each error term constant, SAELens's rule, and differentiates later SAEs' reconstructions instead: equal
  for the last SAE, not for earlier ones.)
- **Exact, the `top` cells by |attribution|:** the target run with that one feature's activation at that position
  set to its source value, every SAE spliced with its error term. Batched; each batch starts at the first layer
  it edits (before it the run is the target run, read from its cached resid_pre).

`direction` as for every site: "denoise" patches clean values into the corrupted run, "noise" (Marks et al.'s
setting) corrupted values into the clean run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ..hooks import build_context, layer_hook_name
from ..metrics import Metric, as_float
from ..variants import Variant, VariantLike, resolve_variant
from .attribution import gradients_at
from .result import PatchResult

SITE = "sae"
TOP = 20  # exact patched runs by default: the cells of largest |attribution|
TOKENS_PER_BATCH = 4096  # rows x positions of one batched exact forward (as patching.TOKENS_PER_BATCH)


def check_saes(saes: Sequence[Any] | None, model: Any) -> list[Any]:
    """The SAEs of a feature sweep, refused with a reason when they cannot be one."""
    if not saes:
        raise ValueError("site='sae' patches SAE features: pass saes=[sae, ...] (slmviz.load_sae(...) or one of "
                         "slmviz.bundled_saes(model))")
    saes = list(saes)
    outs = [sae.hook_name_out for sae in saes]
    if len(set(outs)) != len(outs):
        raise ValueError(f"Two SAEs write the same hook ({', '.join(sorted({o for o in outs if outs.count(o) > 1}))}); "
                         "a feature sweep names its cells by (hook, feature, position), so give one SAE per hook")
    for sae in saes:
        if "hook_embed" in (sae.hook_name, sae.hook_name_out):
            raise ValueError("An SAE on hook_embed cannot be a patch site (the embedding is where the gradient "
                             "starts); train or load one on blocks.0.hook_resid_pre")
        if sae.hook_name_out not in model.hook_names:
            raise ValueError(f"The SAE at {sae.hook_name_out!r} does not fit this model: it has no such hook")
    return saes


def _layer(hook: str) -> int | None:
    """The block a hook sits in (None for hook_embed, before every block)."""
    found = re.match(r"blocks\.(\d+)\.", hook)
    return int(found.group(1)) if found else None


def _start(sae: Any) -> int:
    """The first block whose run an edit of this SAE's features changes: the block of the hook it reads."""
    layers = [layer for layer in (_layer(sae.hook_name), _layer(sae.hook_name_out)) if layer is not None]
    return min(layers, default=0)


def acts_name(sae: Any) -> str:
    return f"{sae.hook_name_out}.hook_sae_acts_post"


@dataclass(repr=False)
class FeaturePatchResult(PatchResult):
    """A feature sweep: one cell per (SAE, feature, position) active in either run.

    `values` [n_cells]: the attribution estimate of the metric after each single patch (target metric + the
    first-order change); `exact` [n_cells]: the patched run's metric for the `top` cells (NaN elsewhere);
    `cells`: DataFrame hook, layer, feature, position, source_act, target_act (one row per cell, values' order).
    """

    exact: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    cells: pd.DataFrame = field(default_factory=pd.DataFrame)
    target_metric: float = float("nan")

    @property
    def dims(self) -> tuple[str, ...]:
        return ("cell",)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        span = self.clean - self.corrupted
        return torch.full_like(x, float("nan")) if span == 0 else (x - self.corrupted) / span

    @property
    def exact_normalized(self) -> torch.Tensor:
        return self._normalize(self.exact)

    def frame(self) -> pd.DataFrame:
        """One row per cell: hook, layer, feature, position, token, source_act, target_act, value (attribution),
        normalized, exact, exact_normalized (NaN where not run), effect (value - the target's metric)."""
        frame = self.cells.copy()
        frame["token"] = [self.tokens[p] for p in frame["position"]]
        frame["value"] = self.values.tolist()
        frame["normalized"] = self.normalized.tolist()
        frame["exact"] = self.exact.tolist()
        frame["exact_normalized"] = self.exact_normalized.tolist()
        frame["effect"] = (self.values - self.target_metric).tolist()
        return frame

    def top(self, n: int = 20, by: str = "attribution") -> pd.DataFrame:
        """The n cells of largest |effect| on the metric: by the attribution estimate, or by="exact" (the cells run)."""
        if by not in ("attribution", "exact"):
            raise ValueError(f"by must be 'attribution' or 'exact', got {by!r}")
        frame = self.frame()
        key = (frame["value"] if by == "attribution" else frame["exact"]) - self.target_metric
        frame = frame.assign(_key=key.abs()).dropna(subset=["_key"])
        frame = frame.sort_values("_key", ascending=False, kind="stable")
        return frame.drop(columns="_key").head(n).reset_index(drop=True)

    def plot(self, n: int = 20, **kwargs):
        """Bars of the n cells of largest |attribution| (see slmviz.plots.patch.feature_patch_bars)."""
        from ..plots.patch import feature_patch_bars

        return feature_patch_bars(self, n, **kwargs)

    def run_cell(self, hook: str, feature: int, position: int):  # type: ignore[override]
        """The exact patched run of one cell (hook = the SAE's hook_name_out) as a full Trace: one forward."""
        if not self._run:
            raise RuntimeError("This result does not know its model (it was built by hand); call slmviz.patch")
        r = self._run
        match = self.cells[(self.cells["hook"] == hook) & (self.cells["feature"] == feature)
                           & (self.cells["position"] == position)]
        if match.empty:
            raise ValueError(f"No cell ({hook!r}, feature {feature}, position {position}): cells are the features "
                             "active in either run; see .cells")
        value = float(match["source_act"].iloc[0])
        saes = r["saes"]
        sae = next(s for s in saes if s.hook_name_out == hook)

        def put(x: torch.Tensor, name: str) -> torch.Tensor:
            out = x.clone()
            out[position, feature] = value
            return out

        return r["model"].trace(r["target_ids"], variant=r["variant"], saes=saes, hooks={acts_name(sae): put})

    def __repr__(self) -> str:
        run = int((~torch.isnan(self.exact)).sum()) if self.exact.numel() else 0
        n_saes = self.cells["hook"].nunique()
        return (f"FeaturePatchResult({len(self.cells)} cells over {n_saes} SAEs, {self.direction}, "
                f"clean={self.clean:.4g}, corrupted={self.corrupted:.4g}, {run} run exactly)")


def feature_sweep(model: Any, saes: Sequence[Any], clean_ids: torch.Tensor, corrupted_ids: torch.Tensor,
                  target_ids: torch.Tensor, source_ids: torch.Tensor, metric: Metric, metric_name: str,
                  default_metric: bool, direction: str, variant: VariantLike, top: int | None,
                  per_cell: bool = False) -> FeaturePatchResult:
    """The sweep behind `patch(..., site="sae")` (module docstring): attribution for every cell, exact for `top`."""
    saes = check_saes(saes, model)
    top = TOP if top is None else top
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be a non-negative number of cells to run exactly, got {top!r}")
    v = resolve_variant(variant)
    names = [acts_name(sae) for sae in saes]
    source = model.trace(source_ids, variant=v, names=names, saes=saes)
    starts = sorted({layer_hook_name(_start(sae), "hook_resid_pre") for sae in saes})  # where exact runs begin
    target = model.trace(target_ids, variant=v, names=names + starts, saes=saes)
    grads, value = _output_gradients(model, saes, target_ids, metric, v)
    rows: list[dict[str, Any]] = []
    estimate: list[torch.Tensor] = []
    grad_at = {sae.hook_name_out: g for sae, g in zip(saes, grads, strict=True)}
    for sae, name in zip(saes, names, strict=True):
        src, tgt = source[name].double(), target[name].double()  # [pos, d_sae]
        positions, features = ((src != 0) | (tgt != 0)).nonzero(as_tuple=True)
        grad_f = feature_gradient(sae, grad_at, tgt)
        delta = src - tgt
        estimate.append((delta * grad_f)[positions, features].cpu())  # the sweep's table lives on the CPU
        rows += [{"hook": sae.hook_name_out, "layer": _layer(sae.hook_name_out), "feature": f, "position": p,
                  "source_act": float(src[p, f]), "target_act": float(tgt[p, f])}
                 for p, f in zip(positions.tolist(), features.tolist(), strict=True)]
    cells = pd.DataFrame(rows, columns=["hook", "layer", "feature", "position", "source_act", "target_act"])
    cells["layer"] = cells["layer"].astype("Int64")
    base = as_float(value)
    values = base + (torch.cat(estimate) if estimate else torch.zeros(0, dtype=torch.float64))
    exact = torch.full_like(values, float("nan"))
    order = torch.argsort((values - base).abs(), descending=True, stable=True)[:top]
    chosen = [int(i) for i in order]
    if chosen:
        by_sae = {sae.hook_name_out: sae for sae in saes}
        jobs = [(by_sae[cells.at[i, "hook"]], int(cells.at[i, "position"]), int(cells.at[i, "feature"]),
                 float(source[acts_name(by_sae[cells.at[i, "hook"]])][cells.at[i, "position"], cells.at[i, "feature"]]))
                for i in chosen]
        exact[chosen] = torch.tensor(_exact(model, saes, target, jobs, metric, default_metric, v, per_cell),
                                     dtype=torch.float64)
    clean_run, corrupted_run = (source, target) if direction == "denoise" else (target, source)
    return FeaturePatchResult(
        site=SITE, values=values, clean=as_float(metric(clean_run.logits)),
        corrupted=as_float(metric(corrupted_run.logits)), tokens=target.tokens, source_tokens=source.tokens,
        direction=direction, method="attribution", metric_name=metric_name, done=len(values), total=len(values),
        exact=exact, cells=cells, target_metric=base,
        _run={"model": model, "target_ids": target_ids, "source_ids": source_ids, "variant": v, "saes": saes},
    )


def feature_gradient(sae: Any, grad_at: dict[str, torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """d metric / d f [pos, d_sae] (float64): Σ over the hooks the SAE's features write of d metric / d (that hook)
    @ the decoder rows there (`decoder_rows`: an SAE writes its own hook through W_dec; a cross-layer transcoder's
    layer, replacement.clt.CLTLayer, writes every later MLP output, each through its own slice of W_dec). A hook the
    metric does not read (e.g. a position after the one it reads) adds nothing."""
    rows = sae.decoder_rows()
    out = torch.zeros_like(like)
    for hook, w in rows.items():
        g = grad_at.get(hook)
        if g is not None:
            flat = g.flatten(1) if g.dim() == 3 else g  # [pos, d_out] (hook_z: [pos, h*dh])
            out += flat.double() @ w.detach().double().T  # [pos, d_sae]: d output / d f = the decoder rows
    return out


def _output_gradients(model: Any, saes: Sequence[Any], target_ids: torch.Tensor, metric: Metric,
                      variant: Variant) -> tuple[list[torch.Tensor | None], torch.Tensor]:
    """d metric / d (the value of each SAE's hook_name_out) at the target run [pos, *hook shape], and the metric.

    Run without splicing: with error terms the spliced run is this run, and this is the derivative of the function
    an exact patch evaluates (every SAE's output is x_out + (x_hat(f) - x_hat(f_target)))."""
    _, grads, value = gradients_at(model, target_ids, [sae.hook_name_out for sae in saes], metric, variant,
                                what="Attribution over features")
    return [None if g is None else g[0].detach() for g in grads], value


def _exact(model: Any, saes: Sequence[Any], target: Any, jobs: list[tuple[Any, int, int, float]], metric: Metric,
           default_metric: bool, variant: Variant, per_cell: bool) -> list[float]:
    """The metric of the target run with one feature activation set per row: jobs (sae, position, feature, value).

    Rows are sorted by the layer they edit and batched; a batch starts at its first edited layer from the target's
    resid_pre there (the run is the target run before it)."""
    n_pos = len(target.tokens)
    order = sorted(range(len(jobs)), key=lambda i: _start(jobs[i][0]))
    rows = 1 if per_cell else max(1, TOKENS_PER_BATCH // n_pos)
    out = [float("nan")] * len(jobs)
    starts = {layer: target_resid(model, target, layer, variant) for layer in {_start(job[0]) for job in jobs}}
    for i in range(0, len(order), rows):
        part = order[i:i + rows]
        batch = [jobs[j] for j in part]
        hooks = {acts_name(sae): _setter([(row, p, f, value) for row, (s, p, f, value) in enumerate(batch) if s is sae])
                 for sae in saes}
        ctx = build_context(model.hook_names, [], hooks, batched=True, saes=saes)
        start = min(_start(sae) for sae, *_ in batch)
        x = starts[start].expand(len(batch), *starts[start].shape)  # [b, pos, d_model]
        logits = model.decoder.forward_from(x, start, ctx, variant, last_only=default_metric)  # [b, pos, vocab]
        values = metric(logits).tolist() if default_metric else [as_float(metric(r)) for r in logits]
        for j, value in zip(part, values, strict=True):
            out[j] = float(value)
    return out


def target_resid(model: Any, target: Any, layer: int, variant: Variant) -> torch.Tensor:
    """The target run's resid_pre of `layer` [pos, d_model] (one capture-only forward, stopped at that layer)."""
    name = layer_hook_name(layer, "hook_resid_pre")
    if name in target.cache:
        return target.cache[name]
    return model.trace(target.input_ids, variant=variant, names=[name])[name]


def _setter(cells: list[tuple[int, int, int, float]]) -> Any:
    """A hook on hook_sae_acts_post [b, pos, d_sae] setting, in row r, f[p, feature] = value for each (r, p, feature,
    value); rows it does not name pass through unchanged."""

    def put(x: torch.Tensor, name: str) -> torch.Tensor:
        if not cells:
            return x
        out = x.clone()
        for row, p, f, value in cells:
            out[row, p, f] = value
        return out

    return put
