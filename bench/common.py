"""Shared pieces of the benchmarks: inputs, interleaved timing, result rows, machine facts, where results go.

Every script under bench/ (perf/, peers/, studies/, tools/) starts with the same line,
`sys.path.insert(0, str(Path(__file__).resolve().parents[1]))`, so `import common` finds this file from any group;
importing it puts this checkout first on sys.path, so the scripts measure the slmviz beside them, not an installed
one. Scripts of one group import each other by name (their own folder is on sys.path already); what two groups
share lives here.

Every script runs slmviz and transformers in one process on the same weights and the same token ids,
warms both up, then times them in alternating rounds (slmviz, transformers, slmviz, ...) and reports
medians. Alternating matters on a shared 2-core machine: a neighbour's burst of work lands on both
sides of a ratio instead of on whichever ran second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"  # every recorded table, JSON, figure and run log, whichever group wrote it
if str(REPO) not in sys.path:  # `python bench/<group>/<script>.py` without an installed slmviz
    sys.path.insert(0, str(REPO))

# Ordinary English prose, repeated to any length: the token ids every forward benchmark feeds both models.
TEXT = (
    "The lighthouse stood at the end of a long spit of sand, and every evening the keeper climbed its "
    "one hundred and twelve steps to light the lamp. Ships passing in the night saw the beam sweep across "
    "the water and knew where the rocks were. In winter the storms came from the north, and the keeper "
    "wrote in his logbook the height of the waves, the direction of the wind and the names of the boats "
    "that sheltered in the bay. "
)
GENERATE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Row:
    """One line of the results table."""

    what: str
    slmviz: str  # the measured figure, formatted (s, tokens/s, GB, ...)
    reference: str  # transformers' figure, or the bound it is compared with ("" if none)
    ratio: float | None  # the number the target constrains
    target: str  # e.g. "≤ 1.0"
    met: bool | None  # None when not measured
    note: str = ""


def prompt_ids(model, n_tokens: int) -> torch.Tensor:
    """Exactly n_tokens ids of TEXT (repeated as needed) through the model's own tokenizer."""
    text = TEXT
    while len(model.tokenizer(text)["input_ids"]) < n_tokens:
        text += TEXT
    return torch.tensor(model.tokenizer(text)["input_ids"][:n_tokens], dtype=torch.long)


def interleaved(fns: dict[str, Callable[[], object]], warmup: int = 2, repeats: int = 7,
                into: dict[str, list[float]] | None = None,
                sync: Callable[[], object] = lambda: None) -> dict[str, list[float]]:
    """Wall-clock seconds of each fn over `repeats` alternating rounds, after `warmup` untimed rounds.

    Appends to `into` when given (so callers can interleave several groups round by round) and returns it.
    `sync` runs before the clock starts and before it stops (torch.cuda.synchronize on a GPU, whose kernels run
    after the call returns).
    """
    times = into if into is not None else {name: [] for name in fns}
    with torch.inference_mode():
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        for _ in range(repeats):
            for name, fn in fns.items():
                sync()
                start = time.perf_counter()
                fn()
                sync()
                times[name].append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def matmul_replaced(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]):
    """Inside the block, every weight matmul of slmviz's decoder calls fn(x, w, b) instead of params.linear.

    For evidence rows only: what the time would be with another kernel, or how long the matmuls take.
    """
    from slmviz.model import block, decoder

    saved = block.linear, decoder.linear
    block.linear = decoder.linear = fn
    try:
        yield
    finally:
        block.linear, decoder.linear = saved


def decoding_step_split(model, ids: torch.Tensor, n: int,
                        timed: Callable[[torch.Tensor], bool] = lambda w: True) -> tuple[float, float]:
    """(seconds per decoding step, of which inside the weight matmuls `timed(w)` selects) of one stream.

    Every selected matmul is timed with perf_counter around it, so the split carries the timer's own cost.
    """
    from slmviz.model.params import linear

    spent = [0.0]

    def timed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if not timed(w):
            return linear(x, w, b)
        start = time.perf_counter()
        out = linear(x, w, b)
        spent[0] += time.perf_counter() - start
        return out

    stamps = []
    with matmul_replaced(timed_linear), torch.inference_mode():
        for _step in model.stream(ids, n, stop_at_eos=False):
            stamps.append(time.perf_counter())
            if len(stamps) == 1:
                spent[0] = 0.0  # the clock starts after the prefill, like the decoding-steps rows
    # The last step's matmuls ran before its token was yielded, so every counted matmul is in the window.
    return per_step(stamps), spent[0] / (len(stamps) - 1)


def per_step(stamps: list[float]) -> float:
    """Seconds per cached decoding step from the times tokens were yielded (the first one ends the prefill)."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    """min–max of a timing list, for the notes: a wide spread means the machine was busy."""
    return f"{min(xs):.3g}–{max(xs):.3g} s"


def load_models(*attn_implementations: str, name: str | None = None):
    """slmviz's bundled model (`name`: another bundled one, e.g. "gemma-3-270m") and transformers models of
    the same folder, fp32, one per attention kernel."""
    import slmviz
    from slmviz.loading.reference import load_reference

    model = slmviz.load(name)
    refs = {impl: load_reference(model.path, attn_implementation=impl) for impl in attn_implementations}
    return model, refs


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def status_gb(key: str) -> float:
    """/proc/self/status's `key` (VmRSS, VmHWM, ...) in GiB; the kernel reports kB (1024 bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**20
    raise KeyError(key)


def reset_peak() -> float:
    """Reset this process's peak resident set (VmHWM) to its current one and return that, in GiB: the peak read
    afterwards is what the work after this call held, with whatever was already loaded counted once."""
    Path("/proc/self/clear_refs").write_text("5")
    return status_gb("VmRSS")


def head_of(path: Path, tokens: int, model) -> str:
    """A temporary jsonl of the corpus's first documents, about `tokens` tokens of them (a short training run on
    the full corpus would spend its time tokenising the whole of it for BatchTopK's threshold rows)."""
    out = Path(tempfile.mkdtemp()) / "head.jsonl"
    kept, n = [], 0
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        kept.append(line)
        n += len(model.encode(json.loads(line)["text"]))
        if n >= tokens:
            break
    out.write_text("\n".join(kept) + "\n", encoding="utf-8")
    return str(out)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine() -> dict[str, str]:
    import transformers

    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
    }


def fmt_ratio(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def markdown_table(header: list[str], rows: Iterable[Iterable[object]]) -> str:
    """A Markdown table: one line a row, every cell str()-ed, a "|" inside a cell escaped (it would end the cell)."""
    def line(cells: Iterable[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(header), line("---" for _ in header), *map(line, rows)])


def verdict(r: Row) -> str:
    return "—" if r.met is None else ("✅ met" if r.met else "❌ not met")


def results_table(rows: list[Row], reference: str = "transformers / bound",
                  ratio: Callable[[float | None], str] = fmt_ratio) -> str:
    """The results files' table of Rows (make bench's bench/results/perf.md, and perf/gpu.py's)."""
    return markdown_table(["what", "slmviz", reference, "ratio", "target", "result", "notes"],
                          ([r.what, r.slmviz, r.reference, ratio(r.ratio), r.target, verdict(r), r.note]
                           for r in rows))


def frame_table(frame) -> str:
    """A DataFrame as a Markdown table: floats to 3 significant digits, strings in code spans (node names such as
    "<q>" would otherwise read as HTML tags)."""
    def cell(x: object) -> str:
        return f"{x:.3g}" if isinstance(x, float) else f"`{x}`" if isinstance(x, str) else str(x)

    return markdown_table(list(frame.columns), ([cell(x) for x in row] for row in frame.itertuples(index=False)))


def print_rows(rows: list[Row]) -> None:
    for r in rows:
        verdict = "n/a" if r.met is None else ("met" if r.met else "NOT met")
        ref = f" vs {r.reference}" if r.reference else ""
        print(f"{r.what}: {r.slmviz}{ref} → {fmt_ratio(r.ratio)} (target {r.target}) {verdict}"
              + (f"  [{r.note}]" if r.note else ""))


def main(run: Callable[[argparse.Namespace], list[Row]], description: str,
         add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
    """Command line shared by every script: `--json PATH` also writes the rows for bench/perf/run_all.py."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, default=None, help="also write the result rows here")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per measurement (median reported)")
    if add_args:
        add_args(parser)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load_average()}",
          flush=True)
    rows = run(args)
    print_rows(rows)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows]))
