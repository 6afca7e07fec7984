"""The local replacement model of one prompt (circuit-tracer's): attention patterns and norm scales frozen at the
prompt's values, each MLP output replaced by its transcoder's features + an error term, so the model is linear in
the sources (token embeddings, feature decoder vectors, errors) between the embedding and every feature or logit.

Why freezing makes it linear: with the pattern a constant, attention is pattern · (norm(x) W_v) W_o, and with the
norm's divisor a constant, norm(x) is x · weight / scale (minus the mean for LayerNorm); both linear in x. The MLP's
own non-linearity is cut: its output becomes the prompt's value, held constant, plus the transcoder's skip path
x · W_skipᵀ where it has one (linear, so gradients flow through it, as in circuit-tracer's ReplacementModel).

What stays outside every node and so forms each target's `constant` (`replacement_constant`): b_dec, the
attention/MLP biases of families that have them, a LayerNorm's bias, and whatever `zero_bos` zeroes.
This module runs the model; attribution.py turns its gradients into a graph.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..hooks import build_context
from ..model.norm import unhooked
from ..variants import resolve_variant

_IN = re.compile(r"blocks\.(\d+)\.mlp\.hook_in")
_OUT = re.compile(r"blocks\.(\d+)\.hook_mlp_out")


class AttributionGraphError(ValueError):
    """Bad input to slmviz.attribution_graph: no transcoders, a transcoder for another model or site, a prompt
    too long for the memory budget."""


def transcoder_layer(sae: Any, d_model: int, n_layers: int) -> int:
    """The layer a transcoder replaces; refuses one that reads or writes anywhere else, or another model's width.

    circuit-tracer's transcoders read the MLP's input and write its output; here that is `blocks.L.mlp.hook_in` ->
    `blocks.L.hook_mlp_out` (DESIGN.md "Features"). An SAE of the residual stream, or a transcoder whose d_in is not
    this model's d_model, would run and give a graph of nothing.
    """
    hook_in, hook_out = str(getattr(sae, "hook_name", "")), str(getattr(sae, "hook_name_out", ""))
    m_in, m_out = _IN.fullmatch(hook_in), _OUT.fullmatch(hook_out)
    if not (m_in and m_out and m_in.group(1) == m_out.group(1)):
        raise AttributionGraphError(
            f"{sae!r} reads {hook_in!r} and writes {hook_out!r}; an attribution graph needs transcoders that read "
            f"blocks.L.mlp.hook_in and write blocks.L.hook_mlp_out of the same layer L (an SAE of another site "
            f"cannot replace an MLP)")
    layer = int(m_in.group(1))
    if layer >= n_layers:
        raise AttributionGraphError(f"{sae!r} is for layer {layer}; this model has layers 0..{n_layers - 1}")
    if sae.d_in != d_model or sae.d_out != d_model:
        raise AttributionGraphError(
            f"{sae!r} has d_in={sae.d_in}, d_out={sae.d_out}, but this model's d_model is {d_model}: "
            f"it is a transcoder for another model")
    return layer


def checked_transcoders(transcoders: Any, d_model: int, n_layers: int) -> dict[int, Any]:
    """{layer: transcoder}, each validated (transcoder_layer); at least one, at most one per layer."""
    if transcoders is None or (isinstance(transcoders, Sequence) and len(transcoders) == 0):
        raise AttributionGraphError(
            "attribution_graph needs transcoders=[...]: features are what its nodes are. Load one with "
            "slmviz.load_sae(name, model=m); slmviz.bundled_saes(m) lists those that ship (transcoder_l6, ...)")
    if not isinstance(transcoders, Sequence):
        transcoders = [transcoders]
    by_layer: dict[int, Any] = {}
    for sae in transcoders:
        if not all(hasattr(sae, a) for a in ("W_enc", "W_dec", "hook_name", "hook_name_out")):
            raise AttributionGraphError(f"transcoders must be slmviz SAE objects (slmviz.load_sae), got {sae!r}")
        layer = transcoder_layer(sae, d_model, n_layers)
        if layer in by_layer:
            raise AttributionGraphError(f"two transcoders for layer {layer}: {by_layer[layer]!r} and {sae!r}")
        by_layer[layer] = sae
    return dict(sorted(by_layer.items()))


def decoder_vectors(sae: Any, features: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
    """What each active feature adds to the MLP output: acts [n] · W_dec[features] -> [n, d_model] (fp32).

    A topk SAE with rescale_acts_by_decoder_norm divides its activation by |W_dec[f]| before decoding (SAE.decode),
    so the vector it writes is (a / |W_dec[f]|) W_dec[f].
    """
    w = sae.W_dec.detach()[features].float()  # [n, d_model]
    a = acts.float()
    if getattr(sae, "architecture", "") == "topk" and getattr(sae, "rescale_acts_by_decoder_norm", False):
        a = a / w.norm(dim=-1)
    return a[:, None] * w


def skip_of(sae: Any, x: torch.Tensor) -> torch.Tensor:
    """The transcoder's linear skip path x · W_skipᵀ (zeros without W_skip): the part of the MLP replacement that
    depends on the input, and so carries gradients between layers."""
    if getattr(sae, "W_skip", None) is None:
        return torch.zeros_like(x)
    return (x.to(sae.W_skip.dtype) @ sae.W_skip.T).to(x.dtype)  # [..., d_in] -> [..., d_out]


def frozen_names(hook_names: Sequence[str]) -> list[str]:
    """The hooks whose prompt values are frozen: every attention pattern and every norm's scale (ln1, ln2, the
    post-norms of Gemma and OLMo-2, q/k norms, ln_final), as circuit-tracer's stop_gradient hooks."""
    return [n for n in hook_names if n.endswith("attn.hook_pattern") or n.endswith("hook_scale")]


@dataclass
class PromptState:
    """One prompt's run: what the replacement model freezes, and what its nodes are built from (fp32 where said)."""

    ids: torch.Tensor  # [pos]
    logits: torch.Tensor  # [pos, vocab], the model's own
    frozen: dict[str, torch.Tensor]  # hook name -> [1, ...] pattern or scale
    embed: torch.Tensor  # [pos, d_model] hook_embed: what enters the residual stream (Gemma's scale included)
    mlp_in: list[torch.Tensor]  # per layer [pos, d_model], blocks.L.mlp.hook_in
    mlp_out: list[torch.Tensor]  # per layer [pos, d_model], blocks.L.hook_mlp_out
    final_scale: torch.Tensor  # [1, pos, 1] ln_final's divisor


def prompt_state(model: Any, ids: torch.Tensor) -> PromptState:
    """Run the prompt once, capturing what the replacement model freezes and reads."""
    cfg, dec = model.cfg, model.decoder
    n = cfg.n_layers
    names = [*frozen_names(model.hook_names), "hook_embed",
             *[f"blocks.{L}.mlp.hook_in" for L in range(n)], *[f"blocks.{L}.hook_mlp_out" for L in range(n)]]
    names = [x for x in names if x != "ln_final.hook_scale"]
    ctx = build_context(model.hook_names, names, batched=True)
    v = resolve_variant(None, cfg)
    with torch.inference_mode():
        resid = dec.forward(ids[None], ctx, v, stop_after_layer=n - 1)  # [1, pos, d_model]
        scales: list[torch.Tensor] = []

        def keep(s: torch.Tensor) -> torch.Tensor:
            scales.append(s)
            return s

        normed = dec.final_norm(resid, dec.conventions(v), keep)
        logits = normed @ dec.params.unembed.T  # [1, pos, vocab]
        if cfg.final_logit_softcap is not None:
            logits = torch.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    # Inference tensors cannot be saved for backward: plain copies, so the frozen values can be autograd constants.
    s = {k: t.clone() for k, t in ctx.store.items()}
    return PromptState(
        ids=ids, logits=logits[0].clone(),
        frozen={k: s[k] for k in names if k in s and k.endswith(("pattern", "scale"))},
        embed=s["hook_embed"][0], mlp_in=[s[f"blocks.{L}.mlp.hook_in"][0] for L in range(n)],
        mlp_out=[s[f"blocks.{L}.hook_mlp_out"][0] for L in range(n)], final_scale=scales[0].clone(),
    )


def frozen_forward(
    model: Any, state: PromptState, transcoders: dict[int, Any], embed: torch.Tensor, deltas: Sequence[torch.Tensor],
    grad: bool = False, last_layer: int | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The local replacement model on a batch: embed [b, pos, d_model] enters the residual stream in place of the
    tokens' embeddings, and layer L's MLP output is

        prompt's mlp_out[L] - skip(prompt's mlp_in[L]) + skip(mlp_in[L]) + deltas[L]      [b, pos, d_model]

    (the prompt's output, its skip path live, plus an edit), under the prompt's attention patterns and norm scales.
    With embed = the prompt's and deltas = 0 it reproduces the prompt's run; it is linear in (embed, deltas).
    Returns (mlp_in per layer [b, pos, d_model], ln_final's output [b, pos, d_model]). `last_layer`: run blocks
    0..last_layer only (what feature targets up to that layer read) and return None for ln_final's output.
    """
    cfg, dec = model.cfg, model.decoder
    b = embed.shape[0]
    mlp_in: list[torch.Tensor | None] = [None] * cfg.n_layers

    def frozen(x: torch.Tensor, name: str) -> torch.Tensor:
        return state.frozen[name].expand_as(x)

    def inject(x: torch.Tensor, name: str) -> torch.Tensor:
        return embed

    def read_in(layer: int):
        def fn(x: torch.Tensor, name: str) -> None:
            mlp_in[layer] = x
        return fn

    def replace_out(layer: int):
        sae = transcoders.get(layer)

        def fn(x: torch.Tensor, name: str) -> torch.Tensor:
            base = state.mlp_out[layer]
            if sae is None:
                return (base + deltas[layer]).to(x.dtype)
            live = skip_of(sae, mlp_in[layer])
            return (base - skip_of(sae, state.mlp_in[layer]) + live + deltas[layer]).to(x.dtype)
        return fn

    fns: dict[str, Any] = {name: frozen for name in state.frozen}
    fns["hook_embed"] = inject
    for layer in range(cfg.n_layers):
        fns[f"blocks.{layer}.mlp.hook_in"] = read_in(layer)
        fns[f"blocks.{layer}.hook_mlp_out"] = replace_out(layer)
    ctx = build_context(model.hook_names, [], fns, batched=True)
    v = resolve_variant(None, cfg)
    ids = state.ids[None].expand(b, -1)
    stop = cfg.n_layers - 1 if last_layer is None else last_layer
    resid = dec.forward(ids, ctx, v, grad=grad, stop_after_layer=stop)  # [b, pos, d_model]
    if last_layer is not None:
        return [t for t in mlp_in if t is not None], None
    with torch.enable_grad() if grad else torch.inference_mode():
        scale = state.final_scale.expand(b, -1, -1)
        normed = dec.final_norm(resid, dec.conventions(v), lambda s: scale.to(s.dtype), unhooked)
    return [t for t in mlp_in if t is not None], normed
