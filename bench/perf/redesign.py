"""The 0.3 redesign's before/after: the one-pass trainer's throughput (a per-layer set and a cross-layer
transcoder) and an attribution graph's time, slmviz 0.2.0 against this checkout, side by side in one run.

    .venv/bin/python bench/perf/redesign.py [--repeats 2] [--before a3c8453] [--out bench/results/redesign.md]

Why: the redesign moved every module into parts and merged the trainers into one loop; its issue asks that the
one-pass trainer's throughput and the graph's time stay within 5 % of 0.2.0's. Both versions make the same
public calls with the same arguments (slmviz.load, train_transcoders, load_transcoders, attribution_graph), on
the same token file, and the graph reads the same set's bytes (trained and saved once by the "before" code, loaded
by both). Each call runs in a fresh subprocess whose PYTHONPATH is that version's tree (the worker checks that
slmviz was imported from there), and each round runs both versions back to back, alternating which goes first,
so a neighbour's burst of work on a shared machine lands on both sides of a ratio.

The "before" tree is a git worktree of BEFORE (detached) under the cache folder, made once and reused; the corpus
head (the first documents of 0.2.0's broad corpus) and the graph's set are made there once too. Measurements:
- PLT: train_transcoders(kind="plt") over --layers layers, --d-sae features, --tokens tokens a layer (skip,
  BatchTopK, the prepared recipe's settings otherwise); layer-tokens/s of the whole call (tokens x layers / wall)
  and of its training loop alone (the progress callback's tokens_per_s);
- CLT: train_transcoders(kind="clt") over every layer, --clt-d-sae features a layer, --clt-tokens tokens;
- graph: attribution_graph of PROMPT over the PLT set (the --max-feature-nodes most influential features kept), after
  an untimed graph of its first word in the same process.
Each also reports its CPU seconds (user + system, every thread): on a machine shared with other work the wall clock
waits for a core and the CPU time does not, so the two together say whether a gap is the code or the load.
Writes a Markdown table (each version's median and min–max, the median of the rounds' after ÷ before speed
ratios) with the CPU, the load average and both commits to --out, after every round. Nothing is asserted: the
table says whether each ratio is within 5 %.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BEFORE = "a3c8453"  # 0.2.0: main before the redesign moved anything
PROMPT = "The Eiffel Tower is in the city of"
TASKS = ("graph", "plt", "clt")  # the graph first: the quickest, so a failing call shows in minutes
TOLERANCE = 0.05  # the "within 5 %"
# The options every worker gets: what it measures with.
MEASURED = ("layers", "tokens", "d_sae", "k", "clt_d_sae", "clt_k", "clt_tokens", "dtype", "max_feature_nodes")


# ---- the worker: one measurement, in a subprocess whose PYTHONPATH is one version's tree ------------------------

def worker(args: argparse.Namespace) -> dict:
    """Run one task with the slmviz of `args.tree` and return what it measured."""
    import slmviz

    where = Path(slmviz.__file__).resolve()
    if not where.is_relative_to(Path(args.tree).resolve()):
        raise SystemExit(f"slmviz was imported from {where}, not from {args.tree}: PYTHONPATH did not win")
    cache = Path(args.cache)
    model = slmviz.load()
    if args.worker == "setup":
        return setup(slmviz, model, cache, args)
    if args.worker == "graph":
        return time_graph(slmviz, model, cache / "set", args.max_feature_nodes)
    return time_training(slmviz, model, cache / "corpus.jsonl", args)


def training_arguments(args: argparse.Namespace, kind: str) -> dict:
    """The same train_transcoders arguments for both versions: the prepared recipe's settings at a small size."""
    common = dict(tokens=args.tokens, architecture="batchtopk", skip=True, lr=2e-3, batch_tokens=512,
                  buffer_tokens=args.tokens, dead_window=100_000, seed=0, dtype=args.dtype)
    if kind == "plt":
        return dict(common, kind="plt", layers=list(range(args.layers)), d_sae=args.d_sae, k=args.k)
    return dict(common, kind="clt", tokens=args.clt_tokens, buffer_tokens=args.clt_tokens, d_sae=args.clt_d_sae,
                k=args.clt_k, pre_act_coefficient=0.03)


def setup(slmviz, model, cache: Path, args: argparse.Namespace) -> dict:
    """Once, with the "before" code: the corpus head both versions train on, and the PLT set the graphs read."""
    from slmviz.features.corpora import resolve_corpus  # 0.2.0's module: this step only ever runs there

    head, n = [], 0
    with open(resolve_corpus("broad"), encoding="utf-8") as f:
        # Twice the tokens: BatchTopK's final threshold reads rows from across the whole corpus, which on the full
        # broad corpus would mean tokenising all of it and swamp a short run's time.
        for line in f:
            head.append(line)
            n += len(model.tokenizer(json.loads(line)["text"])["input_ids"])
            if n >= 2 * max(args.tokens, args.clt_tokens):
                break
    (cache / "corpus.jsonl").write_text("".join(head), encoding="utf-8")
    slmviz.train_transcoders(model, corpus=str(cache / "corpus.jsonl"), out=cache / "set", progress=False,
                             **training_arguments(args, "plt"))
    return {"documents": len(head), "tokens": n}


def cpu_seconds() -> float:
    """User + system CPU time of this process, every thread: the work a call did, which a shared machine's load moves
    much less than the call's wall clock (it waits for a core without counting)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def time_training(slmviz, model, corpus: Path, args: argparse.Namespace) -> dict:
    kw = training_arguments(args, args.worker)
    last: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        start, cpu = time.perf_counter(), cpu_seconds()
        slmviz.train_transcoders(model, corpus=str(corpus), out=Path(tmp) / "set", progress=last.update, **kw)
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    # A PLT set's rate counts layer-tokens (a token trains every layer's coder), a CLT's tokens, as its progress
    # callback's tokens_per_s does.
    rows = kw["tokens"] * (len(kw["layers"]) if args.worker == "plt" else 1)
    return {"seconds": seconds, "speed": rows / seconds, "loop_speed": last.get("tokens_per_s"), "cpu_seconds": cpu}


def time_graph(slmviz, model, folder: Path, max_feature_nodes: int) -> dict:
    transcoders = slmviz.load_transcoders(folder, model=model)
    # A set trained on a few thousand tokens fires many features a token: the cap keeps the graph within the default
    # memory budget, as the app's cap does for a full set.
    kw = dict(progress=False, max_feature_nodes=max_feature_nodes)
    slmviz.attribution_graph(PROMPT.split()[0], transcoders, model, **kw)  # warm-up, one word: first-call costs
    start, cpu = time.perf_counter(), cpu_seconds()
    graph = slmviz.attribution_graph(PROMPT, transcoders, model, **kw)
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    adjacency = graph.adjacency
    # What the graph holds, so the table can say both versions built the same one.
    return {"seconds": seconds, "speed": 1 / seconds, "cpu_seconds": cpu, "nodes": list(adjacency.shape),
            "checksum": float(adjacency.double().abs().sum())}


# ---- the driver ---------------------------------------------------------------------------------------------------

def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def before_tree(rev: str, cache: Path) -> Path:
    """A detached git worktree of `rev` under `cache`, made once (the repository's own objects) and reused."""
    full = git("rev-parse", f"{rev}^{{commit}}")
    path = cache / f"slmviz-{full[:7]}"
    if (path / "slmviz" / "__init__.py").is_file():
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
        if head.stdout.strip() == full:
            return path
        raise SystemExit(f"{path} holds another commit ({head.stdout.strip() or head.stderr.strip()}); remove it")
    git("worktree", "prune")  # a registration whose folder was deleted would refuse the add
    git("worktree", "add", "--detach", str(path), full)
    return path


def run_worker(task: str, tree: Path, cache: Path, args: argparse.Namespace) -> dict:
    """One measurement in a fresh process with `tree` first on its path; the worker's last stdout line is JSON."""
    options = [x for name in MEASURED for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", task, "--tree", str(tree), "--cache", str(cache),
           *options]
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{task} with {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    """lscpu's model name (the row a reader compares machines by)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return "unknown"


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def number(x: float) -> str:
    """Three significant figures, without an exponent (a CLT's few tokens/s and a PLT's thousands alike)."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


# Each row: (task, the worker's key, whether the key is a time, what the row measures). A time's speed ratio is
# before ÷ after, a rate's after ÷ before, so every ratio reads the same way: above 1, the redesign is faster.
ROWS = {
    "plt": ("plt", "speed", False,
            "train_transcoders, PLT: {layers} layers x {d_sae:,} features, {tokens:,} tokens (layer-tokens/s)"),
    "plt_loop": ("plt", "loop_speed", False, "the same run's training loop alone (progress tokens_per_s)"),
    "plt_cpu": ("plt", "cpu_seconds", True, "the same run's CPU seconds (user + system, every thread)"),
    "clt": ("clt", "speed", False,
            "train_transcoders, CLT: every layer x {clt_d_sae:,} features, {clt_tokens:,} tokens (tokens/s)"),
    "clt_loop": ("clt", "loop_speed", False, "the same run's training loop alone (progress tokens_per_s)"),
    "clt_cpu": ("clt", "cpu_seconds", True, "the same run's CPU seconds"),
    "graph": ("graph", "seconds", True,
              "attribution_graph over the PLT set, prompt {prompt}, max_feature_nodes {max_feature_nodes:,} (seconds)"),
    "graph_cpu": ("graph", "cpu_seconds", True, "the same graph's CPU seconds"),
}


def table(results: dict[str, dict[str, list[dict]]], args: argparse.Namespace) -> tuple[str, list[str]]:
    """The Markdown table of every measured row and the rows whose median ratio misses the tolerance."""
    lines = ["| measurement | before | after | after ÷ before speed: median of rounds (range) | within 5 % |",
             "| --- | --- | --- | --- | --- |"]
    missed = []
    for row, (task, key, is_time, what) in ROWS.items():
        before = [r.get(key) for r in results[task]["before"]]
        after = [r.get(key) for r in results[task]["after"]]
        if not before or None in before or None in after:
            continue  # a task not run, or a version that does not report this figure
        ratios = [(b / a) if is_time else (a / b) for a, b in zip(after, before, strict=True)]
        ratio = statistics.median(ratios)
        if ratio < 1 - TOLERANCE:
            missed.append(row)
        unit = "s" if is_time else "tokens/s"
        lines.append(f"| {what.format(prompt=repr(PROMPT), **vars(args))} | {cell(before, unit)} | "
                     f"{cell(after, unit)} | {ratio:.3f} ({min(ratios):.3f}–{max(ratios):.3f}) | "
                     f"{'no' if row in missed else 'yes'} |")
    return "\n".join(lines), missed


def cell(values: list[float], unit: str) -> str:
    """A version's median and min–max over the rounds."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{number(mid)} {unit} ({number(low)}–{number(high)})"


def same_graph(graphs: list[dict]) -> str:
    """Whether every graph of both versions had the same adjacency shape and sum of |weights| (to 3 decimals)."""
    if not graphs:
        return ""
    seen = {(tuple(g["nodes"]), round(g["checksum"], 3)) for g in graphs}
    if len(seen) == 1:
        return (f" Every graph of both versions had the same {graphs[0]['nodes'][0]:,} nodes and the same sum of "
                "|adjacency| to 3 decimals.")
    return f" The graphs differ between runs (adjacency shape, sum of |adjacency|): {sorted(seen)}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=BEFORE, help="the commit to compare against (default: 0.2.0's)")
    parser.add_argument("--repeats", type=int, default=2, help="rounds; each runs every task in both versions")
    parser.add_argument("--layers", type=int, default=30, help="the PLT's layers (the first N)")
    parser.add_argument("--tokens", type=int, default=4096, help="training tokens (a layer's, for the PLT)")
    parser.add_argument("--d-sae", type=int, default=1024)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--clt-d-sae", type=int, default=128)
    parser.add_argument("--clt-k", type=int, default=16)
    parser.add_argument("--clt-tokens", type=int, default=2048, help="the CLT's training tokens")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"],
                        help="fixed, so a per-process choice of the fastest dtype cannot differ between versions")
    parser.add_argument("--max-feature-nodes", type=int, default=1024, help="the graph's cap on feature nodes")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset of " + ",".join(TASKS))
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the before tree, corpus head and graph set live (default: ~/.cache/slmviz-bench)")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "redesign.md")
    parser.add_argument("--worker", choices=("setup", *TASKS), help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.path.remove(str(Path(__file__).resolve().parent))  # bench/perf's scripts must not shadow a module
        print(json.dumps(worker(args)))
        return

    home = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    root = (args.cache or home / "slmviz-bench").resolve()
    root.mkdir(parents=True, exist_ok=True)
    tree = before_tree(args.before, root)
    # The corpus head and the graph's set depend on the training arguments: one folder per choice of them.
    cache = root / (f"redesign-{tree.name}-L{args.layers}-t{args.tokens}-d{args.d_sae}-k{args.k}-c{args.clt_tokens}-"
                    f"{args.dtype}")
    cache.mkdir(exist_ok=True)
    trees = {"before": tree, "after": REPO}
    started = datetime.datetime.now().astimezone()
    load_before = load_average()
    if not (cache / "set").is_dir() or not (cache / "corpus.jsonl").is_file():
        print(f"setup with {tree}: the corpus head and the graph's PLT set, into {cache}", flush=True)
        print(run_worker("setup", tree, cache, args), flush=True)

    tasks = args.tasks.split(",")
    results: dict[str, dict[str, list[dict]]] = {t: {"before": [], "after": []} for t in TASKS}
    loads: list[float] = []
    for round_ in range(args.repeats):
        order = ("before", "after") if round_ % 2 == 0 else ("after", "before")
        for task in tasks:
            for version in order:
                loads.append(os.getloadavg()[0])
                results[task][version].append(run_worker(task, trees[version], cache, args))
                print(f"round {round_ + 1}, {task}, {version}: {json.dumps(results[task][version][-1])}", flush=True)
        # After every round, so a run cut short on a busy machine still leaves the rounds it finished.
        write_report(args, results, round_ + 1, root, started, load_before, loads)


def write_report(args: argparse.Namespace, results: dict[str, dict[str, list[dict]]], rounds: int, root: Path,
                 started: datetime.datetime, load_before: str, loads: list[float]) -> None:
    body, missed = table(results, args)
    after_rev = git("rev-parse", "--short", "HEAD") + (" with uncommitted changes to slmviz/"
                                                       if git("status", "--porcelain", "--", "slmviz") else "")
    command = " ".join(["bench/perf/redesign.py", *sys.argv[1:]])
    header = (f"Made by `{command}` from {started:%Y-%m-%d %H:%M %Z}, {rounds} of {args.repeats} rounds done: "
              f"before = {args.before} (slmviz 0.2.0; a worktree in {root}), after = {after_rev}. "
              f"{os.cpu_count()} cores ({cpu_name()}), {args.dtype}, each measurement in a fresh process, the versions "
              f"alternating within each round. Load average (1, 5, 15 min) before: {load_before}; now: "
              f"{load_average()}; at each measurement's start (1 min): {min(loads):.1f}–{max(loads):.1f}.")
    note = (f"A speed ratio above 1 means the redesign is faster; below {1 - TOLERANCE:.2f} would be a regression "
            "beyond the issue's 5 %. Each round's ratio pairs the two versions' runs of that round (back to back), "
            "so the median of the ratios is steadier than the ratio of the medians when the load moves."
            + same_graph(results["graph"]["before"] + results["graph"]["after"]))
    if missed:
        note += f" Outside 5 %: {', '.join(missed)}; re-run on a quieter machine before reading it as a regression."
    text = f"# Before and after the 0.3 redesign\n\n{header}\n\n{body}\n\n{note}\n"
    print("\n" + text, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(f"written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
