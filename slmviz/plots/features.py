"""HTML of feature dashboards (slmviz.features.dashboard): the card a notebook displays and the app's Features tab
shows (#feature-card), and clickable feature lists.

Plain markup with inline styles and no script, so the same HTML shows in a notebook, in the app's gr.HTML and in
a saved page. Clickable items carry class FEATURE_LINK and `data-feature`: the app's page JavaScript turns a click
into a Gradio event (app/tabs/features.py); elsewhere they are inert labels.
"""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from .trace import show_token

FEATURE_LINK = "slmviz-feature-link"
STRIP_STYLE = "font-family:ui-monospace,monospace;margin:3px 0;white-space:pre-wrap;font-size:13px"
CELL = "padding:1px 8px;border:none;border-bottom:1px solid #e5e7eb"  # compact cells, whatever the page's CSS
TABLE = "font-size:12px;border-collapse:collapse;border:none;margin:0;width:auto"


def feature_list_html(items: list[tuple[int, str]]) -> str:
    """Features as clickable chips: (feature, what to show beside it)."""
    return '<div class="slmviz-feature-list">' + "".join(
        f'<span class="{FEATURE_LINK}" data-feature="{int(f)}" style="cursor:pointer;display:inline-block;'
        f'margin:2px 4px;padding:1px 6px;border-radius:10px;background:#eef2ff;color:#1d3f9a;border:1px solid #c7d2fe">'
        f'#{int(f)} <span style="color:#555">{html.escape(str(note))}</span></span>' for f, note in items) + "</div>"


def _colour(value: float, scale: float) -> str:
    if value != value or scale <= 0:
        return "transparent"
    return f"rgba(255,140,0,{min(max(value, 0.0) / scale, 1.0):.2f})"


def contexts_html(card: Any) -> str:
    """The top activating contexts as strips shaded by the feature's activation, the example token outlined."""
    table = card.contexts
    if table is None or table.empty:
        return "<p>This feature never fired on the scanned corpus (outside the rows the SAE's row rule drops).</p>"
    hook = f"{card.sae.hook_name_out}.hook_sae_acts_post"
    scale = max(card.stats["max"], 1e-12)
    docs = card.docs
    strips = []
    for row in table.itertuples():
        spans = []
        for token, act, here in card.scan.context(hook, card.feature, row.rank):
            style = f"background:{_colour(act, scale)};padding:1px 0;border-radius:2px"
            if here:
                style += ";outline:2px solid #d62728;font-weight:600"
            text = token.replace("\n", "↵ ") or "∅"  # spaces as spaces: a context reads as text
            spans.append(f'<span style="{style}" title="{act:.4g}">{html.escape(text)}</span>')
        hover = html.escape(docs[row.doc][:400], quote=True) if docs and row.doc < len(docs) else ""
        strips.append(f'<div class="slmviz-feature-context" data-doc="{row.doc}" title="{hover}" style="{STRIP_STYLE}">'
                      f'<span style="color:#666">{row.activation:.3g}  </span>' + "".join(spans) + "</div>")
    return "".join(strips)


def density_html(stats: dict[str, Any]) -> str:
    """The activation density histogram of the firing tokens as plain bars (log count height), and the bands."""
    bins = stats["bins"]
    bars = ""
    if not bins.empty:
        peak = math.log10(float(bins["count"].max()) + 1)
        for row in bins.itertuples():
            height = 4 + 76 * math.log10(float(row.count) + 1) / peak
            bars += (f'<div title="({row.left:.3g}, {row.right:.3g}]: {int(row.count)} tokens" style="flex:1;'
                     f'min-width:3px;height:{height:.0f}px;background:#ff8c00;margin-right:1px"></div>')
    # the axes: tokens per bin (log height: the tallest bin's count at the top, 1 at the foot), and the activation at
    # the first bin's left edge, the middle bin's and the last bin's right edge
    y_ticks = x_ticks = ""
    if not bins.empty:
        y_ticks = f"<span>{int(bins['count'].max()):,}</span><span>tokens</span><span>1</span>"
        mid = bins.iloc[len(bins) // 2]
        x_ticks = "".join(f"<span>{x:.3g}</span>" for x in (bins["left"].iloc[0], mid.left, bins["right"].iloc[-1]))
    firing = max(stats["firing"], 1)
    bands = stats["bands"]
    band_rows = "".join(
        f"<tr><td style='{CELL}'>{100 * i // len(bands)}-{100 * (i + 1) // len(bands)} % of max</td>"
        f"<td style='{CELL};text-align:right'>{n}</td><td style='{CELL};text-align:right'>{100 * n / firing:.1f} %"
        "</td></tr>" for i, n in enumerate(bands))
    return (
        '<div style="display:flex;gap:18px;flex-wrap:wrap;align-items:flex-start">'
        '<div style="min-width:260px;flex:1"><div style="font-size:12px;color:#667">Activation density: tokens '
        'per bin of activation > 0 (log-spaced bins, log height)</div>'
        '<div style="display:flex;gap:4px"><div style="display:flex;flex-direction:column;'
        f'justify-content:space-between;font-size:10px;color:#667;text-align:right;height:84px">{y_ticks}</div>'
        f'<div style="flex:1"><div class="slmviz-feature-density" style="display:flex;align-items:flex-end;'
        f'height:84px;border-bottom:1px solid #999;border-left:1px solid #999">{bars or "<i>never fires</i>"}</div>'
        f'<div class="slmviz-feature-density-x" style="display:flex;justify-content:space-between;font-size:10px;'
        f'color:#667">{x_ticks}</div><div style="font-size:10px;color:#667;text-align:center">activation '
        f'(log-spaced bins)</div></div></div></div>'
        f'<table class="slmviz-feature-bands" style="{TABLE}"><tr><th style="{CELL}">quantile band</th>'
        f'<th style="{CELL}">tokens</th><th style="{CELL}">share of firing</th></tr>' + band_rows + "</table></div>"
    )


def effects_html(effects: pd.DataFrame | None, reason: str = "") -> str:
    """Two columns: the tokens the feature promotes and those it suppresses (SAE.logit_effects)."""
    if effects is None:
        return f"<p>No logit effects: {html.escape(reason)}</p>"
    cols = []
    for kind, colour in (("promoted", "#1a7f37"), ("suppressed", "#b42318")):
        rows = effects[effects.kind == kind]
        cells = "".join(f"<tr><td style='{CELL}'><code>{html.escape(show_token(r.token))}</code></td>"
                        f"<td style='{CELL};text-align:right;color:{colour}'>{r.effect:+.3g}</td></tr>"
                        for r in rows.itertuples())
        cols.append(f'<table class="slmviz-feature-{kind}" style="{TABLE}"><tr><th colspan=2 style="{CELL}">'
                    f"{kind}</th></tr>{cells}</table>")
    return '<div style="display:flex;gap:24px">' + "".join(cols) + "</div>"


def feature_card_html(card: Any, label: str | None = None) -> str:
    """A FeatureCard as HTML: header (with the feature's `label`, given one: SAE.label's) and statistics, density
    histogram and quantile bands, top activating contexts (these three only with a scan), logit effects
    (W_dec[f] · W_U) and nearest features by decoder cosine."""
    title = f"Feature {card.feature}" + (f" of {html.escape(card.name)}" if card.name else "")
    section = '<h4 style="margin:10px 0 4px">{}</h4>'
    parts = [f'<div class="slmviz-feature-card" data-feature="{card.feature}" style="line-height:1.35">',
             f'<h3 style="margin:0 0 2px">{title}</h3>']
    if label:
        parts.append(f'<div class="slmviz-feature-label" style="font-size:15px;margin:2px 0 4px">'
                     f'<b>Label:</b> {html.escape(label)}</div>')
    parts.append(f'<div style="font-size:12px;color:#555">{html.escape(repr(card.sae))}</div>')
    if card.note:
        parts.append(f'<p style="color:#8a5a00">{html.escape(card.note)}</p>')
    if card.stats is not None:
        s = card.stats
        parts.append(
            f'<p class="slmviz-feature-stats">Fires on <b>{100 * s["density"]:.2f} %</b> of {s["tokens"]} '
            f'scanned tokens ({s["firing"]}) of {card.scan.info["documents"]} documents; max activation '
            f'<b>{s["max"]:.3g}</b>, mean {s["mean"]:.3g}.</p>')
        parts.append(density_html(s))
        parts.append(section.format("Top activating contexts"))
        parts.append(contexts_html(card))
    parts.append(section.format("Logit effects (W_dec[f] · W_U)"))
    parts.append(effects_html(card.effects, card.no_effects))
    if card.nearest is not None and not card.nearest.empty:
        parts.append(section.format("Nearest features by decoder cosine (click one to open it)"))
        parts.append(feature_list_html([(r.feature, f"{r.cosine:.2f}") for r in card.nearest.itertuples()]))
    parts.append("</div>")
    return "".join(parts)
