"""What a read-out needs of a trace, as a Protocol: `Trace` has all of it, and the read-outs never import `Trace`, so
that `Trace` can offer them as methods (`t.logit_lens()`, `t.logit_attribution(...)`) without an import circle."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..config import ArchConfig
from ..variants import Variant


class Traced(Protocol):
    """A traced prompt: its tokens, captured hooks by name, logits, and the model facts it was traced with."""

    tokens: list[str]
    config: ArchConfig
    variant: Variant
    logits: torch.Tensor
    _model: Any  # the Model that traced it, when it is still around (read-outs needing weights use it)

    @property
    def n_layers(self) -> int: ...

    def token_string(self, token_id: int) -> str: ...

    def float(self) -> Traced: ...

    def __getitem__(self, name: str) -> torch.Tensor: ...

    def __contains__(self, name: object) -> bool: ...
