"""Direct logit attribution: how much each component's write into the residual stream adds to a logit difference.

The final residual at a position is a sum of writes: the embedding, then each layer's attention and MLP output
(`hook_attn_out`, `hook_mlp_out` are exactly what is added on every family, docs/hook-names.md). The logit difference
is `(W_U[answer] - W_U[wrong]) · norm(x)`, and the final norm is not linear, so the usual trick is applied:
freeze its scale (the `ln_final.hook_scale` the run actually had at that position) and keep its weight. With
the scale frozen the readout is a linear map, `direction · x`, and every write gets its share exactly:

    Σ rows = direction · x_final = the model's logit difference (up to fp32 rounding of the run itself).

The rows: per layer (`by="layer"`: attention, MLP), per head (`by="head"`: each head's z_h · W_o[h], plus the
MLPs), or per MLP neuron (`by="neuron"`: post_n · W_down[:, n], plus the attention layers), and one
`remainder` row: the embedding (with GPT-2's learned positions) and every bias (o_proj, down_proj, the final
LayerNorm's), which belong to no head or neuron.

Families with a norm *inside* the branch (Gemma's ln1_post / ln2_post, OLMo-2's output norms) are exact too:
hook_attn_out already is the normalised write, and for the split into heads or neurons that norm's scale is
frozen in the same way (its `hook_scale` at the position). What stays approximate is what attribution cannot
express: the frozen scales themselves depend on every component (changing one write would change them).
The `post_norm` variant normalises the residual stream itself, so its final residual is no sum of writes and
attribution refuses it.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
import torch

from ..hooks import layer_hook_name
from ..metrics import single_token_id
from ..model.norm import normalize
from .traced import Traced

BY = ("layer", "head", "neuron")


def logit_attribution(trace: Traced, answer: str | int, wrong: str | int | None = None, by: str = "layer",
                      position: int = -1) -> pd.DataFrame:
    """DataFrame: component, kind, layer, head, neuron, attribution; rows sum to the logit difference.

    `frame.attrs["logit_diff"]` is the model's own logit(answer) - logit(wrong) at `position`. Where the family
    soft-caps its logits (Gemma 2), the readout is linear only before the cap: the rows sum to
    `frame.attrs["logit_diff_before_cap"]`, and logit_diff is the capped value beside it.
    """
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    model = trace._model
    if model is None:
        raise RuntimeError("Logit attribution needs the model's weights: this trace was loaded from disk; "
                           "re-trace the prompt with a model")
    cfg, p = trace.config, model.decoder.params
    n_pos = len(trace.tokens)
    if not -n_pos <= position < n_pos:
        raise ValueError(f"position must be in -{n_pos}..{n_pos - 1}, got {position}")
    pos = position % n_pos
    conv = _conventions(trace)
    if conv["norm"] == "post":
        raise ValueError("The post_norm variant normalises the residual stream itself (resid = N(x + F(x))), so the "
                         "final residual is not a sum of component writes; logit attribution needs another variant")
    a = single_token_id(model.tokenizer, answer, cfg.vocab_size, "answer")
    w = None if wrong is None else single_token_id(model.tokenizer, wrong, cfg.vocab_size, "wrong")
    positions = ["hook_pos_embed"] if "hook_pos_embed" in model.hook_names else []
    need = ["hook_embed", *positions, "ln_final.hook_scale"] + [
        layer_hook_name(L, hook) for L in range(cfg.n_layers) for hook in ("hook_attn_out", "hook_mlp_out")]
    need += [layer_hook_name(L, "attn.hook_z") for L in range(cfg.n_layers)] if by == "head" else []
    need += [layer_hook_name(L, "mlp.hook_post") for L in range(cfg.n_layers)] if by == "neuron" else []
    missing = [n for n in need if n not in trace]
    if missing and not (missing == ["ln_final.hook_scale"] and conv["norm"] == "none"):
        raise KeyError(f"Logit attribution by {by} reads {len(need)} hooks; this trace lacks {missing[:3]}"
                       f"{' ...' if len(missing) > 3 else ''}. Traced with names=None (everything) or include them")

    def at(name: str) -> torch.Tensor:
        return trace[name][pos].double()

    # the two rows, then fp64: the whole unembedding in fp64 is a GB on Gemma's 262,144-token vocabulary
    readout = p.unembed[a].double() - (p.unembed[w].double() if w is not None else 0.0)  # [d_model]
    direction = readout if conv["norm"] == "none" else _through_norm(
        readout, _weight(p.ln_final, conv), at("ln_final.hook_scale"), conv["norm_type"])  # [d_model]

    rows: list[tuple[str, str, int | None, int | None, int | None, float]] = []
    remainder = float(direction @ at("hook_embed"))
    if "hook_pos_embed" in model.hook_names:  # learned positions (GPT-2) are part of the embedding's write
        remainder += float(direction @ at("hook_pos_embed"))
    if p.ln_final_bias is not None and conv["norm"] != "none":  # LayerNorm's bias: a constant of the readout
        remainder += float(readout @ p.ln_final_bias.double())
    h, dh = cfg.n_heads, cfg.d_head
    for L, lp in enumerate(p.layers):
        d_attn = _branch_direction(trace, direction, lp, "ln1_post", L, pos, conv)  # [d_model]
        d_mlp = _branch_direction(trace, direction, lp, "ln2_post", L, pos, conv)
        attn_bias = float(d_attn @ lp.b_o.double()) if lp.b_o is not None else 0.0
        mlp_bias = float(d_mlp @ lp.b_down.double()) if lp.b_down is not None else 0.0
        remainder += attn_bias + mlp_bias
        attn = float(direction @ at(layer_hook_name(L, "hook_attn_out"))) - attn_bias
        mlp = float(direction @ at(layer_hook_name(L, "hook_mlp_out"))) - mlp_bias
        if by == "head":
            per_dim = (d_attn @ lp.w_o.double()).view(h, dh)  # [h * dh] -> [h, dh]: direction read back per head
            heads = (per_dim * at(layer_hook_name(L, "attn.hook_z"))).sum(-1)  # [h]
            rows += [(f"L{L}H{i}", "head", L, i, None, float(v)) for i, v in enumerate(heads)]
        else:
            rows.append((f"L{L} attn", "attn", L, None, None, attn))
        if by == "neuron":
            per_neuron = (d_mlp @ lp.w_down.double()) * at(layer_hook_name(L, "mlp.hook_post"))  # [d_mlp]
            rows += [(f"L{L}N{n}", "neuron", L, None, n, float(v)) for n, v in enumerate(per_neuron)]
        else:
            rows.append((f"L{L} mlp", "mlp", L, None, None, mlp))
    rows.append(("remainder (embedding + biases)", "remainder", None, None, None, remainder))
    frame = pd.DataFrame(rows, columns=["component", "kind", "layer", "head", "neuron", "attribution"])
    for col in ("layer", "head", "neuron"):
        frame[col] = frame[col].astype("Int64")
    logits = trace.logits[pos].double()
    frame.attrs["logit_diff"] = float(logits[a] - (logits[w] if w is not None else 0.0))
    c = model.decoder.conventions(trace.variant)
    if c.final_softcap is not None:  # Gemma 2: the rows split the difference before cap · tanh(logits / cap)
        final = trace[layer_hook_name(cfg.n_layers - 1, "hook_resid_post")][pos][None].double()
        normed = normalize(final, model.decoder.final_norm_factor(c).double(), cfg.norm_eps, c.norm_type,
                           weight_in_fp32=c.norm_weight_in_fp32)[0]
        frame.attrs["logit_diff_before_cap"] = float(readout @ normed)
    frame.attrs["metric"] = (f"logit({trace.token_string(a)!r})"
                             + (f" - logit({trace.token_string(w)!r})" if w is not None else ""))
    frame.attrs["position"] = pos
    return frame


def _through_norm(direction: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, norm_type: str) -> torch.Tensor:
    """The transpose of the frozen-scale norm x -> weight · centre(x) / scale, applied to a readout direction.

    RMSNorm does not centre; the layer_norm variant subtracts the mean, a symmetric projection, so the
    transposed map centres the weighted direction.
    """
    v = direction * weight.double() / scale.double()  # [d_model]
    return v - v.mean() if norm_type == "layer" else v


def _branch_direction(trace: Traced, direction: torch.Tensor, lp: Any, slot: str, layer: int, pos: int,
                      conv: dict[str, Any]) -> torch.Tensor:
    """The direction read back through a norm inside the branch (ln1_post / ln2_post), if the family has one."""
    weight = getattr(lp, slot, None)
    if weight is None or conv["norm"] not in ("output", "sandwich"):
        return direction
    name = layer_hook_name(layer, f"{slot}.hook_scale")
    if name not in trace:
        raise KeyError(f"Splitting a post-normed branch into heads or neurons needs {name!r}; trace with names=None")
    return _through_norm(direction, _weight(weight, conv), trace[name][pos], conv["norm_type"])


def _weight(weight: torch.Tensor, conv: dict[str, Any]) -> torch.Tensor:
    """The factor a norm really multiplies by: w, or (1 + w) on Gemma (`norm_offset`)."""
    return weight.double() + conv["norm_offset"]


def _conventions(trace: Traced) -> dict[str, Any]:
    """norm placement, norm type and norm offset of the trace's run, as its decoder resolved them for the checkpoint."""
    c = trace._model.decoder.conventions(trace.variant)
    return {"norm": c.norm, "norm_type": c.norm_type, "norm_offset": float(c.norm_offset)}
