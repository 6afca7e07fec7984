"""Plotly figures shared by the notebook and the app: a Trace (or two) in, a Figure out.

Plots never run the model. The one exception is the logit lens, which reads the residual stream
through the final norm and unembedding with `trace.logit_lens()` (it needs the trace's model).

Conventions every figure follows:
- a title, a subtitle saying how to read it, and labelled axes;
- tokens are labelled "position: token" (`token_labels`), so repeated tokens stay distinct on
  plotly's categorical axes, with spaces and newlines made visible (`show_token`);
- values that stopped being finite (e.g. variant `no_norm` overflowing fp32) are left blank and an
  annotation names the first hook that held them (`Trace.first_nonfinite`), never an exception.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..analysis.diff import kl_per_position as _kl_per_position
from ..analysis.diff import trace_diff
from ..hooks import RESIDUAL_STAGES, layer_hook_name
from ..model.attention import attention_mask, kv_head_index

if TYPE_CHECKING:
    from ..trace import Trace

STAGE_NAMES = {
    "pre": "resid_pre (block input)",
    "mid": "resid_mid (after attention)",
    "post": "resid_post (block output)",
}
STAGE_COLORS = {"pre": "#1f77b4", "mid": "#ff7f0e", "post": "#2ca02c"}
STAGE_SYMBOLS = {"pre": "circle", "mid": "diamond", "post": "square"}
RUN_DASHES = ("solid", "dash")
NEXT_TOKEN_COLUMNS = ("rank", "token", "token_id", "prob")
# Figure config for plotly.js (notebook and app): keep the modebar's "download as PNG" button.
FIGURE_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}

_VISIBLE = str.maketrans({" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍", "<": "‹", ">": "›"})


# --- labels --------------------------------------------------------------------------------------
def show_token(token: str) -> str:
    """A token as a label: spaces, tabs and newlines made visible; < > swapped for ‹ › so plotly's
    label markup (which reads <b>, <br>, ...) leaves special tokens like <|im_start|> alone."""
    return token.translate(_VISIBLE) or "∅"


def plotly_text(text: str) -> str:
    """Text for plotly's label markup, escaped once: & < > as entities, which plotly reads back; quotes left as they
    are (plotly shows &quot; and &#x27; literally, so a token `␣"` read `␣&quot;` in the logit lens)."""
    return html.escape(text, quote=False)


def token_labels(tokens: list[str]) -> list[str]:
    """'position: token' labels, unique even when a token repeats (plotly merges equal categories)."""
    return [f"{i}: {show_token(t)}" for i, t in enumerate(tokens)]


def run_label(trace: Trace) -> str:
    """The variant's short name: 'faithful', a preset name, or its changed fields."""
    return trace.variant.label() or "faithful"


def _finite(values: torch.Tensor | np.ndarray) -> np.ndarray:
    """float64 array with NaN wherever the value is NaN or ±inf (plotly draws NaN as a gap)."""
    a = values.detach().cpu().double().numpy() if isinstance(values, torch.Tensor) else np.asarray(values, dtype=float)
    return np.where(np.isfinite(a), a, np.nan)


TITLE_CHARS, SUBTITLE_CHARS = 60, 80  # a line's characters that fit a half-width plot (a Row of two in the app)


def wrap_line(text: str, chars: int) -> tuple[str, int]:
    """`text` broken into lines of at most `chars` characters at spaces (plotly does not wrap a title: a long one
    is clipped at the figure's edge), joined by <br>; and how many lines. An existing <br> starts a line."""
    lines: list[str] = []
    for part in text.split("<br>"):
        line = ""
        for word in part.split(" "):
            if line and len(line) + 1 + len(word) > chars:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return "<br>".join(lines), len(lines)


SUBPLOT_TITLE_PX = 24  # a subplot title's line (plotly's 16 px font) above each panel of a grid


def title_layout(title: str, subtitle: str = "", title_chars: int = TITLE_CHARS,
                 subtitle_chars: int = SUBTITLE_CHARS) -> tuple[dict[str, Any], int]:
    """(plotly's title layout, the top margin it needs): the title and subtitle wrapped to fit a half-width plot, so
    neither is ever clipped; the margin grows with their lines."""
    text, n_title = wrap_line(title, title_chars)
    sub_text, n_sub = wrap_line(subtitle, subtitle_chars) if subtitle else ("", 0)
    layout = {"text": text, "x": 0.0, "xanchor": "left"}
    if subtitle:
        layout["subtitle"] = {"text": sub_text}
    return layout, 40 + 24 * n_title + 17 * n_sub


def _style(fig: go.Figure, title: str, subtitle: str, x_title: str | None, y_title: str | None,
           height: int, extra_top: int = 0) -> go.Figure:
    """`extra_top`: pixels of the top margin kept free below the subtitle (a grid's subplot titles sit there)."""
    layout, top = title_layout(title, subtitle)
    if extra_top:  # the title at the figure's top, held inside it by its pad (plotly's own place follows the plot down)
        top += extra_top
        layout.update(yref="container", y=1.0, yanchor="top", pad={"t": 14})
    fig.update_layout(
        title=layout, template="plotly_white", height=height + max(0, top - 110),
        margin={"t": max(110, top), "l": 80, "r": 30, "b": 70},
        hoverlabel={"align": "left"}, font={"size": 12},
    )
    if x_title is not None:
        fig.update_xaxes(title_text=x_title)
    if y_title is not None:
        fig.update_yaxes(title_text=y_title)
    return fig




def _note_nonfinite(fig: go.Figure, *traces: Trace) -> None:
    """Annotate the figure with the first hook that stopped being finite, per trace that has one."""
    notes = []
    for t in traces:
        bad = t.first_nonfinite()
        if bad is not None:
            prefix = f"{run_label(t)}: " if len(traces) > 1 or not t.variant.is_faithful else ""
            notes.append(f"⚠ {prefix}values stopped being finite at {bad} (fp32 overflow); they are left blank")
    if notes:
        fig.add_annotation(
            text="<br>".join(notes), xref="paper", yref="paper", x=0.0, y=1.0, xanchor="left", yanchor="bottom",
            showarrow=False, align="left", font={"color": "#b00020", "size": 12},
            bgcolor="rgba(255,240,240,0.9)", bordercolor="#b00020", borderwidth=1,
        )
        fig.update_layout(margin={"t": 110 + 18 * len(notes)})


def _check_layer(trace: Trace, layer: int) -> None:
    if not 0 <= layer < trace.n_layers:
        raise ValueError(f"layer must be in 0..{trace.n_layers - 1}, got {layer}")


def _check_same_prompt(reference: Trace, other: Trace) -> None:
    if not torch.equal(reference.input_ids, other.input_ids):
        raise ValueError("The two traces must be of the same prompt (same token ids) to be compared")


# --- layer kinds (Gemma 3: sliding-window and global layers) ---------------------------------------
def _layer_kinds(trace: Trace) -> list[str] | None:
    """ "sliding" / "global" per layer where the model has both kinds, else None (nothing to label)."""
    cfg = trace.config
    if not getattr(cfg, "mixes_layer_types", False):
        return None
    return ["sliding" if cfg.layer_type(i) == "sliding_attention" else "global" for i in range(trace.n_layers)]


def _label_layer_axis(fig: go.Figure, trace: Trace, axis: str) -> str:
    """Tick "5 G" for a global layer, shade global layers; returns a note for the subtitle ("" if uniform)."""
    kinds = _layer_kinds(trace)
    if kinds is None:
        return ""
    ticks = [f"{i} G" if k == "global" else str(i) for i, k in enumerate(kinds)]
    update = fig.update_xaxes if axis == "x" else fig.update_yaxes
    update(tickvals=list(range(len(kinds))), ticktext=ticks)
    add_band = fig.add_vrect if axis == "x" else fig.add_hrect
    for i, k in enumerate(kinds):
        if k == "global":
            add_band(i - 0.5, i + 0.5, fillcolor="#888", opacity=0.12, line_width=0, layer="below")
    window = trace.config.sliding_window
    return f" G = global attention layer (shaded); the others slide over a {window}-token window."


def _sliding_window_of(trace: Trace, layer: int) -> int | None:
    """The window this layer masked with: None for global layers, or when the variant removed windows."""
    cfg = trace.config
    if getattr(trace.variant, "sliding_window", None) is False or cfg.layer_type(layer) != "sliding_attention":
        return None
    return cfg.sliding_window


# --- attention -----------------------------------------------------------------------------------
def attention(trace: Trace, layer: int, head: int | None = None) -> go.Figure:
    """Attention pattern of one head, or (head=None) every head laid out by the KV head it reads.

    Rows are query tokens (the position doing the attending), columns key tokens (attended to);
    keys the model could not see (the future under a causal mask, outside a sliding window) are blank.
    The grid has one row per KV head with the query heads that share it side by side, using the
    trace's own GQA mapping (query head i reads KV head i // (h/g), or i % g under `gqa_tile`).
    """
    _check_layer(trace, layer)
    cfg = trace.config
    pattern = trace[layer_hook_name(layer, "attn.hook_pattern")]  # [h, pos_q, pos_k]
    n = pattern.shape[-1]
    z = _finite(pattern)
    visible = attention_mask(n, n, causal=trace.variant.causal, sliding_window=_sliding_window_of(trace, layer))
    if visible is not None:
        z[:, ~visible.numpy()] = np.nan
    labels = token_labels(trace.tokens)
    kv = kv_head_index(cfg.n_heads, cfg.n_kv_heads, trace.variant.gqa).tolist()
    subtitle = "Row = query token (attending), column = key token (attended to); blank = masked. Hover for weights."
    kinds = _layer_kinds(trace)
    kind = f" ({kinds[layer]})" if kinds else ""
    side = min(900, max(420, 16 * n + 220))
    if head is not None:
        if not 0 <= head < cfg.n_heads:
            raise ValueError(f"head must be in 0..{cfg.n_heads - 1} (or None for all heads), got {head}")
        fig = go.Figure(_attention_heatmap(z[head], labels, head, kv[head]))
        fig.update_layout(coloraxis={"colorscale": "Blues", "cmin": 0, "cmax": 1, "colorbar": {"title": "weight"}})
        _style(fig, f"Attention, layer {layer}{kind}, head {head} (reads KV head {kv[head]}) — {run_label(trace)}",
               subtitle, "key token (attended to)", "query token (attending)", side)
    else:
        groups = [[q for q in range(cfg.n_heads) if kv[q] == g] for g in range(cfg.n_kv_heads)]
        n_cols = max(len(members) for members in groups)
        titles = [f"head {members[c]}" if c < len(members) else "" for members in groups for c in range(n_cols)]
        fig = make_subplots(
            rows=cfg.n_kv_heads, cols=n_cols, shared_xaxes=True, shared_yaxes=True, subplot_titles=titles,
            row_titles=[f"KV head {g}" for g in range(cfg.n_kv_heads)],
            horizontal_spacing=0.02, vertical_spacing=0.04,
        )
        for g, members in enumerate(groups):
            for col, q in enumerate(members):
                fig.add_trace(_attention_heatmap(z[q], labels, q, g), row=g + 1, col=col + 1)
        fig.update_layout(coloraxis={"colorscale": "Blues", "cmin": 0, "cmax": 1, "colorbar": {"title": "weight"}})
        height = min(1400, max(600, cfg.n_kv_heads * (8 * n + 180)))
        sharing = (f"All {cfg.n_heads} query heads read the one KV head (MQA). " if cfg.n_kv_heads == 1 else
                   f"Each row: the {n_cols} query heads that read the same KV head (GQA). ")
        _style(fig, f"Attention, layer {layer}{kind}, all {cfg.n_heads} heads by KV head — {run_label(trace)}",
               sharing + subtitle,
               None, None, height, extra_top=SUBPLOT_TITLE_PX)
        fig.update_xaxes(title_text="key token", row=cfg.n_kv_heads)
        fig.update_yaxes(title_text="query token", col=1)
        fig.update_xaxes(tickfont={"size": 9})
        fig.update_yaxes(tickfont={"size": 9})
    fig.update_yaxes(autorange="reversed")  # query 0 at the top, like a matrix
    fig.update_xaxes(tickangle=-60)
    _note_nonfinite(fig, trace)
    return fig


def _attention_heatmap(z: np.ndarray, labels: list[str], head: int, kv_head: int) -> go.Heatmap:
    return go.Heatmap(
        z=z.astype(np.float32), x=labels, y=labels, coloraxis="coloraxis", hoverongaps=False, name=f"head {head}",
        hovertemplate=(f"head {head} (KV head {kv_head})<br>query: %{{y}}<br>key: %{{x}}"
                       "<br>weight: %{z:.3f}<extra></extra>"),
    )


# --- residual stream -----------------------------------------------------------------------------
def residual_norms(
    trace: Trace,
    stages: tuple[str, ...] | list[str] = ("pre", "mid", "post"),
    per_position: bool = False,
    log_y: bool = False,
    include_first: bool = True,
    other: Trace | None = None,
    other_label: str | None = None,
) -> go.Figure:
    """L2 norm of the residual stream per layer: averaged over positions, or one line per position.

    `include_first=False` hides position 0, whose norm is often far larger than the rest (the
    "attention sink"). `other` overlays a second trace of the same prompt (dashed), e.g. a variant.
    """
    unknown = [s for s in stages if s not in RESIDUAL_STAGES]
    if unknown or not stages:
        raise ValueError(f"stages must be a non-empty subset of {list(RESIDUAL_STAGES)}, got {list(stages)}")
    if other is not None:
        _check_same_prompt(trace, other)
    if not include_first and len(trace.tokens) < 2:
        raise ValueError("The prompt has one token: hiding the first token would leave nothing to plot")
    runs = [(trace, run_label(trace))]
    if other is not None:
        runs.append((other, other_label or run_label(other)))
    labels = token_labels(trace.tokens)
    fig = go.Figure()
    for (run, name), dash in zip(runs, RUN_DASHES, strict=False):
        frame = run.residual_norms()
        frame = frame[frame["stage"].isin(stages) & ((frame["position"] > 0) | include_first)]
        prefix = f"{name}: " if other is not None else ""
        if per_position:
            palette = _position_colors(len(trace.tokens))
            for (stage, pos), part in frame.groupby(["stage", "position"], sort=False):
                fig.add_trace(_norm_line(part, f"{prefix}{labels[pos]} · {stage}", palette[pos], dash,
                                         STAGE_SYMBOLS[stage], f"{labels[pos]}<br>{STAGE_NAMES[stage]}"))
        else:
            for stage, part in frame.groupby("stage", sort=False):
                # mean over positions; a non-finite position makes that layer's mean a gap, not a number
                mean = part.groupby("layer", as_index=False)["norm"].mean()
                fig.add_trace(_norm_line(mean, f"{prefix}{STAGE_NAMES[stage]}", STAGE_COLORS[stage], dash,
                                         STAGE_SYMBOLS[stage], f"{STAGE_NAMES[stage]}, mean over positions"))
    what = "one line per position" if per_position else "mean over positions"
    first = "" if include_first else ", first token hidden"
    fig.update_xaxes(dtick=1 if trace.n_layers <= 32 else None)
    kinds_note = _label_layer_axis(fig, trace, "x")
    _style(fig, f"Residual stream norm per layer ({what}{first})",
           "‖x‖ of the residual stream entering each block (pre), after its attention (mid) and after its MLP (post)."
           + (" Dashed: " + runs[1][1] + "." if other is not None else "") + kinds_note,
           "layer", "L2 norm" + (" (log scale)" if log_y else ""), 520)
    if log_y:
        fig.update_yaxes(type="log")
    _note_nonfinite(fig, *[run for run, _ in runs])
    return fig


def _norm_line(frame: pd.DataFrame, name: str, color: str, dash: str, symbol: str, hover: str) -> go.Scatter:
    return go.Scatter(
        x=frame["layer"].to_numpy(), y=_finite(frame["norm"].to_numpy()), mode="lines+markers", name=name,
        line={"color": color, "dash": dash, "width": 2}, marker={"symbol": symbol, "size": 5},
        hovertemplate=f"{plotly_text(hover)}<br>layer %{{x}}<br>norm %{{y:.4g}}<extra>{plotly_text(name)}</extra>",
    )


def _position_colors(n: int) -> list[str]:
    import plotly.colors as pc

    return pc.sample_colorscale("Viridis", [i / max(1, n - 1) for i in range(n)])


# --- logit lens ----------------------------------------------------------------------------------
def logit_lens(trace: Trace, k: int = 5, max_positions: int = 32) -> go.Figure:
    """Layers × positions: the top next-token guess if the model stopped after each layer.

    Each cell is the residual stream after block L read through the final norm and unembedding; its
    colour is the top token's probability and its text the token. Hover lists the top k. Only the
    last `max_positions` positions are computed and shown (the lens is per position).
    """
    if k < 1 or max_positions < 1:
        raise ValueError(f"k and max_positions must be >= 1, got k={k}, max_positions={max_positions}")
    start = max(0, len(trace.tokens) - max_positions)
    lens = trace.logit_lens(k, start)
    labels = token_labels(trace.tokens)
    positions = list(range(start, len(trace.tokens)))
    layers = list(range(trace.n_layers))
    # logit_lens rows are ordered (layer, position, rank): reshape instead of grouping row by row.
    shape = (len(layers), len(positions), k)
    probs = lens["prob"].to_numpy().reshape(shape)
    preds = np.array([plotly_text(show_token(p)) for p in lens["pred"]], dtype=object).reshape(shape)
    finite = lens["finite"].to_numpy().reshape(shape)[..., 0]
    prob = np.where(finite, probs[..., 0], np.nan)
    text = np.where(finite, preds[..., 0], "")
    hover = np.full(prob.shape, "not finite", dtype=object)
    for i, j in zip(*np.nonzero(finite), strict=True):
        hover[i, j] = "<br>".join(f"{r + 1}. {preds[i, j, r]}  {probs[i, j, r]:.1%}" for r in range(k))
    fig = go.Figure(go.Heatmap(
        z=prob, x=[labels[p] for p in positions], y=layers, text=text, customdata=hover,
        texttemplate="%{text}", textfont={"size": 9}, colorscale="Viridis", zmin=0, zmax=1, hoverongaps=False,
        colorbar={"title": "top-1 prob"},
        hovertemplate="input: %{x}<br>after layer %{y}<br>top next tokens:<br>%{customdata}<extra></extra>",
    ))
    shown = "" if start == 0 else f" (last {len(positions)} of {len(trace.tokens)} positions)"
    fig.update_xaxes(tickangle=-60)
    fig.update_yaxes(dtick=1 if trace.n_layers <= 32 else None)
    kinds_note = _label_layer_axis(fig, trace, "y")
    _style(fig, f"Logit lens — {run_label(trace)}{shown}",
           "What the model would predict next if it stopped after each layer (final norm + unembedding). "
           "Top row = the real output." + kinds_note,
           "input token (the prediction is for the token after it)", "after layer",
           min(1100, 120 + 22 * trace.n_layers + 80))
    _note_nonfinite(fig, trace)
    return fig


# --- faithful vs variant -------------------------------------------------------------------------
def kl_per_position(reference: Trace, other: Trace) -> go.Figure:
    """KL(reference ‖ other) of the next-token distribution at each position, in nats."""
    _check_same_prompt(reference, other)
    kl = _finite(_kl_per_position(reference.logits, other.logits))
    labels = token_labels(reference.tokens)
    fig = go.Figure(go.Bar(
        x=labels, y=kl, marker_color="#d62728", name="KL",
        hovertemplate="position %{x}<br>KL %{y:.4g} nats<extra></extra>",
    ))
    bad = [labels[i] for i in np.flatnonzero(np.isnan(kl))]
    if bad:
        fig.add_trace(go.Scatter(x=bad, y=[0] * len(bad), mode="markers+text", text=["∞"] * len(bad),
                                 textposition="top center", marker={"symbol": "x", "color": "#b00020", "size": 10},
                                 name="not finite",
                                 hovertemplate="position %{x}<br>KL = ∞ (not finite)<extra></extra>"))
    _style(fig, f"How much {run_label(other)} changes each next-token prediction",
           f"KL({run_label(reference)} ‖ {run_label(other)}) per position, in nats: 0 = identical predictions.",
           "input token (the prediction is for the token after it)", "KL divergence (nats)", 420)
    fig.update_xaxes(tickangle=-60)
    fig.update_layout(showlegend=bool(bad))
    fig.update_yaxes(rangemode="tozero")
    _note_nonfinite(fig, other)
    return fig


def variant_diff(reference: Trace, other: Trace, stage: str = "post") -> go.Figure:
    """Layers × positions: relative difference ‖other − reference‖ / ‖reference‖ of the residual stream."""
    if stage not in RESIDUAL_STAGES:
        raise ValueError(f"stage must be one of {list(RESIDUAL_STAGES)}, got {stage!r}")
    _check_same_prompt(reference, other)
    frame = trace_diff(reference, other)
    frame = frame[frame["stage"] == stage]
    if frame.empty:
        raise KeyError(f"Both traces need blocks.*.hook_resid_{stage} to be compared")
    rel = frame.pivot(index="layer", columns="position", values="rel_diff").sort_index()
    values = _finite(rel.to_numpy())
    z = np.log10(np.clip(values, 1e-7, None))  # log colour: 1e-6 (rounding) to >1 (unrelated) on one scale
    labels = token_labels(reference.tokens)
    ticks = list(range(-6, 2))
    fig = go.Figure(go.Heatmap(
        z=z, x=[labels[p] for p in rel.columns], y=list(rel.index), customdata=values, zmin=-6, zmax=1,
        colorscale="Inferno", hoverongaps=False,
        colorbar={"title": "‖Δ‖/‖x‖", "tickvals": ticks, "ticktext": [f"{10.0**t:g}" for t in ticks]},
        hovertemplate="input: %{x}<br>after layer %{y}<br>relative difference %{customdata:.3g}<extra></extra>",
    ))
    _style(fig, f"Where {run_label(other)} moves the residual stream away from {run_label(reference)}",
           f"‖Δ‖/‖x‖ of {STAGE_NAMES[stage]} per layer and position (log colour): "
           "1e-6 is rounding noise, 1 means as large as the signal itself.",
           "input token", "layer", min(1100, 120 + 20 * reference.n_layers + 80))
    fig.update_xaxes(tickangle=-60)
    _note_nonfinite(fig, other)
    return fig


# --- next token ----------------------------------------------------------------------------------
def next_token_table(trace: Trace, k: int = 10, position: int = -1) -> pd.DataFrame:
    """Display table of the next-token prediction: rank, token (spaces made visible), token_id, prob.

    Non-finite logits give one row saying where the values stopped being finite instead of raising.
    """
    try:
        top = trace.top_tokens(k, position)
    except FloatingPointError:
        bad = trace.first_nonfinite()
        row = (None, f"(logits not finite: overflow from {bad})", None, None)
        return pd.DataFrame([row], columns=list(NEXT_TOKEN_COLUMNS))
    columns = (top["rank"], [show_token(t) for t in top["token"]], top["token_id"], top["prob"].round(4))
    return pd.DataFrame(dict(zip(NEXT_TOKEN_COLUMNS, columns, strict=True)))


def top_tokens(trace: Trace, k: int = 10, position: int = -1) -> go.Figure:
    """Bar chart of the k most likely next tokens after `position` (default: the last)."""
    table = next_token_table(trace, k, position)
    fig = go.Figure()
    if table["prob"].notna().any():
        fig.add_trace(go.Bar(x=table["prob"], y=table["token"], orientation="h", marker_color="#1f77b4",
                             hovertemplate="%{y}: %{x:.2%}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    pos = position % len(trace.tokens)
    _style(fig, f"Next token after {token_labels(trace.tokens)[pos]} — {run_label(trace)}",
           f"The {k} most likely next tokens and their probabilities.", "probability", "token", 360)
    _note_nonfinite(fig, trace)
    return fig


# --- HTML for notebooks and the app --------------------------------------------------------------
def tokens_html(trace: Trace) -> str:
    """A wrapping strip of token chips: position above, token below (␣ = space, ↵ = newline)."""
    chips = []
    for i, (tok, tid) in enumerate(zip(trace.tokens, trace.input_ids.tolist(), strict=True)):
        chips.append(
            f'<span title="position {i}, token id {tid}" style="display:inline-flex;flex-direction:column;'
            'align-items:center;border:1px solid #c8ccd2;border-radius:4px;padding:1px 5px;margin:2px;'
            'background:#f4f6f8;color:#111;font-family:ui-monospace,monospace;font-size:13px">'
            f'<span style="font-size:9px;color:#667">{i}</span>{html.escape(show_token(tok))}</span>'
        )
    return (f'<div class="slmviz-tokens" style="line-height:1.2">'
            f'<div style="font-size:12px;color:#667;margin-bottom:2px">{len(trace.tokens)} tokens '
            '(␣ = space, ↵ = newline; hover a token for its id)</div>' + "".join(chips) + "</div>")


_PLOTLYJS_SENT = False


def figure_html(fig: go.Figure, include_plotlyjs: bool | str | None = None) -> str:
    """A figure as an HTML fragment. By default plotly.js (from the installed plotly, no CDN) is
    embedded in the first fragment of the kernel session and reused by the later ones."""
    global _PLOTLYJS_SENT
    if include_plotlyjs is None:
        include_plotlyjs = not _PLOTLYJS_SENT
    _PLOTLYJS_SENT = _PLOTLYJS_SENT or include_plotlyjs is True
    return fig.to_html(full_html=False, include_plotlyjs=include_plotlyjs, config=FIGURE_CONFIG)


def trace_html(trace: Trace, k: int = 5, include_plotlyjs: bool | str | None = None) -> str:
    """Rich notebook display of a trace: header, token strip, top next tokens, residual-norm plot."""
    head = (f"<b>{html.escape(repr(trace))}</b>")
    table = next_token_table(trace, k).to_html(index=False, border=0, na_rep="")
    note = trace.first_nonfinite()
    warn = (f'<div style="color:#b00020">⚠ values stopped being finite at {html.escape(note)}</div>'
            if note else "")
    fig = residual_norms(trace)
    fig.update_layout(height=380)
    return (f'<div class="slmviz-trace">{head}{warn}{tokens_html(trace)}'
            f'<div style="margin-top:6px"><b>Next token</b>{table}</div>'
            f"{figure_html(fig, include_plotlyjs)}</div>")
