"""The cost of splicing an SAE into a trace: `m.trace(ids, saes=[sae])` ÷ `m.trace(ids)`, alternating rounds.

SmolLM2-135M (the bundled model), 128 tokens, every hook captured (the default trace). The SAE is a random TopK
SAE of SmolLM2's training width (d_sae 4608 = 8 × d_model, k 32) at blocks.15.hook_resid_post, with the error term
(outputs unchanged; the splice runs the encoder and decoder once and records its six hooks). Evidence rows: the
same with a 4608-wide JumpReLU transcoder at layer 15 (mlp.hook_in -> hook_mlp_out), and with capture off
(names=[]: only the SAE's work is added to a bare forward).

    .venv/bin/python bench/perf/sae_splice.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, main, median, prompt_ids, spread

TARGET = 1.1
N_TOKENS = 128


def timed(fns: dict[str, Callable[[], object]], warmup: int, repeats: int) -> tuple[dict, dict]:
    """Wall-clock and CPU (process) seconds of each fn, in alternating rounds after warm-up.

    CPU time is what this process itself spent: on a machine other jobs share, it moves much less than the wall
    clock (other processes' bursts do not count), so the ratios are quoted on both."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        for _ in range(repeats):
            for name, fn in fns.items():
                w, c = time.perf_counter(), time.process_time()
                fn()
                cpu[name].append(time.process_time() - c)
                wall[name].append(time.perf_counter() - w)
    return wall, cpu


def paired(a: list[float], b: list[float]) -> float:
    """The median of the per-round ratios a/b (each pair ran back to back, so a burst of load hits both)."""
    return median([x / y for x, y in zip(a, b, strict=True)])


def run(args: argparse.Namespace) -> list[Row]:
    import slmviz
    from slmviz import SAE

    model = slmviz.load()
    ids = prompt_ids(model, N_TOKENS)
    d = model.cfg.d_model
    sae = SAE.random(d, 8 * d, architecture="topk", k=32, hook_name="blocks.15.hook_resid_post")
    tc = SAE.random(d, 8 * d, architecture="jumprelu", hook_name="blocks.15.mlp.hook_in",
                    hook_name_out="blocks.15.hook_mlp_out", seed=1)
    wall, cpu = timed({
        "plain": lambda: model.trace(ids),
        "sae": lambda: model.trace(ids, saes=[sae]),
        "transcoder": lambda: model.trace(ids, saes=[tc]),
        "bare": lambda: model.trace(ids, names=[]),
        "bare_sae": lambda: model.trace(ids, names=[], saes=[sae]),
    }, warmup=2, repeats=args.repeats)
    exact = float((model.trace(ids, saes=[sae]).logits - model.trace(ids).logits).abs().max())
    # The splice's own arithmetic alone, fastest of many short runs (a short op's minimum is what a quiet core
    # gives, even on a shared machine), against the fastest plain trace: the overhead's estimate.
    x = model.trace(ids, names=[sae.hook_name])[sae.hook_name]
    alone, _ = timed({"sae": lambda: x - sae.decode(sae.activate(sae.encode_pre(x)), x)}, warmup=3,
                     repeats=10 * args.repeats)
    rows = []
    for key, base, what, target in (
        ("sae", "plain", f"trace, {N_TOKENS} tokens, all hooks, one TopK SAE spliced (d_sae {8 * d}, k 32, layer 15) "
         "÷ the same trace without", TARGET),
        ("transcoder", "plain", f"(evidence) the same trace with a JumpReLU transcoder (d_sae {8 * d}, layer 15) "
         "÷ without", None),
        ("bare_sae", "bare", f"(evidence) capture off (names=[]), {N_TOKENS} tokens, the TopK SAE spliced ÷ without",
         None),
    ):
        ratio = paired(wall[key], wall[base])
        cpu_ratio = paired(cpu[key], cpu[base])
        fastest = min(wall[key]) / min(wall[base])
        note = (f"median of per-round ratios; fastest rounds {min(wall[key]):.3f} s vs {min(wall[base]):.3f} s "
                f"({fastest:.2f}); CPU-time ratio {cpu_ratio:.2f}; wall spread {spread(wall[key])} vs "
                f"{spread(wall[base])}")
        if key == "sae":
            note = f"error term on: max |Δlogit| {exact:.1e}; " + note
        rows.append(Row(what, f"{median(wall[key]):.3f} s", f"{median(wall[base]):.3f} s", ratio,
                        f"≤ {target}" if target else "—", ratio <= target if target else None, note))
    rows.append(Row(
        f"(evidence) the splice's arithmetic alone (encode, TopK, decode, error term; {N_TOKENS} positions), fastest "
        "run ÷ the fastest plain trace", f"{min(alone['sae']) * 1e3:.1f} ms", f"{min(wall['plain']):.3f} s",
        min(alone["sae"]) / min(wall["plain"]), "—", None,
        f"{10 * args.repeats} runs; the rest of a spliced trace's extra time is capturing six [pos, ·] tensors"))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
