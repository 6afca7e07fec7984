"""Built-in circuit tasks (slmviz.circuits.tasks) and the circuit figures.

Fast tests use a tiny model (its word-level tokenizer has no names or digits, so only the induction task applies
there); the slow ones check every task on both bundled models' tokenizers and that each task separates the clean
and corrupted runs. Not covered: what the circuits found (bench/perf/circuits.py, docs/circuits.md).
"""

from __future__ import annotations

import plotly.graph_objects as go
import pytest
import torch

import slmviz
from slmviz.circuits.tasks import (
    Task,
    greater_than_metric,
    greater_than_task,
    induction_task,
    ioi_task,
    one_token_names,
    task,
)


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    return slmviz.load(tiny_dirs["llama_gqa"])


def test_induction_pairs_repeat_a_random_sequence(tiny):
    t = induction_task(tiny, n=5, length=8, seed=3)
    assert len(t) == 5 and t.name == "induction"
    special = set(tiny.tokenizer.all_special_ids)
    for clean, corrupted, answer, wrong in zip(t.clean, t.corrupted, t.answers, t.wrongs, strict=True):
        assert len(clean) == len(corrupted)
        a, k = clean[:8], len(clean) - 8
        assert clean[8:] == a[:k] == corrupted[8:] and answer == a[k]
        assert wrong == corrupted[k] and not set(a) & set(corrupted[:8]) and not set(clean) & special
    assert induction_task(tiny, n=5, length=8, seed=3).clean == t.clean  # seeded


def test_a_task_stands_for_its_pairs(tiny):
    t = induction_task(tiny, n=3, length=6)
    by_task = slmviz.circuit(t, model=tiny)
    by_hand = slmviz.circuit(t.clean, t.corrupted, answer=t.answers, wrong=t.wrongs, model=tiny)
    torch.testing.assert_close(by_task.scores, by_hand.scores)
    assert slmviz.patch_edges(t, edges=[("m0", "logits")], model=tiny) == pytest.approx(
        slmviz.patch_edges(t.clean, t.corrupted, edges=[("m0", "logits")], answer=t.answers, wrong=t.wrongs,
                           model=tiny))
    assert list(t.frame(tiny).columns[:4]) == ["clean", "corrupted", "answer", "wrong"]
    assert task("induction", tiny, n=3, length=6).clean == t.clean
    with pytest.raises(ValueError, match="built-in tasks are ioi, induction, greater-than"):
        task("greater_than", tiny)


def test_tasks_that_need_words_or_digits_say_so(tiny):
    with pytest.raises(ValueError, match="IOI needs 3 names that are one token"):
        ioi_task(tiny)
    with pytest.raises(ValueError, match="one token per digit"):
        greater_than_task(tiny)


def test_the_greater_than_metric_is_the_probability_difference():
    digits = list(range(10, 20))
    logits = torch.full((3, 30), -1e9)
    logits[-1, digits] = torch.log(torch.tensor([0.1] * 10))  # uniform over the ten digits
    assert float(greater_than_metric(digits, 3)(logits)) == pytest.approx(0.6 - 0.3)
    assert float(greater_than_metric(digits, 0)(logits)) == pytest.approx(0.9)


def test_circuit_figures(tiny):
    t = induction_task(tiny, n=2, length=6)
    c = slmviz.circuit(t, model=tiny, method="eap-ig", steps=2)
    fig = c.plot(10)
    assert isinstance(fig, go.Figure)
    edges = [tr for tr in fig.data if tr.mode == "lines"]
    assert len(edges) == 10 and edges[0].customdata[0][0] == c.edges.source.iloc[0]
    curve = c.plot_faithfulness([0, 5, c.graph.n_edges])
    assert list(curve.data[0].customdata[:, 0]) == [0, 5, c.graph.n_edges]
    assert "eap-ig" in repr(c) and "2 pairs" in repr(c)


@pytest.mark.slow
@pytest.mark.parametrize("name", [None, "gemma-3-270m"])
def test_every_task_works_on_the_bundled_tokenizers(name):
    m = slmviz.load(name)
    assert len(one_token_names(m)) >= 20
    for t in (ioi_task(m, n=6), induction_task(m, n=6), greater_than_task(m, n=6)):
        assert isinstance(t, Task)
        for clean, corrupted in zip(t.clean, t.corrupted, strict=True):
            assert m.encode(clean).numel() == m.encode(corrupted).numel()
        from slmviz.circuits.circuit import prepare

        runs, _ = prepare(m, t.clean, t.corrupted, t.answers, t.wrongs, t.metrics)
        clean = sum(r.clean_metric for r in runs) / len(runs)
        corrupted = sum(r.corrupted_metric for r in runs) / len(runs)
        assert clean > corrupted + 0.3 * abs(clean), (t.name, clean, corrupted)
