"""Figures of a Scan, shared by the notebook and the app's Corpus tab: a Scan in, plotly / HTML out.

`examples_html` draws each top example as a strip of tokens whose background shows the feature's
activation at that token (orange for positive, blue for negative, scaled by the feature's corpus max),
the example's own token outlined. `histogram` plots the feature's activation histogram over every token
of the corpus as a density (count / bin width) on a log count axis: the scan's bins are log-spaced
(slmviz.scans.reduce.EDGES), so raw counts would favour the wide bins far from zero.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from .trace import show_token

if TYPE_CHECKING:
    from ..scans.scan import Scan

STRIP_CLASS = "slmviz-corpus-strip"


def _colour(value: float, scale: float) -> str:
    if value != value or scale <= 0:  # NaN: outside the window
        return "transparent"
    alpha = min(abs(value) / scale, 1.0)
    rgb = "255,140,0" if value >= 0 else "31,119,180"
    return f"rgba({rgb},{alpha:.2f})"


def examples_html(scan: Scan, hook: str, index: int, docs: list[str] | None = None) -> str:
    """One strip per top example (rank order); each strip has data-rank and data-doc for click handlers.
    `docs`: the corpus's documents, to show each example's whole document on hover."""
    table = scan.top_examples(hook, index)
    if table.empty:
        return "<p>No tokens were scanned for this feature.</p>"
    scale = max(abs(float(scan.max(hook)[index])), abs(float(scan.min(hook)[index])), 1e-12)
    strips = []
    for row in table.itertuples():
        spans = []
        for token, act, here in scan.context(hook, index, row.rank):
            style = f"background:{_colour(act, scale)};padding:1px 0;border-radius:2px"
            if here:
                style += ";outline:2px solid #d62728;font-weight:600"
            spans.append(f'<span style="{style}" title="{act:.4g}">{html.escape(show_token(token))}</span>')
        hover = html.escape(docs[row.doc][:400], quote=True) if docs and row.doc < len(docs) else ""
        strips.append(
            f'<div class="{STRIP_CLASS}" data-rank="{row.rank}" data-doc="{row.doc}" title="{hover}" '
            f'style="cursor:pointer;font-family:ui-monospace,monospace;margin:3px 0;white-space:pre-wrap">'
            f'<span style="color:#666">#{row.rank + 1} doc {row.doc}, pos {row.position}: {row.activation:.4g}  </span>'
            + "".join(spans) + "</div>"
        )
    return f'<div class="slmviz-corpus">{"".join(strips)}</div>'


def histogram(scan: Scan, hook: str, index: int) -> go.Figure:
    """Density of one feature's activations over every token of the corpus (log count axis)."""
    h = scan.histogram(hook, index)
    finite = h[(h.left > float("-inf")) & (h.right < float("inf"))]
    width = finite.right - finite.left
    fig = go.Figure(go.Bar(x=(finite.left + finite.right) / 2, y=finite["count"] / width, width=width,
                           customdata=finite[["left", "right", "count"]].to_numpy(),
                           hovertemplate="(%{customdata[0]:.3g}, %{customdata[1]:.3g}]: %{customdata[2]} tokens"
                                         "<extra></extra>", marker_color="#ff8c00"))
    what = scan.features[hook]["what"]
    n = int(scan.stats[hook].n)
    fig.update_layout(
        title={"text": f"{hook}, feature {index}<br><sup>{what}; {n} tokens of {scan.info['documents']} "
                       f"documents; mean {float(scan.mean(hook)[index]):.3g}, max {float(scan.max(hook)[index]):.3g}"
                       "</sup>"},
        xaxis_title="activation", yaxis_title="tokens per unit of activation", yaxis_type="log",
        bargap=0, margin={"t": 70, "l": 60, "r": 20, "b": 50}, height=360,
    )
    return fig
