"""train_sae, evaluate_sae and the rows an SAE sees (slmviz.training: train, loop, sae_objective, sparse, rows;
features.evaluate, features.activations).

On a tiny random LLaMA (built once for this module) and on synthetic activations; no real model is loaded here.
Not covered: the bundled SAEs' quality (bench/results/perf.md "Features" records evaluate_sae on held-out text) and
training throughput (bench/peers/sae_train.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import build_tiny_model

import slmviz
from slmviz.corpora.reading import CorpusError
from slmviz.features.activations import batch_ids, sae_rows
from slmviz.features.evaluate import Totals, evaluate_sae
from slmviz.features.sae import SAE
from slmviz.formats.checkpoint import CheckpointError, read_checkpoint
from slmviz.training.config import TrainConfig
from slmviz.training.loop import Trainer, training_batches
from slmviz.training.rows import block_rows, forward_hooks, plan_blocks, sae_batch_shape, threshold_rows
from slmviz.training.sae_objective import SAEObjective
from slmviz.training.sparse import (
    CUT_SAMPLE_STRIDE,
    batch_threshold,
    batch_top_k,
    batch_top_k_cut,
    dead_feature_decode,
    decode_sparse,
    gather,
    linear_fit,
    unit_scale,
)
from slmviz.training.train import train_sae

HOOK = "blocks.1.hook_resid_post"
SMALL = dict(d_sae=64, k=4, batch_tokens=128, window=16, forward_tokens=128, buffer_tokens=512, progress=False,
             dtype="float32", checkpoint_every=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return slmviz.load(build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama_gqa"))


@pytest.fixture(scope="module")
def corpus():
    return [" ".join(f"w{(i * 7 + j * 3) % 120}" for j in range(20 + i % 13)) for i in range(60)]


def test_massive_rows_are_dropped():
    """A window's first position and a row far above the batch's median norm are dropped; ordinary rows stay,
    including one at 9x the median (Gemma's punctuation rows reach ~10x and are real tokens)."""
    torch.manual_seed(0)
    x = torch.randn(10, 8)
    x = x / x.norm(dim=-1, keepdim=True)
    x[3] *= 100.0  # a sink in mid-window
    x[5] *= 9.0
    first = torch.zeros(10, dtype=torch.bool)
    first[0] = True
    keep = sae_rows(x, first)
    assert keep.tolist() == [False, True, True, False, True, True, True, True, True, True]
    y = torch.ones(10, 4)
    y[7] *= 1000.0  # a transcoder's target can be the massive one
    assert not sae_rows(x, first, y)[7]


def test_decoder_stops_after_a_layer(tiny):
    ids = torch.tensor([[3, 5, 7, 9], [2, 4, 6, 8]])
    ctx = slmviz.hooks.build_context(tiny.hook_names, ["blocks.0.hook_resid_post"], batched=True)
    out = tiny.decoder.forward(ids, ctx, slmviz.resolve_variant(None), stop_after_layer=0)
    assert torch.equal(out, ctx.store["blocks.0.hook_resid_post"])
    assert "blocks.1.hook_resid_pre" not in ctx.store


def _planted(n_rows: int, d: int = 32, n_dirs: int = 48, active: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(n_dirs, d, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    which = torch.rand(n_rows, n_dirs, generator=g).topk(active, dim=-1).indices  # [n, active]
    mags = 1 + torch.rand(n_rows, active, generator=g)
    x = (mags[..., None] * dirs[which]).sum(1) + 0.01 * torch.randn(n_rows, d, generator=g)
    return x, dirs


def _config(hook_out: str = HOOK, **kw) -> TrainConfig:
    base = dict(kind="sae", model="synthetic", hooks=((HOOK, hook_out),), d_in=32, d_out=32, d_sae=96, k=3,
                architecture="topk", tokens=80 * 256, lr=3e-3, batch_tokens=256, seed=0, dtype="float32", window=16,
                forward_tokens=128, buffer_tokens=4096, dead_window=2048, aux_coefficient=1.0, lr_decay=0.2, corpus="",
                massive_factor=20.0)
    return TrainConfig(**{**base, **kw})


def _trainer(cfg: TrainConfig) -> Trainer:
    """One coder's trainer, as a run of `cfg` holds it: rows go in as [n, 1, d] (one layer)."""
    return Trainer(SAEObjective(cfg, cfg.hooks, torch.device("cpu")))


@pytest.mark.parametrize("architecture", ["topk", "batchtopk"])
def test_training_recovers_planted_directions(architecture):
    """Rows made of 3 of 48 planted unit directions: most directions get a decoder row at cosine > 0.9. Does not
    cover the model's activations (the bundled SAEs' evaluation does)."""
    x, dirs = _planted(300 * 256)
    trainer = _trainer(_config(architecture=architecture, lr=1e-2, tokens=300 * 256))
    coder = trainer.objective
    coder.initialise(x[:4096, None], x[:4096, None])
    for i in range(300):
        rows = coder.inputs(x[i * 256:(i + 1) * 256, None])
        trainer.step(rows, rows)
        trainer.cursor.tokens += 256
    sae = coder.result(trainer.cursor.tokens, {})
    w = sae.W_dec / sae.W_dec.norm(dim=-1, keepdim=True)
    best = (dirs @ w.T).max(-1).values  # [n_dirs]
    assert (best > 0.9).float().mean() >= 0.8, best


def test_saved_sae_computes_what_training_computed():
    """The folds (decoder norms to 1, the input scale into the weights) leave a TopK SAE's output unchanged."""
    x, _ = _planted(1024)
    coder = _trainer(_config(lr=1e-2)).objective
    coder.initialise(x[:, None], x[:, None])
    with torch.no_grad():
        coder.W_dec.mul_(torch.rand(96, 1) + 0.5)  # rows of unequal norm, as training leaves them
        coder.b_enc.add_(0.01 * torch.randn(96))
        s = coder.scale_in[0]
        h = ((x * s - coder.b_dec) @ coder.W_enc + coder.b_enc) * coder.W_dec.norm(dim=-1)
        rows, feats, acts = coder.activate(0, h)
        norms = coder.W_dec.norm(dim=-1)
        y_train = (decode_sparse(rows, feats, acts / norms[feats], coder.W_dec, 1024) + coder.b_dec) / s
        sae = coder.result(0, {})
        assert torch.allclose(sae(x), y_train, rtol=1e-4, atol=1e-5)
        assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(96))


def test_interrupted_run_resumes_to_the_same_weights(tiny, corpus, tmp_path):
    """A run stopped by an exception right after a checkpoint (what kill -9 leaves: the last checkpoint on disk)
    and resumed ends with exactly the weights of a run never stopped."""
    whole = train_sae(tiny, HOOK, corpus, tokens=2000, out=tmp_path / "whole", **SMALL)
    steps = read_checkpoint(tmp_path / "whole").coders["sae"]["cursor"]["steps"]

    def stop(update):
        stats = update.stats
        if stats["step"] == steps // 2:
            raise KeyboardInterrupt  # after the step, before its checkpoint: the previous one is on disk

    with pytest.raises(KeyboardInterrupt):
        train_sae(tiny, HOOK, corpus, tokens=2000, out=tmp_path / "cut", **{**SMALL, "progress": stop})
    assert read_checkpoint(tmp_path / "cut").coders["sae"]["cursor"]["steps"] == steps // 2 - 1
    resumed = train_sae(tiny, HOOK, corpus, tokens=2000, out=tmp_path / "cut", **SMALL)
    for name, t in whole.tensors().items():
        assert torch.equal(t, resumed.tensors()[name]), name
    again = train_sae(tiny, HOOK, corpus, tokens=2000, out=tmp_path / "cut", **SMALL)  # finished: loaded
    assert torch.equal(again.W_dec, whole.W_dec)


def test_a_run_is_extended_before_its_decay_to_what_a_longer_run_gives(tiny, corpus, tmp_path):
    """tokens may change on resume while the run is still at its constant learning rate: the result equals a run
    started with the new total. After the decay began, a change is refused."""
    def stop(update):
        stats = update.stats
        if stats["tokens"] >= 600:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_sae(tiny, HOOK, corpus, tokens=1500, out=tmp_path / "cut", **{**SMALL, "progress": stop})
    extended = train_sae(tiny, HOOK, corpus, tokens=2500, out=tmp_path / "cut", **SMALL)
    longer = train_sae(tiny, HOOK, corpus, tokens=2500, out=tmp_path / "long", **SMALL)
    assert torch.equal(extended.W_enc, longer.W_enc) and torch.equal(extended.b_dec, longer.b_dec)
    with pytest.raises(CheckpointError, match="tokens: 2500 there, 3000 now"):
        train_sae(tiny, HOOK, corpus, tokens=3000, out=tmp_path / "long", **SMALL)


def test_a_transcoder_trains_and_saves_as_jumprelu(tiny, corpus, tmp_path):
    tc = train_sae(tiny, "blocks.1.mlp.hook_in", corpus, hook_out="blocks.1.hook_mlp_out", architecture="batchtopk",
                   tokens=1500, out=tmp_path / "tc", **SMALL)
    assert tc.is_transcoder and tc.architecture == "jumprelu" and tc.threshold.min() > 0
    l0 = evaluate_sae(tc, corpus, model=tiny, progress=False)["l0"]
    assert 0.5 * SMALL["k"] <= l0 <= 1.5 * SMALL["k"], l0  # the threshold keeps ~k per token, as training did
    loaded = slmviz.load_sae(tmp_path / "tc", model=tiny)
    assert loaded.hook_name_out == "blocks.1.hook_mlp_out" and torch.equal(loaded.W_enc, tc.W_enc)


def _linear_plus_sparse(n_rows: int, d: int = 32, n_dirs: int = 48, seed: int = 1):
    """x: dense noise plus 3 of 48 planted directions; y = a dense linear map of x plus a sparse part (each active
    direction writes its own output direction with its magnitude). k=3 features cannot carry the dense linear part
    of the noise; a skip connection can."""
    g = torch.Generator().manual_seed(seed)
    dirs = torch.randn(n_dirs, d, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    which = torch.rand(n_rows, n_dirs, generator=g).topk(3, dim=-1).indices  # [n, 3]
    mags = 1 + torch.rand(n_rows, 3, generator=g)
    x = (mags[..., None] * dirs[which]).sum(1) + 0.3 * torch.randn(n_rows, d, generator=g)
    M = torch.randn(d, d, generator=g) / math.sqrt(d)
    out_dirs = torch.randn(n_dirs, d, generator=g) / math.sqrt(d)
    return x, x @ M + (mags[..., None] * out_dirs[which]).sum(1)


def _trained(cfg: TrainConfig, x: torch.Tensor, y: torch.Tensor, steps: int) -> SAEObjective:
    trainer = _trainer(cfg)
    coder = trainer.objective
    coder.initialise(x[:4096, None], y[:4096, None])
    for i in range(steps):
        rows = slice(i * 256, (i + 1) * 256)
        trainer.step(coder.inputs(x[rows, None]), coder.targets(y[rows, None]))
        trainer.cursor.tokens += 256
    return coder


def test_the_skip_init_is_the_float64_least_squares_fit():
    """linear_fit runs its row products in fp32 and only the solve in float64: on anisotropic rows (scales spread
    over three decades, an offset, noise) it equals the ridge-regularised normal equations solved in float64 to
    fp32 rounding, and with the ridge near 0 it recovers a planted map; unit_scale is SAELens's factor."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 48, generator=g) * torch.logspace(-1, 2, 48) + 3.0
    W_true = torch.randn(32, 48, generator=g) / 8
    y = x @ W_true.T + 0.5 + 0.01 * torch.randn(4000, 32, generator=g)
    W, b = linear_fit(x, y)
    xd, yd = x.double(), y.double()
    xc = xd - xd.mean(0)
    cov = xc.T @ xc
    cov += 1e-3 * cov.diagonal().mean() * torch.eye(48, dtype=torch.float64)
    W_ref = torch.linalg.solve(cov, xc.T @ (yd - yd.mean(0))).T
    assert W.dtype == torch.float64
    assert (W - W_ref).norm() / W_ref.norm() < 1e-4
    assert torch.allclose(b, yd.mean(0) - xd.mean(0) @ W_ref.T, rtol=1e-4, atol=1e-4)
    W0, b0 = linear_fit(x, y, ridge=1e-9)
    assert torch.allclose(W0, W_true.double(), atol=1e-2)
    assert float((xd @ W0.T + b0 - yd).pow(2).mean().sqrt()) < 0.0105  # the planted noise's 0.01, no more
    s = unit_scale(x)
    assert math.isclose(float((s * xd).pow(2).sum(-1).mean()), 48, rel_tol=1e-9)


def test_a_skip_transcoder_beats_the_plain_one_on_planted_data():
    """Targets with a dense linear part: the skip transcoder (W_skip learned, from 0) explains much more held-out
    variance than the plain one with the same width, k and steps, and its saved SAE (folds included, W_skip
    scaled by s_in / s_out) computes what training computed."""
    x, y = _linear_plus_sparse(200 * 256 + 4096)
    x_test, y_test = x[-4096:], y[-4096:]
    tc = dict(hook_out="blocks.1.hook_mlp_out", architecture="batchtopk", lr=1e-2, tokens=200 * 256)
    ev = {}
    for skip in (False, True):
        coder = _trained(_config(**tc, skip=skip), x, y, 200)
        sae = coder.result(200 * 256, {})
        assert (sae.W_skip is not None) == skip
        y_hat = sae(x_test).detach()
        ev[skip] = float(1 - (y_hat - y_test).pow(2).sum() / (y_test - y_test.mean(0)).pow(2).sum())
        if skip:
            s_in, s_out = coder.scale_in[0], coder.scale_out[0]
            with torch.no_grad():
                xs = x_test * s_in
                h = (xs @ coder.W_enc + coder.b_enc) * coder.W_dec.norm(dim=-1)
                f = h.relu() * (h > coder.threshold[0])
                y_train = (f / coder.W_dec.norm(dim=-1)) @ coder.W_dec + coder.b_dec + xs @ coder.W_skip.T
            assert torch.allclose(y_hat, y_train / s_out, rtol=1e-4, atol=1e-4)
    assert ev[True] > 0.85 and ev[True] > ev[False] + 0.1, ev


def test_a_skip_transcoder_saves_loads_and_resumes_exactly(tiny, corpus, tmp_path):
    """skip=True: saved as SAELens's jumprelu_skip_transcoder, loaded back by load_sae with the same W_skip, and
    an interrupted run resumes (W_skip and its Adam state in the checkpoint) to the weights of an uninterrupted one."""
    kw = dict(hook_out="blocks.1.hook_mlp_out", architecture="batchtopk", skip=True, tokens=1500, **SMALL)
    whole = train_sae(tiny, "blocks.1.mlp.hook_in", corpus, out=tmp_path / "whole", **kw)
    assert whole.W_skip is not None and whole.W_skip.abs().sum() > 0
    assert json.loads((tmp_path / "whole" / "cfg.json").read_text())["architecture"] == "jumprelu_skip_transcoder"
    loaded = slmviz.load_sae(tmp_path / "whole", model=tiny)
    assert torch.equal(loaded.W_skip, whole.W_skip) and torch.equal(loaded.threshold, whole.threshold)
    steps = read_checkpoint(tmp_path / "whole").coders["sae"]["cursor"]["steps"]

    def stop(update):
        stats = update.stats
        if stats["step"] == steps // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_sae(tiny, "blocks.1.mlp.hook_in", corpus, out=tmp_path / "cut", **{**kw, "progress": stop})
    resumed = train_sae(tiny, "blocks.1.mlp.hook_in", corpus, out=tmp_path / "cut", **kw)
    for name, t in whole.tensors().items():
        assert torch.equal(t, resumed.tensors()[name]), name
    with pytest.raises(CheckpointError, match="skip: True there, False now"):
        train_sae(tiny, "blocks.1.mlp.hook_in", corpus, out=tmp_path / "cut", **{**kw, "skip": False})
    with pytest.raises(ValueError, match="skip=True is for transcoders"):
        train_sae(tiny, HOOK, corpus, tokens=100, out=tmp_path / "s", skip=True, **SMALL)


def test_blocks_hold_a_bounded_number_of_rows(tiny, corpus):
    """Memory: one block of at most buffer_tokens + one forward batch of rows, however long the corpus is."""
    cfg = _config(window=16, forward_tokens=128, buffer_tokens=512)
    sizes = [block_rows(tiny, b, cfg, {"sae": cfg.hooks})["sae"].seen for b in plan_blocks(tiny, corpus * 4, cfg)]
    assert len(sizes) > 4 and max(sizes) <= 512 + 128


def test_training_forwards_have_few_shapes(tiny, corpus):
    """Every training forward is padded to one of LENGTH_BUCKETS shapes (oneDNN caches one primitive per shape, so
    more shapes grow a bf16 run's memory), every window lands in exactly one batch, and padding keeps the rows."""
    cfg = _config(window=16, forward_tokens=128, buffer_tokens=512)
    docs = [t[: 5 + 7 * i] for i, t in enumerate(corpus)]  # many lengths, so every bucket is used
    shapes, seen = set(), []
    for block in plan_blocks(tiny, docs, cfg):
        for batch in block.batches:
            shape = sae_batch_shape(max(len(w.ids) for w in batch.windows), cfg)
            ids, real = batch_ids(batch, shape)
            shapes.add(tuple(ids.shape))
            assert real.sum() == batch.n_tokens and len(batch.windows) <= shape[0]
            seen += [(w.doc, w.offset) for w in batch.windows]
    assert shapes <= {(32, 4), (16, 8), (10, 12), (8, 16)} and len(shapes) >= 3
    windows = slmviz.scans.batches.iter_windows(tiny.tokenizer, docs, 16)
    assert sorted(seen) == sorted((w.doc, w.offset) for w in windows)
    # a padded forward gives the same rows as the unpadded one
    block = next(plan_blocks(tiny, docs, cfg))
    batch = block.batches[0]
    plain = forward_hooks(tiny, batch_ids(batch)[0], [HOOK])[HOOK]
    padded_ids, real = batch_ids(batch, sae_batch_shape(max(len(w.ids) for w in batch.windows), cfg))
    padded = forward_hooks(tiny, padded_ids, [HOOK])[HOOK]
    torch.testing.assert_close(padded[real], plain[batch_ids(batch)[1]], rtol=1e-5, atol=1e-5)


def test_training_steps_have_one_shape():
    """A block's rows are cut into steps of exactly batch rows (the last topped up from the block's first rows),
    so the SAE step's matmuls meet one shape whatever the block's size."""
    order = torch.randperm(1000, generator=torch.Generator().manual_seed(0))
    steps = training_batches(order, 128)
    assert {len(s) for s in steps} == {128} and len(steps) == 8
    assert set(torch.cat(steps).tolist()) == set(range(1000))
    assert torch.equal(steps[-1][-(128 * 8 - 1000):], order[:128 * 8 - 1000])
    assert [len(s) for s in training_batches(order[:100], 128)] == [100]
    assert len(training_batches(order[:512], 128)) == 4


def test_the_threshold_sample_spans_the_corpus(tiny, corpus):
    """BatchTopK's final threshold is measured on rows from blocks spread over the whole corpus (the first and the
    last among them), not on the last block's rows, which can be one long document."""
    cfg = _config(window=16, forward_tokens=128, buffer_tokens=256)
    readers = {"sae": cfg.hooks}
    blocks = [block_rows(tiny, b, cfg, readers)["sae"].x[:, 0] for b in plan_blocks(tiny, corpus, cfg)]
    assert len(blocks) >= 6  # blocks=4 of 6 draws from blocks 0, 2, 3 and 5
    sample = threshold_rows(tiny, corpus, cfg, readers, rows=60, blocks=4)["sae"]
    assert sample.shape == (60, 1, tiny.cfg.d_model)
    sample = sample[:, 0]

    def holds(rows: torch.Tensor) -> bool:  # some sample row is one of `rows`
        return bool(torch.cdist(sample, rows).min() < 1e-5)

    assert holds(blocks[0]) and holds(blocks[-1]) and not holds(blocks[1])


def test_bad_input_is_a_clear_error(tiny, corpus, tmp_path):
    with pytest.raises(CorpusError, match="no tokens"):
        train_sae(tiny, HOOK, ["", ""], tokens=100, out=tmp_path / "empty", **SMALL)
    with pytest.raises(ValueError, match="k=65 is larger than d_sae=64"):
        train_sae(tiny, HOOK, corpus, tokens=100, out=tmp_path / "k", **{**SMALL, "k": 65})
    with pytest.raises(ValueError, match="Unknown hook name"):
        train_sae(tiny, "blocks.1.ln1_post.hook_normalized", corpus, tokens=100, out=tmp_path / "h", **SMALL)
    with pytest.raises(CorpusError, match="list of strings or a file path"):
        train_sae(tiny, HOOK, (t for t in corpus), tokens=100, out=tmp_path / "g", **SMALL)
    train_sae(tiny, HOOK, corpus, tokens=300, out=tmp_path / "run", **SMALL)
    with pytest.raises(slmviz.SAEError, match="d_sae: 64 there, 32 now") as refused:  # one family: 0.2.0's too
        train_sae(tiny, HOOK, corpus, tokens=300, out=tmp_path / "run", **{**SMALL, "d_sae": 32})
    assert isinstance(refused.value, CheckpointError)
    with pytest.raises(CheckpointError, match="corpus"):
        train_sae(tiny, HOOK, corpus[:-1], tokens=300, out=tmp_path / "run", **SMALL)


def _identity_like(d: int, hook: str) -> SAE:
    """relu([x, -x]) @ [I; -I] = x exactly."""
    sae = SAE(d, 2 * d, architecture="relu", hook_name=hook)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([torch.eye(d), -torch.eye(d)], 1))
        sae.W_dec.copy_(torch.cat([torch.eye(d), -torch.eye(d)], 0))
    return sae


@pytest.mark.parametrize("hook", [HOOK, "blocks.0.hook_mlp_out"])
def test_identity_scores_one_and_zero_scores_zero(tiny, corpus, hook):
    d = tiny.cfg.d_model
    ident = evaluate_sae(_identity_like(d, hook), corpus, model=tiny, progress=False)
    assert ident["ce_loss_score"] == pytest.approx(1, abs=1e-6) and ident["kl_score"] == pytest.approx(1, abs=1e-6)
    assert ident["explained_variance"] == pytest.approx(1) and ident["frac_dead"] == 0
    zero = evaluate_sae(SAE(d, 8, architecture="relu", hook_name=hook), corpus, model=tiny, progress=False)
    assert zero["ce_loss_score"] == pytest.approx(0, abs=1e-9) and zero["kl_score"] == pytest.approx(0, abs=1e-9)
    assert zero["l0"] == 0 and zero["frac_dead"] == 1 and zero["ce_sae"] == zero["ce_zero"]


def test_explained_variance_is_over_all_tokens():
    """Two batches with different means: the formula over all rows, not the mean of per-batch values."""
    y = torch.tensor([[1.0, 0.0], [3.0, 0.0], [10.0, 2.0], [14.0, 2.0]])
    y_hat = torch.tensor([[2.0, 0.0], [2.0, 0.0], [12.0, 2.0], [12.0, 2.0]])  # each batch's mean
    totals = Totals(2, 4)
    for rows in (slice(0, 2), slice(2, 4)):
        totals.add_rows(y[rows], y_hat[rows], torch.zeros(2, 4))
    sse = (y - y_hat).pow(2).sum()
    assert totals.metrics()["explained_variance"] == pytest.approx(float(1 - sse / (y - y.mean(0)).pow(2).sum()))
    assert not math.isclose(totals.metrics()["explained_variance"], 0.0)  # per batch it would be exactly 0


def test_command_line_trains_and_evaluates(tiny, corpus, tmp_path, capsys):
    from slmviz.cli import main

    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(corpus) + "\n")
    argv = ["train-sae", "--model", str(tiny.path), "--hook", HOOK, "--corpus", str(path), "--d-sae", "32", "--k", "4",
            "--tokens", "400", "--out", str(tmp_path / "sae"), "--batch-tokens", "128", "--window", "16",
            "--forward-tokens", "128", "--buffer-tokens", "512", "--dtype", "float32", "--no-progress"]
    assert main(argv) == 0
    sae = SAE.load(tmp_path / "sae")
    assert sae.metadata["training_command"].startswith("slmviz train-sae --model")
    assert main(["evaluate-sae", str(tmp_path / "sae"), "--model", str(tiny.path), "--corpus", str(path),
                 "--no-progress", "--json", str(tmp_path / "m.json")]) == 0
    assert '"ce_loss_score"' in capsys.readouterr().out and (tmp_path / "m.json").is_file()


def test_bundled_saes_are_listed_and_carry_their_command():
    """Every bundled SAE folder reads as an SAE whose cfg.json records the command that trained it (on "mixed" or
    "balanced": broad text and the model's own chat, named in the command and in corpus_name) and its evaluations on
    the three held-out texts bench/tools/bundle_sae.py measures (broad, chat, hand-written modern prose). The real-model
    checks (hooks exist, widths match) are in the slow test below."""
    from slmviz.features.bundled import BUNDLED_DIR, bundled_sae_folder, bundled_saes

    models = [p.name for p in BUNDLED_DIR.iterdir() if p.is_dir()] if BUNDLED_DIR.is_dir() else []
    for name in models:
        for sae_name in bundled_saes(name):
            sae = SAE.load(bundled_sae_folder(sae_name, name))
            assert sae.metadata["training_command"].startswith("slmviz train-sae")
            corpus = sae.metadata["corpus_name"]
            assert corpus in ("mixed", "balanced") and f"--corpus {corpus} " in sae.metadata["training_command"]
            assert 0 < sae.metadata["evaluation"]["explained_variance"] <= 1
            evaluations = sae.metadata["evaluations"]
            assert set(evaluations) == {"broad-heldout", "chat-heldout", "modern-prose"}
            assert all(0 < e["explained_variance"] <= 1 for e in evaluations.values())
    assert bundled_saes("no-such-model") == [] and bundled_sae_folder("../x", "SmolLM2-135M-Instruct") is None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SmolLM2-135M-Instruct", "gemma-3-270m"])
def test_bundled_saes_load_on_their_model(name):
    from slmviz.features.bundled import bundled_sae_folder

    model = slmviz.load(name)
    names = slmviz.bundled_saes(model)
    assert names
    for sae_name in names:
        sae = slmviz.load_sae(bundled_sae_folder(sae_name, model), model=model)
        assert sae.dtype == torch.float32 and sae.hook_name in model.hook_names


def test_the_default_dtype_is_measured():
    """fastest_dtype times bf16 and fp32 matmuls here; which one wins depends on the CPU (AMX / avx512_bf16 or not),
    so the test pins only the contract, not the answer."""
    from slmviz.training.config import fastest_dtype

    assert fastest_dtype("cpu") in ("float32", "bfloat16")


def test_decode_sparse_has_autograds_gradients():
    """decode_sparse (an embedding bag) gives autograd's gradients of the dense decode codes @ W_dec, for W_dec and
    for the active values, with the codes of BatchTopK (unequal counts per row)."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(24, 40, generator=g)
    rows, feats, values = batch_top_k(h, 5)
    assert len(set(rows.tolist())) > 1 and torch.bincount(rows).unique().numel() > 1  # unequal counts per row
    W = torch.randn(40, 12, generator=g)
    grad = torch.randn(24, 12, generator=g)
    W_a, v_a = W.clone().requires_grad_(), values.detach().clone().requires_grad_()
    decode_sparse(rows, feats, v_a, W_a, 24).backward(grad)
    W_b, v_b = W.clone().requires_grad_(), values.detach().clone().requires_grad_()
    codes = torch.zeros(24, 40).index_put((rows, feats), v_b)
    (codes @ W_b).backward(grad)
    assert torch.allclose(W_a.grad, W_b.grad, atol=1e-5)
    assert torch.allclose(v_a.grad, v_b.grad, atol=1e-5)


def test_batch_top_k_keeps_the_k_b_largest_positive_entries_and_fills_ties_in_index_order():
    """BatchTopK keeps exactly the k*B largest entries of relu(h), grouped by row; ties at the cut fill the count
    in index order; zeros are never kept (a zero kept would count its feature as fired). Checked against a sort."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(16, 50, generator=g)
    rows, feats, values = batch_top_k(h, 4)
    want = h.flatten().topk(64).values
    assert torch.equal(values.sort().values, want.sort().values) and (rows.diff() >= 0).all()
    assert torch.equal(h[rows, feats], values)
    tied = torch.zeros(4, 10)
    tied[:, :3] = 2.0  # 12 entries equal: k*B = 8 of them, the first 8 in index order
    rows, feats, values = batch_top_k(tied, 2)
    assert values.tolist() == [2.0] * 8 and rows.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    skewed = torch.rand(16, 50, generator=g)
    skewed[3] += 10.0  # one row holds 50 of the 64 largest
    hidden = torch.rand(16, 50, generator=g)
    hidden.view(-1)[::CUT_SAMPLE_STRIDE] += 100.0  # the sample sees only the largest entries: every guess too high
    for a in (h.relu(), skewed, hidden):
        want_cut = a.flatten().sort(descending=True).values[64]  # the 65th largest: the largest left out
        assert batch_top_k_cut(a, 64) == want_cut
        assert torch.equal(batch_top_k(a, 4)[2].sort().values, a.flatten().topk(64).values.sort().values)
    few = torch.full((3, 10), -1.0)
    few[0, 4] = 0.5  # one positive entry where k*B = 6: only it is kept, no zeros
    rows, feats, values = batch_top_k(few, 2)
    assert rows.tolist() == [0] and feats.tolist() == [4] and values.tolist() == [0.5]


@pytest.mark.parametrize("n_dead", [7, 30])  # a fifth dead: the dense product; three quarters: the sparse decode
def test_dead_feature_decode_is_saelens_aux_reconstruction(n_dead):
    """The aux loss's reconstruction on either path equals SAELens's formula written out densely (the top k_aux
    raw pre-activations among dead features, divided by decoder norms, times W_dec), values and gradients."""
    g = torch.Generator().manual_seed(2)
    h0, W0 = torch.randn(16, 40, generator=g), torch.randn(40, 12, generator=g)
    dead = torch.zeros(40, dtype=torch.bool)
    dead[torch.randperm(40, generator=g)[:n_dead]] = True
    k_aux = min(6, n_dead)

    def run(fn):
        h, W = h0.clone().requires_grad_(), W0.clone().requires_grad_()
        out = fn(h, W, W.norm(dim=-1))
        out.pow(2).sum().backward()
        return out.detach(), h.grad, W.grad

    def reference(h, W, norms):
        masked = torch.where(dead[None], h, -torch.inf)
        top = masked.topk(k_aux, dim=-1).indices
        codes = torch.zeros_like(h).scatter(1, top, h.gather(1, top))
        return (codes / norms) @ W

    for got, want in zip(run(lambda h, W, n: dead_feature_decode(h, dead, k_aux, n, W)), run(reference), strict=True):
        assert torch.allclose(got, want, atol=1e-5)


def test_batch_threshold_keeps_k_per_row_on_average():
    """The saved JumpReLU threshold is the largest relu'd pre-activation below the k*n largest: relu(h) > threshold
    keeps exactly k*n entries when the values are distinct."""
    h = torch.randn(64, 300, generator=torch.Generator().manual_seed(3))
    t = batch_threshold(h, 5)
    assert t.dtype == torch.float64 and int((h.relu() > t).sum()) == 5 * 64
    assert t == h.relu().flatten().topk(5 * 64 + 1).values.min()


def test_a_corpus_the_model_cannot_embed_is_refused_before_any_forward(tmp_path, monkeypatch):
    """A model whose config's vocabulary (100) is smaller than its tokenizer's (128 ids): a corpus with a token the
    embedding lacks is refused by train_sae and train_transcoders (both kinds) with a CorpusError naming the id, the
    vocabulary size and the document, before the decoder runs once and before anything is written (today's trace
    refuses the same text with a PromptError). Does not cover evaluate_sae, which reads windows as they come."""
    import transformers
    from conftest import TINY_BASE, _write_tokenizer

    folder = tmp_path / "small_vocab"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**TINY_BASE, "vocab_size": 100}),
                                                  dtype=torch.float32).save_pretrained(folder)
    _write_tokenizer(folder, 128)
    model = slmviz.load(folder)
    with pytest.raises(slmviz.PromptError, match="outside the vocabulary"):
        model.trace("w3 w110")
    corpus = ["w1 w2 w3 w4 w5 w6"] * 30 + ["w7 w8 w110 w9"] + ["w1 w2"] * 30
    bad = max(model.tokenizer(corpus[30])["input_ids"])
    assert bad >= 100

    def no_forward(*args, **kwargs):
        raise AssertionError("the decoder ran before the corpus was checked")

    monkeypatch.setattr(model.decoder, "forward", no_forward)
    runs = {"sae": lambda out: train_sae(model, HOOK, corpus, tokens=300, out=out, **SMALL),
            "plt": lambda out: slmviz.train_transcoders(model, corpus=corpus, tokens=300, out=out, **SMALL),
            "clt": lambda out: slmviz.train_transcoders(model, kind="clt", corpus=corpus, tokens=300, out=out,
                                                        **SMALL)}
    for name, run in runs.items():
        with pytest.raises(CorpusError, match=rf"document 30 .*token id {bad} .*vocabulary of 100 ids"):
            run(tmp_path / name)
        assert not (tmp_path / name).exists(), name


@pytest.mark.usefixtures("two_threads")
def test_gathering_per_entry_values_has_one_gradient_however_often_it_runs():
    """A feature active in many rows gathers its decoder norm once per entry, and the gradients of the repeats are
    summed. sparse.gather (index_select) sums them in index order, so a step gives the same gradient every time and
    in every process; advanced indexing (t[index]) summed them with parallel atomic adds on two threads, and two
    builds of the quick set differed in every layer. At a quick-set step's size: 1,024 features, 32,768 entries."""
    g = torch.Generator().manual_seed(0)
    norms = torch.rand(1024, generator=g).requires_grad_()
    feats = torch.randint(0, 1024, (32_768,), generator=g)
    upstream = torch.randn(32_768, generator=g)
    grads = set()
    for _ in range(30):
        norms.grad = None
        (gather(norms, feats) * upstream).sum().backward()
        grads.add(norms.grad.numpy().tobytes())
    assert len(grads) == 1
    assert torch.equal(gather(norms, feats), norms[feats])
    reference = torch.zeros(1024, dtype=torch.float64).index_add_(0, feats, upstream.double())
    assert torch.allclose(norms.grad.double(), reference, rtol=1e-5, atol=1e-4)
