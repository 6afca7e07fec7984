"""What an intervention measures: answer tokens and the logit-difference metric.

Patching, attribution patching and direct logit attribution all read one number off the logits: by default
`logit(answer) - logit(wrong)` at the last position (TransformerLens's `logits_to_ave_logit_diff`). Both
tokens must be single tokens of the model's vocabulary; a word the tokenizer splits into several pieces
would silently measure only its first piece, so it is refused with the pieces named.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .tokens import PromptError, token_strings

Metric = Callable[[torch.Tensor], Any]  # logits [pos, vocab] -> float or 0-d tensor


def single_token_id(tokenizer: Any, token: str | int, vocab_size: int, role: str = "answer") -> int:
    """The id of `token` (a string that is exactly one token, or an id). Anything else is a ValueError.

    Strings are tokenized without special tokens (no BOS), so " Paris" is looked up as the model would
    continue a prompt with it: mind the leading space, which most BPE vocabularies fold into the token.
    """
    if isinstance(token, bool):
        raise ValueError(f"{role} must be a token string or id, got {token!r}")
    if isinstance(token, int):
        if not 0 <= token < vocab_size:
            raise ValueError(f"{role} id {token} is outside the vocabulary [0, {vocab_size})")
        return token
    if not isinstance(token, str) or token == "":
        raise ValueError(f"{role} must be a non-empty token string (e.g. ' Paris') or a token id, got {token!r}")
    ids = tokenizer(token, add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{role} {token!r} produced no tokens; pick a single token, e.g. ' Paris'")
    if len(ids) != 1:
        pieces = token_strings(tokenizer, ids)
        raise ValueError(
            f"{role} {token!r} is {len(ids)} tokens {pieces} (ids {ids}), not one; pick a single token, "
            f"e.g. {pieces[0]!r}"
        )
    return int(ids[0])


def logit_diff(answer: int, wrong: int | None) -> Metric:
    """logits [..., pos, vocab] -> logit(answer) - logit(wrong) at the last position ([...]).

    With `wrong=None` the metric is the answer's logit alone. Works on a batch too: a leading batch
    dimension is kept, so a batched sweep gets one value per row.
    """

    def metric(logits: torch.Tensor) -> torch.Tensor:
        last = logits[..., -1, :].double()  # [..., vocab]
        return last[..., answer] - (last[..., wrong] if wrong is not None else 0.0)

    metric.answer, metric.wrong = answer, wrong  # type: ignore[attr-defined]
    return metric


def as_float(value: Any, what: str = "the metric") -> float:
    """A metric's return value as a Python float (a 0-d / one-element tensor or a number)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} must return one number, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().reshape(()))
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must return a number, got {type(value).__name__}") from None


def check_same_length(model: Any, clean_ids: torch.Tensor, corrupted_ids: torch.Tensor) -> None:
    """Patching writes position p of one run into position p of the other: the prompts must be the same length."""
    if clean_ids.numel() != corrupted_ids.numel():
        clean, corrupted = model.to_strings(clean_ids), model.to_strings(corrupted_ids)
        raise PromptError(
            f"The clean and corrupted prompts must have the same number of tokens (positions are patched one "
            f"for one), but clean has {len(clean)}: {clean} and corrupted has {len(corrupted)}: {corrupted}"
        )


def first_difference(a: Sequence[int] | torch.Tensor, b: Sequence[int] | torch.Tensor) -> int | None:
    """The first position where two id sequences differ (None if equal up to the shorter length)."""
    for i, (x, y) in enumerate(zip(list(map(int, a)), list(map(int, b)), strict=False)):
        if x != y:
            return i
    return None
