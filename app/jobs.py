"""Background jobs: long work (corpus scans, patch sweeps, feature scans, SAE training) run off the request queues.

Why. Gradio's "model" queue runs one call at a time (two cores, one shared model). Measured on the app before
this runner: while one session's `z` patch sweep of a 20-token pair held that queue (6.3 s), four other
sessions' Run requests waited 5.6-6.1 s each (0.23 s when idle).

The choice: a worker of its own, not chunks that give way inside the model queue. Giving way between chunks
would need each chunk to be a request of its own, re-queued behind the short ones: the page, gradio_client
and the API would all have to drive that loop, a job's state would live between requests, and a job that
gives way to every new request starves under steady load. Instead a long job runs in the runner's worker
thread, outside every queue; the request that started it only waits for it (in its own "jobs" queue,
app/main.py), showing its progress and partial results. A short request from another session is served at
once, beside the job on the same cores (torch releases the GIL inside its kernels): measured with a `z`
sweep running in the worker on this 2-core machine, while other agents loaded it, a Run-sized trace took
0.1-1.0 s (bench/studies/app_jobs.py measures it). What it costs: the job itself runs slower while short requests
share the cores.

- One long job at a time (WORKERS), in the order they were asked for: on two cores a second long job in
  parallel would only halve both and slow every short request further. A queued job's progress says how
  many jobs are ahead of it.
- Shared jobs (`join`, by key: a corpus scan) run once however many visitors wait, and their result is kept.
  One-off jobs (`submit`: one session's sweep) are forgotten when done; their result goes to the one
  request that waits for it.
- Every visitor waiting for a job is one of its watchers (their Gradio session). A job stops at its next
  progress report once no one watches it (a queued one never starts):
  - Cancel ends the waiting request, and Gradio closes its generator: `wait` then leaves at once;
  - `leave` (a Cancel over the API, which does not stop the request) removes that visitor's watch;
  - a watch not renewed for ABANDONED_S lapses (a closed tab).
  So one visitor's Cancel never stops the scan another visitor still waits for. A stopped or failed shared
  job is forgotten, and the next visitor to ask starts it again.
- Progress: slmviz.progress's contract. The work is handed its job's `JobProgress` (a slmviz.progress.Progress): it
  reports there, or hands it (or a part of it) to the library call it makes, so a job is one bar that never runs
  backwards, names its phase and says the time left; `job.update` is its latest ProgressUpdate. `publish(partial)`
  keeps what it has so far (a sweep's partial heatmap); nothing is lost when a session waits again or a job fails.
  Calling it as `report(fraction, desc[, partial])` is the older form, still taken (a phase named `desc` at
  `fraction` of the job).

`wait` is a generator for Gradio handlers: it renews the watch and reports progress every POLL_S and yields,
so a cancelled request (which Gradio stops iterating, then closes) stops renewing its watch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Any

from slmviz.progress import Progress, ProgressUpdate, _Root

POLL_S = 0.5
ABANDONED_S = 15.0
WORKERS = 1  # long jobs at once: two cores; short requests run beside them
Report = Callable[..., None]  # a JobProgress: report(fraction done, what is happening[, partial result]) or its parts


class JobCancelled(Exception):
    """Raised inside a job's work by its progress report once no visitor watches it any more."""


class JobProgress(Progress):
    """A job's progress (slmviz.progress.Progress) whose every report renews nothing but checks the job is still
    watched: once no visitor waits, the report raises JobCancelled and the work stops there."""

    def __init__(self, job: Job):
        super().__init__(_Root(str(job.kind or "job"), job._sink))
        self._job = job

    def publish(self, partial: Any) -> None:
        """Keep `partial` as what the job has so far (a sweep's partial heatmap); stops the work if unwatched."""
        self._job.partial = partial
        self._job._check()

    def __call__(self, fraction: float, desc: str, partial: Any = None) -> None:
        """The older report: a phase named `desc` at `fraction` (0..1) of the job, and what it has so far."""
        if partial is not None:
            self._job.partial = partial
        self._root.emit(desc, 0, None, "", "", fraction)


class Job:
    """One piece of work, `work(progress)`, run by a Jobs runner's worker (or in a thread of its own by `start`).

    `progress` is the job's JobProgress; its latest ProgressUpdate is `self.update`, and `fraction` and `desc` read
    from it (`desc`: where the job waits in the queue until it starts)."""

    def __init__(self, key: Hashable, work: Callable[[Report], Any], kind: str = ""):
        self.key, self.kind = key, kind
        self.update: ProgressUpdate | None = None
        self._place = "starting"
        self.partial: Any = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._work = work
        self._watchers: dict[str, float] = {}  # session -> last time it was renewed (time.monotonic)
        self._left: set[str] = set()  # sessions that pressed Cancel: their waits end
        self._lock = threading.Lock()

    def start(self) -> Job:
        """Run it now in a daemon thread of its own (outside any runner's queue)."""
        threading.Thread(target=self.run, name=f"job {self.key}", daemon=True).start()
        return self

    def run(self) -> None:
        try:
            if not self.watched():  # every visitor left while it was queued: never start it
                raise JobCancelled(f"{self.key}: cancelled before it started, no visitor is waiting for it")
            self.result = self._work(JobProgress(self))
        except BaseException as e:  # noqa: BLE001 - handed to every waiter, who shows it
            self.error = e
        finally:
            self.done.set()

    @property
    def fraction(self) -> float:
        return self.update.fraction if self.update is not None else 0.0

    @property
    def desc(self) -> str:
        """The line a person reads: the latest update's text ("scan 2/4 120 / 200 doc · 1m 05s left"), or the
        job's place in the queue before it reports."""
        return self.update.text() if self.update is not None else self._place

    @desc.setter
    def desc(self, text: str) -> None:
        self._place = text

    def _sink(self, update: ProgressUpdate) -> None:
        self.update = update
        self._check()

    def _check(self) -> None:
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
    """A runner: its worker threads run queued jobs `workers` at a time, first asked, first run.

    `join` starts a shared job or joins the one queued, running or finished under that key; `submit` queues a
    one-off job. Worker threads start with the first job and then wait for more (daemons)."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._jobs: dict[Hashable, Job] = {}  # shared jobs by key, kept once finished
        self._pending: deque[Job] = deque()
        self._running: set[Job] = set()
        self._lock = threading.Condition()
        self._workers: list[threading.Thread] = []
        self._n_workers = workers
        self._ids = itertools.count()

    def join(self, key: Hashable, work: Callable[[Report], Any], who: str, kind: str = "") -> Job:
        with self._lock:
            job = self._jobs.get(key)
            if job is None or job.failed:  # a cancelled or failed job is started again
                job = self._jobs[key] = Job(key, work, kind)
                job.watch(who)  # before it is queued: the worker must see a watcher
                self._queue(job)
                return job
            job.watch(who)
            return job

    def submit(self, work: Callable[[Report], Any], who: str, kind: str = "") -> Job:
        """A one-off job for `who` alone: queued now, forgotten by the runner once it is done."""
        with self._lock:
            job = Job((kind or "job", who, next(self._ids)), work, kind)
            job.watch(who)
            self._queue(job)
            return job

    def _queue(self, job: Job) -> None:  # holding self._lock
        self._pending.append(job)
        self._say_places()
        if len(self._workers) < self._n_workers:
            worker = threading.Thread(target=self._work, name="slmviz long jobs", daemon=True)
            self._workers.append(worker)
            worker.start()
        self._lock.notify()

    def _say_places(self) -> None:  # holding self._lock: a queued job's progress line is its place
        for ahead, job in enumerate(self._pending, start=len(self._running)):
            job.desc = (f"waiting for {ahead} long job{'s' if ahead > 1 else ''} ahead of it (one runs at a time)"
                        if ahead else "starting")

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._pending:
                    self._lock.wait()
                job = self._pending.popleft()
                job.desc = "starting"
                self._running.add(job)
                self._say_places()
            try:
                job.run()
            finally:
                with self._lock:
                    self._running.discard(job)
                    self._say_places()

    def leave(self, who: str, kind: str | None = None) -> None:
        """`who` stops waiting for every job (of this kind, if given): the Cancel buttons."""
        with self._lock:
            jobs = {*self._jobs.values(), *self._pending, *self._running}
        for job in jobs:
            if kind is None or job.kind == kind:
                job.leave(who)

    def put(self, key: Hashable, result: Any, kind: str = "") -> Job:
        """A shared job's result known without running it (read from a file prepared beforehand): `join` and
        `finished` find it done under `key`, as if it had run."""
        job = Job(key, lambda report: result, kind)
        job.result = result
        job.done.set()
        with self._lock:
            self._jobs[key] = job
        return job

    def finished(self, key: Hashable) -> Any | None:
        """The result of a shared job that finished successfully, else None (never starts one)."""
        with self._lock:
            job = self._jobs.get(key)
        return job.result if job is not None and job.done.is_set() and job.error is None else None


RUNNER = Jobs()  # the server's one runner: every tab's long work queues here


def wait(job: Job, who: str, progress: Callable[..., Any] | None = None) -> Iterator[None]:
    """Yield every POLL_S until `job` is done (renewing `who`'s watch and showing its progress), then return;
    re-raise the job's error (JobCancelled if every watcher left, or `who` did). Use as `yield from` in a
    generator handler, then read job.result. Closing this generator (Gradio does, on Cancel) leaves the job."""
    try:
        while not job.done.wait(POLL_S):
            if not job.renew(who):
                raise JobCancelled(f"{job.key}: you stopped waiting for it")
            if progress is not None:
                progress(job.fraction, desc=job.desc)
            yield
    finally:
        job.leave(who)
    if job.error is not None:
        raise job.error
