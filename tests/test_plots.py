"""slmviz.plots: every figure builds from real traces, is labelled, and survives non-finite values.

Checks structure (titles, axis labels, token labels, GQA layout, masked cells, annotations) and that
numbers shown equal the library's own (`top_tokens`, `compare.kl_per_position`). Does not check how
figures look in a browser: tests/test_browser.py renders them in the app.
"""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import pytest

from slmviz.analysis.diff import kl_per_position
from slmviz.model.attention import kv_head_of
from slmviz.plots import trace as plots

PROMPT = "The cat sat on the mat. The cat sat on the"


@pytest.fixture(scope="module")
def faithful(model):
    return model.trace(PROMPT)


@pytest.fixture(scope="module")
def rope_broken(model, faithful):
    return model.trace(faithful.input_ids, variant="rope_interleaved")


@pytest.fixture(scope="module")
def overflowing(model, faithful):
    """Variant no_norm overflows fp32 a few layers in on SmolLM2 (massive activations, no norm)."""
    t = model.trace(faithful.input_ids, variant="no_norm")
    assert t.first_nonfinite() is not None, "expected no_norm to overflow on SmolLM2"
    return t


def _heatmaps(fig: go.Figure) -> list[go.Heatmap]:
    return [t for t in fig.data if isinstance(t, go.Heatmap)]


def _axis_titles(fig: go.Figure, axis: str) -> list[str]:
    keys = [k for k in fig.layout.to_plotly_json() if k.startswith(axis)]
    return [fig.layout[k].title.text for k in keys if fig.layout[k].title.text]


FIGURES = {
    "attention head": lambda f, o: plots.attention(f, 2, 4),
    "attention grid": lambda f, o: plots.attention(f, 2),
    "residual norms": lambda f, o: plots.residual_norms(f),
    "residual norms overlay": lambda f, o: plots.residual_norms(f, other=o, per_position=True, log_y=True),
    "logit lens": lambda f, o: plots.logit_lens(f),
    "kl per position": lambda f, o: plots.kl_per_position(f, o),
    "variant diff": lambda f, o: plots.variant_diff(f, o),
    "top tokens": lambda f, o: plots.top_tokens(o),
}
PAIRED = {"residual norms overlay", "kl per position", "variant diff", "top tokens"}


@pytest.mark.parametrize("kind", FIGURES)
def test_every_figure_has_a_title_a_subtitle_and_axis_labels(kind, faithful, rope_broken):
    fig = FIGURES[kind](faithful, rope_broken)
    assert fig.layout.title.text and fig.layout.title.subtitle.text
    assert _axis_titles(fig, "xaxis") and _axis_titles(fig, "yaxis"), f"{kind}: missing x or y axis title"


@pytest.mark.parametrize("kind", FIGURES)
def test_every_figure_plots_a_nonfinite_trace_and_says_where_it_stopped_being_finite(kind, faithful, overflowing):
    first = faithful if kind in PAIRED else overflowing  # paired figures compare faithful with the broken trace
    fig = FIGURES[kind](first, overflowing)
    notes = [a.text for a in fig.layout.annotations if "stopped being finite" in (a.text or "")]
    assert notes and overflowing.first_nonfinite() in notes[0]
    fig.to_json()  # serialisable: no inf reaches plotly


def test_attention_head_labels_both_axes_with_unique_tokens_and_blanks_the_future(faithful):
    fig = plots.attention(faithful, layer=0, head=3)
    (heat,) = _heatmaps(fig)
    labels = plots.token_labels(faithful.tokens)
    assert list(heat.x) == labels and list(heat.y) == labels
    assert len(set(labels)) == len(labels) and faithful.tokens.count(" cat") == 2  # repeated token, distinct labels
    z = np.asarray(heat.z, dtype=float)
    pattern = faithful["blocks.0.attn.hook_pattern"][3].double().numpy()
    upper = np.triu(np.ones_like(z, dtype=bool), k=1)
    assert np.isnan(z[upper]).all()
    np.testing.assert_allclose(z[~upper], pattern[~upper])
    assert "query" in heat.hovertemplate and "key" in heat.hovertemplate and "weight" in heat.hovertemplate


def test_attention_grid_has_one_row_per_kv_head_holding_the_query_heads_that_read_it(faithful):
    cfg = faithful.config
    fig = plots.attention(faithful, layer=5)
    assert len(_heatmaps(fig)) == cfg.n_heads
    for g in range(cfg.n_kv_heads):
        row = [t.name for t in fig.select_traces(row=g + 1)]
        assert row == [f"head {q}" for q in range(cfg.n_heads) if kv_head_of(q, cfg.n_rep) == g]
    assert len(row) == cfg.n_rep == 3  # SmolLM2-135M: 9 query heads, 3 KV heads


def test_attention_grid_follows_the_traces_own_gqa_mapping(model, faithful):
    tiled = model.trace(faithful.input_ids, variant="gqa_tile", names=lambda n: n.endswith("hook_pattern"))
    g = tiled.config.n_kv_heads
    fig = plots.attention(tiled, layer=0)
    assert [t.name for t in fig.select_traces(row=1)] == [f"head {q}" for q in range(0, tiled.config.n_heads, g)]


def test_attention_grid_layout_on_a_tiny_model_with_other_head_counts(tiny_model):
    t = tiny_model.trace("w3 w4 w5 w3 w4")
    cfg = t.config
    fig = plots.attention(t, layer=1)
    assert [len(list(fig.select_traces(row=r + 1))) for r in range(cfg.n_kv_heads)] == [cfg.n_rep] * cfg.n_kv_heads


def test_attention_without_causal_mask_shows_the_future(model, faithful):
    t = model.trace(faithful.input_ids, variant="no_causal_mask", names=lambda n: n.endswith("hook_pattern"))
    (heat,) = _heatmaps(plots.attention(t, layer=0, head=0))
    assert not np.isnan(np.asarray(heat.z, dtype=float)).any()


def test_attention_rejects_a_layer_or_head_out_of_range_with_the_valid_range(faithful):
    with pytest.raises(ValueError, match="0..29"):
        plots.attention(faithful, layer=30)
    with pytest.raises(ValueError, match="0..8"):
        plots.attention(faithful, layer=0, head=9)


def test_residual_norms_average_per_stage_or_draw_one_line_per_position(faithful):
    n = len(faithful.tokens)
    averaged = plots.residual_norms(faithful)
    assert len(averaged.data) == 3
    expected = faithful.residual_norms().query("stage == 'post'").groupby("layer")["norm"].mean().to_numpy()
    post = next(t for t in averaged.data if "resid_post" in t.name)
    np.testing.assert_allclose(post.y, expected, rtol=1e-6)
    per_pos = plots.residual_norms(faithful, stages=("pre", "post"), per_position=True)
    assert len(per_pos.data) == 2 * n
    hidden = plots.residual_norms(faithful, stages=("mid",), per_position=True, include_first=False, log_y=True)
    assert len(hidden.data) == n - 1 and not any(t.name.startswith("0: ") for t in hidden.data)
    assert hidden.layout.yaxis.type == "log"


def test_residual_norms_overlay_draws_the_other_trace_dashed(faithful, rope_broken):
    fig = plots.residual_norms(faithful, other=rope_broken, other_label="broken")
    assert len(fig.data) == 6
    assert {t.line.dash for t in fig.data if t.name.startswith("broken")} == {"dash"}


def test_residual_norms_rejects_unknown_stages(faithful):
    with pytest.raises(ValueError, match="stages"):
        plots.residual_norms(faithful, stages=("middle",))


def test_logit_lens_cells_hold_the_top_token_and_the_last_layer_is_the_models_output(faithful):
    fig = plots.logit_lens(faithful, k=5)
    (heat,) = _heatmaps(fig)
    z = np.asarray(heat.z, dtype=float)
    assert z.shape == (faithful.n_layers, len(faithful.tokens))
    top = faithful.top_tokens(k=5)
    assert heat.text[-1][-1] == plots.show_token(top["token"][0])
    assert math.isclose(z[-1, -1], top["prob"][0], rel_tol=1e-5)
    hover = heat.customdata[-1][-1]
    assert hover.count("<br>") == 4 and plots.show_token(top["token"][1]) in hover
    assert list(heat.x) == plots.token_labels(faithful.tokens)


def test_logit_lens_shows_only_the_last_positions_when_asked(faithful):
    (heat,) = _heatmaps(plots.logit_lens(faithful, max_positions=4))
    assert list(heat.x) == plots.token_labels(faithful.tokens)[-4:]
    full = _heatmaps(plots.logit_lens(faithful))[0]
    np.testing.assert_allclose(np.asarray(heat.z, float), np.asarray(full.z, float)[:, -4:], rtol=1e-6)


def test_kl_per_position_is_zero_against_itself_and_matches_compare(faithful, rope_broken):
    same = plots.kl_per_position(faithful, faithful)
    assert np.allclose(same.data[0].y, 0, atol=1e-6)
    fig = plots.kl_per_position(faithful, rope_broken)
    np.testing.assert_allclose(fig.data[0].y, kl_per_position(faithful.logits, rope_broken.logits).numpy(), rtol=1e-5)


def test_variant_diff_is_a_layers_by_positions_heatmap_of_relative_difference(faithful, rope_broken):
    (heat,) = _heatmaps(plots.variant_diff(faithful, rope_broken))
    values = np.asarray(heat.customdata, dtype=float)
    assert values.shape == (faithful.n_layers, len(faithful.tokens))
    assert values[:, 0].max() < 1e-5  # position 0 has no rotation to get wrong: RoPE is the identity there
    assert values[:, 1:].min() > 1e-3


def test_comparing_traces_of_different_prompts_is_refused(model, faithful):
    other = model.trace("Something else entirely", names=lambda n: "resid" in n)
    with pytest.raises(ValueError, match="same prompt"):
        plots.kl_per_position(faithful, other)


def test_next_token_table_matches_top_tokens_and_explains_nonfinite_logits(faithful, overflowing):
    table = plots.next_token_table(faithful, k=5)
    top = faithful.top_tokens(k=5)
    assert list(table["token_id"]) == list(top["token_id"])
    bad = plots.next_token_table(overflowing)
    assert "not finite" in bad["token"][0]


def test_tokens_html_escapes_tokens_and_makes_spaces_visible(model):
    t = model.trace("<b>bold</b> and a\nnewline", names=[])
    strip = plots.tokens_html(t)
    assert "<b>bold" not in strip and "␣and" in strip and "↵" in strip


def test_trace_html_embeds_plotly_once_per_session(faithful, monkeypatch):
    monkeypatch.setattr(plots, "_PLOTLYJS_SENT", False)
    first, second = plots.trace_html(faithful), plots.trace_html(faithful)
    assert len(first) > 1_000_000 > len(second)  # plotly.js inlined once, no CDN
    assert "src=\"http" not in first and "Next token" in second and "␣cat" in second
    assert faithful._repr_html_().startswith('<div class="slmviz-trace">')


def test_figures_are_built_without_running_the_model(faithful, monkeypatch):
    """Plots read the trace; only the logit lens touches the model's weights (not its forward)."""
    model = faithful._model

    def refuse(*args, **kwargs):
        raise AssertionError("plots ran the model")

    monkeypatch.setattr(model.decoder, "forward", refuse)
    for build in FIGURES.values():
        build(faithful, faithful)
    assert isinstance(plots.top_tokens(faithful), go.Figure)


def test_spread_columns_gives_the_fullest_position_most_width_and_each_node_its_own_room():
    """A column is as wide as its widest cell (an empty one keeps its least width), a cell sits centred in its
    column, its nodes side by side in the order given: the Graph tab's drawing and its page twin rely on it."""
    from slmviz.plots.attribution import spread_columns

    x, edges = spread_columns([2, 2, 2, 0, 2], [1.0, 1.0, 1.0, 1.0, 3.0], [10, 10, 30, 10, 10], [5, 5, 5], 4)
    assert edges == [0, 10, 15, 65]  # position 2's row 1 needs 50, position 1 (no node) keeps 5
    assert x == [17, 27, 37, 2, 37]  # row 1's cell fills its column; row 3's one node sits at its centre
