"""The Circuits tab's full transcoder set (app/transcoder_sets.py) over HTTP and in headless Chromium, on a tiny random
llama: with no set prepared the tab offers to build one; the build reports its progress, Cancel stops it mid-way
(its checkpoint kept, the worker free for the next request) and Build again resumes it to the finished set; the set
is then one choice of the picker, refused beside a single transcoder, and its graph is the library's with its
scores in the status line; a feature node's card is its layer's coder.

The server trains a tiny set from $SLMVIZ_SET_RECIPE (the tiny model has no recipe of its own) into a temporary
$SLMVIZ_CACHE. Does not cover: a real model's set (hundreds of MB, an hour of training: bench/ and
docs/features.md), nor the training's numbers (tests/test_train_set.py).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

import pytest
from app_helpers import CHROMIUM, NO_CHROMIUM, app_server
from conftest import build_tiny_model
from gradio_client import Client
from gradio_client.exceptions import AppError
from playwright.sync_api import expect

import slmviz
from app.tabs.graph_attribution import feature_table
from app.transcoder_sets import MAX_FEATURE_NODES
from slmviz import SAE
from slmviz.features.prepared_scans import load_set_scan
from slmviz.formats.checkpoint import read_checkpoint
from slmviz.formats.slmviz import SET_FILE
from slmviz.loading.bundled import cache_dir
from slmviz.model_api import load_folder
from slmviz.replacement.load import load_transcoders

PICKER_TIMEOUT_MS = 60_000  # the page load's refresh of the transcoder picker, on a busy CI machine

pytestmark = pytest.mark.app

CORPUS = [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]
# 2 layers x 12,000 tokens in 128-token steps: ~190 progress reports over ~15-20 s on this loaded 2-core machine,
# long enough to be cancelled after its first ones.
RECIPE = dict(d_sae=48, k=4, tokens=12_000, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512,
              dtype="float32", checkpoint_every=0, corpus=CORPUS)
LABEL = "full set: 2 per-layer transcoders"
PROMPT = "w3 w5 w7 w9"
SCREENSHOT = Path(tempfile.gettempdir()) / "slmviz-full-set.png"  # looked at by hand, not kept in the repo


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("sets-app") / "tiny", "llama_gqa", seed=3)


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_folder(tiny_folder)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def server(tiny_folder, tiny, cache):
    """The app on the tiny model, one single transcoder (layer 0) in $SLMVIZ_SAE_DIRS and no set prepared yet."""
    root = tiny_folder.parent / "transcoders"
    SAE.random(tiny.cfg.d_model, 32, seed=0, architecture="relu", hook_name="blocks.0.mlp.hook_in",
               hook_name_out="blocks.0.hook_mlp_out").save(root / "tc_l0")
    env = {"SLMVIZ_SAE_DIRS": str(root), "SLMVIZ_CACHE": str(cache), "SLMVIZ_SET_RECIPE": json.dumps(RECIPE)}
    with app_server(env=env, model=str(tiny_folder), allow_local_models=True) as url:
        yield url


@pytest.fixture(scope="module")
def monkeypatch_module(cache):
    """$SLMVIZ_CACHE in this process too: the library reads the set the server prepared."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLMVIZ_CACHE", str(cache))
        yield mp


def set_folder(cache):
    return cache / "transcoders" / "tiny" / "plt"


@pytest.fixture(scope="module")
def built(server, cache, tiny, monkeypatch_module):
    """The set, built through the Build button's endpoint (at once when an earlier test built it)."""
    names, status, *_ = Client(server, verbose=False).predict(api_name="/circuit_set_build")
    assert (set_folder(cache) / SET_FILE).is_file() and names["value"] == [LABEL]
    scanned, docs = load_set_scan(tiny, "plt")  # the feature scan, prepared with the set
    assert docs == CORPUS and len(scanned.hooks) == 2
    return names, status


def test_a_build_reports_progress_cancel_keeps_its_checkpoint_and_build_again_resumes(server, cache):
    alice = Client(server, verbose=False)
    with pytest.raises(AppError, match=f"tiny has no {LABEL} yet: press 'Build the full transcoder set'"):
        alice.predict(PROMPT, [LABEL], 0.95, 0.98, api_name="/circuit_attribution")
    job = alice.submit(api_name="/circuit_set_build")
    while not any("training " in str(out[1]) for out in job.outputs()):  # its first steps are done
        assert not job.done(), job.exception()
        time.sleep(0.1)
    said = next(str(out[1]) for out in job.outputs() if "training " in str(out[1]))
    # one bar for the whole build (slmviz.progress): its phase, tokens trained over the layers, their EV, time left
    done, total = (int(x.replace(",", "")) for x in re.search(r"training ([\d,]+) / ([\d,]+) tok", said).groups())
    assert 0 <= done < total == RECIPE["tokens"] * 2 and "EV " in said and "%" in said
    # another session's Run is served beside the build (which runs in the worker, not in a queue Run waits in)
    tokens, *_ = Client(server, verbose=False).predict(PROMPT, False, 1, "all", ["pre", "mid", "post"], False, False,
                                                        True, api_name="/run")
    assert "w5" in tokens and not job.done()
    assert "checkpoint is kept" in alice.predict(api_name="/circuit_set_cancel")
    job.cancel()
    # the worker is free again: the next long job (a graph over the single transcoder) is served
    _, _, _, status = alice.predict(PROMPT, ["tc_l0"], 0.95, 0.98, api_name="/circuit_attribution")
    assert "computed in" in status and "Replacement score" in status  # single transcoders show their scores too
    while not job.done():
        time.sleep(0.1)
    assert not (set_folder(cache) / SET_FILE).exists()  # stopped mid-way: no set, a checkpoint
    coders = read_checkpoint(set_folder(cache)).coders
    kept = sum(coder["cursor"]["tokens"] for coder in coders.values()) // len(coders)
    assert kept > 0  # what Build resumes from
    # Build again: resumed from the checkpoint (its first report is past it) to the finished set, now ticked alone
    again = alice.submit(api_name="/circuit_set_build")
    names, status, *_ = again.result()
    # The status says where it resumed (the rest can finish between two of the client's polls on an idle machine,
    # so no "trained" report need be seen); test_train_set pins resume == uninterrupted.
    assert f"resumed from its checkpoint at {kept:,} tokens per layer" in status
    assert names["value"] == [LABEL] and [LABEL, LABEL] in names["choices"] and "Built" in status
    assert (set_folder(cache) / SET_FILE).is_file()


def card_reads_the_prepared_scan(client: Client, table: dict, set_name: str) -> None:
    """The feature table's first node opens its page: the card of that layer's coder in the set (`{set_name}/layer_L`),
    its top contexts from the scan prepared with the set (over the set's own corpus), so no scan runs first."""
    layer, feature, position = table["data"][0][:3]
    opening = client.submit(f"{layer}_{feature}_{position}", api_name="/circuit_feature")
    card, node = opening.result()
    assert node == f"{layer}_{feature}" and f"{set_name}/layer_{layer}" in card
    assert "Top activating contexts" in card and f"of {len(CORPUS)} documents" in card
    assert not any("verses of the bundled corpus" in str(out[0]) for out in opening.outputs())
    # the Graph tab's node card names the text its contexts come from: the set's own corpus
    node_card, _ = client.predict(f"{layer}_{feature}_{position}", 1.0, 1.0, api_name="/workbench_card")
    assert f"from the scan prepared with it: {len(CORPUS)} documents of its own corpus" in node_card


def test_the_set_is_one_choice_and_its_graph_shows_its_scores(server, built, tiny, cache):
    client = Client(server, verbose=False)
    with pytest.raises(AppError, match="already has a transcoder at every layer"):
        client.predict(PROMPT, [LABEL, "tc_l0"], 0.95, 0.98, api_name="/circuit_attribution")
    # nothing pruned (thresholds 1): the random tiny model's features carry little of the influence
    plot, table, path, status = client.predict(PROMPT, [LABEL], 1.0, 1.0, api_name="/circuit_attribution")
    ts = load_transcoders(set_folder(cache), model=tiny)
    graph = slmviz.attribution_graph(PROMPT, transcoders=ts, model=tiny, progress=False,
                                     max_feature_nodes=MAX_FEATURE_NODES)
    scores = graph.scores()
    assert (f"Replacement score {scores['replacement']:.3f}, completeness {scores['completeness']:.3f}" in status
            and f"{graph.n_features} active features (at most {MAX_FEATURE_NODES:,}" in status and LABEL in status)
    names = {L: ts.coder_name(L) for L in ts.layers}
    expected = feature_table(graph.prune(1.0, 1.0), names)
    assert len(expected) > 0
    assert [row[:3] for row in table["data"]] == expected[["layer", "feature", "position"]].values.tolist()
    assert {row[5] for row in table["data"]} <= {"tiny-plt/layer_0", "tiny-plt/layer_1"}
    card_reads_the_prepared_scan(client, table, "tiny-plt")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_in_chromium_the_set_is_ticked_and_its_graph_shows_its_scores(built, page, server):
    page.get_by_role("tab", name="Graph").click()
    page.wait_for_selector("#graph-prompt textarea")
    page.fill("#graph-prompt textarea", PROMPT)
    # the page load's refresh ticks the set built since the server started: wait for it, as a person would
    expect(page.get_by_label(LABEL)).to_be_checked(timeout=PICKER_TIMEOUT_MS)
    expect(page.get_by_label("tc_l0")).not_to_be_checked()
    assert not page.locator("#graph-build-full").is_visible()  # the set is there: nothing to build
    page.click("#graph-build")
    page.wait_for_function("document.querySelector('#graph-status').innerText.includes('Pruned to')",
                           timeout=180_000)
    page.wait_for_selector("#graph-all-edges .js-plotly-plot .nsewdrag")
    status = page.locator("#graph-status").inner_text()
    assert re.search(r"Replacement score \d\.\d{3}, completeness \d\.\d{3}", status), status
    assert f"active features (at most {MAX_FEATURE_NODES:,}, the most influential" in status and LABEL in status
    page.mouse.move(5, 5)
    page.wait_for_timeout(500)
    page.locator("#graph-status").scroll_into_view_if_needed()
    page.screenshot(path=str(SCREENSHOT), full_page=True)
    errors = page.locator(".toast-body.error")
    assert errors.count() == 0, errors.first.inner_text()


CLT_LABEL = "cross-layer transcoder: 2 layers"


@pytest.fixture(scope="module")
def clt_server(tiny_folder, tiny, server, tmp_path_factory):
    """The app on the tiny model whose CLT `prepare --transcoders clt` has made (here in-process, into a cache of
    its own, with no per-layer set), and the CLT's folder. After `server`: its single transcoder's folder."""
    from slmviz.training.prepare import prepare_transcoders

    cache = tmp_path_factory.mktemp("clt-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLMVIZ_CACHE", str(cache))
        clt = prepare_transcoders(tiny, "clt", progress=False, **{**RECIPE, "tokens": 2_000})
        assert clt.kind == "clt" and load_set_scan(tiny, "clt") is not None
    env = {"SLMVIZ_SAE_DIRS": str(tiny_folder.parent / "transcoders"), "SLMVIZ_CACHE": str(cache)}
    with app_server(env=env, model=str(tiny_folder), allow_local_models=True) as url:
        yield url, cache / "transcoders" / "tiny" / "clt"


def test_a_prepared_clt_is_a_choice_its_graph_and_cards_the_libraries(clt_server, tiny):
    """The picker ticks the CLT (no per-layer set there) and refuses it beside a single transcoder; its graph is
    the library's over the CLT, and a feature node's card is its layer's feature_view (the CLT's encoder) with the
    scan prepared with the CLT, so no scan runs first."""
    url, folder = clt_server
    client = Client(url, verbose=False)
    picker = next(c["props"] for c in client.config["components"]
                  if c.get("props", {}).get("elem_id") == "graph-transcoders")
    assert picker["value"] == [CLT_LABEL] and [CLT_LABEL, CLT_LABEL] in picker["choices"], picker
    with pytest.raises(AppError, match="already has a transcoder at every layer"):
        client.predict(PROMPT, [CLT_LABEL, "tc_l0"], 1.0, 1.0, api_name="/circuit_attribution")
    plot, table, path, status = client.predict(PROMPT, [CLT_LABEL], 1.0, 1.0, api_name="/circuit_attribution")
    graph = slmviz.attribution_graph(PROMPT, transcoders=load_transcoders(folder, model=tiny), model=tiny,
                                     progress=False, max_feature_nodes=MAX_FEATURE_NODES)
    scores = graph.scores()
    assert (f"Replacement score {scores['replacement']:.3f}, completeness {scores['completeness']:.3f}" in status
            and f"{graph.n_features} active features" in status and CLT_LABEL in status)
    assert table["data"] and {row[5] for row in table["data"]} <= {"tiny-clt/layer_0", "tiny-clt/layer_1"}
    card_reads_the_prepared_scan(client, table, "tiny-clt")


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason=NO_CHROMIUM)
def test_in_chromium_the_clt_is_ticked_and_its_graph_shows_its_scores(clt_server, browser):
    from app_helpers import recording_page

    with recording_page(browser, clt_server[0]) as page:
        page.get_by_role("tab", name="Graph").click()
        page.wait_for_selector("#graph-prompt textarea")
        page.fill("#graph-prompt textarea", PROMPT)
        expect(page.get_by_label(CLT_LABEL)).to_be_checked(timeout=PICKER_TIMEOUT_MS)
        expect(page.get_by_label("tc_l0")).not_to_be_checked()
        page.click("#graph-build")
        page.wait_for_function("document.querySelector('#graph-status').innerText.includes('Pruned to')",
                               timeout=180_000)
        status = page.locator("#graph-status").inner_text()
        assert re.search(r"Replacement score \d\.\d{3}, completeness \d\.\d{3}", status) and CLT_LABEL in status
        errors = page.locator(".toast-body.error")
        assert errors.count() == 0, errors.first.inner_text()


SMOL = "SmolLM2-135M-Instruct"
SMOL_FOLDER = cache_dir() / SMOL  # the prepared bundled model, found before any test moves $SLMVIZ_CACHE
PROSE = ["The train to the coast leaves at nine, so we should pack tonight.", "Can you help me write an email to "
         "my landlord about the broken heater?", "Scientists said on Tuesday that the river had reached its highest "
         "level in forty years.", "Sure! Here is a short poem about autumn leaves.", "The meeting was moved to "
         "Thursday afternoon because the manager was travelling.", "What is the capital of Australia?"]


def test_a_bundled_saes_card_reads_the_scan_prepared_with_the_set(tmp_path):
    """prepare_transcoders also prepares the bundled SAEs' scans over the set's corpus (here: six modern sentences,
    into a temporary cache that links the bundled model); the Features tab's card of transcoder_l6 reads it at once
    (its documents are those six), never scanning King James verses first."""
    from slmviz.features.load import load_sae
    from slmviz.features.prepared_scans import prepare_sae_scans

    (tmp_path / SMOL).symlink_to(SMOL_FOLDER)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLMVIZ_CACHE", str(tmp_path))
        smol = slmviz.load(SMOL)
        prepare_sae_scans(smol, {"transcoder_l6": load_sae("transcoder_l6", model=smol)}, corpus=PROSE,
                          progress=False)
    with app_server(env={"SLMVIZ_CACHE": str(tmp_path)}) as url:
        client = Client(url, verbose=False)
        showing = client.submit("transcoder_l6", 3, api_name="/feature_show")
        _, card = showing.result()
        assert f"of {len(PROSE)} documents" in card and "Top activating contexts" in card
        assert not any("verses of the bundled corpus" in str(out[1]) for out in showing.outputs())
