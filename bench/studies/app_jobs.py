"""Short requests while a long job runs, timed from the outside through gradio_client (app/jobs.py).

Starts the app (tests/app_helpers.py), then: a Run of a short prompt when the server is idle; the same Run
from 1 and from 4 other sessions at once while one session's `z` patch sweep of a 23-token pair (the prompts
differ at the second token, so it runs for minutes) is under way; then cancels the sweep. Before the job
runner, the sweep held the one-at-a-time model queue and every Run waited for it until the sweep ended. Evidence,
no target: a shared 2-core machine's neighbours
move these numbers; re-run when the load average printed first was high.

    .venv/bin/python bench/studies/app_jobs.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO, Row, main, median, spread

sys.path.insert(0, str(REPO / "tests"))
from app_helpers import app_server  # the app tests' server

STAGES = ["pre", "mid", "post"]
PROMPT = "The capital of France is"
LONG_CLEAN = "When Mary and John went to the market after a long day at work in the town, John gave a drink to"
LONG_CORRUPTED = "When Anna and John went to the market after a long day at work in the town, John gave a drink to"


def timed_run(client) -> float:
    start = time.perf_counter()
    client.predict(PROMPT, False, 1, "all", STAGES, False, False, True, api_name="/run")
    return time.perf_counter() - start


def at_once(clients) -> list[float]:
    """Each client's Run, all started together; seconds each took."""
    times = [0.0] * len(clients)

    def one(i: int) -> None:
        times[i] = timed_run(clients[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times


def run(args: argparse.Namespace) -> list[Row]:
    from gradio_client import Client

    with app_server() as url:
        clients = [Client(url, verbose=False) for _ in range(5)]
        timed_run(clients[0])  # warm-up
        idle = [timed_run(clients[0]) for _ in range(args.repeats)]
        alice = Client(url, verbose=False)
        sweep = alice.submit(LONG_CLEAN, LONG_CORRUPTED, " Mary", " Anna", "z", "denoise", "exact",
                             api_name="/patch_sweep")
        while not sweep.outputs():
            time.sleep(0.2)
        one = [timed_run(clients[0]) for _ in range(args.repeats)]
        four = [max(at_once(clients[1:])) for _ in range(args.repeats)]
        still_running = not sweep.done()
        alice.predict(api_name="/patch_cancel")
        sweep.cancel()
    note = "sweep still running when measured" if still_running else "the sweep ended before the Runs did"
    return [
        Row("app: Run of a 6-token prompt, idle server", f"{median(idle):.2f} s ({spread(idle)})", "", None, "", None),
        Row("app: the same Run during another session's long z sweep", f"{median(one):.2f} s ({spread(one)})",
            f"{median(idle):.2f} s idle", median(one) / median(idle), "", None, note),
        Row("app: 4 sessions' Runs at once during the sweep (slowest)", f"{median(four):.2f} s ({spread(four)})",
            "5.6-6.1 s before the job runner", None, "", None, note),
    ]


if __name__ == "__main__":
    main(run, __doc__.splitlines()[0], None)
