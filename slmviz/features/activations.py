"""Activations for SAE training and evaluation: corpus -> windows -> batched forwards that stop after the hook's
layer -> the rows an SAE may see (`sae_rows`) -> blocks of a bounded shuffle buffer.

The windows are the corpus scan's (scans.batches.iter_windows): documents are cut into windows of `window`
tokens. They are batched by `plan_sae_batches` into a few fixed forward shapes (one per length bucket), padded on
the right, and the forward stops after the last layer an SAE reads (`Decoder.forward(stop_after_layer=)`): a
layer-15 SAE on a 30-layer model runs 16 blocks and no unembedding.

A *block* is consecutive planned batches holding at least `buffer_tokens` real tokens; its kept rows are shuffled
together and cut into training batches (train.py). A block is a pure function of the corpus, the tokenizer and
these sizes, found without running the model, so a resumed run skips to its block by tokenizing alone, and memory
holds one block (buffer_tokens x (d_in + d_out) floats) whatever the number of tokens trained.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..corpora.reading import CorpusError, iter_documents
from ..hooks import build_context, check_names, layer_of
from ..scans.batches import PAD_ID, Batch, Window, iter_windows
from ..variants import resolve_variant

# A row is massive when its norm exceeds this many times the median norm of its batch's other rows. Measured on
# Bible windows of 128 tokens (bench/results/perf.md "Features"): SmolLM2's first position sits at ~115x the median of
# the rest (layer 15: ~20 000 against ~173) while its other rows reach 1.6x (layer 3: 8.8x); Gemma 3 270M's
# punctuation rows reach ~10x at layer 9, real tokens an SAE should reconstruct, and its first position ~15x.
MASSIVE_FACTOR = 20.0


def sae_rows(x: torch.Tensor, first: torch.Tensor, *others: torch.Tensor,
             factor: float = MASSIVE_FACTOR) -> torch.Tensor:
    """Which activation rows an SAE trains on, is evaluated on and is shown on (dashboards): a bool mask [n].

    x [n, d] (and `others`, e.g. a transcoder's target [n, d_out]) are one batch's rows; `first` [n] is True at
    each window's first position. A row is dropped when it is a window's first position, or when its norm (in x
    or in any of `others`) exceeds `factor` times the median norm of the batch's non-first rows.

    What goes wrong otherwise: the first position of every forward is an attention sink with a *massive
    activation* (SmolLM2's residual norm ~25 000 against ~175 elsewhere), and so is the first position of a
    window cut mid-document or mid-word, whatever its token. One such row per 128 holds ~99% of the squared norm:
    an SAE fitted with them spends itself on that one direction (SAELens's defaults gave explained variance
    below 0 on 200k tokens), and every metric over them (explained variance, CE with x_hat spliced) measures
    that one row. Filtering token *ids* (SAELens's exclude_special_tokens) misses the mid-document windows;
    filtering position 0 alone misses a sink a model puts elsewhere (the norm test). The median is the batch's
    own, so the rule needs no state and a single prompt (a dashboard) applies it to itself.
    Pinned by tests/test_sae_train.py::test_massive_rows_are_dropped.
    """
    keep = ~first.to(x.device)  # the batch's layout is built on the CPU, its rows live on the model's device
    for t in (x, *others):
        norms = t.float().norm(dim=-1)  # [n]
        ordinary = norms[keep]
        if ordinary.numel() == 0:
            break
        keep = keep & (norms <= factor * ordinary.median())
    return keep


@dataclass(frozen=True)
class Source:
    """Where training or evaluation activations come from: a model's hook(s) over a corpus, cut and batched."""

    hook: str
    hook_out: str  # == hook for an SAE
    window: int = 128  # tokens per window (SAELens's context_size)
    forward_tokens: int = 1024  # padded tokens per forward (the scans' measured sweet spot on 2 cores)
    buffer_tokens: int = 65_536  # real tokens per shuffle block

    @property
    def hooks(self) -> tuple[str, ...]:
        return (self.hook,) if self.hook == self.hook_out else (self.hook, self.hook_out)


def check_source(model: Any, source: Source) -> None:
    """A hook this model lacks, or a transcoder target before its input, is a clear error here (not mid-run)."""
    check_names(list(source.hooks), model.hook_names)
    if model.hook_names.index(source.hook_out) < model.hook_names.index(source.hook):
        raise ValueError(f"hook_out {source.hook_out!r} runs before hook {source.hook!r}; a transcoder predicts a "
                         "later activation from an earlier one")
    for h in source.hooks:
        if len(_hook_shape(model, h)) != 1:
            raise ValueError(f"hook {h!r} is not a [pos, d] activation; SAEs here read [pos, d] hooks such as "
                             "'blocks.L.hook_resid_post', 'blocks.L.mlp.hook_in' or 'blocks.L.hook_mlp_out'")


def hook_width(model: Any, hook: str) -> int:
    """d of a [pos, d] hook on this model."""
    return _hook_shape(model, hook)[0]


def _hook_shape(model: Any, hook: str) -> tuple[int, ...]:
    from ..hooks import hook_shape

    return hook_shape(hook, model.cfg, 1)[1:]


def checked_corpus(corpus: Any) -> Any:
    """A corpus a run can read more than once (a resume re-reads it; a long run takes several passes): a list or
    tuple of strings, or a .txt / .jsonl / .parquet path. A generator is refused, naming what would do."""
    if isinstance(corpus, str | os.PathLike):
        path = Path(corpus)
        if not path.is_file():
            raise CorpusError(f"corpus {str(path)!r}: no such file (a .txt, .jsonl or .parquet path, or a list of "
                              "strings)")
        return corpus
    if isinstance(corpus, list | tuple):
        return corpus
    raise CorpusError(f"a training corpus must be a list of strings or a file path (the run reads it again to resume "
                      f"and for every pass), not {type(corpus).__name__}")


def corpus_fingerprint(corpus: Any) -> str:
    """sha256 of the corpus's documents (a file's bytes), so a checkpoint is never resumed on other data."""
    h = hashlib.sha256()
    if isinstance(corpus, str | os.PathLike):
        with open(corpus, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    else:
        for text in corpus:
            h.update(text.encode("utf-8"))
            h.update(b"\0")
    return h.hexdigest()


@dataclass(frozen=True)
class PlannedBlock:
    index: int
    batches: tuple[Batch, ...]

    @property
    def n_tokens(self) -> int:
        return sum(b.n_tokens for b in self.batches)


def plan_blocks(tokenizer: Any, corpus: Any, source: Source, limit: int | None = None) -> Iterator[PlannedBlock]:
    """The blocks of one pass over the corpus, planned without running the model (cheap: tokenizing only)."""
    docs = iter_documents(corpus, limit)
    windows = iter_windows(tokenizer, docs, source.window)
    index, current, tokens = 0, [], 0
    for batch in plan_sae_batches(windows, source):
        current.append(batch)
        tokens += batch.n_tokens
        if tokens >= source.buffer_tokens:
            yield PlannedBlock(index, tuple(current))
            index, current, tokens = index + 1, [], 0
    if current:
        yield PlannedBlock(index, tuple(current))


LENGTH_BUCKETS = 4  # forward lengths per window size (window/4, window/2, 3 window/4, window): see sae_batch_shape


def sae_batch_shape(longest: int, source: Source) -> tuple[int, int]:
    """The padded shape [rows, length] of a training forward whose longest window has `longest`
    tokens: the length rounded up to the next of LENGTH_BUCKETS steps of the window, and as many rows as fit
    `forward_tokens` at that length.

    Why fixed shapes: bf16 matmuls run in oneDNN, which (with ideep) caches a compiled primitive for every input
    shape it meets, up to 1024 of them. A stream of forwards padded to whatever each batch's longest window was
    met 27 shapes on the broad corpus and kept growing the process (train_sae's peak RSS 1.09x at 4x the tokens,
    bench/studies/sae_memory_shapes.py); at most LENGTH_BUCKETS shapes keep it flat. The cost is the padding: under a
    quarter window per short window (a document's last), none for full windows, which are most of them.
    Pinned by tests/test_sae_train.py::test_training_forwards_have_few_shapes.
    """
    step = max(1, -(-source.window // LENGTH_BUCKETS))
    length = min(source.window, -(-longest // step) * step)
    return max(1, source.forward_tokens // length), length


def plan_sae_batches(windows: Iterable[Window], source: Source) -> Iterator[Batch]:
    """Windows grouped by their length bucket (sae_batch_shape) into batches that fill its shape, emitted in the
    order they fill; at the end of the corpus each bucket's partial batch (padded with empty rows). Memory: at most
    one batch per bucket waits."""
    waiting: dict[int, list[Window]] = {}
    index = 0
    for w in windows:
        rows, length = sae_batch_shape(len(w.ids), source)
        group = waiting.setdefault(length, [])
        group.append(w)
        if len(group) == rows:
            yield Batch(index, tuple(group))
            index += 1
            waiting[length] = []
    for length in sorted(waiting, reverse=True):
        if waiting[length]:
            yield Batch(index, tuple(waiting[length]))
            index += 1


def batch_ids(batch: Batch, shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [b, L] padded on the right with PAD_ID, and the real-token mask [b, L]; `shape` pads to [rows, length]
    (rows of PAD_ID only are all False in the mask)."""
    lengths = torch.tensor([len(w.ids) for w in batch.windows])  # [b]
    rows, longest = shape if shape is not None else (len(batch.windows), int(lengths.max()))
    if rows < len(batch.windows) or longest < int(lengths.max()):
        raise ValueError(f"a batch of {len(batch.windows)} windows up to {int(lengths.max())} tokens does not fit "
                         f"the shape {shape}")
    ids = torch.full((rows, longest), PAD_ID, dtype=torch.long)  # [rows, L]
    for i, w in enumerate(batch.windows):
        ids[i, : len(w.ids)] = torch.tensor(w.ids)
    real = torch.arange(longest)[None, :] < torch.cat([lengths, lengths.new_zeros(rows - len(lengths))])[:, None]
    return ids, real


def forward_hooks(model: Any, ids: torch.Tensor, hooks: Sequence[str]) -> dict[str, torch.Tensor]:
    """Values [b, L, d] of `hooks` from one batched faithful forward that stops after the last hook's layer."""
    ctx = build_context(model.hook_names, list(hooks), batched=True)
    last = max(layer_of(h) if layer_of(h) is not None else model.cfg.n_layers - 1 for h in hooks)
    model.decoder.forward(ids.to(model.decoder.device), ctx, resolve_variant(None), stop_after_layer=last)
    return {h: ctx.store[h] for h in hooks}


@dataclass
class Rows:
    """The kept rows of some batches: x [n, d_in] (the SAE's input), y [n, d_out] (its target; x for an SAE)."""

    x: torch.Tensor
    y: torch.Tensor
    seen: int  # real tokens these rows came from (kept or not)


def batch_rows(model: Any, batch: Batch, source: Source, dtype: torch.dtype = torch.float32) -> Rows:
    """One planned batch's kept rows (sae_rows), in corpus order (window by window)."""
    ids, real = batch_ids(batch, sae_batch_shape(max(len(w.ids) for w in batch.windows), source))
    values = forward_hooks(model, ids, source.hooks)
    first = torch.zeros_like(real)
    first[:, 0] = True
    x = values[source.hook][real].to(dtype)  # [b, L, d] -> [n, d]
    y = values[source.hook_out][real].to(dtype) if source.hook_out != source.hook else x
    keep = sae_rows(x, first[real], *((y,) if y is not x else ()))
    x_kept = x[keep]
    return Rows(x_kept, y[keep] if y is not x else x_kept, int(real.sum()))


def block_rows(model: Any, block: PlannedBlock, source: Source, dtype: torch.dtype = torch.float32) -> Rows:
    """Every kept row of one block (its batches' forwards, concatenated in batch order)."""
    parts = [batch_rows(model, b, source, dtype) for b in block.batches]
    x = torch.cat([p.x for p in parts])
    y = x if source.hook == source.hook_out else torch.cat([p.y for p in parts])
    return Rows(x, y, sum(p.seen for p in parts))
