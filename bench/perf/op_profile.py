"""Where the time goes, by torch.profiler: the evidence behind the "what bounds it" notes of the results.

(Not named profile.py: a script's own folder is first on sys.path, and the stdlib `profile`, which transformers
imports through cProfile, would be shadowed.)

Two profiles, each printed as torch.profiler's table of the ops with the most self time:

- the 128-token full trace and transformers' eager forward with attentions and hidden states (the trace
  row): the share of each in matrix multiplications (the self time of aten::mm / bmm / baddbmm / addmm);
- 16 cached decoding steps of greedy generation (the floor rows): how many ATen ops one step dispatches, and
  the share of the step's op time spent outside the weight matmuls (params.linear: F.linear or row-split bmm).

The profiler adds its own cost to every op, so the shares are what to read, not the absolute times
(bench/perf/forward.py and bench/perf/generate.py time the same work without it).

    .venv/bin/python bench/perf/op_profile.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import GENERATE_PROMPT, Row, load_models, main, prompt_ids
from torch.profiler import ProfilerActivity, profile

MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::baddbmm", "aten::addmm"}
DECODE_STEPS = 16


def profiled(fn: Callable[[], object], repeats: int):
    """torch.profiler's per-op averages over `repeats` calls of fn (after one untimed warm-up call)."""
    with torch.inference_mode():
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(repeats):
                fn()
    return prof.key_averages()


def self_ms(ops, names: set[str] | None = None) -> float:
    """Summed self CPU time in ms of the ops (all of them, or those named)."""
    return sum(op.self_cpu_time_total for op in ops if names is None or op.key in names) / 1e3


def run(args: argparse.Namespace) -> list[Row]:
    model, refs = load_models("eager")
    eager = refs["eager"]
    ids = prompt_ids(model, 128)
    rows = []

    shares = {}
    for name, fn in {
        "slmviz trace": lambda: model.trace(ids),
        "transformers eager": lambda: eager(ids[None], output_attentions=True, output_hidden_states=True),
    }.items():
        ops = profiled(fn, args.repeats)
        print(f"\n{name}, 128 tokens, {args.repeats} calls:")
        print(ops.table(sort_by="self_cpu_time_total", row_limit=12))
        shares[name] = self_ms(ops, MATMUL_OPS) / self_ms(ops)
    rows.append(Row(
        "(profile) share of op time in matrix multiplications: full trace | transformers eager, 128 tokens",
        f"{shares['slmviz trace']:.0%}", f"{shares['transformers eager']:.0%}", None, "(evidence)", None,
        "torch.profiler self CPU time of aten::mm/bmm/baddbmm/addmm over all ops; both run MKL's GEMMs",
    ))

    prompt = model.encode(GENERATE_PROMPT, chat=True)

    # Only the cached steps are profiled: the stream's prefill (and first token) runs before the profiler starts.
    stream = model.stream(prompt, DECODE_STEPS + 1, stop_at_eos=False)
    with torch.inference_mode():
        next(stream)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in stream:
                pass
    ops = prof.key_averages()
    print(f"\n{DECODE_STEPS} decoding steps after a {prompt.numel()}-token prompt:")
    print(ops.table(sort_by="self_cpu_time_total", row_limit=20))
    n_layers = model.cfg.n_layers
    step_total = self_ms(ops) / DECODE_STEPS
    # The weight matmuls are bmm (row split) or mm/addmm (F.linear), whichever params.row_split_wins picked.
    step_matmul = self_ms(ops, MATMUL_OPS) / DECODE_STEPS
    per_step = sum(op.count for op in ops) / DECODE_STEPS
    rows.append(Row(
        "(profile) one decoding step: ATen ops dispatched, and the op time outside the matmuls",
        f"{per_step:.0f} ops/step ({per_step / n_layers:.0f} per layer)",
        "", (step_total - step_matmul) / step_total, "(evidence)", None,
        "ratio = share of the step's op time (torch.profiler self CPU) outside the mm/addmm/bmm/baddbmm calls "
        "(the weight matmuls and attention's two small products); ops counted with the ones they call inside "
        "(rms_norm and its pow, mean, ...), views included",
    ))
    return rows


if __name__ == "__main__":
    main(run, __doc__)
