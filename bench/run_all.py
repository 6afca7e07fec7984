"""Run every benchmark (each in its own process), print one table of ratios and write it to bench/results.md.

    make bench          # or: .venv/bin/python bench/run_all.py [--only forward,generate]

Scripts: forward.py (trace / capture-off forward vs transformers), generate.py (tokens/s vs transformers and
vs the weight-read floor of decode_floor.py), compare_presets.py, memory.py (peak RSS, fresh processes),
app.py (startup and Run through gradio_client, if app/ exists), op_profile.py (torch.profiler: where the time
of a trace and of a decoding step goes), patching.py (patching sweeps vs one hooked forward per cell),
sae_splice.py (a trace with one SAE spliced ÷ the same trace without), circuits.py (EAP / EAP-IG over every edge
÷ a trace / a forward; a batched faithfulness curve ÷ separate patched forwards).
Timing on a shared 2-core machine is noisy:
the load average before and after is written next to the table; re-run when it was high.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import BENCH_DIR, Row, fmt_ratio, load_average, machine

SCRIPTS = ["forward", "generate", "compare_presets", "memory", "app", "op_profile", "scan", "patching", "gemma",
           "sae_splice", "circuits"]
RESULTS = BENCH_DIR / "results.md"

# What bounds a target when it is missed (profiled with torch.profiler; see each script's docstring).
# Keyed by the start of the row's `what`; written under the table only for rows that miss.
BOUNDS = {
    "trace, 128 tokens": (
        "the GEMMs, most of a trace's time in both implementations (the profile row), and run-to-run noise "
        "(the notes' spread). attn.hook_result, the one computation transformers never does, is derived from "
        "hook_z only when read (evidence row: the cost of reading all of them). The GEMMs are MKL's, exactly "
        "as in transformers, because the parity tests hold slmviz to 1e-4 of transformers' logits; oneDNN's "
        "kernels are the other evidence row."
    ),
    "Gemma 3 270M: trace, 128 tokens": (
        "as for SmolLM2's trace row: the same MKL GEMMs on both sides, and the notes' spread."
    ),
    "Gemma 3 270M: greedy generate": (
        "the unembedding: Gemma's tied [262144, 640] matrix is 640 MiB of the ~1 GiB both implementations read "
        "per token (evidence row), read through the same MKL matrix-vector product (params.row_split_wins "
        "measures that on this CPU F.linear beats the row split). With the weight reads equal, the ratio "
        "is what slmviz saves in the small ops, a few ms of a ~80 ms step."
    ),
    "greedy generate, 48 new tokens: tokens/s ÷ weight-read floor": (
        "the small ops between the weight matmuls. The evidence row splits a decoding step: its matmuls run "
        "close to the floor pass (slmviz streams the weights in the floor's own layout and kernel, "
        "params.linear), and the rest is ~30 eager PyTorch ops per layer (two RMSNorms, RoPE, two cache "
        "writes, attention, SwiGLU, two residual adds; with their views and inner calls ~160 ATen dispatches "
        "per layer, the profile row), each a few µs because the weight stream has just evicted the caches. "
        "The whole-call row also pays the prompt's prefill, which is compute-bound (its time is in the "
        "decoding-steps row's notes). Tried and dropped: torch.compile of a layer (tens of seconds to "
        "compile, recompiled per layer, no faster step); OMP_WAIT_POLICY=ACTIVE (no change)."
    ),
    "greedy generate, 48 new tokens: decoding steps alone": (
        "as for the row above: the ~30 small ops per layer between the weight matmuls (evidence row)."
    ),
    "forward, capture off": (
        "noise: the spread in the notes overlaps transformers' (same MKL GEMMs, fused q|k|v and gate|up)."
    ),
    "peak RSS during a 512-token trace, residual hooks only": (
        "the loaded model is ~1.0 GB resident (torch + transformers + tokenizer ~0.4 GB, fp32 weights 0.54 GB); "
        "the trace adds its [512, vocab] fp32 logits (0.10 GB, part of the Trace contract) and the captured "
        "residuals (0.07 GB: resid_pre[L+1] is resid_post[L], stored once)."
    ),
}


def run_script(name: str) -> tuple[list[Row], float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(BENCH_DIR / f"{name}.py"), "--json", str(out)], cwd=BENCH_DIR)
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not out.exists():
            return [Row(f"{name}.py", "FAILED", "", None, "", False, f"exit code {done.returncode}")], seconds
        return [Row(**r) for r in json.loads(out.read_text())], seconds


def verdict(r: Row) -> str:
    return "—" if r.met is None else ("✅ met" if r.met else "❌ not met")


def table(rows: list[Row]) -> str:
    lines = ["| what | slmviz | transformers / bound | ratio | target | result | notes |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = [r.what, r.slmviz, r.reference, fmt_ratio(r.ratio), r.target, verdict(r), r.note]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated subset of " + ",".join(SCRIPTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    info = machine()
    load_before = load_average()
    started = datetime.datetime.now().astimezone()
    rows: list[Row] = []
    durations = {}
    for name in args.only.split(","):
        print(f"\n== bench/{name}.py ==", flush=True)
        script_rows, durations[name] = run_script(name)
        rows += script_rows
    load_after = load_average()

    header = (f"Measured {started:%Y-%m-%d %H:%M %Z} on {info['nproc']} cores ({info['cpu']}), "
              f"torch {info['torch']} ({info['threads']} threads), transformers {info['transformers']}, "
              f"Python {info['python']}. Load average (1, 5, 15 min) before: {load_before}; after: {load_after}.")
    body = table(rows)
    bounds = [f"- **{r.what}**: {text}" for r in rows if r.met is False
              for key, text in BOUNDS.items() if r.what.startswith(key)]
    if bounds:
        body += "\n\nWhat bounds the targets that were missed:\n\n" + "\n".join(bounds)
    note = ("Ratios are slmviz ÷ transformers (same process, same weights, same token ids, alternating rounds "
            "after warm-up, medians). Scripts: " + ", ".join(f"bench/{n}.py ({s:.0f} s)" for n, s in durations.items())
            + ".")
    print("\n" + header + "\n\n" + body + "\n\n" + note)
    args.out.write_text(f"# slmviz benchmark results\n\n{header}\n\n{body}\n\n{note}\n", encoding="utf-8")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
