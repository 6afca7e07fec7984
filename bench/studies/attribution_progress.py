"""How often attribution_graph reports progress, so how soon a Cancel (a raising progress callable) takes effect,
and what a stopped graph's exception still holds. SmolLM2 with both bundled transcoders, one prompt.

A graph is stopped at the first report after a raise is asked for, so the gap between reports bounds Cancel's
latency in the app (app/circuits_tab.py). Evidence, no target: a shared 2-core machine's neighbours move these
numbers; the load average is printed first.

    .venv/bin/python bench/studies/attribution_progress.py
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: F401 - this checkout's slmviz first

import slmviz

PROMPT = "When Mary and John went to the store after a long day at work, John gave a drink to"


class Stop(Exception):
    """Stands for the app's JobCancelled."""


def main() -> None:
    print(f"load average {os.getloadavg()[0]:.1f}")
    m = slmviz.load()
    tcs = [slmviz.load_sae(name, model=m) for name in ("transcoder_l6", "transcoder_l9")]
    stamps: list[float] = []
    start = time.perf_counter()
    g = slmviz.attribution_graph(PROMPT, transcoders=tcs, model=m,
                                 progress=lambda u: stamps.append(time.perf_counter()) if u.unit == "target" else None)
    seconds = time.perf_counter() - start
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:], strict=False))
    print(f"{len(g.tokens)} tokens (with the BOS), {len(g.nodes):,} nodes: {len(stamps)} progress reports in "
          f"{seconds:.1f} s; the first after {stamps[0] - start:.1f} s, then a median {gaps[len(gaps) // 2]:.2f} s "
          f"apart (max {gaps[-1]:.2f} s)")
    adjacency_mib = g.adjacency.numel() * 4 / 2**20
    del g
    gc.collect()

    def stop_half_way(done: int, total: int) -> None:
        if done > total // 2:
            raise Stop(f"{done} of {total}")

    start = time.perf_counter()
    try:
        slmviz.attribution_graph(PROMPT, transcoders=tcs, model=m, progress=stop_half_way)
    except Stop as e:
        kept = e  # held, as the app's job runner holds a job's error
        print(f"stopped past half-way ({kept}) after {time.perf_counter() - start:.1f} s; tensors the held "
              f"exception's frames still reference: {held_mib(kept):.1f} MiB (the adjacency alone is "
              f"{adjacency_mib:.0f} MiB)")


def held_mib(e: BaseException) -> float:
    """MiB of the tensors (alone or in lists / tuples / dicts) that the frames of e's traceback still hold."""
    seen: set[int] = set()
    total = 0
    tb = e.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
            for t in items:
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
        tb = tb.tb_next
    return total / 2**20


if __name__ == "__main__":
    main()
