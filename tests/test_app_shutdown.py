"""The app server exits within seconds of Ctrl-C (SIGINT), with a finished long job in it and sessions still open.

That is how every app test module's server stops (tests/app_helpers.py's stop_server), and how a person stops
`make app`. Before app/main.py's serve_until_interrupted, each such stop took 5 to 16 s: Gradio's Ctrl-C handler
closed only the HTTP server, which waited for the heartbeat streams of the sessions still open (Gradio's join gives
up after 5 s), and then the interpreter's last garbage collection walked the whole heap.

Does not cover: SIGTERM (the default action: the process ends at once), nor a job still running at Ctrl-C (its
worker is a daemon thread; the request waiting for it may hold the server's thread up to Gradio's 5 s join).
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from app_helpers import app_process
from gradio_client import Client

pytestmark = pytest.mark.app

SHUTDOWN_S = 5.0  # "within seconds": less than Gradio's own 5 s join of its server thread


def test_a_server_with_a_finished_job_and_an_open_session_exits_within_seconds_of_ctrl_c():
    # a whole process of its own, as `slmviz app` runs; its long job a scan of a few verses (any finished job will do)
    with app_process({"SLMVIZ_CORPUS_DOCS": "4"}, fresh=True) as (proc, url):
        client = Client(url, verbose=False)  # its heartbeat stream stays open, as a test module's clients' do
        status, *_ = client.predict("blocks.7.mlp.hook_post", "", False, api_name="/corpus_load")
        assert status.startswith("Scan of")  # a finished long job: the job worker now waits for the next one
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server was still running 30 s after Ctrl-C")
        took = time.monotonic() - started
    assert proc.returncode == 0
    assert took < SHUTDOWN_S, f"the server took {took:.1f} s to exit after Ctrl-C"


def test_exit_within_ends_a_process_that_a_waiting_thread_would_hold_open():
    """exit_within, which `slmviz app` arms on Ctrl-C: a thread that is not a daemon (here one sleeping a minute)
    holds the interpreter's exit open; the process ends at the grace period, with status 0."""
    import sys

    from app_helpers import REPO

    script = ("import threading, time\nfrom app.main import exit_within\n"
              "threading.Thread(target=time.sleep, args=(60,)).start()\nexit_within(0.5)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, timeout=50)
    assert done.returncode == 0
    assert time.monotonic() - started < 30  # the import of app.main, then half a second, not the minute
