"""A cross-layer transcoder's training cost on SmolLM2-135M-Instruct against the PLT set's, on the same tokens.

    .venv/bin/python bench/studies/clt_train.py [--tokens 2048] [--clt-d-sae 768] [--plt-d-sae 6144] [--k 16]

Each run is a fresh process (its peak RSS is its own): train_transcoders(kind="clt") with d_sae features per layer,
and kind="plt" at the parameter-matched width (a CLT of d_sae features per layer has d_sae x (n + n(n+1)/2) x
d_model weights, n = 30: 768 per layer matches a PLT of 6,144 per layer, 212M parameters each), both BatchTopK
without skip, the broad corpus, batch_tokens 512, buffer_tokens = tokens (one block), fp32. Reported: the
training loop's tokens/s (a token is one row at every layer, for both), the whole run's time, peak RSS, and the
size of the saved folder. Nothing is asserted; the figures go to --out (bench/results/clt_train.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS


def one(kind: str, d_sae: int, k: int, tokens: int) -> dict:
    import torch

    import slmviz
    from slmviz import train_transcoders
    from slmviz.corpora.broad import broad_corpus

    torch.manual_seed(0)
    model = slmviz.load()
    corpus = str(broad_corpus()[0])
    last: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / kind
        t = time.perf_counter()
        train_transcoders(model, kind=kind, corpus=corpus, d_sae=d_sae, k=k, tokens=tokens, out=out,
                          architecture="batchtopk", skip=False, batch_tokens=512, buffer_tokens=tokens,
                          dtype="float32", progress=last.update)
        wall = time.perf_counter() - t
        disk = sum(p.stat().st_size for p in out.rglob("*") if p.is_file() and p.name != "checkpoint.safetensors")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB -> GB
    # the training loop's rate (the block's forward and the steps; not the model load or BatchTopK's threshold
    # rows): the PLT set counts layer-tokens, a CLT tokens
    loop = last["tokens_per_s"] / (model.cfg.n_layers if kind == "plt" else 1)
    return {"kind": kind, "d_sae": d_sae, "k": k, "tokens": tokens, "wall_s": wall, "loop_tokens_per_s": loop,
            "peak_rss_gb": rss, "disk_mb": disk / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--clt-d-sae", type=int, default=768)
    ap.add_argument("--plt-d-sae", type=int, default=6144)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--one", choices=["clt", "plt"])
    ap.add_argument("--out", default=str(RESULTS / "clt_train.md"))
    args = ap.parse_args()
    if args.one:
        d = args.clt_d_sae if args.one == "clt" else args.plt_d_sae
        print(json.dumps(one(args.one, d, args.k, args.tokens)))
        return
    results = []
    for kind in ("clt", "plt"):
        proc = subprocess.run([sys.executable, __file__, "--one", kind, "--tokens", str(args.tokens), "--clt-d-sae",
                               str(args.clt_d_sae), "--plt-d-sae", str(args.plt_d_sae), "--k", str(args.k)],
                              capture_output=True, text=True, check=True)
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    load = os.getloadavg()[0]
    lines = ["# CLT training against the PLT set's (SmolLM2-135M-Instruct)", "",
             f"Made by `bench/studies/clt_train.py --tokens {args.tokens}` on this machine's CPU ({os.cpu_count()} "
             "cores, "
             f"load average {load:.1f} at the end: other work shared it), fp32, BatchTopK k={args.k}, no skip, "
             "one block, batch_tokens 512.", "",
             "| set | features per layer | training loop, tokens/s | whole run (s) | peak RSS (GB) | saved (MB) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        lines.append(f"| {r['kind'].upper()} | {r['d_sae']:,} | {r['loop_tokens_per_s']:.1f} | {r['wall_s']:.0f} | "
                     f"{r['peak_rss_gb']:.2f} | {r['disk_mb']:.0f} |")
    clt, plt = results
    lines += ["", f"CLT / PLT training-loop tokens/s: {clt['loop_tokens_per_s'] / plt['loop_tokens_per_s']:.2f}. "
              "A token is one row at every layer for both. The whole run adds loading the model and, for BatchTopK, "
              "the threshold's rows from 32 blocks across the corpus (the same for both).", ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
