"""`slmviz.evaluate_sae`: SAEBench's core metrics of an SAE or transcoder on a corpus (docs/features.md).

    slmviz.evaluate_sae(sae, "heldout.jsonl", model=m)
    # {'explained_variance': 0.84, 'l0': 32.0, 'ce_loss_score': 0.95, 'kl_score': 0.94, 'frac_dead': 0.02, ...}

Definitions (SAEBench's core eval), over every evaluated token, not per batch:
- explained_variance = 1 - E||y - y_hat||^2 / (E||y||^2 - ||E y||^2), y the activation the SAE writes
  (hook_name_out: the input itself for an SAE, the MLP's output for a transcoder);
- l0 = mean number of active features per token;
- ce_loss_score = (CE_zero - CE_sae) / (CE_zero - CE_clean): CE_sae with the activation replaced by y_hat
  (no error term), CE_zero with it set to 0; 1 is a perfect stand-in, 0 no better than deleting the activation;
- kl_score = (KL_zero - KL_sae) / KL_zero, KL to the clean run's next-token distribution;
- frac_dead: features never active on the evaluated tokens; frac_dense: features active on more than 10% of them.

Tokens: the rows activations.sae_rows keeps (no window's first position, no massive row) are the evaluated tokens,
and the only positions the SAE (or the zero) replaces: the excluded ones keep their clean value in every run, so the
model keeps its attention sink, and CE / KL are averaged over the next-token predictions made at evaluated tokens.
Replacing the sink too would make CE_zero (and so every score) measure the loss of the sink, not of the activation.
The replacement is a plain hook fn on hook_name_out; the runs after the clean one restart at that layer's
resid_pre (Decoder.forward_from), since the layers before it are the clean run's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..corpora.reading import CorpusError, iter_documents
from ..hooks import build_context, layer_hook_name, layer_of
from ..progress import ProgressLike, as_progress
from ..scans.batches import iter_windows, plan_batches
from ..variants import resolve_variant
from .activations import batch_ids, sae_rows

DENSE_FRACTION = 0.1  # SAEBench: a feature active on more than 10 % of tokens is dense


class Totals:
    """Running sums over batches, in float64, from which `metrics` computes every figure over all tokens."""

    def __init__(self, d_out: int, d_sae: int):
        self.rows = 0
        self.sse = 0.0  # sum ||y - y_hat||^2
        self.sum_sq = 0.0  # sum ||y||^2
        self.sum_y = torch.zeros(d_out, dtype=torch.float64)
        self.active = 0  # sum of active features over rows
        self.fired = torch.zeros(d_sae, dtype=torch.float64)  # rows each feature was active on
        self.targets = 0
        self.ce = {"clean": 0.0, "sae": 0.0, "zero": 0.0}
        self.kl = {"sae": 0.0, "zero": 0.0}

    def add_rows(self, y: torch.Tensor, y_hat: torch.Tensor, f: torch.Tensor) -> None:
        y, y_hat = y.double(), y_hat.double()
        self.rows += y.shape[0]
        self.sse += float((y - y_hat).pow(2).sum())
        self.sum_sq += float(y.pow(2).sum())
        self.sum_y += y.sum(0).cpu()
        on = f > 0
        self.active += int(on.sum())
        self.fired += on.sum(0).double().cpu()

    def metrics(self) -> dict[str, float]:
        n = max(self.rows, 1)
        variance = self.sum_sq - float(self.sum_y.pow(2).sum()) / n  # sum ||y - mean||^2
        t = max(self.targets, 1)
        ce = {k: v / t for k, v in self.ce.items()}
        kl = {k: v / t for k, v in self.kl.items()}
        frequency = self.fired / n
        return {
            "explained_variance": 1 - self.sse / variance if variance > 0 else float("nan"),
            "l0": self.active / n,
            "ce_loss_score": _score(ce["zero"] - ce["sae"], ce["zero"] - ce["clean"]),
            "kl_score": _score(kl["zero"] - kl["sae"], kl["zero"]),
            "frac_dead": float((self.fired == 0).double().mean()),
            "frac_dense": float((frequency > DENSE_FRACTION).double().mean()),
            "mse": self.sse / n,
            "ce_clean": ce["clean"], "ce_sae": ce["sae"], "ce_zero": ce["zero"],
            "kl_sae": kl["sae"], "kl_zero": kl["zero"],
            "tokens": self.rows, "targets": self.targets,
        }


def _score(gain: float, span: float) -> float:
    return gain / span if span != 0 else float("nan")


def evaluate_sae(
    sae: Any,
    corpus: Any,
    model: Any = None,
    tokens: int | None = 100_000,
    window: int = 128,
    batch_tokens: int = 512,
    progress: ProgressLike = True,
) -> dict[str, float]:
    """SAEBench's core metrics (module docstring) of `sae` on `corpus`, read by `model` (default: the model the
    SAE was loaded with). tokens: stop after this many real tokens (None: the whole corpus). window: tokens per
    window, as in training. batch_tokens: padded tokens per forward (each holds three [tokens, vocab] logits).
    Returns a dict: explained_variance, l0, ce_loss_score, kl_score, frac_dead, frac_dense, and the raw figures
    (mse, ce_clean / ce_sae / ce_zero, kl_sae / kl_zero, tokens evaluated, targets).
    """
    model = model if model is not None else getattr(sae, "model", None)
    if model is None:
        raise ValueError("evaluate_sae needs the model the SAE reads: evaluate_sae(sae, corpus, model=m)")
    sae.check_model(model)
    totals = Totals(sae.d_out, sae.d_sae)
    for ids, real in evaluation_batches(model, corpus, tokens, window, batch_tokens, progress, "evaluate_sae"):
        evaluate_batch(sae, model, ids, real, totals)
    if totals.rows == 0:
        raise CorpusError("the corpus gave no tokens to evaluate on (empty, or only blank documents and single-token "
                          "windows, whose one position is a window's first)")
    return totals.metrics()


@torch.no_grad()
def evaluate_batch(sae: Any, model: Any, ids: torch.Tensor, real: torch.Tensor, totals: Totals) -> None:
    """Add one padded batch ids [b, T] (real: [b, T]) to `totals`: the clean run, the SAE's run, the zero run."""
    hook, hook_out = sae.hook_name, sae.hook_name_out
    start = layer_of(hook_out)
    start = 0 if start is None else start
    resid_pre = layer_hook_name(start, "hook_resid_pre")
    ids = ids.to(model.decoder.device)
    faithful = resolve_variant(None)
    ctx = build_context(model.hook_names, sorted({hook, hook_out, resid_pre}), batched=True)
    clean = model.decoder.forward(ids, ctx, faithful)  # [b, T, vocab]
    x, y = ctx.store[hook], ctx.store[hook_out]  # [b, T, d_in], [b, T, d_out]
    first = torch.zeros_like(real)
    first[:, 0] = True
    keep = torch.zeros_like(real)
    keep[real] = sae_rows(x[real], first[real], y[real]).cpu()  # [b, T]
    f = sae.encode(x[keep])  # [n, d_sae]
    y_hat = sae.decode(f, x[keep])  # [n, d_out]
    totals.add_rows(y[keep], y_hat, f)

    # next-token targets: predictions made at evaluated positions whose next token is real
    targets = keep[:, :-1] & real[:, 1:]  # [b, T-1]
    next_ids = ids[:, 1:][targets]  # [m]
    log_clean = torch.log_softmax(clean[:, :-1][targets].float(), dim=-1)  # [m, vocab]
    del clean
    totals.targets += int(targets.sum())
    totals.ce["clean"] += float(-log_clean.gather(-1, next_ids[:, None]).sum())
    for name, value in (("sae", y_hat), ("zero", torch.zeros_like(y_hat))):
        replaced = y.clone()
        replaced[keep] = value.to(y.dtype)

        def put(t: torch.Tensor, _name: str, replaced: torch.Tensor = replaced) -> torch.Tensor:
            return replaced

        run_ctx = build_context(model.hook_names, [], {hook_out: put}, batched=True)
        if start == 0 and not hook_out.startswith("blocks."):
            logits = model.decoder.forward(ids, run_ctx, faithful)
        else:
            logits = model.decoder.forward_from(ctx.store[resid_pre], start, run_ctx, faithful)
        log_run = torch.log_softmax(logits[:, :-1][targets].float(), dim=-1)  # [m, vocab]
        del logits
        totals.ce[name] += float(-log_run.gather(-1, next_ids[:, None]).sum())
        totals.kl[name] += float((log_clean.exp() * (log_clean - log_run)).sum(-1).clamp_min(0).sum())


def evaluation_batches(model: Any, corpus: Any, tokens: int | None, window: int, batch_tokens: int,
                       progress: ProgressLike, desc: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(ids [b, T], real [b, T]) of the corpus's windows, batch by batch, until `tokens` real tokens (None: all);
    progress: slmviz.progress's contract, a job named `desc` counted in tokens (True: a tqdm bar)."""
    bar = as_progress(progress, desc)
    seen = 0
    for batch in plan_batches(iter_windows(model.tokenizer, iter_documents(corpus), window), batch_tokens):
        yield batch_ids(batch)
        seen += batch.n_tokens
        bar.update(min(seen, tokens) if tokens is not None else seen, tokens, unit="tok")
        if tokens is not None and seen >= tokens:
            break
