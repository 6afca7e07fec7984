"""`slmviz.train_transcoders`: transcoders at every layer, trained from one forward per batch, resumable.

    ts = slmviz.train_transcoders(m, layers="all", corpus="broad", d_sae=4096, k=64, tokens=1_000_000,
                                  kind="plt", skip=True, out="runs/smollm2_plt")

Per-layer transcoders (PLT): layer L's coder reads `blocks.L.mlp.hook_in` and predicts `blocks.L.hook_mlp_out`.
Each coder is exactly what `train_sae(model, hook=..., hook_out=..., ...)` trains for that layer alone with the
same arguments (the same SAELens step, initialisation, massive-row rule, dead-feature revival, learning-rate
schedule and BatchTopK threshold; features.train.Trainer), and it sees the same batches in the same order:
the rows a layer keeps (activations.sae_rows, decided per layer on its own input and target) and each block's
shuffle (seeded by (seed, pass, block)) are the same whether one layer is trained or thirty. What is shared is the
forward: one batched forward per planned batch captures every layer's input and output and stops after the last
layer's MLP, where training the layers one at a time runs it once per layer.

Each layer keeps its own cursor (a layer's kept rows per block differ from another's, so each reaches `tokens`
rows at its own step); the loop forwards blocks until every layer is done. Memory: one block's rows for every
layer (buffer_tokens x n_layers x 2 x d_model floats: 16 384 tokens on SmolLM2's 30 layers is 2.3 GB in fp32),
whatever the number of tokens trained.

Checkpoints: out/checkpoint.safetensors holds every layer's weights, Adam state and dead-feature counters (keys
prefixed `L{layer}.`), and in its metadata each layer's configuration and cursor; written to a temporary name and
renamed, so a run killed at any moment (`kill -9` included) resumes from the last checkpoint and ends with the same
weights as a run never stopped. It is written once `checkpoint_every` seconds (600 by default) have passed since the
last one, checked after each layer's steps on a block (after the last layer's, it is a block's end). A kill so loses
at most that long of training, plus the forward of its block, which a resume runs again for the layers not yet past
it. Not at every block's end: on SmolLM2's 30 layers each write is 1.8 GB (~12 s on a 2-core AMD EPYC's disk), and a
block ends every ~70 s, so writing at each end took ~15 % of a run (38 of 377 s at 65k tokens a layer,
bench/results/sparsify_compare.md). `checkpoint_every=0` writes after every layer's block (what the resume tests
use). The finished set is saved in slmviz's layout (transcoder_set.save), and the checkpoint then keeps the
configurations and cursors alone (SetRun.save_checkpoint).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..corpora.reading import CorpusError
from ..features.activations import (
    MASSIVE_FACTOR,
    Rows,
    Source,
    batch_ids,
    check_source,
    checked_corpus,
    corpus_fingerprint,
    forward_hooks,
    hook_width,
    plan_blocks,
    sae_batch_shape,
    sae_rows,
)
from ..formats.slmviz import SET_FILE
from ..replacement.base import READ_HOOK, WRITE_HOOK
from ..replacement.transcoder_set import TranscoderSet
from .train_sae import (
    CHECKPOINT,
    SET_POSTFIX,
    THRESHOLD_BLOCKS,
    THRESHOLD_ROWS,
    CheckpointError,
    TrainConfig,
    Trainer,
    _autocast,
    _block_generator,
    _dtype_name,
    _progress_bar,
    _report,
    check_run,
    fastest_dtype,
    release_freed_memory,
    training_batches,
)

KINDS = ("plt", "clt")
FORMAT = 1
Progress = bool | Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class SetConfig:
    """What decides a set's weights beyond each layer's TrainConfig: the kind and the layers."""

    kind: str
    layers: tuple[int, ...]
    name: str


def resolve_layers(layers: str | Sequence[int], n_layers: int) -> tuple[int, ...]:
    """"all" -> every layer; a list -> those layers, sorted, each checked."""
    if layers == "all":
        return tuple(range(n_layers))
    if isinstance(layers, str) or not isinstance(layers, Sequence) or not layers:
        raise ValueError(f"layers must be 'all' or a non-empty list of layer indices, got {layers!r}")
    out = sorted({int(L) for L in layers})
    bad = [L for L in out if not 0 <= L < n_layers]
    if bad:
        raise ValueError(f"layers {bad} do not exist; this model has layers 0..{n_layers - 1}")
    return tuple(out)


def train_transcoders(
    model: Any,
    layers: str | Sequence[int] = "all",
    corpus: Any = "broad",
    d_sae: int = 4096,
    k: int = 64,
    tokens: int = 1_000_000,
    out: str | os.PathLike = "transcoders",
    kind: str = "plt",
    skip: bool = True,
    architecture: str = "batchtopk",
    lr: float = 1e-3,
    batch_tokens: int = 512,
    seed: int = 0,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    progress: Progress = True,
    window: int = 128,
    forward_tokens: int = 1024,
    buffer_tokens: int = 16_384,
    dead_window: int = 500_000,
    aux_coefficient: float = 1.0,
    lr_decay: float = 0.2,
    checkpoint_every: float = 600.0,
    name: str = "",
    metadata: dict[str, Any] | None = None,
    pre_act_coefficient: float = 0.0,
) -> TranscoderSet:
    """Train a transcoder at every layer in `layers` from one forward per batch, checkpointing to `out`.

    The arguments are train_sae's (one value for every layer); `corpus="broad"` is the bundled training corpus
    (features.corpora). `kind`: "plt" (per-layer transcoders) or "clt" (one cross-layer transcoder over every
    layer, features.clt_train: `k` per layer). Returns the set, also saved in `out`; a finished
    run in `out` is loaded, not re-run, and an interrupted one resumes (the same arguments; CheckpointError names
    what differs otherwise). `progress`: a tqdm bar whose postfix shows the layers' EV, L0 and dead fraction
    (mean and worst), nothing (False), or fn(stats) after every step of every layer's batch, stats holding
    `layers`: {layer: {explained_variance, l0, dead_fraction, tokens, loss}} plus tokens / total / tokens_per_s.
    `pre_act_coefficient` (CLT only): the weight of its pre-activation loss (features.clt_train.pre_act_loss).
    """
    from ..corpora.named import resolve_corpus

    out = Path(out)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    check_run(architecture, d_sae, k, tokens, batch_tokens, window, forward_tokens, buffer_tokens, "a coder")
    if kind == "plt" and architecture == "topk":
        raise ValueError("a per-layer transcoder set trains as architecture='batchtopk' (saved as JumpReLU): SAELens "
                         "and circuit-tracer have no TopK transcoder format to save it in")
    chosen = resolve_layers(layers, model.cfg.n_layers)
    if kind == "plt" and pre_act_coefficient:
        raise ValueError("pre_act_coefficient is a CLT's (kind='clt'); a per-layer set trains without it")
    if kind == "clt":  # one coder over every layer, its own step and checkpoint (features.clt_train)
        from .clt_train import train_clt

        if chosen != tuple(range(model.cfg.n_layers)):
            raise ValueError(f"a CLT covers every layer (its features write all later ones): layers='all', not "
                             f"{layers!r}")
        return train_clt(model, corpus, d_sae, k, tokens, out, skip, architecture, lr, batch_tokens, seed, device,
                         dtype, progress, window, forward_tokens, buffer_tokens, dead_window, aux_coefficient,
                         lr_decay, checkpoint_every, name, metadata, pre_act_coefficient=pre_act_coefficient)
    sources = {L: Source(READ_HOOK.format(L=L), WRITE_HOOK.format(L=L), window, forward_tokens, buffer_tokens)
               for L in chosen}
    for s in sources.values():
        check_source(model, s)
    corpus = checked_corpus(resolve_corpus(corpus, model))
    saved = read_set_checkpoint(out)
    dev = torch.device(device) if device is not None else model.decoder.device
    if dtype is None:
        dtype = next(iter(saved[1].values())).dtype if saved is not None else fastest_dtype(dev)
    fingerprint = corpus_fingerprint(corpus)
    set_cfg = SetConfig(kind=kind, layers=chosen, name=name or f"{model.name}-{kind}")
    configs = {L: TrainConfig(
        model=model.name, hook=s.hook, hook_out=s.hook_out, d_in=hook_width(model, s.hook),
        d_out=hook_width(model, s.hook_out), d_sae=d_sae, k=k, architecture=architecture, tokens=tokens, lr=float(lr),
        batch_tokens=batch_tokens, seed=seed, dtype=_dtype_name(dtype), window=window, forward_tokens=forward_tokens,
        buffer_tokens=buffer_tokens, dead_window=dead_window, aux_coefficient=float(aux_coefficient),
        lr_decay=float(lr_decay), corpus=fingerprint, massive_factor=MASSIVE_FACTOR, skip=bool(skip))
        for L, s in sources.items()}
    if saved is not None:
        check_same_set(out, saved[0], set_cfg, saved[1], configs)
    elif (out / SET_FILE).exists():
        raise CheckpointError(f"{out} holds a transcoder set ({SET_FILE}) but no {CHECKPOINT}: not a run "
                              "train_transcoders can resume; choose another out= folder")
    if saved is not None and all(v["cursor"]["finished"] for v in saved[3]["layers"].values()):
        from ..replacement.load import load_transcoders

        return load_transcoders(out, model=model)
    trainers = {L: Trainer(cfg, dev, {**(metadata or {}), "name": f"{set_cfg.name}/layer_{L}"})
                for L, cfg in configs.items()}
    if saved is not None:
        restore_set(trainers, saved[2], saved[3])
    return SetRun(set_cfg, trainers, sources, metadata or {}).run(model, corpus, out, progress, checkpoint_every)



class SetRun:
    """One run of every layer's Trainer over shared forwards."""

    def __init__(self, set_cfg: SetConfig, trainers: dict[int, Trainer], sources: dict[int, Source],
                 metadata: dict[str, Any]):
        self.set_cfg, self.trainers, self.sources, self.metadata = set_cfg, trainers, sources, metadata

    def save_checkpoint(self, out: Path, finished: bool = False) -> None:
        """Every layer's state in one file, written atomically (temporary file, fsync, rename).

        `finished`: the run is over and its set saved, so the file keeps the configurations and cursors alone (what
        a second call reads to load the set instead of training, and to refuse other arguments), not the weights
        and Adam state: 1.8 GB for SmolLM2's 30 layers of 4096 features, which nothing resumes from any more."""
        out.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        layers: dict[str, Any] = {}
        for L, t in self.trainers.items():
            if not finished:
                tensors.update({f"L{L}.{k}": v for k, v in t.state_tensors().items()})
            layers[str(L)] = {"config": asdict(t.cfg), "cursor": asdict(t.cursor), "scale_in": t.scale_in,
                              "scale_out": t.scale_out}
        meta = {"format": FORMAT, "set": asdict(self.set_cfg), "layers": layers}
        tmp = out / (CHECKPOINT + ".tmp")
        save_file(tensors, str(tmp), metadata={"slmviz_train_set_state": json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out / CHECKPOINT)

    def run(self, model: Any, corpus: Any, out: Path, progress: Progress, checkpoint_every: float) -> TranscoderSet:
        trainers = self.trainers
        first = next(iter(trainers.values()))
        cfg = first.cfg
        total = cfg.tokens * len(trainers)
        bar = _progress_bar(progress, total, sum(t.cursor.tokens for t in trainers.values()), "layer-tok",
                            "train_transcoders")
        autocast = _autocast(model.decoder.device, cfg.dtype)
        last_save, t0 = time.monotonic(), time.perf_counter()
        done0 = sum(t.cursor.tokens for t in trainers.values())
        latest: dict[int, dict[str, Any]] = {}
        source = next(iter(self.sources.values()))  # the layers' sources differ only in their hooks
        try:
            while not all(t.cursor.tokens >= t.cfg.tokens for t in trainers.values()):
                epoch = min(t.cursor.epoch for t in trainers.values() if t.cursor.tokens < t.cfg.tokens)
                any_block = False
                for block in plan_blocks(model.tokenizer, corpus, source):
                    any_block = True
                    active = {L: t for L, t in trainers.items()
                              if t.cursor.tokens < t.cfg.tokens and (t.cursor.epoch, t.cursor.block) <= (epoch,
                                                                                                          block.index)}
                    if not active:
                        continue  # every unfinished layer is past this block (planned by tokenizing alone)
                    with autocast:
                        rows = block_rows_by_layer(model, block, {L: self.sources[L] for L in active})
                    for L, t in active.items():
                        self.train_block(t, rows[L], block.index, latest)
                        stats = _summary(latest, trainers, total, done0, t0)
                        _report(bar, progress, stats, SET_POSTFIX)
                        if time.monotonic() - last_save >= checkpoint_every:
                            self.save_checkpoint(out)
                            last_save = time.monotonic()
                    del rows
                    release_freed_memory()
                    if all(t.cursor.tokens >= t.cfg.tokens for t in trainers.values()):
                        break  # the finished checkpoint follows the threshold and the save
                if not any_block or not any(t.cursor.steps for t in trainers.values()):
                    raise CorpusError("the corpus gave no tokens to train on (empty, or only blank documents and "
                                      "single-token windows, whose one position is a window's first)")
                for t in trainers.values():
                    if t.cursor.tokens < t.cfg.tokens and t.cursor.epoch == epoch:
                        t.cursor.epoch, t.cursor.block, t.cursor.batch = epoch + 1, 0, 0
        finally:
            if bar is not None:
                bar.close()
        for t in trainers.values():
            t.cursor.finished = True
        ts = self.finish(model, corpus)
        ts.save(out)
        self.save_checkpoint(out, finished=True)
        for sae in ts:  # where the model runs, as load_transcoders(out, model=model) and a trained CLT return it
            sae.to(getattr(model, "device", "cpu"))
        return ts

    @classmethod
    def from_checkpoint(cls, out: Path, device: str | torch.device = "cpu") -> SetRun:
        """The run out/checkpoint.safetensors holds, every layer's Trainer restored where it stood (to finish it
        there: bench/studies/replacement_curve.py scores a run's copied checkpoints this way)."""
        saved = read_set_checkpoint(Path(out))
        if saved is None:
            raise CheckpointError(f"{out} holds no {CHECKPOINT}")
        set_cfg, configs, tensors, meta = saved
        trainers = {L: Trainer(cfg, torch.device(device), {"name": f"{set_cfg.name}/layer_{L}"})
                    for L, cfg in configs.items()}
        restore_set(trainers, tensors, meta)
        cfg = next(iter(configs.values()))
        sources = {L: Source(READ_HOOK.format(L=L), WRITE_HOOK.format(L=L), cfg.window, cfg.forward_tokens,
                             cfg.buffer_tokens) for L in trainers}
        return cls(set_cfg, trainers, sources, {})

    def finish(self, model: Any, corpus: Any) -> TranscoderSet:
        """The set as the weights stand: BatchTopK's thresholds measured on rows from across `corpus` (the
        training corpus), every coder in the model's units (Trainer.to_sae)."""
        cfg = next(iter(self.trainers.values())).cfg
        if cfg.architecture == "batchtopk":
            with _autocast(model.decoder.device, cfg.dtype):
                samples = threshold_rows_by_layer(model, corpus, self.sources)
            for L, t in self.trainers.items():
                t.estimate_threshold(samples[L].to(t.device) * t.scale_in)
        return TranscoderSet({L: t.to_sae(model) for L, t in self.trainers.items()}, name=self.set_cfg.name,
                             metadata={"trained_by": "slmviz.train_transcoders", **self.metadata,
                                       "set_config": asdict(self.set_cfg)})

    @staticmethod
    def train_block(t: Trainer, rows: Rows, block: int, latest: dict[int, dict[str, Any]]) -> None:
        """Layer t's steps on one block's rows, from where its cursor stands (train_sae's inner loop)."""
        cur, cfg = t.cursor, t.cfg
        if cur.block > block:
            return
        if rows.x.shape[0] == 0:
            cur.block, cur.batch = block + 1, 0
            return
        x = rows.x.to(t.device)
        y = rows.y.to(t.device)
        if t.scale_in == 0.0:
            t.initialise(x, y)
        if cur.batch == 0:
            cur.seen += rows.seen
        order = torch.randperm(x.shape[0], generator=_block_generator(cfg.seed, cur.epoch, block))
        chunks = training_batches(order, cfg.batch_tokens)
        for j in range(cur.batch, len(chunks)):
            idx = chunks[j].to(t.device)
            stats = t.step(x[idx] * t.scale_in, y[idx] * t.scale_out)
            cur.batch, cur.tokens, cur.steps = j + 1, cur.tokens + len(idx), cur.steps + 1
            latest[int(cfg.hook.split(".")[1])] = {**stats, "tokens": cur.tokens}
            if cur.tokens >= cfg.tokens:
                return
        cur.block, cur.batch = block + 1, 0


def block_rows_by_layer(model: Any, block: Any, sources: dict[int, Source]) -> dict[int, Rows]:
    """Every kept row of one block for each layer, from one forward per planned batch that captures every layer's
    input and output (activations.block_rows, for all layers at once; each layer keeps its own rows by sae_rows).

    Each layer's rows are written into buffers of the block's size as each batch's forward ends, instead of kept as
    parts and concatenated at the end: with 30 layers x (input + output) x 16k rows, the parts and their
    concatenation held 2 x 2.8 GB at once, and the concatenation took ~4 s of a block's ~25 s forward (SmolLM2,
    2-core AMD EPYC). The rows are the same values in the same order (kept rows are a prefix of each buffer)."""
    hooks = [h for s in sources.values() for h in s.hooks]
    any_source = next(iter(sources.values()))
    capacity = sum(len(w.ids) for batch in block.batches for w in batch.windows)  # every kept row is a real token
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    filled = dict.fromkeys(sources, 0)
    seen = 0
    for batch in block.batches:
        ids, real = batch_ids(batch, sae_batch_shape(max(len(w.ids) for w in batch.windows), any_source))
        values = forward_hooks(model, ids, hooks)
        first = torch.zeros_like(real)
        first[:, 0] = True
        seen += int(real.sum())
        for L, s in sources.items():
            x = values[s.hook][real]  # [b, L, d] -> [n, d], in the forward's dtype
            y = values[s.hook_out][real]
            keep = sae_rows(x, first[real], y)
            if L not in buffers:
                buffers[L] = (x.new_empty(capacity, x.shape[-1], dtype=torch.float32),
                              y.new_empty(capacity, y.shape[-1], dtype=torch.float32))
            n, at = int(keep.sum()), filled[L]
            buffers[L][0][at:at + n] = x[keep]
            buffers[L][1][at:at + n] = y[keep]
            filled[L] += n
        del values
    return {L: Rows(buffers[L][0][:filled[L]], buffers[L][1][:filled[L]], seen) for L in sources}


def threshold_rows_by_layer(model: Any, corpus: Any, sources: dict[int, Source], rows: int = THRESHOLD_ROWS,
                            blocks: int = THRESHOLD_BLOCKS) -> dict[int, torch.Tensor]:
    """train.threshold_rows for every layer from shared forwards: input rows [<= rows, d_in] per layer, from the
    first batches of `blocks` blocks evenly spaced over one pass."""
    source = next(iter(sources.values()))
    n_blocks = sum(1 for _ in plan_blocks(model.tokenizer, corpus, source))
    chosen = {round(i * (n_blocks - 1) / max(blocks - 1, 1)) for i in range(min(blocks, n_blocks))}
    quota = -(-rows // max(len(chosen), 1))
    parts: dict[int, list[torch.Tensor]] = {L: [] for L in sources}
    for block in plan_blocks(model.tokenizer, corpus, source):
        if block.index not in chosen:
            continue
        got = dict.fromkeys(sources, 0)
        for batch in block.batches:
            if all(g >= quota for g in got.values()):
                break
            rows_now = block_rows_by_layer(model, type(block)(block.index, (batch,)), sources)
            for L, r in rows_now.items():
                if got[L] < quota:
                    parts[L].append(r.x[: quota - got[L]])
                    got[L] += parts[L][-1].shape[0]
    return {L: torch.cat(p)[:rows] for L, p in parts.items()}


def read_set_checkpoint(out: Path, tensors: bool = True) -> tuple[SetConfig, dict[int, TrainConfig],
                                                                  dict[str, torch.Tensor], dict[str, Any]] | None:
    """(set config, {layer: config}, tensors, metadata) of out/checkpoint.safetensors, or None when there is none.
    `tensors=False`: the metadata alone, tensors {} (a full set's checkpoint is hundreds of MB)."""
    path = Path(out) / CHECKPOINT
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {})["slmviz_train_set_state"])
            found = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}  # noqa: SIM118 (not a dict)
        set_cfg = SetConfig(**{**meta["set"], "layers": tuple(meta["set"]["layers"])})
        configs = {int(L): TrainConfig(**v["config"]) for L, v in meta["layers"].items()}
    except Exception as e:
        raise CheckpointError(f"{path} is not a train_transcoders checkpoint this version reads ({e}); train into "
                              "another out= folder") from e
    return set_cfg, configs, found, meta


def checkpoint_tokens(out: Path) -> int | None:
    """The tokens per layer a run in `out` has trained (its checkpoint's cursors, mean over layers), or None when
    it has no checkpoint: where a resumed run starts. Reads the checkpoint's metadata, not its tensors."""
    saved = read_set_checkpoint(out, tensors=False)
    if saved is None:
        return None
    layers = saved[3]["layers"]
    return sum(v["cursor"]["tokens"] for v in layers.values()) // max(len(layers), 1)


def check_same_set(out: Path, saved_set: SetConfig, set_cfg: SetConfig, saved: dict[int, TrainConfig],
                   configs: dict[int, TrainConfig]) -> None:
    """Refuse a checkpoint of another run, naming what differs (train.py's rule for `tokens` does not apply: a
    set is resumed with exactly its arguments)."""
    differ = {k: (v, getattr(set_cfg, k)) for k, v in asdict(saved_set).items()
              if getattr(set_cfg, k) != v and k != "name"}
    if not differ and saved:
        a, b = next(iter(saved.values())), next(iter(configs.values()))
        differ = {k: (v, getattr(b, k)) for k, v in asdict(a).items()
                  if getattr(b, k) != v and k not in ("hook", "hook_out")}
    if differ:
        what = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
        raise CheckpointError(f"{out} holds the checkpoint of another train_transcoders run ({what}); resume it "
                              "with the same arguments, or train into another out= folder")


def restore_set(trainers: dict[int, Trainer], tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    for L, t in trainers.items():
        prefix = f"L{L}."
        t.restore({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}, meta["layers"][str(L)])


def _summary(latest: dict[int, dict[str, Any]], trainers: dict[int, Trainer], total: int, done0: int,
             t0: float) -> dict[str, Any]:
    done = sum(t.cursor.tokens for t in trainers.values())
    evs = [s["explained_variance"] for s in latest.values()]
    return {"tokens": done, "total": total, "layers": {L: dict(s) for L, s in sorted(latest.items())},
            "explained_variance": sum(evs) / len(evs) if evs else float("nan"),
            "worst_explained_variance": min(evs) if evs else float("nan"),
            "l0": sum(s["l0"] for s in latest.values()) / max(len(latest), 1),
            "dead_fraction": max((s["dead_fraction"] for s in latest.values()), default=0.0),
            "tokens_per_s": (done - done0) / max(time.perf_counter() - t0, 1e-9)}
