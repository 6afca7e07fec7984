"""The "fast (bf16)" switch of the Patch and Corpus tabs: run sweeps and scans on a bfloat16 copy of the model.

Whether it is offered is measured, never read off the CPU's name: this machine kind has had CPUs whose bf16
matrix multiplies ran ~3x (AVX512-BF16) and ~6x (AMX) faster than fp32, and a CPU without native bf16 kernels
runs them tens of times slower. `slmviz.model.params.bf16_bulk_speedup()` times one bulk-sized product in both
dtypes once per process; the switch is enabled only where bf16 wins by at least MIN_SPEEDUP, and otherwise shown
disabled with the measured factor, so nobody turns on a 100x slowdown by accident.

What it costs is stated next to it, from what tests/test_dtype_bulk.py pins (docs/performance.md, "bf16").
"""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from slmviz.model.params import BF16_SPEEDUP, bf16_bulk_speedup

FAST_DTYPE = "bfloat16"
MIN_SPEEDUP = BF16_SPEEDUP  # the switch is offered where train_sae's dtype=None would pick bf16
# What it costs, per tab: the tolerances tests/test_dtype_bulk.py pins.
SWEEP_COST = "bf16 keeps 8 bits of mantissa: the heatmap stays within 0.05 of fp32's (normalized, every cell)."
SCAN_COST = ("bf16 keeps 8 bits of mantissa: examples whose activations are within bf16's error (~1-3 % of the "
             "top) may swap ranks; a scan in bf16 is cached apart from the fp32 one.")


@dataclass(frozen=True)
class FastChoice:
    available: bool
    speedup: float  # fp32 time / bf16 time of one matmul, measured on this machine
    info: str


def fast_choice(cost: str = SWEEP_COST) -> FastChoice:
    """Whether this machine runs bf16 matmuls fast enough to offer the switch, with the text shown beside it."""
    speedup = bf16_bulk_speedup()
    if speedup >= MIN_SPEEDUP:
        return FastChoice(True, speedup, f"bf16 matrix multiplies measured {speedup:.1f}x faster here. {cost}")
    return FastChoice(False, speedup, f"Off on this machine: bf16 matrix multiplies measured {1 / speedup:.1f}x "
                                      "slower than fp32 here (no native bf16 kernels).")


def fast_checkbox(elem_id: str, cost: str) -> gr.Checkbox:
    """The switch, disabled with the measured reason where bf16 does not win; `cost` says what it costs there."""
    choice = fast_choice(cost)
    return gr.Checkbox(value=False, label="fast (bf16)", info=choice.info, interactive=choice.available,
                       elem_id=elem_id)


def dtype_for(fast: bool | None) -> str:
    """The model dtype a handler asks the store for; refuses bf16 where the switch is not offered (an API
    client can send True to a disabled checkbox)."""
    if not fast:
        return "float32"
    choice = fast_choice()
    if not choice.available:
        raise gr.Error(choice.info)
    return FAST_DTYPE
