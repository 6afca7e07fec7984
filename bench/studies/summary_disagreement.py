"""Why a summary's checks disagree: which of the constrained run's freezes parts `predicted` from `measured`.

`GraphSummary.check` turns each feature group off twice: in the constrained run (attention patterns, norm scales,
transcoder errors and the MLP outputs of layers without a transcoder all kept at the prompt's values: the graph's
linear model) and in a free run. This study runs the same edits with each freeze alone, and with all but one, and
says how far each run's logit changes agree in sign (over the groups whose predicted change is not negligible) and
rank with `predicted` and with `measured`: the freeze whose release moves the constrained run most of the way to
the free one is what the graph does not model.

    .venv/bin/python bench/studies/summary_disagreement.py --model SmolLM2-135M-Instruct --set plt-quick --prompts 8
    .venv/bin/python bench/studies/summary_disagreement.py ... --report

One JSON line a prompt in bench/results/summary_runs/disagreement-{model}-{set}.jsonl (resumes); --report writes
bench/results/summary_disagreement_{model}-{set}.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from summary import CANDIDATES, MAX_FEATURE_NODES, answers, spearman  # noqa: E402

import slmviz  # noqa: E402
from slmviz.graphs.intervene import constrained_hooks  # noqa: E402
from slmviz.graphs.summary import (  # noqa: E402
    CHECK_BATCH,
    NEGLIGIBLE,
    _batched_edits,
    _batched_run,
    demeaned_change,
    group_edits,
)
from slmviz.graphs.workbench import coders  # noqa: E402

PARTS = ("patterns", "scales", "errors")  # what the constrained run freezes (intervene.constrained_hooks)
SCALES = (0.5, 0.9)  # smaller edits than turning a group off: each group's features set to this share of themselves


def variants() -> dict[str, tuple[str, ...]]:
    """run name -> the parts it freezes: none (free, `measured`), each alone, all but each, all (`predicted`)."""
    out = {"free": ()}
    out.update({f"only {p}": (p,) for p in PARTS})
    out.update({f"all but {p}": tuple(q for q in PARTS if q != p) for p in PARTS})
    out["constrained"] = PARTS
    return out


def run_prompt(model, ts, prompt: str) -> dict:
    t0 = time.perf_counter()
    g = slmviz.attribution_graph(prompt, transcoders=ts, model=model, progress=False,
                                 max_feature_nodes=MAX_FEATURE_NODES)
    p = g.prune()
    s = p.summarize(max_groups=12, apply=False)
    groups = s.feature_groups
    tcs = coders(p)
    saes = list(tcs.values())
    parts = constrained_hooks(model, tcs)
    acts = {L: f"{sae.hook_name_out}.hook_sae_acts_post" for L, sae in tcs.items()}
    ids = torch.tensor(p.input_ids)
    off = [group_edits(p, members) for members in groups["members"]]
    # the same groups scaled instead of turned off: (position, feature, share x its activation in the prompt)
    acts_of = {(int(r.layer), int(r.position), int(r.feature)): float(r.activation)
               for r in p.nodes[p.nodes.kind == "feature"].itertuples()}
    n = len(groups)
    out: dict[str, list[float]] = {}
    with torch.inference_mode():
        before = model.trace(ids, saes=saes, names=[name for part in parts.values() for name in part])
        base = before.logits[-1].double()
        t = int(torch.argmax(model.logits(ids)[-1]))

        def changes(edits, frozen) -> list[float]:
            keep = {name: before[name] for part in frozen for name in parts[part]}
            rows = []
            for a in range(0, n, CHECK_BATCH):
                chunk = edits[a:a + CHECK_BATCH]
                rows.append(_batched_run(model, ids, saes, _batched_edits(chunk, acts), keep, len(chunk)))
            logits = torch.cat(rows)
            # the unedited run with these freezes is the prompt's own run (frozen values are its values)
            return [demeaned_change(logits[k], base, t) for k in range(n)]

        for run, frozen in variants().items():
            out[run] = changes(off, frozen)
        for share in SCALES:
            scaled = [{L: [(q, f, share * acts_of[(L, q, f)]) for q, f, _ in cells] for L, cells in e.items()}
                      for e in off]
            out[f"constrained x{share}"] = changes(scaled, PARTS)
            out[f"free x{share}"] = changes(scaled, ())
    last = len(p.tokens) - 1
    return {"prompt": prompt, "answer": model.to_strings([t])[0], "seconds": time.perf_counter() - t0,
            "load": common.load_average(), "runs": out,
            "at_last": [last in pos for pos in groups["positions"]], "sizes": [len(m) for m in groups["members"]]}


def agreement(a: np.ndarray, b: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """Sign agreement and Spearman of a and b over `mask`, leaving out the groups whose run overflowed (a
    non-finite change: Gemma's residual with its norm scales frozen and attention free can); the report counts
    them."""
    mask = mask & np.isfinite(a) & np.isfinite(b)
    if not mask.any():
        return math.nan, math.nan
    return float((np.sign(a[mask]) == np.sign(b[mask])).mean()), spearman(a[mask], b[mask])


def report(path: Path, out: Path, model_name: str, set_name: str) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    runs = {k: np.array([v for r in rows for v in r["runs"][k]]) for k in variants()}  # the freezes, groups off
    at_last = np.array([x for r in rows for x in r["at_last"]])
    predicted, measured = runs["constrained"], runs["free"]
    big = np.abs(predicted) >= NEGLIGIBLE
    lines = [f"# Why predicted and measured disagree: {model_name}, {set_name}", "",
             f"{len(rows)} prompts the model answers right, {int(big.sum())} groups whose predicted change is not "
             f"negligible (|Δ| >= {NEGLIGIBLE}; of {len(predicted)}), the default grouping "
             f"(bench/studies/summary_disagreement.py). CPU: {common.cpu_model()}, {os.cpu_count()} cores.", "",
             "Each run turns the same groups off with some of the constrained run's freezes: `constrained` is "
             "`predicted`, `free` is `measured`. Sign agreement and Spearman over the non-negligible groups, "
             "pooled.", "",
             "| run (what stays frozen) | agrees with predicted | Spearman | agrees with measured | Spearman | "
             "agrees with measured, groups at the last position | at earlier positions only | overflowed (left out) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, value in runs.items():
        ap, sp = agreement(value, predicted, big)
        am, sm = agreement(value, measured, big)
        al, _ = agreement(value, measured, big & at_last)
        ae, _ = agreement(value, measured, big & ~at_last)
        overflowed = int((big & ~np.isfinite(value)).sum())
        lines.append(f"| {name} | {ap:.2f} | {sp:.2f} | {am:.2f} | {sm:.2f} | {al:.2f} | {ae:.2f} | {overflowed} |")
    lines += ["", f"Groups at the last position: {int((big & at_last).sum())}; at earlier positions only: "
              f"{int((big & ~at_last).sum())}.", "",
              "## Smaller edits", "",
              "The same groups (the same non-negligible ones) with their features scaled to a share of their "
              "activation instead of turned off: constrained against free at each share.", "",
              "| edit | sign agreement | Spearman | at the last position | at earlier positions only |",
              "|---|---|---|---|---|"]
    for share in (0.0, *SCALES):
        names = ("constrained", "free") if share == 0 else (f"constrained x{share}", f"free x{share}")
        c, f = (np.array([v for r in rows for v in r["runs"].get(k, [])]) for k in names)
        if len(c) != len(predicted):
            continue  # rows written before the smaller edits were measured
        a, rho = agreement(c, f, big)
        lines.append(f"| x{share} | {a:.2f} | {rho:.2f} | {agreement(c, f, big & at_last)[0]:.2f} | "
                     f"{agreement(c, f, big & ~at_last)[0]:.2f} |")
    lines.append("")
    out.write_text("\n".join(lines))
    print(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--set", default="plt-quick")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args()
    path = common.RESULTS / "summary_runs" / f"disagreement-{a.model}-{a.set}.jsonl"
    out = common.RESULTS / f"summary_disagreement_{a.model}-{a.set}.md"
    if a.report:
        report(path, out, a.model, a.set)
        return
    torch.set_num_threads(a.threads)
    model = slmviz.load(a.model)
    ts = slmviz.load_transcoders(a.set, model=model)
    done = {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()} \
        if path.is_file() else set()
    for prompt, _, _ in answers(model, CANDIDATES, a.prompts):
        if prompt in done:
            continue
        row = run_prompt(model, ts, prompt)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{prompt!r}: {row['seconds']:.0f} s", flush=True)
    report(path, out, a.model, a.set)


if __name__ == "__main__":
    main()
