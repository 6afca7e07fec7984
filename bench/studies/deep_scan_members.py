"""The features in graph summaries (issue 51's label-score goal is over them): for the first `--n` prompts of
bench/studies/summary.py's candidates that the model answers right, the (layer, feature) of every member of the
summary's feature groups (the default grouping method), one JSON line a prompt in
bench/results/deep_scan_members_{model}-{set}.jsonl (a prompt already there is skipped: a stopped run resumes).
bench/studies/deep_scan.py reads it to report the label scores of exactly these features.

    .venv/bin/python bench/studies/deep_scan_members.py --model SmolLM2-135M-Instruct --set plt-quick
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
sys.path.insert(0, str(Path(__file__).resolve().parent))  # summary.py's prompts
import common  # noqa: E402
import torch  # noqa: E402
from summary import CANDIDATES, answers  # noqa: E402

import slmviz  # noqa: E402

MAX_FEATURE_NODES = 4096  # app/transcoder_sets.py's


def members_path(model: str, set_name: str) -> Path:
    return common.RESULTS / f"deep_scan_members_{model}-{set_name}.jsonl"


def read_members(model: str, set_name: str) -> list[dict]:
    """The rows written so far ([] when none): {prompt, members: [[layer, feature], ...], ...}."""
    path = members_path(model, set_name)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--set", default="plt-quick")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = slmviz.load(args.model)
    ts = slmviz.load_transcoders(args.set, model=m)
    path = members_path(args.model, args.set)
    done = {r["prompt"] for r in read_members(args.model, args.set)}
    for prompt, token, prob in answers(m, CANDIDATES, args.n):
        if prompt in done:
            continue
        t0 = time.perf_counter()
        p = slmviz.attribution_graph(prompt, transcoders=ts, model=m, progress=False,
                                     max_feature_nodes=MAX_FEATURE_NODES).prune()
        s = p.summarize(max_groups=12, apply=False)
        feats = p.nodes[p.nodes.kind == "feature"].drop_duplicates("node_id").set_index("node_id")
        members = [[int(feats.layer[n]), int(feats.feature[n])] for ms in s.feature_groups.members for n in ms]
        row = {"prompt": prompt, "answer": token, "answer_prob": prob, "members": members,
               "max_feature_nodes": MAX_FEATURE_NODES,
               "seconds": time.perf_counter() - t0, "load": common.load_average()}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{prompt!r}: {len(members)} members in {row['seconds']:.0f} s (load {row['load']})", flush=True)


if __name__ == "__main__":
    main()
