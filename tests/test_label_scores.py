"""Label scores (features.deep_scan): the detection balanced accuracy of a label's predicate, weighed across the
feature's activation bands, on synthetic features whose activation is a known function of their tokens, checked
against values worked out by hand; the token table against a brute-force count; labels and scores on a graph.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from slmviz.features import deep_scan as ds
from slmviz.features.deep_scan import (
    HeavyHitters,
    LabelScorer,
    TokenTable,
    choose_label_tokens,
    label_text,
    label_tokens,
    quantile_edges,
)
from slmviz.scans.reduce import EDGES, N_BINS

A, B, C, D, E = 1, 2, 3, 4, 5
VOCAB = 8
ACT = {A: 3.0, B: 1.0, C: 0.5}  # the synthetic feature: 3 on A, 1 on B, 0.5 on C, 0 elsewhere


def synthetic_tokens() -> torch.Tensor:
    """10 A, 10 B, 20 C (where the feature fires), 10 E and 50 D (where it does not), interleaved."""
    toks = [A] * 10 + [B] * 10 + [C] * 20 + [E] * 10 + [D] * 50
    return torch.tensor(toks)[torch.randperm(len(toks), generator=torch.Generator().manual_seed(0))]


def feature_of(tokens: torch.Tensor) -> torch.Tensor:
    x = torch.zeros(len(tokens), 2)  # feature 0 the synthetic one; feature 1 fires on D at 2.0
    for t, a in ACT.items():
        x[tokens == t, 0] = a
    x[tokens == D, 1] = 2.0
    return x


def histogram(x: torch.Tensor) -> torch.Tensor:
    """[F, N_BINS] as scans.reduce.HookPartial.of_tokens counts it (bin i: EDGES[i-1] < x <= EDGES[i])."""
    bins = torch.bucketize(x.contiguous(), EDGES)
    return torch.stack([torch.bincount(bins[:, f], minlength=N_BINS) for f in range(x.shape[1])])


def test_quantile_edges_are_the_bins_where_the_firing_share_reaches_each_fifth():
    x = feature_of(synthetic_tokens())
    edges = quantile_edges(histogram(x), q=5)
    # firing tokens: 20 at 0.5 (half), 10 at 1 (to 75 %), 10 at 3: the fifths fall in the bins of 0.5, 0.5, 1, 3
    def right_edge(v):  # the right edge of the bin holding v
        return float(EDGES[torch.bucketize(torch.tensor([v]), EDGES)])

    assert edges[0].tolist() == pytest.approx([right_edge(0.5), right_edge(0.5), right_edge(1.0), right_edge(3.0)])
    assert right_edge(1.0) == 1.0  # 1 is an edge: a bin holds its right edge
    assert edges[1].tolist() == [right_edge(2.0)] * 4  # one activation: every fifth in its bin
    assert torch.isinf(quantile_edges(torch.zeros(1, N_BINS, dtype=torch.long))).all()  # never fired


def scorer_for(tokens: torch.Tensor, label: list[int], baseline: list[int]) -> LabelScorer:
    x = feature_of(tokens)
    s = LabelScorer({"h": 0}, 2, VOCAB, quantile_edges(histogram(x)), {0: label, 1: [D]}, {0: baseline, 1: [D]})
    half = len(tokens) // 2  # two batches: the counts add up
    s.add("h", x[:half], tokens[:half])
    s.add("h", x[half:], tokens[half:])
    return s


def test_label_score_equals_its_worked_out_value():
    """Bands (edges of the fifths): 0.5 -> band 0, 1 -> band 2 (1 is not above its own edge), 3 -> band 3; band 1 is
    empty. A label naming A and B finds none of band 0 (C), all of band 2 (B) and band 3 (A): TPR = (0 + 1 + 1) / 3;
    it names no non-firing token: TNR = 1; BA = 5/6. Naming A only (the baseline): TPR = 1/3, BA = 2/3. Naming A, B
    and E (10 of the 60 non-firing tokens): TNR = 50/60, BA = (2/3 + 5/6) / 2 = 3/4. Naming C, B, A: 1."""
    tokens = synthetic_tokens()
    s = scorer_for(tokens, [A, B], [A])
    assert s.scores("label")[0] == pytest.approx(5 / 6, abs=1e-12)
    assert s.scores("baseline")[0] == pytest.approx(2 / 3, abs=1e-12)
    assert scorer_for(tokens, [A, B, E], [A]).scores("label")[0] == pytest.approx(3 / 4, abs=1e-12)
    assert scorer_for(tokens, [C, B, A], [A]).scores("label")[0] == pytest.approx(1.0, abs=1e-12)
    assert s.scores("label")[1] == pytest.approx(1.0)  # fires on D exactly, named D
    assert s.n == len(tokens)


def test_a_feature_that_never_fires_in_the_held_out_text_has_no_score():
    tokens = torch.tensor([E] * 20)
    s = LabelScorer({"h": 0}, 1, VOCAB, torch.ones(1, 4), {0: [A]}, {0: [A]})
    s.add("h", torch.zeros(20, 1), tokens)
    assert np.isnan(s.scores()[0])


def test_label_tokens_are_the_largest_gains_in_balanced_accuracy():
    tokens = synthetic_tokens()
    counts = torch.bincount(tokens, minlength=VOCAB).numpy()
    # firing tokens by count: C 20, A 10, B 10 (then D, which the feature never fires on, is not in the table);
    # each fires every time it occurs: gains 20/40, 10/40, 10/40 (ties keep the given order)
    chosen = choose_label_tokens(np.array([C, A, B]), np.array([20, 10, 10]), 40, counts, len(tokens))
    assert chosen == [C, A, B]
    # by gain, not by count: E fires 6 times of its 10, C 8 times of its 40 -> gains 6/14 - 4/86 > 8/14 - 32/86
    some = counts.copy()
    some[C] = 40
    assert choose_label_tokens(np.array([C, E]), np.array([8, 6]), 14, some, 100) == [E, C]
    # a token as common outside the feature as in it lowers the accuracy: left out
    counts_e = counts.copy()
    counts_e[E] = 1000
    assert choose_label_tokens(np.array([E, A]), np.array([2, 10]), 12, counts_e, 2000) == [A]
    assert choose_label_tokens(np.array([A, B]), np.array([5, 5]), 10, counts, len(tokens), most=1) == [A]


def test_token_table_counts_equal_a_brute_force_count_and_keeps_the_heavy_hitters():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (500,), generator=g)
    x = torch.rand(500, 3, generator=g) * (torch.rand(500, 3, generator=g) > 0.6)
    table = TokenTable(["a", "b"], [3, 2], VOCAB, keep=VOCAB)
    for lo in range(0, 500, 100):
        table.add("a", x[lo:lo + 100], ids[lo:lo + 100])
        table.add("b", x[lo:lo + 100, 1:], ids[lo:lo + 100])
    for _hook, off, cols in (("a", 0, [0, 1, 2]), ("b", 3, [1, 2])):
        for j, col in enumerate(cols):
            want = Counter(ids[x[:, col] > 0].tolist())
            toks, counts = table.top(off + j)
            assert dict(zip(toks.tolist(), counts.tolist(), strict=True)) == dict(want)
            assert counts.tolist() == sorted(counts.tolist(), reverse=True)
            assert int(table.fires[off + j]) == int((x[:, col] > 0).sum())
    assert table.token_counts.tolist() == torch.bincount(ids, minlength=VOCAB).tolist() and table.n == 500
    small = TokenTable(["a"], [3], VOCAB, keep=2)  # 8 tokens > 2 * 2: cut back to the 2 most frequent
    small.add("a", x, ids)
    toks, counts = small.top(0)
    full = Counter(ids[x[:, 0] > 0].tolist()).most_common()
    assert len(full) > 4 and len(toks) == 2 and counts.tolist() == [c for _, c in full[:2]]


def reference_heavy_hitters(batches: list[list[int]], span: int, keep: int) -> dict[int, int]:
    """HeavyHitters' rule, written plainly: add each batch's counts, then cut each group of more than 2 * keep keys
    back to its `keep` most frequent (ties: the lower key)."""
    table: dict[int, int] = {}
    for batch in batches:
        for k in batch:
            table[k] = table.get(k, 0) + 1
        groups: dict[int, list[int]] = {}
        for k in table:
            groups.setdefault(k // span, []).append(k)
        table = {k: table[k] for ks in groups.values()
                 for k in (sorted(ks, key=lambda k: (-table[k], k))[:keep] if len(ks) > 2 * keep else ks)}
    return table


@pytest.mark.parametrize("keep", [1, 3, 50])
def test_heavy_hitters_keep_each_groups_most_frequent_keys_merge_after_merge(keep, monkeypatch):
    monkeypatch.setattr(ds, "PENDING_PAIRS", 40)  # a merge every few batches: trims between them
    gen = np.random.default_rng(keep)
    span = 20
    batches = [(gen.zipf(1.6, size=15) % span + span * gen.integers(0, 4, size=15)).tolist() for _ in range(30)]
    hh = HeavyHitters(span, keep)
    merged: list[list[int]] = [[]]
    for b in batches:
        hh.add(np.array(b))
        merged[-1] += b
        if not hh._pending:  # it merged: the reference merges the same keys at once
            merged.append([])
    hh.compact()
    assert dict(zip(hh.keys.tolist(), hh.counts.tolist(), strict=True)) == reference_heavy_hitters(merged, span, keep)
    assert hh.keys.tolist() == sorted(hh.keys.tolist())


def test_heavy_hitters_pack_or_sort_the_same_ranking(monkeypatch):
    """Too many groups and keys to pack in one int64 fall back from one packed sort to a three-key lexsort: the same
    table."""
    keys = np.random.default_rng(5).integers(0, 64 * 30, size=3000)
    packed = HeavyHitters(30, 4)  # 30 keys a group: every group is cut
    packed.add(keys)
    packed.compact()
    real, calls = np.lexsort, []
    monkeypatch.setattr(np, "lexsort", lambda k: calls.append(1) or real(k))
    monkeypatch.setattr(ds, "_PACK_BITS", 20)  # no room for the counts: the lexsort path
    sorted_ = HeavyHitters(30, 4)
    sorted_.add(keys)
    sorted_.compact()
    assert calls
    assert packed.keys.tolist() == sorted_.keys.tolist() and packed.counts.tolist() == sorted_.counts.tolist()


def test_label_tokens_of_a_table_are_choose_label_tokens_of_each_feature():
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (400,), generator=gen)
    x = torch.rand(400, 4, generator=gen) * (torch.rand(400, 4, generator=gen) > 0.7)
    x[ids == 3, 2] = 5.0  # feature 2 fires on every 3
    table = TokenTable(["a"], [4], VOCAB, keep=VOCAB)
    table.add("a", x, ids)
    got = label_tokens(table, most=3)
    for f in range(4):
        toks, counts = table.top(f)
        assert got[f] == choose_label_tokens(toks, counts, int(table.fires[f]), table.token_counts, table.n, most=3)
    assert got[2][0] == 3


def test_a_feature_no_token_singles_out_is_labelled_by_its_most_frequent_token():
    """Each token occurs in pairs and the feature fires on the first of each pair: every token fires exactly at the
    feature's base rate, so naming any of them gains nothing; the label names the most frequent one (ties: lower id)."""
    ids = torch.tensor([t for t in [4, 2, 4, 6, 2, 4] for _ in range(2)])
    x = torch.zeros(len(ids), 2)
    x[::2, 0] = 1.0
    x[ids == 6, 1] = 1.0  # a second feature, singled out by token 6
    table = TokenTable(["a"], [2], VOCAB, keep=VOCAB)
    table.add("a", x, ids)
    assert label_tokens(table) == {0: [4], 1: [6]}
    toks, counts = table.top(0)
    assert choose_label_tokens(toks, counts, int(table.fires[0]), table.token_counts, table.n) == [4]


def test_a_label_reads_its_first_tokens_and_how_many_more_it_names():
    assert label_text([" is", " be", "is", " it", " was", " are", "\n"]) == "is / be / it / was (+2)"
    assert label_text([" Paris"]) == "Paris"
    assert label_text([]) == "(no tokens)"
