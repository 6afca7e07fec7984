"""`slmviz.compare` of every preset on a 64-token prompt: total wall time (one faithful trace + one trace per
preset, residual hooks captured). No transformers counterpart: the target is absolute.

    .venv/bin/python bench/perf/compare_presets.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, interleaved, main, median, prompt_ids, spread

TARGET_SECONDS = 3.0


def run(args: argparse.Namespace) -> list[Row]:
    import slmviz

    model = slmviz.load()
    ids = prompt_ids(model, 64)
    n_presets = len([p for p in slmviz.PRESETS if p != "faithful"])
    t = interleaved({"compare": lambda: slmviz.compare(ids, model=model)}, warmup=1, repeats=args.repeats)
    seconds = median(t["compare"])
    return [Row(
        f"compare, all {n_presets} presets, 64-token prompt (total)",
        f"{seconds:.2f} s", "", seconds, f"≤ {TARGET_SECONDS:g} s", seconds <= TARGET_SECONDS,
        f"{n_presets + 1} forwards; spread {spread(t['compare'])}",
    )]


if __name__ == "__main__":
    main(run, __doc__)
