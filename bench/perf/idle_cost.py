"""What the app costs while nothing happens: an idle server, and an idle page of it in headless Chromium.

    .venv/bin/python bench/perf/idle_cost.py          # prints CPU-seconds per IDLE_S of idle (bench/results/notes.md)

- the server: a Gradio app's process, its CPU over IDLE_S with no request, its queue polling as Gradio sets it and
  as the app sets it (app/main.py, poll_queue_less; idle, the queue's poll is what a server spends);
- the page: the app's page after a Run, its Chromium processes' CPU over IDLE_S, as a person's browser runs it
  and with the test pages' throttle of Gradio's frame loop (tests/app_helpers.py, STILL_PAGE_JS).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]
IDLE_S = 20.0


def process_cpu(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def chromium_cpu() -> float:
    import psutil

    total = 0.0
    for p in psutil.process_iter(["cmdline", "cpu_times"]):
        if "chromium" in " ".join(p.info["cmdline"] or []):
            total += p.info["cpu_times"].user + p.info["cpu_times"].system
    return total


SERVER = """
import sys, time
import gradio as gr
from app.main import poll_queue_less
with gr.Blocks() as demo:
    gr.Markdown("idle")
demo.queue()
if sys.argv[1] == "app":
    poll_queue_less(demo)
demo.launch(server_port=int(sys.argv[2]), prevent_thread_lock=True, quiet=True)
print("serving", flush=True)
time.sleep(3600)
"""


def idle_server(poll: str) -> float:
    """An idle Gradio server's CPU over IDLE_S (`poll`: "gradio" or "app")."""
    from app_helpers import free_port

    proc = subprocess.Popen([sys.executable, "-c", SERVER, poll, str(free_port())], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        proc.stdout.readline()  # "serving"
        time.sleep(3)
        return idle(process_cpu, proc.pid)
    finally:
        proc.kill()
        proc.wait()


def idle(measure, *args) -> float:
    before = measure(*args)
    time.sleep(IDLE_S)
    return measure(*args) - before


def main() -> None:
    from app_helpers import CHROMIUM, CHROMIUM_ARGS, STILL_PAGE_JS, app_server
    from playwright.sync_api import sync_playwright

    for poll, name in (("gradio", "Gradio's own queue poll"), ("app", "the app's (poll_queue_less)")):
        print(f"idle server, {name}: {idle_server(poll):.2f} CPU-s in {IDLE_S:.0f} s")
    with app_server() as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        for name, script in (("as a browser runs it", None), ("with the test pages' throttle", STILL_PAGE_JS)):
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            if script:
                context.add_init_script(script)
            page = context.new_page()
            page.goto(url)
            page.click("#run")
            page.wait_for_selector("#attention-plot .js-plotly-plot")
            time.sleep(3)
            print(f"idle page after a Run, {name}: {idle(chromium_cpu):.2f} Chromium CPU-s in {IDLE_S:.0f} s")
            context.close()
        browser.close()


if __name__ == "__main__":  # the test servers fork from a forkserver, which imports this module again
    main()
