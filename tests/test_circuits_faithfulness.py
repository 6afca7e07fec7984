"""The batched faithfulness curve against the plain path (issue 19, "a curve of 10 sizes >= 5x faster than 10
separate patched forwards"; bench/perf/circuits.py measures the speed, these tests the values).

The curve runs every size as rows of one batch, and several rows share one copy of the pair's corrupted writes;
each destination's input is computed without per-destination masking (a destination with no patched edge gets
x + 0, one with every edge patched its corrupted input + 0). Checked: each size equals that edge set run alone
(within fp32 rounding: rows of one batch round like one row up to the kernels' blocking), the empty circuit is the
corrupted metric and the full graph the clean one exactly, and the destination inputs of the batched reader equal
x and the corrupted input bit for bit where nothing or everything is patched.
Does not cover: speed (bench/perf/circuits.py) or real models.
"""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.circuits.circuit import circuit
from slmviz.circuits.engine import _Reader, patched_metrics

CLEAN = [3, 17, 5, 99, 42, 8, 11, 60, 7, 21]
CORRUPTED = [3, 17, 5, 99, 40, 8, 11, 60, 7, 21]  # differs at position 4: the batch runs positions 4..
ANSWER, WRONG = 5, 6


@pytest.fixture(scope="module")
def c(tiny_dirs):
    m = slmviz.load(tiny_dirs["llama_gqa"])
    return circuit(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, model=m, method="eap")


def test_each_size_of_the_curve_equals_its_edge_set_run_alone(c):
    total = c.graph.n_edges
    sizes = [0, 1, 3, 10, 30, 60, total // 2, total - 5, total]
    curve = c.faithfulness(sizes)
    real, rank = c.graph.real(), c._rank()
    alone = [float(patched_metrics(c._model, c.graph, c._runs, [real & (rank >= n)])[0, 0]) for n in sizes]
    assert curve["metric"].tolist() == pytest.approx(alone, abs=1e-5)
    assert curve["metric"].iloc[0] == c.corrupted and curve["metric"].iloc[-1] == c.clean  # exactly
    # the same sets through the patched runs (the empty / full shortcuts off) agree to rounding
    ran = patched_metrics(c._model, c.graph, c._runs, [real & (rank >= n) for n in sizes], shortcuts=False)
    assert ran[:, 0].tolist() == pytest.approx(alone, abs=1e-5)
    # the batch really differs from row to row (a bug that ran one row for all would pass the ends only)
    assert len(set(curve["metric"].round(6))) > 4


def test_the_reader_gives_untouched_destinations_x_and_whole_ones_their_corrupted_input_exactly():
    torch.manual_seed(0)
    b, n, k, pos, d = 3, 6, 4, 5, 8
    diff = torch.randn(b, n, pos, d)
    x = torch.randn(b, pos, d)
    corrupted = x + diff.sum(1) + 0.25  # + a term no source owns, the same in both runs (o_proj's bias)
    mask = torch.zeros(b, n, k, dtype=torch.bool)
    mask[0, :, 1] = True  # row 0: destination 1 whole, 0 / 2 / 3 untouched
    mask[1, :2, 0] = True  # row 1: destination 0 two of six (x + sum), destination 2 five of six (corrupted - rest)
    mask[1, :5, 2] = True
    mask[2] = True  # row 2: every destination whole
    out = _Reader(mask, diff, lambda: corrupted)._compute(x)  # [b, pos, k, d]
    assert torch.equal(out[0, :, 0], x[0]) and torch.equal(out[0, :, 3], x[0])
    assert torch.equal(out[0, :, 1], corrupted[0]) and torch.equal(out[2], corrupted[2, :, None].expand(pos, k, d))
    assert torch.allclose(out[1, :, 0], x[1] + diff[1, :2].sum(0), atol=1e-6)
    assert torch.allclose(out[1, :, 2], corrupted[1] - diff[1, 5], atol=1e-6)
