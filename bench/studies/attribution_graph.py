"""Attribution graph of a 16-token prompt on SmolLM2-135M-Instruct with the bundled transcoders (transcoder_l6,
transcoder_l9; the other 28 layers are all error): wall time, CPU time and peak RSS of `slmviz.attribution_graph`.

Peak RSS: the kernel's peak counter (VmHWM) is reset after the model and transcoders are loaded
(`echo 5 > /proc/self/clear_refs`), so the figure is the most the process held while building one graph, model
resident. Also printed: the graph's size, what `prune()` keeps, the time of prune + to_json, the estimate the
memory-budget check made, and how exactly the graph's linear model reproduces the logits (Σ edges + constant vs
the model's demeaned logits). The prompt is 16 tokens of bench/common.TEXT; attribution_graph puts a special token
in front (circuit-tracer's rule), so the graph has 17 positions.

    nice -n 10 .venv/bin/python bench/studies/attribution_graph.py [--repeats 3] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import prompt_ids, status_gb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()

    import slmviz
    from slmviz.graphs.attribution import estimate_memory_bytes

    load_before = os.getloadavg()
    m = slmviz.load()
    tcs = [slmviz.load_sae(name, model=m) for name in ("transcoder_l6", "transcoder_l9")]
    ids = prompt_ids(m, args.tokens)
    print(f"prompt ({len(ids)} tokens): {''.join(m.to_strings(ids))!r}")
    print(f"after load: RSS {status_gb('VmRSS'):.2f} GB; torch threads {torch.get_num_threads()}")

    walls, cpus, peaks = [], [], []
    for r in range(args.repeats):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = status_gb("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        graph = slmviz.attribution_graph(ids, transcoders=tcs, model=m, batch_size=args.batch_size)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        peaks.append(status_gb("VmHWM"))
        print(f"round {r}: {walls[-1]:.2f} s wall, {cpus[-1]:.2f} s CPU, peak RSS {peaks[-1]:.2f} GB "
              f"(+{peaks[-1] - base:.2f} GB over the {base:.2f} GB before the call)")
        del graph
    graph = slmviz.attribution_graph(ids, transcoders=tcs, model=m, batch_size=args.batch_size)
    t0 = time.perf_counter()
    pruned = graph.prune()
    data = pruned.to_json()
    t_prune = time.perf_counter() - t0
    kinds = graph.nodes["kind"].value_counts().to_dict()
    kept = pruned.kept_nodes["kind"].value_counts().to_dict()
    n_pos = len(graph.input_ids)
    estimate = estimate_memory_bytes(len(graph.nodes), n_pos, args.batch_size, m.cfg) / 2**30
    long = estimate_memory_bytes(4 * len(graph.nodes), 4 * n_pos, args.batch_size, m.cfg) / 2**30

    last = m.logits(torch.tensor(graph.input_ids))[-1]
    logit = (graph.nodes["kind"] == "logit").to_numpy()
    toks = torch.tensor(graph.nodes.loc[logit, "feature"].to_numpy())
    expected = last[toks] - last.mean()
    got = (graph.adjacency.sum(1) + graph.constant)[torch.tensor(logit)]
    load_after = os.getloadavg()

    print(f"nodes: {len(graph.nodes)} ({kinds}); nonzero links {int((graph.adjacency != 0).sum())}")
    print(f"pruned (0.8 / 0.98): {len(pruned.kept_nodes)} nodes ({kept}), {len(pruned.links)} links; "
          f"JSON {len(data['nodes'])} nodes, {len(data['links'])} links; prune + to_json {t_prune:.2f} s")
    print(f"top logits: {list(graph.nodes.loc[logit, 'token'])[:5]} p={graph.logit_probabilities[:5].tolist()}")
    print(f"logits reproduced: max |Σ edges + constant − (logit − mean)| = {(got - expected).abs().max():.2e} "
          f"(largest |target| {expected.abs().max():.2f})")
    print(f"graph scores (circuit-tracer's compute_graph_scores): {graph.scores()}")
    print(f"memory-budget estimate {estimate:.2f} GiB (default budget 4 GiB); a 4x longer prompt: ~{long:.2f} GiB")
    print(f"median of {args.repeats}: {statistics.median(walls):.2f} s wall "
          f"(spread {min(walls):.2f}–{max(walls):.2f}), "
          f"{statistics.median(cpus):.2f} s CPU, peak RSS {statistics.median(peaks):.2f} GB (max {max(peaks):.2f})")
    print(f"load average before {' '.join(f'{x:.2f}' for x in load_before)}, "
          f"after {' '.join(f'{x:.2f}' for x in load_after)}")


if __name__ == "__main__":
    main()
