"""The quick-set build's progress as a visitor meets it (issue 52, item 1), on a tiny random llama whose recipe comes
from $SLMVIZ_SET_RECIPE: one bar for the whole build that never runs backwards, names its phase (training, then the
scan) and says the time left from the measured rate, in the status line beside the buttons (no overlay over the
picker); Build disabled and Cancel enabled while it runs. One server for the module; the screenshot of the bar goes
to $SLMVIZ_SCREENSHOTS/build-progress.png (assets/ for the repository's; looked at by hand).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, app_server
from conftest import build_tiny_model
from gradio_client import Client

pytestmark = pytest.mark.app

# The screenshots, looked at by hand: into the temporary folder, or assets/ with SLMVIZ_SCREENSHOTS=assets (how the
# repository's were made), so a test run leaves the checkout as it was
ASSETS = Path(os.environ.get("SLMVIZ_SCREENSHOTS") or tempfile.gettempdir()).resolve()
CORPUS = [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]
# 2 layers x 16,000 tokens in 128-token steps: a few hundred reports over tens of seconds on a loaded 2-core machine
RECIPE = dict(d_sae=48, k=4, tokens=16_000, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512,
              dtype="float32", checkpoint_every=0, corpus=CORPUS)
PERCENT = re.compile(r"\*\*([\d.]+)%\*\*")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("polish-build") / "tiny", "llama_gqa", seed=5)


@pytest.fixture(scope="module")
def server(tiny_folder, tmp_path_factory):
    env = {"SLMVIZ_CACHE": str(tmp_path_factory.mktemp("cache")), "SLMVIZ_SET_RECIPE": json.dumps(RECIPE)}
    with app_server(env=env, model=str(tiny_folder), allow_local_models=True) as url:
        yield url


def test_the_quick_builds_progress_never_decreases_and_names_its_phases(server):
    """Through gradio_client: the quick set's build (the browser test watches the full set's, the same
    TranscoderSets._build, on this server: the full set's panel shows whether or not a quick set is there)."""
    client = Client(server, verbose=False)
    job = client.submit(api_name="/graph_build_quick")
    while not job.done():
        time.sleep(0.1)
    outputs = job.outputs()
    names, status, *_ = outputs[-1]
    assert names["value"] == ["quick set: 2 per-layer transcoders"] and "Built" in status, status
    lines = [str(out[1]) for out in outputs if PERCENT.search(str(out[1]))]
    values = [float(PERCENT.search(line)[1]) for line in lines]
    assert len(values) >= 3 and values == sorted(values), values  # one bar, never backwards
    assert any(" · training " in line and " tok · EV " in line for line in lines), lines
    # the scan phase's name is pinned in the library (test_prepared_sets reads every update): the page samples the
    # job every poll, and a tiny set's scan can start and end between two samples
    assert any(re.search(r" · (\d+m )?\d+s left$", line) for line in lines), lines  # the time left, measured


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_in_chromium_the_bar_is_in_the_status_line_and_build_is_disabled(page):
    page.get_by_role("tab", name="Graph").click()
    page.wait_for_selector("#graph-build-full", timeout=120_000)
    page.click("#graph-build-full")
    page.wait_for_selector("#graph-full-status :text('left')", timeout=120_000)
    build, cancel = page.locator("#graph-build-full"), page.locator("#graph-build-full-cancel")
    assert build.is_disabled() and cancel.is_enabled()  # Build off while its job runs, Cancel on
    status = page.inner_text("#graph-full-status")
    assert re.search(r"Building: [█░]+ [\d.]+% · ", status), status
    picker = page.locator("#circuit-attr-transcoders").bounding_box()
    bar = page.locator("#graph-full-status").bounding_box()
    assert bar["y"] >= picker["y"] + picker["height"]  # the bar is a line of its own under the picker, not over it
    top = max(0, picker["y"] - 10)
    clip = {"x": 0, "y": top, "width": page.viewport_size["width"], "height": bar["y"] + bar["height"] + 70 - top}
    page.screenshot(path=str(ASSETS / "build-progress.png"), clip=clip)
    page.wait_for_selector("#graph-full-status :text('Built')", timeout=300_000)
