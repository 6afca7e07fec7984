"""SAE features as a patch site on both bundled models: how closely attribution tracks the exact patched runs, and
what the call costs (docs/interventions.md, "Features as a patch site").

Runs `slmviz.patch(..., site="sae")` with each model's bundled SAEs on one IOI pair in both directions, with the `--top`
cells of largest |attribution| also patched exactly, and prints the number of cells, the Pearson r and the sign
agreement between estimated and exact changes over those cells, the largest cells, and the wall time, and writes
them as Markdown to bench/results/feature_patching.md (docs/interventions.md includes it).

    .venv/bin/python bench/studies/feature_patching.py [--top 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS, frame_table, load_average, machine

import slmviz

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Tom gave a drink to"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=40, help="cells run exactly")
    parser.add_argument("--out", type=Path, default=RESULTS / "feature_patching.md")
    args = parser.parse_args()
    facts = machine()
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by "
             "`bench/studies/feature_patching.py --top "
             f"{args.top}` on {facts['nproc']} cores ({facts['cpu']}), torch {facts['torch']}, shared with other "
             f"jobs (load average before: {load_average()}). Clean \"{CLEAN}\", corrupted \"{CORRUPTED}\", metric "
             "logit(\" Mary\") − logit(\" John\"). *effect*: the attribution estimate of the metric's change, "
             "*exact*: the patched run's change."]
    for name in (None, "gemma-3-270m"):
        m = slmviz.load(name)
        names = slmviz.bundled_saes(m)
        saes = [slmviz.load_sae(sae, model=m) for sae in names]
        lines.append(f"\n**{m.name}** with the bundled SAEs {', '.join(f'`{n}`' for n in names)}:")
        for direction in ("noise", "denoise"):
            start = time.perf_counter()
            r = slmviz.patch(CLEAN, CORRUPTED, answer=" Mary", wrong=" John", site="sae", saes=saes, model=m,
                             direction=direction, top=args.top)
            elapsed = time.perf_counter() - start
            frame = r.frame()
            ran = frame.dropna(subset=["exact"])
            estimate, exact = ran["value"] - r.target_metric, ran["exact"] - r.target_metric
            r_exact = float(np.corrcoef(estimate, exact)[0, 1])
            signs = int((np.sign(estimate) == np.sign(exact)).sum())
            per_sae = ", ".join(f"`{hook}` {n}" for hook, n in frame.groupby("hook").size().items())
            top = r.top(8)[["hook", "feature", "position", "token", "effect", "exact"]]
            top = top.assign(exact=top["exact"] - r.target_metric)
            lines += [f"\n*direction={direction!r}*: {len(frame):,} cells ({per_sae}); over the {len(ran)} cells "
                      f"run exactly, Pearson r of estimate and exact change {r_exact:.3f}, same sign {signs} of "
                      f"{len(ran)}; the call took {elapsed:.1f} s.\n", frame_table(top)]
            print("\n".join(lines[-2:]), flush=True)
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
