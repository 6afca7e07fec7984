"""The deep scan of a prepared set (features.deep_scan, features.prepared_scans): its Scan is slmviz.scan's over the
same documents, its token table a brute-force count over a plain trace, it resumes where it stopped with the result
of an uninterrupted run, a damaged one is a ScanFormatError and is written again, and load_set_scan prefers it.
Tiny random models of two families."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz.features import deep_scan as ds
from slmviz.features import prepared_scans as ps
from slmviz.features.dashboard import acts_hook
from slmviz.features.prepared_scans import (
    deep_scan_dir,
    load_deep_labels,
    load_set_scan,
    prepare_deep_scan,
    prepare_set_scan,
    set_scan_source,
)
from slmviz.features.sae import SAE
from slmviz.scans.scan import ScanFormatError

CORPUS = [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]
FAMILIES = ["llama_gqa", "gemma3"]


class Stopped(Exception):
    pass


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    m = slmviz.load(build_tiny_model(tmp_path_factory.mktemp("deep") / request.param, request.param, seed=1))
    d = m.cfg.d_model
    coders = [SAE.random(d, 32, seed=layer, architecture="relu", hook_name=f"blocks.{layer}.mlp.hook_in",
                         hook_name_out=f"blocks.{layer}.hook_mlp_out") for layer in (0, 1)]
    return m, coders


@pytest.fixture(autouse=True)
def small_shards(monkeypatch):
    monkeypatch.setattr(ds, "DEEP_SHARD_DOCS", 8)  # several shards from a tiny corpus: resume has steps to skip
    monkeypatch.setattr(ds, "KEEP_TOKENS", 128)  # the whole tiny vocabulary: the token table's counts are exact


def test_the_deep_scan_is_slmvizs_scan_with_a_brute_force_token_table_and_scored_labels(tiny, tmp_path, monkeypatch):
    m, coders = tiny
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    s, docs = prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    assert docs == CORPUS[:54] and s.n_tokens == sum(len(m.encode(d)) for d in docs)  # all of the 90 % read
    hooks = [acts_hook(c) for c in coders]
    ref = slmviz.scan(docs, hooks=hooks, saes=coders, model=m, top_k=ds.DEEP_TOP_K, progress=False)
    for h in hooks:
        a, b = s.stats[h], ref.stats[h]
        # the same tokens (n, histogram counts); fp32 forwards of other batch shapes round the activations apart in
        # their last bits, which may swap near-tied top examples, so the top values are compared, not their order
        assert int(a.n) == int(b.n) and torch.equal(a.hist, b.hist)
        torch.testing.assert_close(a.top_val, b.top_val, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.mean, b.mean, rtol=1e-6, atol=1e-9)
    # labels: for each feature, the tokens choose_label_tokens names from counts made over a plain trace
    table = load_deep_labels(m, "plt")
    assert table.info["tokens"] == s.n_tokens and table.info["heldout_tokens"] > 0
    fired: dict[tuple[int, int], Counter] = {}
    every = Counter()
    for d in docs:
        ids = m.encode(d)
        every.update(ids.tolist())
        t = m.trace(ids, saes=coders, names=hooks)
        for L, c in enumerate(coders):
            x = t[acts_hook(c)].clone()
            x[0] = 0  # the scan's row rule: each window's first position is not a feature's context
            for pos, f in (x > 0).nonzero().tolist():
                fired.setdefault((L, f), Counter())[int(ids[pos])] += 1
    assert len(table.frame) == len(fired)
    for r in table.frame.itertuples():
        counts = fired[(r.layer, r.feature)]
        assert r.fires == sum(counts.values())
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))  # by count, ties to the lower id
        vocab = np.zeros(m.decoder.params.unembed.shape[0], dtype=np.int64)
        for tok, c in every.items():
            vocab[tok] = c
        want = ds.choose_label_tokens(np.array([t for t, _ in ranked]), np.array([c for _, c in ranked]),
                                      r.fires, vocab, s.n_tokens)
        assert list(r.tokens) == want
        assert 0.0 <= r.score <= 1.0 or np.isnan(r.score)
    assert set_scan_source(m, "plt") == "deep"


def test_an_interrupted_deep_scan_resumes_to_the_same_result(tiny, tmp_path, monkeypatch):
    m, coders = tiny
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path / "a"))
    whole, _ = prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    whole_labels = load_deep_labels(m, "plt").frame
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path / "b"))
    seen = []

    def stop_in_the_third_shard(u):
        seen.append(u)
        if u.phase == "scan" and "shard 3" in u.detail:
            raise Stopped

    with pytest.raises(Stopped):
        prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=stop_in_the_third_shard)
    work = deep_scan_dir(m, "plt").with_name(ds.WORK_FOLDER)
    assert json.loads((work / "state.json").read_text())["shards"] == 2
    assert load_set_scan(m, "plt") is None  # nothing half-written is read
    resumed, _ = prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    assert not work.exists()
    for h in whole.stats:
        a, b = whole.stats[h], resumed.stats[h]
        assert torch.equal(a.hist, b.hist) and torch.equal(a.top_key, b.top_key)
        torch.testing.assert_close(a.mean, b.mean, rtol=1e-12, atol=0)
    got = load_deep_labels(m, "plt").frame
    assert got.drop(columns=["tokens"]).equals(whole_labels.drop(columns=["tokens"]))


def test_load_set_scan_prefers_the_deep_scan_and_a_damaged_one_is_an_error_then_written_again(tiny, tmp_path,
                                                                                              monkeypatch):
    m, coders = tiny
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    assert set_scan_source(m, "plt") is None
    small, _ = prepare_set_scan(m, coders, "plt", corpus=CORPUS, progress=False)
    assert set_scan_source(m, "plt") == "small" and load_set_scan(m, "plt")[0].n_tokens == small.n_tokens
    deep, _ = prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    assert set_scan_source(m, "plt") == "deep" and load_set_scan(m, "plt")[0].n_tokens == deep.n_tokens
    assert load_set_scan(m, "plt", deep=False)[0].n_tokens == small.n_tokens
    weights = deep_scan_dir(m, "plt") / "scan.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ScanFormatError, match="could not be read"):
        load_set_scan(m, "plt")
    again, _ = prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    assert load_set_scan(m, "plt")[0].n_tokens == deep.n_tokens == again.n_tokens


def test_a_graphs_labels_and_scores_come_from_the_deep_scan(tiny, tmp_path, monkeypatch):
    m, coders = tiny
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    table = load_deep_labels(m, "plt")
    g = slmviz.attribution_graph(CORPUS[0][:40], transcoders=coders, model=m, progress=False).prune(1.0, 1.0)
    assert g.label_scores == {}
    g.use_labels(table)
    feats = g.kept_nodes[g.kept_nodes.kind == "feature"]
    scored = {(r.layer, r.feature): (r.label, r.score) for r in table.frame.itertuples()}
    want = {nid: scored[(L, f)][1] for nid, L, f in zip(feats.node_id, feats.layer, feats.feature, strict=True)
            if (L, f) in scored}
    assert g.label_scores.keys() == want.keys() and want
    assert all(g.label_scores[k] == v or (np.isnan(v) and np.isnan(g.label_scores[k])) for k, v in want.items())
    nid = next(iter(want))
    L, f = int(feats.set_index("node_id").layer[nid]), int(feats.set_index("node_id").feature[nid])
    assert g.labels[nid].startswith("[auto] " + scored[(L, f)][0])


def test_a_card_says_which_scan_it_read_and_shows_the_label_with_its_score(tiny, tmp_path, monkeypatch):
    from slmviz.features.dashboard import feature_card

    m, coders = tiny
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    small, _ = prepare_set_scan(m, coders, "plt", corpus=CORPUS, progress=False)
    assert "small scan" in feature_card(coders[1], 3, scan=small, model=m).note
    deep, _ = prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    table = load_deep_labels(m, "plt")
    r = table.frame[table.frame.layer == 1].iloc[0]
    card = feature_card(coders[1], int(r.feature), scan=deep, model=m, labels=table)
    assert card.label == r.label and (card.label_score == r.score or np.isnan(r.score))
    assert f"deep scan ({deep.n_tokens:,} tokens)" in card.note and r.label in card.note


def test_the_deep_scan_reads_the_corpus_its_set_trained_on(tmp_path, monkeypatch):
    from slmviz.features.prepared_scans import CORPUS
    from slmviz.loading.bundled import prepared_dir

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    assert ps.set_corpus("M", "plt-quick") == CORPUS  # no set there: the prepared sets' corpus
    folder = prepared_dir("M", "plt-quick")
    folder.mkdir(parents=True)
    for recorded, read in (("quick", "quick"), ("custom", None), ("no such corpus", CORPUS)):
        (folder / "transcoder_set.json").write_text(json.dumps({"metadata": {"corpus_name": recorded}}))
        assert ps.set_corpus("M", "plt-quick") == read


def test_a_background_deep_scan_runs_off_the_callers_thread_cancels_and_resumes(tiny, tmp_path, monkeypatch):
    m, coders = tiny
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    updates = []

    def cancel_in_the_second_shard(u):
        updates.append(u)
        if u.phase == "scan" and "shard 2" in u.detail:
            job.cancel()

    job = ps.BackgroundDeepScan(m, coders, "plt", corpus=CORPUS, tokens=10_000, progress=cancel_in_the_second_shard)
    assert job.start().wait(600) and job.cancelled and job.result is None and job.error is None
    assert "cancelled" in job.status() and load_set_scan(m, "plt") is None
    work = deep_scan_dir(m, "plt").with_name(ds.WORK_FOLDER)
    assert json.loads((work / "state.json").read_text())["shards"] == 1  # the first shard is kept
    got = []
    again = ps.BackgroundDeepScan(m, coders, "plt", corpus=CORPUS, tokens=10_000, on_done=got.append).start()
    assert again.wait(600) and again.error is None and got == [again.result]
    assert "done" in again.status() and load_set_scan(m, "plt")[0].n_tokens == again.result[0].n_tokens
    assert all(u.fraction <= 1 for u in updates) and not again.running


def test_a_preview_of_a_stopped_deep_scan_labels_what_its_last_shard_left(tiny, tmp_path, monkeypatch):
    """preview_labels reads the work folder's state: after the whole text it gives the finished scan's labels."""
    m, coders = tiny
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    done = load_deep_labels(m, "plt").frame
    monkeypatch.setattr(ds.shutil, "rmtree", lambda *a, **k: None)  # keep the work folder of a second run
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path / "again"))
    prepare_deep_scan(m, coders, "plt", tokens=10_000, corpus=CORPUS, progress=False)
    work = deep_scan_dir(m, "plt").with_name(ds.WORK_FOLDER)
    preview = ds.preview_labels(m, dict(enumerate(coders)), work, CORPUS).frame
    assert preview.drop(columns=["tokens"]).equals(done.drop(columns=["tokens"]))
    assert [list(t) for t in preview.tokens] == [list(t) for t in done.tokens]
