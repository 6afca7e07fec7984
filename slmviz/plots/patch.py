"""Plotly figures of interventions: a patching sweep's heatmap and direct logit attribution's bars.

A PatchResult or a logit-attribution DataFrame in, a Figure out; nothing here runs the model or imports the
modules that produce these results (they call us through `.plot()`), so the flow stays one-way.
Every heatmap is diverging and centred at 0 (white = no effect), layers on the y axis, tokens (or heads) on x.
Each cell carries customdata [layer, position, head] (-1 where unused), which the app reads on click.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .trace import show_token, title_layout

DIVERGING = "RdBu"  # red = pushes towards the corrupted answer, blue = restores the clean one
ATTRIBUTION_CAVEAT = ("A first-order (gradient) estimate, not a patched run: good for small activations such as "
                      "one head's z, poor for the residual stream, where a patch is large and the model far from "
                      "linear.")
# Pearson r of attribution patching with the exact sweep, SmolLM2-135M-Instruct, the 12-token IOI pair of
# bench/perf/patching.py (`--groups attribution`), recorded in bench/results/notes.md. Shown when a result has no own r.
MEASURED_CORRELATION = {"resid_pre": 0.58, "resid_mid": 0.59, "attn_out": 0.99, "mlp_out": 0.29,
                        "z": 0.99, "q": 0.83, "k": 0.92, "v": 1.00, "pattern": 0.99, "heads": 0.99}


def position_labels(clean: list[str], corrupted: list[str]) -> list[str]:
    """'p: token' per position; where the prompts differ, 'p: clean ⇄ corrupted'."""
    return [f"{p}: {show_token(a)}" + (f" ⇄ {show_token(b)}" if a != b else "")
            for p, (a, b) in enumerate(zip(clean, corrupted, strict=True))]


def patch_heatmap(result: Any, normalized: bool = True, head: int | None = None) -> go.Figure:
    """The sweep as layers x positions (one panel per head for z/q/pattern/k/v; layers x heads for `heads`).

    normalized: colour by (value - corrupted) / (clean - corrupted), so 1 = the clean metric; else raw values.
    head: draw one head's panel only. Cells not computed yet (a sweep in progress) are blank.
    """
    values = result.normalized if normalized and result.clean != result.corrupted else result.values
    normalized = normalized and result.clean != result.corrupted
    z = values.detach().double().numpy()
    dims = result.dims
    clean, corrupted = (result.source_tokens, result.tokens) if result.direction == "denoise" else \
        (result.tokens, result.source_tokens)
    labels = position_labels(clean, corrupted)
    n_layers = z.shape[0]
    finite = z[np.isfinite(z)]
    bound = float(np.abs(finite).max()) if finite.size else 1.0
    bound = bound if bound > 0 else 1.0
    colour = {"colorscale": DIVERGING, "cmid": 0.0, "cmin": -bound, "cmax": bound,
              "colorbar": {"title": "normalized" if normalized else "metric"}}
    what = "normalized metric" if normalized else result.metric_name
    layers = list(range(n_layers))
    if dims == ("layer", "position"):
        fig = go.Figure(_heatmap(z, labels, layers, _cells(z.shape, None), what))
        x_title = "position: token (clean ⇄ corrupted where they differ)"
    elif dims == ("layer", "head"):
        heads = [f"head {h}" for h in range(z.shape[1])]
        custom = np.stack(np.meshgrid(layers, [-1], range(z.shape[1]), indexing="ij"), -1)[:, 0]  # [L, h, 3]
        fig = go.Figure(_heatmap(z, heads, layers, custom, what))
        x_title = "head (z patched at every position)"
    else:
        n_heads = z.shape[2]
        kind = "KV head" if dims[2] == "kv_head" else "head"
        shown = [head] if head is not None else list(range(n_heads))
        if head is not None and not 0 <= head < n_heads:
            raise ValueError(f"head must be in 0..{n_heads - 1}, got {head}")
        cols = min(3, len(shown))
        rows = math.ceil(len(shown) / cols)
        fig = make_subplots(rows=rows, cols=cols, shared_xaxes=True, shared_yaxes=True,
                            subplot_titles=[f"{kind} {h}" for h in shown], horizontal_spacing=0.03,
                            vertical_spacing=0.08)
        for i, h in enumerate(shown):
            fig.add_trace(_heatmap(z[:, :, h], labels, layers, _cells(z.shape[:2], h), what, f"{kind} {h}"),
                          row=i // cols + 1, col=i % cols + 1)
        x_title = None
        fig.update_xaxes(tickfont={"size": 8})
    fig.update_layout(coloraxis=colour)
    title = (f"{'Attribution' if result.method == 'attribution' else 'Activation'} patching: {result.site} "
             f"({'clean → corrupted' if result.direction == 'denoise' else 'corrupted → clean'})")
    subtitle = (f"Metric {result.metric_name}: clean {result.clean:.3g}, corrupted {result.corrupted:.3g}. "
                + ("Colour 1 = patching this cell alone restores the clean metric, 0 = no effect. "
                   if normalized and result.direction == "denoise" else
                   "Colour 1 = no effect, 0 = patching this cell alone destroys the clean metric. "
                   if normalized else ""))
    if result.method == "attribution":
        measured = MEASURED_CORRELATION.get(result.site)
        subtitle += ATTRIBUTION_CAVEAT + (
            f" Correlation with the exact sweep: r = {result.correlation:.2f}." if result.correlation is not None
            else f" Measured correlation with the exact sweep for {result.site} on SmolLM2: r = {measured:.2f}."
            if measured is not None else "")
    if not result.complete:
        subtitle += f" Computing: {result.done}/{result.total} cells."
    panel_rows = 1 if len(fig.data) == 1 else math.ceil(len(fig.data) / 3)
    height = 200 + panel_rows * max(140, 14 * n_layers)
    layout, top = title_layout(title, subtitle)
    fig.update_layout(
        title=layout, template="plotly_white", height=int(min(1600, max(420, height))) + max(0, top - 120),
        margin={"t": max(120, top), "l": 70, "r": 30, "b": 110}, font={"size": 12},
    )
    fig.update_xaxes(tickangle=-60)
    if x_title:
        fig.update_xaxes(title_text=x_title)
    if len(fig.data) > 1:
        fig.update_yaxes(title_text="layer", col=1)
    else:
        fig.update_yaxes(title_text="layer")
    return fig


def _cells(shape: tuple[int, ...], head: int | None) -> np.ndarray:
    """customdata [layer, position, head] for every cell of a [layers, positions] panel."""
    n_layers, n_pos = shape[:2]
    layer, pos = np.meshgrid(range(n_layers), range(n_pos), indexing="ij")
    return np.stack([layer, pos, np.full_like(layer, -1 if head is None else head)], -1)


def _heatmap(z: np.ndarray, x: list[str], y: list[int], custom: np.ndarray, what: str,
             name: str = "") -> go.Heatmap:
    return go.Heatmap(
        z=np.where(np.isfinite(z), z, np.nan), x=x, y=y, customdata=custom, coloraxis="coloraxis",
        hoverongaps=False, name=name, xgap=1, ygap=1,
        hovertemplate=f"{name + '<br>' if name else ''}layer %{{y}}<br>%{{x}}<br>{what}: %{{z:.3f}}<extra></extra>",
    )


def logit_attribution_bars(frame: pd.DataFrame, top: int = 20) -> go.Figure:
    """Direct logit attribution as bars: per layer (attention and MLP side by side), or the `top` heads/neurons.

    The remainder row (embedding and biases) is drawn too, so the bars add up to the logit difference.
    """
    metric = frame.attrs.get("metric", "logit difference")
    total = frame.attrs.get("logit_diff")
    fine = frame[frame["kind"].isin(["head", "neuron"])]
    fig = go.Figure()
    if fine.empty:
        for kind, color in (("attn", "#1f77b4"), ("mlp", "#ff7f0e")):
            part = frame[frame["kind"] == kind]
            fig.add_trace(go.Bar(x=[f"L{int(v)}" for v in part["layer"]], y=part["attribution"], name=kind,
                                 marker_color=color,
                                 hovertemplate=f"%{{x}} {kind}<br>%{{y:.3f}}<extra></extra>"))
        x_title = "layer"
    else:
        kind = fine["kind"].iloc[0]
        picked = fine.reindex(fine["attribution"].abs().sort_values(ascending=False).index).head(top)
        fig.add_trace(go.Bar(x=picked["component"], y=picked["attribution"], name=f"top {len(picked)} {kind}s",
                             marker_color=np.where(picked["attribution"] >= 0, "#2166ac", "#b2182b"),
                             hovertemplate="%{x}<br>%{y:.3f}<extra></extra>"))
        x_title = f"{kind} (the {len(picked)} largest by |attribution|)"
    rest = frame[frame["kind"] == "remainder"]
    fig.add_trace(go.Bar(x=["remainder"], y=rest["attribution"], name="embedding + biases", marker_color="#999999",
                         hovertemplate="embedding + biases<br>%{y:.3f}<extra></extra>"))
    subtitle = (f"Each component's write into the residual stream, read through the final norm (scale frozen) "
                f"and the unembedding: its share of {metric}"
                + (f" = {total:.3f} (all rows sum to it)." if total is not None else "."))
    layout, top = title_layout("Direct logit attribution", subtitle)
    fig.update_layout(
        title=layout, template="plotly_white", height=420 + max(0, top - 110), barmode="group",
        margin={"t": max(110, top), "l": 70, "r": 30, "b": 90},
        xaxis_title=x_title, yaxis_title="logit difference contributed", font={"size": 12},
    )
    fig.update_xaxes(tickangle=-60)
    return fig


def feature_patch_bars(result: Any, n: int = 20) -> go.Figure:
    """A feature sweep (patch(..., site="sae")) as horizontal bars: the n cells (SAE hook, feature, position) of
    largest |attribution|, each bar the estimated change of the metric when that one feature's activation at that
    position takes the other prompt's value, and a diamond at the exact patched run's change where it was run.

    Changes are in normalized units (1 = the whole clean - corrupted gap) when the two runs differ, raw otherwise;
    red moves the metric towards the corrupted run, blue towards the clean one, as in the heatmaps.
    """
    top = result.top(n)
    span = result.clean - result.corrupted
    scale = span if span != 0 else 1.0
    unit = "normalized change (1 = the clean - corrupted gap)" if span != 0 else f"change of {result.metric_name}"
    labels = [f"{h.removeprefix('blocks.')} f{f} @ {p}: {show_token(result.tokens[p])}"
              for h, f, p in zip(top["hook"], top["feature"], top["position"], strict=True)]
    estimate = ((top["value"] - result.target_metric) / scale).to_numpy()
    exact = ((top["exact"] - result.target_metric) / scale).to_numpy()
    fig = go.Figure(go.Bar(
        y=labels, x=estimate, orientation="h", name="attribution (Δf · ∂metric/∂f)",
        marker_color=np.where(estimate >= 0, "#2166ac", "#b2182b"),
        customdata=np.stack([top["source_act"], top["target_act"]], -1) if len(top) else None,
        hovertemplate="%{y}<br>estimate %{x:.3f}<br>f source %{customdata[0]:.3g}, target %{customdata[1]:.3g}"
                      "<extra></extra>"))
    ran = np.isfinite(exact)
    if ran.any():
        fig.add_trace(go.Scatter(y=np.array(labels)[ran], x=exact[ran], mode="markers", name="exact patched run",
                                 marker={"symbol": "diamond", "size": 10, "color": "#222222"},
                                 hovertemplate="%{y}<br>exact %{x:.3f}<extra></extra>"))
    into = "corrupted → clean" if result.direction == "denoise" else "clean → corrupted"
    subtitle = (f"{len(result.cells)} cells (every feature active in either run, at every position); the {len(top)} "
                f"largest by |attribution|. Each sets one feature at one position to the other run's value ({into}), "
                f"error terms on.")
    layout, margin_top = title_layout("Feature patching: " + result.metric_name, subtitle)
    fig.update_layout(
        title=layout, template="plotly_white", height=max(320, 26 * len(top) + 140) + max(0, margin_top - 110),
        margin={"t": max(110, margin_top), "l": 260, "r": 30, "b": 60},
        xaxis_title=unit, yaxis={"autorange": "reversed"}, font={"size": 12},
        legend={"orientation": "h", "y": -0.12},
    )
    return fig
