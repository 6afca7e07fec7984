"""The deep scan of a prepared transcoder set: a million tokens or more of the set's own kind of text, the labels
drawn from it, and a measured score for each label.

    s, docs = prepare_deep_scan(m, ts, "plt-quick", corpus=set_corpus(m, "plt-quick"))   # (prepared_scans) cached
    load_set_scan(m, "plt-quick")[0].n_tokens             # >= 1,000,000 once it exists (prepared_scans)
    table = load_deep_labels(m, "plt-quick")              # LabelTable: layer, feature, label, tokens, score, baseline
    g.use_labels(table); g.labels; g.label_scores
    job = BackgroundDeepScan(m, ts, "plt-quick").start()  # prepared_scans': in a thread of its own; cancellable

**The scan.** The set's feature Scan (statistics, histograms, top contexts: what a card shows), over the set
corpus's training split and then the broad corpus's (DEEP_CHARS of each document) until `tokens` are read, with a
token table beside it: for each feature, the tokens it fires on most (`TokenTable`, one reduction per batch inside
the scan's own batch loop, scans.batches.run_batch's `tap`: no second forward). It runs a shard of documents at a
time and writes its state after each, so a stopped run resumes at the shard after the last one written. The scan
runs the set's encoders on a plain forward (scans.batches._encoder_plan: no decoder runs) and reduces only the
entries that fire (scans.reduce.Fired).

**Labels.** A label's predicate is a set of tokens, "the token here is one of these": the feature's tokens whose
balanced accuracy gain on the scan's own text is positive (it fires on them more often than on the rest of the
text), the largest gains first, at most LABEL_TOKENS (`choose_label_tokens`). The gain of naming one more token is
additive (named sets of tokens are disjoint), so the set of the largest gains is the best one of its size.
Its text shows the first SHOWN_TOKENS and how many more it names: 'is / be / it / was (+38)'.

Why a set of tokens and not fewer tokens with their context: measured on the quick set (bench/results/deep_scan.md),
its features fire across dozens of tokens each (a median 24 tokens to cover half of a feature's firing contexts),
so a label of four tokens can name only a sliver of what a feature fires on; naming the previous token too (a
token after a given token, or any token after it) raised the held-out score by less than 0.01 at every size, while
naming more tokens raised it by 0.1 to 0.2.

**Scores.** Measured on held-out text the scan never read (the set corpus's held-out split past the small scan's
documents), mechanically: the detection balanced accuracy of the label's predicate between contexts where the
feature fires and where it does not. Firing contexts are weighed evenly across QUANTILES bands of the feature's
activation (edges from the deep scan's histogram), so a label that names only what tops the feature scores lower
than one that names what it fires on across its range (`LabelScorer`). The baseline is the same score for a label
naming only the feature's single top token (the token of its top example).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from ..formats.files import swap_in_folder
from ..progress import ProgressLike, as_progress

DEEP_TOKENS = 1_000_000
DEEP_FOLDER, WORK_FOLDER = "scan-deep", ".scan-deep-work"
DEEP_CHARS = 2_000  # of each document: long source files would otherwise fill the scan with a few files
DEEP_SHARD_DOCS = 128  # documents per resumable step
DEEP_TOP_K = 10
DEEP_BATCH_TOKENS = 2048  # padded tokens per forward: the deep scan is throughput-bound
KEEP_TOKENS = 256  # tokens kept per feature in the running token table, up to twice as many between cuts
# (heavy hitters; see TokenTable)
LABEL_TOKENS = 256  # tokens a label's predicate names at most
SHOWN_TOKENS = 4  # of them, the ones its text shows
QUANTILES = 5  # activation bands the firing contexts are weighed across
HELDOUT_TOKENS = 65_536  # held-out tokens a score reads
HELDOUT_SKIP_DOCS = 200  # the small scan's documents (prepared_scans.SCAN_DOCS): never scored on
PENDING_PAIRS = 4_000_000  # (feature, token) pairs gathered before they are merged into the table
_PACK_BITS = 63  # bits of the packed (group, count, place) key HeavyHitters sorts by


# --- the token table ------------------------------------------------------------------------------------------
def _runs(sorted_keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys, how many times each) of a sorted array."""
    if len(sorted_keys) == 0:
        return sorted_keys, np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    return sorted_keys[starts], np.diff(np.r_[starts, len(sorted_keys)])


class HeavyHitters:
    """Counts of int64 keys, grouped by key // `span` (a feature's keys: feature * span + token). A group that grows
    past 2 * `keep` keys is cut back to its `keep` most frequent (ties: the lower key). A key dropped then and met again
    restarts its count (Misra-Gries-like: a key among its group's most frequent over the whole stream stays; the
    tail's counts are low bounds). With `keep` at least half the group's distinct keys, every count is exact.

    Why numpy, and cuts at twice `keep`: merging a batch is a sort of its keys, and numpy's sort of int64 (AVX-512 on
    this CPU) is 3-5x torch's; the table is merged by binary search, not sorted again; and cutting a group only once
    it has doubled sorts each key about once between cuts, where cutting every group after every merge sorted the
    whole table each time (measured: 11 s a merge of the quick set's 10M pairs at load 13, most of it the cut)."""

    def __init__(self, span: int, keep: int):
        self.span, self.keep = int(span), int(keep)
        self.keys = np.zeros(0, np.int64)  # sorted, distinct
        self.counts = np.zeros(0, np.int64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0

    def add(self, keys: np.ndarray) -> None:
        self._pending.append(np.asarray(keys, dtype=np.int64))
        self._pending_size += len(keys)
        if self._pending_size > PENDING_PAIRS:
            self.compact()

    def compact(self) -> None:
        """Merge the pending keys into the table, then cut back the groups past 2 * keep."""
        if not self._pending:
            return
        new = np.concatenate(self._pending)
        self._pending, self._pending_size = [], 0
        new.sort()
        found, counts = _runs(new)
        pos = np.searchsorted(self.keys, found)
        there = pos < len(self.keys)
        there[there] = self.keys[pos[there]] == found[there]
        self.counts[pos[there]] += counts[there]
        self.keys = np.insert(self.keys, pos[~there], found[~there])
        self.counts = np.insert(self.counts, pos[~there], counts[~there])
        self._cut()

    def _cut(self) -> None:
        """Each group past 2 * keep keys keeps its `keep` most frequent."""
        group = self.keys // self.span
        starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1]))) if len(group) else group
        sizes = np.diff(np.concatenate((starts, [len(group)])))
        big = sizes > 2 * self.keep
        if not big.any():
            return
        starts, sizes = starts[big], sizes[big]
        rows = np.repeat(starts - np.cumsum(np.concatenate(([0], sizes[:-1]))), sizes) + np.arange(sizes.sum())
        place = rows - np.repeat(starts, sizes)  # in its group, in key order
        gid = np.repeat(np.arange(len(starts), dtype=np.int64), sizes)
        counts = self.counts[rows]
        # one sort of (group, count descending, place in the group): distinct int64s, so numpy's fast unstable
        # sort gives the stable order, and the place (key order) breaks ties to the lower key
        place_bits = max(int(sizes.max() - 1).bit_length(), 1)
        group_bits = max(int(len(starts) - 1).bit_length(), 1)
        count_bits = _PACK_BITS - place_bits - group_bits
        if count_bits < 24:  # too many groups or keys to pack: sort the three keys
            order = np.lexsort((place, -counts, gid))
            ranked_gid, ranked_place = gid[order], place[order]
        else:
            cap = (1 << count_bits) - 1
            packed = (gid << (place_bits + count_bits)) | ((cap - np.minimum(counts, cap)) << place_bits) | place
            packed.sort()
            ranked_gid, ranked_place = packed >> (place_bits + count_bits), packed & ((1 << place_bits) - 1)
        rank = np.arange(len(rows)) - np.repeat(np.cumsum(np.concatenate(([0], sizes[:-1]))), sizes)
        top = rank < self.keep
        kept = np.ones(len(self.keys), bool)
        kept[rows] = False  # the cut groups keep only their top
        kept[starts[ranked_gid[top]] + ranked_place[top]] = True
        self.keys, self.counts = self.keys[kept], self.counts[kept]


class TokenTable:
    """For every feature of the scanned hooks (one global index, hook after hook), the tokens it fires on most, by
    count (`HeavyHitters` of feature * vocab + token, KEEP_TOKENS per feature); its exact number of firing tokens;
    and every token's count in the text.

    Why heavy hitters and not every (feature, token) pair: a feature firing on 6 % of a million tokens meets
    thousands of distinct tokens, and 30,000 features' pairs outgrow memory. A label names at most
    LABEL_TOKENS < KEEP_TOKENS of them."""

    def __init__(self, hooks: list[str], sizes: list[int], vocab: int, keep: int | None = None):
        self.hooks, self.sizes, self.vocab = list(hooks), list(sizes), int(vocab)
        self.keep = KEEP_TOKENS if keep is None else int(keep)
        offsets = np.cumsum([0, *sizes])
        self.offset = {h: int(o) for h, o in zip(hooks, offsets[:-1], strict=True)}
        self.n_features = int(offsets[-1])
        self.pairs = HeavyHitters(self.vocab, self.keep)
        self.fires = np.zeros(self.n_features, np.int64)
        self.token_counts = np.zeros(self.vocab, np.int64)
        self.n = 0

    def add(self, hook: str, x: torch.Tensor, ids: torch.Tensor, fired: Any = None) -> None:
        """One batch of `hook`'s features x [N, F] at tokens `ids` [N] (run_batch's tap; `fired`: x's entries above 0,
        scans.reduce.Fired, found here when not given). Tokens are counted with the first hook."""
        if hook not in self.offset:
            return
        ids_np = ids.numpy()
        if hook == self.hooks[0]:
            self.token_counts += np.bincount(ids_np, minlength=self.vocab)
            self.n += len(ids_np)
        rows, cols = _fired_rows(x, fired)
        off, size = self.offset[hook], x.shape[1]
        self.fires[off:off + size] += np.bincount(cols, minlength=size)
        self.pairs.add((cols + off) * self.vocab + ids_np[rows])

    def compact(self) -> None:
        self.pairs.compact()

    def top(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, counts) of global feature `g`, most frequent first (ties: the lower id)."""
        self.compact()
        keys, counts = self.pairs.keys, self.pairs.counts
        lo, hi = np.searchsorted(keys, [g * self.vocab, (g + 1) * self.vocab])
        order = np.argsort(-counts[lo:hi], kind="stable")
        return (keys[lo:hi] % self.vocab)[order], counts[lo:hi][order]

    def state(self) -> dict[str, torch.Tensor]:
        self.compact()
        return {"table/keys": torch.from_numpy(self.pairs.keys), "table/counts": torch.from_numpy(self.pairs.counts),
                "table/fires": torch.from_numpy(self.fires), "table/token_counts": torch.from_numpy(self.token_counts),
                "table/n": torch.tensor(self.n)}

    def load_state(self, t: dict[str, torch.Tensor]) -> None:
        self.pairs.keys, self.pairs.counts = t["table/keys"].numpy().copy(), t["table/counts"].numpy().copy()
        self.fires, self.token_counts = t["table/fires"].numpy().copy(), t["table/token_counts"].numpy().copy()
        self.n = int(t["table/n"])


def _fired_rows(x: torch.Tensor, fired: Any) -> tuple[np.ndarray, np.ndarray]:
    """(rows, columns) of x's entries above 0, in row-major order, as numpy."""
    if fired is not None:
        return fired.rows.numpy(), fired.cols.numpy()
    rows, cols = (x > 0).nonzero(as_tuple=True)
    return rows.numpy(), cols.numpy()


def _gains(hits: np.ndarray, named: np.ndarray, fires: np.ndarray | int, n: int) -> np.ndarray:
    """What naming a token adds to a label's balanced accuracy on the scanned text (without the 1/2): the share of
    the feature's firing tokens it names, less the share of its other tokens it names."""
    return hits / fires - np.maximum(named - hits, 0) / np.maximum(n - fires, 1)


def choose_label_tokens(tokens: np.ndarray, counts: np.ndarray, fires: int, token_counts: np.ndarray, n: int,
                        most: int | None = None) -> list[int]:
    """The tokens a label names: of the feature's firing tokens (`tokens`, their firing `counts`, most frequent
    first), those that raise the balanced accuracy of "the token is one of these" on the scanned text (TPR: the
    firing tokens it names over all firing tokens; TNR: the non-firing tokens it does not name over all non-firing
    ones), the largest gains first (ties keep the given order), at most `most` (LABEL_TOKENS). Each token's gain is
    its own (the named tokens' contexts are disjoint), so these are the best `most` tokens. None raises it: the most
    frequent one alone."""
    most = LABEL_TOKENS if most is None else most
    if fires <= 0 or len(tokens) == 0:
        return []
    tokens, counts = np.asarray(tokens), np.asarray(counts)
    gain = _gains(counts, np.asarray(token_counts)[tokens], fires, n)
    order = np.argsort(-gain, kind="stable")
    chosen = [int(t) for t in tokens[order][gain[order] > 0][:most]]
    return chosen or [int(tokens[0])]


def label_tokens(table: TokenTable, most: int | None = None) -> dict[int, list[int]]:
    """choose_label_tokens for every feature of the table that fired, at once: {global feature: token ids}."""
    most = LABEL_TOKENS if most is None else most
    table.compact()
    keys, hits = table.pairs.keys, table.pairs.counts
    if not len(keys):
        return {}
    g, tok = keys // table.vocab, keys % table.vocab
    gain = _gains(hits, table.token_counts[tok], table.fires[g], table.n)
    # the named tokens: per feature, gain descending, then choose_label_tokens' given order (count descending, the
    # lower id); only the tokens that raise it are sorted
    up = np.flatnonzero(gain > 0)
    up = up[np.lexsort((tok[up], -hits[up], -gain[up], g[up]))]
    feats, toks = g[up], tok[up]
    starts = np.flatnonzero(np.r_[True, feats[1:] != feats[:-1]]) if len(up) else np.zeros(0, np.int64)
    rank = np.arange(len(up)) - np.repeat(starts, np.diff(np.r_[starts, len(up)]))
    feats, toks = feats[rank < most], toks[rank < most]
    # a feature none of whose tokens raises it names its most frequent token alone (count descending, the lower id)
    rest = np.flatnonzero(~np.isin(g, feats))
    rest = rest[np.lexsort((tok[rest], -hits[rest], g[rest]))]
    if len(rest):
        first = np.r_[True, g[rest][1:] != g[rest][:-1]]
        order = np.argsort(np.r_[feats, g[rest][first]], kind="stable")
        feats, toks = np.r_[feats, g[rest][first]][order], np.r_[toks, tok[rest][first]][order]
    cut = np.flatnonzero(np.r_[True, feats[1:] != feats[:-1]])
    return dict(zip(feats[cut].tolist(), (a.tolist() for a in np.split(toks, cut[1:])), strict=True))


# --- the score --------------------------------------------------------------------------------------------------
def quantile_edges(hist: torch.Tensor, q: int = QUANTILES) -> torch.Tensor:
    """[F, q-1] the activation edges of q equal-count bands of each feature's firing tokens (> 0), read off a scan's
    histogram [F, N_BINS] (scans.reduce's fixed log-spaced bins): the right edge of the bin where the cumulative
    share of firing tokens first reaches 1/q, 2/q, ... (exact to a bin; inf where the feature never fired)."""
    from ..scans.reduce import EDGES

    zero = int(torch.nonzero(EDGES == 0)[0])
    right = torch.cat([EDGES, torch.tensor([float("inf")])])  # bin i's right edge: EDGES[i]; the last bin: inf
    pos = hist[:, zero + 1:].double()  # bins of x > 0
    total = pos.sum(1, keepdim=True)
    cum = pos.cumsum(1) / total.clamp_min(1)
    targets = torch.arange(1, q, dtype=torch.float64) / q
    idx = torch.searchsorted(cum.contiguous(), targets.expand(len(cum), -1).contiguous())  # first bin reaching it
    idx = idx.clamp(max=pos.shape[1] - 1)
    edges = right[zero + 1:][idx]
    return torch.where(total > 0, edges, torch.full_like(edges, float("inf")))


class LabelScorer:
    """Detection balanced accuracy of each feature's label predicate (the token is one the label names), streamed
    over held-out batches: firing tokens are counted per activation band (`edges`, quantile_edges), so that the
    true-positive rate is the mean over the feature's non-empty bands of the share its label names (each band
    weighs the same however many tokens it holds: contexts across the quantiles, not only the top); the true-negative
    rate is the share of non-firing tokens the label does not name. `labels` and `baseline`: {global feature:
    [token ids]}; the baseline is scored alongside on the same tokens."""

    def __init__(self, offsets: dict[str, int], n_features: int, vocab: int, edges: torch.Tensor,
                 labels: dict[int, list[int]], baseline: dict[int, list[int]]):
        self.offset, self.n_features, self.vocab, self.edges = offsets, n_features, vocab, edges.float()
        self.q = edges.shape[1] + 1
        self.first = next(iter(offsets))
        self.band = np.zeros(n_features * self.q, np.int64)
        self.named = {k: np.zeros(n_features * self.q, np.int64) for k in ("label", "baseline")}
        self.keys = {k: _key_set(d, vocab) for k, d in (("label", labels), ("baseline", baseline))}
        self.token_counts = np.zeros(vocab, np.int64)
        self.n = 0

    def add(self, hook: str, x: torch.Tensor, ids: torch.Tensor, fired: Any = None) -> None:
        if hook not in self.offset:
            return
        ids_np = ids.numpy()
        if hook == self.first:
            self.token_counts += np.bincount(ids_np, minlength=self.vocab)
            self.n += len(ids_np)
        rows, cols = _fired_rows(x, fired)
        g = cols + self.offset[hook]
        act = fired.vals if fired is not None else x[torch.from_numpy(rows), torch.from_numpy(cols)].float()
        band = (act[:, None] > self.edges[torch.from_numpy(g)]).sum(1).numpy()  # [nnz] in 0..q-1
        slot = g * self.q + band
        size = self.n_features * self.q
        self.band += np.bincount(slot, minlength=size)
        key = g * self.vocab + ids_np[rows]
        for k, keys in self.keys.items():
            if len(keys) == 0:
                continue
            at = np.minimum(np.searchsorted(keys, key), len(keys) - 1)
            self.named[k] += np.bincount(slot[keys[at] == key], minlength=size)

    def scores(self, which: str = "label") -> np.ndarray:
        """[n_features] balanced accuracy (nan where the feature never fired in the held-out text)."""
        band = self.band.reshape(-1, self.q).astype(np.float64)
        named = self.named[which].reshape(-1, self.q).astype(np.float64)
        filled = band > 0
        tpr = np.where(filled, named / np.maximum(band, 1), 0.0).sum(1) / np.maximum(filled.sum(1), 1)
        fires = band.sum(1)
        keys = self.keys[which]
        # every held-out token the label names, firing or not: its tokens' counts summed
        named_all = np.bincount(keys // self.vocab, weights=self.token_counts[keys % self.vocab],
                                minlength=self.n_features)
        non_firing = np.maximum(self.n - fires, 1)
        tnr = 1 - np.maximum(named_all - named.sum(1), 0) / non_firing
        out = 0.5 * (tpr + tnr)
        return np.where(fires > 0, out, np.nan)


def _key_set(d: dict[int, list[int]], vocab: int) -> np.ndarray:
    """The sorted distinct keys feature * vocab + token of {feature: tokens}."""
    parts = [np.asarray(toks, dtype=np.int64) + g * vocab for g, toks in d.items() if len(toks)]
    if not parts:
        return np.zeros(0, np.int64)
    keys = np.sort(np.concatenate(parts))  # np.unique hashes: 10x slower on millions of keys
    return keys[np.r_[True, keys[1:] != keys[:-1]]]


# --- the label table --------------------------------------------------------------------------------------------
@dataclass
class LabelTable:
    """The deep scan's labels: `frame` (layer, feature, hook, label, tokens, score, baseline) and what they came from
    (`info`: tokens scanned, held-out tokens scored on). AttributionGraph.use_labels reads it."""

    frame: pd.DataFrame
    info: dict[str, Any]

    def lookup(self, layer: int, feature: int) -> tuple[str, float] | None:
        hit = self.frame[(self.frame.layer == layer) & (self.frame.feature == feature)]
        return None if hit.empty else (str(hit.label.iat[0]), float(hit.score.iat[0]))

    def save(self, folder: Path) -> None:
        self.frame.to_parquet(folder / "labels.parquet", index=False)
        (folder / "labels.json").write_text(json.dumps(self.info), encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> LabelTable:
        return cls(pd.read_parquet(folder / "labels.parquet"),
                   json.loads((folder / "labels.json").read_text(encoding="utf-8")))


def label_text(tokens: list[str], shown: int | None = None, total: int | None = None) -> str:
    """'is / be / it / was (+38)': the first `shown` (SHOWN_TOKENS) of the named tokens as read (labels._clean),
    each once, and how many more tokens the label names (of `total`, default len(tokens): a caller may pass the
    first few strings only)."""
    from .labels import _clean

    shown = SHOWN_TOKENS if shown is None else shown
    out: list[str] = []
    used = 0
    for t in tokens:
        if len(out) == shown:
            break
        used += 1
        c = _clean(t)
        if c not in out:
            out.append(c)
    more = (len(tokens) if total is None else total) - used
    return (" / ".join(out) or "(no tokens)") + (f" (+{more})" if more else "")


# --- the documents ----------------------------------------------------------------------------------------------
def _held_apart(corpus: Any) -> tuple[list[str], list[str]] | None:
    """A corpus given as a list of texts (not a name): its first 90 % scanned, its last 10 % held out."""
    if isinstance(corpus, (str, Path)):
        return None
    docs = list(corpus)
    cut = max(1, len(docs) - max(1, len(docs) // 10))
    return docs[:cut], docs[cut:]


def deep_docs(model: Any, corpus: Any, chars: int = DEEP_CHARS) -> Iterator[str]:
    """What a deep scan reads, in order: the set corpus's training split, then, for a named corpus, the broad
    corpus's (modern prose, chat and code between them), each document cut to `chars`, each text once. A list of
    texts: its first 90 % (_held_apart)."""
    from ..corpora.named import NAMES, resolve_corpus
    from ..corpora.reading import iter_documents

    apart = _held_apart(corpus)
    sources: list[Any] = [apart[0]] if apart is not None else [resolve_corpus(corpus, model, split="train")]
    if isinstance(corpus, str) and corpus in NAMES:
        from ..corpora.broad import broad_corpus

        sources.append(broad_corpus()[0])
    seen: set[int] = set()
    for source in sources:
        for doc in iter_documents(source):
            doc = doc[:chars]
            h = hash(doc)
            if doc.strip() and h not in seen:
                seen.add(h)
                yield doc


def heldout_docs(model: Any, corpus: Any, skip: int = HELDOUT_SKIP_DOCS, chars: int = DEEP_CHARS) -> Iterator[str]:
    """Held-out text for the scores: the corpus's held-out split past the small scan's documents (a list of texts:
    its last 10 %, _held_apart)."""
    from ..corpora.named import resolve_corpus
    from ..corpora.reading import iter_documents

    apart = _held_apart(corpus)
    if apart is not None:
        yield from (d[:chars] for d in apart[1] if d.strip())
        return
    for i, doc in enumerate(iter_documents(resolve_corpus(corpus, model, split="heldout"))):
        if i >= skip and doc.strip():
            yield doc[:chars]


# --- the run ----------------------------------------------------------------------------------------------------
class DeepScanBusy(RuntimeError):
    """Another deep scan of the same set is running (it holds the work folder's lock)."""


def run_deep_scan(model: Any, coders: dict[int, Any], folder: Path, corpus: Any, tokens: int = DEEP_TOKENS,
                  heldout_tokens: int = HELDOUT_TOKENS, batch_tokens: int = DEEP_BATCH_TOKENS,
                  progress: ProgressLike = None, docs: Any = None, heldout: Any = None) -> tuple[Any, list[str]]:
    """The deep scan of `coders` ({layer: SAE}, spliced together) into `folder` (scan files, docs.json,
    labels.parquet), resuming from `folder`'s sibling work folder where a run stopped. `docs` / `heldout`:
    iterables of documents in place of deep_docs / heldout_docs (tests). Returns (Scan, docs). Another run of the
    same set at once: DeepScanBusy."""
    work = folder.with_name(WORK_FOLDER if folder.name == DEEP_FOLDER else f".{folder.name}-work")
    work.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock, Timeout

    lock = FileLock(work.parent / f"{work.name}.lock", blocking=False)
    try:
        lock.acquire()
    except Timeout:
        raise DeepScanBusy(f"a deep scan of this set is running already (it holds {lock.lock_file}); it resumes "
                           "where it stops, nothing is lost") from None
    try:
        return _run(model, layers_of(coders), coders, folder, work, corpus, tokens, heldout_tokens, batch_tokens,
                    progress, docs, heldout)
    finally:
        lock.release()


def layers_of(coders: dict[int, Any]) -> list[int]:
    return sorted(coders)


def _run(model: Any, layers: list[int], coders: dict[int, Any], folder: Path, work: Path, corpus: Any, tokens: int,
         heldout_tokens: int, batch_tokens: int, progress: ProgressLike, docs: Any, heldout: Any
         ) -> tuple[Any, list[str]]:
    """run_deep_scan's work, under its lock."""
    from safetensors.torch import load_file, save_file

    from ..hooks import checked_saes
    from ..scans.batches import ScanSpec
    from ..scans.reduce import HookPartial
    from ..scans.scan import DAMAGE_COLUMNS, Scan
    from ..scans.shards import empty_partials, iter_shards, run_shard
    from ..scans.units import feature_of
    from .dashboard import acts_hook

    p = as_progress(progress, "deep scan")
    scan_part, label_part, score_part = p.part("scan", 0.9), p.part("labels", 0.02), p.part("scores", 0.08)
    saes = tuple(checked_saes([coders[L] for L in layers], model.hook_names))
    hooks = [acts_hook(coders[L]) for L in layers]
    features = {h: feature_of(h, model.hook_names, model.cfg, saes) for h in hooks}
    spec = ScanSpec(tuple(hooks), DEEP_TOP_K, window=min(256, model.cfg.context_length),
                    batch_tokens=batch_tokens, saes=saes)
    vocab = int(model.decoder.params.unembed.shape[0])
    table = TokenTable(hooks, [features[h].n for h in hooks], vocab)
    acc = empty_partials(model, spec, features)
    done = {"shards": 0, "documents": 0, "windows": 0, "tokens": 0, "batches": 0, "seconds": 0.0}
    state_file = work / "state.safetensors"
    if state_file.is_file():  # resume: the state written after the last finished shard
        t = load_file(str(state_file))
        acc = {h: HookPartial.from_tensors(t, h) for h in hooks}
        table.load_state(t)
        done = json.loads((work / "state.json").read_text(encoding="utf-8"))
    source = iter(docs if docs is not None else deep_docs(model, corpus))
    read: list[str] = []
    t0 = time.perf_counter() - done["seconds"]
    for shard in iter_shards(source, DEEP_SHARD_DOCS):
        read.extend(shard.texts)
        if shard.index < done["shards"]:
            continue
        if done["tokens"] >= tokens:
            break

        def batch_done(fraction: float, index: int = shard.index) -> None:  # every batch: the app's Cancel
            scan_part.update(min(done["tokens"], tokens), tokens, "tok", f"shard {index + 1}, {100 * fraction:.0f} %")

        result = run_shard(model, shard, spec, features, batch_done, tap=table.add)
        for h in hooks:
            acc[h] = acc[h].merge(result.hooks[h])
        for k in ("windows", "tokens", "batches"):
            done[k] += getattr(result, k)
        done["shards"], done["documents"] = shard.index + 1, done["documents"] + result.n_docs
        done["seconds"] = time.perf_counter() - t0
        tensors = {k: v for h in hooks for k, v in acc[h].to_tensors(h).items()}
        tensors.update(table.state())
        save_file(tensors, str(work / "state.tmp"))  # written aside, then renamed: a stop mid-write loses nothing
        (work / "state.json.tmp").write_text(json.dumps(done), encoding="utf-8")
        (work / "state.tmp").replace(state_file)
        (work / "state.json.tmp").replace(work / "state.json")
        scan_part.update(min(done["tokens"], tokens), tokens, "tok",
                         f"{done['tokens'] / max(done['seconds'], 1e-9):,.0f} tok/s")
    read = read[:done["documents"]]
    scan_part.finish()

    used = torch.unique(torch.cat([a.top_ids.flatten() for a in acc.values()]))
    used = used[used >= 0].tolist()
    info = {"model": model.name, "engine": "local", "documents": done["documents"], "windows": done["windows"],
            "tokens": done["tokens"], "batches": done["batches"], "seconds": done["seconds"],
            "tokens_per_s": done["tokens"] / done["seconds"] if done["seconds"] else 0.0, "window": spec.window,
            "batch_tokens": batch_tokens, "top_k": DEEP_TOP_K, "context_before": spec.context_before,
            "context_after": spec.context_after, "variants": [], "saes": [repr(s) for s in saes],
            "sae_rows": hooks, "deep": True, "threads": torch.get_num_threads()}
    features_info = {h: {"axis": f.axis, "n": f.n, "what": f.what} for h, f in features.items()}
    s = Scan(info, features_info, acc, dict(zip(used, model.to_strings(used), strict=True)),
             pd.DataFrame(columns=DAMAGE_COLUMNS))

    labels = label_and_score(model, layers, hooks, features, saes, acc, table, corpus, heldout_tokens, batch_tokens,
                             spec.window, heldout, label_part, score_part, tokens_scanned=done["tokens"])
    _save(s, read, labels, folder)
    shutil.rmtree(work, ignore_errors=True)
    p.finish(f"{done['tokens']:,} tokens in {done['seconds']:.0f} s")
    return s, read


def label_and_score(model: Any, layers: list[int], hooks: list[str], features: dict[str, Any], saes: tuple[Any, ...],
                    acc: dict[str, Any], table: TokenTable, corpus: Any, heldout_tokens: int, batch_tokens: int,
                    window: int, heldout: Any = None, label_part: Any = None, score_part: Any = None,
                    tokens_scanned: int | None = None) -> LabelTable:
    """The labels of a scan's token table (label_tokens), the top-token baselines from its top examples (`acc`: the
    scan's HookPartials), both scored on held-out text (LabelScorer over heldout_docs, or `heldout`)."""
    from ..scans.batches import ScanSpec
    from ..scans.shards import iter_shards, run_shard

    label_part = label_part if label_part is not None else as_progress(None, "labels")
    score_part = score_part if score_part is not None else as_progress(None, "scores")
    t_labels = time.perf_counter()
    label_part.say("choosing label tokens")
    labels = label_tokens(table)
    before = ScanSpec.context_before  # the deep scan's contexts are ScanSpec's default: the example's token
    top_tok = torch.cat([acc[h].top_ids[:, 0, before] for h in hooks]).numpy()  # [n_features]
    baseline = {g: ([int(top_tok[g])] if top_tok[g] >= 0 else []) for g in labels}
    label_part.finish()
    label_s = time.perf_counter() - t_labels

    t_scores = time.perf_counter()
    edges = torch.cat([quantile_edges(acc[h].hist) for h in hooks])
    scorer = LabelScorer(table.offset, table.n_features, table.vocab, edges, labels, baseline)
    held_spec = ScanSpec(tuple(hooks), 1, window=window, batch_tokens=batch_tokens, saes=saes)
    held = iter(heldout if heldout is not None else heldout_docs(model, corpus))
    for shard in iter_shards(held, DEEP_SHARD_DOCS):
        run_shard(model, shard, held_spec, features, lambda fr: score_part.update(scorer.n, heldout_tokens, "tok"),
                  tap=scorer.add)
        if scorer.n >= heldout_tokens:
            break
    score, base = scorer.scores("label"), scorer.scores("baseline")
    score_s = time.perf_counter() - t_scores
    strings = model.to_strings(list(range(table.vocab)))  # once: a label's text reads a few of its tokens
    rows = []
    for h, L in zip(hooks, layers, strict=True):
        off = table.offset[h]
        for f in range(features[h].n):
            g = off + f
            if g not in labels:
                continue
            toks = labels[g]
            rows.append({"layer": L, "feature": f, "hook": h, "label": label_text([strings[t] for t in toks[:16]],
                                                                                  total=len(toks)),
                         "tokens": toks, "score": float(score[g]), "baseline": float(base[g]),
                         "fires": int(table.fires[g])})
    frame = pd.DataFrame(rows, columns=["layer", "feature", "hook", "label", "tokens", "score", "baseline", "fires"])
    info = {"tokens": table.n if tokens_scanned is None else tokens_scanned, "heldout_tokens": scorer.n,
            "quantiles": QUANTILES, "label_tokens": LABEL_TOKENS, "keep_tokens": table.keep,
            "median_score": _median(frame.score), "median_baseline": _median(frame.baseline),
            "label_seconds": label_s, "score_seconds": score_s}
    score_part.finish()
    return LabelTable(frame, info)


def preview_labels(model: Any, coders: dict[int, Any], work: Path, corpus: Any,
                   heldout_tokens: int = HELDOUT_TOKENS, batch_tokens: int = DEEP_BATCH_TOKENS) -> LabelTable:
    """The labels and scores a running (or stopped) deep scan would give now: label_and_score over the state its
    work folder `work` holds after its last finished shard (read while it runs: the state is swapped in whole).
    What a measuring run reads hours before the scan ends; nothing is written."""
    from safetensors.torch import load_file

    from ..hooks import checked_saes
    from ..scans.reduce import HookPartial
    from ..scans.units import feature_of
    from .dashboard import acts_hook

    layers = layers_of(coders)
    saes = tuple(checked_saes([coders[L] for L in layers], model.hook_names))
    hooks = [acts_hook(coders[L]) for L in layers]
    features = {h: feature_of(h, model.hook_names, model.cfg, saes) for h in hooks}
    t = load_file(str(work / "state.safetensors"))
    acc = {h: HookPartial.from_tensors(t, h) for h in hooks}
    table = TokenTable(hooks, [features[h].n for h in hooks], int(model.decoder.params.unembed.shape[0]))
    table.load_state(t)
    return label_and_score(model, layers, hooks, features, saes, acc, table, corpus, heldout_tokens, batch_tokens,
                           min(256, model.cfg.context_length))


def _median(x: pd.Series) -> float:
    x = x.dropna()
    return float(x.median()) if len(x) else math.nan


def _save(s: Any, docs: list[str], labels: LabelTable, folder: Path) -> None:
    """The scan, its documents and labels written aside, then swapped in whole (formats.files.swap_in_folder)."""
    import tempfile


    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        s.save(tmp)
        (tmp / "docs.json").write_text(json.dumps(docs), encoding="utf-8")
        labels.save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_in_folder(tmp, folder)


__all__ = ["DEEP_TOKENS", "DeepScanBusy", "HeavyHitters", "LabelScorer", "LabelTable", "TokenTable",
           "choose_label_tokens", "deep_docs", "label_and_score", "label_tokens", "preview_labels", "quantile_edges",
           "run_deep_scan"]
