"""One progress contract for every long job: training, scans, set preparation, graphs, evaluation, EAP.

A job reports through a `Progress`. A job made of phases gives each phase a `part` of its own span, so one bar covers
the whole job, never runs backwards, and names where it is:

    p = as_progress(progress, "prepare plt-quick")         # progress: True (tqdm), False/None, fn(update), Progress
    corpus = p.part("chat corpus", share=0.3)              # the next 30 % of p's span
    for i, part in enumerate(parts):
        corpus.update(i + 1, len(parts), unit="part")      # -> "chat corpus 3/9 part"
    train(..., progress=p.part("training", share=0.4))     # a sub-job reports into its part as if it were the job
    for i in range(passes):
        scan_pass(..., progress=p.part("scan", share=0.3 / passes, index=(i + 1, passes)))   # -> "scan 2/4 ..."

Each report reaches the job's one sink as a `ProgressUpdate`: the phase's name, done and total, the whole job's
fraction (monotone: a phase that restarts a count cannot pull the bar back) and the time left from the measured rate.
A sink that raises (the app's Cancel) stops the job where it reports, which is why every long loop reports.

Why shares and not per-phase bars: a person reads one bar per job; a bar per pass is what made the quick-set build's
bar "go backwards" (200/200, then 54/200) with no word of the passes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

__all__ = ["Progress", "ProgressLike", "ProgressUpdate", "as_progress", "format_seconds"]

ETA_AFTER = 0.01  # no time left is guessed before 1 % of the job: the first steps' rate says little (warm-up, caches)


@dataclass(frozen=True)
class ProgressUpdate:
    """One report of a job: where it is (`phase`, `done` of `total` `unit`, `detail`) and how far the whole job is."""

    job: str
    phase: str  # "training", "scan 2/4": the innermost part's name with its index
    done: float
    total: float | None
    unit: str
    detail: str  # what the phase measures as it goes: "EV 0.65"
    fraction: float  # of the whole job, in [0, 1]; never smaller than the previous update's
    elapsed_s: float
    eta_s: float | None  # time left at the job's measured rate; None until ETA_AFTER of it is done
    stats: Any = None  # what the phase measured, whole, for a caller that reads more than `detail` (training's stats)

    def text(self) -> str:
        """The one line a person reads: "training 27,272 / 65,536 tok · EV 0.65 · 3m 10s left"."""
        bits = [self.phase or self.job]
        if self.total:
            bits[0] += f" {_count(self.done)} / {_count(self.total)}" + (f" {self.unit}" if self.unit else "")
        elif self.done:
            bits[0] += f" {_count(self.done)}" + (f" {self.unit}" if self.unit else "")
        if self.detail:
            bits.append(self.detail)
        if self.eta_s is not None:
            bits.append(f"{format_seconds(self.eta_s)} left")
        return " · ".join(bits)


Sink = Callable[[ProgressUpdate], None]
ProgressLike = Union[bool, None, Sink, "Progress"]


class _Root:
    """What every part of one job shares: its sink, clock and the furthest fraction reported."""

    def __init__(self, job: str, sink: Sink | None):
        self.job, self.sink = job, sink
        self.t0 = time.perf_counter()
        self.fraction = 0.0
        self.lock = threading.Lock()

    def emit(self, phase: str, done: float, total: float | None, unit: str, detail: str, fraction: float,
             stats: Any = None) -> None:
        with self.lock:
            self.fraction = max(self.fraction, min(max(fraction, 0.0), 1.0))
            elapsed = time.perf_counter() - self.t0
            f = self.fraction
            eta = elapsed * (1 - f) / f if f >= ETA_AFTER else None
            update = ProgressUpdate(self.job, phase, done, total, unit, detail, f, elapsed, eta, stats)
        if self.sink is not None:
            self.sink(update)


class Progress:
    """A job's progress, or one part of it (a span of the job's bar). Build one with `as_progress`."""

    def __init__(self, root: _Root, name: str = "", lo: float = 0.0, hi: float = 1.0):
        self._root, self.name, self.lo, self.hi = root, name, lo, hi
        self._cursor = lo  # where the next part starts

    @property
    def job(self) -> str:
        return self._root.job

    def part(self, name: str, share: float, index: tuple[int, int] | None = None) -> Progress:
        """The next `share` (0..1) of this span, as a Progress of its own named `name` ("scan 2/4" with index=(2, 4)).
        Parts are laid end to end in the order they are asked for; a share past the end is cut to what is left."""
        label = f"{name} {index[0]}/{index[1]}" if index else name
        lo = self._cursor
        hi = min(self.hi, lo + share * (self.hi - self.lo))
        self._cursor = hi
        return Progress(self._root, label, lo, hi)

    def update(self, done: float, total: float | None = None, unit: str = "", detail: str = "",
               stats: Any = None) -> None:
        """`done` of `total` `unit` of this part (a total of None: a count with no known end, which moves no bar);
        `stats`: the phase's figures, whole, handed on in the update (training's stats dict)."""
        within = min(done / total, 1.0) if total else 0.0
        self._root.emit(self.name, done, total, unit, detail, self.lo + within * (self.hi - self.lo), stats)

    def at(self, fraction: float, detail: str = "") -> None:
        """This part is `fraction` (0..1) done, with no count of its own ("loading the set", a step of a few)."""
        within = min(max(fraction, 0.0), 1.0)
        self._root.emit(self.name, 0, None, "", detail, self.lo + within * (self.hi - self.lo))

    def say(self, detail: str) -> None:
        """A word with no count ("loading the set"), at this part's start or wherever the job already is."""
        self._root.emit(self.name, 0, None, "", detail, self._cursor)

    def finish(self, detail: str = "") -> None:
        """This part is done: the job's bar moves to its end."""
        self._cursor = self.hi
        self._root.emit(self.name, 1, 1, "", detail, self.hi)


def as_progress(progress: ProgressLike, job: str) -> Progress:
    """The Progress a long job reports to, from what its caller passed:
    True -> one tqdm bar (tqdm.auto: a widget in notebooks); False or None -> nothing;
    fn(ProgressUpdate) -> that function, called at every report; a Progress (a caller's part) -> itself."""
    if isinstance(progress, Progress):
        return progress
    if progress is True:
        return Progress(_Root(job, TqdmSink(job)))
    if progress is None or progress is False:
        return Progress(_Root(job, None))
    if callable(progress):
        return Progress(_Root(job, progress))
    raise TypeError(f"progress must be True, False, None, a function of a ProgressUpdate or a Progress; got "
                    f"{type(progress).__name__}")


class TqdmSink:
    """One tqdm bar for a job, in per-mille of the whole job, its description the current phase's line."""

    def __init__(self, job: str):
        self.job, self.bar = job, None

    def __call__(self, u: ProgressUpdate) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=1000, desc=self.job, bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}")
        self.bar.set_postfix_str(u.text(), refresh=False)
        self.bar.update(round(u.fraction * 1000) - self.bar.n)
        if u.fraction >= 1.0:
            self.bar.close()

    def __del__(self) -> None:
        if self.bar is not None:
            self.bar.close()


def format_seconds(s: float) -> str:
    """12 s, 3m 10s, 1h 05m: a time left as a person reads it."""
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def _count(x: Any) -> str:
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.2f}"
