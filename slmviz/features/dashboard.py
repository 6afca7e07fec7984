"""Feature dashboards: what an SAE's (or transcoder's) feature responds to and what it writes, as data and as one
HTML card that a notebook displays (`_repr_html_`) and the app's Features tab shows (app/tabs/features.py).

    s = slmviz.scan(corpus, hooks=[f"{sae.hook_name_out}.hook_sae_acts_post"], saes=[sae], model=m)
    feature_card(sae, 12, scan=s, model=m)          # in a notebook: the card itself
    top_features(m.trace(prompt, saes=[sae]), sae)  # the strongest features at each token
    search_features(sae, " God", by="promotes", model=m)

Rows: a feature's numbers count the rows training and evaluate_sae count (activations.sae_rows, through
SAE.shown_rows): slmviz.scan zeroes an SAE's features on the rows it drops, and `top_features` marks them
kept=False. Without that the attention sink's massive first position tops every feature's contexts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from ..errors import SAEError, check_feature, check_k
from ..hooks import layer_of

BANDS = 5  # quantile bands of the feature's max activation: 0-20 %, ..., 80-100 %
SEARCH_MODES = ("promotes", "fires")


def acts_hook(sae: Any) -> str:
    """The hook a feature scan reads: the SAE's features after its activation function."""
    return f"{sae.hook_name_out}.hook_sae_acts_post"


def _scanned(scan: Any, sae: Any) -> str:
    hook = acts_hook(sae)
    if hook not in scan.stats:
        raise ValueError(f"the scan has no {hook!r} (it has {scan.hooks}); scan the SAE's features with "
                         f"slmviz.scan(corpus, hooks=[{hook!r}], saes=[sae], model=m)")
    return hook


def top_contexts(scan: Any, sae: Any, feature: int) -> pd.DataFrame:
    """scan.top_examples of the feature where it fired (> 0): a feature that rarely fires has zeros as its last
    "top" examples. Columns as Scan.top_examples."""
    table = scan.top_examples(_scanned(scan, sae), check_feature(sae, feature))
    return table[table.activation > 0].reset_index(drop=True)


def firing_stats(scan: Any, sae: Any, feature: int) -> dict[str, Any]:
    """Density (share of scanned tokens where the feature is > 0), its max and mean, and the quantile bands: how
    many firing tokens fall in each fifth of the max activation (from the scan's log-spaced histogram bins, each bin
    counted in the band of its midpoint, so a band is exact only to a bin). `bins`: the histogram's bins above 0."""
    hook = _scanned(scan, sae)
    f = check_feature(sae, feature)
    hist = scan.histogram(hook, f)
    n = int(scan.stats[hook].n)
    firing = hist[hist.left >= 0].reset_index(drop=True)
    n_firing = int(firing["count"].sum())
    top = float(scan.max(hook)[f])
    bands = [0] * BANDS
    if top > 0:
        for row in firing.itertuples():
            mid = (float(row.left) + min(float(row.right), top)) / 2
            bands[min(int(BANDS * mid / top), BANDS - 1)] += int(row.count)
    return {"tokens": n, "firing": n_firing, "density": n_firing / n if n else 0.0, "max": top,
            "mean": float(scan.mean(hook)[f]), "bands": bands, "bins": firing}


@dataclass
class FeatureCard:
    """One feature's dashboard: `stats` and `contexts` from a scan (None without one), logit `effects` (None for
    an SAE that does not write the residual stream; `no_effects` says why) and `nearest` features by decoder
    cosine. `html()` / `_repr_html_` draw it (slmviz.plots.features.feature_card_html)."""

    sae: Any
    feature: int
    name: str = ""
    scan: Any = None
    docs: list[str] | None = None
    stats: dict[str, Any] | None = None
    contexts: pd.DataFrame | None = None
    effects: pd.DataFrame | None = None
    no_effects: str = ""
    nearest: pd.DataFrame = field(default_factory=pd.DataFrame)
    note: str = ""
    label: str = ""  # the deep scan's label (features.deep_scan), when given
    label_score: float | None = None  # its detection balanced accuracy on held-out text

    def html(self) -> str:
        """The card as one HTML fragment (inline styles, no script)."""
        from ..plots.features import feature_card_html

        return feature_card_html(self)

    def _repr_html_(self) -> str:
        from ..plots.features import feature_card_html

        return feature_card_html(self)

    def __repr__(self) -> str:
        s = self.stats
        fires = f", fires on {100 * s['density']:.2f} % of {s['tokens']} tokens, max {s['max']:.3g}" if s else ""
        return f"FeatureCard(feature {self.feature} of {self.name or repr(self.sae)}{fires})"


def scan_source(scan: Any) -> str:
    """What a card says of the scan it read: "the deep scan (1,048,576 tokens)" or "the small scan (20,480 tokens;
    the deep scan is not built yet)"; "" without a scan."""
    if scan is None:
        return ""
    n = int(scan.info.get("tokens", 0))
    if scan.info.get("deep"):
        return f"Read the deep scan ({n:,} tokens)."
    return f"Read the small scan ({n:,} tokens); labels and contexts sharpen once the set's deep scan is built."


def feature_card(sae: Any, feature: int, scan: Any = None, model: Any = None, docs: list[str] | None = None,
                 name: str = "", k: int = 10, note: str = "", labels: Any = None) -> FeatureCard:
    """Feature `feature`'s dashboard. scan: a scan of acts_hook(sae) with the SAE spliced (its statistics, density,
    quantile bands and top contexts; left out without one). model: for the logit effects (default: the model the
    SAE was loaded for). docs: the scanned documents, shown when hovering a context. k: tokens per side of the
    logit effects and nearest features. labels: the deep scan's LabelTable (features.deep_scan): the card shows the
    feature's label beside its score. The note says which scan the card read (scan_source)."""
    f = check_feature(sae, feature)
    k = check_k(k)
    notes = [n for n in (note, scan_source(scan)) if n]
    card = FeatureCard(sae, f, name=name, scan=scan, docs=docs, note=" ".join(notes), nearest=sae.nearest(f, k))
    layer = _layer_of(sae)
    hit = labels.lookup(layer, f) if labels is not None and layer is not None else None
    if hit is not None:
        card.label, card.label_score = hit
        score = "no score (it never fired in the held-out text)" if hit[1] != hit[1] else f"score {hit[1]:.2f}"
        card.note = f"Label: {hit[0]} ({score}, detection balanced accuracy on held-out text). {card.note}".strip()
    if scan is not None:
        card.stats = firing_stats(scan, sae, f)
        card.contexts = top_contexts(scan, sae, f)
    try:
        card.effects = sae.logit_effects(f, k=k, model=model)
    except SAEError as e:  # no model, or an SAE that does not write the residual stream: the card says why
        card.no_effects = str(e)
    return card


def _layer_of(sae: Any) -> int | None:
    parts = str(getattr(sae, "hook_name", "")).split(".")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "blocks" and parts[1].isdigit() else None


def top_features(trace: Any, sae: Any, k: int = 8) -> pd.DataFrame:
    """The k strongest features at each token of one traced prompt: position, token, rank, feature, activation,
    kept. `trace` must hold the SAE's input hook (sae.hook_name; a trace captures every hook by default); its
    features are read from acts_hook(sae) when traced with saes=[sae], else computed as sae.encode(input).
    kept is False on the rows sae.shown_rows drops (the first position, massive rows), whose features say nothing
    about their token; their activations are listed anyway."""
    k = check_k(k)
    if sae.hook_name not in trace:
        raise ValueError(f"the trace has no {sae.hook_name!r}, the SAE's input; trace with that hook captured "
                         "(the default), e.g. m.trace(prompt, saes=[sae])")
    x = trace[sae.hook_name].flatten(1).float()  # [pos, d_in] (an attn.hook_z SAE reads [pos, h, d_head])
    hook = acts_hook(sae)
    with torch.no_grad():
        acts = (trace[hook] if hook in trace else sae.encode(x.to(sae.W_enc.device))).float().cpu()  # [pos, d_sae]
    others = ()
    if getattr(sae, "is_transcoder", False) and sae.hook_name_out in trace:
        others = (trace[sae.hook_name_out].flatten(1).float(),)
    first = torch.zeros(x.shape[0], dtype=torch.bool)
    first[0] = True
    kept = sae.shown_rows(x.cpu(), first, *(o.cpu() for o in others)).tolist()
    values, ids = acts.topk(min(k, acts.shape[-1]), dim=-1)  # [pos, k]
    rows = [(pos, trace.tokens[pos], rank, int(ids[pos, rank]), float(values[pos, rank]), kept[pos])
            for pos in range(acts.shape[0]) for rank in range(values.shape[1])]
    return pd.DataFrame(rows, columns=["position", "token", "rank", "feature", "activation", "kept"])


def search_features(sae: Any, token: str, by: str = "promotes", model: Any = None, scan: Any = None,
                    k: int = 10) -> pd.DataFrame:
    """Features related to one token.

    by="promotes": the k features whose decoder direction, read through the unembedding, raises `token`'s logit
    most (W_dec[f] · W_U[:, token], the final norm's weight folded in as in SAE.logit_effects); needs model (or an
    SAE loaded with model=) and `token` to be exactly one token (' the' and 'the' differ). Columns: feature, effect.
    by="fires": the k features with the most top contexts in `scan` on `token` (case and surrounding spaces
    ignored), then by their highest activation there. Columns: feature, contexts, activation."""
    k = check_k(k)
    if by not in SEARCH_MODES:
        raise ValueError(f"by must be one of {SEARCH_MODES}, got {by!r}")
    if not (token or "").strip():
        raise ValueError("Type a token to search for, e.g. ' God'")
    if by == "fires":
        if scan is None:
            raise ValueError("by='fires' reads a feature scan: pass scan= (slmviz.scan with saes=[sae])")
        return _firing_on(scan, sae, token, k)
    return _promoting(sae, model if model is not None else getattr(sae, "model", None), token, k)


def _promoting(sae: Any, model: Any, token: str, k: int) -> pd.DataFrame:
    if model is None:
        raise SAEError("by='promotes' needs the model: pass model=, or load the SAE with load_sae(..., model=m)")
    ids = model.encode(token)
    if ids.numel() != 1:
        raise ValueError(f"{token!r} is {ids.numel()} tokens for {model.name}; search for one token (mind the "
                         "leading space: ' the' and 'the' are different tokens)")
    directions = sae.W_dec.detach().float()  # [d_sae, d_out]
    if sae.hook_name_out.endswith("attn.hook_z"):  # through W_O, as SAE.residual_direction
        layer = layer_of(sae.hook_name_out)
        directions = directions @ model.decoder.params.layers[layer].w_o.float().T.to(directions.device)
    if directions.shape[-1] != model.cfg.d_model:
        raise SAEError(f"{sae!r} does not write the residual stream, so it has no logit effects")
    from ..variants import resolve_variant

    decoder = model.decoder
    factor = decoder.final_norm_factor(decoder.conventions(resolve_variant(None, model.cfg))).float()
    unembed = decoder.params.unembed[int(ids[0])].float()  # [d_model]
    effects = directions @ (unembed * factor).to(directions.device)  # [d_sae, d_model] @ [d_model]
    values, order = effects.cpu().topk(min(k, sae.d_sae))
    return pd.DataFrame({"feature": order.tolist(), "effect": values.tolist()})


def _firing_on(scan: Any, sae: Any, token: str, k: int) -> pd.DataFrame:
    hook = _scanned(scan, sae)
    rows = scan.all_top_examples()
    rows = rows[(rows.hook == hook) & (rows.activation > 0)]
    rows = rows[rows.token.str.strip().str.lower() == token.strip().lower()]
    if rows.empty:
        return pd.DataFrame(columns=["feature", "contexts", "activation"])
    grouped = rows.groupby("feature").agg(contexts=("activation", "size"), activation=("activation", "max"))
    return grouped.sort_values(["contexts", "activation"], ascending=False).head(k).reset_index()
