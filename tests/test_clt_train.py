"""train_transcoders(kind="clt"): a cross-layer transcoder trained from one forward per batch, resumable, on a tiny
random LLaMA (no real model here; CI never trains a full CLT).

Independent references: the trainer's own prediction in its scaled units against the saved CLT's formula on the
model's rows (the folding of scales and decoder norms), a run never interrupted (for resume), and the graph's
linear model (tests/test_clt.py's check) for the trained CLT.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz.corpora.named import resolve_corpus
from slmviz.formats.checkpoint import CheckpointError, read_checkpoint
from slmviz.graphs.attribution import attribution_graph
from slmviz.replacement.clt import CrossLayerTranscoder
from slmviz.replacement.load import load_clt
from slmviz.training.clt_objective import pre_act_loss
from slmviz.training.config import TrainConfig
from slmviz.training.loop import Run
from slmviz.training.rows import block_rows, checked_corpus, plan_blocks
from slmviz.training.train import train_transcoders

SMALL = dict(d_sae=48, k=4, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512, progress=False,
             dtype="float32", checkpoint_every=0)
PROMPT = [1, 7, 12, 3, 44, 9, 101, 23]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return slmviz.load(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa"))


@pytest.fixture(scope="module")
def corpus():
    return [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]


@pytest.fixture(scope="module")
def trained(tiny, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("clt") / "clt"
    return train_transcoders(tiny, kind="clt", corpus=corpus, tokens=1200, out=out, architecture="batchtopk",
                             skip=True, **SMALL), out


def test_a_batchtopk_clt_trains_saves_as_jumprelu_and_graphs_exactly(tiny, trained):
    clt, out = trained
    assert isinstance(clt, CrossLayerTranscoder) and clt.kind == "clt" and clt.architecture == "jumprelu"
    assert clt.n_layers == tiny.cfg.n_layers and clt.d_sae == 48 and clt.W_skip is not None
    assert clt.input_hook == "mlp.hook_in"
    back = load_clt(out, model=tiny)  # a JumpReLU CLT with a skip path: Gemma Scope 2's layout
    assert (out / "params_layer_0.safetensors").is_file()
    for k, v in clt.tensors().items():
        assert torch.equal(back.tensors()[k], v), k
    t = tiny.trace(PROMPT, saes=back)
    assert torch.equal(t.logits, tiny.trace(PROMPT).logits)
    l0 = [float((t[f"blocks.{L}.hook_mlp_out.hook_sae_acts_post"][1:] > 0).sum(-1).float().mean())
          for L in range(clt.n_layers)]
    assert all(0 < x < 4 * 4 for x in l0), l0  # BatchTopK's threshold keeps ~k per token (on this prompt: loosely)
    g = attribution_graph(PROMPT, transcoders=back, model=tiny, progress=False)
    kinds = g.nodes["kind"]
    target = torch.tensor(kinds.isin(["feature", "logit"]).to_numpy())
    assert g.n_features > 0
    got = (g.adjacency.sum(1) + g.constant)[target]
    assert torch.allclose(got, g.target_values[target], atol=3e-5 * g.target_values[target].abs().max(), rtol=0)


def test_the_saved_clt_is_the_trainers_prediction_in_model_units(tiny, corpus, tmp_path):
    """A TopK CLT (selection on h times decoder norms, as trained): for the training rows x, y of one block, the
    trainer's prediction in scaled units divided by each layer's output scale equals the saved CLT's formula on
    the model's own rows, and the loss it minimised is the squared error summed over layers."""
    out = tmp_path / "topk"
    seen = []
    clt = train_transcoders(tiny, kind="clt", corpus=corpus, tokens=1200, out=out, architecture="topk", skip=False,
                            lr=1e-2, **{**SMALL, "progress": lambda u: seen.append(u.stats)})
    assert seen[-1]["explained_variance"] > seen[0]["explained_variance"] + 0.1, [s["explained_variance"] for s in seen]
    assert seen[-1]["l0"] == 4 and seen[-1]["l0_total"] == 4 * tiny.cfg.n_layers
    assert clt.architecture == "topk" and clt.k == 4 and (out / "W_dec_0.safetensors").is_file()
    checkpoint = read_checkpoint(out)
    assert checkpoint.tensors == {}  # finished: the weights are the saved CLT's; train the run again, keeping its Run
    cfg = TrainConfig.from_json(checkpoint.config)
    run = Run(cfg)
    again = run.train(tiny, checked_corpus(resolve_corpus(corpus, tiny)), tmp_path / "again", False, 600)
    for k, v in clt.tensors().items():
        assert torch.equal(again.tensors()[k], v), k
    trainer = run.trainers["clt"]
    objective = trainer.objective
    block = next(plan_blocks(tiny, corpus, cfg))
    rows = block_rows(tiny, block, cfg, run.readers)["clt"]
    s_in = torch.tensor(objective.scale_in)[None, :, None]
    s_out = torch.tensor(objective.scale_out)[None, :, None]
    with torch.no_grad():
        x = rows.x[:64] * s_in
        hs, norms = objective.pre(x)
        y_hat = objective.decode([objective.activate(L, h) for L, h in enumerate(hs)], norms, x) / s_out
        formula = clt(rows.x[:64].transpose(0, 1)).transpose(0, 1)  # [rows, n, d]
    assert torch.allclose(formula, y_hat, atol=1e-4, rtol=1e-4), (formula - y_hat).abs().max()
    expected = ((y_hat - rows.y[:64]) * s_out).pow(2).sum(-1).mean(0).sum()
    stats = trainer.step(rows.x[:64] * s_in, rows.y[:64] * s_out)  # its statistics: of the prediction before the update
    assert stats["mse"] == pytest.approx(float(expected), rel=1e-4)


def test_a_clt_run_killed_mid_block_resumes_to_the_same_weights(tiny, corpus, trained, tmp_path):
    calls = []

    def stop(update):
        stats = update.stats
        calls.append(stats["tokens"])
        if len(calls) == 5:  # inside block 1 (blocks of ~4 steps here): the checkpoint holds a block half done
            raise KeyboardInterrupt

    args = dict(kind="clt", corpus=corpus, tokens=1200, out=tmp_path / "cut", architecture="batchtopk", skip=True)
    with pytest.raises(KeyboardInterrupt):
        train_transcoders(tiny, **args, **{**SMALL, "progress": stop})
    cursor = read_checkpoint(tmp_path / "cut").coders["clt"]["cursor"]
    assert cursor["batch"] > 0 and not cursor["finished"], cursor
    resumed = train_transcoders(tiny, **args, **SMALL)
    for k, v in trained[0].tensors().items():
        assert torch.equal(resumed.tensors()[k], v), k
    checkpoint = read_checkpoint(tmp_path / "cut")
    assert checkpoint.finished and checkpoint.tensors == {}  # the finished run's checkpoint keeps no weights
    from safetensors import safe_open

    with safe_open(str(tmp_path / "cut" / "checkpoint.safetensors"), framework="pt") as f:
        assert list(f.keys()) == []
    again = train_transcoders(tiny, **args, **SMALL)  # finished: loaded, not re-run
    assert torch.equal(again.W_enc, resumed.W_enc)
    with pytest.raises(CheckpointError, match="d_sae: 48 there, 32 now"):
        train_transcoders(tiny, **args, **{**SMALL, "d_sae": 32})


def test_clt_checkpoints_wait_for_checkpoint_every_not_each_block_end(tiny, corpus, tmp_path):
    """As the PLT sets' trainer: no checkpoint at a block's end before `checkpoint_every` has passed (a real CLT's
    is 1.75 GB): stopped in its second block, a run with an hour's interval has written none."""
    calls = []

    def stop(update):
        stats = update.stats
        calls.append(stats["tokens"])
        if len(calls) == 6:  # inside block 1: past block 0's end
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_transcoders(tiny, kind="clt", corpus=corpus, tokens=1200, out=tmp_path / "cut",
                          architecture="batchtopk", skip=True, **{**SMALL, "progress": stop, "checkpoint_every": 3600})
    assert read_checkpoint(tmp_path / "cut") is None


def test_a_prepared_clt_is_ready_only_once_its_run_says_finished(tiny, trained, tmp_path, monkeypatch):
    """replacement.prepared.prepared_ready(model, "clt"), what the app offers by: the CLT's files and a finished
    checkpoint. A run killed while writing its files (files there, the checkpoint not finished) is not ready."""
    import shutil

    from slmviz.formats.checkpoint import run_finished
    from slmviz.replacement.prepared import prepared_dir, prepared_ready

    monkeypatch.setenv("SLMVIZ_CACHE", str(tmp_path))
    folder = prepared_dir(tiny, "clt")
    assert not prepared_ready(tiny, "clt") and run_finished(folder) is None
    shutil.copytree(trained[1], folder)
    assert prepared_ready(tiny, "clt") and run_finished(folder) is True
    run = Run(TrainConfig.from_json(read_checkpoint(folder).config))
    run.save_checkpoint(folder)  # an unfinished cursor: as if killed between the files and the last checkpoint
    assert run_finished(folder) is False and not prepared_ready(tiny, "clt")


def test_what_a_clt_cannot_be_trained_as_is_refused(tiny, corpus, tmp_path):
    with pytest.raises(ValueError, match="every layer"):
        train_transcoders(tiny, kind="clt", layers=[1], corpus=corpus, tokens=100, out=tmp_path / "a", **SMALL)
    with pytest.raises(ValueError, match="no file format"):
        train_transcoders(tiny, kind="clt", corpus=corpus, tokens=100, out=tmp_path / "b", architecture="topk",
                          skip=True, **SMALL)
    with pytest.raises(ValueError, match="pre_act_coefficient"):
        train_transcoders(tiny, corpus=corpus, tokens=100, out=tmp_path / "plt", pre_act_coefficient=0.1, **SMALL)


def test_the_command_line_trains_a_clt(tiny, corpus, tmp_path, capsys):
    from slmviz.cli import main

    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus) + "\n")
    argv = ["train-transcoders", "--kind", "clt", "--model", str(tiny.path), "--corpus", str(path), "--d-sae", "32",
            "--k", "4", "--tokens", "300", "--out", str(tmp_path / "clt"), "--batch-tokens", "128",
            "--buffer-tokens", "512", "--dtype", "float32", "--no-skip", "--architecture", "topk", "--no-progress"]
    assert main(argv) == 0
    clt = load_clt(tmp_path / "clt")
    assert clt.architecture == "topk" and clt.d_sae == 32
    assert clt.metadata["training_command"].startswith("slmviz train-transcoders --kind clt")
    assert "CrossLayerTranscoder" in capsys.readouterr().out


def test_the_pre_activation_loss_is_anthropics_and_keeps_k_features_per_token(tiny, corpus, trained, tmp_path):
    """clt_objective.pre_act_loss against Anthropic's formula written from the raw weights, Σ_L mean over rows of
    Σ_f relu(-(x_L W_enc[L] + b_enc[L]))_f |W_dec[L][f]| (the decoder norm over every layer f writes); and what it
    is for: features pushed below zero on every row get no gradient from the reconstruction and stay there, while
    with the loss they come back above zero and BatchTopK keeps k again (clt_objective.pre_act_loss's docstring)."""
    torch.manual_seed(0)
    n, d, f = 3, 8, 24
    base = TrainConfig.from_json(read_checkpoint(trained[1]).config)
    hooks = tuple((f"blocks.{L}.mlp.hook_in", f"blocks.{L}.hook_mlp_out") for L in range(n))
    x, y = torch.randn(64, n, d), torch.randn(64, n, d)

    def trainer_with(coefficient: float):
        cfg = dataclasses.replace(base, hooks=hooks, d_in=d, d_out=d, d_sae=f, k=4, lr=1e-2,
                                  pre_act_coefficient=coefficient)
        t = Run(cfg).trainers["clt"]
        c = t.objective
        c.initialise(x, y)
        with torch.no_grad():  # every feature just below zero on every row: as if pushed down by the reconstruction
            for L in range(n):
                c.b_enc[L] -= (x[:, L] @ c.W_enc[L] + c.b_enc[L]).max(0).values + 0.02
        return t

    c = trainer_with(0.0).objective
    with torch.no_grad():
        by_hand = sum((-(x[:, L] @ c.W_enc[L] + c.b_enc[L])).relu() @ c.W_dec[L].flatten(1).norm(dim=-1)
                      for L in range(n)).mean()
        assert float(pre_act_loss(c.pre(x)[0])) == pytest.approx(float(by_hand), rel=1e-5)
    l0 = {}
    for coefficient in (0.0, 1.0):
        t = trainer_with(coefficient)
        seen = [t.step(x, y) for _ in range(20)]
        assert seen[0]["l0"] == 0 and (seen[0]["pre_act"] > 0) == (coefficient > 0)
        l0[coefficient] = seen[-1]["l0"]
    assert l0[0.0] == 0 and l0[1.0] == 4, l0
