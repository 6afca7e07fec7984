"""Render a replacement-model curve (bench/results/replacement_curve.json: tokens; bench/results/replacement_width.json:
widths) as the markdown table docs/features.md includes. Every figure is read from the JSON, none is typed in.

    .venv/bin/python bench/tools/curve_table.py bench/results/replacement_curve.json --prepared plt \
        > bench/results/replacement_curve.md
    .venv/bin/python bench/tools/curve_table.py bench/results/replacement_width.json \
        > bench/results/replacement_width.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS, markdown_table
from replacement_table import _range, _replaced


def _heldout(point: dict, split: str) -> str:
    return f"{point[f'heldout_{split}']['median_ev']:.3f} / {_replaced(point, f'heldout_{split}')}"


def _minutes(seconds: float | None) -> str:
    return "not timed" if seconds is None else f"{seconds / 60:.1f} min"


def _largest_error_share(point: dict) -> str:
    share = point["error_share_by_layer"]
    layer = max(range(len(share)), key=share.__getitem__)
    return f"{100 * share[layer]:.1f} % (layer {layer})"


def prepared_point(name: str) -> dict:
    """The prepared set `name` of bench/results/replacement_scores.json as the token curve's last point: its recipe's
    tokens (prepared.RECIPES), and its held-out EV's median over layers as replacement_curve.py reports it."""
    from slmviz.training.prepare import RECIPES

    scores = json.loads((RESULTS / "replacement_scores.json").read_text())
    entry = dict(scores["sets"][name])
    entry["tokens"] = RECIPES[(scores["model"], name)]["tokens"]
    entry["label"] = f"{entry['tokens'] / 1000:.0f}k (the prepared set)"
    for split in ("broad", "chat"):
        evs = [layer["explained_variance"] for layer in entry[f"heldout_{split}"]["layers"]]
        entry[f"heldout_{split}"] = {**entry[f"heldout_{split}"], "median_ev": statistics.median(evs)}
    return entry


def table(points: list[dict]) -> str:
    """One row a point: by width when the points differ in width (replacement_width.py), else by tokens."""
    by_width = "d_sae" in points[0]
    head = ["features per layer" if by_width else "tokens per layer"]
    if by_width:  # trained and scored in one run on one machine, so their times compare
        head += ["tokens per layer", "training time", "graph time (median)"]
    head += ["replacement, median (range)", "completeness, median (range)", "path length",
             "broad: median EV / CE-loss score / top-1", "chat: median EV / CE-loss score / top-1",
             "largest error share"]
    rows = []
    for p in points:
        row = [p.get("label") or (f"{p['d_sae']:,}" if by_width else f"{p['tokens'] / 1000:.0f}k")]
        if by_width:
            row += [f"{p['tokens']:,}", _minutes(p.get("train_seconds")), f"{p['median_seconds']:.1f} s"]
        row += [_range(p, "replacement"), _range(p, "completeness"), f"{p['median_path_length']:.2f}",
                _heldout(p, "broad"), _heldout(p, "chat"), _largest_error_share(p)]
        rows.append(row)
    return markdown_table(head, rows) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("curve", type=Path)
    p.add_argument("--prepared", default=None,
                   help="a prepared set of bench/results/replacement_scores.json to end with")
    args = p.parse_args()
    points = json.loads(args.curve.read_text())["points"]
    if args.prepared:
        last = prepared_point(args.prepared)
        points = [pt for pt in points if pt["tokens"] != last["tokens"]] + [last]
    print(table(points), end="")


if __name__ == "__main__":
    main()
