"""The feature axis a corpus scan ranks for each hook: one number per (token, feature).

A scan needs, at every token, a vector of scalars it can rank and average. Most hooks already are one:
an MLP neuron (`mlp.hook_post` [pos, d_mlp]), a residual dimension ([pos, d_model]), a norm's scale
([pos, 1]). Two kinds are not, and these are the choices made here:

- **Per-head vectors** (`attn.hook_q/z/rot_q` [pos, h, d_head], `hook_k/v/rot_k` [pos, g, d_head],
  `attn.hook_result` [pos, h, d_model]): the feature is the L2 norm of each head's vector, one feature per
  head (h, or g for KV heads). "Which contexts make head 3's output largest" is the question people ask;
  a single component of z means little on its own. The raw per-position mean (what mean-ablation
  needs, [h, d_head]) is kept separately by the scan (`Scan.value_mean`).
- **Attention patterns** (`attn.hook_pattern` [h, pos_q, pos_k]): the feature of head h at query q is
  its strongest attention to an earlier token other than the first, max_{0<k<q} pattern[h, q, k].
  The first token is excluded because most heads park their attention there (the attention sink), and
  the query itself because attending to yourself says nothing about context; so a high value means
  "here this head looked back at one specific earlier token" (previous-token, induction, name-mover
  heads). Queries 0 and 1 have no such token: 0. Inside a window only: a window never sees earlier ones.

`attn.hook_attn_scores` has no feature (its masked entries are -inf; scan `hook_pattern` instead).
Every function takes the batched value [b, *shape] and returns [b, pos, n_features].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..hooks import HookNameError, check_names, hook_dims


@dataclass(frozen=True)
class Feature:
    """How one hook becomes [b, pos, n_features]: `fn`, the feature axis's name and a sentence for people."""

    hook: str
    axis: str  # "d_mlp", "d_model", "h", "g", "1"
    n: int
    what: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    per_position_value: bool  # the hook has a value per token (all but patterns): value_mean is defined
    value_shape: tuple[int, ...] | None = None  # one token's value, where the model's hook table does not know it


def identity(x: torch.Tensor) -> torch.Tensor:
    return x  # [b, pos, F]


def head_norm(x: torch.Tensor) -> torch.Tensor:
    return x.float().norm(dim=-1)  # [b, pos, h, d] -> [b, pos, h]


def max_attention_to_earlier(pattern: torch.Tensor) -> torch.Tensor:
    """[b, h, pos_q, pos_k] -> [b, pos_q, h]: max over 0 < k < q of pattern[b, h, q, k] (0 where q < 2)."""
    q, k = pattern.shape[-2:]
    earlier = torch.ones(q, k, dtype=torch.bool, device=pattern.device).tril(-1)  # k < q
    earlier[:, 0] = False  # not the first token (the attention sink)
    picked = pattern.float().masked_fill(~earlier, 0.0)
    return picked.amax(-1).transpose(1, 2)  # [b, h, q] -> [b, q, h]


# dims of a hook (hooks.LAYER_HOOKS) -> (feature fn, feature axis, description); the axis is the last dim
# for per-position hooks and "h" for patterns.
FEATURES: dict[tuple[str, ...], tuple[Callable[[torch.Tensor], torch.Tensor], str, str]] = {
    ("pos", "d_mlp"): (identity, "d_mlp", "the activation of each MLP neuron"),
    ("pos", "d_model"): (identity, "d_model", "each residual-stream dimension"),
    ("pos", "1"): (identity, "1", "the norm's scale (one value per token)"),
    ("pos", "d_sae"): (identity, "d_sae", "each SAE feature's activation"),
    ("pos", "d_sae_in"): (identity, "d_sae_in", "each dimension of the SAE's input"),
    ("pos", "d_sae_out"): (identity, "d_sae_out", "each dimension of the SAE's reconstruction"),
    ("pos", "h", "d_head"): (head_norm, "h", "the L2 norm of each query head's vector"),
    ("pos", "g", "d_head"): (head_norm, "g", "the L2 norm of each KV head's vector"),
    ("pos", "h", "d_model"): (head_norm, "h", "the L2 norm of each head's write into the residual stream"),
    ("h", "pos_q", "pos_k"): (
        max_attention_to_earlier, "h",
        "each head's strongest attention to an earlier token other than the first (the sink)"),
}


# Hooks shaped like a scannable one whose values are not: local name -> why, and what to scan instead.
UNSCANNABLE = {"attn.hook_attn_scores": "its masked entries are -inf and its scale is arbitrary; scan "
                                        "attn.hook_pattern instead"}


def feature_of(hook: str, valid_names: list[str], cfg: Any, saes: Sequence[Any] = ()) -> Feature:
    """The Feature of `hook` on a model with these hook names; a clear error for unknown or unscannable hooks.

    `saes`: SAEs spliced into the scan; their hooks (`{hook_name_out}.hook_sae_acts_post`: one feature per SAE
    feature) are scannable too, with the sizes the SAE reports (`splice_dims`, `splice_sizes`)."""
    sae_dims: dict[str, tuple[str, ...]] = {}
    sae_sizes: dict[str, int] = {}
    for sae in saes:
        if hook in sae.splice_dims():
            sae_dims, sae_sizes = sae.splice_dims(), sae.splice_sizes()
    check_names([hook], [*valid_names, *sae_dims] if sae_dims else valid_names)
    local = hook.split(".", 2)[2] if hook.startswith("blocks.") else hook
    if local in UNSCANNABLE:
        raise HookNameError(f"{hook!r} has no feature to scan: {UNSCANNABLE[local]}")
    dims = sae_dims.get(hook) or hook_dims(hook)
    if dims not in FEATURES:
        raise HookNameError(
            f"{hook!r} has no feature to scan (its entries are not one number per token and feature); "
            f"scan attn.hook_pattern for attention, or a hook shaped [pos, X] or [pos, heads, X]"
        )
    fn, axis, what = FEATURES[dims]
    sizes = {"d_mlp": cfg.d_mlp, "d_model": cfg.d_model, "h": cfg.n_heads, "g": cfg.n_kv_heads, "1": 1,
             "d_head": cfg.d_head, **sae_sizes}
    value_shape = tuple(sizes[d] for d in dims[1:]) if sae_dims else None
    return Feature(hook, axis, sizes[axis], what, fn, per_position_value=dims[0] == "pos", value_shape=value_shape)
