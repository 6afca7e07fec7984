"""Short automatic labels for features, offline: the tokens a feature fires on and the tokens it promotes.

    sae.label(12, scan=s, model=m)     # '[auto] of «France» and → Paris / French'
    sae.labels[12] = "says Paris"      # an edited label: sae.label(12) returns it from now on
    g.labels                           # {node_id: label} of an attribution graph's feature nodes, the same labels

A label made here starts with AUTO ("[auto] ") so that nobody mistakes it for a person's reading of the feature.
It is built from two lists:

- the tokens it fires on: its top activating example's token with a word of context either side ("of «France»
  and": in_context), then the other distinct tokens (stripped) of its top activating contexts in a feature scan, in
  rank order (the scan's top_examples), at most `n` in all; left out without a scan;
- the tokens it promotes: the top `n` of W_dec[f] · W_U (the final norm's weight folded in), exactly the
  "promoted" rows of SAE.logit_effects, computed for many features in one matmul per chunk.

Deterministic for a given scan and SAE: ties in topk are broken the way torch.topk breaks them on CPU, and the
scan's top examples are sorted by the scan. Edited labels (sae.labels, AttributionGraph.label) always win.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

AUTO = "[auto] "
N_TOKENS = 2
CONTEXT_CHARS = 12  # at most this much of the word before and after the top example's token
# Byte-level BPE's marks for a space, a new line and a tab (GPT-2's Ġ Ċ ĉ, SentencePiece's ▁), should a token reach
# a label undecoded: "ĠParis" reads " Paris".
BYTE_MARKS = {"Ġ": " ", "Ċ": "\n", "ĉ": "\t", "▁": " "}
CHUNK = 256  # features per [chunk, d_model] @ [d_model, vocab] matmul: ~50 MB of fp32 on SmolLM2


def is_automatic(label: str | None) -> bool:
    """True for a label this module made (it starts with AUTO) or an empty one."""
    return not label or label.startswith(AUTO)


def _clean(token: str) -> str:
    for mark, text in BYTE_MARKS.items():
        token = token.replace(mark, text)
    t = token.replace("\n", "\\n").strip()
    return t if t else repr(token)


def in_context(context: str) -> str:
    """A top example's token in a word of its context: 'the state of [[ Texas]] is' -> 'of «Texas» is', and
    'the mon[[ster]]s' -> 'mon«ster»s' (a piece of a word reads with the rest of it). `context` is
    Scan.top_examples' text with the token in [[ ]]; without the brackets, the text cleaned."""
    for mark, text in BYTE_MARKS.items():
        context = context.replace(mark, text)
    match = re.search(r"\[\[(.*?)\]\]", context, flags=re.S)
    if match is None:
        return _clean(context)
    token = match.group(1)
    before = re.search(r"\S*\s*$", context[:match.start()]).group(0)[-CONTEXT_CHARS:]
    after = re.match(r"\s*\S*", context[match.end():]).group(0)[:CONTEXT_CHARS]
    lead = " " if token[:1].isspace() and not before[-1:].isspace() else ""
    said = f"{before}{lead}«{_clean(token)}»{after}".replace("\n", " ")
    return " ".join(said.split())


def _distinct(tokens: Iterable[str], n: int) -> list[str]:
    out: list[str] = []
    for t in tokens:
        c = _clean(t)
        if c not in out:
            out.append(c)
        if len(out) == n:
            break
    return out


def promoted_tokens(sae: Any, features: Sequence[int], model: Any, n: int = N_TOKENS) -> dict[int, list[str]]:
    """{feature: the n tokens W_dec[f] · W_U promotes most} (SAE.logit_effects' "promoted" rows, batched)."""
    from ..variants import resolve_variant

    features = sorted({int(f) for f in features})
    if not features:
        return {}
    decoder = model.decoder
    factor = decoder.final_norm_factor(decoder.conventions(resolve_variant(None, model.cfg))).float()
    unembed = decoder.params.unembed.float()  # [vocab, d_model]
    out: dict[int, list[str]] = {}
    for start in range(0, len(features), CHUNK):
        chunk = features[start:start + CHUNK]
        rows = torch.stack([sae.residual_direction(f, model) for f in chunk])  # [c, d_model]
        effects = (rows.to(unembed.device) * factor) @ unembed.T  # [c, d_model] @ [d_model, vocab] -> [c, vocab]
        # 3n candidates: several tokens strip to the same text (" Paris", "Paris")
        top = effects.topk(min(3 * n, effects.shape[-1]), dim=-1).indices.cpu()  # [c, 3n]
        for f, ids in zip(chunk, top.tolist(), strict=True):
            out[f] = _distinct(model.to_strings(ids), n)
    return out


def activating_tokens(scan: Any, sae: Any, feature: int, n: int = N_TOKENS) -> list[str]:
    """The first n distinct tokens of the feature's top activating contexts in `scan` (empty if it never fired)."""
    from .dashboard import top_contexts

    return _distinct(top_contexts(scan, sae, feature)["token"].tolist(), n)


def activating_side(scan: Any, sae: Any, feature: int, n: int = N_TOKENS) -> list[str]:
    """What a label says the feature fires on: its top example in context (in_context), then the next distinct
    tokens of its top contexts, n in all (empty if it never fired)."""
    from .dashboard import top_contexts

    top = top_contexts(scan, sae, feature)
    if not len(top):
        return []
    first = _clean(str(top["token"].iat[0]))
    rest = [t for t in _distinct(top["token"].tolist(), n + 1) if t != first][: n - 1]
    return [in_context(str(top["context"].iat[0])), *rest]


def compose(fires: Sequence[str], promotes: Sequence[str]) -> str:
    """'[auto] of «France» and / French → Paris / French' (either side may be missing)."""
    left, right = " / ".join(fires), " / ".join(promotes)
    if left and right:
        return f"{AUTO}{left} → {right}"
    if right:
        return f"{AUTO}→ {right}"
    return f"{AUTO}{left}" if left else f"{AUTO}(no tokens)"


def auto_labels(sae: Any, features: Iterable[int], model: Any = None, scan: Any = None,
                n: int = N_TOKENS) -> dict[int, str]:
    """{feature: automatic label}. `model` (default: the SAE's, load_sae(..., model=m)) gives the promoted tokens;
    `scan` (a feature scan of the SAE's hook_sae_acts_post) the tokens it fires on. Without either, that side is
    left out."""
    features = [int(f) for f in features]
    model = model if model is not None else getattr(sae, "model", None)
    promotes = promoted_tokens(sae, features, model, n) if model is not None else {}
    out = {}
    for f in features:
        fires = activating_side(scan, sae, f, n) if scan is not None else []
        out[f] = compose(fires, promotes.get(f, []))
    return out


__all__ = ["AUTO", "activating_side", "activating_tokens", "auto_labels", "compose", "in_context", "is_automatic",
           "promoted_tokens"]
