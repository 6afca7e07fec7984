"""Hook names, their shapes, and the per-run context that captures and intervenes.

Names follow TransformerLens so existing notebooks port over; the table is reproduced in
`LAYER_HOOKS` / `GLOBAL_HOOKS`, and tests/test_hooks.py runs the model and checks every name and shape.
Shapes are for one prompt, no batch dimension. Dim names: pos, d_model, h (query heads), g (KV heads),
d_head, d_mlp, pos_q, pos_k. `hook_k`/`hook_v` keep g KV heads (not expanded to h).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Any

import torch

HookFn = Callable[[torch.Tensor, str], torch.Tensor | None]
NameFilter = Iterable[str] | Callable[[str], bool] | None

# name → dims, in the order the forward pass reaches them. LAYER_HOOKS is the LLaMA family's block;
# `layer_hooks(cfg)` gives each family's own (norms after a sub-layer, QK-norm).
GLOBAL_HOOKS_BEFORE: dict[str, tuple[str, ...]] = {"hook_embed": ("pos", "d_model")}
# Learned absolute positions (GPT-2): TransformerLens's hook_pos_embed; resid_pre[0] = hook_embed + hook_pos_embed.
POS_EMBED_HOOKS: dict[str, tuple[str, ...]] = {"hook_pos_embed": ("pos", "d_model")}
_RESID_PRE = {"hook_resid_pre": ("pos", "d_model")}
_LN1 = {"ln1.hook_scale": ("pos", "1"), "ln1.hook_normalized": ("pos", "d_model")}
_QKV = {
    "attn.hook_q": ("pos", "h", "d_head"),
    "attn.hook_k": ("pos", "g", "d_head"),
    "attn.hook_v": ("pos", "g", "d_head"),
}
# QK-norm over each head's d_head (Qwen3, Gemma 3) or over the whole projection (OLMo-2).
_QK_NORM = {
    "head": {
        "attn.q_norm.hook_scale": ("pos", "h", "1"), "attn.q_norm.hook_normalized": ("pos", "h", "d_head"),
        "attn.k_norm.hook_scale": ("pos", "g", "1"), "attn.k_norm.hook_normalized": ("pos", "g", "d_head"),
    },
    "projection": {
        "attn.q_norm.hook_scale": ("pos", "1"), "attn.q_norm.hook_normalized": ("pos", "h*d_head"),
        "attn.k_norm.hook_scale": ("pos", "1"), "attn.k_norm.hook_normalized": ("pos", "g*d_head"),
    },
    "none": {},
}
_ROTARY = {
    "attn.hook_rot_q": ("pos", "h", "d_head"),
    "attn.hook_rot_k": ("pos", "g", "d_head"),
}
_ATTENTION = {
    "attn.hook_attn_scores": ("h", "pos_q", "pos_k"),
    "attn.hook_pattern": ("h", "pos_q", "pos_k"),
    "attn.hook_z": ("pos", "h", "d_head"),
    "attn.hook_result": ("pos", "h", "d_model"),
}
_LN1_POST = {"ln1_post.hook_scale": ("pos", "1"), "ln1_post.hook_normalized": ("pos", "d_model")}
_ATTN_OUT = {"hook_attn_out": ("pos", "d_model"), "hook_resid_mid": ("pos", "d_model")}
_LN2 = {"ln2.hook_scale": ("pos", "1"), "ln2.hook_normalized": ("pos", "d_model")}
# What the MLP receives: ln2's output *after* its weight (hook_resid_mid itself where no norm sits before the MLP).
# Not ln2.hook_normalized, which is before the weight (model.block.mlp_input says what breaks).
_MLP_IN = {"mlp.hook_in": ("pos", "d_model")}
_MLP = {
    "mlp.hook_pre": ("pos", "d_mlp"),
    "mlp.hook_gate": ("pos", "d_mlp"),
    "mlp.hook_pre_linear": ("pos", "d_mlp"),
    "mlp.hook_post": ("pos", "d_mlp"),
}
# An ungated MLP (GPT-2, GPT-NeoX), as TransformerLens names it: the pre-activation and act(pre).
_PLAIN_MLP = {"mlp.hook_pre": ("pos", "d_mlp"), "mlp.hook_post": ("pos", "d_mlp")}
_LN2_POST = {"ln2_post.hook_scale": ("pos", "1"), "ln2_post.hook_normalized": ("pos", "d_model")}
_MLP_OUT = {"hook_mlp_out": ("pos", "d_model"), "hook_resid_post": ("pos", "d_model")}
GLOBAL_HOOKS_AFTER: dict[str, tuple[str, ...]] = {
    "ln_final.hook_scale": ("pos", "1"),
    "ln_final.hook_normalized": ("pos", "d_model"),
}
# Every local name any family has, with its dims (a name's dims never depend on the family, except the
# QK-norm ones, which `layer_hooks` resolves).
ALL_LAYER_HOOKS: dict[str, tuple[str, ...]] = {
    **_RESID_PRE, **_LN1, **_QKV, **_QK_NORM["head"], **_ROTARY, **_ATTENTION, **_LN1_POST, **_ATTN_OUT, **_LN2,
    **_MLP_IN, **_MLP, **_LN2_POST, **_MLP_OUT,
}
# Opt-in hooks (TransformerLens's names; docs/circuits.md): the residual each head's query, each KV group's key
# and value, and the MLP branch read *before* their norm. An edit of one changes that reader only (the residual
# stream and the other heads keep theirs). They are h (or g) copies of the residual stream, so they are computed
# only when named, in a list of names or as a key of hooks=: never in a default full trace (names=None) nor
# chosen by a predicate. Not `mlp.hook_in`, which is after the norm.
INPUT_HOOKS: dict[str, tuple[str, ...]] = {
    "hook_q_input": ("pos", "h", "d_model"),
    "hook_k_input": ("pos", "g", "d_model"),
    "hook_v_input": ("pos", "g", "d_model"),
    "hook_mlp_in": ("pos", "d_model"),
}
# Values a trace computes on demand from another captured value instead of storing (local names): each
# head's write into the residual stream is z_h @ W_o[h] (model.block.per_head_result), [pos, h, d_model],
# the largest tensor of a full trace, and one matmul with o_proj's FLOPs per layer.
DERIVED_HOOKS = {"attn.hook_result": "attn.hook_z"}
# The residual stream's three stages of each block (plots, compare and the trace's pandas views read them).
RESIDUAL_STAGES = {"pre": "hook_resid_pre", "mid": "hook_resid_mid", "post": "hook_resid_post"}


def layer_hooks(cfg: Any = None) -> dict[str, tuple[str, ...]]:
    """Local hook name → dims of one block of `cfg`'s family, in execution order (None: the LLaMA block).

    A family has lnX before a sub-layer when its norms sit there (pre, sandwich) and lnX_post after it
    when they sit there (output, sandwich); q_norm / k_norm when it normalises queries and keys.
    """
    pre = cfg is None or cfg.has_pre_norms
    post = cfg is not None and cfg.has_post_norms
    qk = "none" if cfg is None else cfg.qk_norm
    mlp = _MLP if cfg is None or cfg.gated_mlp else _PLAIN_MLP
    # hook_rot_q / hook_rot_k on every family: with learned positions (GPT-2) nothing turns and they equal hook_q /
    # hook_k. TransformerLens has them on rotary models only; slmviz keeps them so that what reads the queries and
    # keys attention scores (QK attributions, circuits' frozen forwards) reads one name on every family.
    return {
        **_RESID_PRE, **(_LN1 if pre else {}), **_QKV, **_QK_NORM[qk], **_ROTARY, **_ATTENTION,
        **(_LN1_POST if post else {}), **_ATTN_OUT, **(_LN2 if pre else {}), **_MLP_IN, **mlp,
        **(_LN2_POST if post else {}), **_MLP_OUT,
    }


def global_hooks_before(cfg: Any = None) -> dict[str, tuple[str, ...]]:
    """The hooks before the first block: hook_embed, and hook_pos_embed where positions are learned (GPT-2)."""
    learned = cfg is not None and cfg.positions == "learned"
    return {**GLOBAL_HOOKS_BEFORE, **(POS_EMBED_HOOKS if learned else {})}


LAYER_HOOKS: dict[str, tuple[str, ...]] = layer_hooks()


def layer_hook_name(layer: int, local: str) -> str:
    return f"blocks.{layer}.{local}"


def hook_names(cfg_or_n_layers: Any) -> list[str]:
    """Every hook name of a model, in execution order: `hook_names(model.cfg)`, or `hook_names(n_layers)`
    for a LLaMA-family model of that depth."""
    cfg = None if isinstance(cfg_or_n_layers, int) else cfg_or_n_layers
    n_layers = cfg_or_n_layers if cfg is None else cfg.n_layers
    local_names = layer_hooks(cfg)
    names = list(global_hooks_before(cfg))
    for layer in range(n_layers):
        names += [layer_hook_name(layer, local) for local in local_names]
    return names + list(GLOBAL_HOOKS_AFTER)


def hook_dims(name: str, cfg: Any = None) -> tuple[str, ...]:
    """The dim names of a hook, e.g. ("h", "pos_q", "pos_k") for any layer's hook_pattern."""
    if name.startswith("blocks."):
        local = name.split(".", 2)[2]
        return layer_hooks(cfg).get(local) or ALL_LAYER_HOOKS.get(local) or INPUT_HOOKS[local]
    return {**GLOBAL_HOOKS_BEFORE, **POS_EMBED_HOOKS, **GLOBAL_HOOKS_AFTER}[name]


def hook_shape(name: str, cfg: Any, n_pos: int, n_pos_k: int | None = None) -> tuple[int, ...]:
    """The exact shape a hook has for a prompt of n_pos tokens (n_pos_k keys, default n_pos)."""
    sizes = {
        "pos": n_pos,
        "pos_q": n_pos,
        "pos_k": n_pos if n_pos_k is None else n_pos_k,
        "d_model": cfg.d_model,
        "h": cfg.n_heads,
        "g": cfg.n_kv_heads,
        "d_head": cfg.d_head,
        "h*d_head": cfg.n_heads * cfg.d_head,
        "g*d_head": cfg.n_kv_heads * cfg.d_head,
        "d_mlp": cfg.d_mlp,
        "1": 1,
    }
    return tuple(sizes[d] for d in hook_dims(name, cfg))


def layer_of(name: str) -> int | None:
    """Layer index of a `blocks.L.*` name, None for global hooks."""
    return int(name.split(".")[1]) if name.startswith("blocks.") else None


class HookNameError(KeyError, ValueError):
    """An unknown hook name. Both a KeyError (dict-style lookups like `trace[name]` keep their usual
    exception) and a ValueError (like every other bad input to slmviz). str() is the plain message:
    a bare KeyError would wrap it in quotes and escape its newlines."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class HookError(RuntimeError):
    """A hook fn raised. The message names the hook and the fn; the original exception is `__cause__`."""

    def __init__(self, message: str, hook_name: str):
        super().__init__(message)
        self.hook_name = hook_name


def is_input_hook(name: str, valid_set: set[str] | frozenset[str]) -> bool:
    """True for an opt-in input hook (INPUT_HOOKS) of a layer the model has (its hook_resid_pre is valid)."""
    parts = name.split(".", 2)
    return (len(parts) == 3 and parts[0] == "blocks" and parts[2] in INPUT_HOOKS
            and f"blocks.{parts[1]}.hook_resid_pre" in valid_set)


def input_hook_names(n_layers: int) -> list[str]:
    """Every opt-in input hook name of a model of this depth (INPUT_HOOKS), layer by layer."""
    return [layer_hook_name(layer, local) for layer in range(n_layers) for local in INPUT_HOOKS]


def check_names(requested: Iterable[str], valid: list[str]) -> None:
    """Raise HookNameError naming the closest valid hooks for any unknown name (the opt-in input hooks of
    the model's layers are valid too)."""
    valid_set = set(valid)
    for name in requested:
        if not isinstance(name, str):
            raise HookNameError(f"Hook names are strings like 'blocks.0.attn.hook_pattern', got {name!r}")
        if name not in valid_set and not is_input_hook(name, valid_set):
            close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise HookNameError(
                f"Unknown hook name {name!r}{hint} (valid names look like 'blocks.0.attn.hook_pattern'; "
                f"see model.hook_names)"
            )


class HookContext:
    """What one forward pass captures and which hook functions it calls.

    `capture`: the set of names to store (None = nothing). `fns`: name → fn(tensor, name).
    A fn's non-None return replaces the value and feeds forward; it must keep shape and dtype.
    Stored tensors are the live values (no copy): the model never modifies a tensor in place after
    it has passed a hook point.

    Inside the decoder every value has a leading batch dimension. `batched=False` (a trace of one
    prompt, the public contract) shows fns and captures the single row without it; `batched=True`
    (sweeps, corpus scans) shows them the whole [b, ...] tensor.
    """

    __slots__ = ("capture", "fns", "store", "batched", "_active")

    def __init__(self, capture: set[str] | None = None, fns: dict[str, list[HookFn]] | None = None,
                 batched: bool = False):
        self.capture = capture or set()
        self.fns = fns or {}
        self.store: dict[str, torch.Tensor] = {}
        self.batched = batched
        self._active = self.capture | set(self.fns)

    def wants(self, name: str) -> bool:
        """True if anyone reads this value; optional work (per-head results, patterns) is skipped otherwise."""
        return name in self._active

    def wants_any(self, names: Iterable[str]) -> bool:
        """True if anyone reads any of `names` (a block asks once per forward whether it needs its hooks at all)."""
        return not self._active.isdisjoint(names)

    def edits(self, name: str) -> bool:
        """True if a hook fn may replace this value (capture alone never does)."""
        return name in self.fns

    def defer(self, derived: dict[str, str]) -> tuple[dict[str, str], list[str]]:
        """Capture the sources of derivable values instead of the values themselves.

        `derived`: local name → local name it is computed from (DERIVED_HOOKS). Every captured name that
        no fn edits is swapped for its source. Returns ({captured name: source name}, the sources that
        were not themselves requested, which the caller keeps out of the trace's names).
        """
        moved: dict[str, str] = {}
        for name in list(self.capture):
            local = name.split(".", 2)[-1] if name.startswith("blocks.") else name
            if local in derived and not self.edits(name):
                moved[name] = name[: len(name) - len(local)] + derived[local]
        extra = sorted({src for src in moved.values() if src not in self.capture})
        self.capture = (self.capture - set(moved)) | set(moved.values())
        self._active = self.capture | set(self.fns)
        return moved, extra

    def fire(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Run the fns and capture of a hook point that fires *inside* another hook's fn (an SAE's splice
        hooks): x is already the view fns see (one prompt's row, or the batch), so no batch handling here."""
        return self._run(name, x) if name in self._active else x

    def append_fn(self, name: str, fn: HookFn) -> None:
        """Call `fn` at `name` after the fns already there (an SAE splice runs after the user's own edits)."""
        self.fns.setdefault(name, []).append(fn)
        self._active = self.capture | set(self.fns)

    def __call__(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name not in self._active:
            return x
        if self.batched:
            return self._run(name, x)
        if x.shape[0] != 1:
            raise ValueError(f"An unbatched hook context saw a batch of {x.shape[0]} at {name!r}")
        row = x[0]
        out = self._run(name, row)
        return x if out is row else out[None]  # unchanged values keep their identity (the block relies on it)

    def _run(self, name: str, x: torch.Tensor) -> torch.Tensor:
        for fn in self.fns.get(name, ()):
            out = fn(x, name)
            if out is not None:
                x = _checked_replacement(name, x, out)
        if name in self.capture:
            self.store[name] = x
        return x


NULL_CONTEXT = HookContext()


def _checked_replacement(name: str, old: torch.Tensor, new: Any) -> torch.Tensor:
    keep = "return None to keep the value, or a tensor of the same shape and dtype to replace it"
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"Hook on {name!r} returned {type(new).__name__}; {keep}")
    if new.shape != old.shape:
        raise ValueError(
            f"Hook on {name!r} returned shape {tuple(new.shape)}, expected {tuple(old.shape)}; {keep}"
        )
    if new.dtype != old.dtype:
        raise ValueError(f"Hook on {name!r} returned dtype {new.dtype}, expected {old.dtype}; {keep}")
    return new


def _naming_errors(fn: HookFn, hook_name: str) -> HookFn:
    """Wrap a user's hook fn so an exception it raises says which hook it was on (chained, not swallowed)."""
    label = getattr(fn, "__qualname__", None) or type(fn).__name__

    def call(x: torch.Tensor, name: str):
        try:
            return fn(x, name)
        except Exception as e:
            raise HookError(f"The hook fn {label} on {name!r} raised {type(e).__name__}: {e}", name) from e

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


# SAELens's hook names under the hook an SAE (or transcoder) writes, in the order a splice fires them.
SAE_HOOKS = ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_error",
             "hook_sae_output")


def checked_saes(saes: Iterable[Any] | None, valid: list[str]) -> list[Any]:
    """The `saes=` argument as a list, each checked: anything with `splice_fns(ctx)` and `splice_dims()` (an
    slmviz.SAE; this layer never imports it), reading and writing hooks this model has, one SAE per written hook."""
    if saes is None:
        return []
    if isinstance(saes, str) or not isinstance(saes, Iterable) or hasattr(saes, "splice_fns"):
        raise TypeError(f"saes= takes a list of SAEs (slmviz.load_sae(...)), not {type(saes).__name__}")
    out, writes = list(saes), {}
    valid_set = set(valid)
    for sae in out:
        if not callable(getattr(sae, "splice_fns", None)) or not callable(getattr(sae, "splice_dims", None)):
            raise TypeError(f"saes= takes SAE objects (slmviz.load_sae / slmviz.SAE), got {type(sae).__name__}")
        for what, name in (("reads", sae.hook_name), ("writes", sae.hook_name_out)):
            if name not in valid_set:
                close = difflib.get_close_matches(str(name), valid, n=2, cutoff=0.6)
                hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
                raise HookNameError(f"{sae!r} {what} {name!r}, a hook this model does not have{hint}")
        if sae.hook_name_out in writes:
            raise ValueError(f"two SAEs write {sae.hook_name_out!r}; splice at most one SAE per hook")
        writes[sae.hook_name_out] = sae
    return out


def build_context(
    valid: list[str], names: NameFilter = None, hooks: dict[str, HookFn | list[HookFn]] | None = None,
    capture_all_by_default: bool = True, batched: bool = False, saes: Iterable[Any] | None = None,
) -> HookContext:
    """Resolve a `names=` filter (None = all, [] = none, list of exact names, or a predicate) and hook fns.

    `batched`: hook fns and captures see [b, ...] tensors instead of one prompt's (see HookContext).
    `saes`: SAEs spliced in (features.splice): their SAELens hook names (`{hook_name_out}.hook_sae_acts_post`, ...)
    become valid names to capture and hook, and each SAE's splice fn runs at the hook it writes, after `hooks`'s.
    """
    spliced = checked_saes(saes, valid)
    if spliced:
        valid = valid + [name for sae in spliced for name in sae.splice_dims()]
    if names is None:
        capture = set(valid) if capture_all_by_default else set()
    elif callable(names):
        capture = {n for n in valid if names(n)}
    else:
        if not isinstance(names, str | Iterable):
            raise TypeError(
                f"names= takes None (all), a list of hook names, or a predicate fn(name) -> bool, "
                f"not {type(names).__name__}"
            )
        names = [names] if isinstance(names, str) else list(names)
        check_names(names, valid)
        capture = set(names)
    if hooks is not None and not isinstance(hooks, dict):
        raise TypeError(
            f"hooks= takes a dict {{hook name: fn(tensor, name)}} (or a list of fns per name), "
            f"not {type(hooks).__name__}"
        )
    fns: dict[str, list[HookFn]] = {}
    for name, fn in (hooks or {}).items():
        check_names([name], valid)
        fn_list = list(fn) if isinstance(fn, list | tuple) else [fn]
        for f in fn_list:
            if not callable(f):
                raise TypeError(f"Hook for {name!r} must be callable fn(tensor, name), got {type(f).__name__}")
        fns[name] = [_naming_errors(f, name) for f in fn_list]
    ctx = HookContext(capture, fns, batched)
    for sae in spliced:
        for name, fn in sae.splice_fns(ctx).items():
            ctx.append_fn(name, fn)
    return ctx
