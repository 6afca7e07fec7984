"""Issue 51's goals for graph summaries, measured on prompts the model answers right, with a prepared set:

- feature groups (at most 12) and the share of the kept features' influence they hold (>= 80 %);
- predicted (constrained) vs measured (free) logit change of each group turned off: sign agreement over the groups
  whose predicted change is not negligible (>= 90 %) and Spearman between them (>= 0.8);
- summarize + check seconds a graph (<= 15 s), beside the graph's own build time;
- for each prompt, the answer's probability change when its most influential group is off (free run);
- the median label score of the features in the summaries against the top-token baseline (when the set's deep scan
  exists);
and, for the grouping study, the same figures for every grouping method (graphs.summary.METHODS).

    .venv/bin/python bench/studies/summary.py --model SmolLM2-135M-Instruct --set plt-quick      # resumes
    .venv/bin/python bench/studies/summary.py --model SmolLM2-135M-Instruct --set plt-quick --report

One JSON line a prompt in bench/results/summary_runs/{model}-{set}.jsonl (a prompt already there is skipped: a
stopped run resumes); --report writes bench/results/summary_{model}-{set}.md from it.
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
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import slmviz  # noqa: E402
from slmviz.graphs.summary import DEFAULT_METHOD, METHODS  # noqa: E402

MAX_FEATURE_NODES = 4096  # app/transcoder_sets.py's: what a person gets in the Graph tab
# the methods compared on a prepared set (each costs a check per prompt); the bundled study compared all of METHODS
STUDY_METHODS = ("both", "both+place", "signed")

# (prompt, the answer's first token stripped and lowercased): facts, two-hop, IOI, induction, arithmetic, syntax
CANDIDATES = [
    ("The capital of France is", "paris"), ("The Eiffel Tower is in the city of", "paris"),
    ("The capital of Japan is", "tokyo"), ("The capital of Italy is", "rome"),
    ("The capital of Germany is", "berlin"), ("The capital of Spain is", "madrid"),
    ("The capital of England is", "london"), ("The largest planet in the solar system is", "jupiter"),
    ("Water is made of hydrogen and", "oxygen"), ("The opposite of hot is", "cold"),
    ("The sun rises in the", "east"), ("Monday, Tuesday,", "wednesday"), ("January, February,", "march"),
    ("one, two, three,", "four"), ("The color of the sky on a clear day is", "blue"),
    ("When Mary and John went to the store, John gave a drink to", "mary"),
    ("After Tom and Anna arrived at the party, Anna handed a gift to", "tom"),
    ("When Sarah and David met at the park, David threw the ball to", "sarah"),
    ("Then, Lucy and Mark had a long talk, and Mark gave the book to", "lucy"),
    ("apple kiwi plum fig apple kiwi", "plum"), ("red blue green red blue", "green"),
    ("Dursley Potter Granger Dursley Potter", "granger"),
    ("The currency of the United States is the", "dollar"), ("The Statue of Liberty is in New", "york"),
    ("The capital of the state containing Dallas is", "austin"),
    ("The language spoken in the country whose capital is Madrid is", "spanish"),
    ("A baby cat is called a", "kitten"), ("Ice is frozen", "water"), ("Bees make", "honey"),
    ("The first man to walk on the moon was Neil", "armstrong"), ("Romeo and", "juliet"),
    ("Cats and", "dogs"), ("The chemical symbol for gold is", "au"), ("Salt and", "pepper"),
]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rho: Pearson's r of the ranks (ties averaged)."""
    if len(a) < 3:
        return math.nan

    def ranks(x: np.ndarray) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x))
        for v in np.unique(x):
            at = x == v
            r[at] = r[at].mean()
        return r

    ra, rb = ranks(np.asarray(a)), ranks(np.asarray(b))
    if ra.std() == 0 or rb.std() == 0:
        return math.nan
    return float(np.corrcoef(ra, rb)[0, 1])


def answers(model, prompts, n: int) -> list[tuple[str, str, float]]:
    """The first `n` candidates whose top token is the answer: (prompt, answer token, its probability)."""
    out = []
    for prompt, want in prompts:
        ids = slmviz.graphs.attribution.prepend_special(model.tokenizer, model.encode(prompt))
        probs = torch.softmax(model.logits(ids)[-1].float(), -1)
        top = int(probs.argmax())
        token = model.to_strings([top])[0]
        if token.strip().lower() == want:
            out.append((prompt, token, float(probs[top])))
        if len(out) == n:
            break
    return out


def run_prompt(model, ts, labels, prompt: str) -> dict:
    t0 = time.perf_counter()
    # the Graph tab's cap on a prepared set (a 16-token prompt has ~30k active features over 30 layers)
    g = slmviz.attribution_graph(prompt, transcoders=ts, model=model, progress=False,
                                 max_feature_nodes=MAX_FEATURE_NODES)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    p = g.prune()
    prune = time.perf_counter() - t0
    if labels is not None:
        p.use_labels(labels)
    row = {"prompt": prompt, "graph_s": build, "prune_s": prune, "nodes": int(p.node_mask.sum()),
           "features": int(((p.nodes.kind == "feature").to_numpy() & p.node_mask.numpy()).sum()), "methods": {}}
    for method in STUDY_METHODS:
        t0 = time.perf_counter()
        s = p.summarize(max_groups=12, method=method, apply=False)
        summarize_s = time.perf_counter() - t0
        checks = s.check()
        check_s = s.seconds["check"]
        feats = s.feature_groups
        big = checks[~checks.negligible]
        top = checks.iloc[0]  # groups are ordered by influence: the first is the most influential
        row["methods"][method] = {
            "groups": len(feats), "coverage": s.coverage, "summarize_s": summarize_s, "check_s": check_s,
            "agree_all": float(checks.agree.mean()) if len(checks) else math.nan,
            "non_negligible": len(big), "agree": float(big.agree.mean()) if len(big) else math.nan,
            "spearman": spearman(checks.predicted.to_numpy(), checks.measured.to_numpy()),
            "spearman_non_negligible": spearman(big.predicted.to_numpy(), big.measured.to_numpy()),
            "top_group": top["name"], "top_influence": float(feats.influence.iloc[0]),
            "top_predicted": float(top.predicted), "top_measured": float(top.measured),
            "top_measured_prob": float(top.measured_prob), "answer": checks.attrs["target_token"],
            "answer_prob": checks.attrs["probability"],
            "sizes": [len(m) for m in feats.members],
            "checks": [{**{k: (bool(v) if isinstance(v, np.bool_) else v) for k, v in r.items()},
                        "positions": list(map(int, pos)), "layers": list(map(int, lay)), "size": len(mem)}
                       for r, pos, lay, mem in zip(checks.to_dict("records"), feats.positions, feats.layers,
                                                   feats.members, strict=True)],
            "last_position": len(p.tokens) - 1,
        }
        if method == DEFAULT_METHOD:
            members = [m for ms in feats.members for m in ms]
            scores = p.label_scores
            row["label_scores"] = [scores[m] for m in members if m in scores]
            if labels is not None:
                frame = labels.frame.set_index(["layer", "feature"])
                nodes = p.nodes.set_index("node_id")
                base = []
                for m in members:
                    key = (int(nodes.layer[m] if np.ndim(nodes.layer[m]) == 0 else nodes.layer[m].iloc[0]),
                           int(nodes.feature[m] if np.ndim(nodes.feature[m]) == 0 else nodes.feature[m].iloc[0]))
                    if key in frame.index:
                        base.append(float(frame.loc[key, "baseline"]))
                row["baseline_scores"] = base
            row["groups_table"] = [{"name": r.name, "label": r.label, "size": len(r.members), "layers": r.layers,
                                    "positions": r.positions, "influence": r.influence}
                                   for r in feats.itertuples()]
    return row


def report(path: Path, out: Path, model_name: str, set_name: str) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [f"# Graph summaries: {model_name}, {set_name}", "",
             f"{len(rows)} prompts the model answers right (bench/studies/summary.py). CPU: {common.cpu_model()}, "
             f"{os.cpu_count()} cores; load average while run: see each run's `load` in the JSONL "
             f"(bench/results/summary_runs/).", "",
             "## Grouping methods (all prompts; medians, and the share of prompts meeting each goal)", "",
             "| method | groups | coverage | sign agree (non-negligible) | Spearman | Spearman (non-negl.) | "
             "non-negligible groups a prompt | largest group's share of features | groups of 1-2 features a prompt | "
             "summarize + check s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for method in (*STUDY_METHODS, *(m for m in METHODS if m not in STUDY_METHODS)):
        ms = [r["methods"][method] for r in rows if method in r["methods"]]
        if not ms:
            continue

        def med(key: str, ms=ms) -> float:
            v = [m[key] for m in ms if m[key] is not None and not (isinstance(m[key], float) and math.isnan(m[key]))]
            return float(np.median(v)) if v else math.nan

        pooled_agree = np.mean([c["agree"] for m in ms for c in m["checks"] if not c["negligible"]] or [math.nan])
        pp = np.array([c["predicted"] for m in ms for c in m["checks"]])
        mm = np.array([c["measured"] for m in ms for c in m["checks"]])
        # a method can agree more by lumping half the features into one group and leaving singletons: these say so
        largest = np.median([max(m["sizes"]) / sum(m["sizes"]) for m in ms])
        tiny = np.mean([sum(1 for x in m["sizes"] if x <= 2) for m in ms])
        lines.append(f"| {method} | {med('groups'):.0f} | {med('coverage'):.3f} | {pooled_agree:.3f} pooled, "
                     f"{med('agree'):.2f} median | {spearman(pp, mm):.3f} pooled, {med('spearman'):.2f} median | "
                     f"{med('spearman_non_negligible'):.2f} | {med('non_negligible'):.1f} | {largest:.2f} | "
                     f"{tiny:.1f} | {med('summarize_s') + med('check_s'):.1f} |")
    lines += ["", f"## Per prompt ({DEFAULT_METHOD})", "",
              "| prompt | answer (p) | graph s | summarize + check s | groups | coverage | agree | Spearman | "
              "most influential group | its Δlogit pred / meas | Δp(answer) off |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["methods"][DEFAULT_METHOD]
        lines.append(f"| {r['prompt']} | {m['answer']!r} ({m['answer_prob']:.2f}) | {r['graph_s']:.1f} | "
                     f"{m['summarize_s'] + m['check_s']:.1f} | {m['groups']} | {m['coverage']:.2f} | "
                     f"{m['agree']:.2f} | {m['spearman']:.2f} | {m['top_group']} | {m['top_predicted']:+.2f} / "
                     f"{m['top_measured']:+.2f} | {m['top_measured_prob']:+.3f} |")
    lines += ["", f"## Where predicted and measured disagree ({DEFAULT_METHOD}, non-negligible groups, pooled)", "",
              "| groups | n | sign agree | Spearman |", "|---|---|---|---|"]
    for what, keep in (("holding the last position (the answer's)", True), ("at earlier positions only", False)):
        at = [r["methods"][DEFAULT_METHOD] for r in rows]
        cs = [c for m in at for c in m["checks"]
              if "positions" in c and not c["negligible"] and (m["last_position"] in c["positions"]) == keep]
        if cs:
            rho = spearman(np.array([c["predicted"] for c in cs]), np.array([c["measured"] for c in cs]))
            lines.append(f"| {what} | {len(cs)} | {np.mean([c['agree'] for c in cs]):.3f} | {rho:.3f} |")
    scores = [s for r in rows for s in r.get("label_scores", []) if s is not None and not math.isnan(s)]
    base = [s for r in rows for s in r.get("baseline_scores", []) if s is not None and not math.isnan(s)]
    lines += ["", "## Label scores of the features in the summaries", ""]
    if scores:
        lines.append(f"{len(scores)} feature nodes: median {np.median(scores):.3f} (quartiles "
                     f"{np.quantile(scores, 0.25):.3f}-{np.quantile(scores, 0.75):.3f}); top-token baseline median "
                     f"{np.median(base):.3f} ({len(base)}).")
    else:
        lines.append("No deep scan for this set when these rows were made: no label scores.")
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--set", default="plt-quick")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads: 1 runs fastest on a shared 2-core machine")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = common.RESULTS / "summary_runs"
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / f"{args.model}-{args.set}.jsonl"
    out = common.RESULTS / f"summary_{args.model}-{args.set}.md"
    if args.report:
        report(path, out, args.model, args.set)
        return
    m = slmviz.load(args.model)
    if args.set == "bundled":  # the model's bundled transcoders (a few layers), while no prepared set is there
        ts = [slmviz.load_sae(n, model=m) for n in slmviz.bundled_saes(m) if n.startswith("transcoder")]
    else:
        ts = slmviz.load_transcoders(args.set, model=m)
    from slmviz.features.prepared_scans import load_deep_labels

    labels = load_deep_labels(m, args.set) if args.set != "bundled" else None
    done = {json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()} \
        if path.is_file() else set()
    chosen = answers(m, CANDIDATES, args.n)
    print(f"{len(chosen)} prompts answered right; {len(done)} done already", flush=True)
    for prompt, token, prob in chosen:
        if prompt in done:
            continue
        row = run_prompt(m, ts, labels, prompt)
        row.update({"answer": token, "answer_prob": prob, "load": common.load_average(), "cpu": common.cpu_model(),
                    "deep_labels": labels is not None})
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        d = row["methods"][DEFAULT_METHOD]
        print(f"{prompt!r}: graph {row['graph_s']:.1f}s, summarize+check {d['summarize_s'] + d['check_s']:.1f}s, "
              f"{d['groups']} groups, coverage {d['coverage']:.2f}, agree {d['agree']:.2f}, rho {d['spearman']:.2f}",
              flush=True)
    report(path, out, args.model, args.set)


if __name__ == "__main__":
    main()
