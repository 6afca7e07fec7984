"""The "Features" tab: browse and steer the features of sparse autoencoders (SAEs) and transcoders.

Pick an SAE (#feature-sae) and a feature (#feature-id), press Show (#feature-show): #feature-card fills with the
feature's page: how often it fires and its quantile bands, its activation density, its top activating contexts
in a scan of the bundled corpus (the Corpus tab's verses, scanned once per model and SAE with the SAE spliced in
and cached like the Corpus tab's scans, as a long job of app/jobs.py), its logit effects (W_dec[f] · W_U)
and its nearest features by decoder cosine. Below: the current prompt's strongest features at each token (click
a token, then a feature), a search for features that fire on, or promote, a token, a steering panel (#steer-run)
that continues the prompt with and without the feature added, with the same seed, and the "Train an SAE" panel
(app/tabs/features_training.py). The SAEs on offer are app/saes.py's.

Bad input (an SAE for another model's width, a hook the family lacks, missing, mis-shaped or non-finite tensors,
a pickle, an unknown architecture, an unreachable hub, a feature out of range) is a one-line message from
slmviz.load_sae / the SAE object, shown as an error in the page; nothing the session had is lost.
The card, the prompt's features and the searches are the library's (slmviz.features.dashboard); a notebook shows
the same card (docs/features.md, "Dashboards in a notebook").
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from typing import Any

import gradio as gr

import slmviz
from slmviz.errors import check_feature
from slmviz.features.dashboard import acts_hook, feature_card, search_features, top_features
from slmviz.plots.features import FEATURE_LINK, feature_card_html, feature_list_html
from slmviz.plots.trace import show_token

from ..models import AppContext
from ..saes import NO_SAE, Entry, SAEStore, finished_feature_scan, join_feature_scan
from ..scans import SCANS, corpus_size
from ..shared import Queues, guard_number, html_click_js, readable_errors, session, skips, wait_or_say
from .features_training import build_training_panel

EFFECTS_K = 10  # tokens per side of the logit effects, and nearest features
PER_TOKEN = 8  # features listed per prompt token
TOKEN_CHIP = "slmviz-feature-token"
STEER_TOKENS = 24
# The steering strength's default: this many times the feature's largest activation over the scanned corpus (the
# strength multiplies W_dec[f], so 1 adds what the feature writes when it fires hardest; 40 flat, the old default,
# drowned the prompt of a feature whose activations are a few units: the continuation was just ".").
STEER_SCALE = 2.0
FEATURE_CLICK_JS = html_click_js(FEATURE_LINK, "feature")  # a feature link's click: its number
TOKEN_CLICK_JS = html_click_js(TOKEN_CHIP, "pos")  # a token chip's click: its position


class FeatureHandlers:
    """The tab's handlers, and the feature page every tab opens (the Graph tab's cards too); models come from the
    page's AppContext, SAEs from the server's SAEStore."""

    def __init__(self, ctx: AppContext, saes: SAEStore):
        self.ctx = ctx
        self.saes = saes

    @readable_errors
    def choices(self, source: str | None, keep: str | None = None, request: gr.Request = None) -> gr.Dropdown:
        names = self.saes.names(self.ctx.model(source), session(request))
        value = keep if keep in names else (names[0] if names else None)
        return gr.Dropdown(choices=names, value=value)

    @staticmethod
    def _wait_scan(model: Any, entry: Entry, who: str, progress: Any, n_outputs: int) -> Iterator[Any]:
        """Join (or start) the SAE's feature scan and wait for it, yielding no-op updates of the handler's
        n outputs meanwhile; return (Scan, docs)."""
        job = join_feature_scan(model, entry, who)
        for _ in wait_or_say(job, who, progress, "The feature scan was cancelled; press Show to start it again"):
            yield skips(n_outputs)
        return job.result

    def _card(self, model: Any, entry: Entry, feature: int, found: Any = None, note: str = "") -> str:
        """The feature's card, headed by its label (SAE.label: an edited one, else "[auto] ..." from its scan's
        contexts and the tokens it promotes)."""
        scan, docs = found if found is not None else (None, None)
        card = feature_card(entry.sae, feature, scan=scan, model=model, docs=docs, name=entry.name, k=EFFECTS_K,
                            note=note)
        return feature_card_html(card, label=entry.sae.label(feature, scan=scan, model=model))

    @readable_errors
    def steer_scale(self, name: str | None, feature: float | None, source: str | None) -> tuple:
        """The steering strength's default from the feature's own activation scale: STEER_SCALE times its largest
        activation over the scanned corpus (once its scan is there), with a note saying so."""
        model = self.ctx.model(source)
        if not name:
            return gr.skip(), ""
        entry = self.saes.get(model, name)
        f = check_feature(entry.sae, _whole(feature))
        found = finished_feature_scan(model, entry)
        if found is None:
            return gr.skip(), ("Strength: press **Show** for this feature first; the default is then set from its "
                               "activations (its scan).")
        top = float(found[0].max(acts_hook(entry.sae))[f])
        if not top > 0:
            return gr.skip(), f"Feature {f} never fired in the scanned corpus: no activation scale to set it from."
        strength = round(STEER_SCALE * top, 1)
        return (gr.update(value=strength), f"Strength set to {strength:g}: {STEER_SCALE:g} × feature {f}'s largest "
                f"activation over the scanned corpus ({top:.3g}). Larger values push harder, and past a few times it "
                "the text degrades.")

    @readable_errors
    def show(self, name: str | None, feature: float | None, source: str | None, request: gr.Request,
             progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """The feature's page; its contexts and density come from the feature scan (computed on first use)."""
        model = self.ctx.model(source)
        entry = self.saes.get(model, name)
        f = check_feature(entry.sae, _whole(feature))
        who = session(request)
        if finished_feature_scan(model, entry) is None:
            yield f, self._card(model, entry, f, note=f"Scanning {corpus_size()} verses of the bundled corpus with "
                                "this SAE (first use only; everyone else's requests go on). The contexts and the "
                                "density appear when it is done.")
        found = yield from self._wait_scan(model, entry, who, progress, 2)
        yield f, self._card(model, entry, f, found)

    @readable_errors
    def open(self, evt: gr.EventData, name: str | None, source: str | None, request: gr.Request,
             progress: gr.Progress = gr.Progress()) -> Iterator[tuple]:  # noqa: B008
        """A click on a feature (nearest features, a token's features, search results): open its page."""
        yield from self.show(name, getattr(evt, "feature", None), source, request, progress)

    @readable_errors
    def prompt_features(self, prompt: str, chat: bool, name: str | None, source: str | None) -> tuple:
        model = self.ctx.model(source)
        entry = self.saes.get(model, name)
        found = prompt_features(model, entry.sae, self.ctx.checked_prompt(prompt, model), bool(chat))
        first = next((i for i, keep in enumerate(found["kept"]) if keep), 0)
        return prompt_tokens_html(found), token_features_html(found, len(found["tokens"]) - 1
                                                              if found["kept"][-1] else first), found

    @readable_errors
    def token(self, evt: gr.EventData, found: dict | None) -> str:
        if not found:
            raise ValueError("Press 'Features of the prompt' first")
        return token_features_html(found, int(getattr(evt, "pos", -1)))

    @readable_errors
    def token_at(self, found: dict | None, pos: float | None) -> str:
        """The same as clicking token `pos` (for gradio_client)."""
        if not found:
            raise ValueError("Press 'Features of the prompt' first")
        return token_features_html(found, _whole(pos))

    @readable_errors
    def search(self, name: str | None, token: str, mode: str, source: str | None, request: gr.Request,
               progress: gr.Progress = gr.Progress()) -> Iterator[str]:  # noqa: B008
        model = self.ctx.model(source)
        entry = self.saes.get(model, name)
        if not (token or "").strip():
            raise ValueError("Type a token to search for, e.g. ' God'")
        if mode == "promotes":
            table = search_features(entry.sae, token, by="promotes", model=model)
            items = [(r.feature, f"{r.effect:+.3g}") for r in table.itertuples()]
            what = f"Features whose logit effect on <code>{_esc(token)}</code> is largest"
        else:
            yield "Scanning the corpus for this SAE first..."
            scan, _ = yield from self._wait_scan(model, entry, session(request), progress, 1)
            table = search_features(entry.sae, token, by="fires", scan=scan)
            items = [(r.feature, f"{r.contexts} contexts, max {r.activation:.3g}") for r in table.itertuples()]
            what = f"Features whose top contexts sit on <code>{_esc(token)}</code>"
        if not items:
            yield f"<p>No feature found: {what[0].lower() + what[1:]}.</p>"
            return
        yield f"<p>{what} (click one to open its page):</p>" + feature_list_html(items)

    @readable_errors
    def steer(self, prompt: str, chat: bool, name: str | None, feature: float | None, strength: float | None,
              max_new_tokens: float | None, temperature: float | None, seed: float | None,
              source: str | None) -> tuple[str, str]:
        """The prompt continued as is and with strength × W_dec[feature] added at the SAE's hook, same seed."""
        model = self.ctx.model(source)
        entry = self.saes.get(model, name)
        f = check_feature(entry.sae, _whole(feature))
        n_new = self.ctx.checked_new_tokens(max_new_tokens)
        if temperature is None or not 0 <= float(temperature) <= 5:
            raise ValueError(f"Temperature must be between 0 and 5, got {temperature!r}")
        text = self.ctx.checked_prompt(prompt, model)
        ids = model.encode(text, chat=bool(chat))
        kwargs = dict(temperature=float(temperature), seed=None if seed in (None, "") else _whole(seed))
        hooks = slmviz.steer(entry.sae, {f: float(strength) if strength is not None else 0.0})
        return model.generate(ids, n_new, **kwargs), model.generate(ids, n_new, hooks=hooks, **kwargs)

    def cancel(self, request: gr.Request) -> str:
        SCANS.jobs.leave(session(request), kind="scan")
        return "Cancelled. The scan stops unless another visitor is waiting for it; press **Show** to start again."

    def model_changed(self, source: str | None, request: gr.Request = None) -> tuple:
        names = self.saes.names(self.ctx.model(source), session(request))
        note = "" if names else NO_SAE
        return gr.Dropdown(choices=names, value=names[0] if names else None), note, "", "", None


def prompt_features(model: Any, sae: slmviz.SAE, prompt: str, chat: bool = False, k: int = PER_TOKEN) -> dict[str, Any]:
    """slmviz's top_features of the prompt as plain lists for gr.State: tokens, features [pos][k], acts [pos][k],
    kept [pos] (False where SAE.shown_rows drops the row: the first position and massive ones)."""
    names = [acts_hook(sae), sae.hook_name] + ([sae.hook_name_out] if sae.is_transcoder else [])
    trace = model.trace(prompt, chat=chat, saes=[sae], names=list(dict.fromkeys(names)))
    table = top_features(trace, sae, k)
    by_pos = table.groupby("position", sort=True)
    return {"tokens": list(trace.tokens), "features": [g.feature.tolist() for _, g in by_pos],
            "acts": [g.activation.tolist() for _, g in by_pos], "kept": [bool(g.kept.iloc[0]) for _, g in by_pos],
            "sae": repr(sae)}


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


def _whole(value: Any) -> int:
    if value is None or value == "" or not float(value).is_integer():
        raise ValueError(f"A feature is a whole number, got {value!r}")
    return int(value)


def _esc(text: str) -> str:
    return html.escape(text)


def build_features_tab(fh: FeatureHandlers, prompt: gr.Textbox, chat: gr.Checkbox, source: gr.State,
                       queues: Queues) -> gr.Dropdown:
    """The Features tab, inside the page's gr.Tabs; returns its SAE picker (the Model tab's SAE loader picks what
    it loads there). Waiting for a feature scan holds a "jobs" slot; the model queue only serves the prompt's
    features, and steering decodes in the "decode" queue (app/main.py)."""
    model = fh.ctx.store.get()
    names = fh.saes.names(model)
    with gr.Tab("Features", id="tab-features") as tab:
        gr.Markdown(
            "The features of a sparse autoencoder (SAE) or transcoder: what makes one fire across "
            f"{corpus_size()} verses of the bundled corpus (scanned once per SAE and cached), which tokens it "
            "promotes, which features are its neighbours, and what it does to a continuation when added.")
        with gr.Row():
            picker = gr.Dropdown(names, value=names[0] if names else None, label="SAE", elem_id="feature-sae",
                                 scale=3, allow_custom_value=False)
            feature = gr.Number(value=0, precision=0, label="feature", elem_id="feature-id", scale=1)
            guard_number(feature, "The feature", lo=0, whole=True)
            show_btn = gr.Button("Show", variant="primary", elem_id="feature-show", scale=1)
            cancel_btn = gr.Button("Cancel", elem_id="feature-cancel", scale=1)
        status = gr.Markdown("" if names else NO_SAE, elem_id="feature-status")
        card = gr.HTML(elem_id="feature-card", js_on_load=FEATURE_CLICK_JS)
        with gr.Accordion("The prompt's features: the strongest features at each token", open=True):
            with gr.Row():
                prompt_btn = gr.Button("Features of the prompt", elem_id="feature-prompt-run", scale=1)
                token_pos = gr.Number(value=None, precision=0, label="token position", elem_id="feature-token-pos",
                                      scale=1, visible=False)
            found = gr.State(None, time_to_live=3600)
            tokens = gr.HTML(elem_id="feature-tokens", js_on_load=TOKEN_CLICK_JS)
            token_features = gr.HTML(elem_id="feature-token-features", js_on_load=FEATURE_CLICK_JS)
        with gr.Accordion("Search: features that fire on, or promote, a token", open=False):
            with gr.Row():
                query = gr.Textbox(label="token", placeholder=" God", elem_id="feature-search", scale=2)
                mode = gr.Radio([("fire on it (top corpus contexts)", "fires"),
                                 ("promote it (logit effect)", "promotes")], value="promotes", label="features that",
                                elem_id="feature-search-mode", scale=2)
                search_btn = gr.Button("Search", elem_id="feature-search-run", scale=1)
            results = gr.HTML(elem_id="feature-search-results", js_on_load=FEATURE_CLICK_JS)
        with gr.Accordion("Steering: add the feature's decoder direction at every position", open=True):
            with gr.Row():
                steer_feature = gr.Number(value=0, precision=0, label="feature", elem_id="steer-feature")
                guard_number(steer_feature, "The feature", lo=0, whole=True)
                strength = gr.Slider(-200, 200, value=40, step=0.1, label="strength", elem_id="steer-strength")
                steer_new = gr.Slider(1, 64, value=STEER_TOKENS, step=1, label="new tokens", elem_id="steer-tokens")
                temperature = gr.Slider(0, 2, value=0.5, step=0.05, label="temperature", elem_id="steer-temperature")
                seed = gr.Number(value=0, precision=0, label="seed", elem_id="steer-seed")
            steer_note = gr.Markdown(elem_id="steer-note")
            steer_btn = gr.Button("Steer", variant="primary", elem_id="steer-run")
            with gr.Row():
                default_text = gr.Textbox(label="default", lines=5, interactive=False, elem_id="steer-default")
                steered_text = gr.Textbox(label="steered", lines=5, interactive=False, elem_id="steer-steered")
        build_training_panel(fh.ctx, fh.saes, source, picker, queues)

    shown = {"show_progress_on": card}
    show_events = [
        show_btn.click(fh.show, [picker, feature, source], [feature, card], api_name="feature_show", **shown,
                       **queues.jobs),
        feature.submit(fh.show, [picker, feature, source], [feature, card], api_name="feature_submit", **shown,
                       **queues.jobs),
    ]
    for html_box in (card, token_features, results):
        show_events.append(html_box.click(fh.open, [picker, source], [feature, card], api_visibility="private",
                                          **shown, **queues.jobs))
    cancel_btn.click(fh.cancel, None, status, cancels=show_events, api_name="feature_cancel", **queues.light)
    feature.change(lambda f: f, feature, steer_feature, api_visibility="private", **queues.light)
    # The feature's scan is there once its page shows: scale the strength by it, whichever way the page was opened
    # (Show, Enter, or a click on a neighbour or a prompt's feature), so the note never names another feature.
    for shown_event in show_events:
        shown_event.success(fh.steer_scale, [picker, feature, source], [strength, steer_note],
                            api_name="steer_scale_after_show", api_visibility="private", **queues.light)
    steer_feature.submit(fh.steer_scale, [picker, steer_feature, source], [strength, steer_note],
                         api_name="steer_scale", **queues.light)
    prompt_btn.click(fh.prompt_features, [prompt, chat, picker, source], [tokens, token_features, found],
                     api_name="feature_prompt", **queues.model)
    tokens.click(fh.token, found, token_features, api_visibility="private", **queues.light)
    token_pos.submit(fh.token_at, [found, token_pos], token_features, api_name="feature_token", **queues.light)
    gr.on([search_btn.click, query.submit], fh.search, [picker, query, mode, source], results,
          api_name="feature_search", **queues.jobs)
    steer_btn.click(fh.steer, [prompt, chat, picker, steer_feature, strength, steer_new, temperature, seed, source],
                    [default_text, steered_text], api_name="steer", **queues.decode)
    source.change(fh.model_changed, source, [picker, status, card, tokens, found], api_visibility="private",
                  **queues.light)
    tab.select(fh.choices, [source, picker], picker, api_visibility="private", **queues.light)
    return picker
