"""What a "quick" per-layer transcoder set for SmolLM2 costs and scores: the curve behind the `plt-quick` recipe
(training.prepare.RECIPES). The full PLT recipe (k 64, BatchTopK saved as JumpReLU, skip, seed 0) at smaller widths
and token counts, trained on cheaper corpora, each point scored as bench/studies/replacement_curve.py scores one (the
20 prompts' unpruned graphs of bench/studies/replacement_scores.py, AttributionGraph.scores(); per-layer EV on the
held-out splits of broad and chat).

The corpora (`--corpus`):
- `broad`: the bundled broad corpus alone (nothing generated).
- `slice{n}`: corpora.generated.quick_corpus(model, n): the chat corpus's first n training jobs in slice_jobs's
  stratified order (n=6, the "quick" corpus: one seed of each of the six kinds; 10, 24, 48: ~10, 25, 50 % of the
  jobs), their parts written into the chat corpus's own parts folder (so the full corpus reuses them), interleaved
  with the broad corpus's first n/95 of its lines: "mixed"'s chat density, n/95 of its length.
- `mixed`: the full "mixed" corpus (the prepared set's).

Subcommands:

    # the chat corpus, generated once into $SLMVIZ_CACHE in slice order, each stage (slice) timed
    nice -n 19 python bench/studies/quick_set_curve.py chat --stages 6 10 24 48 95
    # a point: train (resumes), time its phases, scan it, score it (prompts resume from --log), write it to --out
    nice -n 19 python bench/studies/quick_set_curve.py point --corpus slice6 --width 1024 --tokens 65536 \
        --runs /tmp/quick-runs --log /tmp/quick-runs/logs
    # `slmviz prepare --transcoders plt-quick` from an empty cache (the prepared model linked in), timed
    python bench/studies/quick_set_curve.py fresh --cache /tmp/fresh-cache
    # the table
    python bench/studies/quick_set_curve.py table > bench/results/quick_set_curve.md

A point's phases (`phases`, seconds, this call's; null where a resumed call did not run that phase): `corpus` (the
broad corpus built, the slice's parts generated and the mix written, each only if not already in the cache: see
`corpus_seconds_fresh` for what it took from nothing), `train` (train_transcoders' training loop), `threshold`
(BatchTopK's threshold pass: training.loop.Run.finish), `save` (the set and the finished checkpoint), `scan`
(features.prepared_scans's scan of every coder over the first `--scan-docs` held-out documents of the corpus,
`--scan-chars` each). Every row names the CPU, the threads and the load average before and after each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import RESULTS, cpu_model, load_average, markdown_table  # noqa: E402

import slmviz  # noqa: E402
from slmviz.corpora import generated as gc  # noqa: E402
from slmviz.features.prepared_scans import SCAN_CHARS, SCAN_DOCS  # noqa: E402

HERE = RESULTS  # the recorded JSON and tables


def machine() -> dict:
    return {"cpu": cpu_model(), "nproc": os.cpu_count(), "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch": torch.__version__,
            "nice": os.nice(0)}


def chat_heldout(args) -> None:
    """The chat corpus's held-out split alone (its held-out seeds' parts, generated into the cache's parts folder when
    missing, timed), written to `--out` byte for byte as chat_corpus writes heldout.jsonl: what the held-out chat EV
    reads, without waiting for the whole corpus."""
    model = slmviz.load()
    jobs = [job for job in gc.generation_jobs() if gc.held_out(job[3])]
    t0, load0 = time.perf_counter(), load_average()
    parts = gc.generate_parts(model, gc.corpus_dir(model) / "parts", jobs, progress=False)
    print(json.dumps({"heldout_jobs": [j[:3] for j in jobs], "seconds": round(time.perf_counter() - t0, 1),
                      "load": [load0, load_average()]}), flush=True)
    args.out.write_text("".join(part.read_text(encoding="utf-8") for part in parts), encoding="utf-8")


def stage_chat(args) -> None:
    """Generate the chat corpus's jobs in slice_jobs order, one stage per slice, timing each stage and each part."""
    model = slmviz.load()
    out = args.out
    report = json.loads(out.read_text()) if out.exists() else {}
    stages = report.setdefault("stages", [])
    done_n = {s["n"] for s in stages}
    parts = gc.corpus_dir(model) / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    prev: list = []
    for n in args.stages:
        jobs = gc.slice_jobs(n)
        new = [j for j in jobs if j not in prev]
        prev = jobs
        todo = [j for j in new if not (parts / f"{j[0]}_{j[1]}.jsonl").is_file()]
        if n in done_n or not todo:
            print(f"stage {n}: nothing to do", flush=True)
            continue
        stamps: list[float] = []
        load0 = load_average()
        t0 = time.perf_counter()
        gc.generate_parts(model, parts, todo,
                          lambda k, total, stamps=stamps, t0=t0: stamps.append(round(time.perf_counter() - t0, 1)))
        seconds = time.perf_counter() - t0
        entry = {"n": n, "new_jobs": [list(j[:3]) for j in todo], "seconds": round(seconds, 1),
                 "seconds_per_job": round(seconds / len(todo), 1), "part_finished_at": stamps,
                 "load_before": load0, "load_after": load_average(), "finished": time.strftime("%Y-%m-%d %H:%M"),
                 **machine(), "workers": gc.generation_workers(model)}
        stages.append(entry)
        print(json.dumps(entry), flush=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
    if 95 in args.stages:
        t0 = time.perf_counter()
        gc.chat_corpus(model, progress=False)
        report["assemble_seconds"] = round(time.perf_counter() - t0, 1)
        out.write_text(json.dumps(report, indent=1) + "\n")
    if "broad_build_seconds" not in report:  # the broad corpus built from nothing, into a folder of its own
        from slmviz.corpora.broad import broad_corpus

        with tempfile.TemporaryDirectory() as tmp:
            load0, t0 = load_average(), time.perf_counter()
            broad_corpus(tmp)
            report["broad_build_seconds"] = round(time.perf_counter() - t0, 1)
            report["broad_build_load"] = [load0, load_average()]
        out.write_text(json.dumps(report, indent=1) + "\n")


def point_name(args) -> str:
    name = f"{args.corpus}-d{args.width}@{args.tokens}"
    for flag, default in (("lr_decay", 0.2), ("dead_window", None), ("lr", None)):
        value = getattr(args, flag)
        if value is not None and value != default:
            name += f"-{flag.replace('_', '')}{value:g}"
    if (args.scan_docs, args.scan_chars) != (SCAN_DOCS, SCAN_CHARS):
        name += f"-scan{args.scan_docs}x{args.scan_chars}"
    return name


def resolve(model, corpus: str):
    """(train path, held-out path) of --corpus (module docstring), built when not yet in the cache."""
    from slmviz.corpora.named import resolve_corpus

    if corpus.startswith("slice"):
        return gc.quick_corpus(model, int(corpus[len("slice"):]), progress=False)
    return resolve_corpus(corpus, model), resolve_corpus(corpus, model, split="heldout")


class PhaseClock:
    """Times train_transcoders' phases from outside: the call's start, Run.finish's start and end (BatchTopK's
    threshold pass, then each coder converted), and the call's return (the set and the finished checkpoint saved)."""

    def __init__(self):
        self.at: dict[str, float] = {}

    def __enter__(self):
        from slmviz.training.loop import Run

        self._finish = Run.finish
        clock = self

        def finish(run, model, corpus):
            clock.at["finish_start"], clock.at["cpu_finish_start"] = time.perf_counter(), time.process_time()
            clock.at["load_after_train"] = load_average()
            ts = clock._finish(run, model, corpus)
            clock.at["finish_end"], clock.at["cpu_finish_end"] = time.perf_counter(), time.process_time()
            return ts

        Run.finish = finish
        return self

    def __exit__(self, *exc):
        from slmviz.training.loop import Run

        Run.finish = self._finish


def run_point(args) -> None:
    from replacement_curve import score_point, write_point

    from slmviz.features.dashboard import acts_hook
    from slmviz.features.prepared_scans import SCAN_TOP_K, _load_scan, _save_scan, scan_docs
    from slmviz.scans.scan import scan
    from slmviz.training.prepare import RECIPES

    name = point_name(args)
    out = args.runs / name
    out.mkdir(parents=True, exist_ok=True)
    record = out / "phases.json"
    phases = json.loads(record.read_text()) if record.exists() else {}
    t_load = time.perf_counter()
    model = slmviz.load()
    phases.setdefault("model_load", round(time.perf_counter() - t_load, 1))

    def save() -> None:
        record.write_text(json.dumps(phases, indent=1) + "\n")

    if "broad" not in phases:  # the broad corpus (built when not yet in the cache; seconds when it was)
        from slmviz.corpora.broad import broad_corpus

        t0 = time.perf_counter()
        broad_corpus()
        phases["broad"] = round(time.perf_counter() - t0, 1)
    if "corpus" not in phases:  # the rest: a slice's parts not yet generated, and its mix
        load0, t0 = load_average(), time.perf_counter()
        train, heldout = resolve(model, args.corpus)
        phases["corpus"] = round(time.perf_counter() - t0, 1)
        phases["corpus_load"] = [load0, load_average()]
        save()
    else:
        train, heldout = resolve(model, args.corpus)
    recipe = {k: v for k, v in RECIPES[(model.name, "plt")].items() if k not in ("d_sae", "tokens")}
    for flag in ("lr_decay", "dead_window", "lr"):
        if getattr(args, flag) is not None:
            recipe[flag] = getattr(args, flag)
    finished = (out / "transcoder_set.json").exists()
    resumed = phases.get("started", False)  # a call before this one began training: this one's time is a part
    phases["started"] = True
    save()
    load0 = load_average()
    with PhaseClock() as clock:
        t0, c0 = time.perf_counter(), time.process_time()
        ts = slmviz.train_transcoders(model, layers="all", corpus=train, d_sae=args.width, tokens=args.tokens,
                                      out=out, progress=False, name=f"{model.name}-{name}", **recipe)
        t1, c1 = time.perf_counter(), time.process_time()
    if not finished:
        at = clock.at
        phases.update({"train": round(at["finish_start"] - t0, 1),
                       "threshold": round(at["finish_end"] - at["finish_start"], 1),
                       "save": round(t1 - at["finish_end"], 1), "train_resumed": resumed,
                       "cpu_seconds": {"train": round(at["cpu_finish_start"] - c0, 1),
                                       "threshold": round(at["cpu_finish_end"] - at["cpu_finish_start"], 1),
                                       "save": round(c1 - at["cpu_finish_end"], 1)},
                       "train_load": [load0, clock.at["load_after_train"], load_average()]})
        save()
    if "scan" not in phases or _load_scan(out / "scan") is None:
        load0, t0, c0 = load_average(), time.perf_counter(), time.process_time()
        docs = scan_docs(model, heldout, args.scan_docs, args.scan_chars)
        s = scan(docs, hooks=[acts_hook(c) for c in ts], saes=list(ts), model=model, top_k=SCAN_TOP_K,
                 progress=False)
        _save_scan(s, docs, out / "scan")
        phases.update({"scan": round(time.perf_counter() - t0, 1), "scan_load": [load0, load_average()],
                       "scan_cpu_seconds": round(time.process_time() - c0, 1),
                       "scan_tokens": int(sum(len(model.encode(d)) for d in docs))})
        save()
    print(json.dumps({"point": name, **phases}), flush=True)
    if args.no_score:
        return
    if args.chat_heldout is not None:  # score_point's resolve_corpus, for the held-out chat split alone
        import replacement_curve

        from slmviz.corpora.named import resolve_corpus

        def resolve_heldout(corpus, model=None, split="train"):
            if corpus == "chat" and split == "heldout":
                return str(args.chat_heldout)
            return resolve_corpus(corpus, model, split)

        replacement_curve.resolve_corpus = resolve_heldout
    log = args.log / f"{name}.jsonl"
    args.log.mkdir(parents=True, exist_ok=True)
    load0, t0 = load_average(), time.perf_counter()
    scores = score_point(model, ts, log, args.heldout_tokens, args.memory_budget_gb)
    entry = {"point": name, "corpus": args.corpus, "d_sae": args.width, "tokens": args.tokens, "k": recipe["k"],
             "recipe": recipe, "scan_docs": args.scan_docs, "scan_chars": args.scan_chars, "phases": phases,
             "total_seconds": round(sum(phases.get(k) or 0 for k in ("corpus", "train", "threshold", "save",
                                                                    "scan")), 1),
             "score_seconds": round(time.perf_counter() - t0, 1), "score_load": [load0, load_average()],
             "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), **scores}
    print(json.dumps({k: v for k, v in entry.items() if k not in ("error_share_by_layer",)}), flush=True)
    write_point(args.out, model.name, entry, "point")


def run_fresh(args) -> None:
    """`slmviz prepare --transcoders plt-quick` as a user runs it, from an empty cache that holds only the prepared
    model (linked in): the quick corpus (the broad corpus built, the slice's chat seeds generated, the mix written),
    training, the threshold pass, the save, the set's feature scan and the bundled SAEs'. One subprocess, its wall
    clock and CPU seconds, the load average before and after, appended to --out."""
    import resource
    import subprocess

    cache = args.cache
    if cache.exists() and any(cache.iterdir()):
        raise SystemExit(f"{cache} is not empty: a fresh run needs an empty folder")
    cache.mkdir(parents=True, exist_ok=True)
    model_name = args.model
    source = Path(os.environ.get("SLMVIZ_CACHE", Path.home() / ".cache" / "slmviz")) / model_name
    (cache / source.name).symlink_to(source)
    command = [sys.executable, "-m", "slmviz.cli", "prepare", "--model", model_name, "--transcoders", "plt-quick"]
    env = {**os.environ, "SLMVIZ_CACHE": str(cache)}
    load0, t0 = load_average(), time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    entry = {"command": "slmviz prepare --model " + model_name + " --transcoders plt-quick", "model": model_name,
             "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "load_before": load0,
             "load_after": load_average(), "cache": str(cache), "machine": machine(),
             "date": time.strftime("%Y-%m-%d %H:%M"), "stdout_tail": done.stdout[-500:]}
    print(json.dumps(entry), flush=True)
    runs = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(runs + [entry], indent=1) + "\n")


def fresh_corpus_seconds(point: dict, chat: dict) -> float | None:
    """What a point's corpus takes from an empty cache: the broad corpus built (chat report's
    broad_build_seconds), the chat jobs its corpus needs generated (the chat report's stages up to its slice; every
    stage for "mixed"), and the point's own corpus phase (its mix written, the parts already cached)."""
    if "broad_build_seconds" not in chat:
        return None
    n = {"broad": 0, "mixed": 95}.get(point["corpus"]) or int(point["corpus"][len("slice"):])
    stages = [st for st in chat.get("stages", []) if st["n"] <= n]
    if n and (not stages or max(st["n"] for st in stages) != n):
        return None
    return round(chat["broad_build_seconds"] + sum(st["seconds"] for st in stages) + point["phases"]["corpus"], 1)


def _partial(run: Path) -> list[str]:
    """A point not yet scored on all 20 prompts: the median of those scored (its prompts.jsonl, the --log rows)."""
    log = run / "prompts.jsonl"
    rows = [json.loads(x) for x in log.read_text().splitlines() if x] if log.exists() else []
    if not rows:
        return ["not yet scored", "not yet scored"]
    return [f"{statistics.median(r[k] for r in rows):.3f} ({len(rows)} of 20 prompts; "
            f"{min(r[k] for r in rows):.3f}–{max(r[k] for r in rows):.3f})" for k in ("replacement", "completeness")]


def _span(point: dict, what: str) -> str:
    lo, hi = point[f"range_{what}"]
    return f"{point[f'median_{what}']:.3f} ({lo:.3f}–{hi:.3f})"


def _ev(point: dict, split: str) -> str:
    h = point[f"heldout_{split}"]
    return f"{h['median_ev']:.3f} ({h['min_ev']:.3f})"


def _s(x) -> str:
    return "—" if x is None else f"{x:.0f}"


def render(results: Path, chat_report: Path, reference: tuple[int, ...] = (), runs: Path | None = None) -> str:
    data = json.loads(results.read_text()) if results.exists() else {"points": []}
    chat = json.loads(chat_report.read_text()) if chat_report.exists() else {}
    head = ["point", "corpus", "features", "tokens / layer", "corpus s (fresh)", "train s", "threshold s", "save s",
            "scan s (tokens)", "total s", "replacement, median (range)", "completeness, median (range)",
            "held-out EV broad, median (worst layer)", "held-out EV chat, median (worst layer)",
            "CE-loss score broad / chat", "load average during training (1 min: start, end)"]
    rows = []
    for pt in data["points"]:
        ph = pt["phases"]
        corpus = fresh_corpus_seconds(pt, chat)
        total = None if corpus is None else corpus + sum(ph[k] for k in ("train", "threshold", "save", "scan"))
        loads = ph.get("train_load", [])
        rows.append([pt["point"], pt["corpus"], f"{pt['d_sae']:,}", f"{pt['tokens']:,}", _s(corpus),
                     _s(ph.get("train")), _s(ph.get("threshold")), _s(ph.get("save")),
                     f"{_s(ph.get('scan'))} ({ph.get('scan_tokens', 0):,})", _s(total),
                     _span(pt, "replacement"), _span(pt, "completeness"), _ev(pt, "broad"), _ev(pt, "chat"),
                     f"{pt['heldout_broad']['replaced']['ce_loss_score']:.3f} / "
                     f"{pt['heldout_chat']['replaced']['ce_loss_score']:.3f}",
                     ", ".join(x.split()[0] for x in loads[:1] + loads[-1:]) if loads else "—"])
    scored = {pt["point"] for pt in data["points"]}
    for record in sorted(runs.glob("*/phases.json")) if runs is not None else []:  # trained, not yet scored
        ph = json.loads(record.read_text())
        if record.parent.name in scored or "scan" not in ph:
            continue
        loads = ph.get("train_load", [])
        corpus, rest = record.parent.name.split("-d", 1)
        rows.append([record.parent.name, corpus, f"{int(rest.split('@')[0]):,}", f"{int(rest.split('@')[1]):,}", "—",
                     _s(ph.get("train")), _s(ph.get("threshold")), _s(ph.get("save")),
                     f"{_s(ph.get('scan'))} ({ph.get('scan_tokens', 0):,})", "—", *_partial(record.parent),
                     "—", "—", "—", ", ".join(x.split()[0] for x in loads[:1] + loads[-1:]) if loads else "—"])
    width = json.loads((HERE / "replacement_width.json").read_text())["points"]
    for pt in (p for p in width if p["d_sae"] in reference):  # bench/studies/replacement_width.py's points, not re-run
        rows.append([f"mixed-d{pt['d_sae']}@{pt['tokens']} (bench/results/replacement_width.json: AMD EPYC, not re-run "
                     "here)", "mixed", f"{pt['d_sae']:,}", f"{pt['tokens']:,}", "—",
                     "—" if pt.get("train_seconds") is None else f"{pt['train_seconds']:.0f} (train+threshold+save)",
                     "—", "—", "—", "—", _span(pt, "replacement"), _span(pt, "completeness"), _ev(pt, "broad"),
                     _ev(pt, "chat"), f"{pt['heldout_broad']['replaced']['ce_loss_score']:.3f} / "
                     f"{pt['heldout_chat']['replaced']['ce_loss_score']:.3f}", "—"])
    here = [pt["machine"] for pt in data["points"]] or [st for st in chat.get("stages", [])]
    cpus = sorted({m["cpu"] for m in here})
    lines = [markdown_table(head, rows)]
    if here:
        lines[:0] = [f"Measured on {', '.join(cpus)} ({here[0]['nproc']} cores, {here[0]['threads']} torch threads, "
                     f"nice {here[0]['nice']}), with other jobs on the machine (the load averages). Rendered by "
                     "`bench/studies/quick_set_curve.py table`.", ""]
    if chat.get("stages"):
        lines += ["", "The chat corpus's jobs generated in slice order (`quick_set_curve.py chat`), "
                  f"{chat['stages'][0]['workers']} seeds decoded at once:", "",
                  markdown_table(["slice (first n jobs)", "new jobs", "seconds", "seconds a job", "cumulative s",
                                  "load average before / after (1 min)"],
                                 ([st["n"], len(st["new_jobs"]), f"{st['seconds']:.0f}", f"{st['seconds_per_job']:.1f}",
                                   f"{sum(x['seconds'] for x in chat['stages'] if x['n'] <= st['n']):.0f}",
                                   f"{st['load_before'].split()[0]} / {st['load_after'].split()[0]}"]
                                  for st in chat["stages"]))]
        if "broad_build_seconds" in chat:
            lines += ["", f"The broad corpus built from nothing: {chat['broad_build_seconds']:.1f} s."]
    fresh = HERE / "quick_set_fresh.json"
    if fresh.exists():
        runs = json.loads(fresh.read_text())
        lines += ["", "`slmviz prepare --transcoders plt-quick` from an empty cache, the model already prepared "
                  "(`quick_set_curve.py fresh`):", "",
                  markdown_table(["model", "wall", "CPU seconds", "load average (1 min) before / after", "CPU", "date"],
                                 ([r["model"], f"{r['wall_seconds'] / 60:.1f} min", f"{r['cpu_seconds']:.0f}",
                                   f"{r['load_before'].split()[0]} / {r['load_after'].split()[0]}",
                                   r["machine"]["cpu"], r["date"]] for r in runs))]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("chat", help="generate the chat corpus in slice order, timing each slice")
    c.add_argument("--stages", nargs="+", type=int, default=[6, 10, 24, 48, 95])
    c.add_argument("--out", type=Path, default=HERE / "quick_set_chat.json")
    h = sub.add_parser("chat-heldout", help="the chat corpus's held-out split alone, as chat_corpus writes it")
    h.add_argument("--out", type=Path, default=Path("/work/quick-runs/chat-heldout.jsonl"))
    q = sub.add_parser("point", help="train, time, scan and score one point")
    q.add_argument("--corpus", required=True, help="broad | slice{n} | mixed")
    q.add_argument("--width", type=int, default=1024)
    q.add_argument("--tokens", type=int, default=65_536)
    q.add_argument("--lr-decay", type=float, default=None)
    q.add_argument("--dead-window", type=int, default=None)
    q.add_argument("--lr", type=float, default=None)
    q.add_argument("--scan-docs", type=int, default=SCAN_DOCS)
    q.add_argument("--scan-chars", type=int, default=SCAN_CHARS)
    q.add_argument("--runs", type=Path, default=Path("/work/quick-runs"))
    q.add_argument("--log", type=Path, default=Path("/work/quick-runs/logs"))
    q.add_argument("--out", type=Path, default=HERE / "quick_set_curve.json")
    q.add_argument("--heldout-tokens", type=int, default=10_000)
    q.add_argument("--memory-budget-gb", type=float, default=19)
    q.add_argument("--no-score", action="store_true", help="train, time and scan only")
    q.add_argument("--chat-heldout", type=Path, default=None,
                   help="the chat corpus's held-out split (chat-heldout's file) while the whole corpus is not yet "
                        "generated (resolve_corpus('chat', split='heldout') would generate it)")
    f = sub.add_parser("fresh", help="slmviz prepare --transcoders plt-quick from an empty cache, timed")
    f.add_argument("--model", default="SmolLM2-135M-Instruct")
    f.add_argument("--cache", type=Path, required=True, help="an empty folder: the fresh $SLMVIZ_CACHE")
    f.add_argument("--out", type=Path, default=HERE / "quick_set_fresh.json")
    t = sub.add_parser("table", help="the points as a markdown table")
    t.add_argument("results", type=Path, nargs="?", default=HERE / "quick_set_curve.json")
    t.add_argument("--chat", type=Path, default=HERE / "quick_set_chat.json")
    t.add_argument("--reference", type=int, nargs="*", default=[1024],
                   help="widths of bench/results/replacement_width.json's points to add as reference rows")
    t.add_argument("--runs", type=Path, default=None, help="also list the points trained there but not yet scored")
    args = p.parse_args()
    if args.command == "table":
        print(render(args.results, args.chat, tuple(args.reference), args.runs), end="")
    elif args.command == "chat":
        stage_chat(args)
    elif args.command == "chat-heldout":
        chat_heldout(args)
    elif args.command == "point":
        run_point(args)
    elif args.command == "fresh":
        run_fresh(args)


if __name__ == "__main__":
    sys.exit(main())
