"""Peak resident memory of a 512-token trace, full capture vs residual hooks only, each in a fresh process.

Each measurement gets its own subprocess (a process's peak never goes down): load the default model,
reset the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`), trace 512 tokens with the given
`names=` filter, and read the peak (VmHWM) again. So "during the trace" is the most the process held while
tracing, with the model resident as in the app; loading's own transient peak is reported next to it, and
the model alone (loaded, nothing traced) is measured the same way.

    .venv/bin/python bench/perf/memory.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import BENCH_DIR, Row, main

RESIDUAL_LIMIT_GB = 1.2
MODES = {
    "model only": None,
    "full capture": "all",
    "residual only": "resid",
}

CHILD = r"""
import json, sys, torch
sys.path.insert(0, {bench!r})
from common import prompt_ids
import slmviz

def status_gb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e6  # kB -> GB
mode = {mode!r}
model = slmviz.load()
out = {{"load_peak_gb": status_gb("VmHWM"), "after_load_gb": status_gb("VmRSS")}}
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM to the current RSS: from here on it is the peak of what follows
if mode is not None:
    ids = prompt_ids(model, 512)
    names = None if mode == "all" else (lambda n: "resid" in n)
    t = model.trace(ids, names=names)
    out["hooks"] = len(t.names)
    storages = {{v.untyped_storage().data_ptr(): v.untyped_storage().nbytes() for v in t.cache.values()}}
    out["captured_gb"] = sum(storages.values()) / 1e9  # views of one buffer counted once
out["peak_gb"] = status_gb("VmHWM")
print(json.dumps(out))
"""


def measure(mode: str | None) -> dict:
    code = CHILD.format(bench=str(BENCH_DIR), mode=mode)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> list[Row]:
    results = {label: measure(mode) for label, mode in MODES.items()}
    for label, r in results.items():
        print(f"  {label:14s} peak RSS {r['peak_gb']:.2f} GB", json.dumps(r))
    base = results["model only"]["after_load_gb"]
    full, resid = results["full capture"], results["residual only"]
    load_peak = max(r["load_peak_gb"] for r in results.values())

    def note(r: dict) -> str:
        return (f"{r['hooks']} hooks, {r['captured_gb']:.2f} GB captured; fresh process; its peak while loading "
                f"the model, before the trace: {r['load_peak_gb']:.2f} GB")

    return [
        Row("peak RSS during a 512-token trace, full capture", f"{full['peak_gb']:.2f} GB",
            f"model loaded {base:.2f} GB", None, "recorded", None, note(full)),
        Row("peak RSS during a 512-token trace, residual hooks only", f"{resid['peak_gb']:.2f} GB",
            f"model loaded {base:.2f} GB", resid["peak_gb"], f"≤ {RESIDUAL_LIMIT_GB} GB",
            resid["peak_gb"] <= RESIDUAL_LIMIT_GB, note(resid)),
        Row("peak RSS while loading the model (slmviz.load(), before any trace)", f"{load_peak:.2f} GB", "",
            None, "recorded", None, "the process's lifetime peak when it is higher than the trace's"),
    ]


if __name__ == "__main__":
    main(run, __doc__)
