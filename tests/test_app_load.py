"""The app under load: 8 concurrent gradio_client sessions × 5 requests each, a cancelled generation, and a Run
served during another session's generation (checked by order of completion, never by time); and, idle, the queue's
poll the app slows down.

Checks every request succeeds, results equal a single client's (determinism under Gradio's queue and
its concurrency limit), and the server's memory stays bounded (peak RSS is printed and recorded in
README's limits section). Does not measure latency (no timing asserts: the machines are noisy).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from app_helpers import app_server
from gradio_client import Client

from app.variant_fields import FAITHFUL_WIDGETS

pytestmark = pytest.mark.app

STAGES = ["pre", "mid", "post"]
PROMPTS = [
    "The capital of France is",
    "One, two, three, four,",
    "When Mary and John went to the store, John gave a drink to",
    "def add(a, b):\n    return",
    "The cat sat on the mat. The cat",
]
N_CLIENTS = 8
MAX_SERVER_RSS = 4 * 2**30  # 4 GiB: one model (~0.6 GB) plus bounded per-request traces


def run(client: Client, prompt: str) -> tuple:
    return client.predict(prompt, False, 1, "all", STAGES, False, False, True, api_name="/run")


def fingerprint(result: tuple) -> tuple:
    """What must not depend on concurrency: the token strip, the next-token table, the status line."""
    tokens, _attention, _residual, table, status = result  # the gr.State trace stays on the server
    return tokens, [tuple(row) for row in table["data"]], status


def server_process(url: str) -> psutil.Process:
    port = int(url.rsplit(":", 1)[1])
    for child in psutil.Process().children(recursive=True):
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections()):
                return child
        except psutil.Error:
            continue
    raise RuntimeError(f"no child process listens on port {port}")


class PeakRss:
    """Samples a process's RSS every 0.2 s in a thread; `.peak` is the largest seen."""

    def __init__(self, proc: psutil.Process):
        self.proc, self.peak, self._stop = proc, proc.memory_info().rss, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server():
    with app_server() as url:
        yield url


def test_eight_concurrent_clients_get_the_single_client_results(server, record_property):
    expected = {p: fingerprint(run(Client(server, verbose=False), p)) for p in PROMPTS}
    proc = server_process(server)
    idle_rss = proc.memory_info().rss

    def session(i: int) -> list[tuple[str, tuple]]:
        client = Client(server, verbose=False)
        order = PROMPTS[i % len(PROMPTS):] + PROMPTS[: i % len(PROMPTS)]  # different clients, different orders
        return [(p, fingerprint(run(client, p))) for p in order]

    with PeakRss(proc) as rss, ThreadPoolExecutor(N_CLIENTS) as pool:
        results = [r for rs in pool.map(session, range(N_CLIENTS)) for r in rs]
    assert len(results) == N_CLIENTS * len(PROMPTS)
    for prompt, got in results:
        assert got == expected[prompt], prompt
    print(f"\nserver RSS: idle {idle_rss / 2**20:.0f} MiB, peak under 8x5 load {rss.peak / 2**20:.0f} MiB")
    record_property("server_peak_rss_mib", round(rss.peak / 2**20))
    assert rss.peak < MAX_SERVER_RSS


def streaming_generation(client: Client):
    """A faithful 256-token generation, returned once its first tokens have streamed."""
    job = client.submit("Tell me a very long story about the sea.", True, *FAITHFUL_WIDGETS, 256, 0, 0, 0,
                        api_name="/generate")
    deadline = time.monotonic() + 120
    while not job.outputs() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.outputs(), "generation never started streaming"
    return job


def test_cancelling_a_long_generation_leaves_the_server_answering(server):
    client = Client(server, verbose=False)
    job = streaming_generation(client)
    job.cancel()
    streamed = len(job.outputs())
    time.sleep(2)
    assert len(job.outputs()) <= streamed + 1  # it stopped (at most one update was already in flight)
    assert job.outputs()[-1][0] and len(job.outputs()[-1][0]) < 2000  # partial text, not a full 256 tokens
    result = run(client, "The capital of France is")
    assert result[4].startswith("Traced")


def test_another_sessions_run_during_a_long_generation_finishes_first(server):
    """Generate decodes in the "decode" queue, not the one-at-a-time "model" queue: a Run from another session,
    asked for while a 256-token generation streams, is served beside it and finishes first."""
    alice, bob = Client(server, verbose=False), Client(server, verbose=False)
    job = streaming_generation(alice)
    result = run(bob, "The capital of France is")
    assert result[4].startswith("Traced")
    assert not job.done()  # bob's Run did not wait for alice's generation
    job.cancel()


def test_an_idle_queue_looks_for_work_every_20_ms_not_every_millisecond():
    """Gradio's queue polls for new events every millisecond and for progress every 10 ms (the attributes read
    below); the app sets them to QUEUE_POLL_S and PROGRESS_POLL_S (app/main.py, poll_queue_less). Fails where a
    Gradio release renames them, which would silently bring back an idle server's busy core."""
    import gradio as gr

    from app.main import PROGRESS_POLL_S, QUEUE_POLL_S, poll_queue_less

    with gr.Blocks() as demo:
        gr.Markdown("idle")
    demo.queue()
    assert demo._queue.sleep_when_free < QUEUE_POLL_S  # Gradio's own, before
    poll_queue_less(demo)
    assert demo._queue.sleep_when_free == QUEUE_POLL_S
    assert demo._queue.progress_update_sleep_when_free == PROGRESS_POLL_S
