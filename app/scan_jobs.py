"""Shared background jobs: long work (a corpus scan) that runs once per server, however many visitors wait.

A job runs in its own thread, never inside a request, so it holds no queue slot: other visitors' Run,
Compare and Patch requests go on while it works (on the same cores, so more slowly). Every visitor waiting
for a job is one of its watchers (their Gradio session). A job stops at its next progress report once no
one watches it:
- Cancel removes that visitor's watch at once (`leave`);
- a watch not renewed for ABANDONED_S lapses (a closed tab, or a waiting request Gradio cancelled).
So one visitor's Cancel never stops the scan another visitor still waits for. A stopped or failed job is
forgotten, and the next visitor to ask starts it again.

`wait` is a generator for Gradio handlers: it renews the watch and reports progress every POLL_S and
yields, so a cancelled request (which Gradio stops iterating) stops renewing its watch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterator
from typing import Any

POLL_S = 0.5
ABANDONED_S = 15.0
Report = Callable[[float, str], None]  # (fraction done, what is happening)


class JobCancelled(Exception):
    """Raised inside a job's work by its progress report once no visitor watches it any more."""


class Job:
    """One piece of work, `work(report)`, run in a daemon thread; `report(fraction, desc)` is its progress."""

    def __init__(self, key: Hashable, work: Callable[[Report], Any]):
        self.key = key
        self.fraction, self.desc = 0.0, "starting"
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._work = work
        self._watchers: dict[str, float] = {}  # session -> last time it was renewed (time.monotonic)
        self._left: set[str] = set()  # sessions that pressed Cancel: their waits end
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"job {key}", daemon=True)

    def start(self) -> Job:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.result = self._work(self._report)
        except BaseException as e:  # noqa: BLE001 - handed to every waiter, who shows it
            self.error = e
        finally:
            self.done.set()

    def _report(self, fraction: float, desc: str) -> None:
        self.fraction, self.desc = fraction, desc
        if not self.watched():
            raise JobCancelled(f"{self.key}: cancelled, no visitor is waiting for it")

    def watch(self, who: str) -> None:
        """`who` (re)joins: watching it from now on, even after an earlier leave."""
        with self._lock:
            self._left.discard(who)
            self._watchers[who] = time.monotonic()

    def renew(self, who: str) -> bool:
        """`who` is still waiting; False if it left (a Cancel that did not stop its request, e.g. over the API)."""
        with self._lock:
            if who in self._left:
                return False
            self._watchers[who] = time.monotonic()
            return True

    def leave(self, who: str) -> None:
        with self._lock:
            self._watchers.pop(who, None)
            self._left.add(who)

    def watched(self) -> bool:
        now = time.monotonic()
        with self._lock:
            self._watchers = {w: t for w, t in self._watchers.items() if now - t < ABANDONED_S}
            return bool(self._watchers)

    @property
    def failed(self) -> bool:
        return self.done.is_set() and self.error is not None


class Jobs:
    """The server's jobs by key: `join` starts a job or joins the one already running or finished."""

    def __init__(self) -> None:
        self._jobs: dict[Hashable, Job] = {}
        self._lock = threading.Lock()

    def join(self, key: Hashable, work: Callable[[Report], Any], who: str) -> Job:
        with self._lock:
            job = self._jobs.get(key)
            if job is None or job.failed:  # a cancelled or failed job is started again
                job = self._jobs[key] = Job(key, work)
                job.watch(who)  # before it starts: its first report must see a watcher
                return job.start()
            job.watch(who)
            return job

    def leave(self, who: str) -> None:
        """`who` stops waiting for every job (the Cancel button)."""
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.leave(who)

    def finished(self, key: Hashable) -> Any | None:
        """The result of a job that finished successfully, else None (never starts one)."""
        with self._lock:
            job = self._jobs.get(key)
        return job.result if job is not None and job.done.is_set() and job.error is None else None


def wait(job: Job, who: str, progress: Callable[..., Any] | None = None) -> Iterator[None]:
    """Yield every POLL_S until `job` is done (renewing `who`'s watch and showing its progress), then return;
    re-raise the job's error (JobCancelled if every watcher left, or `who` did). Use as `yield from` in a
    generator handler, then read job.result."""
    while not job.done.wait(POLL_S):
        if not job.renew(who):
            raise JobCancelled(f"{job.key}: you stopped waiting for it")
        if progress is not None:
            progress(job.fraction, desc=job.desc)
        yield
    job.leave(who)
    if job.error is not None:
        raise job.error
