"""The Patch tab over HTTP (gradio_client against a real server): a sweep, a clicked cell, the per-head heatmap and
logit attribution, ablation, and readable errors. The numbers the app draws are checked against the library
run in this process.

A long sweep runs in the app's job worker (app/jobs.py): another session's Run, started while it runs, finishes
first (checked by order of completion, never by time).

Does not cover: the page itself (tests/test_patch_browser.py clicks through it) nor sweep speed
(bench/perf/patching.py).
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np
import pytest
from app_helpers import TEST_CORPUS_DOCS
from gradio_client import Client
from gradio_client.exceptions import AppError

import slmviz
from app.scans import corpus_docs
from app.shared import EXAMPLE_ANSWER, EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, EXAMPLE_WRONG
from app.tabs.patch import parse_pairs
from slmviz import plots
from slmviz.interventions.ablation import ablation

pytestmark = pytest.mark.app


@pytest.fixture()
def client(server):
    return Client(server, verbose=False)


def figure(plot: dict) -> dict:
    assert plot["type"] == "plotly"
    return json.loads(plot["plot"])


def array(value) -> np.ndarray:
    """A plotly JSON array: a list, or plotly 6's typed array {"dtype", "bdata" (base64), "shape"}."""
    if isinstance(value, dict) and "bdata" in value:
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        return flat.reshape([int(n) for n in str(value.get("shape", len(flat))).split(",")])
    return np.asarray(value, dtype=float)


def sweep(client, site="resid_pre", clean=EXAMPLE_CLEAN, corrupted=EXAMPLE_CORRUPTED, answer=EXAMPLE_ANSWER,
          wrong=EXAMPLE_WRONG, direction="denoise", method="exact"):
    return client.predict(clean, corrupted, answer, wrong, site, direction, method, api_name="/patch_sweep")


def test_the_patch_endpoints_are_named(client):
    names = set(client.view_api(print_info=False, return_format="dict")["named_endpoints"])
    assert {"/patch_sweep", "/patch_cell", "/patch_heads", "/patch_suggest", "/patch_ablate"} <= names


def test_the_answer_and_wrong_tokens_are_suggested_from_the_first_differing_token(client):
    assert tuple(client.predict(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, api_name="/patch_suggest")) == (" Mary", " John")


def test_a_sweep_draws_the_library_heatmap_and_a_clicked_cell_shows_its_patched_run(client, model):
    plot, status, answer, wrong = sweep(client)
    assert "Done in" in status and (answer, wrong) == (EXAMPLE_ANSWER, EXAMPLE_WRONG)
    fig = figure(plot)
    (heat,) = fig["data"]
    expected = slmviz.patch(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, answer=EXAMPLE_ANSWER, wrong=EXAMPLE_WRONG, model=model)
    assert len(heat["y"]) == model.cfg.n_layers and len(heat["x"]) == len(expected.tokens)
    assert fig["layout"]["coloraxis"]["cmid"] == 0
    np.testing.assert_allclose(array(heat["z"]), expected.normalized.numpy(), rtol=0, atol=1e-4)
    # resid_pre of the last position entering the last layer carries almost all of it: the patched run says " Mary"
    table, text = client.predict(f"{model.cfg.n_layers - 1}, {len(expected.tokens) - 1}, -1", api_name="/patch_cell")
    assert table["data"][0][1] == "␣Mary" and f"normalized {float(expected.normalized[-1, -1]):.2f}" in text


def test_the_per_head_heatmap_and_logit_attribution_follow_the_sweep(client, model):
    sweep(client)
    heads, dla, dla_heads = client.predict(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, EXAMPLE_ANSWER, EXAMPLE_WRONG, "denoise",
                                           api_name="/patch_heads")
    heat = figure(heads)["data"][0]
    assert len(heat["x"]) == model.cfg.n_heads and len(heat["y"]) == model.cfg.n_layers
    bars = figure(dla)
    total = sum(array(bar["y"]).sum() for bar in bars["data"])
    expected = model.trace(EXAMPLE_CLEAN).logit_attribution(EXAMPLE_ANSWER, EXAMPLE_WRONG).attrs["logit_diff"]
    assert total == pytest.approx(expected, rel=1e-4)
    assert "20 largest heads" in figure(dla_heads)["layout"]["title"]["text"]


def test_a_head_sweep_cell_and_an_attribution_sweep(client, model):
    plot, status, *_ = sweep(client, site="z", method="attribution")
    fig = figure(plot)
    assert len(fig["data"]) == model.cfg.n_heads and "estimate" in fig["layout"]["title"]["subtitle"]["text"]
    assert "r = " in status
    table, text = client.predict("20, 13, 4", api_name="/patch_cell")
    assert "head 4" in text and len(table["data"]) == 10


def test_ablation_changes_the_next_tokens_and_the_continuation(client):
    before, after, text_before, text_after, status = client.predict(
        EXAMPLE_CLEAN, "", "0.0, 0.1, 0.2, 0.3", "zero", api_name="/patch_ablate")
    assert "neuron 0.3" in status and before["data"] != after["data"]
    assert text_before and text_after
    with pytest.raises(AppError, match="not computed yet"):  # the Ablate button computes them first
        client.predict(EXAMPLE_CLEAN, "3.1", "", "mean", api_name="/patch_ablate")
    ready = client.predict("3.1", "", "mean", api_name="/patch_ablate_means")
    assert "blocks.3.attn.hook_z" in ready and f"over {TEST_CORPUS_DOCS} verses" in ready
    *_, status = client.predict(EXAMPLE_CLEAN, "3.1", "", "mean", api_name="/patch_ablate")
    assert "head 3.1" in status and f"means over {TEST_CORPUS_DOCS} verses of the bundled corpus" in status
    model = slmviz.load()
    corpus_mean = slmviz.scan(corpus_docs(TEST_CORPUS_DOCS), hooks=["blocks.3.attn.hook_z"], top_k=1, model=model,
                              progress=False)
    hooks = ablation(heads=[(3, 1)], kind="mean", reference=corpus_mean, model=model)
    expected = plots.next_token_table(model.trace(EXAMPLE_CLEAN, names=[], hooks=hooks), 10)
    after = client.predict(EXAMPLE_CLEAN, "3.1", "", "mean", api_name="/patch_ablate")[1]
    assert [row[1] for row in after["data"]] == list(expected.iloc[:, 1])  # the same next tokens as the library


def test_bad_input_is_a_readable_error_and_the_server_keeps_serving(client):
    with pytest.raises(AppError, match="same number of tokens"):
        sweep(client, corrupted="When Mary went to the store, Mary gave a drink to")
    with pytest.raises(AppError, match="is 2 tokens"):
        sweep(client, answer=" Mary Jane")
    with pytest.raises(AppError, match="Run a sweep first"):
        Client(client.src, verbose=False).predict("1, 2", api_name="/patch_cell")
    with pytest.raises(AppError, match="layer.index pairs"):
        client.predict(EXAMPLE_CLEAN, "three", "", "zero", api_name="/patch_ablate")
    assert tuple(client.predict(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, api_name="/patch_suggest")) == (" Mary", " John")


def test_pairs_parse_as_layer_dot_index():
    assert parse_pairs("3.1, 5:7  2.0", "heads") == [(3, 1), (5, 7), (2, 0)]
    assert parse_pairs("", "heads") == []
    with pytest.raises(ValueError, match="layer.index"):
        parse_pairs("3", "heads")


def test_a_running_sweep_can_be_cancelled_and_the_next_request_is_served(client):
    job = client.submit(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, EXAMPLE_ANSWER, EXAMPLE_WRONG, "pattern", "denoise", "exact",
                        api_name="/patch_sweep")
    while not job.outputs():  # the first partial heatmap: the sweep is running
        assert not job.done(), job.exception()
        time.sleep(0.2)
    job.cancel()
    start = time.monotonic()
    assert tuple(client.predict(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, api_name="/patch_suggest")) == (" Mary", " John")
    assert time.monotonic() - start < 60
    assert "Done in" not in job.outputs()[-1][1]


# Differs at the second token, so every later position of every layer and head is patched: a sweep of minutes,
# which the test cancels once it has seen what it needs.
LONG_CLEAN = "When Mary and John went to the market after a long day at work in the town, John gave a drink to"
LONG_CORRUPTED = "When Anna and John went to the market after a long day at work in the town, John gave a drink to"


def test_another_sessions_run_during_a_long_sweep_finishes_before_it(server):
    alice, bob = Client(server, verbose=False), Client(server, verbose=False)
    swept = alice.submit(LONG_CLEAN, LONG_CORRUPTED, " Mary", " Anna", "z", "denoise", "exact",
                         api_name="/patch_sweep")
    while not swept.outputs():  # the first partial heatmap: the sweep runs
        assert not swept.done(), swept.exception()
        time.sleep(0.2)
    tokens, *_ = bob.predict("The capital of France is", False, 1, "all", ["pre", "mid", "post"], False, False, True,
                             api_name="/run")
    assert "France" in tokens
    assert not swept.done()  # bob's Run was served beside the sweep, not queued behind it
    assert alice.predict(api_name="/patch_cancel") == "Cancelled."
    swept.cancel()
    while not swept.done():
        time.sleep(0.2)
    assert "Done in" not in swept.outputs()[-1][1]


def test_the_fast_switch_sweeps_on_a_bf16_copy_within_the_stated_tolerance_or_says_why_not(client, model):
    """"fast (bf16)" (app/fast_mode.py): where bf16 matmuls measure fast here, the sweep runs on a bf16 copy and
    its normalized heatmap stays within docs/performance.md's 0.05 of the fp32 one; elsewhere the switch is off
    and asking for it over the API is refused with the measured reason."""
    args = (EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, EXAMPLE_ANSWER, EXAMPLE_WRONG, "resid_pre", "denoise", "exact", True)
    try:
        plot, status, *_ = client.predict(*args, api_name="/patch_sweep")
    except AppError as e:  # the server measured bf16 slow on this CPU: refused, with the measured reason
        assert "slower than fp32" in str(e)
        return
    assert "exact, bf16)" in status
    expected = slmviz.patch(EXAMPLE_CLEAN, EXAMPLE_CORRUPTED, answer=EXAMPLE_ANSWER, wrong=EXAMPLE_WRONG, model=model)
    fast = array(figure(plot)["data"][0]["z"])
    assert np.abs(fast - expected.normalized.numpy()).max() <= 0.05
    assert not np.array_equal(fast, expected.normalized.numpy())  # it really ran in bf16
    plot, status, *_ = sweep(client)  # and the switch off is fp32 again
    assert "bf16" not in status


def test_the_corpus_tabs_fast_switch_scans_on_the_bf16_copy_and_caches_it_apart(client):
    hook = "blocks.7.mlp.hook_post"
    try:
        status, _, best, strips, _ = client.predict(hook, True, api_name="/corpus_reload")
    except AppError as e:  # the server measured bf16 slow on this CPU
        assert "slower than fp32" in str(e)
        return
    assert status.startswith(f"bf16 Scan of {TEST_CORPUS_DOCS} verses") and "data-rank" in strips
    status, strips, _ = client.predict(hook, best, True, api_name="/corpus_show")
    assert status.startswith("bf16 Scan")
    status, *_ = client.predict(hook, False, api_name="/corpus_reload")  # fp32: its own scan
    assert status.startswith(f"Scan of {TEST_CORPUS_DOCS} verses")
