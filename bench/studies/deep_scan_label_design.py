"""Which label predicate a deep scan should draw (issue 51): measured on the quick set's features, offline, from the
fired entries of every feature over the start of its deep scan's text (label choice) and the held-out text (score).

    .venv/bin/python bench/studies/deep_scan_label_design.py --collect --scan-tokens 40000   # the fired entries
    .venv/bin/python bench/studies/deep_scan_label_design.py                                  # the comparison

Every predicate is chosen on the scanned text and scored on the held-out text exactly as the deep scan scores its
labels (detection balanced accuracy, the firing contexts weighed evenly across 5 activation bands; the bands'
edges here are the scanned activations' quintiles, not the deep scan's binned ones). Families:
- `baseline`: the feature's single top token (the token of its strongest activation);
- `gain top N`: the N tokens of the largest balanced-accuracy gains (what features.deep_scan names, N = LABEL_TOKENS);
- `count top 4`: the older label (most frequent firing tokens, added while the accuracy rose, at most 4);
- `tokens+context 8`: up to 8 clauses, greedy on the scanned text, each a token, a token after a given previous
  token, or any token after a given token (the previous token as context);
- `tokens+classes 8`: up to 8 clauses, each a token or a class of tokens by their text (punctuation, digits, line
  breaks, spaces, capitalised words, lower-case words, word pieces, other).
Features: those in graph summaries (deep_scan_members.py's file) when it is there, else a random sample. One JSON line
in bench/results/deep_scan_label_design.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import unicodedata
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
sys.path.insert(0, str(Path(__file__).resolve().parent))  # deep_scan_members.py
import common  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

Q = 5


def collect(args) -> None:
    """The fired entries (feature, row, activation) of every feature, with each row's token and previous token."""
    import slmviz
    from slmviz.features import deep_scan as ds
    from slmviz.scans import batches, shards

    m = slmviz.load(args.model)
    ts = slmviz.load_transcoders(args.set, model=m)
    layers = sorted(ts.coders)
    saes = tuple(ts.coders[L] for L in layers)
    from slmviz.features.dashboard import acts_hook
    from slmviz.scans.units import feature_of

    hooks = [acts_hook(ts.coders[L]) for L in layers]
    features = {h: feature_of(h, m.hook_names, m.cfg, saes) for h in hooks}
    offset = {h: i * ts.d_sae for i, h in enumerate(hooks)}
    spec = batches.ScanSpec(tuple(hooks), 1, window=256, batch_tokens=2048, saes=saes)
    corpus = ds.set_corpus(m, args.set)
    real_run_batch = batches.run_batch

    for name, docs, limit in (("scan", ds.deep_docs(m, corpus), args.scan_tokens),
                              ("held", ds.heldout_docs(m, corpus), args.heldout_tokens)):
        rec: dict[str, list] = {"ids": [], "prev": [], "g": [], "row": [], "val": []}

        def run_batch(model, batch, spec, features, tap=None, rec=rec):
            keys, prev = [], []
            for w in batch.windows:
                for i in range(len(w.ids)):
                    keys.append((w.doc << 32) | (w.offset + i))
                    prev.append(w.ids[i - 1] if i > 0 else -1)
            rec["prev"].append(np.array(prev, np.int32)[np.argsort(np.array(keys), kind="stable")])
            return real_run_batch(model, batch, spec, features, tap)

        def tap(hook, x, ids, fired, rec=rec):
            if hook == hooks[0]:
                rec["ids"].append(ids.numpy().astype(np.int32))
            base = sum(len(a) for a in rec["ids"][:-1])
            rec["g"].append((fired.cols + offset[hook]).numpy().astype(np.int32))
            rec["row"].append((fired.rows + base).numpy().astype(np.int32))
            rec["val"].append(fired.vals.numpy().astype(np.float16))

        shards.run_batch = run_batch
        n = 0
        for shard in shards.iter_shards(iter(docs), 16):
            n += shards.run_shard(m, shard, spec, features, None, tap=tap).tokens
            print(name, n, common.load_average(), flush=True)
            if n >= limit:
                break
        shards.run_batch = real_run_batch
        np.savez(Path(args.data) / f"{name}.npz", **{k: np.concatenate(v) for k, v in rec.items()})


def token_classes(model, vocab: int) -> dict[str, np.ndarray]:
    """Classes of the vocabulary by each token's text."""
    def kind(s: str) -> str:
        core = s.strip()
        if "\n" in s:
            return "line break"
        if not core:
            return "spaces"
        if all(unicodedata.category(c)[0] in "PS" for c in core):
            return "punctuation"
        if core.isdigit():
            return "digits"
        if s.startswith(" ") and core.isalpha():
            return "Capitalised word" if core[0].isupper() else "lower-case word"
        if core.isalpha():
            return "word piece"
        return "other"

    names: dict[str, list[int]] = {}
    for t, text in enumerate(model.tokenizer.batch_decode([[t] for t in range(vocab)])):
        names.setdefault(kind(text), []).append(t)
    return {k: np.array(v) for k, v in names.items()}


def evaluate(args) -> None:
    from deep_scan_members import read_members

    import slmviz

    m = slmviz.load(args.model)
    vocab = int(m.decoder.params.unembed.shape[0])
    data = {k: np.load(Path(args.data) / f"{k}.npz") for k in ("scan", "held")}
    ids = {k: d["ids"] for k, d in data.items()}
    prev = {k: np.where(d["prev"] < 0, vocab, d["prev"]).astype(np.int64) for k, d in data.items()}
    n = {k: len(v) for k, v in ids.items()}
    rows = read_members(args.model, args.set)
    if rows:
        feats = np.array(sorted({L * 1024 + f for r in rows for L, f in r["members"]}))
        population = f"features in {len(rows)} graph summaries"
    else:
        feats = np.sort(np.random.default_rng(0).choice(30 * 1024, 600, replace=False))
        population = "600 random features"
    by = {}
    for k, d in data.items():
        keep = np.isin(d["g"], feats)
        g, row, val = d["g"][keep], d["row"][keep], d["val"][keep].astype(np.float32)
        order = np.argsort(g, kind="stable")
        g, row, val = g[order], row[order], val[order]
        lo, hi = np.searchsorted(g, feats), np.searchsorted(g, feats, side="right")
        by[k] = {int(f): (row[a:b], val[a:b]) for f, a, b in zip(feats, lo, hi, strict=True)}
    token_counts = np.bincount(ids["scan"], minlength=vocab)
    classes = token_classes(m, vocab)
    in_class = {c: np.isin(np.arange(vocab + 1), t) for c, t in classes.items()}

    def score(mask: np.ndarray, rows: np.ndarray, vals: np.ndarray, edges: np.ndarray) -> float:
        band = np.searchsorted(edges, vals, side="left")
        tpr = np.mean([mask[rows[band == b]].mean() for b in range(Q) if (band == b).any()])
        fired = np.zeros(n["held"], bool)
        fired[rows] = True
        return 0.5 * (tpr + 1 - (mask & ~fired).sum() / max(n["held"] - len(rows), 1))

    def clause(c, k: str) -> np.ndarray:
        kind, v = c
        if kind == "token":
            return ids[k] == v
        if kind == "after":
            return prev[k] == v
        if kind == "bigram":
            return (prev[k] == v[0]) & (ids[k] == v[1])
        return in_class[v][ids[k]]

    def greedy(cands: list, rows: np.ndarray, most: int) -> list:
        fired = np.zeros(n["scan"], bool)
        fired[rows] = True
        masks = {c: clause(c, "scan") for c in cands}
        cur, chosen, best = np.zeros(n["scan"], bool), [], 0.5
        while len(chosen) < most:
            gains = {c: 0.5 * ((cur | mk)[rows].mean() + 1 - ((cur | mk) & ~fired).sum() / (n["scan"] - len(rows)))
                     for c, mk in masks.items() if c not in chosen}
            if not gains:
                break
            c, s = max(gains.items(), key=lambda kv: kv[1])
            if s <= best + 1e-12:
                break
            chosen.append(c)
            cur |= masks[c]
            best = s
        return chosen

    results: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for f in feats.tolist():
        srows, svals = by["scan"][f]
        hrows, hvals = by["held"][f]
        if len(srows) < 3 or len(hrows) == 0:
            continue
        edges = np.quantile(svals, np.arange(1, Q) / Q)
        F = len(srows)
        hits = np.bincount(ids["scan"][srows], minlength=vocab)
        gain = hits / F - (token_counts - hits) / (n["scan"] - F)
        ranked = np.argsort(-gain, kind="stable")
        ranked = ranked[gain[ranked] > 0]

        def add(name: str, mask: np.ndarray, hrows=hrows, hvals=hvals, edges=edges) -> None:
            results.setdefault(name, []).append(score(mask, hrows, hvals, edges))

        add("baseline", ids["held"] == ids["scan"][srows[np.argmax(svals)]])
        for cap in (4, 8, 32, 128, 256, 10**9):
            add(f"gain top {cap if cap < 10**9 else 'all'}", np.isin(ids["held"], ranked[:cap]))
        by_count = [t for t, _ in Counter(ids["scan"][srows].tolist()).most_common()]
        old, ba, h, named = [], 0.5, 0, 0
        for t in by_count:  # the older rule: most frequent first, added while the accuracy rises, at most 4
            b = 0.5 * ((h + hits[t]) / F + 1 - max(named + token_counts[t] - h - hits[t], 0) / (n["scan"] - F))
            if b > ba:
                old.append(t)
                ba, h, named = b, h + hits[t], named + token_counts[t]
            if len(old) == 4:
                break
        add("count top 4", np.isin(ids["held"], old))
        if not args.quick:
            toks = [("token", int(t)) for t in ranked[:16]]
            after = [("after", int(p)) for p, _ in Counter(prev["scan"][srows].tolist()).most_common(12)]
            pairs = Counter(zip(prev["scan"][srows].tolist(), ids["scan"][srows].tolist(), strict=True))
            bigrams = [("bigram", p) for p, _ in pairs.most_common(12)]
            for name, cands in (("tokens 8 (greedy)", toks), ("tokens+context 8", toks + after + bigrams),
                                ("tokens+classes 8", toks + [("class", c) for c in classes])):
                chosen = greedy(cands, srows, 8)
                mask = np.zeros(n["held"], bool)
                for c in chosen:
                    mask |= clause(c, "held")
                add(name, mask)
    summary = {k: {"median": float(np.median(v)), "q25": float(np.quantile(v, 0.25)),
                   "q75": float(np.quantile(v, 0.75)), "n": len(v)} for k, v in results.items()}
    out = {"model": args.model, "set": args.set, "population": population, "scan_tokens": n["scan"],
           "heldout_tokens": n["held"], "results": summary, "seconds": time.perf_counter() - t0,
           "when": time.strftime("%Y-%m-%d %H:%M")}
    with (common.RESULTS / "deep_scan_label_design.jsonl").open("a") as fh:
        fh.write(json.dumps(out) + "\n")
    for k, v in summary.items():
        print(f"{k:22s} median {v['median']:.3f} ({v['q25']:.3f}-{v['q75']:.3f}), {v['n']} features")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--set", default="plt-quick")
    ap.add_argument("--data", default="/tmp/deep_scan_label_design", help="where --collect keeps the fired entries")
    ap.add_argument("--collect", action="store_true")
    ap.add_argument("--scan-tokens", type=int, default=40_000)
    ap.add_argument("--heldout-tokens", type=int, default=65_536)
    ap.add_argument("--quick", action="store_true", help="the token-set families only (the greedy ones are slow)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    Path(args.data).mkdir(parents=True, exist_ok=True)
    (collect if args.collect else evaluate)(args)


if __name__ == "__main__":
    main()
