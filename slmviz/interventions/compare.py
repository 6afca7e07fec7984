"""Faithful vs broken: run one prompt under several variants and tabulate how far each strays (`slmviz.compare`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..analysis.diff import RESIDUAL_HOOKS, first_divergent_layer, kl_per_position
from ..variants import BASE, VariantLike, resolve_variant

if TYPE_CHECKING:
    from ..model_api import Model


def compare(
    prompt: str | Sequence[int] | torch.Tensor,
    variants: Sequence[VariantLike] | None = None,
    model: Model | None = None,
    max_new_tokens: int = 0,
    chat: bool = False,
) -> pd.DataFrame:
    """One row per variant against the faithful model on the same prompt.

    Columns: variant, kl_mean, kl_last (nats, KL(faithful ‖ variant)), top1_agreement (fraction of
    positions whose argmax agrees), faithful_next, variant_next, diverges_at_layer (first layer whose
    residual stream moves > 1 %, None if never), nonfinite_at (first hook that stopped being finite),
    note; with max_new_tokens > 0 also faithful_continuation and variant_continuation (greedy).
    Non-finite logits give kl = inf and count as disagreement; `note` says why.
    """
    from ..variants import variants as applicable

    if model is None:
        from ..model_api import load

        model = load()
    wanted = list(variants) if variants is not None else [n for n in applicable(model) if n != "faithful"]
    names = lambda n: n.endswith(RESIDUAL_HOOKS)  # noqa: E731 - a tiny predicate reads best inline
    base = model.trace(prompt, variant=BASE, names=names, chat=chat)
    base_next = int(base.logits[-1].argmax())
    base_cont = model.generate(base.input_ids, max_new_tokens) if max_new_tokens else None
    rows = []
    for spec in wanted:
        v = resolve_variant(spec, model.cfg)
        label = spec if isinstance(spec, str) else v.label()
        t = model.trace(base.input_ids, variant=v, names=names)
        kl = kl_per_position(base.logits, t.logits)
        finite = torch.isfinite(t.logits).all(-1)
        agree = (t.logits.argmax(-1) == base.logits.argmax(-1)) & finite
        bad = t.first_nonfinite()
        note = ""
        if bad:
            note = f"values overflow fp32 from {bad}: KL is inf and those positions count as disagreement"
        elif v.kv_position_bug and v.changes() == {"kv_position_bug": True}:
            note = "affects cached decoding only: prefill is identical; compare continuations (max_new_tokens > 0)"
        row = {
            "variant": label,
            "kl_mean": float(kl.mean()),
            "kl_last": float(kl[-1]),
            "top1_agreement": float(agree.float().mean()),
            "faithful_next": base.token_string(base_next),
            "variant_next": t.token_string(int(t.logits[-1].argmax())) if bool(finite[-1]) else "(not finite)",
            "diverges_at_layer": first_divergent_layer(base, t),
            "nonfinite_at": bad,
            "note": note,
        }
        if max_new_tokens:
            row["faithful_continuation"] = base_cont
            row["variant_continuation"] = _safe_generate(model, base.input_ids, max_new_tokens, v)
        rows.append(row)
    frame = pd.DataFrame(rows)
    frame["diverges_at_layer"] = frame["diverges_at_layer"].astype("Int64")  # None stays <NA>, not NaN
    return frame


def _safe_generate(model: Model, ids: torch.Tensor, max_new_tokens: int, variant) -> str:
    """Greedy continuation; a variant whose logits are NaN has no argmax worth showing."""
    steps = []
    for step in model.stream(ids, max_new_tokens, variant=variant):
        steps.append(step)
    return steps[-1].text if steps else ""
