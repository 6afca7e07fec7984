"""The one progress report of a training run, on slmviz.progress's contract: after every step of every coder, one
ProgressUpdate of the tokens trained (summed over coders) with the layers' mean explained variance as its detail
("EV 0.65", the worst layer's beside it for a set) and the whole stats dict as its `stats`. `progress`: True (a tqdm
bar), False/None, fn(ProgressUpdate), or a caller's Progress part (slmviz.training.prepare's "training").

stats: tokens and total (summed over the run's coders: per layer times layers for a PLT set), step (steps taken),
tokens_per_s, the latest loss terms summed over coders (loss, mse, aux, and pre_act for a CLT), and over every layer
trained: explained_variance (mean), worst_explained_variance, l0 (mean features per token), l0_total (their sum) and
dead_fraction (the worst layer's); `layers` holds each layer's latest {explained_variance, l0, dead_fraction, mse,
tokens}.
"""

from __future__ import annotations

import time
from typing import Any

from ..progress import ProgressLike, as_progress

SUMMARY = ("explained_variance", "worst_explained_variance", "l0", "l0_total", "dead_fraction")


def summary(layers: dict[Any, dict[str, float]]) -> dict[str, float]:
    """The figures over every layer: mean and worst explained variance, mean and summed L0, worst dead fraction."""
    evs = [f["explained_variance"] for f in layers.values()]
    l0 = [f["l0"] for f in layers.values()]
    return {"explained_variance": sum(evs) / len(evs), "worst_explained_variance": min(evs), "l0": sum(l0) / len(l0),
            "l0_total": sum(l0), "dead_fraction": max(f["dead_fraction"] for f in layers.values())}


class Report:
    """Collects each coder's latest step figures (loop.Trainer.step) into the run's stats and reports them."""

    def __init__(self, progress: ProgressLike, trainers: dict[str, Any], desc: str):
        self.progress, self.trainers = as_progress(progress, desc), trainers
        self.total = sum(t.cfg.tokens for t in trainers.values())
        self.latest: dict[str, dict[str, Any]] = {}
        self.start, self.t0 = self.done(), time.perf_counter()

    def done(self) -> int:
        return sum(t.cursor.tokens for t in self.trainers.values())

    def step(self, coder: str, figures: dict[str, Any]) -> None:
        """After one step of `coder`: one update of the tokens trained, "EV 0.65" (", worst 0.41") and L0 its detail."""
        self.latest[coder] = figures
        stats = self.stats()
        self.progress.update(stats["tokens"], self.total, unit="tok", detail=detail(stats), stats=stats)

    def stats(self) -> dict[str, Any]:
        done = self.done()
        layers = {L: {**f, "tokens": self.trainers[name].cursor.tokens}
                  for name, figures in self.latest.items() for L, f in figures["layers"].items()}
        terms = [k for k in next(iter(self.latest.values())) if k not in SUMMARY and k != "layers"]
        return {"tokens": done, "total": self.total, "step": sum(t.cursor.steps for t in self.trainers.values()),
                "tokens_per_s": (done - self.start) / max(time.perf_counter() - self.t0, 1e-9),
                **{k: sum(f[k] for f in self.latest.values()) for k in terms}, **summary(layers), "layers": layers}

    def close(self) -> None:
        """Nothing to close: the job's sink (a tqdm bar of progress=True) closes at the job's end."""


def detail(stats: dict[str, Any]) -> str:
    """What a training update says beside its count: "EV 0.65, worst 0.41 · L0 32.0" (worst for several layers)."""
    ev = f"EV {stats['explained_variance']:.2f}"
    if len(stats["layers"]) > 1:
        ev += f", worst {stats['worst_explained_variance']:.2f}"
    return f"{ev} · L0 {stats['l0']:.1f}"
