"""Shards: the unit of work both scan engines map over, and the unit the scan's reduce merges.

A shard is SHARD_DOCS consecutive documents. `run_shard` tokenizes them, cuts them into windows, plans its
batches (batches.plan_batches), runs each and merges the batches' partial results in batch order into
one `ShardResult`. The scan then merges shard results in shard order. Both engines run exactly this: the
local engine on shards it reads as it goes, the Ray engine on actors that read their shard themselves
(corpus.read_shard), so the driver holds neither the corpus's tokens nor more than a few shard results,
and the two engines give identical results.

Batches never span two shards, so a shard boundary costs at most one part-filled batch per SHARD_DOCS
documents.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .batches import ScanSpec, Tap, iter_windows, plan_batches, run_batch
from .reduce import DamagePartial, HookPartial
from .units import Feature

SHARD_DOCS = 1024  # documents per shard: enough to keep a Ray actor busy between its reads (docs/scans.md)


@dataclass(frozen=True)
class Shard:
    index: int
    first_doc: int  # the corpus number of texts[0]
    texts: tuple[str, ...]


@dataclass
class ShardResult:
    """The merged partials of one shard's batches, and what it ran (windows, real tokens, batches)."""

    index: int
    n_docs: int
    hooks: dict[str, HookPartial]
    damage: DamagePartial | None
    windows: int
    tokens: int
    batches: int

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {k: torch.tensor(getattr(self, k)) for k in ("index", "n_docs", "windows", "tokens", "batches")}
        for name, part in self.hooks.items():
            out.update(part.to_tensors(name))
        if self.damage is not None:
            out.update(self.damage.to_tensors())
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], hooks: Sequence[str]) -> ShardResult:
        counts = {k: int(tensors[k]) for k in ("index", "n_docs", "windows", "tokens", "batches")}
        return cls(hooks={h: HookPartial.from_tensors(tensors, h) for h in hooks},
                   damage=DamagePartial.from_tensors(tensors), **counts)


def iter_shards(docs: Iterable[str], size: int = SHARD_DOCS) -> Iterator[Shard]:
    """Consecutive shards of `size` documents (the last may be shorter), read lazily."""
    index, first, texts = 0, 0, []
    for text in docs:
        texts.append(text)
        if len(texts) == size:
            yield Shard(index, first, tuple(texts))
            index, first, texts = index + 1, first + size, []
    if texts:
        yield Shard(index, first, tuple(texts))


def empty_partials(model: Any, spec: ScanSpec, features: dict[str, Feature]) -> dict[str, HookPartial]:
    """One empty partial per scanned hook: what a reduce starts from."""
    from ..hooks import hook_shape

    def value_shape(hook: str, feature: Feature) -> tuple[int, ...]:
        if not feature.per_position_value:
            return (0,)
        return feature.value_shape if feature.value_shape is not None else hook_shape(hook, model.cfg, 1)[1:]

    return {h: HookPartial.empty(f.n, spec.top_k, spec.context, value_shape(h, f)) for h, f in features.items()}


def run_shard(model: Any, shard: Shard, spec: ScanSpec, features: dict[str, Feature],
              on_batch: Callable[[float], None] | None = None,
              tap: Tap | None = None) -> ShardResult:
    """Every batch of one shard, merged in batch order. on_batch(fraction of the shard's tokens done) is called
    after each batch (progress, and the app's Cancel); `tap` is run_batch's."""
    windows = list(iter_windows(model.tokenizer, shard.texts, spec.window, first_doc=shard.first_doc))
    total = max(1, sum(len(w.ids) for w in windows))  # batches run longest first: count tokens, not documents
    merged = empty_partials(model, spec, features)
    damage: list[DamagePartial] = []
    n_windows = n_tokens = n_batches = 0
    for batch in plan_batches(windows, spec.batch_tokens):
        result = run_batch(model, batch, spec, features, tap)
        for h, part in result.hooks.items():
            merged[h] = merged[h].merge(part)
        if result.damage is not None:
            damage.append(result.damage)
        n_windows, n_tokens, n_batches = n_windows + len(batch.windows), n_tokens + batch.n_tokens, n_batches + 1
        if on_batch is not None:
            on_batch(n_tokens / total)
    return ShardResult(shard.index, len(shard.texts), merged, DamagePartial.concat(damage), n_windows, n_tokens,
                       n_batches)
