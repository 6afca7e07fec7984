"""The bundled SAEs' evaluations as markdown tables, rendered from what was measured (nothing typed in):

    .venv/bin/python bench/bundled_table.py > bench/bundled_saes.md

- the first table: every bundled SAE as it ships, from its cfg.json (`metadata.evaluations`, written by
  bench/bundle_sae.py on the files as shipped): EV, L0, CE-loss score and dead fraction on the broad corpus's held-out
  split, the chat corpus's held-out split (the model's own chat and prose from seeds never trained on) and
  bench/modern_prose.txt (32 hand-written modern texts);
- the second: the same SAEs' explained variance before and after they were retrained on "mixed", the "before" from
  bench/bundled_broad_trained.json (the broad-trained files, measured on the same texts before they were replaced).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TEXTS = ("broad-heldout", "chat-heldout", "modern-prose")
BEFORE = REPO / "bench" / "bundled_broad_trained.json"


def shipped() -> dict[tuple[str, str], dict]:
    """{(model, name): cfg.json's metadata} of every bundled SAE."""
    from slmviz.features.bundled import BUNDLED_DIR

    found = {}
    for cfg in sorted(BUNDLED_DIR.glob("*/*/cfg.json")):
        found[(cfg.parent.parent.name, cfg.parent.name)] = json.loads(cfg.read_text())["metadata"]
    return found


def table(rows: list[list[str]], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join([*lines, *("| " + " | ".join(r) + " |" for r in rows)])


def three(evals: dict, key: str, fmt: str = "{:.3f}") -> str:
    return " / ".join(fmt.format(evals[t][key]) if t in evals and key in evals[t] else "–" for t in TEXTS)


def main() -> None:
    saes = shipped()
    rows = []
    for (model, name), meta in saes.items():
        e, cfg = meta["evaluations"], meta["training_config"]
        rows.append([model, f"`{name}`", f"{cfg['d_sae']}, k {cfg['k']}", f"{cfg['tokens'] / 1e6:.2f}M of "
                     f"{meta['corpus_name']}", three(e, "explained_variance"), three(e, "l0", "{:.1f}"),
                     three(e, "ce_loss_score"), three(e, "frac_dead", "{:.1%}"),
                     " / ".join(f"{e[t]['targets']:,}" for t in TEXTS)])
    print(table(rows, ["model", "SAE", "width, k", "trained on", "EV (broad / chat / prose)", "L0",
                       "CE-loss score", "dead", "rows evaluated"]))
    print()
    before = json.loads(BEFORE.read_text())["saes"]
    rows = []
    for (model, name), meta in saes.items():
        old, new = before.get(model, {}).get(name), meta["evaluations"]
        if old is None:
            continue
        ev = {t: (old[t]["explained_variance"], new[t]["explained_variance"]) for t in TEXTS}
        rows.append([model, f"`{name}`", *(f"{a:.3f} → **{b:.3f}**" for a, b in ev.values())])
    print(table(rows, ["model", "SAE", "EV broad held-out", "EV chat held-out", "EV modern prose"]))


if __name__ == "__main__":
    main()
