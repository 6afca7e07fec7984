"""The one progress report of a training run: a tqdm bar (progress=True), nothing (False), or fn(stats) after every
step of every coder.

stats: tokens and total (summed over the run's coders: per layer times layers for a PLT set), step (steps taken),
tokens_per_s, the latest loss terms summed over coders (loss, mse, aux, and pre_act for a CLT), and over every layer
trained: explained_variance (mean), worst_explained_variance, l0 (mean features per token), l0_total (their sum) and
dead_fraction (the worst layer's); `layers` holds each layer's latest {explained_variance, l0, dead_fraction, mse,
tokens}.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

Progress = bool | Callable[[dict[str, Any]], None]
SUMMARY = ("explained_variance", "worst_explained_variance", "l0", "l0_total", "dead_fraction")
POSTFIX = {"loss": ("loss", ".3g"), "explained_variance": ("ev", ".3f"), "worst_explained_variance": ("worst", ".3f"),
           "l0": ("l0", ".1f"), "dead_fraction": ("dead", ".3f")}  # stats key -> (tqdm postfix name, format)


def summary(layers: dict[Any, dict[str, float]]) -> dict[str, float]:
    """The figures over every layer: mean and worst explained variance, mean and summed L0, worst dead fraction."""
    evs = [f["explained_variance"] for f in layers.values()]
    l0 = [f["l0"] for f in layers.values()]
    return {"explained_variance": sum(evs) / len(evs), "worst_explained_variance": min(evs), "l0": sum(l0) / len(l0),
            "l0_total": sum(l0), "dead_fraction": max(f["dead_fraction"] for f in layers.values())}


class Report:
    """Collects each coder's latest step figures (loop.Trainer.step) into the run's stats and reports them."""

    def __init__(self, progress: Progress, trainers: dict[str, Any], desc: str):
        self.progress, self.trainers = progress, trainers
        self.total = sum(t.cfg.tokens for t in trainers.values())
        self.latest: dict[str, dict[str, Any]] = {}
        self.start, self.t0 = self.done(), time.perf_counter()
        self.bar = None
        if progress is True:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=self.start, unit="tok", unit_scale=True, desc=desc)

    def done(self) -> int:
        return sum(t.cursor.tokens for t in self.trainers.values())

    def step(self, coder: str, figures: dict[str, Any]) -> None:
        """After one step of `coder`: the bar's position and postfix, or fn(stats)."""
        self.latest[coder] = figures
        stats = self.stats()
        if self.bar is not None:
            fields = [f for f in POSTFIX if f != "worst_explained_variance" or len(stats["layers"]) > 1]
            self.bar.update(stats["tokens"] - self.bar.n)
            self.bar.set_postfix(refresh=False, **{POSTFIX[f][0]: format(stats[f], POSTFIX[f][1]) for f in fields})
        elif callable(self.progress):
            self.progress(stats)

    def stats(self) -> dict[str, Any]:
        done = self.done()
        layers = {L: {**f, "tokens": self.trainers[name].cursor.tokens}
                  for name, figures in self.latest.items() for L, f in figures["layers"].items()}
        terms = [k for k in next(iter(self.latest.values())) if k not in SUMMARY and k != "layers"]
        return {"tokens": done, "total": self.total, "step": sum(t.cursor.steps for t in self.trainers.values()),
                "tokens_per_s": (done - self.start) / max(time.perf_counter() - self.t0, 1e-9),
                **{k: sum(f[k] for f in self.latest.values()) for k in terms}, **summary(layers), "layers": layers}

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
