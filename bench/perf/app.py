"""The app, timed from the outside: `python -m slmviz.cli app` until its port answers, then Run → every plot of a
32-token prompt through gradio_client (/run, then the /logit_lens it chains). Skipped when app/ is absent.

The default model must already be prepared (`make model`), so startup measures loading, not dequantizing.

    .venv/bin/python bench/perf/app.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: common.py, which puts this checkout first
from common import REPO, TEXT, Row, main, median, spread

sys.path.insert(0, str(REPO / "tests"))
from app_helpers import free_port, stop_server  # the same start/stop helpers the app tests use

STARTUP_TARGET_S = 15.0
RUN_TARGET_S = 2.0
STARTUP_TIMEOUT_S = 120
PROMPT_TOKENS = 32
STAGES = ["pre", "mid", "post"]


def prompt_of(n_tokens: int) -> str:
    """The shortest word prefix of TEXT that the default tokenizer turns into exactly n_tokens tokens."""
    import slmviz

    tokenizer = slmviz.load().tokenizer
    words = TEXT.split()
    for end in range(1, len(words) + 1):
        text = " ".join(words[:end])
        n = len(tokenizer(text)["input_ids"])
        if n >= n_tokens:
            if n != n_tokens:
                print(f"  (closest prompt has {n} tokens)")
            return text
    raise ValueError("TEXT is too short")


def start_server(port: int, log) -> tuple[subprocess.Popen, float]:
    """Start the app; return the process and seconds until GET / answered 200."""
    env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "slmviz.cli", "app", "--port", str(port)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/"
    while time.perf_counter() - start < STARTUP_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - start
        except OSError:
            time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"the app did not answer within {STARTUP_TIMEOUT_S} s")


def run_all_plots(client, prompt: str) -> None:
    """What the Run button does: /run (tokens, attention, residual stream, next token), then /logit_lens."""
    client.predict(prompt, False, 1, "all", STAGES, False, False, True, api_name="/run")
    client.predict(api_name="/logit_lens")


def run(args: argparse.Namespace) -> list[Row]:
    if not (REPO / "app" / "main.py").exists():
        return [Row("app startup / Run", "not measured", "", None, "", None, "app/ does not exist yet")]
    from gradio_client import Client

    prompt = prompt_of(PROMPT_TOKENS)
    startups, runs = [], []
    with tempfile.NamedTemporaryFile(prefix="slmviz-bench-app-", suffix=".log") as log:
        for attempt in range(args.startups):
            port = free_port()
            proc, seconds = start_server(port, log)
            startups.append(seconds)
            try:
                if attempt == 0:
                    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
                    run_all_plots(client, prompt)  # warm-up: the first requests also set up the session
                    for _ in range(args.repeats):
                        t0 = time.perf_counter()
                        run_all_plots(client, prompt)
                        runs.append(time.perf_counter() - t0)
            finally:
                stop_server(proc)
    start_s, run_s = median(startups), median(runs)
    return [
        Row("`python -m slmviz.cli app` until the port answers (model prepared)", f"{start_s:.1f} s", "",
            start_s, f"≤ {STARTUP_TARGET_S:g} s", start_s <= STARTUP_TARGET_S,
            f"{len(startups)} cold starts, spread {spread(startups)}"),
        Row(f"app Run → all plots, {PROMPT_TOKENS}-token prompt (gradio_client: /run + /logit_lens)",
            f"{run_s:.2f} s", "", run_s, f"≤ {RUN_TARGET_S:g} s", run_s <= RUN_TARGET_S,
            f"spread {spread(runs)}"),
    ]


def _args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--startups", type=int, default=3, help="cold starts to time (median reported)")


if __name__ == "__main__":
    main(run, __doc__, _args)
