"""The "chat" corpus: the model's own text from seeds, decoded in batches (features.generated_corpus), on a tiny
random LLaMA. Independent reference: the model's own single-row greedy `generate`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz.corpora import generated as gc


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return slmviz.load(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa"))


def test_batched_decoding_equals_greedy_generate_at_top_k_1(tiny, monkeypatch):
    """With top-k 1 every row is the greedy continuation: the batched KV cache decodes as the one-row path does."""
    monkeypatch.setattr(gc, "TOP_K", 1)
    prompt = "w1 w7 w12 w3"
    docs = gc.sample_continuations(tiny, prompt, samples=3, new_tokens=6, seed=0)
    greedy = tiny.generate(prompt, max_new_tokens=6, stop_at_eos=False)
    assert docs == [prompt + greedy] * 3


def test_corpus_is_seeded_split_by_seed_and_resumes(tiny, tmp_path):
    seeds = [("news", "w1 w2 w3"), ("fact", "w4 w5"), ("chat", "w6 w7 w8"), ("prose", "w9")]
    kw = dict(progress=False, samples=2, new_tokens=5, seeds=seeds)
    train, heldout = gc.chat_corpus(tiny, folder=tmp_path / "a", **kw)
    lines = [json.loads(x) for x in train.read_text().splitlines() + heldout.read_text().splitlines()]
    assert len(lines) == 2 * len(seeds) and all(x["text"].startswith(x["seed"]) for x in lines if x["kind"] != "chat")
    assert all(gc.held_out(x["seed"]) == (x in [json.loads(y) for y in heldout.read_text().splitlines()])
               for x in lines)
    # an interrupted run: two seeds' parts on disk, no corpus files yet; it resumes to the same text
    again = tmp_path / "b"
    gc.chat_corpus(tiny, folder=again, **kw)
    (again / "train.jsonl").unlink()
    (again / "heldout.jsonl").unlink()
    for part in sorted((again / "parts").iterdir())[2:]:
        part.unlink()
    resumed = gc.chat_corpus(tiny, folder=again, **kw)
    assert resumed[0].read_text() == train.read_text() and resumed[1].read_text() == heldout.read_text()


def test_interleave_keeps_each_order_and_spreads_the_smaller():
    a, b = [f"a{i}" for i in range(9)], ["b0", "b1", "b2"]
    merged = gc._interleave(a, b)
    assert [x for x in merged if x[0] == "a"] == a and [x for x in merged if x[0] == "b"] == b
    assert merged.index("b0") < merged.index("a5") < merged.index("b2")


def test_balanced_corpus_is_half_chat_and_keeps_every_kind_of_broad_text(tiny, tmp_path, monkeypatch):
    """"balanced": the broad corpus thinned evenly to the chat corpus's characters, then interleaved with it."""
    from slmviz.corpora.broad import broad_corpus

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    chat = gc.corpus_dir(tiny)
    chat.mkdir(parents=True)
    chat_lines = {split: [json.dumps({"text": f"w{i} {split} " * 20}) for i in range(40)] for split in
                  ("train", "heldout")}
    for split, lines in chat_lines.items():
        (chat / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    train, heldout = gc.balanced_corpus(tiny)
    for path, broad, split in ((train, broad_corpus()[0], "train"), (heldout, broad_corpus()[1], "heldout")):
        lines = path.read_text(encoding="utf-8").splitlines()
        broad_lines = broad.read_text(encoding="utf-8").splitlines()
        kept = [x for x in lines if x not in chat_lines[split]]
        assert [x for x in lines if x in chat_lines[split]] == chat_lines[split]
        stride = round(sum(map(len, broad_lines)) / sum(map(len, chat_lines[split])))
        assert stride > 1 and kept == broad_lines[::stride]  # evenly thinned, in order
        share = sum(map(len, chat_lines[split])) / sum(map(len, lines))
        assert 0.3 < share < 0.7, share
    from app.tabs.features_training import train_corpus  # the app's "Train an SAE" panel reads the same file

    assert train_corpus("balanced", tiny) == str(train) and train_corpus("broad") == str(broad_corpus()[0])


def test_thin_keeps_every_nth_line():
    assert gc._thin([f"{i:02d}" for i in range(10)], 6) == ["00", "03", "06", "09"]
    assert gc._thin(["a", "b"], 100) == ["a", "b"]


def test_seeds_decoded_at_once_on_one_thread_each_write_the_same_corpus(tiny, tmp_path):
    """generation_workers' claim: two seeds at once, each on one thread, give the text one seed at a time gives."""
    seeds = [("news", "w1 w2 w3"), ("fact", "w4 w5"), ("chat", "w6 w7 w8"), ("prose", "w9"), ("howto", "w2 w2")]
    kw = dict(progress=False, samples=3, new_tokens=6, seeds=seeds)
    threads = torch.get_num_threads()
    one = gc.chat_corpus(tiny, folder=tmp_path / "one", workers=1, **kw)
    two = gc.chat_corpus(tiny, folder=tmp_path / "two", workers=2, **kw)
    assert [p.read_text() for p in one] == [p.read_text() for p in two]
    assert torch.get_num_threads() == threads  # the workers' one thread is not left behind


def test_a_progress_that_raises_stops_the_workers_and_keeps_the_parts(tiny, tmp_path):
    seeds = [(k, f"w{i} w{i + 1}") for i, k in enumerate(["news", "fact", "prose", "howto", "news", "fact"])]
    calls = []

    def progress(update) -> None:
        calls.append(update.done)
        if update.done == 2:
            raise KeyboardInterrupt  # what the app's cancelled job raises from its report

    with pytest.raises(KeyboardInterrupt):
        gc.chat_corpus(tiny, folder=tmp_path, progress=progress, samples=2, new_tokens=40, seeds=seeds, workers=2)
    written = list((tmp_path / "parts").glob("*.jsonl"))
    assert calls == [0, 1, 2] and 2 <= len(written) < len(seeds) and not (tmp_path / "train.jsonl").exists()
    assert not list((tmp_path / "parts").glob("*.tmp"))
    resumed = gc.chat_corpus(tiny, folder=tmp_path, progress=False, samples=2, new_tokens=40, seeds=seeds, workers=1)
    fresh = gc.chat_corpus(tiny, folder=tmp_path / "fresh", progress=False, samples=2, new_tokens=40, seeds=seeds)
    assert [p.read_text() for p in resumed] == [p.read_text() for p in fresh]


def test_the_cli_names_each_corpus_and_split(tiny, tmp_path, monkeypatch):
    """`--corpus` of train-sae / evaluate-sae / train-transcoders: broad, chat and mixed, each with its -heldout split
    (chat and mixed are the model's own, from $SLMVIZ_CACHE); a path is taken as it is."""
    from slmviz.corpora.broad import broad_corpus
    from slmviz.training.cli import resolve_corpus

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    chat = gc.corpus_dir(tiny)
    chat.mkdir(parents=True)
    for split in ("train", "heldout"):
        (chat / f"{split}.jsonl").write_text(json.dumps({"text": f"w1 {split}"}) + "\n")
    assert resolve_corpus("chat", tiny) == str(chat / "train.jsonl")
    assert resolve_corpus("chat-heldout", tiny) == str(chat / "heldout.jsonl")
    assert resolve_corpus("broad-heldout") == str(broad_corpus()[1])
    mixed = resolve_corpus("mixed-heldout", tiny)
    assert mixed == str(gc.corpus_dir(tiny, "mixed") / "heldout.jsonl")
    assert json.dumps({"text": "w1 heldout"}) in Path(mixed).read_text(encoding="utf-8").splitlines()
    assert resolve_corpus("balanced", tiny) == str(gc.corpus_dir(tiny, "balanced") / "train.jsonl")
    assert resolve_corpus("bench/modern_prose.txt") == "bench/modern_prose.txt"


def test_slice_jobs_hold_every_kind_in_its_share_and_grow_by_prefix():
    """The quick corpus's jobs: the first six are one seed of each kind, a larger slice holds a smaller one, and no
    held-out seed is trained on."""
    six, twenty = gc.slice_jobs(6), gc.slice_jobs(20)
    kinds = list(dict.fromkeys(kind for kind, _ in gc.SEEDS))
    assert sorted(job[2] for job in six) == sorted(kinds) and twenty[:6] == six
    assert not any(gc.held_out(job[3]) for job in gc.slice_jobs(len(gc.SEEDS)))
    assert all(gc.SEEDS[i] == (kind, text) for _, i, kind, text in twenty)


def test_the_quick_corpus_is_a_slice_of_mixed_from_the_chat_corpus_own_parts(tiny, tmp_path, monkeypatch):
    """Training split: the slice's chat lines dealt round-robin, spread over the broad corpus's first n/95 of its lines.
    Held-out split: the broad held-out split whole with every held-out seed's lines. The parts are the chat corpus's
    own files, so generating the full corpus later reuses them and generates nothing twice."""
    from slmviz.corpora.broad import broad_corpus

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    parts = gc.corpus_dir(tiny) / "parts"
    parts.mkdir(parents=True)
    jobs = [(0, i, kind, text) for i, (kind, text) in enumerate(gc.SEEDS)]
    for job in jobs:  # every part written already: nothing to generate, the lines known
        gc._part(parts, job).write_text("".join(json.dumps({"text": f"{job[1]} {s}"}) + "\n" for s in range(3)))
    train, heldout = gc.quick_corpus(tiny, n=6, progress=False)
    lines = train.read_text(encoding="utf-8").splitlines()
    chat = [json.dumps({"text": f"{job[1]} {s}"}) for s in range(3) for job in gc.slice_jobs(6)]
    broad_train, broad_heldout = (p.read_text(encoding="utf-8").splitlines() for p in broad_corpus())
    assert [x for x in lines if x in chat] == chat  # dealt: each job's first sample, then each one's second
    assert [x for x in lines if x not in chat] == broad_train[:round(len(broad_train) * 6 / len(jobs))]
    held = [json.dumps({"text": f"{job[1]} {s}"}) for job in jobs if gc.held_out(job[3]) for s in range(3)]
    held_lines = heldout.read_text(encoding="utf-8").splitlines()
    assert held and [x for x in held_lines if x in held] == held
    assert [x for x in held_lines if x not in held] == broad_heldout
    assert gc.quick_corpus(tiny, n=6, progress=False) == (train, heldout)  # written once
    full_train, _ = gc.chat_corpus(tiny, progress=False)  # from the same parts, generating none
    assert all(x in full_train.read_text(encoding="utf-8").splitlines() for x in chat)


def test_the_chat_heldout_split_alone_is_the_one_the_whole_corpus_writes(tiny, tmp_path, monkeypatch):
    """resolve_corpus("chat", split="heldout") generates only the held-out seeds' parts (chat_heldout): the same file
    chat_corpus writes later from every part, and no training part is needed for it."""
    from slmviz.corpora.named import resolve_corpus

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    parts = gc.corpus_dir(tiny) / "parts"
    parts.mkdir(parents=True)
    jobs = [(0, i, kind, text) for i, (kind, text) in enumerate(gc.SEEDS)]
    for job in jobs:
        if gc.held_out(job[3]):  # only the held-out parts exist: a training part asked for would be generated
            gc._part(parts, job).write_text("".join(json.dumps({"text": f"{job[1]} {s}"}) + "\n" for s in range(2)))
    monkeypatch.setattr(gc, "ROUNDS", 1)
    monkeypatch.setattr(gc, "generation_jobs", lambda rounds=1, seeds=None: jobs)
    heldout = resolve_corpus("chat", tiny, split="heldout")
    alone = heldout.read_text(encoding="utf-8")
    assert alone == "".join(json.dumps({"text": f"{job[1]} {s}"}) + "\n" for job in jobs if gc.held_out(job[3])
                            for s in range(2))
    assert not (gc.corpus_dir(tiny) / "train.jsonl").exists()
    for job in jobs:  # now every part: the whole corpus writes the same held-out file
        gc._part(parts, job).write_text("".join(json.dumps({"text": f"{job[1]} {s}"}) + "\n" for s in range(2)))
    heldout.unlink()
    _, again = gc.chat_corpus(tiny, progress=False, rounds=1)
    assert again.read_text(encoding="utf-8") == alone
