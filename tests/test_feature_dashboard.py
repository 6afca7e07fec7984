"""Feature dashboards (slmviz.features.dashboard, slmviz.plots.features) and the row rule in SAE feature scans, on a
tiny random model and a small random SAE. The app's use of them: tests/test_features_app.py."""

from __future__ import annotations

import pytest
import torch

import slmviz
from slmviz.errors import SAEError
from slmviz.features.dashboard import acts_hook, feature_card, firing_stats, search_features, top_features
from slmviz.features.sae import SAE

DOCS = [" ".join(f"w{(i * 7 + j * 3) % 40 + 2}" for j in range(6 + i % 5)) for i in range(12)]


@pytest.fixture(scope="module")
def sae(tiny_model):
    return SAE.random(tiny_model.cfg.d_model, 32, seed=3, hook_name="blocks.0.hook_resid_post")


@pytest.fixture(scope="module")
def scanned(tiny_model, sae):
    return slmviz.scan(DOCS, hooks=[acts_hook(sae)], top_k=5, model=tiny_model, saes=[sae], window=4,
                       progress=False)


class NoRule(SAE):
    """The SAE without shown_rows: scans see every row (duck typing: scans look the method up)."""

    shown_rows = None


class DropAll(SAE):
    def shown_rows(self, x, first, *others):
        return torch.zeros(x.shape[0], dtype=torch.bool)


def _as(cls, sae):
    other = SAE.random(sae.d_in, sae.d_sae, seed=3, hook_name=sae.hook_name)
    other.__class__ = cls
    return other


def test_a_feature_scan_zeroes_the_rows_the_sae_drops(tiny_model, sae, scanned):
    hook = acts_hook(sae)
    assert scanned.info["sae_rows"] == [hook]
    top = scanned.all_top_examples()
    assert not (top[top.activation > 0].position % 4 == 0).any()  # no window's first position (window=4)
    plain = slmviz.scan(DOCS, hooks=[hook], top_k=5, model=tiny_model, saes=[_as(NoRule, sae)], window=4,
                        progress=False)
    assert plain.info["sae_rows"] == []
    top = plain.all_top_examples()
    assert (top[top.activation > 0].position % 4 == 0).any()  # the rule is what keeps them out
    nothing = slmviz.scan(DOCS, hooks=[hook], top_k=5, model=tiny_model, saes=[_as(DropAll, sae)], window=4,
                          progress=False)
    assert float(nothing.max(hook).abs().max()) == 0.0 and nothing.stats[hook].n == scanned.stats[hook].n


def test_scans_of_ordinary_hooks_are_unchanged_by_the_rule(tiny_model, sae):
    hook = "blocks.1.hook_resid_post"
    with_sae = slmviz.scan(DOCS, hooks=[hook], top_k=3, model=tiny_model, saes=[sae], window=4, progress=False)
    plain = slmviz.scan(DOCS, hooks=[hook], top_k=3, model=tiny_model, window=4, progress=False)
    torch.testing.assert_close(with_sae.mean(hook), plain.mean(hook))
    torch.testing.assert_close(with_sae.max(hook), plain.max(hook))
    assert with_sae.info["sae_rows"] == []


def test_a_feature_card_holds_the_scans_numbers_and_draws_them(tiny_model, sae, scanned):
    hook = acts_hook(sae)
    feature = int(scanned.max(hook).argmax())
    card = feature_card(sae, feature, scan=scanned, model=tiny_model, docs=DOCS, name="random")
    stats = firing_stats(scanned, sae, feature)
    assert card.stats["max"] == stats["max"] == float(scanned.max(hook)[feature]) > 0
    assert sum(stats["bands"]) == stats["firing"] and 0 < stats["density"] <= 1
    assert (card.contexts.activation > 0).all() and len(card.contexts) >= 1
    assert card.nearest.feature.tolist() == sae.nearest(feature, 10).feature.tolist()
    html = card._repr_html_()
    assert html == card.html() and f"Feature {feature} of random" in html
    assert html.count('class="slmviz-feature-context"') == len(card.contexts)
    assert f"{card.effects.effect.iloc[0]:+.3g}" in html and "quantile band" in html
    bare = feature_card(sae, feature)  # no scan, no model: the parts that need them are left out, said why
    assert bare.stats is None and "needs the model" in bare.no_effects and "No logit effects" in bare.html()


def test_bad_input_to_a_card_is_a_clear_error(tiny_model, sae, scanned):
    with pytest.raises(SAEError, match="out of range"):
        feature_card(sae, sae.d_sae, scan=scanned)
    other = SAE.random(sae.d_in, 8, hook_name="blocks.1.hook_resid_post")
    with pytest.raises(ValueError, match="scan has no"):
        feature_card(other, 0, scan=scanned)


def test_top_features_per_token_mark_the_dropped_rows(tiny_model, sae):
    trace = tiny_model.trace("w3 w5 w7 w9 w11", saes=[sae])
    table = top_features(trace, sae, k=3)
    n = len(trace.tokens)
    assert len(table) == n * 3 and list(table.columns) == ["position", "token", "rank", "feature", "activation",
                                                            "kept"]
    acts = trace[acts_hook(sae)]
    at_2 = table[table.position == 2]
    assert at_2.feature.tolist() == acts[2].topk(3).indices.tolist()
    assert table.groupby("position").kept.first().tolist() == [False] + [True] * (n - 1)
    unspliced = top_features(tiny_model.trace("w3 w5 w7 w9 w11"), sae, k=3)  # encoded from the SAE's input
    torch.testing.assert_close(torch.tensor(unspliced.activation.values), torch.tensor(table.activation.values))


def test_search_features_by_promoted_token_and_by_firing_contexts(tiny_model, sae, scanned):
    promoting = search_features(sae, "w5", model=tiny_model, k=4)
    token = int(tiny_model.encode("w5")[0])
    tables = [sae.logit_effects(f, k=tiny_model.cfg.vocab_size, model=tiny_model) for f in promoting.feature]
    effects = torch.tensor([float(t[t.token_id == token].effect.iloc[0]) for t in tables], dtype=torch.float64)
    torch.testing.assert_close(effects, torch.tensor(promoting.effect.values), rtol=1e-4, atol=1e-5)
    assert promoting.effect.is_monotonic_decreasing
    with pytest.raises(ValueError, match="is 2 tokens"):
        search_features(sae, "w5 w6", model=tiny_model)
    top = scanned.all_top_examples()
    word = top[top.activation > 0].token.iloc[0]
    firing = search_features(sae, word, by="fires", scan=scanned)
    assert not firing.empty and (firing.contexts >= 1).all()
    with pytest.raises(ValueError, match="by must be one of"):
        search_features(sae, "w5", by="likes", model=tiny_model)
    with pytest.raises(ValueError, match="pass scan="):
        search_features(sae, "w5", by="fires")
