"""Direct logit attribution: the rows (with the remainder) sum to the model's logit difference, exactly, on
SmolLM2 and on a tiny model of every architecture; the finer splits add up to the coarser ones.

Does not cover: whether attribution is a good explanation (it is a decomposition of one run, not a causal
test; activation patching is that), nor Gemma-family post-norms unless a tiny Gemma config is available.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ARCHS

import slmviz
from slmviz.analysis.logit_attribution import logit_attribution

REL = 1e-4


def _check_sums(trace, answer, wrong, by):
    frame = logit_attribution(trace, answer, wrong, by=by)
    total, expected = frame["attribution"].sum(), frame.attrs["logit_diff"]
    assert abs(total - expected) <= REL * max(abs(expected), 1.0), (by, total, expected)
    assert (frame["kind"] == "remainder").sum() == 1
    return frame


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_rows_sum_to_the_logit_difference_on_every_tiny_architecture(tiny_dirs, arch):
    m = slmviz.load(tiny_dirs[arch])
    t = m.trace([3, 10, 11, 12, 13, 14, 15, 16])
    for by in ("layer", "head", "neuron"):
        _check_sums(t, 20, 21, by)


def test_head_rows_add_up_to_the_attention_row_and_neurons_to_the_mlp_row(tiny_model):
    t = tiny_model.trace([3, 10, 11, 12, 13, 14, 15, 16])
    layer = _check_sums(t, 20, 21, "layer").set_index("component")["attribution"]
    heads = _check_sums(t, 20, 21, "head")
    neurons = _check_sums(t, 20, 21, "neuron")
    for L in range(tiny_model.cfg.n_layers):
        assert heads[heads["layer"] == L].query("kind == 'head'")["attribution"].sum() == pytest.approx(
            layer[f"L{L} attn"], abs=1e-6)  # fp32 attn_out vs z · W_o in fp64
        assert neurons[neurons["layer"] == L].query("kind == 'neuron'")["attribution"].sum() == pytest.approx(
            layer[f"L{L} mlp"], abs=1e-6)
    assert len(heads) == tiny_model.cfg.n_layers * (tiny_model.cfg.n_heads + 1) + 1


def test_biases_land_in_the_remainder_row(tiny_dirs):
    m = slmviz.load(tiny_dirs["llama_bias"])
    t = m.trace([3, 10, 11, 12, 13])
    frame = _check_sums(t, 20, 21, "head")
    embed_only = logit_attribution(m.trace([3, 10, 11, 12, 13]), 20, 21, "layer")
    assert frame.set_index("kind").loc["remainder", "attribution"] != pytest.approx(
        embed_only.set_index("component")["attribution"].iloc[0])


@pytest.mark.slow
def test_rows_sum_to_the_logit_difference_on_smollm2(model):
    t = model.trace("When Mary and John went to the store, John gave a drink to")
    for by in ("layer", "head", "neuron"):
        frame = _check_sums(t, " Mary", " John", by)
    assert frame.attrs["logit_diff"] > 0  # SmolLM2 prefers the indirect object
    assert frame.attrs["metric"] == "logit(' Mary') - logit(' John')"
    same = t.logit_attribution(" Mary", " John", by="neuron")  # the Trace method is the same call
    assert same.equals(frame)


def test_a_single_answer_without_wrong_attributes_its_logit(tiny_model):
    t = tiny_model.trace([3, 10, 11, 12])
    frame = _check_sums(t, 20, None, "layer")
    assert frame.attrs["logit_diff"] == pytest.approx(float(t.logits[-1, 20]), rel=1e-6)


def test_bad_input_is_a_clear_error(tiny_model):
    t = tiny_model.trace([3, 10, 11, 12])
    with pytest.raises(ValueError, match="by must be one of"):
        logit_attribution(t, 20, 21, by="block")
    with pytest.raises(ValueError, match="is 2 tokens"):
        logit_attribution(t, "w5 w6", 21)
    with pytest.raises(KeyError, match="lacks"):
        logit_attribution(tiny_model.trace([3, 10, 11, 12], names=[]), 20, 21)
    with pytest.raises(ValueError, match="post_norm"):
        logit_attribution(tiny_model.trace([3, 10, 11, 12], variant="post_norm"), 20, 21)


def test_the_last_position_is_the_default_and_others_can_be_read(tiny_model):
    t = tiny_model.trace([3, 10, 11, 12, 13])
    first = logit_attribution(t, 20, 21, position=1)
    assert first.attrs["position"] == 1
    assert first["attribution"].sum() == pytest.approx(float(t.logits[1, 20] - t.logits[1, 21]), rel=REL, abs=1e-6)
    assert torch.isfinite(torch.tensor(first["attribution"].to_numpy())).all()


def test_the_bar_charts_add_up_to_the_logit_difference(tiny_model):
    from slmviz.plots.patch import logit_attribution_bars

    t = tiny_model.trace([3, 10, 11, 12, 13])
    frame = t.logit_attribution(20, 21)
    fig = logit_attribution_bars(frame)
    assert sum(sum(bar.y) for bar in fig.data) == pytest.approx(frame.attrs["logit_diff"], rel=REL, abs=1e-6)
    by_head = logit_attribution_bars(t.logit_attribution(20, 21, by="head"), top=3)
    assert len(by_head.data[0].x) == 3 and by_head.data[-1].x == ("remainder",)


@pytest.mark.slow
def test_rows_sum_to_the_logit_difference_on_gemma_3_with_its_post_norms():
    """Gemma 3 270M: sandwich norms with (1 + w) weights; the split into heads and neurons freezes the post-norm
    scales inside each branch too. (Loads the bundled Gemma, prepared by the other slow tests.)"""
    gemma = slmviz.load("gemma-3-270m")
    t = gemma.trace("When Mary and John went to the store, John gave a drink to")
    for by in ("layer", "head", "neuron"):
        _check_sums(t, " Mary", " John", by)
