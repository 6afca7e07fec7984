"""Render the README's side-by-side table of replacement models from bench/results/replacement_scores.json.

    python bench/tools/replacement_table.py "plt=PLT set (30 × 4,096)" "clt=CLT (30 × 512)" clt-no-pre-act-loss

Each named entry (`name` or `name=column heading`) of the JSON (written by `bench/studies/replacement_scores.py
--evaluate`) becomes a column; every figure is read from the file, none is typed in, so the README's table is
re-made by running this again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS, markdown_table


def _layers(entry: dict, split: str) -> str:
    layers = entry[split]["layers"]
    evs = [layer["explained_variance"] for layer in layers]
    nmse = statistics.mean(1 - ev for ev in evs)
    worst = min(layers, key=lambda layer: layer["explained_variance"])
    return f"{nmse:.3f} ({statistics.median(evs):.3f}; {worst['explained_variance']:.3f} at {worst['layer']})"


def _l0(entry: dict, split: str) -> str:
    l0s = [layer["l0"] for layer in entry[split]["layers"]]
    return f"{statistics.median(l0s):.1f} ({sum(l0s):,.0f})"


def _replaced(entry: dict, split: str) -> str:
    replaced = entry[split]["replaced"]
    return f"{replaced['ce_loss_score']:.3f} / {replaced['top1_agreement']:.3f}"


def _range(entry: dict, name: str) -> str:
    low, high = entry[f"range_{name}"]
    return f"{entry[f'median_{name}']:.3f} ({low:.3f}–{high:.3f})"


ROWS = [
    ("graph replacement score, median (range)", lambda e: _range(e, "replacement")),
    ("graph completeness, median (range)", lambda e: _range(e, "completeness")),
    ("mean path length, token to logit (median)", lambda e: f"{e['median_path_length']:.2f}"),
    (
        "active features in a graph (median) / graph time (median)",
        lambda e: f"{statistics.median(p['features'] for p in e['prompts']):,.0f} / {e['median_seconds']:.1f} s",
    ),
    ("broad: NMSE, mean of layers (median EV; worst layer)", lambda e: _layers(e, "heldout_broad")),
    ("broad: L0 per layer, median (sum over layers)", lambda e: _l0(e, "heldout_broad")),
    ("broad: every MLP replaced, CE-loss score / top-1 agreement", lambda e: _replaced(e, "heldout_broad")),
    ("chat: NMSE, mean of layers (median EV; worst layer)", lambda e: _layers(e, "heldout_chat")),
    ("chat: L0 per layer, median (sum over layers)", lambda e: _l0(e, "heldout_chat")),
    ("chat: every MLP replaced, CE-loss score / top-1 agreement", lambda e: _replaced(e, "heldout_chat")),
]


def render(scores: dict, names: list[str]) -> str:
    """The markdown table, one column per entry of `scores["sets"]` named in `names` (each `name` or
    `name=heading`)."""
    headings = [name.partition("=")[2] or name for name in names]
    names = [name.partition("=")[0] for name in names]
    missing = [name for name in names if name not in scores["sets"]]
    if missing:
        raise SystemExit(f"not in the scores file: {missing}; it holds {sorted(scores['sets'])}")
    return markdown_table(["figure", *headings],
                          ([label, *(cell(scores["sets"][name]) for name in names)] for label, cell in ROWS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help="entries of the scores file, one column each: NAME or NAME=HEADING")
    parser.add_argument("--scores", type=Path, default=RESULTS / "replacement_scores.json")
    args = parser.parse_args()
    print(render(json.loads(args.scores.read_text()), args.names))


if __name__ == "__main__":
    main()
