"""How long one QK attribution and one edge's head loadings take, against the attribution graph's own build time.

SmolLM2-135M-Instruct with a transcoder set (`--set plt`: the prepared full per-layer set; `bundled`: the bundled
pair), a prompt of `--tokens` tokens (the prepended special token included), fp32:

- the graph: `attribution_graph` (unpruned, or its `--max-feature-nodes` most influential features; progress off), once;
- qk: `qk_attribution` of a head of the middle layer at (last position, a key `--key-back` positions before it), on
  the graph pruned at 0.8 / 0.98 (what the app shows) and on the unpruned graph;
- head loadings: `head_loadings` of the largest kept edge into the top logit from an earlier position.

The first call on a graph (which rebuilds the graph's sources and keeps them), then `--repeats` more: their median
and spread of wall time, and their CPU time. The targets (the qk issue): one qk query ≤ 2 s, one edge's head
loadings ≤ 5 s, with the full set on a 16-token prompt on the 2-core CPU.

    .venv/bin/python bench/perf/qk.py [--set plt|bundled] [--tokens 16] [--repeats 3] [--out results/qk.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import torch  # noqa: E402

import slmviz  # noqa: E402
from slmviz.graphs.attribution import attribution_graph  # noqa: E402
from slmviz.graphs.head_loadings import head_loadings  # noqa: E402
from slmviz.graphs.qk import qk_attribution  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
TARGETS = {"qk": 2.0, "head loadings": 5.0}  # seconds, with the full set on a 16-token prompt


def timed(fn, repeats: int) -> tuple[float, list[float], list[float]]:
    """(the first call's wall time, the next calls' wall times, their CPU times): a first call on a graph rebuilds
    its sources (the prompt's run, the active features), which the graph then keeps; CPU time (every thread's,
    time.process_time) moves less than wall time when other work shares the machine."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return first, wall, cpu


def load_set(model, which: str):
    if which == "bundled":
        return [slmviz.load_sae(name, model=model) for name in ("transcoder_l6", "transcoder_l9")]
    from slmviz.replacement.load import load_transcoders

    return load_transcoders(which, model=model)


def run(args: argparse.Namespace) -> str:
    m = slmviz.load()
    ts = load_set(m, args.set)
    ids = [int(i) for i in common.prompt_ids(m, args.tokens - 1)]  # attribution_graph prepends a special token
    start = time.perf_counter()
    g = attribution_graph(ids, transcoders=ts, model=m, progress=False, max_feature_nodes=args.max_feature_nodes)
    build = time.perf_counter() - start
    p = g.prune(0.8, 0.98)
    n_pos = len(g.input_ids)
    layer, head, key = m.cfg.n_layers // 2, 0, n_pos - 1 - args.key_back
    nodes, links = p.nodes, p.links
    target = nodes.loc[nodes["kind"] == "logit", "node_id"].iat[0]
    position = dict(zip(nodes["node_id"], nodes["position"], strict=False))
    into = links[(links["target"] == target) & (links["source"].map(position) < n_pos - 1)]
    source = into["source"].iat[0]
    rows = []
    cases = [("qk (pruned graph)", "qk", lambda: qk_attribution(p, layer=layer, head=head, query=-1, key=key)),
             ("qk (unpruned graph)", "qk", lambda: qk_attribution(g, layer=layer, head=head, query=-1, key=key)),
             ("head loadings", "head loadings", lambda: head_loadings(p, source, target))]
    for what, kind, fn in cases:
        first, wall, cpu = timed(fn, args.repeats)
        med = statistics.median(wall)
        target_s = TARGETS[kind]
        rows.append([what, f"{first:.2f} s", f"{med:.2f} s", common.spread(wall), f"{statistics.median(cpu):.2f} s",
                     f"{med / build:.3f}", f"≤ {target_s:g} s", "yes" if med <= target_s else "no"])
    qk = qk_attribution(p, layer=layer, head=head, query=-1, key=key)
    hl = head_loadings(p, source, target)
    lines = [
        f"SmolLM2-135M-Instruct, set `{args.set}` ({ts!r}), {n_pos} tokens, fp32; {common.cpu_model()}, "
        f"{torch.get_num_threads()} threads, load average {common.load_average()} (bench/perf/qk.py: the first call, "
        f"then the median of {args.repeats} more).", "",
        f"Graph build: {build:.1f} s ({g}); pruned: {p}. qk: layer {layer} head {head}, query {n_pos - 1}, key {key} "
        f"({len(qk.query_side)} query-side x {len(qk.key_side)} key-side nodes on the pruned graph). Head loadings: "
        f"{source} -> {target} (edge {hl.attrs['edge']:+.4f}).", "",
        common.markdown_table(["what", "first call", "median", "spread", "CPU time", "/ graph build", "target",
                               "met"], rows)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", default="plt")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--key-back", type=int, default=5, help="the key: this many positions before the query")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-feature-nodes", type=int, default=None,
                        help="keep the graph's most influential features (the app keeps 4,096): a set with tens of "
                             "thousands of active features needs it within the 4 GiB budget")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default torch's own); 1 steadies the timing on a busy machine, where two "
                             "threads wait on each other")
    parser.add_argument("--out", default=str(RESULTS / "qk.md"))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    text = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
