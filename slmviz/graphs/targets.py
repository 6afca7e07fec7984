"""What an attribution graph attributes: its targets at the last position, read after the final norm.

The seam: `attribution_graph(..., targets=...)` takes any object with `select(model, state) -> TargetSet`: which
tokens' demeaned logits (before a final softcap) the graph explains, each read from the last position's normalised
residual through its demeaned unembedding row, with the weight its influence starts from (its probability).

- `LogitTargets` (the default): circuit-tracer's salient logits, the smallest top set reaching a probability.
- `TokenTargets`: named tokens, whatever their rank (why is ' Austin' not the answer?), each weighted by its
  probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .frozen import AttributionGraphError, PromptState, demeaned_unembed


@dataclass
class TargetSet:
    """The targets of one graph: token `ids` [k] (naming the logit nodes), `probabilities` [k] (the influence's
    starting weights) and `vectors` [k, d_model] (what each reads from the last position's normalised residual)."""

    ids: torch.Tensor
    probabilities: torch.Tensor
    vectors: torch.Tensor

    def __len__(self) -> int:
        return len(self.ids)


class AttributionTargets(Protocol):
    def select(self, model: Any, state: PromptState) -> TargetSet: ...


def salient_logits(logits: torch.Tensor, unembed: torch.Tensor, max_n_logits: int, desired_logit_prob: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """circuit-tracer's compute_salient_logits: the smallest top set whose cumulative probability reaches
    `desired_logit_prob`, at most `max_n_logits`; returns (ids [k], probs [k], demeaned unembedding rows [k, d]:
    frozen.demeaned_unembed)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_idx = torch.topk(probs, min(max_n_logits, probs.shape[-1]))
    cutoff = int(torch.searchsorted(torch.cumsum(top_p, 0), desired_logit_prob)) + 1
    top_p, top_idx = top_p[:cutoff], top_idx[:cutoff]
    return top_idx, top_p, demeaned_unembed(unembed, top_idx)


@dataclass
class LogitTargets:
    """The top logits (salient_logits): at most `max_n_logits`, with cumulative probability `desired_logit_prob`."""

    max_n_logits: int = 10
    desired_logit_prob: float = 0.95

    def select(self, model: Any, state: PromptState) -> TargetSet:
        if not 0 < self.desired_logit_prob <= 1 or not isinstance(self.max_n_logits, int) or self.max_n_logits < 1:
            raise AttributionGraphError(
                f"max_n_logits must be a positive integer and desired_logit_prob in (0, 1]; got "
                f"{self.max_n_logits!r}, {self.desired_logit_prob!r}")
        ids, probs, vecs = salient_logits(state.logits[-1], model.decoder.params.unembed, self.max_n_logits,
                                          self.desired_logit_prob)
        return TargetSet(ids, probs.cpu(), vecs)


@dataclass
class TokenTargets:
    """Named tokens (ids, or strings that are one token each), weighted by their probabilities."""

    tokens: list[int | str]

    def select(self, model: Any, state: PromptState) -> TargetSet:
        vocab = int(model.decoder.params.unembed.shape[0])
        ids = []
        for t in self.tokens:
            if isinstance(t, str):
                enc = model.encode(t)
                if len(enc) != 1:
                    raise AttributionGraphError(f"{t!r} is {len(enc)} tokens; a target is one token")
                t = int(enc[0])
            if not 0 <= int(t) < vocab:
                raise AttributionGraphError(f"the target {t!r} is not a token id in [0, {vocab})")
            ids.append(int(t))
        if not ids:
            raise AttributionGraphError("TokenTargets needs at least one token")
        idx = torch.tensor(ids, device=state.logits.device)
        probs = torch.softmax(state.logits[-1].float(), -1)[idx]
        return TargetSet(idx, probs.cpu(), demeaned_unembed(model.decoder.params.unembed, idx))


__all__ = ["AttributionTargets", "LogitTargets", "TargetSet", "TokenTargets", "salient_logits"]
