"""The one training loop: every coder of a run (one SAE, every layer's transcoder of a PLT set, or one CLT) trained
from one forward per planned batch, checkpointed, its BatchTopK thresholds measured, and its object saved.

`Trainer` is one coder's state, written once for every objective: Adam (SAELens's betas, fused), the learning rate
(constant, then linear to 0 over the last `lr_decay` of the tokens; SAELens: lr_decay_steps), the gradient norm
clipped to 1 every step, the dead-feature counters (a feature is dead after `dead_window` rows without firing;
SAELens's 1000 steps are more than a short CPU run sees, so its AuxK loss would never start) and the cursor.

`Run` is the loop over the corpus's blocks. Each coder keeps its own cursor: the rows a coder keeps per block (decided
per layer on its own input and target) differ from another's, so each reaches `tokens` rows at its own step; the
loop forwards blocks until every coder is done. A coder sees the same batches in the same order whether it is trained
alone or with others: a block's shuffle comes from a generator seeded by (seed, pass, block), so no random state
carries between blocks and the cursors are all a resume needs.

Checkpoints (formats.checkpoint): every coder's weights, Adam state, counters and thresholds, each coder's cursor
and scales, and the configuration, written once `checkpoint_every` seconds have passed since the last (checked after
every step), so a run killed at any moment (`kill -9` included) resumes from the last one and ends with the weights
of a run never stopped; it loses at most that long of training, plus the forward of the block it was in. Not at
every block's end as well: a full set's checkpoint is gigabytes (docs/features.md). The finished run's checkpoint
keeps its configuration and cursors alone, beside the saved object.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..corpora.reading import CorpusError
from ..formats.checkpoint import Checkpoint, CheckpointError, read_checkpoint, write_checkpoint
from ..progress import ProgressLike
from .clt_objective import CLTObjective
from .config import Cursor, TrainConfig, autocast
from .objective import Objective
from .report import Report, summary
from .results import coder_metadata, package, save_result, to_device
from .rows import Rows, block_rows, count_blocks, plan_blocks, threshold_rows
from .sae_objective import SAEObjective

ADAM_BETAS = (0.9, 0.999)  # SAELens's adam_beta1 / adam_beta2
CLIP_GRAD_NORM = 1.0  # SAELens's trainer clips every step
OBJECTIVES: dict[str, type[Objective]] = {"sae": SAEObjective, "plt": SAEObjective, "clt": CLTObjective}
DESC = {"sae": "train_sae", "plt": "train_transcoders", "clt": "train_transcoders(clt)"}  # the progress bar's


class Trainer:
    """One coder's training state: its objective (weights, thresholds, scales), Adam, the dead-feature counters
    [layers, d_sae] (rows since each feature last fired) and the cursor."""

    def __init__(self, objective: Objective):
        self.objective, self.cfg, self.device = objective, objective.cfg, objective.device
        self.optimizer = adam(objective.params, self.cfg.lr)
        self.since_fired = torch.zeros(len(objective.pairs), self.cfg.d_sae, dtype=torch.long, device=self.device)
        self.cursor = Cursor()

    @property
    def done(self) -> bool:
        return self.cursor.tokens >= self.cfg.tokens

    def lr_at(self, tokens: int) -> float:
        """The learning rate before the step at `tokens`: constant, then linear to 0 over the last lr_decay."""
        cfg = self.cfg
        if cfg.lr_decay == 0:
            return cfg.lr
        return cfg.lr * min(1.0, (cfg.tokens - tokens) / (cfg.lr_decay * cfg.tokens))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """One optimizer step on x [B, layers, d_in] -> y [B, layers, d_out] (training units). Returns the batch's
        figures (of the prediction before the update): the loss terms, report.summary's, and `layers`."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.cursor.tokens)
        dead = self.since_fired > self.cfg.dead_window  # [layers, d_sae]
        out = self.objective.training_forward(x, y, dead)
        terms = list(out.losses.values())
        loss = sum(terms[1:], start=terms[0])
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.objective.params, CLIP_GRAD_NORM)
        self.optimizer.step()
        with torch.no_grad():
            self.since_fired += x.shape[0]
            for L, (_, feats, _) in enumerate(out.active):
                self.since_fired[L, feats] = 0
            err = (out.y_hat - y).pow(2)  # [B, layers, d_out]
            var = (y - y.mean(0)).pow(2).sum((0, 2))  # [layers]
            layers = {layer: {"explained_variance": float(1 - err[:, i].sum() / var[i]),
                              "l0": out.active[i][1].numel() / x.shape[0], "mse": float(err[:, i].sum(-1).mean()),
                              "dead_fraction": float(dead[i].float().mean())}
                      for i, layer in enumerate(self.objective.layers)}
        return {"loss": loss.item(), **{k: float(v.detach()) for k, v in out.losses.items()}, **summary(layers),
                "layers": layers}

    def train_block(self, rows: Rows, block: int) -> Iterator[dict[str, Any]]:
        """This coder's steps on one block's rows from where its cursor stands, yielding each step's figures."""
        cur, cfg = self.cursor, self.cfg
        if rows.x.shape[0] == 0:
            cur.block, cur.batch = block + 1, 0
            return
        x = rows.x.to(self.device)
        y = x if rows.y is rows.x else rows.y.to(self.device)
        if not self.objective.initialised:
            self.objective.initialise(x, y)
        if cur.batch == 0:
            cur.seen += rows.seen
        order = torch.randperm(x.shape[0], generator=block_generator(cfg.seed, cur.epoch, block))
        chunks = training_batches(order, cfg.batch_tokens)
        for j in range(cur.batch, len(chunks)):
            idx = chunks[j].to(self.device)
            figures = self.step(self.objective.inputs(x[idx]), self.objective.targets(y[idx]))
            cur.batch, cur.tokens, cur.steps = j + 1, cur.tokens + len(idx), cur.steps + 1
            yield figures
            if self.done:
                return
        cur.block, cur.batch = block + 1, 0

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps: the objective's, Adam's moments and steps, the dead-feature counters."""
        t = {**self.objective.state(), "since_fired": self.since_fired}
        for i, p in enumerate(self.objective.params):
            st = self.optimizer.state.get(p)
            if st:
                t[f"adam.{i}.exp_avg"], t[f"adam.{i}.exp_avg_sq"] = st["exp_avg"], st["exp_avg_sq"]
                t[f"adam.{i}.step"] = st["step"]
        return {k: v.detach().cpu().contiguous() for k, v in t.items()}

    def header(self) -> dict[str, Any]:
        """What a checkpoint's header keeps of this coder: its cursor and scales."""
        return {"cursor": vars(self.cursor).copy(), "scale_in": self.objective.scale_in,
                "scale_out": self.objective.scale_out}

    def restore(self, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
        self.objective.restore(tensors, header["scale_in"], header["scale_out"])
        self.since_fired = tensors["since_fired"].to(self.device)
        for i, p in enumerate(self.objective.params):
            if f"adam.{i}.step" in tensors:
                self.optimizer.state[p] = {k: tensors[f"adam.{i}.{k}"].to(self.device if k != "step" else "cpu")
                                           for k in ("step", "exp_avg", "exp_avg_sq")}
        self.cursor = Cursor(**header["cursor"])


class Run:
    """Every coder of one run (TrainConfig.coders), trained together over shared forwards."""

    def __init__(self, cfg: TrainConfig, device: torch.device | str = "cpu", metadata: dict[str, Any] | None = None):
        self.cfg, self.metadata = cfg, dict(metadata or {})
        self.readers = cfg.coders()
        self.trainers = {name: Trainer(OBJECTIVES[cfg.kind](cfg, pairs, torch.device(device)))
                         for name, pairs in self.readers.items()}
        self.n_blocks: int | None = None  # one pass's blocks, once counted

    @property
    def done(self) -> bool:
        return all(t.done for t in self.trainers.values())

    def restore(self, checkpoint: Checkpoint) -> None:
        """Every coder where the checkpoint left it."""
        for name, t in self.trainers.items():
            prefix = f"{name}."
            t.restore({k[len(prefix):]: v for k, v in checkpoint.tensors.items() if k.startswith(prefix)},
                      checkpoint.coders[name])

    @classmethod
    def from_checkpoint(cls, out: str | Path, device: torch.device | str = "cpu") -> Run:
        """The run out/checkpoint.safetensors holds, every coder restored where it stood (to finish it there:
        bench/studies/replacement_curve.py scores a run's copied checkpoints this way)."""
        checkpoint = read_checkpoint(out)
        if checkpoint is None or checkpoint.finished:
            raise CheckpointError(f"{out} holds no unfinished run's checkpoint (a finished run's object is saved "
                                  "there: load it)")
        run = cls(TrainConfig.from_json(checkpoint.config), device)
        run.restore(checkpoint)
        return run

    def save_checkpoint(self, out: Path) -> None:
        """The run's state (formats.checkpoint); once every coder is finished, the header alone."""
        finished = all(t.cursor.finished for t in self.trainers.values())
        tensors = {} if finished else {f"{name}.{k}": v for name, t in self.trainers.items()
                                       for k, v in t.state().items()}
        write_checkpoint(out, Checkpoint(self.cfg.to_json(), {n: t.header() for n, t in self.trainers.items()},
                                         tensors))

    def train(self, model: Any, corpus: Any, out: Path, progress: ProgressLike, checkpoint_every: float) -> Any:
        """Train every coder to `tokens` rows from where its cursor stands, then finish (thresholds), save the object
        in `out` with the finished checkpoint, and return it on the model's device."""
        cfg, trainers = self.cfg, self.trainers
        self.n_blocks = count_blocks(model, corpus, cfg)  # before any forward: refuses a token the model cannot embed
        if not self.n_blocks:
            raise CorpusError("the corpus gave no tokens to train on (it is empty, or holds blank documents alone)")
        report = Report(progress, trainers, DESC[cfg.kind])
        last_save = time.monotonic()
        try:
            while not self.done:
                epoch = min(t.cursor.epoch for t in trainers.values() if not t.done)
                for block in plan_blocks(model, corpus, cfg):
                    active = {name: t for name, t in trainers.items()
                              if not t.done and (t.cursor.epoch, t.cursor.block) <= (epoch, block.index)}
                    if not active:
                        continue  # every unfinished coder is past this block (planned by tokenizing alone)
                    with autocast(model.decoder.device, cfg.dtype):
                        rows = block_rows(model, block, cfg, {name: self.readers[name] for name in active})
                    for name, t in active.items():
                        for figures in t.train_block(rows[name], block.index):
                            report.step(name, figures)
                            if time.monotonic() - last_save >= checkpoint_every:
                                self.save_checkpoint(out)
                                last_save = time.monotonic()
                    del rows
                    release_freed_memory()
                    if self.done:
                        break  # the finished checkpoint follows the thresholds and the save
                if not any(t.cursor.steps for t in trainers.values()):
                    raise CorpusError("the corpus gave no tokens to train on (empty, or only blank documents and "
                                      "single-token windows, whose one position is a window's first)")
                for t in trainers.values():
                    if not t.done and t.cursor.epoch == epoch:
                        t.cursor.epoch, t.cursor.block, t.cursor.batch = epoch + 1, 0, 0
        finally:
            report.close()
        for t in trainers.values():
            t.cursor.finished = True
        result = self.finish(model, corpus)
        save_result(cfg, result, out)
        self.save_checkpoint(out)
        return to_device(cfg, result, model.decoder.device)  # where the model runs, as load_result gives it

    def finish(self, model: Any, corpus: Any) -> Any:
        """The run's object as the weights stand: BatchTopK's thresholds measured on rows from across `corpus` (the
        training corpus), every coder in the model's units (Objective.result)."""
        cfg = self.cfg
        if cfg.architecture == "batchtopk":
            with autocast(model.decoder.device, cfg.dtype):
                samples = threshold_rows(model, corpus, cfg, self.readers, self.n_blocks)
            for name, t in self.trainers.items():
                t.objective.estimate_threshold(t.objective.inputs(samples[name].to(t.device)))
        return package(cfg, {name: t.objective.result(t.cursor.tokens, coder_metadata(cfg, name, self.metadata))
                             for name, t in self.trainers.items()}, self.metadata)


def adam(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Adam:
    """SAELens's optimizer (Adam, betas ADAM_BETAS), fused into one kernel per parameter where torch has one.

    Why fused: the unfused CPU Adam runs ~10 elementwise passes over every weight each step, and a coder's step spent
    more time there than in its encoder's matmul (docs/features.md). The fused kernel does the same arithmetic in
    one pass (its results agree with the unfused ones to fp32 rounding, not bit for bit; a run resumes with the
    optimizer it started with)."""
    fused = params[0].device.type in ("cpu", "cuda")  # the devices torch has the fused kernel for
    return torch.optim.Adam(params, lr=lr, betas=ADAM_BETAS, fused=fused or None)


def training_batches(order: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """A block's shuffled row indices cut into steps of exactly `batch` rows: the last, short one is topped up with
    the block's first rows (a block smaller than one batch is one step of all its rows).

    Why exactly: bf16 matmuls run in oneDNN, which caches a compiled primitive for every shape it meets (up to
    1024). Cutting each block into near-equal parts gave its steps row counts that changed from block to block, one
    new set of cached primitives per block, and a run's memory grew with the tokens.
    Pinned by tests/test_sae_train.py::test_training_steps_have_one_shape.
    """
    n = order.numel()
    if n <= batch:
        return [order]
    short = n % batch
    if short:
        order = torch.cat([order, order[:batch - short]])
    return list(order.split(batch))


def block_generator(seed: int, epoch: int, block: int) -> torch.Generator:
    """The generator of one block's shuffle, seeded by (seed, pass, block) alone: a resumed run, and a coder trained
    with others, shuffle each block exactly as a run never stopped, or trained alone."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{block}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def release_freed_memory() -> None:
    """Hand memory freed by the last block back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Blocks and forward batches of varying shapes leave holes in glibc's heap, and a run's resident memory crept up
    over hundreds of thousands of tokens without this (bench/peers/sae_train.py --memory)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
