"""app.shared.busy_while in headless Chromium, on a page of its own (no model): Run is disabled while its job runs,
and enabled again once the job ends, whether it finished or was cancelled. The Patch, Circuits and Train buttons use
it; tests/test_circuits_browser.py checks the Circuits tab's Run in the app itself.

What broke before: the page runs one trigger's listeners in the order they were bound, each to its end, so the
disabling listener bound after the job's ran only when the job had ended, and raced the one that enables it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import gradio as gr
import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, free_port, quiet_context
from playwright.sync_api import expect

from app.shared import busy_while

pytestmark = pytest.mark.browser

if not CHROMIUM.exists():
    pytest.skip(NO_CHROMIUM, allow_module_level=True)

# The job runs until the test ends it, so the button is looked at while it surely runs, however busy the machine.
END = threading.Event()


def job() -> Iterator[str]:
    yield "running"
    END.wait(timeout=120)
    END.clear()
    yield "done"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A page with Run, Cancel and a status line, served from this process."""
    with gr.Blocks(analytics_enabled=False) as demo:
        run = gr.Button("Run", elem_id="busy-run")
        cancel = gr.Button("Cancel", elem_id="busy-cancel")
        status = gr.Textbox(elem_id="busy-status")
        ran = busy_while(run, cancel, lambda: run.click(job, None, status, api_name="job"))
        cancel.click(lambda: "cancelled", None, status, cancels=[ran], queue=False)
    demo.queue()
    port = free_port()
    demo.launch(server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        END.set()  # a cancelled job's thread still waits
        demo.close()


@pytest.fixture()
def page(browser, server):
    context = quiet_context(browser)
    pg = context.new_page()
    pg.goto(server)
    pg.wait_for_selector("#busy-run")
    yield pg
    context.close()


def _status(page, text: str) -> None:
    page.wait_for_function(f"document.querySelector('#busy-status textarea').value === '{text}'", timeout=60_000)


def test_run_is_disabled_while_its_job_runs_and_enabled_after(page):
    run = page.locator("#busy-run")
    for _ in range(2):  # a second run: the button came back for good, not for a moment
        run.click()
        _status(page, "running")
        assert run.is_disabled()  # the job runs until END is set
        END.set()
        _status(page, "done")
        expect(run).to_be_enabled(timeout=30_000)
        page.wait_for_timeout(500)  # a late request that disables it again would land here
        expect(run).to_be_enabled(timeout=30_000)


def test_cancel_enables_run_again(page):
    run = page.locator("#busy-run")
    run.click()
    _status(page, "running")
    assert run.is_disabled()
    page.click("#busy-cancel")
    _status(page, "cancelled")
    expect(run).to_be_enabled(timeout=30_000)
    page.wait_for_timeout(500)
    expect(run).to_be_enabled(timeout=30_000)
    END.set()  # the cancelled job's thread still waits
