"""The deep scan's cost and its labels' scores (issue 51): tokens/s of features.deep_scan on this CPU, the wall time
for 1,000,000 tokens (measured, or extrapolated from a shorter run and said so), and the distribution of label
scores beside the top-token baseline.

    .venv/bin/python bench/studies/deep_scan.py --set plt-quick --tokens 1000000 --threads 1
    .venv/bin/python bench/studies/deep_scan.py --set plt-quick --tokens 40000 --scratch --threads 1
    .venv/bin/python bench/studies/deep_scan.py --model SmolLM2-135M-Instruct --set bundled --tokens 32768

`--set plt-quick` (a prepared set) writes the set's own deep scan where the app and g.label_scores read it
(prepared_scans.deep_scan_dir; resumable: run the same line again after a stop), over the corpus the set trained on
(deep_scan.set_corpus); `--scratch` scans it into a scratch folder instead (a short measuring run that must not stand
in for the set's deep scan); `--preview` reads the labels and scores the set's running deep scan would give now,
from its last saved shard (features.deep_scan.preview_labels: the held-out pass only, nothing written but the JSON
line); `--set bundled` scans the model's bundled transcoders into a scratch folder. Label scores are reported over
every labelled feature and over the features in graph summaries (bench/studies/deep_scan_members.py's file, when it
is there: the issue's goal is over these), beside the top-token
baseline. Appends one JSON line to bench/results/deep_scan.jsonl and prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
sys.path.insert(0, str(Path(__file__).resolve().parent))  # deep_scan_members.py
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import slmviz  # noqa: E402
from slmviz.features import deep_scan as ds  # noqa: E402
from slmviz.features.prepared_scans import (  # noqa: E402
    deep_scan_dir,
    load_deep_labels,
    prepare_deep_scan,
    set_corpus,
)


def in_summaries(frame, model: str, set_name: str) -> dict | None:
    """The label scores of the features in graph summaries (deep_scan_members.py's file), one per member as the
    summaries list them (a feature in several summaries counts each time), beside the top-token baseline."""
    from deep_scan_members import read_members

    rows = read_members(model, set_name)
    if not rows:
        return None
    by = frame.set_index(["layer", "feature"])
    pairs = [(L, f) for r in rows for L, f in r["members"]]
    found = [(float(by.score[k]), float(by.baseline[k])) for k in pairs if k in by.index]
    scored = [(a, b) for a, b in found if not (np.isnan(a) or np.isnan(b))]
    if not scored:
        return {"prompts": len(rows), "members": len(pairs), "scored": 0}
    a, b = np.array(scored).T
    return {"prompts": len(rows), "members": len(pairs), "labelled": len(found), "scored": len(scored),
            "median_score": float(np.median(a)), "quartiles": [float(np.quantile(a, q)) for q in (0.25, 0.75)],
            "median_baseline": float(np.median(b)), "share_ge_0.75": float((a >= 0.75).mean())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--set", default="plt-quick")
    ap.add_argument("--tokens", type=int, default=ds.DEEP_TOKENS)
    ap.add_argument("--heldout", type=int, default=ds.HELDOUT_TOKENS)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--scratch", action="store_true", help="a prepared set's scan into a scratch folder, not the cache")
    ap.add_argument("--preview", action="store_true",
                    help="the labels and scores of the set's running deep scan as its last saved shard leaves them")
    ap.add_argument("--shard-docs", type=int, default=ds.DEEP_SHARD_DOCS,
                    help="documents per resumable step (a short measuring run stops at the first shard past --tokens)")
    args = ap.parse_args()
    ds.DEEP_SHARD_DOCS = args.shard_docs
    if args.threads:
        torch.set_num_threads(args.threads)
    m = slmviz.load(args.model)
    load_before = common.load_average()
    last = {"t": 0.0}

    def show(u) -> None:
        if time.perf_counter() - last["t"] > 30:
            last["t"] = time.perf_counter()
            print(u.text(), flush=True)

    t0 = time.perf_counter()
    if args.set == "bundled":
        coders = {int(s.hook_name.split(".")[1]): s for s in
                  (slmviz.load_sae(n, model=m) for n in slmviz.bundled_saes(m) if n.startswith("transcoder"))}
        folder = Path(tempfile.mkdtemp()) / ds.DEEP_FOLDER
        s, _ = ds.run_deep_scan(m, coders, folder, "quick", tokens=args.tokens, heldout_tokens=args.heldout,
                                progress=show)
        table = ds.LabelTable.load(folder)
    elif args.scratch:
        ts = slmviz.load_transcoders(args.set, model=m)
        folder = Path(tempfile.mkdtemp()) / ds.DEEP_FOLDER
        s, _ = ds.run_deep_scan(m, ts.coders, folder, set_corpus(m, args.set), tokens=args.tokens,
                                heldout_tokens=args.heldout, progress=show)
        table = ds.LabelTable.load(folder)
    elif args.preview:
        ts = slmviz.load_transcoders(args.set, model=m)
        work = deep_scan_dir(m, args.set).with_name(ds.WORK_FOLDER)
        done = json.loads((work / "state.json").read_text())
        table = ds.preview_labels(m, ts.coders, work, set_corpus(m, args.set), heldout_tokens=args.heldout)
        s = SimpleNamespace(hooks=list(ts.coders), n_tokens=done["tokens"], info={"seconds": done["seconds"]},
                            features={h: {"n": ts.d_sae} for h in ts.coders})
        folder = work
    else:
        ts = slmviz.load_transcoders(args.set, model=m)
        s, _ = prepare_deep_scan(m, ts, args.set, tokens=args.tokens, corpus=set_corpus(m, args.set),
                                 progress=show)
        table = load_deep_labels(m, args.set)
        folder = deep_scan_dir(m, args.set)
    wall = time.perf_counter() - t0
    f = table.frame
    scores, base = f.score.dropna().to_numpy(), f.baseline.dropna().to_numpy()
    scan_s = float(s.info["seconds"])
    row = {
        "model": args.model, "set": args.set, "coders": len(s.hooks), "features": int(sum(x["n"] for x in
                                                                                       s.features.values())),
        "tokens": s.n_tokens, "scan_s": scan_s, "tokens_per_s": s.n_tokens / scan_s if scan_s else None,
        "wall_s_this_call": wall, "seconds_for_1M": 1_000_000 * scan_s / s.n_tokens if s.n_tokens else None,
        "extrapolated": s.n_tokens < 1_000_000, "heldout_tokens": table.info["heldout_tokens"],
        "labelled": len(f), "scored": len(scores),
        "median_score": float(np.median(scores)) if len(scores) else None,
        "score_quartiles": [float(np.quantile(scores, q)) for q in (0.25, 0.75)] if len(scores) else None,
        "median_baseline": float(np.median(base)) if len(base) else None,
        "share_score_ge_0.75": float((scores >= 0.75).mean()) if len(scores) else None,
        "examples": [{"layer": int(r.layer), "feature": int(r.feature), "label": r.label, "score": r.score,
                      "baseline": r.baseline} for r in f.sort_values("fires", ascending=False).head(8).itertuples()],
        "label_tokens_median": float(f.tokens.map(len).median()) if len(f) else None,
        "in_summaries": in_summaries(f, args.model, args.set),
        "corpus": str(set_corpus(m, args.set)) if args.set != "bundled" else "quick",
        "folder": str(folder), "cpu": common.cpu_model(), "load_before": load_before,
        "load_after": common.load_average(), "threads": torch.get_num_threads(),
        "batch_tokens": s.info.get("batch_tokens"), "preview": args.preview,
        "label_tokens": ds.LABEL_TOKENS, "keep_tokens": ds.KEEP_TOKENS,
    }
    with (common.RESULTS / "deep_scan.jsonl").open("a") as out:
        out.write(json.dumps(row) + "\n")
    print(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
