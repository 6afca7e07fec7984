"""Text → token ids (plain or through the chat template) and ids → display strings.

A model folder may have no tokenizer (toy models trained on algorithmic tasks): `tokenizer` is then
None, prompts must be token ids, and ids display as "<17>".
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import torch


class PromptError(ValueError):
    """The prompt cannot be run: empty, too long, or ids outside the vocabulary."""


def encode(tokenizer: Any, text_or_ids: str | Sequence[int] | torch.Tensor, chat: bool = False) -> torch.Tensor:
    """LongTensor [pos] of token ids. `chat=True` wraps text as one user turn of the model's chat template.

    Any non-empty text is accepted (emoji, control characters, any script, whitespace) as long as the
    tokenizer turns it into at least one token; everything else is a PromptError saying what is accepted.
    """
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise PromptError(
                "This model folder has no tokenizer, so it cannot read text: pass token ids (a list of ints or a "
                "1-D integer tensor), or load it with slmviz.load(path, tokenizer=<a tokenizer, its folder or hub id>)"
            )
        if text_or_ids == "":
            raise PromptError("The prompt is empty; type some text")
        _check_unicode(text_or_ids)
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
            raise PromptError(
                f"The prompt {text_or_ids!r} produced no tokens: this model's tokenizer drops all of it "
                "(e.g. whitespace, or characters it has no token for); type some other text"
            )
        return torch.tensor(ids, dtype=torch.long)
    if text_or_ids is None or isinstance(text_or_ids, int | float | bytes | dict | set):
        raise PromptError(
            f"The prompt must be text (str) or token ids (a list of ints or a 1-D integer tensor), "
            f"got {type(text_or_ids).__name__}"
        )
    try:
        ids = torch.as_tensor(text_or_ids)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:  # e.g. ["a"], [1, [2]], [2**70]
        raise PromptError(f"Token ids must be a flat sequence of integers (0 <= id < vocab size): {e}") from e
    # An empty list becomes a float tensor, so test emptiness before the dtype.
    if ids.numel() == 0:
        raise PromptError("The prompt is empty (no token ids)")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise PromptError(f"Token ids must be integers, got dtype {ids.dtype}")
    ids = ids.long().flatten() if ids.dim() == 2 and ids.shape[0] == 1 else ids.long()
    if ids.dim() != 1:
        raise PromptError(f"Token ids must be one sequence [pos] (or [1, pos]), got shape {tuple(ids.shape)}")
    return ids


def _check_unicode(text: str) -> None:
    """Python strings may hold unpaired surrogates (e.g. from a bad decode); tokenizers reject them deep inside."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(
            f"The prompt is not valid Unicode text: unpaired surrogate {text[e.start]!r} at character {e.start}"
        ) from e


def check_ids(ids: torch.Tensor, vocab_size: int, max_tokens: int, context_length: int | None = None) -> None:
    """Refuse ids outside [0, vocab_size) and prompts longer than min(max_tokens, context_length)."""
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise PromptError(f"Token id {int(ids[i])} at position {i} is outside the vocabulary [0, {vocab_size})")
    limit, why = max_tokens, "the configured limit model.max_tokens"
    if context_length is not None and context_length <= max_tokens:
        limit, why = context_length, "the model's context length"
    if ids.numel() > limit:
        raise PromptError(f"The prompt is {ids.numel()} tokens; the limit is {limit} ({why}). Shorten the prompt.")


def token_strings(tokenizer: Any, ids: torch.Tensor | Sequence[int]) -> list[str]:
    """One display string per id (decoded one at a time, so each position has its own label). A token that is part
    of a character's UTF-8 bytes (an emoji's or a CJK character's first bytes) shows its bytes as `<0xF0><0x9F>`,
    not as "�": decoded alone it is not text."""
    return [_token_string(tokenizer, int(i)) for i in ids]


def _token_string(tokenizer: Any, token_id: int) -> str:
    text = decode(tokenizer, [token_id])
    if "\ufffd" not in text:
        return text
    raw = _token_bytes(tokenizer, token_id)
    if raw is None:
        return text
    return raw.decode("utf-8", errors="surrogateescape").translate(_BYTE_NAMES)


def _token_bytes(tokenizer: Any, token_id: int) -> bytes | None:
    """The bytes a token stands for: SentencePiece's byte pieces `<0xF0>`, or a byte-level BPE token's characters
    mapped back to bytes (GPT-2's table); None when the tokenizer says neither (its "�" is then kept)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(token_id) if convert is not None else None
    if not isinstance(piece, str):
        return None
    if re.fullmatch(r"(<0x[0-9A-Fa-f]{2}>)+", piece):
        return bytes(int(h, 16) for h in re.findall(r"<0x([0-9A-Fa-f]{2})>", piece))
    table = _byte_decoder()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return None


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE table, character -> byte (the inverse of its bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


# the bytes surrogateescape could not decode (U+DC80..U+DCFF) shown as <0xXX>
_BYTE_NAMES = {0xDC00 + b: f"<0x{b:02X}>" for b in range(0x80, 0x100)}


def id_string(token_id: int) -> str:
    """How an id shows when there is no tokenizer to decode it."""
    return f"<{int(token_id)}>"


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Ids → text with special tokens kept (they are part of what the model saw); "<17><4>" without a tokenizer."""
    if tokenizer is None:
        return "".join(id_string(i) for i in ids)
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def eos_id(tokenizer: Any) -> int | None:
    """The end-of-sequence id generation stops at; None (never stop early) without a tokenizer or an EOS token."""
    return None if tokenizer is None else getattr(tokenizer, "eos_token_id", None)
