"""training.prepare and features.prepared_scans: a model's full set prepared into $SLMVIZ_CACHE (the recipe,
overrides for a model without one) and the feature scan prepared with it, on a tiny random LLaMA in a temporary
cache.

Independent references: slmviz.scan of the same documents with the set spliced (for the prepared scan), and the set
the first call saved (for the second call, which loads instead of training). Does not cover: the bundled models'
recipes run for real (an hour of training: docs/features.md), nor the "mixed" corpus (corpora.generated).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz import SAE
from slmviz.features.dashboard import acts_hook
from slmviz.features.prepared_scans import (
    SCAN_CHARS,
    SCAN_TOP_K,
    load_sae_scan,
    load_set_scan,
    prepare_sae_scans,
    prepare_set_scan,
    sae_scan_dir,
    scan_docs,
    set_scan_dir,
)
from slmviz.formats.checkpoint import CheckpointError
from slmviz.formats.slmviz import SET_FILE
from slmviz.replacement.prepared import prepared_dir
from slmviz.scans.scan import Scan, ScanFormatError
from slmviz.training.prepare import RECIPES, prepare_transcoders, recipe

CORPUS = [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(40)]
TINY = dict(d_sae=32, k=4, tokens=1500, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512,
            dtype="float32", checkpoint_every=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return slmviz.load(build_tiny_model(tmp_path_factory.mktemp("prepared") / "tiny", "llama_gqa", seed=1))


def test_a_bundled_recipe_takes_overrides_and_a_model_without_one_needs_d_sae_k_and_tokens():
    (model, kind), fixed = next(iter(RECIPES.items()))
    assert recipe(model, kind) == fixed and recipe(model, kind, {"tokens": 10})["tokens"] == 10
    with pytest.raises(ValueError, match="no prepared 'plt' recipe for 'tiny'.*pass k, tokens"):
        recipe("tiny", "plt", {"d_sae": 64})
    assert recipe("tiny", "plt", {"d_sae": 64, "k": 4, "tokens": 100}) == {"d_sae": 64, "k": 4, "tokens": 100}


def test_a_set_for_a_model_without_a_recipe_is_prepared_with_its_scan_then_loaded(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    seen = []
    ts = prepare_transcoders(tiny, "plt", progress=seen.append, corpus=CORPUS, **TINY)
    steps = [u for u in seen if u.phase == "training" and u.stats]
    scanned = [(u.done, u.total) for u in seen if u.phase == "scan" and u.unit == "doc"]
    fractions = [u.fraction for u in seen]  # one job, one bar: never backwards, to its end
    assert fractions == sorted(fractions) and fractions[-1] == 1.0 and seen[-1].job == "prepare plt (tiny)"
    folder = prepared_dir(tiny, "plt")
    assert folder == tmp_path / "transcoders" / "tiny" / "plt" and (folder / SET_FILE).is_file()
    assert ts.layers == [0, 1] and ts.d_sae == 32 and steps and scanned[-1] == (len(CORPUS), len(CORPUS))
    assert ts.metadata["corpus_name"] == "custom"
    # the scan prepared with it: every coder at once, over the corpus's documents (a list: itself), the same as
    # slmviz.scan of those documents with the set spliced
    s, docs = load_set_scan(tiny, "plt")
    assert docs == scan_docs(tiny, CORPUS) == [d[:SCAN_CHARS] for d in CORPUS]
    reference = slmviz.scan(docs, hooks=[acts_hook(c) for c in ts], saes=list(ts), model=tiny, top_k=SCAN_TOP_K,
                            progress=False)
    for hook in reference.hooks:
        assert torch.equal(s.stats[hook].top_key, reference.stats[hook].top_key), hook
        assert torch.allclose(s.max(hook), reference.max(hook)), hook
    # a second call loads the finished set (no step reported) and reads the scan back
    again_seen = []
    again = prepare_transcoders(tiny, "plt", progress=again_seen.append, corpus=CORPUS, **TINY)
    assert not [u for u in again_seen if u.stats], "trained again"
    for layer in ts.layers:
        assert torch.equal(again.coder(layer).W_enc, ts.coder(layer).W_enc)
    assert load_set_scan(tiny, "plt")[1] == docs
    # a set prepared by another recipe (a newer slmviz's, here other tokens): refused, saying it still loads and
    # what to delete, and left as it was
    with pytest.raises(CheckpointError, match=r"another recipe.*tokens: 1500 there, 1600 now.*delete that folder"):
        prepare_transcoders(tiny, "plt", progress=False, corpus=CORPUS, **{**TINY, "tokens": 1600})
    assert torch.equal(slmviz.load_transcoders("plt", model=tiny).coder(0).W_enc, ts.coder(0).W_enc)


def test_an_saes_scan_is_prepared_once_for_its_weights(tiny, tmp_path, monkeypatch):
    """prepare_sae_scans (what prepares the bundled SAEs' scans with the set): the same documents as the set's scan,
    equal to slmviz.scan with the SAE spliced, read back only for the weights it was made with."""
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    d = tiny.cfg.d_model
    sae = SAE.random(d, 32, seed=0, architecture="relu", hook_name="blocks.1.hook_resid_post")
    other = SAE.random(d, 32, seed=1, architecture="relu", hook_name="blocks.1.hook_resid_post")
    folders = prepare_sae_scans(tiny, {"resid_l1": sae}, corpus=CORPUS, progress=False)
    assert folders == {"resid_l1": sae_scan_dir(tiny, "resid_l1")}
    s, docs = load_sae_scan(tiny, "resid_l1", sae)
    reference = slmviz.scan(docs, hooks=[acts_hook(sae)], saes=[sae], model=tiny, top_k=SCAN_TOP_K, progress=False)
    assert docs == scan_docs(tiny, CORPUS) and torch.equal(s.stats[acts_hook(sae)].top_key,
                                                          reference.stats[acts_hook(sae)].top_key)
    assert load_sae_scan(tiny, "resid_l1", other) is None  # made for other weights: not read
    prepare_sae_scans(tiny, {"resid_l1": other}, corpus=CORPUS, progress=False)  # replaced for the new weights
    assert load_sae_scan(tiny, "resid_l1", other) is not None and load_sae_scan(tiny, "resid_l1", sae) is None


def test_a_prepared_name_beside_the_trainers_kinds_trains_the_kind_it_names(tiny, tmp_path, monkeypatch):
    """Another prepared name ("plt-quick") trains as the kind TRAINED_AS gives it, whoever gives the recipe (a fixed
    one or the overrides of a model without one): kept under its own name's folder and loaded by that name. A name
    that is neither refuses, and a recipe cannot choose the trainer itself."""
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    monkeypatch.setitem(RECIPES, ("tiny", "plt-quick"), dict(corpus=CORPUS, **TINY))
    ts = prepare_transcoders(tiny, "plt-quick", progress=False)
    assert (prepared_dir(tiny, "plt-quick") / SET_FILE).is_file() and not prepared_dir(tiny, "plt").exists()
    assert ts.name == "tiny-plt-quick" and ts.layers == [0, 1]
    loaded = slmviz.load_transcoders("plt-quick", model=tiny)
    assert torch.equal(loaded.coder(1).W_dec, ts.coder(1).W_dec)
    with pytest.raises(ValueError, match="kind must be one of"):
        prepare_transcoders(tiny, "other", progress=False, corpus=CORPUS, **TINY)
    with pytest.raises(ValueError, match="the prepared name does .'plt-quick' trains as 'plt'"):
        recipe("tiny", "plt-quick", {"kind": "clt", **TINY})


def test_a_second_build_of_a_models_sets_is_refused_while_one_runs_and_loses_nothing(tiny, tmp_path, monkeypatch):
    """While one build holds the model's lock (another process's `slmviz prepare`, or the app's job), preparing any
    of its sets is refused with a message that says to wait; the refused call wrote nothing, and once the first build
    is done the same call prepares its set."""
    from filelock import FileLock

    from slmviz.training.prepare import LOCK_FILE, PrepareBusyError

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    monkeypatch.setitem(RECIPES, ("tiny", "plt-quick"), dict(corpus=CORPUS, **TINY))
    other = FileLock(prepared_dir(tiny, "plt").parent / LOCK_FILE)
    prepared_dir(tiny, "plt").parent.mkdir(parents=True)
    with other:  # a file lock held by another holder: the same call from another process is refused alike
        with pytest.raises(PrepareBusyError, match="another build of tiny's prepared transcoders is running"):
            prepare_transcoders(tiny, "plt-quick", progress=False)
        assert not prepared_dir(tiny, "plt-quick").exists()
    ts = prepare_transcoders(tiny, "plt-quick", progress=False)
    assert (prepared_dir(tiny, "plt-quick") / SET_FILE).is_file() and ts.layers == [0, 1]
    prepare_transcoders(tiny, "plt-quick", progress=False)  # the lock was released


class Stopped(Exception):
    """What a cancelled job's progress report raises (app/jobs.py's JobCancelled), mid-scan."""


def folder_bytes(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_damaged_set_scan_is_written_again_whole_and_a_stopped_rebuild_leaves_the_old_one(tiny, tmp_path,
                                                                                              monkeypatch):
    """A set's scan that cannot be read is a ScanFormatError saying where; prepare_set_scan writes it again. A rebuild
    stopped while scanning, one whose save fails half-way, and one whose final rename fails all leave the old
    folder byte for byte as it was, with nothing beside it; the rebuild that finishes is slmviz.scan's."""
    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    d = tiny.cfg.d_model
    coders = [SAE.random(d, 32, seed=layer, architecture="relu", hook_name=f"blocks.{layer}.mlp.hook_in",
                         hook_name_out=f"blocks.{layer}.hook_mlp_out") for layer in (0, 1)]
    folder = set_scan_dir(tiny, "plt")
    prepare_set_scan(tiny, coders, "plt", corpus=CORPUS, progress=False)
    weights = folder / "scan.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ScanFormatError, match=f"the prepared scan in {folder} could not be read"):
        load_set_scan(tiny, "plt")
    damaged = folder_bytes(folder)

    def stop(update) -> None:
        raise Stopped

    with pytest.raises(Stopped):
        prepare_set_scan(tiny, coders, "plt", corpus=CORPUS, progress=stop)
    assert folder_bytes(folder) == damaged and [p.name for p in folder.parent.iterdir()] == ["scan"]

    def half_saved(self, where):  # the disk fills up after the first file
        (Path(where) / "scan.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    with monkeypatch.context() as m:
        m.setattr(Scan, "save", half_saved)
        with pytest.raises(OSError, match="No space left"):
            prepare_set_scan(tiny, coders, "plt", corpus=CORPUS, progress=False)
    assert folder_bytes(folder) == damaged and [p.name for p in folder.parent.iterdir()] == ["scan"]

    rename = Path.rename

    def refused(self, target):  # the finished scan cannot be renamed in: the old one is put back
        if self.name.startswith(".scan-") and "-old-" not in self.name:
            raise PermissionError("read-only folder")
        return rename(self, target)

    with monkeypatch.context() as m:
        m.setattr(Path, "rename", refused)
        with pytest.raises(PermissionError):
            prepare_set_scan(tiny, coders, "plt", corpus=CORPUS, progress=False)
    assert folder_bytes(folder) == damaged and [p.name for p in folder.parent.iterdir()] == ["scan"]

    s, docs = prepare_set_scan(tiny, coders, "plt", corpus=CORPUS, progress=False)
    assert [p.name for p in folder.parent.iterdir()] == ["scan"]
    read, read_docs = load_set_scan(tiny, "plt")
    reference = slmviz.scan(docs, hooks=[acts_hook(c) for c in coders], saes=coders, model=tiny, top_k=SCAN_TOP_K,
                            progress=False)
    assert read_docs == docs == scan_docs(tiny, CORPUS)
    for hook in reference.hooks:
        assert torch.equal(read.stats[hook].top_key, reference.stats[hook].top_key), hook
