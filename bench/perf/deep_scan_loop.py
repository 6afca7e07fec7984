"""The deep scan's loop, before and after issue 51's speed-up, in one process on the same documents: tokens/s of
features.deep_scan.run_deep_scan's scan phase (the forward, the scan's reductions, the token table and each shard's
saved state) with a prepared set, the older code imported from a git commit as a package of its own.

    .venv/bin/python bench/perf/deep_scan_loop.py --base b6bcd97 --set plt-quick --tokens 4000 --rounds 2

Why one process and alternating rounds (base, new, base, new): on a shared 2-core machine the load moves by the
minute, and a neighbour's burst then lands on both sides of the ratio. torch runs at 1 thread (--threads). The load
average is printed beside every round. Appends one JSON line to bench/results/deep_scan_loop.jsonl.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
import common  # noqa: E402
import torch  # noqa: E402

BASE_NAME = "slmviz_base"


def import_base(commit: str, where: Path):
    """The package as it was at `commit`, importable as slmviz_base (its imports inside are relative)."""
    archive = subprocess.run(["git", "-C", str(common.REPO), "archive", commit, "slmviz"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    (where / "slmviz").rename(where / BASE_NAME)
    sys.path.insert(0, str(where))
    return importlib.import_module(BASE_NAME)


def one_round(pkg, model, coders, docs, heldout, tokens: int) -> dict:
    ds = importlib.import_module(f"{pkg.__name__}.features.deep_scan")
    ds.DEEP_SHARD_DOCS = 16  # short shards: the run stops at the first shard past `tokens`
    folder = Path(tempfile.mkdtemp()) / ds.DEEP_FOLDER
    load = common.load_average()
    t0 = time.perf_counter()
    s, _ = ds.run_deep_scan(model, coders, folder, "unused", tokens=tokens, heldout_tokens=1, progress=False,
                            docs=docs, heldout=heldout)
    wall = time.perf_counter() - t0
    return {"tokens": s.n_tokens, "scan_s": s.info["seconds"], "tokens_per_s": s.n_tokens / s.info["seconds"],
            "wall_s": wall, "load_before": load, "load_after": common.load_average()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="b6bcd97", help="the commit whose deep scan is the 'before'")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--set", default="plt-quick")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import slmviz
    from slmviz.features import deep_scan as ds
    from slmviz.features.prepared_scans import set_corpus

    base = import_base(args.base, Path(tempfile.mkdtemp()))
    sides = {}
    for name, pkg in (("base", base), ("new", slmviz)):
        m = pkg.load(args.model)
        ts = pkg.load_transcoders(args.set, model=m)
        sides[name] = (pkg, m, ts.coders)
    corpus = set_corpus(sides["new"][1], args.set)
    docs, heldout = [], list(ds.heldout_docs(sides["new"][1], corpus))[:2]
    for d in ds.deep_docs(sides["new"][1], corpus):
        docs.append(d)
        if len(docs) == 400:
            break
    rows = {"base": [], "new": []}
    for r in range(args.rounds):
        for name in ("base", "new"):
            pkg, m, coders = sides[name]
            row = one_round(pkg, m, coders, docs, heldout, args.tokens)
            rows[name].append(row)
            print(f"round {r + 1} {name}: {row['tokens']:,} tokens in {row['scan_s']:.1f} s = "
                  f"{row['tokens_per_s']:.1f} tok/s (load {row['load_before']} -> {row['load_after']})", flush=True)
    med = {k: sorted(x["tokens_per_s"] for x in v)[len(v) // 2] for k, v in rows.items()}
    out = {"what": "deep scan loop tokens/s, base vs new, alternating rounds in one process", "base": args.base,
           "model": args.model, "set": args.set, "threads": args.threads, "cpu": common.cpu_model(),
           "rounds": rows, "median_tokens_per_s": med, "speedup": med["new"] / med["base"],
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    with (common.RESULTS / "deep_scan_loop.jsonl").open("a") as f:
        f.write(json.dumps(out) + "\n")
    print(json.dumps({k: out[k] for k in ("median_tokens_per_s", "speedup")}))


if __name__ == "__main__":
    main()
