"""`slmviz scan CORPUS --hook NAME ... --top-k K --out FOLDER [--engine ray] [--model M] [--variants a,b]`.

Kept out of cli.py so the subcommand is one module: its arguments, its run, its printout.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scan", help="scan a corpus: top activating contexts and statistics of hooks' features")
    p.add_argument("corpus", help=".txt (one document a line), .jsonl (a 'text' field) or .parquet ('text' column); "
                                  "'bundled' = the King James Bible that slmviz ships")
    p.add_argument("--hook", action="append", required=True, help="hook name to scan (repeatable)")
    p.add_argument("--top-k", type=int, default=20, help="contexts kept per feature (default 20)")
    p.add_argument("--out", required=True, help="folder to write the scan to (Scan.save)")
    p.add_argument("--engine", choices=("local", "ray"), default="local")
    p.add_argument("--model", default=None, help="model folder or hub id (default: bundled SmolLM2-135M)")
    p.add_argument("--variants", default=None, help="comma-separated presets whose per-document damage to measure")
    p.add_argument("--limit", type=int, default=None, help="read at most this many documents")
    p.add_argument("--window", type=int, default=None, help="tokens per window (longer documents are split)")
    p.add_argument("--workers", type=int, default=1, help="Ray actors (--engine ray)")


def run(args: argparse.Namespace, out=None) -> int:
    out = out or sys.stdout  # resolved per call: a test's capture replaces sys.stdout after import
    from ..corpora.verses import bundled_corpus_path
    from ..model_api import load
    from .scan import DEFAULT_WINDOW, scan

    corpus = bundled_corpus_path() if args.corpus == "bundled" else args.corpus
    try:
        s = scan(corpus, hooks=args.hook, top_k=args.top_k, model=load(args.model),
                        engine=args.engine, variants=args.variants, limit=args.limit,
                        window=args.window or DEFAULT_WINDOW, workers=args.workers)
    except (ImportError, ConnectionError) as e:  # no Ray installed; an unreachable RAY_ADDRESS
        print(f"slmviz scan: error: {e}", file=sys.stderr)
        return 2
    folder = s.save(args.out)
    i = s.info
    print(f"scanned {i['documents']} documents ({i['tokens']} tokens in {i['windows']} windows) in "
          f"{i['seconds']:.1f} s: {i['tokens_per_s']:.0f} tokens/s, {i['engine']} engine", file=out)
    for hook, f in s.features.items():
        print(f"  {hook}: {f['n']} features ({f['what']})", file=out)
    if not s.damage.empty:
        print(s.damage_summary().to_string(index=False), file=out)
    print(f"wrote {folder} (scan.safetensors, tokens.parquet, damage.parquet, top_examples.parquet)", file=out)
    return 0
