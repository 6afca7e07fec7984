"""`slmviz.train_sae`: train a TopK or BatchTopK SAE (or transcoder) on a model's activations, offline, resumable.

    sae = slmviz.train_sae(m, hook="blocks.15.hook_resid_post", corpus="text.jsonl", d_sae=4608, k=32,
                           tokens=2_000_000, out="sae_l15")
    tc = slmviz.train_sae(m, hook="blocks.5.mlp.hook_in", hook_out="blocks.5.hook_mlp_out", ...)  # a transcoder

The training step is SAELens 6.54's TopKTrainingSAE / BatchTopKTrainingSAE (sae_lens/saes/topk_sae.py,
batchtopk_sae.py, training/sae_trainer.py): pre-activations h = (x - b_dec) @ W_enc + b_enc are multiplied by the
decoder row norms before the top-k (`rescale_acts_by_decoder_norm`), the decoder divides them back out, the loss is
the squared error summed over d and averaged over rows, plus the AuxK loss of Gao et al. 2024 (the top d_in/2
pre-activations of dead features reconstruct the detached residual, scaled by min(n_dead / (d_in/2), 1)); Adam
(0.9, 0.999), gradient norm clipped to 1, W_dec initialised with kaiming-uniform rows of norm 0.1 and W_enc = W_dec.T.
BatchTopK keeps the k*B largest activations of the whole batch and learns one threshold (an EMA, rate 0.01, of the
batch's smallest kept activation); it is saved as jumprelu with a threshold, as SAELens saves it, but one measured at
the end on the final weights and on rows drawn from across the corpus (Trainer.estimate_threshold, threshold_rows:
the EMA from 0 lags badly in a run of a few hundred steps, and one block's rows can be one long document).

Where this differs from SAELens's defaults, and why (each a documented option there too):
- inputs are scaled so their mean squared norm is d_in ("expected_average_only_in"), and the scale is folded into
  the saved weights: a learning rate then means the same on every hook (resid norms ~175, MLP inputs ~2);
- b_dec starts at the mean of the first block's targets instead of 0: from 0, Adam needs thousands of steps to
  move it to the stream's mean, more than a CPU run has;
- a skip transcoder's W_skip and b_dec start at the first block's least-squares linear fit (SAELens: W_skip = 0),
  for the same reason;
- the learning rate decays linearly to 0 over the last `lr_decay` of the tokens (SAELens: lr_decay_steps);
- a feature is dead after `dead_window` tokens without firing (SAELens: 1000 steps = 4M tokens, more than a short
  CPU run sees, so its AuxK loss would never start).
Rows are chosen by activations.sae_rows (no window's first position, no massive row), in training and evaluation.

Checkpoints: out/checkpoint.safetensors holds the weights, Adam's state, the dead-feature counters and, in its
metadata, the configuration and the data cursor (pass, block, batch within the block, tokens seen). A block's
shuffle comes from a generator seeded by (seed, pass, block), so no random state carries between blocks and the
cursor is all a resume needs; the file is written to a temporary name and renamed, so a run killed at any moment
(`kill -9` included) resumes from the last checkpoint and ends with the same weights as a run never stopped.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..corpora.reading import CorpusError
from ..features.activations import (
    Source,
    batch_rows,
    block_rows,
    check_source,
    checked_corpus,
    corpus_fingerprint,
    hook_width,
    plan_blocks,
)
from ..features.sae import SAE, SAEError
from ..model.params import BF16_SPEEDUP, bf16_bulk_speedup

TRAIN_ARCHITECTURES = ("topk", "batchtopk")
CHECKPOINT = "checkpoint.safetensors"
FORMAT = 1
ADAM_BETAS = (0.9, 0.999)  # SAELens's adam_beta1 / adam_beta2
INIT_DECODER_NORM = 0.1  # SAELens's decoder_init_norm (Anthropic's April 2024 update)
THRESHOLD_LR = 0.01  # SAELens's topk_threshold_lr
THRESHOLD_ROWS = 8192  # rows, from across the corpus, the final BatchTopK threshold is measured on (threshold_rows)
THRESHOLD_BLOCKS = 32  # blocks those rows are drawn from, evenly spaced over one pass
CLIP_GRAD_NORM = 1.0  # SAELens's trainer clips every step
Progress = bool | Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a run's weights; a checkpoint is resumed only under an equal configuration."""

    model: str
    hook: str
    hook_out: str
    d_in: int
    d_out: int
    d_sae: int
    k: int
    architecture: str
    tokens: int
    lr: float
    batch_tokens: int
    seed: int
    dtype: str  # "float32" | "bfloat16": the matmuls of the forwards and the SAE step (weights stay fp32)
    window: int
    forward_tokens: int
    buffer_tokens: int
    dead_window: int
    aux_coefficient: float
    lr_decay: float
    corpus: str  # sha256 of the corpus
    massive_factor: float
    skip: bool = False  # a skip transcoder: + x @ W_skip.T (defaulted, so checkpoints written before it still read)


@dataclass
class Cursor:
    """Where a run is: the next (pass, block, batch within the block) to train on, and how far it got."""

    epoch: int = 0
    block: int = 0
    batch: int = 0
    tokens: int = 0  # rows trained on
    steps: int = 0
    seen: int = 0  # real tokens forwarded (kept or not), this run and the ones it resumed
    finished: bool = False


class CheckpointError(SAEError):
    """out/ holds another run's checkpoint (or an SAE without one): the message names what differs."""


def train_sae(
    model: Any,
    hook: str,
    corpus: Any,
    d_sae: int,
    k: int,
    tokens: int,
    out: str | os.PathLike,
    hook_out: str | None = None,
    architecture: str = "topk",
    lr: float = 1e-3,
    batch_tokens: int = 4096,
    seed: int = 0,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: Progress = True,
    window: int = 128,
    forward_tokens: int = 1024,
    buffer_tokens: int = 65_536,
    dead_window: int = 500_000,
    aux_coefficient: float = 1.0,
    lr_decay: float = 0.2,
    checkpoint_every: float = 120.0,
    metadata: dict[str, Any] | None = None,
    skip: bool = False,
) -> SAE:
    """Train an SAE on `hook` (a transcoder predicting `hook_out`) over `corpus`, checkpointing to `out`.

    d_sae features, k active per token (TopK) or on average (BatchTopK, saved as jumprelu); `tokens` rows trained
    on (the corpus is read again as often as needed); `batch_tokens` rows per step. device: where the SAE trains
    (default: the model's device). dtype: "float32" or "bfloat16" for the matmuls of the activations' forwards
    and of the SAE step (Adam and the weights stay fp32); None picks bf16 where it measures >= BF16_SPEEDUP
    faster (`fastest_dtype`), or the dtype of the checkpoint being resumed. progress: a tqdm bar (True), nothing
    (False), or fn(stats) after every step (stats: tokens, total, step, loss, mse, aux, explained_variance, l0,
    dead_fraction, tokens_per_s). checkpoint_every: seconds between checkpoints inside a block (0: after every
    step); one is also written at the end of every block, where a resume re-runs no forward.
    skip: a skip transcoder (Paulo et al. 2025, "Transcoders beat sparse autoencoders"): a learned linear term
    x @ W_skip.T (W_skip [d_out, d_in], started at the first block's least-squares fit) is added to the prediction,
    so the features spend themselves on what a linear map of the MLP's input cannot predict; saved as SAELens's
    (jumprelu_)skip_transcoder.
    Returns the trained SAE, also saved in `out` (SAELens format). A finished run in `out` is loaded, not re-run.
    """
    out = Path(out)
    hook_out = hook if hook_out is None else hook_out
    check_run(architecture, d_sae, k, tokens, batch_tokens, window, forward_tokens, buffer_tokens, "an SAE")
    if skip and hook_out == hook:
        raise ValueError("skip=True is for transcoders (hook_out= another hook): an SAE's skip term would learn the "
                         "identity and leave its features nothing to reconstruct")
    if not 0 <= lr_decay <= 1:
        raise ValueError(f"lr_decay is the fraction of tokens over which the lr decays, in [0, 1]; got {lr_decay}")
    from ..features.activations import MASSIVE_FACTOR

    source = Source(hook, hook_out, window, forward_tokens, buffer_tokens)
    check_source(model, source)
    corpus = checked_corpus(corpus)
    saved = read_checkpoint(out)
    dev = torch.device(device) if device is not None else model.decoder.device
    if dtype is None:
        dtype = saved[0].dtype if saved is not None else fastest_dtype(dev)
    cfg = TrainConfig(
        model=model.name, hook=hook, hook_out=hook_out, d_in=hook_width(model, hook), d_out=hook_width(model, hook_out),
        d_sae=d_sae, k=k, architecture=architecture, tokens=tokens, lr=float(lr), batch_tokens=batch_tokens,
        seed=seed, dtype=_dtype_name(dtype), window=window, forward_tokens=forward_tokens, buffer_tokens=buffer_tokens,
        dead_window=dead_window, aux_coefficient=float(aux_coefficient), lr_decay=float(lr_decay),
        corpus=corpus_fingerprint(corpus), massive_factor=MASSIVE_FACTOR, skip=bool(skip),
    )
    if saved is not None:
        _check_same_run(out, saved[0], cfg, saved[2]["cursor"]["tokens"])
    elif (out / "cfg.json").exists():
        raise CheckpointError(f"{out} holds an SAE (cfg.json) but no {CHECKPOINT}: not a run train_sae can resume; "
                              "choose another out= folder")
    trainer = Trainer(cfg, dev, metadata or {})
    if saved is not None:
        trainer.restore(saved[1], saved[2])
        if trainer.cursor.finished:
            return SAE.load(out).to(model.decoder.device)
    # where the model runs (the splice refuses an SAE elsewhere), as train_transcoders and a trained CLT return theirs
    return trainer.run(model, corpus, source, out, progress, checkpoint_every).to(model.decoder.device)


def check_run(architecture: str, d_sae: int, k: int, tokens: int, batch_tokens: int, window: int,
              forward_tokens: int, buffer_tokens: int, coder: str) -> None:
    """The arguments every training run shares (train_sae, train_transcoders, a CLT's), each a clear ValueError;
    `coder` names what keeps k features in the message ("an SAE", "a coder", "a CLT layer")."""
    if architecture not in TRAIN_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {TRAIN_ARCHITECTURES}, got {architecture!r}")
    for name, value in (("d_sae", d_sae), ("k", k), ("tokens", tokens), ("batch_tokens", batch_tokens),
                        ("window", window), ("forward_tokens", forward_tokens), ("buffer_tokens", buffer_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if k > d_sae:
        raise ValueError(f"k={k} is larger than d_sae={d_sae}: {coder} keeps k of its d_sae features active")
    if buffer_tokens < batch_tokens:
        raise ValueError(f"buffer_tokens={buffer_tokens} must hold at least one batch (batch_tokens={batch_tokens})")


def fastest_dtype(device: torch.device | str = "cpu") -> str:
    """"bfloat16" where bf16 matmuls measure >= BF16_SPEEDUP times faster than fp32 on `device`, else "float32".

    Measured at run time (`params.bf16_bulk_speedup`: a [1024, 576] x [576, 2048] product, timed once per process,
    the same measurement the app's fast (bf16) switch reads), never read off the CPU's name: the same machine kind
    has had CPUs where bf16 GEMMs were 6x faster (AMX) and ones where they were hundreds of times slower."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if device.type != "cpu":
        return "float32"
    return "bfloat16" if bf16_bulk_speedup() >= BF16_SPEEDUP else "float32"


def _dtype_name(dtype: str | torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", "float32": "float32", "bfloat16": "bfloat16",
             "fp32": "float32", "bf16": "bfloat16"}
    if dtype not in names:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16' (or None: measured), got {dtype!r}")
    return names[dtype]


def _check_same_run(out: Path, saved: TrainConfig, cfg: TrainConfig, done: int) -> None:
    """Refuse a checkpoint of another configuration. `tokens` alone may change while the run is still before
    the learning-rate decay of both totals: up to there the schedule is the same constant, so the resumed run
    computes exactly what a run started with the new total would (a run can be shortened or extended)."""
    differ = {k: (v, getattr(cfg, k)) for k, v in asdict(saved).items() if getattr(cfg, k) != v}
    if set(differ) == {"tokens"} and done <= (1 - cfg.lr_decay) * min(saved.tokens, cfg.tokens):
        return
    if differ:
        what = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
        raise CheckpointError(f"{out} holds the checkpoint of another run ({what}); resume it with the same "
                              "settings, or train into another out= folder")


class Trainer:
    """The state of one run: weights, Adam, dead-feature counters, threshold, input scales and the cursor."""

    def __init__(self, cfg: TrainConfig, device: torch.device, metadata: dict[str, Any]):
        self.cfg, self.device, self.metadata = cfg, device, metadata
        self.is_sae = cfg.hook == cfg.hook_out
        z = dict(dtype=torch.float32, device=device)
        self.W_enc = torch.nn.Parameter(torch.zeros(cfg.d_in, cfg.d_sae, **z))
        self.b_enc = torch.nn.Parameter(torch.zeros(cfg.d_sae, **z))
        self.W_dec = torch.nn.Parameter(torch.zeros(cfg.d_sae, cfg.d_out, **z))
        self.b_dec = torch.nn.Parameter(torch.zeros(cfg.d_out, **z))
        self.params = [self.W_enc, self.b_enc, self.W_dec, self.b_dec]
        # SAELens's skip transcoder starts W_skip at 0; appended last so Adam's state indices 0-3 keep their meaning.
        self.W_skip = torch.nn.Parameter(torch.zeros(cfg.d_out, cfg.d_in, **z)) if cfg.skip else None
        if self.W_skip is not None:
            self.params.append(self.W_skip)
        self.optimizer = adam(self.params, cfg.lr)
        self.since_fired = torch.zeros(cfg.d_sae, dtype=torch.long, device=device)  # rows since each feature fired
        self.threshold = torch.zeros((), dtype=torch.float64, device=device)  # BatchTopK's, in scaled units
        self.scale_in = self.scale_out = 0.0  # 0: not yet measured (set from the first block)
        self.cursor = Cursor()

    # ---- state ---------------------------------------------------------------------------------------------------
    def initialise(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """SAELens's init, plus the input scales and b_dec = mean target (see the module docstring), from block 0."""
        cfg = self.cfg
        self.scale_in = _unit_scale(x)
        self.scale_out = self.scale_in if self.is_sae else _unit_scale(y)
        g = torch.Generator().manual_seed(cfg.seed)
        w = torch.empty(cfg.d_sae, cfg.d_out)
        torch.nn.init.kaiming_uniform_(w, generator=g)
        w = w / w.norm(dim=-1, keepdim=True) * INIT_DECODER_NORM
        with torch.no_grad():
            self.W_dec.copy_(w)
            if cfg.d_in == cfg.d_out:
                self.W_enc.copy_(w.T)
            else:
                e = torch.empty(cfg.d_sae, cfg.d_in)
                torch.nn.init.kaiming_uniform_(e, generator=g)
                self.W_enc.copy_((e / e.norm(dim=-1, keepdim=True) * INIT_DECODER_NORM).T)
            if self.W_skip is not None:
                W_skip, b = _linear_fit(x * self.scale_in, y * self.scale_out)
                self.W_skip.copy_(W_skip.float())
                self.b_dec.copy_(b.float())
            else:
                self.b_dec.copy_((y.double() * self.scale_out).mean(0).float())

    def state_tensors(self) -> dict[str, torch.Tensor]:
        t = {"W_enc": self.W_enc, "b_enc": self.b_enc, "W_dec": self.W_dec, "b_dec": self.b_dec,
             "since_fired": self.since_fired, "threshold": self.threshold}
        if self.W_skip is not None:
            t["W_skip"] = self.W_skip
        for i, p in enumerate(self.params):
            st = self.optimizer.state.get(p)
            if st:
                t[f"adam.{i}.exp_avg"], t[f"adam.{i}.exp_avg_sq"] = st["exp_avg"], st["exp_avg_sq"]
                t[f"adam.{i}.step"] = st["step"]
        return {k: v.detach().cpu().contiguous() for k, v in t.items()}

    def restore(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        with torch.no_grad():
            for name in ("W_enc", "b_enc", "W_dec", "b_dec") + (("W_skip",) if self.W_skip is not None else ()):
                getattr(self, name).copy_(tensors[name])
        self.since_fired = tensors["since_fired"].to(self.device)
        self.threshold = tensors["threshold"].to(self.device)
        for i, p in enumerate(self.params):
            if f"adam.{i}.step" in tensors:
                self.optimizer.state[p] = {k: tensors[f"adam.{i}.{k}"].to(self.device if k != "step" else "cpu")
                                           for k in ("step", "exp_avg", "exp_avg_sq")}
        self.scale_in, self.scale_out = meta["scale_in"], meta["scale_out"]
        self.cursor = Cursor(**meta["cursor"])

    def save_checkpoint(self, out: Path) -> None:
        """Write out/checkpoint.safetensors atomically (temporary file, fsync, rename)."""
        out.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "config": asdict(self.cfg), "cursor": asdict(self.cursor),
                "scale_in": self.scale_in, "scale_out": self.scale_out,
                "rng": "none carried: block shuffles are seeded by (seed, pass, block); init by seed"}
        tmp = out / (CHECKPOINT + ".tmp")
        save_file(self.state_tensors(), str(tmp), metadata={"slmviz_train_state": json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out / CHECKPOINT)

    # ---- the loop --------------------------------------------------------------------------------------------------
    def run(self, model: Any, corpus: Any, source: Source, out: Path, progress: Progress,
            checkpoint_every: float) -> SAE:
        cfg, cur = self.cfg, self.cursor
        bar = _progress_bar(progress, cfg.tokens, cur.tokens)
        last_save, t0, tokens0 = time.monotonic(), time.perf_counter(), cur.tokens
        autocast = _autocast(model.decoder.device, cfg.dtype)
        try:
            while cur.tokens < cfg.tokens:
                any_block = False
                for block in plan_blocks(model.tokenizer, corpus, source):
                    any_block = True
                    if block.index < cur.block:
                        continue  # done before the resume: planned by tokenizing alone, no forward
                    with autocast:
                        rows = block_rows(model, block, source)
                    if rows.x.shape[0] == 0:
                        cur.block, cur.batch = block.index + 1, 0
                        continue
                    x = rows.x.to(self.device)
                    y = x if self.is_sae else rows.y.to(self.device)
                    if self.scale_in == 0.0:
                        self.initialise(x, y)
                    if cur.batch == 0:
                        cur.seen += rows.seen
                    order = torch.randperm(x.shape[0], generator=_block_generator(cfg.seed, cur.epoch, block.index))
                    chunks = training_batches(order, cfg.batch_tokens)
                    for j in range(cur.batch, len(chunks)):
                        idx = chunks[j].to(self.device)
                        stats = self.step(x[idx] * self.scale_in, y[idx] * self.scale_out)
                        cur.batch, cur.tokens, cur.steps = j + 1, cur.tokens + len(idx), cur.steps + 1
                        stats.update(tokens=cur.tokens, total=cfg.tokens, step=cur.steps,
                                     tokens_per_s=(cur.tokens - tokens0) / max(time.perf_counter() - t0, 1e-9))
                        _report(bar, progress, stats)
                        if cur.tokens >= cfg.tokens:
                            break
                        if time.monotonic() - last_save >= checkpoint_every:
                            self.save_checkpoint(out)
                            last_save = time.monotonic()
                    if cur.tokens >= cfg.tokens:
                        break
                    cur.block, cur.batch = block.index + 1, 0
                    self.save_checkpoint(out)  # always at a block's end: a resume there runs no forward twice
                    last_save = time.monotonic()
                    del rows, x, y
                    release_freed_memory()
                if cur.tokens >= cfg.tokens:
                    break
                if not any_block or cur.steps == 0:
                    raise CorpusError("the corpus gave no tokens to train on (empty, or only blank documents and "
                                      "single-token windows, whose one position is a window's first)")
                cur.epoch, cur.block, cur.batch = cur.epoch + 1, 0, 0
        finally:
            if bar is not None:
                bar.close()
        if cfg.architecture == "batchtopk":
            with autocast:
                sample = threshold_rows(model, corpus, source)
            self.estimate_threshold(sample.to(self.device) * self.scale_in)
        cur.finished = True
        sae = self.to_sae(model)
        sae.save(out)
        self.save_checkpoint(out)
        return sae

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """One optimizer step on x [B, d_in] -> y [B, d_out] (scaled units). Returns the batch's statistics."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.cursor.tokens)
        dead = self.since_fired > cfg.dead_window  # [d_sae]
        with _autocast(x.device, cfg.dtype):
            x_in = x - self.b_dec if self.is_sae else x  # apply_b_dec_to_input for SAEs, not transcoders
            norms = self.W_dec.norm(dim=-1)  # [d_sae]: rescale_acts_by_decoder_norm
            h = (x_in @ self.W_enc + self.b_enc).float() * norms  # [B, d_in] -> [B, d_sae]
        rows, feats, acts = self.activate(h)
        y_hat = decode_sparse(rows, feats, acts / norms[feats], self.W_dec, x.shape[0]) + self.b_dec  # [B, d_out]
        if self.W_skip is not None:
            with _autocast(x.device, cfg.dtype):
                skip = x @ self.W_skip.T  # [B, d_in] -> [B, d_out]
            y_hat = y_hat + skip.float()
        mse = (y_hat - y).pow(2).sum(-1).mean()
        aux = self.aux_loss(h, dead, y - y_hat.detach(), norms)
        loss = mse + aux
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP_GRAD_NORM)
        self.optimizer.step()
        with torch.no_grad():
            fired = torch.zeros(cfg.d_sae, dtype=torch.bool, device=x.device)
            fired[feats] = True
            self.since_fired += x.shape[0]
            self.since_fired[fired] = 0
            err = (y_hat - y).pow(2).sum()
            var = (y - y.mean(0)).pow(2).sum()
        return {"loss": loss.item(), "mse": mse.item(), "aux": aux.item(), "explained_variance": float(1 - err / var),
                "l0": feats.numel() / x.shape[0], "dead_fraction": float(dead.float().mean())}

    def activate(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The active entries of h [B, d_sae] as (row, feature, value) triples, grouped by row.

        TopK: relu of each row's k largest (SAELens: topk first, then relu). BatchTopK: the k*B largest of relu(h)
        over the whole batch, and the threshold's EMA update towards the smallest kept value."""
        rows, feats, values, self.threshold = active_entries(h, self.cfg.architecture, self.cfg.k, self.threshold)
        return rows, feats, values

    @torch.no_grad()
    def estimate_threshold(self, x: torch.Tensor) -> None:
        """BatchTopK's threshold, measured with the final weights on x [n, d_in] (scaled rows, threshold_rows):
        the largest value below the k*n largest activations, so that relu(h) * 1[h > threshold] keeps k per row
        on average, as the batch-wide top-k did.

        The EMA SAELens learns (rate 0.01 from 0) is what this replaces: after n steps it holds (1 - 0.99^n) of the
        value it tracks, and a CPU run of a few hundred steps saved thresholds at ~60 % of it, so the jumprelu SAE
        fired ~3x k features per token (a transcoder trained for 98 steps: L0 193 for k 64)."""
        x_in = x - self.b_dec if self.is_sae else x
        with _autocast(x.device, self.cfg.dtype):
            h = (x_in @ self.W_enc + self.b_enc).float() * self.W_dec.norm(dim=-1)  # [n, d_sae]
        self.threshold = batch_threshold(h, self.cfg.k)

    def aux_loss(self, h: torch.Tensor, dead: torch.Tensor, residual: torch.Tensor,
                 norms: torch.Tensor) -> torch.Tensor:
        """SAELens's calculate_topk_aux_loss: the top k_aux dead pre-activations reconstruct the (detached) residual."""
        n_dead = int(dead.sum())
        if n_dead == 0:
            return h.new_zeros(())
        k_aux = self.cfg.d_in // 2  # Gao et al., appendix B.1
        scale = min(n_dead / k_aux, 1.0)
        k_aux = min(k_aux, n_dead)
        recons = dead_feature_decode(h, dead, k_aux, norms, self.W_dec)  # no b_dec
        return self.cfg.aux_coefficient * scale * (recons - residual).pow(2).sum(-1).mean()

    def lr_at(self, tokens: int) -> float:
        """The learning rate before the step at `tokens`: constant, then linear to 0 over the last lr_decay."""
        cfg = self.cfg
        if cfg.lr_decay == 0:
            return cfg.lr
        return cfg.lr * min(1.0, (cfg.tokens - tokens) / (cfg.lr_decay * cfg.tokens))

    # ---- the result ------------------------------------------------------------------------------------------------
    def to_sae(self, model: Any) -> SAE:
        """The trained SAE in the model's units: decoder rows folded to norm 1 (SAELens's fold_W_dec_norm, exact
        for TopK since the rows were rescaled during training) and the input scales folded into the weights."""
        cfg = self.cfg
        with torch.no_grad():
            norms = self.W_dec.norm(dim=-1).clamp(min=1e-8)  # [d_sae]
            W_dec = (self.W_dec / norms[:, None]).cpu()
            W_enc = (self.W_enc * norms).cpu()
            b_enc = (self.b_enc * norms).cpu()
            b_dec = self.b_dec.cpu()
            # In model units f' = f / s_out: x_hat = f' @ W_dec + b_dec / s_out, h' = (x - b_dec/s_in) @ W_enc
            # * s_in / s_out + b_enc / s_out (for an SAE s_in == s_out, so b_dec / s_in is the same vector).
            s_in, s_out = self.scale_in, self.scale_out
            state = {"W_enc": W_enc * (s_in / s_out), "b_enc": b_enc / s_out, "W_dec": W_dec, "b_dec": b_dec / s_out}
            if self.W_skip is not None:  # y/s_out = (x s_in) @ W_skip.T / s_out
                state["W_skip"] = (self.W_skip * (s_in / s_out)).cpu()
            if cfg.architecture == "batchtopk":
                state["threshold"] = torch.full((cfg.d_sae,), float(self.threshold) / s_out)
        meta = {
            "model_name": cfg.model, "training_config": asdict(cfg), "trained_on_tokens": self.cursor.tokens,
            "trained_on_architecture": cfg.architecture, "input_scale": self.scale_in, "output_scale": self.scale_out,
            "rows": "activations.sae_rows: no window's first position, no row above "
                    f"{cfg.massive_factor}x its batch's median norm",
            **self.metadata,
        }
        arch = "topk" if cfg.architecture == "topk" else "jumprelu"
        return SAE.from_state(state, architecture=arch, k=cfg.k, hook_name=cfg.hook, hook_name_out=cfg.hook_out,
                              apply_b_dec_to_input=self.is_sae, skip=cfg.skip, metadata=meta)


def threshold_rows(model: Any, corpus: Any, source: Source, rows: int = THRESHOLD_ROWS,
                   blocks: int = THRESHOLD_BLOCKS) -> torch.Tensor:
    """SAE input rows [<= rows, d_in] from `blocks` blocks evenly spaced over one pass of the corpus (the first
    batches of each, in order), for BatchTopK's final threshold.

    Why not the last block's rows: a block is 65 536 consecutive tokens of the (document-shuffled) corpus, and one
    long document (a standard-library source file) can fill it. A threshold measured there kept 65.9 features per
    token on the training split and 75.1 on held-out text (SmolLM2's layer-3 transcoder), above the k it was
    trained for. Tokenizing the corpus twice and ~8 extra forwards is the cost.
    """
    n_blocks = sum(1 for _ in plan_blocks(model.tokenizer, corpus, source))
    chosen = {round(i * (n_blocks - 1) / max(blocks - 1, 1)) for i in range(min(blocks, n_blocks))}
    quota = -(-rows // max(len(chosen), 1))
    parts: list[torch.Tensor] = []
    for block in plan_blocks(model.tokenizer, corpus, source):
        if block.index not in chosen:
            continue
        got = 0
        for batch in block.batches:
            x = batch_rows(model, batch, source).x
            parts.append(x[: quota - got])
            got += parts[-1].shape[0]
            if got >= quota:
                break
    return torch.cat(parts)[:rows]


def adam(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    """SAELens's optimizer (Adam, betas ADAM_BETAS), fused into one kernel per parameter where torch has one.

    Why fused: the unfused CPU Adam runs ~10 elementwise passes over every weight each step; a coder's step spent
    more time there than in its encoder's matmul (profiled on SmolLM2's 4096-wide transcoders: 126 ms of Adam
    against 27 ms of matmul, 2 cores). The fused kernel does the same arithmetic in one pass (its results agree with
    the unfused ones to fp32 rounding, not bit for bit; a run resumes with the optimizer it started with)."""
    fused = params[0].device.type in ("cpu", "cuda")  # the devices torch has the fused kernel for
    return torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, fused=fused or None)


def active_entries(h: torch.Tensor, architecture: str, k: int, threshold: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A training step's active entries of h [B, d_sae] as (row, feature, value) triples grouped by row, and the
    BatchTopK threshold after this batch (`threshold` unchanged for TopK).

    TopK: relu of each row's k largest (SAELens: topk first, then relu). BatchTopK: batch_top_k's choice, and the
    threshold's EMA (SAELens's topk_threshold_lr) moved towards the smallest kept value; the trainers replace it
    at the end by batch_threshold on rows from across the corpus, but a checkpoint keeps it."""
    if architecture == "topk":
        values, feats = torch.topk(h, k, dim=-1, sorted=False)  # [B, k]
        rows = torch.arange(h.shape[0], device=h.device)[:, None].expand_as(feats)
        return rows.reshape(-1), feats.reshape(-1), values.relu().reshape(-1), threshold
    rows, feats, values = batch_top_k(h, k)
    if values.numel():
        with torch.no_grad():
            threshold = (1 - THRESHOLD_LR) * threshold + THRESHOLD_LR * values.detach().min().double()
    return rows, feats, values, threshold


def batch_top_k(h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BatchTopK's choice: the k*B largest entries of relu(h) [B, d_sae] over the whole batch, as (row, feature,
    value) triples grouped by row (rows non-decreasing, as decode_sparse needs). Zeros are never kept: SAELens
    counts a feature as fired only where its activation is > 0, so a zero kept would reset its dead counter.

    Found by a cut (batch_top_k_cut: the largest value left out) instead of a top-k over the flattened batch: the
    entries above it are kept, and entries equal to it (bf16 matmuls make ties common) fill the count up to k*B in
    index order, so the count is exactly min(k*B, #positive) and the choice deterministic. The kept indices come out
    sorted, where topk's needed a sort."""
    flat = h.relu().flatten()
    keep = min(k * h.shape[0], flat.numel())
    a = flat.detach()
    with torch.no_grad():
        if keep < a.numel():
            cut = batch_top_k_cut(a, keep)
            chosen = a > cut
            short = keep - int(chosen.sum())
            if short > 0 and cut > 0:
                chosen[(a == cut).nonzero().squeeze(1)[:short]] = True
        else:
            chosen = a > 0
        index = chosen.nonzero().squeeze(1)  # ascending: grouped by row
    return index // h.shape[1], index % h.shape[1], flat[index]


CUT_SAMPLE_STRIDE = 16  # batch_top_k_cut's first guess reads every 16th entry
CUT_SLACK = 1.5  # ... and aims its guess at 1.5x the share of entries kept, so that one guess nearly always holds


def batch_top_k_cut(a: torch.Tensor, keep: int) -> torch.Tensor:
    """The (keep+1)-th largest entry of a (keep < a.numel()): the largest value BatchTopK leaves out.

    Exact, from a guess. `low` is a value that a strided sample (every CUT_SAMPLE_STRIDE-th entry) says has about
    CUT_SLACK x (keep + 1) entries above it. When more than `keep` entries of `a` lie above `low`, the cut lies
    above it too, so it is the (keep+1)-th largest of those candidates alone. When not (the sample misled, e.g. a
    feature large on every row in columns the stride skips), `low` is taken lower in the sample, and at the end
    every entry is a candidate: the answer is the same value as a top-k over all of `a`, only cheaper.

    Why: this runs in every BatchTopK step and in each layer's final threshold. On 512 x 4096 relu'd entries
    (k 64) it takes ~4 ms against 36 ms for torch.topk over the flattened batch (bench/studies/train_step.py, 2-core AMD
    EPYC, 2026-12-03), where the per-row candidates it replaced (each row's 4k largest, then the cut) took ~13 ms."""
    flat = a.reshape(-1)
    sample = flat[::CUT_SAMPLE_STRIDE]
    n = sample.numel()
    q = min(math.ceil((keep + 1) / CUT_SAMPLE_STRIDE * CUT_SLACK), n)
    while True:
        low = sample.topk(q, sorted=False).values.min() if q <= n else flat.new_tensor(-math.inf)
        candidates = flat[flat > low]
        if candidates.numel() > keep:
            return candidates.topk(keep + 1, sorted=False).values.min()
        q = min(4 * q, n) if q < n else n + 1  # lower in the sample; past its smallest entry: every entry


def batch_threshold(h: torch.Tensor, k: int) -> torch.Tensor:
    """The JumpReLU threshold that keeps what BatchTopK kept on h [n, d_sae]: the largest value of relu(h) below its
    k*n largest (float64 scalar)."""
    a = h.relu()
    kept = k * h.shape[0]
    return (batch_top_k_cut(a, kept) if kept < a.numel() else a.min()).double()


DEAD_DECODE_DENSE_FRACTION = 0.5  # dead_feature_decode multiplies densely while at most this fraction is dead


def dead_feature_decode(h: torch.Tensor, dead: torch.Tensor, k_aux: int, norms: torch.Tensor,
                        W_dec: torch.Tensor) -> torch.Tensor:
    """The aux loss's reconstruction (SAELens's calculate_topk_aux_loss): each row of h [B, d_sae] keeps its k_aux
    largest raw pre-activations among the dead features, divided by their decoder norms, decoded by W_dec
    [d_sae, d_out] (no b_dec) -> [B, d_out].

    Over the dead features' columns alone, as a dense product: with k_aux = d_in / 2 = 288 of a few hundred to a
    thousand dead features per row the codes are dense there, and [B, n_dead] @ W_dec[dead] beat the sparse decode
    of B*k_aux entries 2-3x (512 rows, 4096 features; 12 vs 31 ms at 100 dead, 40 vs 66 ms at 1229; 2-core Xeon).
    It loses once most features are dead (98 vs 72 ms at all 4096), where the sparse decode is kept."""
    if dead.float().mean() > DEAD_DECODE_DENSE_FRACTION:
        masked = torch.where(dead[None], h, -torch.inf)  # [B, d_sae]
        values, feats = masked.topk(k_aux, dim=-1, sorted=False)  # [B, k_aux]; raw values, as SAELens
        rows = torch.arange(h.shape[0], device=h.device)[:, None].expand_as(feats).reshape(-1)
        feats = feats.reshape(-1)
        return decode_sparse(rows, feats, values.reshape(-1) / norms[feats], W_dec, h.shape[0])
    idx = dead.nonzero().squeeze(1)
    h_dead = h[:, idx]  # [B, n_dead]
    values, pos = h_dead.topk(k_aux, dim=-1, sorted=False)  # [B, k_aux]
    codes = torch.zeros_like(h_dead).scatter(1, pos, values) / norms[idx]
    return codes @ W_dec[idx]


def training_batches(order: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """A block's shuffled row indices cut into steps of exactly `batch` rows: the last, short one is topped up with
    the block's first rows (a block smaller than one batch is one step of all its rows).

    Why exactly: bf16 matmuls run in oneDNN, which caches a compiled primitive for every shape it meets (up to
    1024). Cutting each block into near-equal parts gave its steps row counts that changed from block to block
    (4093, 4094, ...), one new set of cached primitives per block, and train_sae's memory grew with the tokens.
    Pinned by tests/test_sae_train.py::test_training_steps_have_one_shape.
    """
    n = order.numel()
    if n <= batch:
        return [order]
    short = n % batch
    if short:
        order = torch.cat([order, order[:batch - short]])
    return list(order.split(batch))


def decode_sparse(rows: torch.Tensor, feats: torch.Tensor, values: torch.Tensor, W_dec: torch.Tensor,
                  n_rows: int) -> torch.Tensor:
    """sum_j values_j * W_dec[feats_j] for each row: [n_rows, d_out], entries grouped by row (rows non-decreasing).

    An embedding bag reads only the k active rows of W_dec per token (B*k*d_out multiply-adds) where the dense
    f @ W_dec would multiply B*d_sae*d_out, nearly all by zero; its backward gives W_dec's and the values' grads.
    A dense backward (codes.T @ grad, (grad @ W_dec.T)[rows, feats]) was measured against the bag's and lost at
    every width tried (0.4-0.9x at 4096 features with 64 and 288 active per row; 0.2-0.3x at 16k and 65k)."""
    offsets = torch.searchsorted(rows, torch.arange(n_rows, device=rows.device))
    return F.embedding_bag(feats, W_dec, offsets, mode="sum", per_sample_weights=values.to(W_dec.dtype))


def read_checkpoint(out: Path) -> tuple[TrainConfig, dict[str, torch.Tensor], dict[str, Any]] | None:
    """(config, tensors, metadata) of out/checkpoint.safetensors, or None when there is none."""
    path = Path(out) / CHECKPOINT
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {})["slmviz_train_state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        cfg = TrainConfig(**meta["config"])
    except Exception as e:
        raise CheckpointError(f"{path} is not a train_sae checkpoint this version reads ({e}); train into another "
                              "out= folder") from e
    return cfg, tensors, meta


def release_freed_memory() -> None:
    """Hand memory freed by the last block back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Blocks and forward batches of varying shapes leave holes in glibc's heap, and a run's RSS crept up by ~20 %
    over 300k tokens without this (bench/peers/sae_train.py --memory measures the peak at 1x and 4x the tokens)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _linear_fit(x: torch.Tensor, y: torch.Tensor, ridge: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """(W [d_out, d_in], b [d_out]) minimising ||x @ W.T + b - y||^2 (+ ridge * mean diagonal of the covariance *
    ||W||^2, so a rank-deficient block still solves): the least-squares start of a skip transcoder's W_skip and b_dec.

    SAELens starts W_skip at 0; from there Adam needs thousands of steps to learn the linear part (on SmolLM2's layer
    3 MLP, 0.33 of the variance), which a CPU run does not have. From the fit, the features learn only what a linear
    map of the input leaves.

    The two products over the rows (x's covariance and its cross-covariance with y) run in fp32 and only the d x d
    solve in float64: on a block of SmolLM2's rows the result differs from an all-float64 fit by 1e-6 to 1e-5
    relative, with the same held-out EV to 7 digits, at a third of the time (the float64 copies and products took
    ~1 s a layer inside a 30-layer run, a sixth of a short run's time; bench/studies/train_transcoders.py).
    Returns float64."""
    x, y = x.float(), y.float()
    xm, ym = x.mean(0), y.mean(0)
    xc = x - xm
    cov = (xc.T @ xc).double()
    cov += ridge * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype, device=cov.device)
    W = torch.linalg.solve(cov, (xc.T @ (y - ym)).double()).T  # [d_out, d_in]
    return W, ym.double() - xm.double() @ W.T


def _unit_scale(x: torch.Tensor) -> float:
    """s with E||s x||^2 = d (SAELens's "expected_average_only_in" scaling factor). Each row's ||x||^2 in fp32
    (one dot product of d entries), their mean in float64: within 1e-8 of an all-float64 sum on SmolLM2's rows, at a
    tenth of the time of a float64 copy of the block (~0.1 s a layer inside a 30-layer run)."""
    x = x.reshape(-1, x.shape[-1])
    return math.sqrt(x.shape[-1] / float(torch.einsum("nd,nd->n", x, x).double().mean()))


def _block_generator(seed: int, epoch: int, block: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{epoch}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    if dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


POSTFIX = {"loss": ("loss", ".3g"), "explained_variance": ("ev", ".3f"), "worst_explained_variance": ("worst", ".3f"),
           "l0": ("l0", ".1f"), "dead_fraction": ("dead", ".3f")}  # stats key -> (tqdm postfix name, format)
# What a many-layer run's bar shows (train_transcoders): the layers' mean and worst EV, mean L0, worst dead fraction.
SET_POSTFIX = ("explained_variance", "worst_explained_variance", "l0", "dead_fraction")


def _progress_bar(progress: Progress, total: int, done: int, unit: str = "tok", desc: str = "train_sae"):
    """A tqdm bar for a training run (progress=True), else None; train_transcoders' runs share it."""
    if progress is not True:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, unit=unit, unit_scale=True, desc=desc)


def _report(bar: Any, progress: Progress, stats: dict[str, Any],
            fields: tuple[str, ...] = ("loss", "explained_variance", "l0", "dead_fraction")) -> None:
    """The bar's position and postfix (`fields` of stats, POSTFIX's names), or fn(stats) for a callable progress."""
    if bar is not None:
        bar.update(stats["tokens"] - bar.n)
        bar.set_postfix(refresh=False, **{POSTFIX[f][0]: format(stats[f], POSTFIX[f][1]) for f in fields})
    elif callable(progress):
        progress(stats)
