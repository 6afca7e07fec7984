"""The app's background deep scan (app/transcoder_sets.py), through TranscoderSets itself, no server: a loaded set
starts its deep scan in a thread of its own, its cards read the small scan until it is done and the deep one after,
its labels come with it; Cancel stops it (it resumes); no start for a set trained on a list of texts, nor with
$SLMVIZ_DEEP_SCAN=0. A tiny random LLaMA's set in a temporary cache."""

from __future__ import annotations

import threading

import pytest
from conftest import build_tiny_model

import slmviz
from app import transcoder_sets as sets_module
from app.saes import SAEStore
from app.transcoder_sets import TranscoderSets
from slmviz.features import deep_scan as ds
from slmviz.features import prepared_scans as ps
from slmviz.training.prepare import prepare_transcoders

CORPUS = [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(40)]
TINY = dict(d_sae=32, k=4, tokens=1500, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512,
            dtype="float32", checkpoint_every=0)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A tiny model and its prepared "plt" set (trained on a list of texts: recorded as "custom")."""
    cache = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("SLMVIZ_CACHE", str(cache))
    m = slmviz.load(build_tiny_model(tmp_path_factory.mktemp("deepapp") / "tiny", "llama_gqa", seed=1))
    prepare_transcoders(m, "plt", progress=False, corpus=CORPUS, **TINY)
    yield m
    mp.undo()


@pytest.fixture
def cards(prepared, monkeypatch):
    """What each layer's card is served, in order: [(coder's name, Scan)]."""
    served = []
    real = sets_module.provide_feature_scan

    def provide(model, entry, found, rebuilt=False):
        served.append((entry.name, found[0]))
        real(model, entry, found, rebuilt)

    monkeypatch.setattr(sets_module, "provide_feature_scan", provide)
    monkeypatch.setattr(ds, "DEEP_SHARD_DOCS", 8)
    return served


def test_a_set_trained_on_a_list_of_texts_or_a_server_without_deep_scans_starts_none(prepared, cards, monkeypatch):
    sets = TranscoderSets(ctx=None, saes=SAEStore())
    sets.load(prepared, "plt")
    assert sets.deep_scan(prepared, "plt") is None and "small scan" in sets.deep_scan_status(prepared, "plt")
    assert cards and all(not s.info.get("deep") for _, s in cards)
    monkeypatch.setattr(sets_module, "set_corpus", lambda model, kind: CORPUS)
    monkeypatch.setenv("SLMVIZ_DEEP_SCAN", "0")
    off = TranscoderSets(ctx=None, saes=SAEStore())
    off.load(prepared, "plt")
    assert off.deep_scan(prepared, "plt") is None


def test_a_loaded_set_scans_deep_in_the_background_then_its_cards_read_it(prepared, cards, monkeypatch, tmp_path):
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))  # a cache of its own: the set, no deep scan yet
    prepare_transcoders(prepared, "plt", progress=False, corpus=CORPUS, **TINY)
    monkeypatch.setattr(sets_module, "set_corpus", lambda model, kind: CORPUS)  # as a named corpus would
    sets = TranscoderSets(ctx=None, saes=SAEStore())
    ts, names = sets.load(prepared, "plt")
    job = sets.deep_scan(prepared, "plt")
    assert job is not None and job.wait(600) and job.error is None, job.status()
    assert sets.start_deep_scan(prepared, "plt") is job  # done: not started again
    first = {name: s for name, s in cards[:len(names)]}
    last = {name: s for name, s in cards[len(names):]}
    assert all(not s.info.get("deep") for s in first.values())  # at load: the small scan
    assert set(last) == set(first) and all(s.info.get("deep") for s in last.values())  # once done: the deep one
    labels = sets.deep_labels(prepared, "plt")
    assert labels is not None and len(labels.frame) and labels.info["tokens"] == job.result[0].n_tokens
    assert "done" in sets.deep_scan_status(prepared, "plt")


def test_cancel_stops_the_background_deep_scan_and_a_new_start_resumes_it(prepared, cards, monkeypatch, tmp_path):
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    prepare_transcoders(prepared, "plt", progress=False, corpus=CORPUS, **TINY)
    monkeypatch.setattr(sets_module, "set_corpus", lambda model, kind: CORPUS)
    running, go_on = threading.Event(), threading.Event()

    class Held(ps.BackgroundDeepScan):  # holds at its first report in the second shard, until the test goes on
        def _sink(self, update):
            if update.phase == "scan" and "shard 2" in update.detail and not go_on.is_set():
                running.set()
                go_on.wait(60)
            super()._sink(update)

    monkeypatch.setattr(sets_module, "BackgroundDeepScan", Held)
    sets = TranscoderSets(ctx=None, saes=SAEStore())
    sets.load(prepared, "plt")
    assert running.wait(600)
    assert "Deep scan" in sets.deep_scan_status(prepared, "plt")
    assert "Cancelling" in sets.cancel_deep_scan(prepared, "plt")
    go_on.set()
    job = sets.deep_scan(prepared, "plt")
    assert job.wait(600) and job.cancelled and "cancelled" in sets.deep_scan_status(prepared, "plt")
    again = sets.start_deep_scan(prepared, "plt")
    assert again is not job and again.wait(600) and again.result is not None
