"""Corpus scans: batched local-engine throughput vs the capture-off forward one document at a time, and peak
memory vs corpus size (each size in a fresh process), on verses of the bundled King James Bible.

    .venv/bin/python bench/perf/scan.py [--docs 96] [--sizes 100,400,1600] [--app] [--ray]

Rows:
- throughput: `slmviz.scan` (hooks of the LAST layer, so every block runs; the scan skips only the final
  norm and unembedding, whose logits it does not need) against `decoder.forward` with capture off, one
  verse at a time, full logits: what a loop of plain forwards costs. Alternating rounds, medians.
- the same scan of a layer-15 hook: the forward stops after the last scanned hook (evidence row).
- the scan's forward in tokens/s by batch size (evidence for slmviz.scan's 1024-token batches).
- peak RSS during the scan of N verses (layer-3 hooks) in a fresh process that loaded the model, for each N:
  bounded memory means the largest N needs no more than the smallest (target ≤ 1.10×).
- --app: the app's Corpus tab scan as it runs on first use (app/corpus_tab.py: its size and hooks).
- --ray: the Ray engine's driver peak RSS for the last two --sizes, from a jsonl file on a local node with two
  actors (each reads its own shards; the driver should not grow with the corpus).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import Row, interleaved, main, median, spread

LAST_LAYER_HOOKS = ("mlp.hook_post", "attn.hook_z", "attn.hook_pattern")


def sample_verses(n: int) -> list[str]:
    from slmviz.corpora.verses import bundled_corpus

    verses = bundled_corpus()
    return verses[:: max(1, len(verses) // n)][:n]


def throughput_rows(args) -> list[Row]:
    import slmviz
    from slmviz import resolve_variant
    from slmviz.hooks import build_context
    from slmviz.scans.batches import iter_windows, plan_batches
    from slmviz.scans.scan import DEFAULT_BATCH_TOKENS, DEFAULT_WINDOW

    model = slmviz.load()
    docs = sample_verses(args.docs)
    ids = [model.encode(d) for d in docs]
    n_tokens = sum(int(i.numel()) for i in ids)
    faithful = resolve_variant(None)
    last = model.cfg.n_layers - 1
    deep = [f"blocks.{last}.{k}" for k in LAST_LAYER_HOOKS]
    mid = [f"blocks.15.{k}" for k in LAST_LAYER_HOOKS]

    def one_at_a_time() -> None:
        for i in ids:
            model.decoder.forward(i, build_context(model.hook_names, []), faithful)

    def scan(hooks):
        return lambda: slmviz.scan(docs, hooks=hooks, top_k=20, model=model, progress=False)

    times = interleaved({"forward": one_at_a_time, "scan": scan(deep), "scan15": scan(mid)},
                        warmup=1, repeats=min(args.repeats, 3))  # each round scans every verse 3 ways
    base, deep_s, mid_s = median(times["forward"]), median(times["scan"]), median(times["scan15"])
    batches = list(plan_batches(iter_windows(model.tokenizer, docs, DEFAULT_WINDOW), DEFAULT_BATCH_TOKENS))
    padded = sum(len(b.windows) * max(len(w.ids) for w in b.windows) for b in batches)
    what = (f"{len(docs)} verses, {n_tokens} tokens ({n_tokens / len(docs):.0f} per verse) in {len(batches)} "
            f"batches, {1 - n_tokens / padded:.0%} of what they ran padding")
    return [
        Row(f"scan throughput, last-layer hooks (mlp post, z, pattern), batched ÷ forward one verse at a time; {what}",
            f"{n_tokens / deep_s:.0f} tokens/s", f"{n_tokens / base:.0f} tokens/s", base / deep_s, "≥ 2.0",
            base / deep_s >= 2.0, f"scan {spread(times['scan'])}, forward {spread(times['forward'])}"),
        Row("scan throughput, layer-15 hooks (forward stops after them) ÷ forward one verse at a time",
            f"{n_tokens / mid_s:.0f} tokens/s", f"{n_tokens / base:.0f} tokens/s", base / mid_s, "—", None,
            f"scan {spread(times['scan15'])}"),
    ]


def batch_size_rows(args) -> list[Row]:
    """Evidence for DEFAULT_BATCH_TOKENS and MIN_BATCH_TOKENS: the scan's forward (last-layer hooks) in tokens/s
    for batches of 32-token rows, from one row to 2048 tokens. Alternating rounds, medians."""
    import torch

    import slmviz
    from slmviz.scans.batches import _forward

    model = slmviz.load()
    last = model.cfg.n_layers - 1
    hooks = [f"blocks.{last}.{k}" for k in LAST_LAYER_HOOKS]
    sizes = (1, 8, 32, 64)  # rows of 32 tokens: 32, 256, 1024, 2048 tokens
    gen = torch.Generator().manual_seed(0)
    batches = {b: torch.randint(100, model.cfg.vocab_size, (b, 32), generator=gen) for b in sizes}

    def run(ids):
        return lambda: _forward(model, ids, torch.full((ids.shape[0],), 32), hooks, False)

    times = interleaved({b: run(ids) for b, ids in batches.items()}, warmup=1, repeats=min(args.repeats, 3))
    rate = {b: b * 32 / median(times[b]) for b in sizes}
    note = "; ".join(f"{b * 32} tokens: {rate[b]:.0f} tokens/s" for b in sizes)
    return [Row("scan forward (last-layer hooks), tokens/s of a 1024-token batch ÷ one 32-token row", f"{rate[32]:.0f}"
                " tokens/s", f"{rate[1]:.0f} tokens/s", rate[32] / rate[1], "—", None, note)]


def peak_rss_during(run):
    """run() in this process, with its RSS sampled every 5 ms by a thread: (result, RSS before, peak, seconds).
    The peak is DURING run (the process's lifetime peak is the model load's, which would hide the scan)."""
    import threading

    import psutil

    proc = psutil.Process()
    before = proc.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    return result, before, peak[0], seconds


def child_memory(n: int) -> None:
    """In a fresh process: load, scan n verses, print the peak RSS during the scan as JSON."""
    import slmviz

    model = slmviz.load()
    docs = sample_verses(n)
    s, loaded, peak, seconds = peak_rss_during(lambda: slmviz.scan(
        docs, hooks=[f"blocks.3.{k}" for k in LAST_LAYER_HOOKS], top_k=20, model=model, progress=False))
    print(json.dumps({"n": n, "tokens": s.info["tokens"], "loaded": loaded, "peak": peak, "seconds": seconds}))


def child_ray_memory(n: int) -> None:
    """In a fresh process: scan n verses from a jsonl file on a local Ray node (2 actors) and print the DRIVER's
    peak RSS during the scan (the actors are other processes) as JSON."""
    import tempfile
    from pathlib import Path

    import slmviz

    model = slmviz.load()
    corpus = Path(tempfile.mkdtemp()) / "verses.jsonl"
    corpus.write_text("".join(json.dumps({"text": v}) + "\n" for v in sample_verses(n)), encoding="utf-8")
    s, loaded, peak, seconds = peak_rss_during(lambda: slmviz.scan(
        corpus, hooks=[f"blocks.3.{k}" for k in LAST_LAYER_HOOKS], top_k=20, model=model, engine="ray", workers=2,
        progress=False))
    print(json.dumps({"n": n, "tokens": s.info["tokens"], "loaded": loaded, "peak": peak, "seconds": seconds}))


def in_fresh_processes(flag: str, sizes: list[int]) -> list[dict]:
    """Run this script with `flag N` in a fresh process per size; each prints one JSON line of results."""
    results = []
    for n in sizes:
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), flag, str(n)],
                             capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    return results


def ray_rows(args) -> list[Row]:
    results = in_fresh_processes("--child-ray-memory", [int(x) for x in args.sizes.split(",")][-2:])
    small, large = results
    gb = 1024**3
    note = "; ".join(f"{r['n']} verses ({r['tokens']} tokens): driver peak {r['peak'] / gb:.3f} GB, after load "
                     f"{r['loaded'] / gb:.3f} GB, {r['seconds']:.0f} s with Ray's start-up" for r in results)
    ratio = large["peak"] / small["peak"]
    return [Row(f"Ray engine (jsonl file, 2 actors): driver peak RSS, {large['n']} verses ÷ {small['n']} verses",
                f"{large['peak'] / gb:.3f} GB", f"{small['peak'] / gb:.3f} GB", ratio, "≤ 1.10", ratio <= 1.10, note)]


def memory_rows(args) -> list[Row]:
    results = in_fresh_processes("--child-memory", [int(x) for x in args.sizes.split(",")])
    small, large = results[0], results[-1]
    ratio = large["peak"] / small["peak"]
    gb = 1024**3
    note = "; ".join(f"{r['n']} verses ({r['tokens']} tokens): peak {r['peak'] / gb:.3f} GB, after load "
                     f"{r['loaded'] / gb:.3f} GB, {r['seconds']:.0f} s" for r in results)
    return [Row(f"peak RSS during a scan of {large['n']} verses ÷ {small['n']} verses (fresh processes, layer-3 hooks)",
                f"{large['peak'] / gb:.3f} GB", f"{small['peak'] / gb:.3f} GB", ratio, "≤ 1.10", ratio <= 1.10, note)]


def app_rows() -> list[Row]:
    import slmviz
    from app.scans import corpus_docs, corpus_size, scan_hooks

    model = slmviz.load()
    docs = corpus_docs(corpus_size())
    start = time.perf_counter()
    s = slmviz.scan(docs, hooks=scan_hooks(model), top_k=10, model=model, progress=False)
    seconds = time.perf_counter() - start
    return [Row(f"app Corpus tab, first scan: {len(docs)} verses ({s.info['tokens']} tokens), hooks "
                f"{', '.join(scan_hooks(model))}", f"{seconds:.0f} s", "", None, "minutes", None,
                f"{s.info['tokens_per_s']:.0f} tokens/s")]


def run(args) -> list[Row]:
    if args.child_memory:
        child_memory(args.child_memory)
        sys.exit(0)
    if args.child_ray_memory:
        child_ray_memory(args.child_ray_memory)
        sys.exit(0)
    rows = throughput_rows(args) + batch_size_rows(args) + memory_rows(args)
    if args.ray:
        rows += ray_rows(args)
    if args.app:
        rows += app_rows()
    return rows


def add_args(parser) -> None:
    parser.add_argument("--docs", type=int, default=96, help="verses in the throughput comparison")
    parser.add_argument("--sizes", default="100,400,1600", help="corpus sizes (verses) of the memory rows")
    parser.add_argument("--app", action="store_true", help="also time the app's first Corpus-tab scan")
    parser.add_argument("--ray", action="store_true", help="also measure the Ray driver's peak RSS (last two --sizes)")
    parser.add_argument("--child-memory", type=int, default=0, help=argparse_hidden())
    parser.add_argument("--child-ray-memory", type=int, default=0, help=argparse_hidden())


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main(run, __doc__, add_args)
