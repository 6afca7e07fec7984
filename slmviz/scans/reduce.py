"""Streaming reductions of a corpus scan: running moments, a fixed-edge histogram, top-k with context.

Memory is bounded by the number of features, never by the corpus: each batch of documents is reduced to
a `HookPartial` (moments, histogram counts, its own top-k), and partials are merged one after another
into the running one. Both engines merge the same partials in the same order (batch index), with the
same arithmetic, so the local and the Ray engine agree bit for bit:

- moments merge with Chan et al.'s pairwise update in float64 (no catastrophic sum-of-squares cancellation
  on SmolLM2's ~1e4 residuals);
- histogram counts are integers on edges fixed in advance (symmetric log-spaced bins, 8 per decade from
  1e-5 to 1e6, plus zero and ±overflow), so they need no first pass and merge exactly;
- top-k ranks by activation, ties going to the earlier (document, position), with NaN ranked last;
  merging keeps the k best of (running ∪ batch) by the same rule, so the result equals a brute-force
  sort of every token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

EMPTY_KEY = torch.iinfo(torch.int64).max  # an unused top-k slot: loses every tie
POSITION_BITS = 32  # key = doc << 32 | position: one int64 orders (document, position) pairs


def histogram_edges() -> torch.Tensor:
    """Bin edges shared by every feature: ±10^(j/8) for 1e-5 <= |x| <= 1e6, and 0. [179] float32."""
    positive = 10.0 ** (torch.arange(-40, 49, dtype=torch.float64) / 8)  # [89]
    return torch.cat([-positive.flip(0), torch.zeros(1, dtype=torch.float64), positive]).float()


EDGES = histogram_edges()
N_BINS = EDGES.numel() + 1  # bin i holds edges[i-1] < x <= edges[i]; bins 0 and -1 are the overflows


def token_key(doc: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    return (doc.long() << POSITION_BITS) | position.long()


def key_doc(key: torch.Tensor) -> torch.Tensor:
    return key >> POSITION_BITS


def key_position(key: torch.Tensor) -> torch.Tensor:
    return key & ((1 << POSITION_BITS) - 1)


@dataclass
class HookPartial:
    """One hook's reduction over some tokens. F = features, k = top-k, C = context tokens, V = value shape."""

    n: torch.Tensor  # [] int64: tokens seen
    mean: torch.Tensor  # [F] float64
    m2: torch.Tensor  # [F] float64: sum of squared deviations from the mean
    min: torch.Tensor  # [F] float32
    max: torch.Tensor  # [F] float32
    hist: torch.Tensor  # [F, N_BINS] int64
    value_mean: torch.Tensor  # [*V] float64 (empty for patterns: no per-token value)
    top_val: torch.Tensor  # [F, k] float32, descending; -inf in unused slots
    top_key: torch.Tensor  # [F, k] int64 token_key; EMPTY_KEY in unused slots
    top_ids: torch.Tensor  # [F, k, C] int64 context token ids; -1 outside the window
    top_acts: torch.Tensor  # [F, k, C] float32 the feature at each context token; NaN outside

    @classmethod
    def empty(cls, n_features: int, top_k: int, context: int, value_shape: tuple[int, ...]) -> HookPartial:
        f, k, c = n_features, top_k, context
        return cls(
            n=torch.zeros((), dtype=torch.int64), mean=torch.zeros(f, dtype=torch.float64),
            m2=torch.zeros(f, dtype=torch.float64), min=torch.full((f,), float("inf")),
            max=torch.full((f,), float("-inf")), hist=torch.zeros(f, N_BINS, dtype=torch.int64),
            value_mean=torch.zeros(value_shape, dtype=torch.float64),
            top_val=torch.full((f, k), float("-inf")), top_key=torch.full((f, k), EMPTY_KEY),
            top_ids=torch.full((f, k, c), -1, dtype=torch.int64), top_acts=torch.full((f, k, c), float("nan")),
        )

    @classmethod
    def of_tokens(cls, x: torch.Tensor, keys: torch.Tensor, ctx_rows: torch.Tensor, ids: torch.Tensor,
                  values: torch.Tensor | None, top_k: int, fired: Fired | None = None) -> HookPartial:
        """Reduce one batch. x [N, F] features of its real tokens in key order; keys [N]; ctx_rows [N, C]
        row of each context token (-1: outside the window); ids [N] token ids; values [N, *V] or None.
        `fired`: x's entries above 0 (`fired(x)`), when the caller has them already; None: found here."""
        x64 = x.to(torch.float64, copy=True)  # a copy even of a float64 x: the next line works in place
        mean = x64.mean(0)
        m2 = x64.sub_(mean).square_().sum(0)  # in place: the same operations as ((x64 - mean) ** 2).sum(0)
        del x64
        k = min(top_k, x.shape[0])
        fired = fired if fired is not None else positive_entries(x)
        if fired is not None:  # a sparse coder's features: only the entries above 0 are binned and ranked
            hist = fired.histogram(x.shape[0])
            order = fired.top_rows(x, k)
        else:
            bins = torch.bucketize(x.float().contiguous(), EDGES) + torch.arange(x.shape[1]) * N_BINS  # [N, F]
            hist = torch.bincount(bins.flatten(), minlength=x.shape[1] * N_BINS).view(x.shape[1], N_BINS)
            order = top_rows(x, k)  # [F, k]
        rows = ctx_rows[order]  # [F, k, C]
        feature = torch.arange(x.shape[1])[:, None, None].expand_as(rows)
        acts = torch.where(rows >= 0, x[rows.clamp_min(0), feature].float(), float("nan"))
        part = cls(
            n=torch.tensor(x.shape[0], dtype=torch.int64), mean=mean, m2=m2,
            min=x.float().amin(0), max=x.float().amax(0), hist=hist,
            value_mean=_value_mean(values, x, mean),
            top_val=x.float().T.gather(1, order), top_key=keys[order],
            top_ids=torch.where(rows >= 0, ids[rows.clamp_min(0)], -1), top_acts=acts,
        )
        if k == top_k:
            return part
        # fewer tokens than k: merging with an empty partial pads every top-k tensor with unused slots
        return part.merge(cls.empty(x.shape[1], top_k, ctx_rows.shape[1], tuple(part.value_mean.shape)))

    def merge(self, other: HookPartial) -> HookPartial:
        """self ∪ other, with self's tokens earlier in the corpus than other's (the order both engines use)."""
        n = self.n + other.n
        if int(n) == 0:
            return self
        na, nb = self.n.double(), other.n.double()
        delta = other.mean - self.mean
        mean = self.mean + delta * (nb / n.double())
        m2 = self.m2 + other.m2 + delta**2 * (na * nb / n.double())
        value_mean = self.value_mean + (other.value_mean - self.value_mean) * (nb / n.double())
        k = self.top_val.shape[1]
        val = torch.cat([self.top_val, other.top_val], 1)  # [F, 2k]
        key = torch.cat([self.top_key, other.top_key], 1)
        by_key = torch.sort(key, dim=1, stable=True).indices
        by_val = torch.sort(_rankable(val.gather(1, by_key)), dim=1, descending=True, stable=True).indices
        pick = by_key.gather(1, by_val)[:, :k]  # [F, k]: best activation first, ties to the earlier key
        ids = torch.cat([self.top_ids, other.top_ids], 1)
        acts = torch.cat([self.top_acts, other.top_acts], 1)
        gather3 = pick[:, :, None].expand(-1, -1, ids.shape[2])
        return HookPartial(
            n=n, mean=mean, m2=m2, min=torch.minimum(self.min, other.min), max=torch.maximum(self.max, other.max),
            hist=self.hist + other.hist, value_mean=value_mean, top_val=val.gather(1, pick),
            top_key=key.gather(1, pick), top_ids=ids.gather(1, gather3), top_acts=acts.gather(1, gather3),
        )

    def to_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        return {f"{prefix}/{f.name}": getattr(self, f.name).contiguous() for f in fields(self)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], prefix: str) -> HookPartial:
        return cls(**{f.name: tensors[f"{prefix}/{f.name}"] for f in fields(cls)})


ZERO_BIN = int(torch.bucketize(torch.zeros(1), EDGES))  # the bin of x == 0


@dataclass
class Fired:
    """The entries above 0 of a batch's features x [N, F] whose every entry is >= 0 (no NaN): a sparse coder's
    activations, where ~6 % of the entries fire. `rows`, `cols` in row-major order (torch.nonzero's), `vals`
    float32; `counts` [F] entries per feature.

    Why: a scan's histogram and top-k over every entry of a 30-layer set cost more than the forward; over the
    fired entries they cost a twentieth of that, and give the same integers and the same rows (a zero's bin is
    known, and zeros rank below every fired entry, ties to the earlier row)."""

    rows: torch.Tensor
    cols: torch.Tensor
    vals: torch.Tensor
    counts: torch.Tensor

    def histogram(self, n: int) -> torch.Tensor:
        """[F, N_BINS] the histogram of x (HookPartial.of_tokens' bins): the fired entries binned, the rest at 0."""
        f = len(self.counts)
        hist = torch.bincount(torch.bucketize(self.vals, EDGES) + self.cols * N_BINS, minlength=f * N_BINS)
        hist = hist.view(f, N_BINS)
        hist[:, ZERO_BIN] += n - self.counts
        return hist

    def top_rows(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """[F, k] top_rows(x, k): each feature's fired rows by value (ties to the earlier row), then, where fewer
        than k fired, its earliest rows at 0."""
        f = len(self.counts)
        # one stable sort by (feature, value descending): rows stay in order among equal values. A float >= 0
        # orders as its bits, so (feature << 31) | (max bits - value bits) is the key.
        bits = self.vals.view(torch.int32).long()
        order = torch.sort((self.cols << 31) | (0x7FFFFFFF - bits), stable=True).indices
        cols = self.cols[order]
        start = torch.cumsum(self.counts, 0) - self.counts  # [F] first entry of each feature in `order`
        rank = torch.arange(len(order)) - start[cols]
        keep = rank < k
        out = torch.full((f, k), -1, dtype=torch.long)
        out[cols[keep], rank[keep]] = self.rows[order[keep]]
        short = (self.counts < k).nonzero().flatten()  # features that fired fewer than k times: zeros fill in
        if short.numel():
            # the earliest rows at 0 of such a feature all lie in x's first k rows (at most counts < k fired there)
            zero = x[:k, short] == 0  # [k, S]
            slot = torch.cumsum(zero.long(), 0) - 1 + self.counts[short][None, :]  # its place after the fired rows
            take = zero & (slot < k)
            r, s = take.nonzero(as_tuple=True)
            out[short[s], slot[r, s]] = r
        return out


def positive_entries(x: torch.Tensor) -> Fired | None:
    """x [N, F]'s entries above 0 (Fired) when none is below 0 or NaN, else None (the dense reductions run)."""
    if x.numel() == 0 or x.dtype.is_complex or not bool(x.min() >= 0):  # NaN: min is NaN, the test fails
        return None
    rows, cols = (x > 0).nonzero(as_tuple=True)
    return Fired(rows, cols, x[rows, cols].float(), torch.bincount(cols, minlength=x.shape[1]))


def _value_mean(values: torch.Tensor | None, x: torch.Tensor, x_mean: torch.Tensor) -> torch.Tensor:
    """The per-position value's mean; the features' own mean when the features are the values (a neuron)."""
    if values is None:
        return torch.zeros(0, dtype=torch.float64)
    if values is x:
        return x_mean.clone()  # its own storage: safetensors refuses tensors that share memory
    return values.double().mean(0)


def top_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """[N, F] -> [F, k]: each feature's k best rows, best first; equal values go to the earlier row (rows are
    in (document, position) order), NaN ranks last. The same as a stable descending sort's first k rows.

    torch.topk is ~20x faster than sorting every row, but it breaks ties arbitrarily. Its k rows are the
    stable sort's whenever fewer than k+1 rows reach the k-th value; only features where more do (ties at
    the cut, e.g. a bf16 model's repeated values) are sorted in full.
    """
    v = _rankable(x)
    top = torch.topk(v, k, dim=0)  # [k, F]
    rows = top.indices.sort(dim=0).values  # the same k rows, earliest first
    rows = rows.gather(0, torch.sort(v.gather(0, rows), dim=0, descending=True, stable=True).indices)
    tied = ((v >= top.values[-1]).sum(0) > k).nonzero().flatten()  # [F'] features with ties at the cut
    if tied.numel():
        rows[:, tied] = torch.sort(v[:, tied], dim=0, descending=True, stable=True).indices[:k]
    return rows.T


def _rankable(x: torch.Tensor) -> torch.Tensor:
    """NaN ranks below every number (torch.sort would put it first in a descending sort)."""
    return torch.nan_to_num(x.float(), nan=float("-inf"))


@dataclass
class DamagePartial:
    """Per-window sums of a batch's variant damage. W windows, V variants."""

    doc: torch.Tensor  # [W] int64
    tokens: torch.Tensor  # [W] int64
    kl_sum: torch.Tensor  # [W, V] float64: Σ over positions of KL(faithful ‖ variant), nats
    agree_sum: torch.Tensor  # [W, V] int64: positions where the top-1 token agrees

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {f"damage/{f.name}": getattr(self, f.name).contiguous() for f in fields(self)}

    @classmethod
    def concat(cls, parts: list[DamagePartial]) -> DamagePartial | None:
        """The windows of several batches, in order (None for none)."""
        if not parts:
            return None
        return cls(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> DamagePartial | None:
        if "damage/doc" not in tensors:
            return None
        return cls(**{f.name: tensors[f"damage/{f.name}"] for f in fields(cls)})


class DamageTotals:
    """Per-document sums, merged window by window (a long document's windows can sit in several batches)."""

    def __init__(self, n_variants: int):
        self.n_variants = n_variants
        self.docs: dict[int, list] = {}

    def add(self, part: DamagePartial) -> None:
        for i, doc in enumerate(part.doc.tolist()):
            entry = self.docs.setdefault(doc, [0, torch.zeros(self.n_variants, dtype=torch.float64),
                                               torch.zeros(self.n_variants, dtype=torch.int64)])
            entry[0] += int(part.tokens[i])
            entry[1] = entry[1] + part.kl_sum[i]
            entry[2] = entry[2] + part.agree_sum[i]

    def rows(self, variant_names: list[str]) -> list[tuple]:
        """(doc, variant, tokens, kl_mean, top1_agree) in document order."""
        out = []
        for doc in sorted(self.docs):
            n, kl, agree = self.docs[doc]
            out += [(doc, name, n, float(kl[v]) / n, float(agree[v]) / n) for v, name in enumerate(variant_names)]
        return out
