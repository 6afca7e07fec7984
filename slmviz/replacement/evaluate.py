"""`slmviz.evaluate_transcoders`: a whole transcoder set on a corpus, every layer from one forward, and the model run
with every MLP replaced at once.

    r = slmviz.evaluate_transcoders(ts, "heldout.jsonl", model=m, tokens=20_000)
    r["layers"]          # DataFrame: layer, explained_variance, l0, frac_dead, frac_dense, mse (evaluate_sae's)
    r["replaced"]        # {ce_loss_score, kl_score, top1_agreement, ce_clean, ce_replaced, ce_zero, ...}

Per layer, the figures are evaluate_sae's over the rows activations.sae_rows keeps for that layer (the same rule as
training), on the clean run's activations. `replaced` is the replacement model as a language model: each layer's
MLP output is the set's reconstruction from the *replaced* run's own activations (no error terms), one layer after
another, so errors compound as they do in an attribution graph; ce_loss_score = (CE_zero - CE_replaced) /
(CE_zero - CE_clean) with CE_zero every replaced MLP output set to 0 (for a one-layer set, evaluate_sae's
figures exactly); top1_agreement: the share of next-token predictions
whose argmax equals the clean model's. As in evaluate_sae, rows a layer does not evaluate (a window's first position,
a massive row: the attention sink) keep their own MLP output in every run, and CE, KL and agreement are over the
predictions made at positions every layer evaluates.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from ..corpora.reading import CorpusError
from ..features.activations import sae_rows
from ..features.evaluate import Totals, evaluation_batches
from ..hooks import build_context
from ..progress import ProgressLike
from ..variants import resolve_variant
from .base import ReplacementSet
from .transcoder_set import as_replacement


def evaluate_transcoders(ts: Any, corpus: Any, model: Any, tokens: int | None = 20_000, window: int = 128,
                         batch_tokens: int = 512, progress: ProgressLike = True) -> dict[str, Any]:
    """Per-layer metrics and the all-layers-replaced run of set `ts` on `corpus` (module docstring)."""
    ts = as_replacement(ts)
    ts.check_model(model)
    totals = {L: Totals(model.cfg.d_model, ts.coders[L].d_sae) for L in ts.layers}
    run = {"targets": 0, "agree": 0, "ce": {"clean": 0.0, "replaced": 0.0, "zero": 0.0},
           "kl": {"replaced": 0.0, "zero": 0.0}}
    batches = evaluation_batches(model, corpus, tokens, window, batch_tokens, progress, "evaluate_transcoders")
    for ids, real in batches:
        _evaluate_batch(ts, model, ids, real, totals, run)
    if not any(t.rows for t in totals.values()):
        raise CorpusError("the corpus gave no tokens to evaluate on")
    rows = []
    for L, t in totals.items():
        m = t.metrics()
        rows.append({"layer": L, **{k: m[k] for k in ("explained_variance", "l0", "frac_dead", "frac_dense", "mse",
                                                      "tokens")}})
    n = max(run["targets"], 1)
    ce = {k: v / n for k, v in run["ce"].items()}
    kl = {k: v / n for k, v in run["kl"].items()}
    span = ce["zero"] - ce["clean"]
    replaced = {"ce_loss_score": (ce["zero"] - ce["replaced"]) / span if span else float("nan"),
                "kl_score": (kl["zero"] - kl["replaced"]) / kl["zero"] if kl["zero"] else float("nan"),
                "top1_agreement": run["agree"] / n, "ce_clean": ce["clean"], "ce_replaced": ce["replaced"],
                "ce_zero": ce["zero"], "kl_replaced": kl["replaced"], "kl_zero": kl["zero"], "targets": run["targets"]}
    return {"layers": pd.DataFrame(rows), "replaced": replaced}


@torch.no_grad()
def _evaluate_batch(ts: ReplacementSet, model: Any, ids: torch.Tensor, real: torch.Tensor, totals: dict[int, Totals],
                    run: dict[str, Any]) -> None:
    faithful = resolve_variant(None)
    ids = ids.to(model.decoder.device)
    reads = {L: ts.read_hook(L) for L in ts.layers}
    writes = {L: ts.write_hook(L) for L in range(model.cfg.n_layers)}
    written = ts.layers  # a set writes the MLP outputs of the layers it covers (a CLT covers every layer)
    ctx = build_context(model.hook_names, sorted(set(reads.values()) | {writes[L] for L in written}), batched=True)
    clean = model.decoder.forward(ids, ctx, faithful)  # [b, T, vocab]
    first = torch.zeros_like(real)
    first[:, 0] = True
    keep_all = real.clone()
    acts: dict[int, torch.Tensor] = {}
    inputs: dict[int, torch.Tensor] = {}
    masks: dict[int, torch.Tensor] = {}
    for L in ts.layers:
        x, y = ctx.store[reads[L]], ctx.store[writes[L]]
        keep = torch.zeros_like(real)
        keep[real] = sae_rows(x[real], first[real], y[real]).cpu()
        masks[L] = keep
        keep_all &= keep
        inputs[L] = x
        acts[L] = ts.encode(L, x)
    for L in ts.layers:  # per-layer figures on the clean run's activations
        keep = masks[L]
        y_hat = ts.reconstruct(L, acts, inputs)
        totals[L].add_rows(ctx.store[writes[L]][keep], y_hat[keep], acts[L][keep])

    targets = keep_all[:, :-1] & real[:, 1:]  # predictions made where every layer is evaluated
    next_ids = ids[:, 1:][targets]
    log_clean = torch.log_softmax(clean[:, :-1][targets].float(), dim=-1)
    top_clean = clean[:, :-1][targets].argmax(-1)
    del clean
    run["targets"] += int(targets.sum())
    run["ce"]["clean"] += float(-log_clean.gather(-1, next_ids[:, None]).sum())
    union = torch.zeros_like(real)
    for m in masks.values():
        union |= m
    for name in ("replaced", "zero"):
        logits = _replaced_logits(ts, model, ids, name == "zero", masks, union, written, reads, writes)
        run_logits = logits[:, :-1][targets].float()
        del logits
        log_run = torch.log_softmax(run_logits, dim=-1)
        run["ce"][name] += float(-log_run.gather(-1, next_ids[:, None]).sum())
        run["kl"][name] += float((log_clean.exp() * (log_clean - log_run)).sum(-1).clamp_min(0).sum())
        if name == "replaced":
            run["agree"] += int((run_logits.argmax(-1) == top_clean).sum())


def _replaced_logits(ts: ReplacementSet, model: Any, ids: torch.Tensor, zero: bool, masks: dict[int, torch.Tensor],
                     union: torch.Tensor, written: list[int], reads: dict[int, str], writes: dict[int, str]
                     ) -> torch.Tensor:
    """Logits [b, T, vocab] of the run whose MLP outputs at the written layers are the set's reconstruction from this
    run's own inputs (or 0 with `zero`) at each layer's evaluated rows."""
    live_in: dict[int, torch.Tensor] = {}
    live_acts: dict[int, torch.Tensor] = {}

    def read(layer: int):
        def fn(x: torch.Tensor, _name: str) -> None:
            live_in[layer] = x
            live_acts[layer] = ts.encode(layer, x)
        return fn

    def write(layer: int):
        def fn(y: torch.Tensor, _name: str) -> torch.Tensor:
            keep = masks.get(layer, union)
            out = y.clone()
            value = torch.zeros_like(y) if zero else ts.reconstruct(layer, live_acts, live_in).to(y.dtype)
            out[keep] = value[keep]
            return out
        return fn

    fns = {reads[L]: read(L) for L in ts.layers}
    fns.update({writes[L]: write(L) for L in written})
    return model.decoder.forward(ids, build_context(model.hook_names, [], fns, batched=True), resolve_variant(None))
