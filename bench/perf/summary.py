"""A graph summary's cost (issue 51's goal: summarize plus check at most 15 s a graph), against the graph's own build
time, and the check against its reference: one constrained and one free `graphs.intervene` a group, the runs the
batched check replaces (the same numbers: the script compares them).

    .venv/bin/python bench/perf/summary.py [--model SmolLM2-135M-Instruct] [--set plt-quick] [--prompt "..."]
        [--threads 1] [--repeats 3]

One graph of `--prompt` over the prepared set (the Graph tab's cap, max_feature_nodes=4096), pruned; then, alternating
`--repeats` times: `summarize` (the default method), the batched `check`, and the reference check. Prints the median
of each with the load average, and the largest difference between the two checks' numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import slmviz  # noqa: E402
from slmviz.graphs.intervene import intervene  # noqa: E402
from slmviz.graphs.summary import DEFAULT_METHOD, demeaned_change  # noqa: E402

MAX_FEATURE_NODES = 4096  # app/transcoder_sets.py's


def reference_check(p, s) -> list[tuple[float, float]]:
    """(predicted, measured) of every feature group, one constrained and one free intervention each."""
    out = []
    t = None
    for r in s.feature_groups.itertuples():
        values = {m: 0.0 for m in r.members}
        con = intervene(p, values, constrained=True)
        free = intervene(p, values, constrained=False)
        t = int(free.original.argmax()) if t is None else t
        out.append((demeaned_change(con.logits.double(), con.original.double(), t),
                    demeaned_change(free.logits.double(), free.original.double(), t)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--set", default="plt-quick")
    ap.add_argument("--prompt", default="The capital of Japan is")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = slmviz.load(args.model)
    ts = slmviz.load_transcoders(args.set, model=m)
    print(f"{common.cpu_model()}, {args.threads} thread(s); load {common.load_average()}", flush=True)
    t0 = time.perf_counter()
    g = slmviz.attribution_graph(args.prompt, transcoders=ts, model=m, progress=False,
                                 max_feature_nodes=MAX_FEATURE_NODES)
    build = time.perf_counter() - t0
    p = g.prune()
    print(f"graph {build:.1f} s ({int(p.node_mask.sum())} kept nodes); load {common.load_average()}", flush=True)
    times: dict[str, list[float]] = {"summarize": [], "check": [], "reference check": []}
    worst = 0.0
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        s = p.summarize(max_groups=12, method=DEFAULT_METHOD, apply=False)
        times["summarize"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checks = s.check()
        times["check"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = reference_check(p, s)
        times["reference check"].append(time.perf_counter() - t0)
        got = np.array(checks[["predicted", "measured"]].to_numpy(dtype=float))
        worst = max(worst, float(np.abs(got - np.array(ref)).max()))
        print({k: round(v[-1], 2) for k, v in times.items()}, f"load {common.load_average()}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{args.model}, {args.set}, {args.prompt!r}: {len(s.feature_groups)} feature groups ({DEFAULT_METHOD})")
    print(f"graph build {build:.1f} s; summarize {med['summarize']:.2f} s + check {med['check']:.2f} s = "
          f"{med['summarize'] + med['check']:.2f} s (goal <= 15 s); the reference check {med['reference check']:.2f} s "
          f"({med['reference check'] / med['check']:.1f}x the batched check's); largest difference between the two "
          f"checks' logit changes: {worst:.1e}")


if __name__ == "__main__":
    main()
