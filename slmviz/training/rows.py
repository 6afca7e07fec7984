"""The one row builder of training: corpus -> windows -> planned forwards -> blocks -> every coder's rows.

The windows are the corpus scan's (scans.batches.iter_windows): documents cut into windows of `window` tokens. They
are batched by `plan_sae_batches` into a few fixed forward shapes (one per length bucket), padded on the right, and
each forward stops after the last layer a coder reads (`Decoder.forward(stop_after_layer=)`).

A *block* is consecutive planned batches holding at least `buffer_tokens` real tokens; one forward per batch
captures every hook the run's coders read, and each coder keeps its own rows (`features.activations.sae_rows`) into
buffers of the block's size; the loop shuffles a coder's rows and cuts them into steps. A block is a pure function
of the corpus, the tokenizer and these sizes, found without running the model, so a resumed run skips to its block
by tokenizing alone, and memory holds one block of rows whatever the number of tokens trained.
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
from ..features.activations import batch_ids, sae_rows
from ..hooks import build_context, layer_of
from ..scans.batches import Batch, Window, iter_windows
from ..variants import resolve_variant
from .config import TrainConfig

THRESHOLD_ROWS = 8192  # rows, from across the corpus, BatchTopK's final threshold is measured on (threshold_rows)
THRESHOLD_BLOCKS = 32  # blocks those rows are drawn from, evenly spaced over one pass
LENGTH_BUCKETS = 4  # forward lengths per window size (window/4, window/2, 3 window/4, window): see sae_batch_shape
Reader = tuple[tuple[str, str], ...]  # the (read, write) hooks of each layer a coder trains on


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
    """Consecutive planned batches of one pass, numbered from 0: the rows shuffled and trained on together."""

    index: int
    batches: tuple[Batch, ...]


def plan_blocks(model: Any, corpus: Any, cfg: TrainConfig) -> Iterator[PlannedBlock]:
    """The blocks of one pass over the corpus, planned without running the model (cheap: tokenizing only).
    A token id the model cannot embed is refused here (embeddable_windows)."""
    windows = embeddable_windows(iter_windows(model.tokenizer, iter_documents(corpus), cfg.window),
                                 model.cfg.vocab_size)
    index, current, tokens = 0, [], 0
    for batch in plan_sae_batches(windows, cfg):
        current.append(batch)
        tokens += batch.n_tokens
        if tokens >= cfg.buffer_tokens:
            yield PlannedBlock(index, tuple(current))
            index, current, tokens = index + 1, [], 0
    if current:
        yield PlannedBlock(index, tuple(current))


def count_blocks(model: Any, corpus: Any, cfg: TrainConfig) -> int:
    """The blocks of one pass, from a pass that tokenizes the whole corpus: the run does it before its first
    forward, so a token the model cannot embed is refused before anything is trained (and the count spaces the
    threshold pass's blocks)."""
    return sum(1 for _ in plan_blocks(model, corpus, cfg))


def embeddable_windows(windows: Iterable[Window], vocab_size: int) -> Iterator[Window]:
    """The windows, each checked to hold only ids the model embeds (0 <= id < vocab_size), or a CorpusError naming
    the document, the id and the vocabulary size.

    What goes wrong otherwise: a tokenizer can know more ids than its model's embedding has rows (a checkpoint whose
    config's vocab_size is smaller than its tokenizer), and such an id ends in an IndexError deep in the decoder's
    forward, where trace refuses the same text with a PromptError. Pinned by
    tests/test_sae_train.py::test_a_corpus_the_model_cannot_embed_is_refused_before_any_forward."""
    for w in windows:
        bad = max(w.ids, default=0)
        if bad >= vocab_size:
            at = w.offset + w.ids.index(bad)
            raise CorpusError(f"document {w.doc} of the corpus has token id {bad} (its token {at}), outside this "
                              f"model's vocabulary of {vocab_size} ids: its tokenizer makes ids its "
                              "embedding does not have; train on text without them, or on a model whose vocab_size "
                              "covers its tokenizer")
        yield w


def sae_batch_shape(longest: int, cfg: TrainConfig) -> tuple[int, int]:
    """The padded shape [rows, length] of a training forward whose longest window has `longest` tokens: the length
    rounded up to the next of LENGTH_BUCKETS steps of the window, and as many rows as fit `forward_tokens` there.

    Why fixed shapes: bf16 matmuls run in oneDNN, which (with ideep) caches a compiled primitive for every input
    shape it meets, up to 1024 of them. A stream of forwards padded to whatever each batch's longest window was
    met dozens of shapes on the broad corpus and kept growing the process (bench/studies/sae_memory_shapes.py); at most
    LENGTH_BUCKETS shapes keep it flat. The cost is the padding: under a quarter window per short window (a
    document's last), none for full windows, which are most of them.
    Pinned by tests/test_sae_train.py::test_training_forwards_have_few_shapes.
    """
    step = max(1, -(-cfg.window // LENGTH_BUCKETS))
    length = min(cfg.window, -(-longest // step) * step)
    return max(1, cfg.forward_tokens // length), length


def plan_sae_batches(windows: Iterable[Window], cfg: TrainConfig) -> Iterator[Batch]:
    """Windows grouped by their length bucket (sae_batch_shape) into batches that fill its shape, emitted in the
    order they fill; at the end of the corpus each bucket's partial batch (padded with empty rows). Memory: at most
    one batch per bucket waits."""
    waiting: dict[int, list[Window]] = {}
    index = 0
    for w in windows:
        rows, length = sae_batch_shape(len(w.ids), cfg)
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


def forward_hooks(model: Any, ids: torch.Tensor, hooks: Sequence[str]) -> dict[str, torch.Tensor]:
    """Values [b, L, d] of `hooks` from one batched faithful forward that stops after the last hook's layer."""
    ctx = build_context(model.hook_names, list(hooks), batched=True)
    last = max(layer_of(h) if layer_of(h) is not None else model.cfg.n_layers - 1 for h in hooks)
    model.decoder.forward(ids.to(model.decoder.device), ctx, resolve_variant(None), stop_after_layer=last)
    return {h: ctx.store[h] for h in hooks}


@dataclass
class Rows:
    """One coder's kept rows of some batches: x [n, layers, d_in] (what it reads at each of its layers), y [n,
    layers, d_out] (what it predicts there; the same tensor as x for an SAE)."""

    x: torch.Tensor
    y: torch.Tensor
    seen: int  # real tokens these rows came from (kept or not)


def block_rows(model: Any, block: PlannedBlock, cfg: TrainConfig, readers: dict[str, Reader]) -> dict[str, Rows]:
    """Every kept row of one block for each coder in `readers` ({name: the hooks it reads}), from one forward per
    planned batch that captures every hook of every coder.

    A row is kept for a coder where sae_rows keeps it at every layer it reads (its input and target there; its
    input alone for an SAE), since one step sees a token at all of them at once. Rows are written into buffers of
    the block's size as each batch's forward ends, in corpus order, instead of kept as parts and concatenated: with
    30 layers x (input + output) x 16k rows the parts and their concatenation held twice the block at once."""
    hooks = sorted({h for pairs in readers.values() for pair in pairs for h in pair})
    capacity = sum(len(w.ids) for batch in block.batches for w in batch.windows)  # every kept row is a real token
    buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    filled = dict.fromkeys(readers, 0)
    seen = 0
    for batch in block.batches:
        ids, real = batch_ids(batch, sae_batch_shape(max(len(w.ids) for w in batch.windows), cfg))
        values = forward_hooks(model, ids, hooks)
        first = torch.zeros_like(real)
        first[:, 0] = True
        seen += int(real.sum())
        for name, pairs in readers.items():
            xs = [values[read][real] for read, _ in pairs]  # [b, L, d] -> [n, d], in the forward's dtype
            ys = [x if write == read else values[write][real] for x, (read, write) in zip(xs, pairs, strict=True)]
            keep = None
            for x, y in zip(xs, ys, strict=True):
                kept = sae_rows(x, first[real], *((y,) if y is not x else ()))
                keep = kept if keep is None else keep & kept
            if name not in buffers:
                buffers[name] = _buffers(xs[0], ys[0], len(pairs), capacity)
            n, at = int(keep.sum()), filled[name]
            bx, by = buffers[name]
            for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
                bx[at:at + n, i] = x[keep]
                if by is not bx:
                    by[at:at + n, i] = y[keep]
            filled[name] += n
        del values
    return {name: Rows(x[:filled[name]], y[:filled[name]], seen) for name, (x, y) in buffers.items()}


def _buffers(x: torch.Tensor, y: torch.Tensor, layers: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 buffers [capacity, layers, d] for a coder's inputs and targets (one buffer when y is x: an SAE)."""
    bx = x.new_empty(capacity, layers, x.shape[-1], dtype=torch.float32)
    return bx, bx if y is x else y.new_empty(capacity, layers, y.shape[-1], dtype=torch.float32)


def threshold_rows(model: Any, corpus: Any, cfg: TrainConfig, readers: dict[str, Reader], n_blocks: int | None = None,
                   rows: int = THRESHOLD_ROWS, blocks: int = THRESHOLD_BLOCKS) -> dict[str, torch.Tensor]:
    """Each coder's input rows [<= rows, layers, d_in] from `blocks` blocks evenly spaced over one pass of the
    corpus (the first batches of each, in order), for BatchTopK's final thresholds; `n_blocks`: the pass's blocks
    when already counted (count_blocks).

    Why not the last block's rows: a block is thousands of consecutive tokens of the (document-shuffled) corpus, and
    one long document (a standard-library source file) can fill it; a threshold measured there kept more features
    per token than the k it was trained for, more so on held-out text (docs/features.md). The cost: the forwards of
    the first batches of those blocks."""
    n_blocks = n_blocks if n_blocks is not None else count_blocks(model, corpus, cfg)
    chosen = {round(i * (n_blocks - 1) / max(blocks - 1, 1)) for i in range(min(blocks, n_blocks))}
    quota = -(-rows // max(len(chosen), 1))
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in readers}
    for block in plan_blocks(model, corpus, cfg):
        if block.index not in chosen:
            continue
        got = dict.fromkeys(readers, 0)
        for batch in block.batches:
            if all(g >= quota for g in got.values()):
                break
            for name, r in block_rows(model, PlannedBlock(block.index, (batch,)), cfg, readers).items():
                if got[name] < quota:
                    parts[name].append(r.x[: quota - got[name]])
                    got[name] += parts[name][-1].shape[0]
    return {name: torch.cat(p)[:rows] for name, p in parts.items()}
