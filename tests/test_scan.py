"""Corpus scans (local engine): top-k and statistics equal a brute-force trace per document, padding changes
nothing, windows keep their offsets, save/load is exact, variant damage equals compare's, bad input is clear.

Runs on the tiny random llama (tests/conftest.py) except one padding check on the real SmolLM2. Does not
cover the Ray engine (tests/test_scan_ray.py), the app tab (tests/test_corpus_browser.py) or speed and
memory (bench/perf/scan.py).
"""

from __future__ import annotations

import json
import random

import pandas as pd
import pytest
import torch

import slmviz
from slmviz.analysis.diff import kl_per_position
from slmviz.corpora.reading import CorpusError, count_documents, iter_documents
from slmviz.corpora.verses import bundled_corpus_path
from slmviz.scans.batches import Batch, ScanSpec, Window, _forward, iter_windows, plan_batches

MLP = "blocks.1.mlp.hook_post"
Z = "blocks.0.attn.hook_z"
PATTERN = "blocks.1.attn.hook_pattern"
RESID = "blocks.0.hook_resid_post"


def random_docs(n: int, longest: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(2, 100)}" for _ in range(rng.randrange(1, longest))) for _ in range(n)]


def brute_features(trace: slmviz.Trace) -> dict[str, torch.Tensor]:
    """Each hook's features [pos, F] written out again from the definitions in slmviz/scans/units.py."""
    p = trace[PATTERN]  # [h, q, k]
    q = p.shape[1]
    look_back = torch.zeros(q, p.shape[0])
    for i in range(2, q):
        look_back[i] = p[:, i, 1:i].amax(-1)
    return {MLP: trace[MLP], Z: trace[Z].norm(dim=-1), PATTERN: look_back}


def brute_force(model, docs: list[str], top_k: int) -> dict[str, dict]:
    """Every token of every document in one table per hook; stable sort = ties to the earlier (doc, position)."""
    feats: dict[str, list[torch.Tensor]] = {h: [] for h in (MLP, Z, PATTERN)}
    where = []
    values_z = []
    for d, doc in enumerate(docs):
        t = model.trace(doc, names=[MLP, Z, PATTERN])
        for h, x in brute_features(t).items():
            feats[h].append(x)
        values_z.append(t[Z])
        where += [(d, p) for p in range(len(t.tokens))]
    out = {}
    for h, xs in feats.items():
        x = torch.cat(xs)  # [N, F]
        order = torch.sort(x, dim=0, descending=True, stable=True).indices[:top_k]  # [k, F]
        out[h] = {"x": x, "order": order}
    out["where"] = where
    out["z_value_mean"] = torch.cat(values_z).double().mean(0)
    return out


@pytest.fixture(scope="module")
def docs():
    return random_docs(30, 60)


@pytest.fixture(scope="module")
def small_scan(tiny_model, docs):
    return slmviz.scan(docs, hooks=[MLP, Z, PATTERN], top_k=5, model=tiny_model, batch_tokens=200, progress=False)


def test_top_k_and_statistics_equal_a_brute_force_trace_per_document(tiny_model, docs, small_scan):
    brute = brute_force(tiny_model, docs, top_k=5)
    for hook in (MLP, Z, PATTERN):
        x = brute[hook]["x"].double()
        torch.testing.assert_close(small_scan.mean(hook), x.mean(0), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(small_scan.var(hook), x.var(0, unbiased=False), rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(small_scan.max(hook), x.amax(0).float(), rtol=1e-5, atol=1e-6)
        assert int(small_scan.stats[hook].hist[0].sum()) == x.shape[0]
        for feature in (0, 3):  # an MLP neuron / a head
            table = small_scan.top_examples(hook, feature)
            expected = [brute["where"][int(i)] for i in brute[hook]["order"][:, feature]]
            assert list(zip(table.doc, table.position, strict=True)) == expected, (hook, feature)
            torch.testing.assert_close(torch.tensor(table.activation.tolist()),
                                       x[brute[hook]["order"][:, feature], feature].float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(small_scan.value_mean(Z), brute["z_value_mean"], rtol=1e-5, atol=1e-7)
    assert small_scan.value_mean(PATTERN) is None
    assert small_scan.info["documents"] == len(docs)


def test_top_examples_show_the_token_in_its_context(small_scan, tiny_model, docs):
    table = small_scan.top_examples(MLP, 7)
    assert list(table.columns) == ["rank", "doc", "position", "token", "activation", "context"]
    row = table.iloc[0]
    tokens = tiny_model.to_strings(tiny_model.encode(docs[row.doc]))
    assert row.token == tokens[row.position]
    assert f"[[{row.token}]]" in row.context
    strip = small_scan.context(MLP, 7, 0)
    here = [a for _, a, is_it in strip if is_it]
    assert here == [pytest.approx(row.activation)]
    assert len(strip) <= 12 + 1 + 4
    html = small_scan.examples_html(MLP, 7)
    assert html.count('class="slmviz-corpus-strip"') == len(table) and "rgba(255,140,0" in html
    fig = small_scan.plot_histogram(MLP, 7)
    assert sum(small_scan.histogram(MLP, 7)["count"]) == small_scan.info["tokens"] and fig.data[0].type == "bar"


def test_padding_changes_nothing(tiny_model):
    """Windows of 3..40 tokens padded on the right into one batch give each window's unpadded activations."""
    windows = tuple(Window(i, 0, tuple(tiny_model.encode(d).tolist())) for i, d in enumerate(random_docs(6, 40, 1)))
    assert len({len(w.ids) for w in windows}) > 1
    _check_padding(tiny_model, windows, [MLP, Z, PATTERN, RESID])


@pytest.mark.slow
def test_padding_changes_nothing_on_smollm2(model):
    texts = ["The capital of France is", "In the beginning God created the heaven and the earth, and the earth "
             "was without form.", "Hi"]
    windows = tuple(Window(i, 0, tuple(model.encode(t).tolist())) for i, t in enumerate(texts))
    _check_padding(model, windows, ["blocks.5.mlp.hook_post", "blocks.3.attn.hook_z", "blocks.3.attn.hook_pattern",
                                    "blocks.29.hook_resid_post"])


def _check_padding(model, windows, hooks):
    longest = max(len(w.ids) for w in windows)
    ids = torch.zeros(len(windows), longest, dtype=torch.long)
    for i, w in enumerate(windows):
        ids[i, : len(w.ids)] = torch.tensor(w.ids)
    lengths = torch.tensor([len(w.ids) for w in windows])
    values, logits = _forward(model, ids, lengths, hooks, need_logits=True)
    for i, w in enumerate(windows):
        n = len(w.ids)
        t = model.trace(list(w.ids), names=hooks)
        for h in hooks:
            got = values[h][i]
            got = got[:, :n, :n] if h.endswith("hook_pattern") else got[:n]
            scale = t[h].abs().max().clamp_min(1e-6)
            assert float((got - t[h]).abs().max() / scale) <= 1e-5, (h, i)
        assert float((logits[i, :n] - t.logits).abs().max() / t.logits.abs().max()) <= 1e-5


def test_long_documents_are_cut_into_windows_that_keep_their_offsets(tiny_model):
    doc = " ".join(f"w{3 + i % 90}" for i in range(70))
    s = slmviz.scan([doc, "w5 w6"], hooks=[MLP], top_k=50, model=tiny_model, window=32, progress=False)
    ids = torch.tensor(tiny_model.tokenizer(doc)["input_ids"])  # longer than the tiny model's 64-token context
    assert 64 < len(ids) <= 96 and s.info["windows"] == 4 and s.info["tokens"] == len(ids) + 2
    brute = torch.cat([tiny_model.trace(ids[o:o + 32], names=[MLP])[MLP] for o in (0, 32, 64)])  # [pos, d_mlp]
    table = s.top_examples(MLP, 2)
    for row in table.itertuples():
        if row.doc == 0:
            assert row.activation == pytest.approx(float(brute[row.position, 2]), rel=1e-5, abs=1e-6)
            assert row.token == tiny_model.to_strings([int(ids[row.position])])[0]
    assert table.position.max() >= 64  # a token of the last window, numbered in the whole document


def test_batches_are_planned_within_the_token_budget_and_keep_every_window():
    windows = [Window(i, 0, tuple(range(1 + (i * 7) % 30))) for i in range(300)]
    batches = list(plan_batches(windows, batch_tokens=64))
    assert [b.index for b in batches] == list(range(len(batches)))
    assert sorted(w.doc for b in batches for w in b.windows) == list(range(300))
    assert all(len(b.windows) * max(len(w.ids) for w in b.windows) <= 64 for b in batches)
    assert isinstance(batches[0], Batch)


def test_save_and_load_give_back_the_same_scan(small_scan, tmp_path):
    folder = small_scan.save(tmp_path / "scan")
    back = slmviz.Scan.load(folder)
    assert back.info == small_scan.info and back.features == small_scan.features and back.tokens == small_scan.tokens
    for h in small_scan.hooks:
        for name, t in small_scan.stats[h].to_tensors(h).items():
            assert torch.equal(back.stats[h].to_tensors(h)[name], t) or (t.isnan() == back.stats[h].to_tensors(h)[
                name].isnan()).all() and torch.equal(t.nan_to_num(0), back.stats[h].to_tensors(h)[name].nan_to_num(0))
    pd.testing.assert_frame_equal(back.top_examples(Z, 1), small_scan.top_examples(Z, 1))
    readable = pd.read_parquet(folder / "top_examples.parquet")
    assert set(readable.hook) == {MLP, Z, PATTERN}
    one = readable[(readable.hook == Z) & (readable.feature == 1)].drop(columns=["hook", "feature"])
    pd.testing.assert_frame_equal(one.reset_index(drop=True), small_scan.top_examples(Z, 1), check_dtype=False)


def test_variant_damage_per_document_equals_kl_of_the_two_traces(tiny_model):
    docs = random_docs(5, 30, 2)
    s = slmviz.scan(docs, hooks=[MLP], model=tiny_model, variants="rope_interleaved,no_causal_mask", progress=False)
    for row in s.damage.itertuples():
        ref = tiny_model.trace(docs[row.doc], names=[]).logits
        other = tiny_model.trace(docs[row.doc], names=[], variant=row.variant).logits
        assert row.kl_mean == pytest.approx(float(kl_per_position(ref, other).mean()), rel=1e-4, abs=1e-7)
        assert row.top1_agree == pytest.approx(float((ref.argmax(-1) == other.argmax(-1)).double().mean()))
        assert row.tokens == ref.shape[0]
    summary = s.damage_summary()
    assert list(summary.variant) == ["rope_interleaved", "no_causal_mask"] and (summary.documents == 5).all()


def test_corpus_files_read_the_same_documents(tmp_path):
    docs = ["first line", "", "third: ünïcode"]
    (tmp_path / "c.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)))
    pd.DataFrame({"text": docs}).to_parquet(tmp_path / "c.parquet")
    for suffix in ("txt", "jsonl", "parquet"):
        assert list(iter_documents(tmp_path / f"c.{suffix}")) == docs, suffix
        assert count_documents(tmp_path / f"c.{suffix}") == 3 and count_documents(tmp_path / f"c.{suffix}", 2) == 2
    assert list(iter_documents(docs, limit=2)) == docs[:2]
    path = bundled_corpus_path()
    assert path.name == "kjv.jsonl" and next(iter_documents(path)).startswith("In the beginning God")


def test_empty_documents_keep_their_number(tiny_model):
    s = slmviz.scan(["", "w5 w6 w7", ""], hooks=[MLP], top_k=3, model=tiny_model, progress=False)
    assert s.info["documents"] == 3 and set(s.top_examples(MLP, 0).doc) == {1}


def test_bad_input_is_a_clear_error(tiny_model, tmp_path):
    with pytest.raises(CorpusError, match="No corpus file"):
        slmviz.scan(tmp_path / "missing.jsonl", hooks=[MLP], model=tiny_model)
    with pytest.raises(CorpusError, match="expected one of .txt, .jsonl, .parquet"):
        slmviz.scan(str(tmp_path / "corpus.csv"), hooks=[MLP], model=tiny_model)
    (tmp_path / "bad.jsonl").write_text('{"body": "no text field"}\n')
    with pytest.raises(CorpusError, match=r"bad.jsonl:1 has no string field 'text'"):
        slmviz.scan(tmp_path / "bad.jsonl", hooks=[MLP], model=tiny_model, progress=False)
    with pytest.raises(CorpusError, match="not str"):
        slmviz.scan(["fine", 3], hooks=[MLP], model=tiny_model, progress=False)
    with pytest.raises(slmviz.HookNameError, match="did you mean 'blocks.1.mlp.hook_post'"):
        slmviz.scan(["w3"], hooks=["blocks.1.mlp.hook_pots"], model=tiny_model)
    with pytest.raises(slmviz.HookNameError, match="no feature to scan"):
        slmviz.scan(["w3"], hooks=["blocks.1.attn.hook_attn_scores"], model=tiny_model)
    with pytest.raises(ValueError, match="engine must be one of"):
        slmviz.scan(["w3"], hooks=[MLP], model=tiny_model, engine="spark")
    with pytest.raises(ValueError, match="top_k must be a positive integer"):
        slmviz.scan(["w3"], hooks=[MLP], model=tiny_model, top_k=0)
    with pytest.raises(FileNotFoundError, match="No saved scan"):
        slmviz.Scan.load(tmp_path)


def test_ray_engine_without_ray_says_how_to_install_it(tiny_model, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ImportError, match=r'pip install "slmviz\[ray\]"'):
        slmviz.scan(["w3 w4"], hooks=[MLP], model=tiny_model, engine="ray", progress=False)


def test_cli_scan_writes_a_scan_folder_and_prints_the_throughput(tiny_dir, tmp_path, capsys):
    from slmviz.cli import main

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(random_docs(8, 20, 3)))
    code = main(["scan", str(corpus), "--hook", MLP, "--hook", Z, "--top-k", "3", "--out", str(tmp_path / "out"),
                 "--model", str(tiny_dir), "--variants", "no_rope"])
    out = capsys.readouterr().out
    assert code == 0 and "tokens/s" in out and str(tmp_path / "out") in out
    s = slmviz.Scan.load(tmp_path / "out")
    assert s.hooks == [MLP, Z] and s.info["documents"] == 8 and set(s.damage.variant) == {"no_rope"}
    assert main(["scan", str(tmp_path / "nope.txt"), "--hook", MLP, "--out", str(tmp_path / "o2"),
                 "--model", str(tiny_dir)]) == 2


def test_windows_are_made_from_tokenized_documents_in_order(tiny_model):
    ws = list(iter_windows(tiny_model.tokenizer, ["w3 w4 w5", "", "w6"], window=2))
    assert [(w.doc, w.offset, len(w.ids)) for w in ws] == [(0, 0, 2), (0, 2, 1), (2, 0, 1)]
    assert ScanSpec((MLP,), 3).context == 17


def test_batches_stop_before_a_much_shorter_window_once_they_are_big_enough():
    from slmviz.scans.batches import MAX_PAD_FRACTION, MIN_BATCH_TOKENS

    windows = [Window(i, 0, tuple(range(10 + (i * 37) % 57))) for i in range(96)]  # 10..66 tokens, like verses
    batches = list(plan_batches(windows, batch_tokens=1024))
    for b in batches[:-1]:
        lengths = [len(w.ids) for w in b.windows]
        padded, real = len(lengths) * max(lengths), sum(lengths)
        assert real < MIN_BATCH_TOKENS + max(lengths) or min(lengths) >= (1 - MAX_PAD_FRACTION) * max(lengths)
        assert padded <= 1024
    real = sum(b.n_tokens for b in batches)
    padded = sum(len(b.windows) * max(len(w.ids) for w in b.windows) for b in batches)
    assert 1 - real / padded < 0.08  # filling each batch to the budget instead pads 13 % of these


def test_top_rows_equals_a_stable_sort_with_ties_nans_and_infinities():
    from slmviz.scans.reduce import _rankable, top_rows

    gen = torch.Generator().manual_seed(0)
    for trial in range(120):
        n, f = int(torch.randint(1, 50, (), generator=gen)), int(torch.randint(1, 7, (), generator=gen))
        x = torch.randint(-3, 4, (n, f), generator=gen).float() if trial % 2 else torch.randn(n, f, generator=gen)
        x[torch.rand(n, f, generator=gen) < 0.1] = float("nan")
        x[torch.rand(n, f, generator=gen) < 0.05] = float("-inf")
        k = int(torch.randint(1, n + 1, (), generator=gen))
        expected = torch.sort(_rankable(x), dim=0, descending=True, stable=True).indices[:k].T
        assert torch.equal(top_rows(x, k), expected)


def test_a_shard_read_from_its_source_is_what_a_local_scan_reads(tmp_path):
    """corpus.shard_sources + read_shard (what a Ray actor reads) give the documents of iter_documents, shard by
    shard, for every corpus kind: blank jsonl lines are no document, CRLF lines, a last line without newline."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from slmviz.corpora.reading import read_shard, shard_sources
    from slmviz.scans.shards import iter_shards

    texts = [f"line {i} é" if i % 4 else "" for i in range(23)]
    txt = tmp_path / "c.txt"
    txt.write_bytes(("\r\n".join(texts) + "\rnot a line end\r\nlast").encode())  # CRLF, a lone CR, no final LF
    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + ("\n\n" if i % 5 == 0 else "\n") for i, t in enumerate(texts)),
                     encoding="utf-8")
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": texts}), parquet, row_group_size=4)
    for corpus in (texts, str(txt), jsonl, parquet):
        for limit in (None, 17):
            local = list(iter_shards(iter_documents(corpus, limit), 5))
            sources = shard_sources(corpus, limit, 5)
            assert [s["first_doc"] for s in sources] == [s.first_doc for s in local]
            assert [tuple(read_shard(json.loads(json.dumps(s)))) for s in sources] == [s.texts for s in local]
    no_text = tmp_path / "no_text.parquet"
    pq.write_table(pa.table({"body": texts}), no_text)
    with pytest.raises(CorpusError, match="no 'text' column"):  # on the driver, before any actor starts
        shard_sources(no_text, None, 5)
    from_txt = list(iter_documents(txt))
    assert len(from_txt) == count_documents(txt) == 24 and from_txt[-2].endswith("é\rnot a line end")  # "\n" only


def test_shard_size_changes_no_top_example_and_no_mean_beyond_rounding(tiny_model, docs, small_scan, monkeypatch):
    import importlib

    monkeypatch.setattr(importlib.import_module("slmviz.scans.scan"), "SHARD_DOCS", 7)  # 30 documents: 5 shards
    sharded = slmviz.scan(docs, hooks=[MLP, Z, PATTERN], top_k=5, model=tiny_model, batch_tokens=200, progress=False)
    assert sharded.info["documents"] == small_scan.info["documents"] and sharded.info["tokens"] == small_scan.info[
        "tokens"]
    for h in (MLP, Z, PATTERN):
        a, b = small_scan.stats[h], sharded.stats[h]
        assert torch.equal(a.top_key, b.top_key) and torch.equal(a.top_ids, b.top_ids) and torch.equal(a.hist, b.hist)
        torch.testing.assert_close(a.top_val, b.top_val, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.mean, b.mean, rtol=1e-9, atol=1e-9)
