"""Attribution patching: the estimate is the directional derivative of the metric (checked by finite differences
on a tiny model), exactly 0 where the two runs agree, and shaped like the exact sweep on every site.

Does not cover: how good the estimate is on a real model (bench/perf/patching.py measures its correlation with
the exact sweep on SmolLM2 and the README records it).
"""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.hooks import build_context
from slmviz.interventions.attribution import exact_correlation
from slmviz.interventions.patching import patch
from slmviz.interventions.sites import SITES, site_hook_name

CLEAN = [3, 10, 11, 12, 13, 14, 15, 16]
CORRUPTED = [3, 10, 11, 12, 40, 14, 15, 16]
FIRST_DIFF = 4
ANSWER, WRONG = 20, 21


@pytest.fixture(scope="module")
def m(tiny_model):
    return tiny_model


def _metric_with_cell_moved(m, site, layer, cell, t):
    """The metric on the corrupted run with one cell moved a fraction t of the way to its clean value."""
    s = SITES[site]
    name = site_hook_name(s, layer)
    clean = m.trace(CLEAN, names=[name])[name].double()
    index = s.index(cell)

    def move(x, _):
        out = x.clone()
        out[index] = (x[index].double() + t * (clean[index] - x[index].double())).to(x.dtype)
        return out

    logits = m.decoder.forward(torch.tensor(CORRUPTED), build_context(m.hook_names, [], {name: move}),
                               slmviz.Variant())
    return float(logits[-1, ANSWER].double() - logits[-1, WRONG].double())


@pytest.mark.parametrize("site, cell", [("resid_pre", (5,)), ("resid_mid", (FIRST_DIFF,)), ("z", (6, 1)),
                                        ("k", (FIRST_DIFF, 1)), ("v", (7, 0)), ("q", (7, 2)),
                                        ("pattern", (7, 3)), ("heads", (2,)), ("mlp_out", (7,))])
def test_the_estimate_matches_a_finite_difference(m, site, cell):
    r = patch(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, site=site, model=m, method="attribution")
    for layer in range(m.cfg.n_layers):
        estimate = float(r.values[(layer, *cell)]) - r.corrupted
        eps = 1e-2
        slope = (_metric_with_cell_moved(m, site, layer, cell, eps)
                 - _metric_with_cell_moved(m, site, layer, cell, -eps)) / (2 * eps)
        assert estimate == pytest.approx(slope, rel=2e-2, abs=5e-5), (site, layer, cell)


def test_the_estimate_is_exactly_zero_where_clean_and_corrupted_activations_are_equal(m):
    for site in ("resid_pre", "resid_post", "z", "k", "v", "pattern"):
        r = patch(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, site=site, model=m, method="attribution")
        before = r.values[:, :FIRST_DIFF]
        assert torch.equal(before, torch.full_like(before, r.corrupted)), site
        assert (r.values[:, FIRST_DIFF:] != r.corrupted).any(), site


def test_every_site_has_the_shape_of_the_exact_sweep_and_the_same_unpatched_metrics(m):
    for site in SITES:
        for direction in ("denoise", "noise"):
            kw = dict(answer=ANSWER, wrong=WRONG, site=site, model=m, direction=direction)
            est, exact = patch(CLEAN, CORRUPTED, method="attribution", **kw), patch(CLEAN, CORRUPTED, **kw)
            assert est.values.shape == exact.values.shape and est.method == "attribution"
            assert est.clean == pytest.approx(exact.clean, abs=1e-6)
            assert est.corrupted == pytest.approx(exact.corrupted, abs=1e-6)
            r = exact_correlation(est, exact)
            assert est.correlation == r and -1 <= r <= 1


def test_the_plot_says_it_is_an_estimate_and_gives_the_correlation(m):
    kw = dict(answer=ANSWER, wrong=WRONG, site="z", model=m)
    est = patch(CLEAN, CORRUPTED, method="attribution", **kw)
    exact_correlation(est, patch(CLEAN, CORRUPTED, **kw))
    subtitle = est.plot().layout.title.subtitle.text
    assert "estimate" in subtitle and f"r = {est.correlation:.2f}" in subtitle


def test_a_metric_that_returns_a_float_is_refused(m):
    with pytest.raises(ValueError, match="must return a tensor"):
        patch(CLEAN, CORRUPTED, metric=lambda logits: logits[-1, 3].item(), model=m, method="attribution")
