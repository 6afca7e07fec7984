"""The bundled SAEs' evaluations as markdown tables, rendered from what was measured (nothing typed in):

    .venv/bin/python bench/tools/bundled_table.py > bench/results/bundled_saes.md

- the first table: every bundled SAE as it ships, from its cfg.json (`metadata.evaluations`, written by
  bench/tools/bundle_sae.py on the files as shipped): EV, L0, CE-loss score and dead fraction on the broad corpus's
  held-out split, the chat corpus's held-out split (the model's own chat and prose from seeds never trained on) and
  bench/modern_prose.txt (32 hand-written modern texts);
- the second: the same SAEs' explained variance through their retrainings, oldest first: trained on the broad corpus
  (bench/results/bundled_broad_trained.json), on "mixed" (bench/results/bundled_mixed_trained.json), as shipped; each
  record holds the files measured on the same texts before they were replaced, and a record of the SAE that still
  ships is shown once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS, markdown_table

TEXTS = ("broad-heldout", "chat-heldout", "modern-prose")
# the earlier bundles, oldest first: trained on the broad corpus, then on "mixed"
BEFORE = (("broad", RESULTS / "bundled_broad_trained.json"), ("mixed", RESULTS / "bundled_mixed_trained.json"))


def shipped() -> dict[tuple[str, str], dict]:
    """{(model, name): cfg.json's metadata} of every bundled SAE."""
    from slmviz.features.bundled import BUNDLED_DIR

    found = {}
    for cfg in sorted(BUNDLED_DIR.glob("*/*/cfg.json")):
        found[(cfg.parent.parent.name, cfg.parent.name)] = json.loads(cfg.read_text())["metadata"]
    return found


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
    print(markdown_table(["model", "SAE", "width, k", "trained on", "EV (broad / chat / prose)", "L0",
                          "CE-loss score", "dead", "rows evaluated"], rows))
    print()
    earlier = [(corpus, json.loads(path.read_text())["saes"]) for corpus, path in BEFORE]
    rows = []
    for (model, name), meta in saes.items():
        steps = [(corpus, e[model][name]) for corpus, e in earlier if name in e.get(model, {})]
        if steps and steps[-1][1].get("training_command") == meta["training_command"]:
            steps = steps[:-1]  # still the SAE that record measured: shown once, as shipped
        steps.append((meta["corpus_name"], meta["evaluations"]))
        if len(steps) > 1:
            rows.append([model, f"`{name}`", " → ".join(c for c, _ in steps), *(trail(steps, t) for t in TEXTS)])
    print(markdown_table(["model", "SAE", "trained on", "EV broad held-out", "EV chat held-out", "EV modern prose"],
                         rows))


def trail(steps: list[tuple[str, dict]], text: str) -> str:
    """One text's EV through the retrainings, the shipped one in bold."""
    evs = [f"{e[text]['explained_variance']:.3f}" for _, e in steps]
    return " → ".join([*evs[:-1], f"**{evs[-1]}**"])


if __name__ == "__main__":
    main()
