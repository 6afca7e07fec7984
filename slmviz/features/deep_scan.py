"""The deep scan of a prepared transcoder set: a million tokens or more of the set's own kind of text, the labels
drawn from it, and a measured score for each label.

    s, docs = prepare_deep_scan(m, ts, "plt-quick")      # resumable; kept beside the set's small scan
    load_set_scan(m, "plt-quick")[0].n_tokens             # >= 1,000,000 once it exists (prepared_scans)
    table = load_deep_labels(m, "plt-quick")              # LabelTable: layer, feature, label, score, baseline
    g.use_labels(table); g.labels; g.label_scores

**The scan.** The set's feature Scan (statistics, histograms, top contexts: what a card shows), over the set
corpus's training split and then the broad corpus's (DEEP_CHARS of each document) until `tokens` are read, with a
token table beside it: for each feature, the tokens it fires on most (`TokenTable`, one reduction per batch inside
the scan's own batch loop, scans.batches.run_batch's `tap`: no second forward). It runs a shard of documents at a
time and writes its state after each, so a stopped run resumes at the shard after the last one written.

**Labels.** A feature's label names the tokens it fires on: the most frequent ones of its token table, added while
they raise the label's balanced accuracy on the scan (`choose_label_tokens`), at most LABEL_TOKENS.

**Scores.** Measured on held-out text the scan never read (the set corpus's held-out split past the small scan's
documents), mechanically: the detection balanced accuracy of the label's predicate, "the token here is one the label
names", between contexts where the feature fires and where it does not. Firing contexts are weighed evenly across
QUANTILES bands of the feature's activation (edges from the deep scan's histogram), so a label that names only what
tops the feature scores lower than one that names what it fires on across its range (`LabelScorer`). The baseline is
the same score for a label naming only the feature's single top token.
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
DEEP_SHARD_DOCS = 128  # documents per resumable step (~2-4 min on 2 cores with a 30-layer set)
DEEP_TOP_K = 10
DEEP_BATCH_TOKENS = 2048  # padded tokens per forward: the deep scan is throughput-bound
KEEP_TOKENS = 48  # tokens kept per feature in the running token table (heavy hitters; see TokenTable)
LABEL_TOKENS = 4  # tokens a label names at most
QUANTILES = 5  # activation bands the firing contexts are weighed across
HELDOUT_TOKENS = 65_536  # held-out tokens a score reads
HELDOUT_SKIP_DOCS = 200  # the small scan's documents (prepared_scans.SCAN_DOCS): never scored on


# --- the token table ------------------------------------------------------------------------------------------
class TokenTable:
    """For every feature of the scanned hooks (one global index, hook after hook), the tokens it fires on most, by
    count and activation sum; its exact number of firing tokens; and every token's count in the text.

    Why heavy hitters and not every (feature, token) pair: a feature firing on 6 % of a million tokens meets
    thousands of distinct tokens, and 30,000 features' pairs outgrow memory. After each compaction a feature keeps
    its KEEP_TOKENS most frequent tokens; a token dropped then and met again restarts its count (Misra-Gries-like:
    a token that is among a feature's most frequent over the whole text stays, the tail's counts are low bounds).
    A label names at most LABEL_TOKENS << KEEP_TOKENS of them."""

    def __init__(self, hooks: list[str], sizes: list[int], vocab: int, keep: int = KEEP_TOKENS):
        self.hooks, self.sizes, self.vocab, self.keep = list(hooks), list(sizes), int(vocab), keep
        offsets = np.cumsum([0, *sizes])
        self.offset = {h: int(o) for h, o in zip(hooks, offsets[:-1], strict=True)}
        self.n_features = int(offsets[-1])
        self.keys = torch.zeros(0, dtype=torch.long)  # feature * vocab + token, sorted
        self.counts = torch.zeros(0, dtype=torch.long)
        self.sums = torch.zeros(0, dtype=torch.float64)
        self.fires = torch.zeros(self.n_features, dtype=torch.long)
        self.token_counts = torch.zeros(self.vocab, dtype=torch.long)
        self.n = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_size = 0

    def add(self, hook: str, x: torch.Tensor, ids: torch.Tensor, fired: Any = None) -> None:
        """One batch of `hook`'s features x [N, F] at tokens `ids` [N] (run_batch's tap). Tokens are counted with the
        first hook."""
        if hook not in self.offset:
            return
        if hook == self.hooks[0]:
            self.token_counts += torch.bincount(ids, minlength=self.vocab)
            self.n += int(ids.numel())
        rows, f = (x > 0).nonzero(as_tuple=True)
        g = f + self.offset[hook]
        self.fires += torch.bincount(g, minlength=self.n_features)
        self._pending.append((g * self.vocab + ids[rows], x[rows, f].double()))
        self._pending_size += int(rows.numel())
        if self._pending_size > 4_000_000:
            self.compact()

    def compact(self) -> None:
        """Merge the pending pairs into the table and keep each feature's `keep` most frequent tokens."""
        if not self._pending:
            return
        keys = torch.cat([self.keys, *(k for k, _ in self._pending)])
        sums = torch.cat([self.sums, *(v for _, v in self._pending)])
        counts = torch.cat([self.counts, torch.ones(self._pending_size, dtype=torch.long)])
        self._pending, self._pending_size = [], 0
        uniq, inverse = torch.unique(keys, return_inverse=True)
        c = torch.zeros(len(uniq), dtype=torch.long).index_add_(0, inverse, counts)
        s = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, sums)
        feature = uniq // self.vocab
        # each feature's tokens by count, descending (ties: the lower token id), then its first `keep`
        order = torch.argsort(-c, stable=True)
        order = order[torch.argsort(feature[order], stable=True)]
        f_sorted = feature[order]
        starts = torch.searchsorted(f_sorted, f_sorted, right=False)
        rank = torch.arange(len(order)) - starts
        kept = order[rank < self.keep]
        kept = kept.sort().values  # back to key order
        self.keys, self.counts, self.sums = uniq[kept], c[kept], s[kept]

    def top(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, counts) of global feature `g`, most frequent first."""
        self.compact()
        lo = int(torch.searchsorted(self.keys, g * self.vocab))
        hi = int(torch.searchsorted(self.keys, (g + 1) * self.vocab))
        c = self.counts[lo:hi].numpy()
        order = np.argsort(-c, kind="stable")
        return (self.keys[lo:hi].numpy() % self.vocab)[order], c[order]

    def state(self) -> dict[str, torch.Tensor]:
        self.compact()
        return {"table/keys": self.keys, "table/counts": self.counts, "table/sums": self.sums,
                "table/fires": self.fires, "table/token_counts": self.token_counts,
                "table/n": torch.tensor(self.n)}

    def load_state(self, t: dict[str, torch.Tensor]) -> None:
        self.keys, self.counts, self.sums = t["table/keys"], t["table/counts"], t["table/sums"]
        self.fires, self.token_counts, self.n = t["table/fires"], t["table/token_counts"], int(t["table/n"])


def choose_label_tokens(tokens: np.ndarray, counts: np.ndarray, fires: int, token_counts: np.ndarray, n: int,
                        most: int = LABEL_TOKENS) -> list[int]:
    """The tokens a label names: the feature's most frequent firing tokens, taken in order while each raises the
    balanced accuracy of "the token is one of these" on the scanned text (TPR: the firing tokens it names over all
    firing tokens; TNR: the non-firing tokens it does not name over all non-firing ones), at most `most`."""
    if fires <= 0 or len(tokens) == 0:
        return []
    chosen: list[int] = []
    hit = named = 0
    best = 0.5
    non_firing = max(n - fires, 1)
    for t, c in zip(tokens.tolist(), counts.tolist(), strict=True):
        h, nm = hit + c, named + int(token_counts[t])
        ba = 0.5 * (h / fires + 1 - max(nm - h, 0) / non_firing)
        if ba <= best:
            continue
        chosen.append(int(t))
        hit, named, best = h, nm, ba
        if len(chosen) == most:
            break
    return chosen or [int(tokens[0])]


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
        self.band = torch.zeros(n_features * self.q, dtype=torch.long)
        self.named = {k: torch.zeros(n_features * self.q, dtype=torch.long) for k in ("label", "baseline")}
        self.keys = {k: _key_set(d, vocab) for k, d in (("label", labels), ("baseline", baseline))}
        self.lists = {"label": labels, "baseline": baseline}
        self.token_counts = torch.zeros(vocab, dtype=torch.long)
        self.n = 0

    def add(self, hook: str, x: torch.Tensor, ids: torch.Tensor, fired: Any = None) -> None:
        if hook not in self.offset:
            return
        if hook == self.first:
            self.token_counts += torch.bincount(ids, minlength=self.vocab)
            self.n += int(ids.numel())
        rows, f = (x > 0).nonzero(as_tuple=True)
        g = f + self.offset[hook]
        act = x[rows, f].float()
        band = (act[:, None] > self.edges[g]).sum(1)  # [nnz] in 0..q-1
        slot = g * self.q + band
        size = self.n_features * self.q
        self.band += torch.bincount(slot, minlength=size)
        key = g * self.vocab + ids[rows]
        for k in ("label", "baseline"):
            hit = torch.isin(key, self.keys[k])
            self.named[k] += torch.bincount(slot[hit], minlength=size)

    def scores(self, which: str = "label") -> np.ndarray:
        """[n_features] balanced accuracy (nan where the feature never fired in the held-out text)."""
        band = self.band.view(-1, self.q).double()
        named = self.named[which].view(-1, self.q).double()
        filled = band > 0
        tpr = torch.where(filled, named / band.clamp_min(1), torch.zeros(())).sum(1) / filled.sum(1).clamp_min(1)
        fires = band.sum(1)
        named_all = torch.zeros(self.n_features, dtype=torch.float64)
        for g, toks in self.lists[which].items():
            named_all[g] = float(self.token_counts[toks].sum()) if toks else 0.0
        non_firing = (self.n - fires).clamp_min(1)
        tnr = 1 - (named_all - named.sum(1)).clamp_min(0) / non_firing
        out = 0.5 * (tpr + tnr)
        return torch.where(fires > 0, out, torch.full_like(out, float("nan"))).numpy()


def _key_set(d: dict[int, list[int]], vocab: int) -> torch.Tensor:
    keys = [g * vocab + t for g, toks in d.items() for t in toks]
    return torch.tensor(sorted(set(keys)), dtype=torch.long)


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


def label_text(tokens: list[str]) -> str:
    """'Texas / Dallas / Houston': the named tokens as read (labels._clean), each once."""
    from .labels import _distinct

    return " / ".join(_distinct(tokens, len(tokens))) or "(no tokens)"


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
    table = TokenTable(hooks, [features[h].n for h in hooks], vocab, keep=KEEP_TOKENS)
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
            "sae_rows": hooks, "deep": True}
    features_info = {h: {"axis": f.axis, "n": f.n, "what": f.what} for h, f in features.items()}
    s = Scan(info, features_info, acc, dict(zip(used, model.to_strings(used), strict=True)),
             pd.DataFrame(columns=DAMAGE_COLUMNS))

    # labels from the token table, baselines from each feature's top example
    label_part.say("choosing label tokens")
    tc = table.token_counts.numpy()
    labels: dict[int, list[int]] = {}
    baseline: dict[int, list[int]] = {}
    before = spec.context_before
    for h in hooks:
        off = table.offset[h]
        top_tok = acc[h].top_ids[:, 0, before]
        fired = table.fires[off:off + features[h].n]
        for f in range(features[h].n):
            if int(fired[f]) == 0:
                continue
            toks, counts = table.top(off + f)
            labels[off + f] = choose_label_tokens(toks, counts, int(fired[f]), tc, table.n)
            baseline[off + f] = [int(top_tok[f])] if int(top_tok[f]) >= 0 else []
    label_part.finish()

    edges = torch.cat([quantile_edges(acc[h].hist) for h in hooks])
    scorer = LabelScorer(table.offset, table.n_features, vocab, edges, labels, baseline)
    held_spec = ScanSpec(tuple(hooks), 1, window=spec.window, batch_tokens=batch_tokens, saes=saes)
    held = iter(heldout if heldout is not None else heldout_docs(model, corpus))
    for shard in iter_shards(held, DEEP_SHARD_DOCS):
        run_shard(model, shard, held_spec, features, lambda fr: score_part.update(scorer.n, heldout_tokens, "tok"),
                  tap=scorer.add)
        if scorer.n >= heldout_tokens:
            break
    score, base = scorer.scores("label"), scorer.scores("baseline")
    rows = []
    for h, L in zip(hooks, layers, strict=True):
        off = table.offset[h]
        for f in range(features[h].n):
            g = off + f
            if g not in labels:
                continue
            rows.append({"layer": L, "feature": f, "hook": h, "label": label_text(model.to_strings(labels[g])),
                         "tokens": labels[g], "score": float(score[g]), "baseline": float(base[g]),
                         "fires": int(table.fires[g])})
    frame = pd.DataFrame(rows, columns=["layer", "feature", "hook", "label", "tokens", "score", "baseline", "fires"])
    table_info = {"tokens": done["tokens"], "heldout_tokens": scorer.n, "quantiles": QUANTILES,
                  "label_tokens": LABEL_TOKENS, "median_score": _median(frame.score),
                  "median_baseline": _median(frame.baseline)}
    score_part.finish()
    _save(s, read, LabelTable(frame, table_info), folder)
    shutil.rmtree(work, ignore_errors=True)
    p.finish(f"{done['tokens']:,} tokens in {done['seconds']:.0f} s")
    return s, read


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


__all__ = ["DEEP_TOKENS", "DeepScanBusy", "LabelScorer", "LabelTable", "TokenTable", "choose_label_tokens", "deep_docs",
           "quantile_edges", "run_deep_scan"]
