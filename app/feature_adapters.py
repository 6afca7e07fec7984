"""ADAPTERS for the Features tab: what the tab needs and slmviz.features does not offer yet.

Each function here is a stand-in, to be deleted once the library has it (and the tab then calls the library):
- `feature_card_html`: a feature's dashboard as one HTML card (the library's `.card()` / `_repr_html_`, which a
  notebook displays too; until then a notebook can call this function and show it with IPython.display.HTML);
- `prompt_features`: the strongest features at each token of one prompt, massive rows skipped (sae_rows);
- `features_promoting`: the features whose logit effect on one token is largest (a search by token);
- `features_firing_on`: the features whose top corpus contexts sit on one token (a search by token);
- `bundled_sae_names` / `bundled_sae_source`: slmviz.bundled_saes and load_sae(name) by bundled name;
- `dashboard_sae`: the SAE a feature scan splices in, whose features are 0 on the rows
  slmviz.features.activations.sae_rows drops (each window's first position and massive rows), because
  slmviz.scan does not apply that rule to SAE hooks yet. Without it a feature's "top contexts" are the first
  tokens of verses (the attention sink's massive activation pushes every pre-activation far out: measured on the
  random test SAE, all ten top contexts of its hardest-firing feature sat at position 0), and its density counts
  them too. Training and evaluate_sae drop the same rows.

The HTML here is plain markup with inline styles (no script), so the same card shows in the app's gr.HTML and in
a notebook. Clickable items carry `data-feature` (and tokens `data-pos`): the app's page JavaScript turns a click
into a Gradio event (app/features_tab.py).
"""

from __future__ import annotations

import copy
import html
import math
from typing import Any

import pandas as pd
import torch

from slmviz.features.activations import sae_rows
from slmviz.features.sae import SAE
from slmviz.plots.trace import show_token

FEATURE_LINK = "slmviz-feature-link"
TOKEN_CHIP = "slmviz-feature-token"
BANDS = 5  # quantile bands of the feature's max activation: 0-20 %, ..., 80-100 %
PER_TOKEN = 8  # features listed per prompt token
STRIP_STYLE = "font-family:ui-monospace,monospace;margin:3px 0;white-space:pre-wrap;font-size:13px"
CELL = "padding:1px 8px;border:none;border-bottom:1px solid #e5e7eb"  # compact cells, whatever the page's CSS
TABLE = "font-size:12px;border-collapse:collapse;border:none;margin:0;width:auto"


# --- bundled SAEs (the training helper's slmviz.features.bundled) --------------------------------------------------
def bundled_sae_names(model: Any) -> list[str]:
    """slmviz.bundled_saes(model), or [] while the library has none."""
    try:
        from slmviz.features.bundled import bundled_saes
    except ImportError:
        return []
    return list(bundled_saes(model))


def bundled_sae_source(name: str, model: Any) -> Any:
    """What load_sae reads for bundled SAE `name` (its folder), or `name` itself once load_sae knows the names."""
    try:
        from slmviz.features.bundled import bundled_sae_folder
    except ImportError:
        return name
    return bundled_sae_folder(name, model) or name


# --- the massive-activation rule in a feature scan -------------------------------------------------------------------
class DashboardSAE(SAE):
    """An SAE whose pre-activations are pushed to -inf on the rows sae_rows drops, so its features are 0 there
    (relu, topk and jumprelu all map -inf to 0). Spliced with the error term on, the model's outputs are unchanged.

    Reads the rows the splice hands to encode_pre: [..., T, d_in], each sequence starting at a window's first
    position (a scan's batches are windows padded on the right; a trace is one window)."""

    def encode_pre(self, x: torch.Tensor) -> torch.Tensor:
        h = super().encode_pre(x)  # [..., T, d_sae]
        if x.dim() < 2:
            return h
        rows = self._flat_input(x).reshape(-1, x.shape[-2], self.d_in) if x.shape[-1] != self.d_in \
            else x.reshape(-1, x.shape[-2], x.shape[-1])  # [b, T, d_in]
        first = torch.zeros(rows.shape[:2], dtype=torch.bool)
        first[:, 0] = True
        keep = sae_rows(rows.flatten(0, 1), first.flatten()).view(h.shape[:-1])  # [..., T]
        return h.masked_fill(~keep[..., None], float("-inf"))


def dashboard_sae(sae: SAE) -> DashboardSAE:
    """`sae` as a DashboardSAE, sharing its parameters (a shallow copy; the original is unchanged)."""
    clone = copy.copy(sae)
    clone.__class__ = DashboardSAE
    return clone


# --- what a scan says about one feature ------------------------------------------------------------------------
def top_examples(scan: Any, hook: str, feature: int) -> pd.DataFrame:
    """scan.top_examples without the examples at a window's first position (module docstring) nor those where
    the feature did not fire (a feature that never fires has zeros as its "top" examples)."""
    table = scan.top_examples(hook, feature)
    window = int(scan.info.get("window") or 0)
    first = (table.position % window == 0) if window else (table.position == 0)
    return table[~first & (table.activation > 0)]


def firing_stats(scan: Any, hook: str, feature: int) -> dict[str, Any]:
    """Density (share of scanned tokens where the feature is > 0), its max and mean, and the quantile bands: how
    many firing tokens fall in each fifth of the max activation (from the scan's histogram bins, each bin counted
    in the band of its midpoint)."""
    hist = scan.histogram(hook, feature)
    n = int(scan.stats[hook].n)
    firing = hist[hist.left >= 0]
    n_firing = int(firing["count"].sum())
    top = float(scan.max(hook)[feature])
    bands = [0] * BANDS
    if top > 0:
        for row in firing.itertuples():
            right = min(float(row.right), top)
            mid = (float(row.left) + right) / 2
            bands[min(int(BANDS * mid / top), BANDS - 1)] += int(row.count)
    return {"tokens": n, "firing": n_firing, "density": n_firing / n if n else 0.0, "max": top,
            "mean": float(scan.mean(hook)[feature]), "bands": bands, "bins": firing}


# --- searches -----------------------------------------------------------------------------------------------------
def features_promoting(sae: Any, model: Any, token: str, k: int = 10) -> pd.DataFrame:
    """The k features whose decoder row, read through the unembedding, raises `token`'s logit most: W_dec[f] ·
    W_U[:, token], with the final norm's weight folded in as in SAE.logit_effects. Columns: feature, effect."""
    ids = model.encode(token)
    if ids.numel() != 1:
        raise ValueError(f"{token!r} is {ids.numel()} tokens for {model.name}; search for one token (mind the "
                         "leading space: ' the' and 'the' are different tokens)")
    directions = torch.stack([sae.residual_direction(f, model) for f in range(sae.d_sae)]) \
        if sae.hook_name_out.endswith("attn.hook_z") else sae.W_dec.detach().float()  # [d_sae, d_model]
    if directions.shape[-1] != model.cfg.d_model:
        raise ValueError(f"{sae!r} does not write the residual stream, so it has no logit effects")
    decoder = model.decoder
    from slmviz.variants import resolve_variant

    factor = decoder.final_norm_factor(decoder.conventions(resolve_variant(None, model.cfg))).float()
    unembed = decoder.params.unembed[int(ids[0])].float()  # [d_model]
    effects = directions @ (unembed * factor)  # [d_sae, d_model] @ [d_model]
    values, order = effects.topk(min(k, sae.d_sae))
    return pd.DataFrame({"feature": order.tolist(), "effect": values.tolist()})


def features_firing_on(scan: Any, hook: str, token: str, k: int = 10) -> pd.DataFrame:
    """The k features with the most top contexts on `token` (ignoring case and surrounding spaces), then by their
    highest activation there. Columns: feature, contexts, activation."""
    wanted = token.strip().lower()
    if not wanted:
        raise ValueError("Type a token to search for, e.g. ' God'")
    rows = scan.all_top_examples()
    rows = rows[(rows.hook == hook) & (rows.activation > 0)]
    window = int(scan.info.get("window") or 0)
    if window:
        rows = rows[rows.position % window != 0]
    rows = rows[rows.token.str.strip().str.lower() == wanted]
    if rows.empty:
        return pd.DataFrame(columns=["feature", "contexts", "activation"])
    grouped = rows.groupby("feature").agg(contexts=("activation", "size"), activation=("activation", "max"))
    return grouped.sort_values(["contexts", "activation"], ascending=False).head(k).reset_index()


# --- the prompt's features ----------------------------------------------------------------------------------------
def prompt_features(model: Any, sae: Any, prompt: str, chat: bool = False, k: int = PER_TOKEN) -> dict[str, Any]:
    """The `k` strongest features at each token of `prompt` (the SAE spliced in), as plain lists for gr.State:
    tokens, features [pos][k], activations [pos][k], kept [pos] (False where sae_rows drops the row: the first
    position and massive ones, whose features say nothing about the token)."""
    acts_name = f"{sae.hook_name_out}.hook_sae_acts_post"
    trace = model.trace(prompt, chat=chat, saes=[sae], names=[acts_name, sae.hook_name])
    acts = trace[acts_name]  # [pos, d_sae]
    x = trace[sae.hook_name].flatten(1)  # [pos, d_in] (a hook_z SAE reads [pos, h, d_head])
    first = torch.zeros(x.shape[0], dtype=torch.bool)
    first[0] = True
    kept = sae_rows(x, first)
    values, ids = acts.float().topk(min(k, acts.shape[-1]), dim=-1)  # [pos, k]
    return {"tokens": list(trace.tokens), "features": ids.tolist(), "acts": values.tolist(),
            "kept": kept.tolist(), "sae": repr(sae)}


def prompt_tokens_html(found: dict[str, Any]) -> str:
    """The prompt as token chips, each shaded by its strongest feature's activation; click one for its features."""
    kept = [a[0] for a, keep in zip(found["acts"], found["kept"], strict=True) if keep and a]
    scale = max(kept, default=0.0) or 1.0
    chips = []
    for pos, (tok, acts, keep) in enumerate(zip(found["tokens"], found["acts"], found["kept"], strict=True)):
        alpha = min(max(acts[0], 0.0) / scale, 1.0) if keep and acts else 0.0
        note = f"strongest feature {found['features'][pos][0]}: {acts[0]:.3g}" if keep and acts else \
            "skipped: a window's first position or a massive activation (sae_rows)"
        chips.append(
            f'<span class="{TOKEN_CHIP}" data-pos="{pos}" title="position {pos}; {html.escape(note)}" '
            f'style="cursor:pointer;display:inline-block;border:1px solid #c8ccd2;border-radius:4px;padding:1px 5px;'
            f'margin:2px;background:rgba(255,140,0,{alpha:.2f});color:#111;font-family:ui-monospace,monospace;'
            f'font-size:13px{"" if keep else ";opacity:0.5"}">{html.escape(show_token(tok))}</span>'
        )
    return (f'<div class="slmviz-prompt-features"><div style="font-size:12px;color:#667">{len(found["tokens"])} '
            "tokens, shaded by their strongest feature; click a token for its features</div>" + "".join(chips)
            + "</div>")


def token_features_html(found: dict[str, Any], pos: int) -> str:
    """One token's strongest features as links (click one to open its page)."""
    if not 0 <= pos < len(found["tokens"]):
        raise ValueError(f"position {pos} is not a token of the prompt (0..{len(found['tokens']) - 1})")
    token = html.escape(show_token(found["tokens"][pos]))
    if not found["kept"][pos]:
        return (f"<p>Position {pos} (<code>{token}</code>) is skipped: it is a window's first position or carries a "
                "massive activation, where an SAE's features say nothing about the token (sae_rows).</p>")
    items = [(f, a) for f, a in zip(found["features"][pos], found["acts"][pos], strict=True) if a > 0]
    if not items:
        return f"<p>No feature fires at position {pos} (<code>{token}</code>).</p>"
    return (f"<p>Strongest features at position {pos} (<code>{token}</code>); click one to open its page:</p>"
            + feature_list_html([(f, f"{a:.3g}") for f, a in items]))


def feature_list_html(items: list[tuple[int, str]]) -> str:
    """Features as clickable chips: (feature, what to show beside it)."""
    return '<div class="slmviz-feature-list">' + "".join(
        f'<span class="{FEATURE_LINK}" data-feature="{int(f)}" style="cursor:pointer;display:inline-block;'
        f'margin:2px 4px;padding:1px 6px;border-radius:10px;background:#eef2ff;color:#1d3f9a;border:1px solid #c7d2fe">'
        f'#{int(f)} <span style="color:#555">{html.escape(str(note))}</span></span>' for f, note in items) + "</div>"


# --- the card -----------------------------------------------------------------------------------------------------
def _colour(value: float, scale: float) -> str:
    if value != value or scale <= 0:
        return "transparent"
    return f"rgba(255,140,0,{min(max(value, 0.0) / scale, 1.0):.2f})"


def contexts_html(scan: Any, hook: str, feature: int, docs: list[str] | None = None) -> str:
    """The top activating contexts as strips shaded by the feature's activation, the example token outlined."""
    table = top_examples(scan, hook, feature)
    if table.empty:
        return "<p>This feature never fired on the scanned corpus (outside windows' first positions).</p>"
    scale = max(float(scan.max(hook)[feature]), 1e-12)
    strips = []
    for row in table.itertuples():
        spans = []
        for token, act, here in scan.context(hook, feature, row.rank):
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
    firing = max(stats["firing"], 1)
    band_rows = "".join(
        f"<tr><td style='{CELL}'>{100 * i // BANDS}-{100 * (i + 1) // BANDS} % of max</td>"
        f"<td style='{CELL};text-align:right'>{n}</td><td style='{CELL};text-align:right'>{100 * n / firing:.1f} %"
        "</td></tr>" for i, n in enumerate(stats["bands"]))
    return (
        '<div style="display:flex;gap:18px;flex-wrap:wrap;align-items:flex-start">'
        '<div style="min-width:260px;flex:1"><div style="font-size:12px;color:#667">Activation density: tokens '
        'per bin of activation > 0 (log-spaced bins, log height)</div>'
        f'<div class="slmviz-feature-density" style="display:flex;align-items:flex-end;height:84px;'
        f'border-bottom:1px solid #999">{bars or "<i>never fires</i>"}</div></div>'
        f'<table class="slmviz-feature-bands" style="{TABLE}"><tr><th style="{CELL}">quantile band</th>'
        f'<th style="{CELL}">tokens</th><th style="{CELL}">share of firing</th></tr>' + band_rows + "</table></div>"
    )


def effects_html(effects: pd.DataFrame | None, reason: str = "") -> str:
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


def feature_card_html(sae: Any, feature: int, name: str = "", scan: Any = None, docs: list[str] | None = None,
                      effects: pd.DataFrame | None = None, nearest: pd.DataFrame | None = None,
                      note: str = "") -> str:
    """One feature's dashboard: header and statistics, density histogram and quantile bands, top activating
    contexts (these three need `scan`, a scan of `{sae.hook_name_out}.hook_sae_acts_post` with the SAE spliced),
    logit effects (`sae.logit_effects`) and nearest features by decoder cosine (`sae.nearest`, clickable)."""
    hook = f"{sae.hook_name_out}.hook_sae_acts_post"
    title = f"Feature {feature}" + (f" of {html.escape(name)}" if name else "")
    section = '<h4 style="margin:10px 0 4px">{}</h4>'
    parts = [f'<div class="slmviz-feature-card" data-feature="{feature}" style="line-height:1.35">',
             f'<h3 style="margin:0 0 2px">{title}</h3>',
             f'<div style="font-size:12px;color:#555">{html.escape(repr(sae))}</div>']
    if note:
        parts.append(f'<p style="color:#8a5a00">{html.escape(note)}</p>')
    if scan is not None:
        stats = firing_stats(scan, hook, feature)
        parts.append(
            f'<p class="slmviz-feature-stats">Fires on <b>{100 * stats["density"]:.2f} %</b> of {stats["tokens"]} '
            f'scanned tokens ({stats["firing"]}) of {scan.info["documents"]} documents; max activation '
            f'<b>{stats["max"]:.3g}</b>, mean {stats["mean"]:.3g}.</p>')
        parts.append(density_html(stats))
        parts.append(section.format("Top activating contexts"))
        parts.append(contexts_html(scan, hook, feature, docs))
    parts.append(section.format("Logit effects (W_dec[f] · W_U)"))
    parts.append(effects_html(effects, "this SAE does not write the residual stream"))
    if nearest is not None:
        parts.append(section.format("Nearest features by decoder cosine (click one to open it)"))
        parts.append(feature_list_html([(r.feature, f"{r.cosine:.2f}") for r in nearest.itertuples()]))
    parts.append("</div>")
    return "".join(parts)
