"""engine="ray" on a local Ray node gives exactly engine="local"'s scan; an unreachable RAY_ADDRESS fails fast.

One module-scoped node (2 CPUs, a small object store) started and stopped by the fixture, because each
start costs seconds. Two actors on many small batches, so results can arrive out of order and must still
merge in batch order. Does not cover a remote cluster or GPUs (neither exists here).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

import slmviz
from slmviz.scans.ray_engine import probe

ray = pytest.importorskip("ray", reason='the Ray engine needs pip install "slmviz[ray]"')

HOOKS = ["blocks.1.mlp.hook_post", "blocks.0.attn.hook_z", "blocks.1.attn.hook_pattern"]


@pytest.fixture(scope="module")
def ray_node():
    ray.init(address="local", num_cpus=2, object_store_memory=100 * 1024**2, include_dashboard=False,
             log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_engine_equals_the_local_engine_exactly(ray_node, tiny_model, tmp_path, monkeypatch):
    """A jsonl corpus file in shards of 6 documents: each actor reads its own shards from the file (by byte
    offset), results arrive in any order and merge in shard order, exactly as the local engine merges them. (A
    list corpus, whose shards carry their texts, is the SAE test's: each Ray scan starts actors of its own.)"""
    import importlib
    import json

    from test_scan import random_docs

    monkeypatch.setattr(importlib.import_module("slmviz.scans.scan"), "SHARD_DOCS", 6)
    docs = random_docs(40, 50, seed=5)
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    kw = dict(hooks=HOOKS, top_k=4, model=tiny_model, batch_tokens=96, variants=["rope_interleaved"], progress=False)
    local = slmviz.scan(corpus, engine="local", **kw)
    remote = slmviz.scan(corpus, engine="ray", workers=2, **kw)
    assert local.info["batches"] > 10  # 7 shards of several batches each, for two actors
    for h in HOOKS:
        a, b = local.stats[h].to_tensors(h), remote.stats[h].to_tensors(h)
        for name in a:
            assert torch.equal(a[name].nan_to_num(7.5), b[name].nan_to_num(7.5)), name
    assert local.tokens == remote.tokens
    assert local.damage.equals(remote.damage)
    assert remote.info["engine"] == "ray" and remote.info["documents"] == 40
    assert {k: remote.info[k] for k in ("windows", "tokens", "batches")} == {
        k: local.info[k] for k in ("windows", "tokens", "batches")}


def test_an_unreachable_ray_address_fails_within_the_connect_timeout():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="unset RAY_ADDRESS"):
        probe(f"127.0.0.1:{port}", timeout=2)
    with pytest.raises(ConnectionError, match="not host:port"):
        probe("ray://nowhere")
    assert time.monotonic() - start < 5


def test_ray_engine_with_saes_equals_the_local_engine_exactly(ray_node, tiny_model, monkeypatch):
    """A list corpus (its shards carry their texts), with saes=[...] travelling to the actors with the scan's spec:
    a scan of a spliced SAE's features and of a hook after it (changed by the splice without the error term), in
    shards of 6 documents for two actors, is the same, bit for bit, on both engines."""
    import importlib

    from test_scan import random_docs

    monkeypatch.setattr(importlib.import_module("slmviz.scans.scan"), "SHARD_DOCS", 6)

    from slmviz.features.dashboard import acts_hook

    sae = slmviz.SAE.random(tiny_model.cfg.d_model, 24, seed=3, architecture="topk", k=4,
                            hook_name="blocks.0.hook_resid_post")
    sae.use_error_term = False  # the reconstruction flows on: the later hook depends on the SAE too
    hooks = [acts_hook(sae), "blocks.1.mlp.hook_post"]
    kw = dict(hooks=hooks, saes=[sae], top_k=3, model=tiny_model, batch_tokens=96, progress=False)
    docs = random_docs(24, 40, seed=9)
    local = slmviz.scan(docs, engine="local", **kw)
    remote = slmviz.scan(docs, engine="ray", workers=2, **kw)
    plain = slmviz.scan(docs, engine="local", **{**kw, "hooks": hooks[1:], "saes": None})
    assert local.info["batches"] > 4 and remote.info["engine"] == "ray"
    for h in hooks:
        a, b = local.stats[h].to_tensors(h), remote.stats[h].to_tensors(h)
        for name in a:
            assert torch.equal(a[name].nan_to_num(7.5), b[name].nan_to_num(7.5)), (h, name)
    assert not torch.equal(local.stats[hooks[1]].mean, plain.stats[hooks[1]].mean)  # the splice did something
