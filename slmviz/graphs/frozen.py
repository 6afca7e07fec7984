"""The local replacement model of one prompt (circuit-tracer's): attention patterns and norm scales frozen at the
prompt's values, each MLP output replaced by its transcoder's features + an error term, so the model is linear in
the sources (token embeddings, feature decoder vectors, errors) between the embedding and every feature or logit.

Why freezing makes it linear: with the pattern a constant, attention is pattern · (norm(x) W_v) W_o, and with the
norm's divisor a constant, norm(x) is x · weight / scale (minus the mean for LayerNorm); both linear in x. The MLP's
own non-linearity is cut: its output becomes the prompt's value, held constant, plus the transcoder's skip path
x · W_skipᵀ where it has one (linear, so gradients flow through it, as in circuit-tracer's ReplacementModel).

What stays outside every node and so forms each target's `constant` (`replacement_constant`): b_dec, the
attention/MLP biases of families that have them, a LayerNorm's bias, and whatever `zero_bos` zeroes.
The replacement itself (which coders read and write where, their decoder vectors, the frozen forward) belongs to the
replacement set (replacement.base.ReplacementSet); this module captures the prompt's run it freezes and the sources a
graph's nodes stand for (`active_features`: the features, their writes, the error terms), and attribution.py turns
the set's gradients into a graph (qk.py and head_loadings.py rebuild the same sources to look inside its attention).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import TranscoderSetError
from ..hooks import build_context, layer_hook_name
from ..replacement.base import ReplacementSet
from ..replacement.transcoder_set import as_replacement
from ..variants import resolve_variant


class AttributionGraphError(ValueError):
    """Bad input to slmviz.attribution_graph: no transcoders, a transcoder for another model or site, a prompt
    too long for the memory budget."""


def checked_transcoders(transcoders: Any, model: Any) -> ReplacementSet:
    """`transcoders=` as a replacement set that fits `model` (a set, one transcoder or a list); each problem is an
    AttributionGraphError naming the coder."""
    try:
        ts = as_replacement(transcoders)
        ts.check_model(model)
    except TranscoderSetError as e:
        raise AttributionGraphError(str(e)) from e
    return ts


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
    mlp_in: list[torch.Tensor]  # per layer [pos, d_model]: what the set's layer-L features read (mlp.hook_in)
    mlp_out: list[torch.Tensor]  # per layer [pos, d_model], blocks.L.hook_mlp_out
    final_scale: torch.Tensor  # [1, pos, 1] ln_final's divisor


def prompt_state(model: Any, ids: torch.Tensor, transcoders: Any = None) -> PromptState:
    """Run the prompt once, capturing what the replacement model freezes and reads (each layer's read hook is the
    set's, `blocks.L.mlp.hook_in` without one)."""
    cfg, dec = model.cfg, model.decoder
    n = cfg.n_layers
    reads = [transcoders.read_hook(L) if transcoders is not None else layer_hook_name(L, "mlp.hook_in")
             for L in range(n)]
    outs = [layer_hook_name(L, "hook_mlp_out") for L in range(n)]
    names = [*frozen_names(model.hook_names), "hook_embed", *reads, *outs]
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
        embed=s["hook_embed"][0], mlp_in=[s[r][0] for r in reads],
        mlp_out=[s[layer_hook_name(L, "hook_mlp_out")][0] for L in range(n)], final_scale=scales[0].clone(),
    )


def frozen_forward(model: Any, state: PromptState, transcoders: Any, embed: torch.Tensor,
                   deltas: Sequence[torch.Tensor], grad: bool = False, last_layer: int | None = None,
                   hooks: Mapping[str, Any] | None = None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The set's local replacement model (ReplacementSet.frozen_forward); `transcoders` as attribution_graph takes
    them."""
    return as_replacement(transcoders).frozen_forward(model, state, embed, deltas, grad=grad,
                                                      last_layer=last_layer, hooks=hooks)


def demeaned_unembed(unembed: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The vectors [k, d_model] (fp32) a graph's logit nodes read ln_final's output through: W_U[tok] minus the mean
    over the vocabulary of W_U, so a target is logit[tok] - mean(logits), which is what moves the token's
    probability (a shift of every logit does not). Reading W_U[tok] itself would attribute that shift too, and the
    graph's edges would no longer sum to what the logit nodes stand for (tests/test_attribution_graph.py checks the
    sums against a plain forward)."""
    w = unembed.float()  # [vocab, d_model]
    return w[token_ids] - w.mean(0, keepdim=True)


@dataclass
class Writes:
    """What the active features add to the MLP outputs: one entry per (feature node, layer it writes): the node's
    index, the layer written, and the vector [d_model] (fp32) as `scale · table[row]`. A per-layer transcoder
    writes its own layer once; a cross-layer transcoder's feature writes every later layer too.

    Why a table: the vector is the feature's activation times a decoder row that depends on the feature alone, and a
    feature fires at many positions. Stored per write, a CLT's vectors grow with the prompt (each active feature
    writes every later layer, so the memory budget stopped a CLT's graphs at a few dozen tokens; the figures are in
    docs/cross-layer-transcoders.md); the table holds each (feature, layer written) row once, at most the CLT's
    decoder, whatever the length."""

    node: torch.Tensor  # [w] long: the feature node (0..n_features-1)
    layer: torch.Tensor  # [w] long: the MLP output written
    scale: torch.Tensor  # [w] fp32: the feature's activation at the node
    row: torch.Tensor  # [w] long: its unit-activation vector's row in `table`
    table: torch.Tensor  # [r, d_model] fp32: the distinct unit-activation vectors

    def vec(self, idx: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """The vectors [n, d_model] of writes `idx`."""
        return self.scale[idx, None] * self.table[self.row[idx]]

    def values(self) -> int:
        """What the writes hold, in fp32-sized values (graph_memory_bytes' `write_values`)."""
        return writes_values(self.table.shape[0], len(self.node), self.table.shape[1])

    def select(self, features: torch.Tensor) -> Writes:
        """The writes of `features` (sorted feature node indices), renumbered 0..len(features)-1; the table is
        shared."""
        size = max(int(self.node.max()) if len(self.node) else -1, int(features.max()) if len(features) else -1) + 1
        dev = self.node.device
        new = torch.full((size,), -1, dtype=torch.long, device=dev)
        new[features.to(dev)] = torch.arange(len(features), device=dev)
        keep = new[self.node] >= 0 if len(self.node) else torch.zeros(0, dtype=torch.bool, device=dev)
        return Writes(new[self.node[keep]], self.layer[keep], self.scale[keep], self.row[keep], self.table)


def writes_values(table_rows: int | torch.Tensor, n_writes: int | torch.Tensor, d_model: int) -> int | torch.Tensor:
    """Writes' size in fp32-sized values: the table's rows, and per write three int64 indices (two values each) and
    the scale. Also what bench/studies/longest_prompt.py counts a prompt's writes by, before any graph is built."""
    return table_rows * d_model + 7 * n_writes


def active_features(ts: Any, state: PromptState, n_layers: int, zero_bos: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Writes,
                               torch.Tensor]:
    """Phase 0 (circuit-tracer's setup_attribution): the active features of the prompt, ordered by layer, position,
    feature, as (layer, position, feature, activation, encoder rows [n, d_model], writes, errors [n_layers, pos,
    d_model]), from the set's compute_attribution_components. A layer's error is its MLP output minus the set's
    prediction there (the whole output where nothing writes). `zero_bos` drops position 0's features and errors."""
    c = ts.compute_attribution_components(state.mlp_in, zero_bos)
    writes = Writes(c.write_feature, c.write_layer, c.activation[c.write_feature], c.write_row, c.decoder)
    errors = torch.zeros(n_layers, len(state.ids), state.embed.shape[-1], device=state.embed.device)
    for layer in range(n_layers):
        out = state.mlp_out[layer].float()
        errors[layer] = out - c.reconstruction[layer] if layer in c.reconstruction else out
    if zero_bos:
        errors[:, 0] = 0
    return c.layer, c.position, c.feature, c.activation, c.encoder, writes, errors
