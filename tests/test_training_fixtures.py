"""The trainers give the weights 0.2.0's trainers gave: tests/data/v0_2/ holds the out folders its code wrote
(make_fixtures.py there lists the calls), and the runs it stopped part way (cut_*).

Each run is repeated here with make_fixtures.py's arguments, on the tiny model and corpus saved beside them, and every
saved tensor is compared with the fixture's (fp32 rounding: rtol 1e-5). A cut run of 0.2.0 copied into a fresh
folder resumes to its fixture's weights, and a finished one is loaded, not trained again. Does not cover: bf16 runs
(no fixture; the trainers' own tests run fp32 too), or figures on a real model (bench/).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import slmviz
from slmviz.formats.checkpoint import CheckpointError, read_checkpoint, run_finished
from slmviz.replacement.load import load_clt
from slmviz.training.config import TrainConfig

DATA = Path(__file__).resolve().parent / "data" / "v0_2"
SMALL = dict(d_sae=48, k=4, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512, progress=False,
             dtype="float32", checkpoint_every=0, tokens=1200)
RUNS = {  # make_fixtures.RUNS: fixture -> (trainer, its arguments beyond SMALL and the corpus)
    "sae": ("train_sae", dict(hook="blocks.1.hook_resid_post", architecture="topk")),
    "transcoder": ("train_sae", dict(hook="blocks.0.mlp.hook_in", hook_out="blocks.0.hook_mlp_out",
                                     architecture="batchtopk", skip=True)),
    "plt": ("train_transcoders", dict(kind="plt", architecture="batchtopk", skip=True)),
    "clt": ("train_transcoders", dict(kind="clt", architecture="batchtopk", skip=True)),
    "clt_plain": ("train_transcoders", dict(kind="clt", architecture="batchtopk", skip=False)),
}


@pytest.fixture(scope="module")
def tiny():
    return slmviz.load(DATA / "tiny_llama")


@pytest.fixture(scope="module")
def corpus():
    return json.loads((DATA / "corpus.json").read_text())


def train(name: str, model, corpus, out: Path):
    trainer, extra = RUNS[name]
    return getattr(slmviz, trainer)(model, corpus=corpus, out=out, **SMALL, **extra)


def tensors(name: str, result) -> dict[str, torch.Tensor]:
    """Every tensor of a trained object, by name (a set's by layer)."""
    if RUNS[name][1].get("kind") == "plt":
        return {f"{L}.{k}": v for L in result.layers for k, v in result.coder(L).tensors().items()}
    return dict(result.tensors())


def fixture(name: str, model):
    """The object 0.2.0 saved for run `name`, read by the public loaders."""
    folder = DATA / name
    if name in ("sae", "transcoder"):
        return slmviz.load_sae(folder, model=model)
    if name == "plt":
        return slmviz.load_transcoders(folder, model=model)
    return load_clt(folder, model=model)


def assert_same_tensors(name: str, got, want) -> None:
    a, b = tensors(name, got), tensors(name, want)
    assert a.keys() == b.keys()
    for key, t in b.items():
        u = a[key].detach().cpu()
        assert torch.allclose(u, t, rtol=1e-5, atol=1e-6 * float(t.abs().max())), \
            (name, key, float((u - t).abs().max()), float(t.abs().max()))


@pytest.mark.parametrize("name", list(RUNS))
def test_each_trainer_gives_the_weights_0_2_0_saved(tiny, corpus, tmp_path, name):
    assert_same_tensors(name, train(name, tiny, corpus, tmp_path / name), fixture(name, tiny))


@pytest.mark.parametrize("name", ["sae", "plt", "clt"])
def test_a_run_0_2_0_stopped_part_way_resumes_to_its_weights(tiny, corpus, tmp_path, name):
    out = tmp_path / f"cut_{name}"
    shutil.copytree(DATA / f"cut_{name}", out)
    assert run_finished(out) is False
    assert_same_tensors(name, train(name, tiny, corpus, out), fixture(name, tiny))
    assert run_finished(out) is True


@pytest.mark.parametrize("name", list(RUNS))
def test_a_finished_0_2_0_run_is_loaded_not_trained_again(tiny, corpus, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    assert run_finished(out) is True
    trainer, extra = RUNS[name]
    again = getattr(slmviz, trainer)(tiny, corpus=corpus, out=out, **{**SMALL, **extra, "progress": pytest.fail})
    want = fixture(name, tiny)
    for key, t in tensors(name, want).items():
        assert torch.equal(tensors(name, again)[key].cpu(), t), key


def test_a_clt_checkpoint_from_before_the_pre_activation_loss_reads_as_without_it(tiny, corpus, tmp_path):
    """A CLT header without pre_act_coefficient (0.2.0's, as written before the loss existed) reads as 0, so its
    finished run loads; a call with another coefficient is refused, naming it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = tmp_path / "clt"
    shutil.copytree(DATA / "clt", folder)
    path = folder / "checkpoint.safetensors"
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["slmviz_train_clt_state"])
    del meta["config"]["pre_act_coefficient"]
    save_file({}, str(path), metadata={"slmviz_train_clt_state": json.dumps(meta)})
    assert TrainConfig.from_json(read_checkpoint(folder).config).pre_act_coefficient == 0.0
    extra = RUNS["clt"][1]
    loaded = slmviz.train_transcoders(tiny, corpus=corpus, out=folder, **SMALL, **extra)  # finished: loaded
    assert torch.equal(loaded.W_enc, fixture("clt", tiny).W_enc)
    with pytest.raises(CheckpointError, match="pre_act_coefficient: 0.0 there, 0.5 now"):
        slmviz.train_transcoders(tiny, corpus=corpus, out=folder, pre_act_coefficient=0.5, **SMALL, **extra)
