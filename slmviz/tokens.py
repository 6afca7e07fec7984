"""Text → token ids (plain or through the chat template) and ids → display strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class PromptError(ValueError):
    """The prompt cannot be run: empty, too long, or ids outside the vocabulary."""


def encode(tokenizer: Any, text_or_ids: str | Sequence[int] | torch.Tensor, chat: bool = False) -> torch.Tensor:
    """LongTensor [pos] of token ids. `chat=True` wraps text as one user turn of the model's chat template."""
    if isinstance(text_or_ids, str):
        if text_or_ids == "":
            raise PromptError("The prompt is empty; type some text")
        if chat:
            if not getattr(tokenizer, "chat_template", None):
                raise PromptError("This model's tokenizer has no chat template; run without chat=True")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text_or_ids}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(text_or_ids)["input_ids"]
        if len(ids) == 0:
            raise PromptError(f"The prompt {text_or_ids!r} produced no tokens")
        return torch.tensor(ids, dtype=torch.long)
    ids = torch.as_tensor(text_or_ids)
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise PromptError(f"Token ids must be integers, got dtype {ids.dtype}")
    ids = ids.long().flatten() if ids.dim() == 2 and ids.shape[0] == 1 else ids.long()
    if ids.dim() != 1:
        raise PromptError(f"Token ids must be one sequence [pos], got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise PromptError("The prompt is empty (no token ids)")
    return ids


def check_ids(ids: torch.Tensor, vocab_size: int, max_tokens: int) -> None:
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise PromptError(f"Token id {int(ids[i])} at position {i} is outside the vocabulary [0, {vocab_size})")
    if ids.numel() > max_tokens:
        raise PromptError(f"The prompt is {ids.numel()} tokens; the limit is {max_tokens}")


def token_strings(tokenizer: Any, ids: torch.Tensor | Sequence[int]) -> list[str]:
    """One display string per id (decoded one at a time, so each position has its own label)."""
    return [tokenizer.decode([int(i)]) for i in ids]
