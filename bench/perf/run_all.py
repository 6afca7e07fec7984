"""Run every benchmark (each in its own process), print one table of ratios and write it to bench/results/perf.md.

    make bench          # or: .venv/bin/python bench/perf/run_all.py [--only forward,generate]

Scripts: forward.py (trace / capture-off forward vs transformers), generate.py (tokens/s vs transformers and
vs the weight-read floor of decode_floor.py), compare_presets.py, memory.py (peak RSS, fresh processes),
app.py (startup and Run through gradio_client, if app/ exists), op_profile.py (torch.profiler: where the time
of a trace and of a decoding step goes), patching.py (patching sweeps vs one hooked forward per cell),
sae_splice.py (a trace with one SAE spliced ÷ the same trace without), circuits.py (EAP / EAP-IG over every edge
÷ a trace / a forward; a batched faithfulness curve ÷ separate patched forwards), dtype.py (bf16 against fp32
and against transformers in bf16), tl_compare.py (the trace against TransformerLens 4.3's run_with_cache, run in
its own venv). Hand-written sections of the results file (from its first "## " heading on) are kept.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import BENCH_DIR, RESULTS, Row, load_average, machine, results_table

SCRIPTS = ["forward", "generate", "compare_presets", "memory", "app", "op_profile", "scan", "patching", "gemma",
           "sae_splice", "circuits", "dtype", "tl_compare"]
PERF = Path(__file__).resolve().parent  # the suite's scripts
TABLE = RESULTS / "perf.md"

# What bounds a target when it is missed (profiled with torch.profiler; see each script's docstring).
# Keyed by the start of the row's `what`; written under the table only for rows that miss.
BOUNDS = {
    "trace, 128 tokens": (
        "the GEMMs, most of a trace's time in both implementations (the profile row), and run-to-run noise "
        "(the notes' spread). Both run the same work on the same MKL kernels; slmviz dispatches fewer ATen ops "
        "(fused q|k|v and gate|up, one RoPE for q and k). attn.hook_result, the one computation transformers "
        "never does, is derived from hook_z only when read (evidence row). oneDNN's kernels run the trace's "
        "GEMMs faster on this CPU (the oneDNN evidence row) but move the logits by up to 1.5e-4 from "
        "transformers' over the parity prompts (tests/test_parity.py holds slmviz to 1e-4, residuals to 1e-5 "
        "relative, and oneDNN reaches 1.6e-5), so slmviz keeps MKL: a faithful trace cannot use them."
    ),
    "full trace, 128 tokens, all hooks: TransformerLens": (
        "the trace row: TransformerLens 4.3's TransformerBridge runs transformers' own eager model underneath "
        "(the same MKL GEMMs, values equal to slmviz's: the notes' max |Δ|) and adds its hook wrappers (a "
        "hook_in and hook_out around every submodule: 1393 cached tensors to slmviz's 693). The ratio is "
        "(transformers' forward + the bridge's hooks) ÷ slmviz's trace, and slmviz's trace is about "
        "transformers' forward (the first row), so 2x needs the bridge's hooks to cost as much as the whole "
        "forward; at 128 tokens they cost a third to two thirds of it."
    ),
    "bf16 greedy generate, 48 new tokens: decoding steps alone": (
        "the bf16 matrix-vector products themselves: PyTorch's CPU bf16 one-row product (oneDNN, the weight "
        "reordered on every call) streams 1.5-3 GB/s here against fp32's 12-16 GB/s, so the bf16 floor pass is "
        "no faster than fp32's despite half the bytes, and slmviz's bf16 step pays those products plus the "
        "one-row kernel choice. On this CPU bf16 does not win for decoding: load with the default float32 to "
        "generate (bf16 wins for many-row work: the GEMM row, traces, scans)."
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
        "the prompt's prefill: the whole-call row pays 46 tokens of compute-bound GEMMs (their time is in the "
        "decoding-steps row's notes), which the weight-read floor does not bound; the decoding steps are the "
        "row below."
    ),
    "greedy generate, 48 new tokens: decoding steps alone": (
        "the small ops between the weight matmuls (the evidence row splits a step: its matmuls now run at the "
        "floor pass's speed, the rest is ~30 eager PyTorch ops per layer, the profile row). Until 2026-12-01 "
        "19:30 the one-row kernel probe (params.row_split_wins) timed 56 MB of matrices, which this AMD EPYC's "
        "32 MB L3 half held, so it picked F.linear's one-core product, and the online choice never switched "
        "back because each lone retried split paid its sleeping thread's wake-up: a step's matmuls took 2.4x "
        "the floor pass. The probe now streams 4x the last-level cache, and the online choice retries in runs "
        "and skips the first call after a switch (params.OnlineChoice); SmolLM2 decodes at ~50 tok/s here "
        "instead of ~28. Tried and dropped: torch.compile of a layer (tens of seconds to compile, recompiled "
        "per layer, no faster step); oneDNN for the weights (not within the parity tolerance, see the trace row)."
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


def kept_sections(path: Path) -> str:
    """The hand-written sections of an existing results file (from its first "## " heading on): a run rewrites
    the generated table above them and keeps them, so a section another script or a person added survives."""
    if not path.exists():
        return ""
    text = path.read_text(encoding="utf-8")
    start = text.find("\n## ")
    return "" if start < 0 else text[start:].strip("\n") + "\n"


def run_script(name: str) -> tuple[list[Row], float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        start = time.perf_counter()
        done = subprocess.run([sys.executable, str(PERF / f"{name}.py"), "--json", str(out)], cwd=BENCH_DIR)
        seconds = time.perf_counter() - start
        if done.returncode != 0 or not out.exists():
            return [Row(f"{name}.py", "FAILED", "", None, "", False, f"exit code {done.returncode}")], seconds
        return [Row(**r) for r in json.loads(out.read_text())], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", default=",".join(SCRIPTS), help="comma-separated subset of " + ",".join(SCRIPTS))
    parser.add_argument("--out", type=Path, default=TABLE)
    args = parser.parse_args()
    info = machine()
    load_before = load_average()
    started = datetime.datetime.now().astimezone()
    rows: list[Row] = []
    durations = {}
    for name in args.only.split(","):
        print(f"\n== bench/perf/{name}.py ==", flush=True)
        script_rows, durations[name] = run_script(name)
        rows += script_rows
    load_after = load_average()

    header = (f"Measured {started:%Y-%m-%d %H:%M %Z} on {info['nproc']} cores ({info['cpu']}), "
              f"torch {info['torch']} ({info['threads']} threads), transformers {info['transformers']}, "
              f"Python {info['python']}. Load average (1, 5, 15 min) before: {load_before}; after: {load_after}.")
    body = results_table(rows)
    bounds = [f"- **{r.what}**: {text}" for r in rows if r.met is False
              for key, text in BOUNDS.items() if r.what.startswith(key)]
    if bounds:
        body += "\n\nWhat bounds the targets that were missed:\n\n" + "\n".join(bounds)
    note = ("Ratios are slmviz ÷ transformers (same process, same weights, same token ids, alternating rounds "
            "after warm-up, medians). Scripts: "
            + ", ".join(f"bench/perf/{n}.py ({s:.0f} s)" for n, s in durations.items()) + ".")
    busiest = max(float(x) for x in (load_before + " " + load_after).split() if x.replace(".", "").isdigit())
    if busiest > int(info["nproc"]):
        note += (f" The cores were shared with other work while this ran (load average up to {busiest:.1f} on "
                 f"{info['nproc']} cores): the ratios are noisier than on a quiet machine, and the notes' spreads "
                 "show by how much.")
    print("\n" + header + "\n\n" + body + "\n\n" + note)
    kept = kept_sections(args.out)
    args.out.write_text(f"# slmviz benchmark results\n\n{header}\n\n{body}\n\n{note}\n"
                        + (f"\n{kept}" if kept else ""), encoding="utf-8")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
