"""The Corpus tab's scan over HTTP (gradio_client against a real server): it runs as a background job that
holds up no one else's requests, it can be cancelled, and a cancelled scan is not cached.

Does not cover: the page (tests/test_corpus_browser.py), the job rules in detail (tests/test_scan_jobs.py).
"""

from __future__ import annotations

import time

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, app_server, quiet_context
from gradio_client import Client
from gradio_client.exceptions import AppError

pytestmark = pytest.mark.app

STAGES = ["pre", "mid", "post"]


@pytest.fixture(scope="module")
def scan_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("scans")


@pytest.fixture(scope="module")
def server(scan_cache):
    # 3000 verses: a first scan of over a minute, long enough to overlap with other requests and cancel
    with app_server(env={"SLMVIZ_SCAN_CACHE": str(scan_cache), "SLMVIZ_CORPUS_DOCS": "3000"}) as url:
        yield url


def test_a_running_scan_holds_up_no_other_request_and_cancel_stops_it(server, scan_cache):
    alice, bob = Client(server, verbose=False), Client(server, verbose=False)
    scanning = alice.submit("blocks.7.mlp.hook_post", api_name="/corpus_load")
    time.sleep(3)  # the job has started scanning
    assert not scanning.done()

    tokens, *_ = bob.predict("The capital of France is", False, 1, "all", STAGES, False, False, True, api_name="/run")
    assert "France" in tokens and not scanning.done()  # bob's run finished while alice's scan still ran

    assert "Cancelled" in alice.predict(api_name="/corpus_cancel")
    deadline = time.monotonic() + 60
    while not scanning.done() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert scanning.done(), scanning.status()
    with pytest.raises(AppError, match="not loaded yet"):
        bob.predict("blocks.7.mlp.hook_post", 0, api_name="/corpus_show")
    time.sleep(2)  # the job stops at its next progress report: nothing half-scanned is cached
    assert not [p for p in scan_cache.iterdir() if (p / "scan.safetensors").is_file()]



@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_cancel_in_the_page_stops_the_first_scan_and_says_so(browser, server, scan_cache):
    """As a visitor meets it: opening the tab starts the scan with a progress bar; Cancel ends the wait with a
    message (no error toast); the page keeps working; nothing half-scanned is cached."""
    context = quiet_context(browser, viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.goto(server)
    page.wait_for_selector("#prompt textarea")
    page.get_by_role("tab", name="Corpus").click()
    page.wait_for_function("document.body.innerText.includes('Scanning 3000 verses')", timeout=120_000)
    page.click("#corpus-cancel")
    page.wait_for_function("document.querySelector('#corpus-status').innerText.includes('Cancelled')",
                           timeout=30_000)
    page.wait_for_function("!document.body.innerText.includes('Scanning 3000 verses')", timeout=30_000)
    assert page.locator(".toast-body.error").count() == 0
    page.click("#run")  # the page still serves
    page.wait_for_selector("#tokens .token, #tokens span", timeout=120_000)
    time.sleep(2)
    assert not [p for p in scan_cache.iterdir() if (p / "scan.safetensors").is_file()]
    context.close()
