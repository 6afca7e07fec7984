"""Ablation: knock out heads, MLP neurons or whole sub-layers, as a hooks dict for `trace`, `generate`, `stream`.

    hooks = slmviz.interventions.ablation(heads=[(3, 1)], neurons=[(5, 77)], kind="zero", model=m)
    m.generate("...", hooks=hooks)

A head is ablated through its z (`attn.hook_z[:, h]`), never through the output of o_proj: o_proj mixes the
heads, so there is no per-head slice of hook_attn_out to remove. Zeroing z_h removes exactly that head's write
z_h · W_o[h] from hook_attn_out. A neuron is ablated in `mlp.hook_post` (act(gate) · up, the value down_proj
reads). `layers` ablates a whole sub-layer's write into the residual (hook_attn_out and/or hook_mlp_out).

Kinds:
- "zero": the value becomes 0. Simple, but 0 may be far outside what the model ever sees there.
- "mean": the value becomes its mean over `reference` (reference prompts, or a corpus scan's `mean(hook)`):
  it removes what this input adds beyond the average input.
- "resample": each position gets the value at a random position of the reference prompts' runs (seeded), so
  the replacement is a real activation, drawn from the reference distribution. Position-independent on
  purpose: during cached decoding a hook sees one new position and cannot know which one it is.

The hook fns work on batch-free values ([pos, ...], as `trace` passes them) and on batched ones ([b, pos, ...]).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..hooks import HookFn, layer_hook_name

KINDS = ("zero", "mean", "resample")
SUBLAYERS = {"attn": "hook_attn_out", "mlp": "hook_mlp_out"}

# (hook name, what to index in the last dims of the value) for one ablated unit
_Unit = tuple[str, Callable[[torch.Tensor], Any]]


def ablation(
    heads: Iterable[tuple[int, int]] = (),
    neurons: Iterable[tuple[int, int]] = (),
    layers: Iterable[int | tuple[int, str]] = (),
    kind: str = "zero",
    reference: Sequence[str] | Any | None = None,
    model: Any = None,
    seed: int = 0,
) -> dict[str, HookFn]:
    """A hooks dict {hook name: fn} that ablates every listed unit (see the module docstring).

    heads: (layer, head) pairs; neurons: (layer, neuron) pairs; layers: L (both sub-layers) or (L, "attn"|"mlp").
    reference: prompts (or a Scan with `.mean(hook)`) for kind="mean"; prompts for kind="resample".
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if model is None:
        from ..model_api import load

        model = load()
    cfg = model.cfg
    targets: dict[str, list[tuple[str, int | None]]] = {}  # hook name -> [(what, index)]
    for layer, head in _pairs(heads, "heads", "(layer, head)"):
        _check(layer, cfg.n_layers, "layer", f"head ({layer}, {head})")
        _check(head, cfg.n_heads, "head", f"head ({layer}, {head})")
        targets.setdefault(layer_hook_name(layer, "attn.hook_z"), []).append(("head", head))
    for layer, neuron in _pairs(neurons, "neurons", "(layer, neuron)"):
        _check(layer, cfg.n_layers, "layer", f"neuron ({layer}, {neuron})")
        _check(neuron, cfg.d_mlp, "neuron", f"neuron ({layer}, {neuron})")
        targets.setdefault(layer_hook_name(layer, "mlp.hook_post"), []).append(("neuron", neuron))
    for item in layers:
        layer, parts = (item, tuple(SUBLAYERS)) if isinstance(item, int) else _sublayer(item)
        _check(layer, cfg.n_layers, "layer", f"layer {item!r}")
        for part in parts:
            targets.setdefault(layer_hook_name(layer, SUBLAYERS[part]), []).append(("all", None))
    if not targets:
        raise ValueError("Nothing to ablate: pass heads=[(layer, head)], neurons=[(layer, neuron)] or layers=[L]")

    sources = _replacement_sources(kind, reference, list(targets), model)
    generator = torch.Generator().manual_seed(seed)
    return {name: _ablate(name, units, kind, sources.get(name), generator) for name, units in targets.items()}


def _ablate(name: str, units: list[tuple[str, int | None]], kind: str, source: torch.Tensor | None,
            generator: torch.Generator) -> HookFn:
    """One fn per hook name, ablating all its units at once (a hooks dict holds one entry per name).

    `source`: for "mean", the mean value [*unit shape] (e.g. [h, d_head] for z); for "resample", every
    reference position's value [n_ref, *unit shape].
    """

    def fn(x: torch.Tensor, hook_name: str) -> torch.Tensor:
        out = x.clone()
        if kind == "resample":  # one reference position per position of this value
            picks = torch.randint(source.shape[0], x.shape[:-_unit_dims(name)], generator=generator)
            replacement = source[picks.to(source.device)].to(x.device, x.dtype)  # [..., pos, *unit shape]
        elif kind == "mean":  # a scan's mean lives on the CPU, the run's values on the model's device
            replacement = source.to(x.device, x.dtype).expand_as(x)
        else:
            replacement = torch.zeros_like(x)
        for what, index in units:
            if what == "head":
                out[..., index, :] = replacement[..., index, :]  # z: [..., pos, h, d_head]
            elif what == "neuron":
                out[..., index] = replacement[..., index]  # post: [..., pos, d_mlp]
            else:
                out = replacement.clone()
        return out

    fn.__qualname__ = f"ablate_{kind}"
    return fn


def _unit_dims(name: str) -> int:
    """How many trailing dims one position's value has: z is [h, d_head] (2), the rest [width] (1)."""
    return 2 if name.endswith("attn.hook_z") else 1


def _replacement_sources(kind: str, reference: Any, names: list[str], model: Any) -> dict[str, torch.Tensor]:
    """The mean per hook (kind="mean") or every reference position's value (kind="resample")."""
    if kind == "zero":
        if reference is not None:
            raise ValueError("kind='zero' takes no reference; use kind='mean' or 'resample' with reference prompts")
        return {}
    if reference is None:
        raise ValueError(f"kind={kind!r} needs reference= (a list of prompts"
                         f"{', or a corpus scan' if kind == 'mean' else ''}) to take its values from")
    if kind == "mean" and hasattr(reference, "mean") and not isinstance(reference, str | list | tuple):
        return {name: _scan_mean(reference, name, _unit_shape(name, model.cfg)) for name in names}
    prompts = [reference] if isinstance(reference, str) else list(reference)
    if not prompts:
        raise ValueError("reference= is empty; pass at least one prompt")
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    for prompt in prompts:
        t = model.trace(prompt, names=names)
        for name in names:
            rows[name].append(t[name])  # [pos, *unit shape]
    values = {name: torch.cat(r) for name, r in rows.items()}  # [n_ref, *unit shape]
    return {name: v.mean(0) for name, v in values.items()} if kind == "mean" else values


def _scan_mean(scan: Any, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A corpus scan's mean of one hook's value, shaped like one position of it.

    `Scan.value_mean` is the raw value's mean; `Scan.mean` is the mean of the scan's ranked features, which is
    the same thing only where the features are the values themselves (MLP neurons, residual dimensions): for
    a head it is the norm of each head's vector, no use as a replacement value.
    """
    value = scan.value_mean(name) if hasattr(scan, "value_mean") else scan.mean(name)
    value = None if value is None else torch.as_tensor(value)
    if value is None or value.numel() != math.prod(shape):
        got = "nothing" if value is None else f"shape {tuple(value.shape)}"
        raise ValueError(f"The corpus scan's mean of {name} is {got}, not one position's value {list(shape)}; "
                         f"scan that hook (e.g. slmviz.scan(corpus, hooks=[{name!r}])) or pass reference prompts")
    return value.reshape(shape)


def _unit_shape(name: str, cfg: Any) -> tuple[int, ...]:
    if name.endswith("attn.hook_z"):
        return (cfg.n_heads, cfg.d_head)
    return (cfg.d_mlp,) if name.endswith("mlp.hook_post") else (cfg.d_model,)


def _pairs(items: Iterable[tuple[int, int]], arg: str, form: str) -> list[tuple[int, int]]:
    out = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and all(_is_int(i) for i in item)):
            raise ValueError(f"{arg}= takes {form} pairs of integers, got {item!r}")
        out.append((int(item[0]), int(item[1])))
    return out


def _sublayer(item: Any) -> tuple[int, tuple[str, ...]]:
    if not (isinstance(item, tuple | list) and len(item) == 2 and _is_int(item[0]) and item[1] in SUBLAYERS):
        raise ValueError(f"layers= takes layer numbers or (layer, 'attn' | 'mlp') pairs, got {item!r}")
    return int(item[0]), (item[1],)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(value: int, size: int, what: str, context: str) -> None:
    if not 0 <= value < size:
        raise ValueError(f"{context}: {what} {value} is out of range 0..{size - 1}")
