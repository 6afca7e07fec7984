"""Circuits: what scoring every edge of SmolLM2's component graph costs, and what batching a faithfulness curve saves.

Rows (SmolLM2-135M-Instruct, one 14-token IOI pair; alternating rounds after a warm-up; each ratio is the median of
the per-round ratios, with the CPU-time ratio and the fastest rounds in the notes, since other jobs share the CPU):
- EAP over all 70,651 edges (slmviz.circuit(method="eap"), the whole call: tokenising, both runs' writes, one
  forward and one backward) ÷ one full trace of the clean prompt (every hook captured): target ≤ 4;
- EAP-IG with 5 steps (the whole call) ÷ one capture-off forward of the prompt: target ≤ 4 × (5 + 1) = 24;
- 10 separate patched forwards (the same engine, one edge set per call) ÷ a faithfulness curve of the same 10
  circuit sizes (one batch; the Circuit already holds both runs' writes): target ≥ 5;
- (evidence) 10 separate `slmviz.patch_edges` calls, each tokenising and running both prompts too, ÷ the curve.
`--gemma` adds the EAP and EAP-IG rows for Gemma 3 270M. `--findings 8` instead runs every built-in task on both
bundled models (EAP-IG, faithfulness, IOI's name-mover attention) and writes bench/results/circuits_findings.md, which
docs/circuits.md includes.

    .venv/bin/python bench/perf/circuits.py [--repeats 5] [--gemma] [--groups eap,faithfulness,calls]
    .venv/bin/python bench/perf/circuits.py --findings 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS, Row, frame_table, main, spread

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Tom gave a drink to"
ANSWER, WRONG = " Mary", " John"
SIZES = [10, 30, 100, 300, 1000, 3000, 10000, 20000, 40000, 60000]


def rounds(fns: dict[str, Callable[[], object]], repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall-clock and CPU (process) seconds of each fn over `repeats` alternating rounds after one untimed round
    (autograd left on: EAP needs it). CPU time is what this process itself spent: on a machine other jobs share it
    moves much less than the wall clock, so ratios are quoted on both (as bench/perf/sae_splice.py does)."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
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
    return statistics.median([x / y for x, y in zip(a, b, strict=True)])


def ratio_row(what: str, wall: dict, cpu: dict, key: str, base: str, target: str, ok: Callable[[float], bool],
              note: str = "") -> Row:
    """A row whose ratio is the median of per-round wall-clock ratios key / base, with CPU-time and fastest-round
    ratios in the notes."""
    ratio = paired(wall[key], wall[base])
    fastest = min(wall[key]) / min(wall[base])
    notes = (f"median of per-round ratios; CPU-time ratio {paired(cpu[key], cpu[base]):.2f}; fastest rounds "
             f"{fastest:.2f}; wall spread {spread(wall[key])} vs {spread(wall[base])}")
    return Row(what, f"{statistics.median(wall[key]):.2f} s", f"{statistics.median(wall[base]):.3f} s", ratio,
               target, ok(ratio) if target != "—" else None, f"{note}; {notes}" if note else notes)


def eap_rows(model, label: str, repeats: int) -> list[Row]:
    import slmviz

    def eap():
        return slmviz.circuit(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, model=model, method="eap")

    def eap_ig():
        return slmviz.circuit(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, model=model, method="eap-ig", steps=5)

    wall, cpu = rounds({"trace": lambda: model.trace(CLEAN), "forward": lambda: model.logits(CLEAN), "eap": eap,
                        "eap-ig": eap_ig}, repeats)
    n_pos = model.encode(CLEAN).numel()
    edges = slmviz.circuits.graph.ComponentGraph.of(model).n_edges
    return [
        ratio_row(f"{label}EAP over all {edges:,} edges, one {n_pos}-token IOI pair ÷ one full trace of the pair",
                  wall, cpu, "eap", "trace", "≤ 4", lambda r: r <= 4),
        ratio_row(f"{label}EAP-IG, 5 steps, same pair ÷ one capture-off forward (forward-equivalents)",
                  wall, cpu, "eap-ig", "forward", "≤ 24", lambda r: r <= 24),
    ]


def faithfulness_rows(model, repeats: int, calls: bool = True) -> list[Row]:
    import slmviz
    from slmviz.circuits.engine import patched_metrics

    c = slmviz.circuit(CLEAN, CORRUPTED, answer=ANSWER, wrong=WRONG, model=model, method="eap")
    real = c.graph.real()
    rank = c._rank()
    masks = [real & (rank >= n) for n in SIZES]

    def curve():
        return c.faithfulness(SIZES)

    def separate():
        return [patched_metrics(model, c.graph, c._runs, [m]) for m in masks]

    def patch_calls():
        return [slmviz.patch_edges(CLEAN, CORRUPTED, edges=masks[i], answer=ANSWER, wrong=WRONG, model=model)
                for i in range(len(SIZES))]

    wall, cpu = rounds({"curve": curve, "separate": separate, **({"calls": patch_calls} if calls else {})}, repeats)
    got = curve()["metric"].tolist()
    alone = [float(x[0, 0]) for x in separate()]
    worst = max(abs(a - b) for a, b in zip(got, alone, strict=True))
    rows = [ratio_row("10 separate patched forwards (the same engine, one edge set per call) ÷ a faithfulness curve "
                      "of the same 10 sizes (one batch)", wall, cpu, "separate", "curve", "≥ 5", lambda r: r >= 5,
                      f"sizes {SIZES[0]}–{SIZES[-1]} of {c.graph.n_edges:,} edges; max |Δ metric| batch vs separate "
                      f"{worst:.1e}")]
    if calls:
        rows.append(ratio_row("(evidence) 10 separate slmviz.patch_edges calls (each also runs both prompts) ÷ the "
                              "same curve", wall, cpu, "calls", "curve", "—", lambda r: True))
    return rows


def findings(pairs: int, out: Path) -> None:
    """Write Markdown to `out`: every built-in task on both bundled models with EAP-IG (5 steps): the top edges, the
    edges into the logits (for IOI, where each head's attention from the last position goes), faithfulness."""
    from common import load_average, machine

    import slmviz
    from slmviz.circuits import tasks

    facts = machine()
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
             f"`bench/perf/circuits.py --findings {pairs}` "
             f"on {facts['nproc']} cores ({facts['cpu']}), torch {facts['torch']}, shared with other agents' work "
             f"(load average before: {load_average()}). EAP-IG with 5 steps, {pairs} pairs per task; faithfulness "
             "of the top-n edges (every other edge patched from the corrupted run), normalized: 0 = corrupted, "
             "1 = clean."]
    for name in (None, "gemma-3-270m"):
        model = slmviz.load(name)
        for make in (tasks.ioi_task, tasks.induction_task, tasks.greater_than_task):
            task = make(model, n=pairs)
            start = time.perf_counter()
            c = slmviz.circuit(task, model=model, method="eap-ig", steps=5)
            scored = time.perf_counter() - start
            start = time.perf_counter()
            curve = c.faithfulness()
            smallest = c.smallest(0.8, count=8, curve=curve)
            timed = time.perf_counter() - start
            into_logits = c.edges[c.edges.target == "logits"].head(8)
            lines += [f"\n### {model.name}: {task.name} ({len(task)} pairs)\n",
                      f"{c}; EAP-IG {scored:.0f} s, faithfulness + smallest-80% search {timed:.0f} s\n",
                      "Top edges:\n", frame_table(c.top(12)), "\nInto the logits:\n", frame_table(into_logits),
                      "\nFaithfulness:\n", frame_table(curve), f"\nsmallest circuit reaching 0.8: {smallest} edges"]
            if task.name == "ioi":
                lines += ["\nAttention from the last position of the heads above (mean over the clean prompts):\n",
                          ioi_attention(model, task, into_logits)]
            print(lines[-1], flush=True)
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {out}")


def ioi_attention(model, task, into_logits) -> str:
    """For each head among the top edges into the logits: its mean attention from the last position to the
    indirect object (IO), to the subject's first mention (S1) and to its second (S2), over the task's clean prompts."""
    heads = [s for s in into_logits.source if s.startswith("a")]
    lines = ["| head | attn to IO | to S1 | to S2 |", "| --- | --- | --- | --- |"]
    for head in heads:
        layer, h = int(head[1:].split(".")[0]), int(head.split(".h")[1])
        io = s1 = s2 = 0.0
        for clean, answer, wrong in zip(task.clean, task.answers, task.wrongs, strict=True):
            ids = model.encode(clean).tolist()
            io_id, s_id = model.encode(answer).tolist()[-1], model.encode(wrong).tolist()[-1]
            t = model.trace(clean, names=[f"blocks.{layer}.attn.hook_pattern"])
            row = t[f"blocks.{layer}.attn.hook_pattern"][h, -1]  # [pos_k]
            s_positions = [i for i, x in enumerate(ids) if x == s_id]
            io += float(row[[i for i, x in enumerate(ids) if x == io_id]].sum())
            s1 += float(row[s_positions[0]])
            s2 += float(row[s_positions[-1]]) if len(s_positions) > 1 else 0.0
        n = len(task.clean)
        lines.append(f"| `{head}` | {io / n:.2f} | {s1 / n:.2f} | {s2 / n:.2f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[Row]:
    import slmviz

    torch.manual_seed(0)
    if args.findings:
        findings(args.findings, args.out)
        return []
    model = slmviz.load()
    groups = set(args.groups.split(","))
    rows = eap_rows(model, "", args.repeats) if "eap" in groups else []
    if "faithfulness" in groups:
        rows += faithfulness_rows(model, args.repeats, calls="calls" in groups)
    if args.gemma:
        rows += eap_rows(slmviz.load("gemma-3-270m"), "Gemma 3 270M: ", args.repeats)
    return rows


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gemma", action="store_true", help="also time EAP and EAP-IG on Gemma 3 270M")
    parser.add_argument("--groups", default="eap,faithfulness,calls",
                        help="comma-separated subset of eap, faithfulness, calls (the patch_edges evidence row)")
    parser.add_argument("--findings", type=int, default=0, metavar="PAIRS",
                        help="instead: run every built-in task with this many pairs on both bundled models")
    parser.add_argument("--out", type=Path, default=RESULTS / "circuits_findings.md",
                        help="where --findings writes its Markdown (docs/circuits.md includes it)")


if __name__ == "__main__":
    main(run, __doc__, add_args)
