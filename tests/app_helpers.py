"""Start the slmviz app in a subprocess for the app and browser tests, and stop it afterwards."""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `app` is a folder of the repo, not an installed package
    sys.path.insert(0, str(REPO))
STARTUP_TIMEOUT_S = 240
TEST_CORPUS_DOCS = 48
# Debian's Chromium, driven by Playwright (Playwright's own browser download does not work here); the flags
# keep it from reaching for Google's hosts on a machine with no network.
CHROMIUM = Path(os.environ.get("SLMVIZ_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
NO_CHROMIUM = f"Chromium not found at {CHROMIUM}: apt-get install -y chromium (or set SLMVIZ_CHROMIUM)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def app_server(env: dict[str, str] | None = None, **launch_kwargs) -> Iterator[str]:
    """Serve app.main.launch(port=<free>, **launch_kwargs) from a subprocess; yield its URL (app_process)."""
    with app_process(env, **launch_kwargs) as (_, url):
        yield url


@contextmanager
def app_process(env: dict[str, str] | None = None, fresh: bool = False,
                **launch_kwargs) -> Iterator[tuple[subprocess.Popen | ForkedServer, str]]:
    """Serve app.main.launch(port=<free>, **launch_kwargs) from a process of its own; yield (the process, its URL).

    `env`: variables set for the server on top of this process's environment. Corpus scans (Corpus tab, mean
    ablation) go to a temporary folder and cover TEST_CORPUS_DOCS verses unless `env` says otherwise: tests
    never write into the user's cache, nor wait for the app's 1000-verse scan.
    No background deep scan ($SLMVIZ_DEEP_SCAN=0) unless `env` asks for one: a server that loads a prepared set
    would otherwise scan a million tokens beside every test after it, until it stops (tests/test_deep_scan_app.py
    tests the deep scan itself; what it cost the suite: bench/results/notes.md, "make test's CPU").
    The server is forked from a process that has imported the heavy libraries once (serve_forked), or with `fresh`
    started as a new interpreter, as `slmviz app` starts (for what only a whole process shows: its exit).
    The server's output goes to a log file that is shown if it fails to start. The process is
    stopped (stop_server) on exit, whatever the tests did.
    """
    port = free_port()
    launch_kwargs = {"exit_on_interrupt": True, "port": port, **launch_kwargs}  # as `slmviz app` serves it
    with tempfile.NamedTemporaryFile(prefix="slmviz-app-", suffix=".log") as log, \
            tempfile.TemporaryDirectory(prefix="slmviz-scans-") as scans:
        server_env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1",
                      "SLMVIZ_CORPUS_DOCS": str(TEST_CORPUS_DOCS), "SLMVIZ_SCAN_CACHE": scans,
                      "SLMVIZ_DEEP_SCAN": "0", **(env or {})}
        server_env.pop("SPACE_ID", None)
        if fresh:
            kwargs = ", ".join(f"{k}={v!r}" for k, v in launch_kwargs.items())
            proc = subprocess.Popen(
                [sys.executable, "-c", f"{ANSWER_CTRL_C}; from app.main import launch; launch({kwargs})"],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=server_env,
            )
        else:
            proc = serve_forked(server_env, launch_kwargs, Path(log.name))
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_serving(proc, url, Path(log.name))
            yield proc, url
        finally:
            stop_server(proc)


# --- servers forked from a preloaded process -------------------------------------------------------------------
# A server's start spent most of its CPU importing torch, transformers (and, on the model's load, the parts of it
# that it imports lazily) and gradio, and `make test` starts some twenty (bench/results/notes.md, "make test's
# CPU"). The test servers fork instead from one process per test process that has imported those once
# (multiprocessing's forkserver), and has loaded the default model once (tests/server_preload.py); each then imports
# app, with its own environment set first, so whatever reads a server's settings ($SLMVIZ_*) reads its own. Nothing
# preloaded reads them but $SLMVIZ_CACHE (server_preload: a server with another cache forgets the model), nor starts
# a thread (so the fork is safe). The names are modules; the forkserver of Python 3.11 ignores sys.path, so it
# imports server_preload from tests/ through PYTHONPATH (serve_forked).
SERVER_PRELOAD = [
    "torch", "gradio", "gradio_client", "plotly.graph_objects", "transformers", "transformers.tokenization_utils_fast",
    # the config modules of the models the test servers load (the tiny models and SmolLM2 are llama's, the other
    # bundled one Gemma 3's): the first import of either pulls in transformers' loading and torch.distributed
    "transformers.models.llama.configuration_llama", "transformers.models.gemma3.configuration_gemma3",
    "server_preload",
]
# as app/main.py sets it before it imports gradio: the forkserver, started with this process's environment,
# imports gradio before any app module runs (gradio reads it only when a page is built, but no telemetry, ever)
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def serve_forked(env: dict[str, str], launch_kwargs: dict, log: Path) -> ForkedServer:
    import multiprocessing
    from multiprocessing import forkserver
    from unittest import mock

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(SERVER_PRELOAD)
    # the forkserver, a new interpreter started with this environment, finds server_preload through PYTHONPATH
    here = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    with mock.patch.dict(os.environ, {"PYTHONPATH": here}):
        forkserver.ensure_running()
    proc = context.Process(target=_forked_server, args=(env, launch_kwargs, str(log)), name="slmviz test server")
    proc.start()
    return ForkedServer(proc)


def stop_forkserver() -> None:
    """End the forkserver and wait for it (conftest, at the session's end): unwaited, it would outlive this process
    for a moment, and the CPU time of the servers it forked would be missing from this process's children's (what
    `time make test` reports)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # private, but what the standard library's tests use
    if stop is not None:
        stop()


def _forked_server(env: dict[str, str], launch_kwargs: dict, log: str) -> None:
    """In the forked process: become what `python -c "...; launch(...)"` would have been, then serve."""
    # Ended with the forkserver, which ends once the test process has: a test worker killed (by the OOM killer, say)
    # left its servers running, each holding a model, and their memory got the next worker killed too. The
    # forkserver ends when every holder of its "alive" pipe has, and multiprocessing hands that pipe to each process
    # it forks (for forks of its own, which a server never makes), so the server lets go of it.
    import ctypes
    from multiprocessing import forkserver

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)  # PYTHONUNBUFFERED is read only at an interpreter's start
    os.environ.clear()
    os.environ.update(env)
    if "server_preload" in sys.modules:
        sys.modules["server_preload"].forget_if_another_cache()
    os.chdir(REPO)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the forkserver ignores Ctrl-C (ANSWER_CTRL_C)
    import atexit

    from app.main import launch

    launch(**launch_kwargs)
    atexit._run_exitfuncs()  # multiprocessing ends its processes with os._exit, past the app's atexit cleanup


class ForkedServer:
    """A forked server as stop_server and the tests use a subprocess.Popen: pid, poll, wait, send_signal, ..."""

    def __init__(self, proc: Any):
        self._proc = proc
        self.pid = proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired("slmviz test server", timeout)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self._proc.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# Ctrl-C raises KeyboardInterrupt in the server whatever this process inherited. A shell starts a background job
# (`make test &`, `nohup .ci/run &`) with SIGINT ignored, every child inherits that, and Python then installs no
# handler: each server sat out stop_server's 15 s before SIGTERM, and the shutdown test failed.
ANSWER_CTRL_C = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


def stop_server(proc: subprocess.Popen | ForkedServer) -> None:
    """Ctrl-C first, so the app closes and its atexit cleanup of saved traces runs (it exits within a second:
    tests/test_app_shutdown.py); then harder."""
    for send in (lambda: proc.send_signal(signal.SIGINT), proc.terminate, proc.kill):
        if proc.poll() is not None:
            return
        send()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            continue


def _wait_until_serving(proc: subprocess.Popen | ForkedServer, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"The app exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)  # a forked server answers within seconds, so a whole second's poll was a good part of it
    raise RuntimeError(f"The app did not answer within {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


# A small random SAE for the bundled model, for the Features tab's tests (no bundled SAE needed): a topk SAE on
# SmolLM2's layer-3 residual stream, so a feature scan runs 4 of its 30 layers.
TEST_SAE_HOOK = "blocks.3.hook_resid_post"
TEST_SAE_NAME = "test_resid_post_l3"
TEST_SAE_FEATURES = 64


def write_test_sae(root: Path, name: str = TEST_SAE_NAME, seed: int = 0) -> Path:
    """Save the test SAE as a SAELens folder `root/name` (the app lists it when root is in $SLMVIZ_SAE_DIRS)."""
    from slmviz import SAE

    sae = SAE.random(576, TEST_SAE_FEATURES, seed=seed, scale=1.0, architecture="topk", k=8, hook_name=TEST_SAE_HOOK)
    return sae.save(root / name)


# What a test's page draws while nothing changes, kept to what a person would see:
# - No CSS animations or transitions: Gradio's spinners and pulsing progress bars run while a job does, and
#   Chromium repaints them for every second a test waits on the server.
# - Gradio's status tracker counts a job's elapsed time in a requestAnimationFrame loop, and one such loop keeps
#   running once the page has loaded, with no job pending (gradio 6.31, in any app, even one of a single Markdown:
#   an idle page asks for 60 frames a second, forever). The tracker's frames come once a second instead: an elapsed
#   time then moves by whole seconds, and an idle page draws nothing (bench/results/notes.md, "Idle servers and
#   pages"). The wrapper is in place before Gradio's modules run (an init script), which read
#   window.requestAnimationFrame once; the app itself cannot do the same, since its own scripts run after them.
STILL_PAGE_JS = """
document.addEventListener('DOMContentLoaded', () => {
  const style = document.createElement('style');
  style.textContent = '*, *::before, *::after { animation: none !important; transition: none !important; }';
  document.head.appendChild(style);
});
(() => {
  const frame = window.requestAnimationFrame.bind(window);
  window.requestAnimationFrame = (callback) => {
    const timer = String(callback).includes('performance.now()') && (new Error().stack || '').includes('statustracker');
    return timer ? window.setTimeout(() => callback(performance.now()), 1000) : frame(callback);
  };
})();
"""


WAIT_POLL_MS = 100  # how often a test page's wait_for_function checks its condition


def quiet_context(browser, **kwargs):
    """A new browser context whose pages run STILL_PAGE_JS, and whose `page.wait_for_function` checks its condition
    every WAIT_POLL_MS unless a call says otherwise: Playwright's default checks it at every animation frame, and a
    page asked for frames draws them, 60 a second for as long as a test waits on the server (bench/results/notes.md,
    "Idle servers and pages"). Every test page comes from here."""
    context = browser.new_context(**kwargs)
    context.add_init_script(STILL_PAGE_JS)
    new_page = context.new_page

    def new_quiet_page():
        page = new_page()
        page.wait_for_function = functools.partial(page.wait_for_function, polling=WAIT_POLL_MS)
        return page

    context.new_page = new_quiet_page
    return context


@contextmanager
def recording_page(browser, url: str, height: int = 1000) -> Iterator:
    """A Playwright page on the app at `url` that records the host of every request and websocket it opens
    (`page.hosts`: the browser tests check that none leaves the server), once the prompt box is there."""
    context = quiet_context(browser, viewport={"width": 1400, "height": height}, reduced_motion="reduce")
    page = context.new_page()
    page.hosts = set()
    page.on("request", lambda r: page.hosts.add(origin(r.url)))
    page.on("websocket", lambda ws: page.hosts.add(origin(ws.url)))
    try:
        page.goto(url)
        page.wait_for_selector("#prompt textarea")
        yield page
    finally:
        context.close()


SMOLLM2_FULL_SET = "full set: 30 per-layer transcoders"  # app/transcoder_sets.py's label for SmolLM2's prepared set


def tick_one_bundled_transcoder(page, name: str = "transcoder_l6") -> None:
    """Leave only the bundled transcoder `name` ticked in the Graph tab (one transcoder: half the targets, half
    the time). The tab ticks the two bundled transcoders by default, or the full set alone once it is prepared in
    this cache (`make transcoders`), so a test that assumed either would fail on the other machine."""
    full = page.get_by_label(SMOLLM2_FULL_SET)
    if full.count() and full.is_checked():
        full.uncheck()
    # `input:checked` is live: unchecking its first match renumbers the rest, so take the first one each time
    # (iterating `.all()` waits forever for an nth match that no longer exists).
    checked = page.locator("#circuit-attr-transcoders input:checked")
    while checked.count():
        checked.first.uncheck()
    page.get_by_label(name).check()
    assert page.locator("#circuit-attr-transcoders input:checked").count() == 1


def origin(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc if parts.scheme in ("http", "https", "ws", "wss") else parts.scheme
