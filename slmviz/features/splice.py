"""Splicing an SAE (or transcoder) into a forward pass, with SAELens's hook names under the hook it writes.

`m.trace(prompt, saes=[sae])` (and generate, stream, scan, patch) hands the SAEs to `hooks.build_context`, which
calls `splice_fns(sae, ctx)` for each and runs the returned fns after the user's own fns at those hooks. At the hook
the SAE writes (`hook_name_out`), the splice fires, in order:

    {out}.hook_sae_input      [pos, d_in]   the activation the SAE reads (hook_name's value; flat for hook_z)
    {out}.hook_sae_acts_pre   [pos, d_sae]  h = x' @ W_enc + b_enc
    {out}.hook_sae_acts_post  [pos, d_sae]  f, the feature activations
    {out}.hook_sae_recons     [pos, d_out]  x_hat = f @ W_dec + b_dec (+ x @ W_skip.T)
    {out}.hook_sae_error      [pos, d_out]  x_out - x_hat of the *unedited* SAE (SAELens's clean error term)
    {out}.hook_sae_output     the hook's own shape and dtype: what flows on

The first five are in the SAE's dtype (the activation is cast to it, as SAELens does); an edit of any of them flows
on through the rest. With the error term (`sae.use_error_term`, True by default), output = recons + error: without
edits that is exactly the model's own value (computed as x_out + (recons - clean recons), which is x_out bit for bit
when nothing was edited), so every downstream hook and the logits are unchanged. Without it, output = recons: the
model runs on the SAE's reconstruction (what the metrics' "spliced" loss measures).
When autograd is on (attribution), the error term is a constant and the gradient flows through the SAE (SAELens's
rule), so gradients reach the features; the value then equals the model's up to rounding (~1 ulp).

A transcoder reads `hook_name` (blocks.L.mlp.hook_in) and writes `hook_name_out` (blocks.L.hook_mlp_out): the input
is kept when hook_name fires and used when hook_name_out fires, and the error is the true MLP output minus the
prediction.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hooks import SAE_HOOKS, HookContext, HookFn, hook_dims


def sub_hook_names(sae: Any) -> dict[str, str]:
    """SAELens's short name (hook_sae_acts_post, ...) -> the full hook name under the hook the SAE writes."""
    return {short: f"{sae.hook_name_out}.{short}" for short in SAE_HOOKS}


def splice_dims(sae: Any) -> dict[str, tuple[str, ...]]:
    """Full sub-hook name -> its dims. d_sae_in / d_sae / d_sae_out are this SAE's sizes (see `splice_sizes`)."""
    names = sub_hook_names(sae)
    try:
        out_dims = hook_dims(sae.hook_name_out)
    except KeyError:
        out_dims = ("pos", "d_sae_out")
    dims = {"hook_sae_input": ("pos", "d_sae_in"), "hook_sae_acts_pre": ("pos", "d_sae"),
            "hook_sae_acts_post": ("pos", "d_sae"), "hook_sae_recons": ("pos", "d_sae_out"),
            "hook_sae_error": ("pos", "d_sae_out"), "hook_sae_output": out_dims}
    return {names[short]: d for short, d in dims.items()}


def splice_sizes(sae: Any) -> dict[str, int]:
    return {"d_sae_in": sae.d_in, "d_sae": sae.d_sae, "d_sae_out": sae.d_out}


def _flat(x: torch.Tensor, width: int, name: str) -> torch.Tensor:
    """[..., d] as is, or [..., h, d_head] flattened to [..., h*d_head] (an attn.hook_z SAE, Gemma Scope's attn_out)."""
    if x.shape[-1] == width:
        return x
    if x.dim() >= 2 and x.shape[-2] * x.shape[-1] == width:
        return x.flatten(-2)  # [..., h, d_head] -> [..., h*d_head]
    raise ValueError(
        f"the SAE at {name!r} has width {width}, but the model's value there is {tuple(x.shape)} "
        "(load the SAE with model= to check it against the model first)"
    )


def splice_fns(sae: Any, ctx: HookContext, use_error_term: bool | None = None) -> dict[str, HookFn]:
    """{hook name: fn} that splice `sae` into a forward pass run with `ctx` (see the module docstring)."""
    names = sub_hook_names(sae)
    error_term = sae.use_error_term if use_error_term is None else use_error_term
    separate = sae.hook_name != sae.hook_name_out
    kept: dict[str, torch.Tensor] = {}
    # Edits of these change the reconstruction, so the error term needs the unedited SAE's own reconstruction.
    before_error = [names[n] for n in ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons")]

    def keep_input(x: torch.Tensor, name: str) -> None:
        kept["x"] = x

    def splice(x_out: torch.Tensor, name: str) -> torch.Tensor:
        x_in = kept.pop("x") if separate else x_out
        if error_term and not any(ctx.wants(n) for n in names.values()):
            return x_out  # nobody reads or edits the SAE's hooks: with the error term the output is x_out itself
        if x_in.device != sae.W_enc.device:
            raise ValueError(f"the SAE at {sae.hook_name_out!r} is on {sae.W_enc.device}, the model's activations "
                             f"on {x_in.device}: move it with sae.to(model.device) (load_sae(..., model=m) does)")
        flat_out = _flat(x_out, sae.d_out, sae.hook_name_out)
        clean_in = _flat(x_in, sae.d_in, sae.hook_name).to(sae.dtype)
        sae_in = ctx.fire(names["hook_sae_input"], clean_in)
        pre = ctx.fire(names["hook_sae_acts_pre"], sae.encode_pre(sae_in))
        acts = ctx.fire(names["hook_sae_acts_post"], sae.activate(pre))
        recons = ctx.fire(names["hook_sae_recons"], sae.decode(acts, sae_in))
        if error_term and torch.is_grad_enabled():
            # A gradient (attribution) flows through the SAE, with the error term a constant: SAELens's rule.
            with torch.no_grad():
                clean = sae.decode(sae.activate(sae.encode_pre(clean_in)), clean_in)
                error = flat_out.to(sae.dtype) - clean
            out = (recons + ctx.fire(names["hook_sae_error"], error)).to(x_out.dtype)
        elif error_term:
            edited = any(ctx.edits(n) for n in before_error)
            clean = sae.decode(sae.activate(sae.encode_pre(clean_in)), clean_in) if edited else recons
            error = flat_out.to(sae.dtype) - clean
            hooked_error = ctx.fire(names["hook_sae_error"], error)
            if hooked_error is not error:  # an edited error term: output = recons + that error
                out = (recons + hooked_error).to(x_out.dtype)
            elif edited:  # x_out + (recons - clean) == recons + error, and exactly x_out when recons == clean
                out = flat_out + (recons - clean).to(x_out.dtype)
            else:
                out = flat_out
        else:
            out = recons.to(x_out.dtype)
        full = x_out if out is flat_out else out.reshape(x_out.shape)
        return ctx.fire(names["hook_sae_output"], full)

    fns: dict[str, HookFn] = {sae.hook_name_out: splice}
    if separate:
        fns = {sae.hook_name: keep_input, **fns}
    return fns

