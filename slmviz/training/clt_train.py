"""Training a cross-layer transcoder: `train_transcoders(model, kind="clt", ...)` (features.train_set dispatches here).

    clt = slmviz.train_transcoders(m, layers="all", kind="clt", corpus="broad", d_sae=1024, k=16,
                                   tokens=200_000, skip=False, out="runs/smollm2_clt")

One forward per planned batch captures every layer's input hook and MLP output (as the PLT trainer's); a row is kept
when every layer keeps it (activations.sae_rows on each layer's input and target), since one CLT step sees a token
at every layer at once. The step is train.Trainer's, over all layers together:

    h_L = (x_L @ W_enc[L] + b_enc[L]) * |W_dec[L][f]|          (rescale_acts_by_decoder_norm: the norm of feature
                                                                f's decoder over every layer it writes)
    f_L = TopK(h_L) per row, or BatchTopK (the k*B largest over the batch; saved as JumpReLU with a threshold
          measured at the end on rows from across the corpus, one per layer)
    y_j = Σ_{L ≤ j} (f_L / |W_dec[L][f]|) W_dec[L][:, j - L] + b_dec[j] (+ x_j @ W_skip[j].T)
    loss = Σ_j mean over rows of |y_j - target_j|² + Σ_L AuxK_L (dead features of layer L reconstruct the residual
           of every layer they write)

Inputs and targets are scaled per layer to mean squared norm d_model (train.py's reason; folded into the weights
when saved). Adam (0.9, 0.999), the gradient norm clipped to 1 over every parameter, the learning rate decaying
linearly to 0 over the last `lr_decay` of the tokens, W_dec rows started at norm 0.1 with W_enc[L] their layer-L
slice transposed, b_dec at the first block's mean targets, W_skip (skip=True) at each layer's least-squares fit.

The input hook is `blocks.L.mlp.hook_in`, what the MLP computes from (Gemma Scope 2's choice and slmviz's PLTs'): the
norm's per-token scale is then already divided out, so one feature's encoder reads every token on one scale, where
`hook_resid_mid`'s norm grows with depth and with the attention sink's massive rows.

Checkpoints: out/checkpoint.safetensors (weights, Adam, dead-feature counters, thresholds, and in its metadata the
configuration, the cursor and the scales), written to a temporary name and renamed once `checkpoint_every` seconds
have passed since the last, checked after each step; a run killed at any moment (kill -9 included) resumes from it
and ends with the weights of a run never stopped (a resume inside a block runs that block's forward again). Not at
every block's end as well: SmolLM2's CLT checkpoint is 1.75 GB (146M weights and two Adam moments), ~12 s to write
on a 2-core AMD EPYC (timed for the PLT set's 1.8 GB), where a 16k-token block ends every ~150 s.
A resume with other arguments is refused, naming them. The finished CLT is saved in
`out` (formats.circuit_tracer: circuit-tracer's layout, Gemma Scope 2's for a JumpReLU CLT with a skip path).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

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
    plan_blocks,
    sae_batch_shape,
    sae_rows,
)
from ..replacement.clt import CrossLayerTranscoder, input_hook_local
from .train_sae import (
    CHECKPOINT,
    CLIP_GRAD_NORM,
    INIT_DECODER_NORM,
    SET_POSTFIX,
    THRESHOLD_BLOCKS,
    THRESHOLD_ROWS,
    CheckpointError,
    Cursor,
    _autocast,
    _block_generator,
    _dtype_name,
    _linear_fit,
    _progress_bar,
    _report,
    _unit_scale,
    active_entries,
    adam,
    batch_threshold,
    check_run,
    dead_feature_decode,
    decode_sparse,
    fastest_dtype,
    release_freed_memory,
    training_batches,
)

FORMAT = 1
STATE_KEY = "slmviz_train_clt_state"
Progress = bool | Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class CLTConfig:
    """Everything that decides a CLT run's weights; a checkpoint is resumed only under an equal configuration."""

    model: str
    n_layers: int
    d_model: int
    d_sae: int
    k: int
    architecture: str
    tokens: int
    lr: float
    batch_tokens: int
    seed: int
    dtype: str
    window: int
    forward_tokens: int
    buffer_tokens: int
    dead_window: int
    aux_coefficient: float
    lr_decay: float
    corpus: str
    massive_factor: float
    input_hook: str
    skip: bool
    name: str
    pre_act_coefficient: float = 0.0  # last, with a default: checkpoints written before it read as 0 (none)


def train_clt(model: Any, corpus: Any = "broad", d_sae: int = 1024, k: int = 16, tokens: int = 200_000,
              out: str | os.PathLike = "clt", skip: bool = False, architecture: str = "batchtopk", lr: float = 1e-3,
              batch_tokens: int = 512, seed: int = 0, device: str | torch.device | None = None,
              dtype: str | torch.dtype | None = None, progress: Progress = True, window: int = 128,
              forward_tokens: int = 1024, buffer_tokens: int = 16_384, dead_window: int = 500_000,
              aux_coefficient: float = 1.0, lr_decay: float = 0.2, checkpoint_every: float = 600.0, name: str = "",
              metadata: dict[str, Any] | None = None, input_hook: str = "mlp.hook_in",
              pre_act_coefficient: float = 0.0) -> CrossLayerTranscoder:
    """Train a CLT over every layer of `model` (module docstring); train_transcoders(kind="clt") calls this with its
    own arguments. Returns the CLT, also saved in `out`; a finished run there is loaded, an interrupted one
    resumed. `k`: features active per token *per layer* (TopK), or on average (BatchTopK). `pre_act_coefficient`:
    the weight of the pre-activation loss (pre_act_loss), which keeps k features per token active; 0 leaves it out."""
    from ..corpora.named import resolve_corpus
    from ..replacement.load import load_clt

    out = Path(out)
    check_run(architecture, d_sae, k, tokens, batch_tokens, window, forward_tokens, buffer_tokens, "a CLT layer")
    if pre_act_coefficient < 0:
        raise ValueError(f"pre_act_coefficient must be >= 0, got {pre_act_coefficient}")
    if skip and architecture == "topk":
        raise ValueError("a TopK CLT with a skip path has no file format (circuit-tracer reads no skip path, Gemma "
                         "Scope 2's CLTs are JumpReLU): train architecture='batchtopk' or skip=False")
    hook = input_hook_local(input_hook)
    cfg_m = model.cfg
    sources = {L: Source(f"blocks.{L}.{hook}", f"blocks.{L}.hook_mlp_out", window, forward_tokens, buffer_tokens)
               for L in range(cfg_m.n_layers)}
    for s in sources.values():
        check_source(model, s)
    corpus = checked_corpus(resolve_corpus(corpus, model))
    saved = read_clt_checkpoint(out)
    dev = torch.device(device) if device is not None else model.decoder.device
    if dtype is None:
        dtype = saved[0].dtype if saved is not None else fastest_dtype(dev)
    cfg = CLTConfig(
        model=model.name, n_layers=cfg_m.n_layers, d_model=cfg_m.d_model, d_sae=d_sae, k=k,
        architecture=architecture, tokens=tokens, lr=float(lr), batch_tokens=batch_tokens, seed=seed,
        dtype=_dtype_name(dtype), window=window, forward_tokens=forward_tokens, buffer_tokens=buffer_tokens,
        dead_window=dead_window, aux_coefficient=float(aux_coefficient), lr_decay=float(lr_decay),
        corpus=corpus_fingerprint(corpus), massive_factor=MASSIVE_FACTOR, input_hook=hook, skip=bool(skip),
        name=name or f"{model.name}-clt", pre_act_coefficient=float(pre_act_coefficient))
    if saved is not None:
        differ = {k_: (v, getattr(cfg, k_)) for k_, v in asdict(saved[0]).items() if getattr(cfg, k_) != v}
        if differ:
            what = ", ".join(f"{k_}: {a!r} there, {b!r} now" for k_, (a, b) in differ.items())
            raise CheckpointError(f"{out} holds the checkpoint of another CLT run ({what}); resume it with the same "
                                  "arguments, or train into another out= folder")
    elif out.is_dir() and any(out.iterdir()):
        raise CheckpointError(f"{out} holds files but no {CHECKPOINT}: not a CLT run train_transcoders can resume; "
                              "choose another out= folder")
    if saved is not None and saved[2]["cursor"]["finished"]:
        return load_clt(out, model=model)
    trainer = CLTTrainer(cfg, dev, metadata or {})
    if saved is not None:
        trainer.restore(saved[1], saved[2])
    return trainer.run(model, corpus, sources, out, progress, checkpoint_every)


def read_clt_checkpoint(out: Path, tensors: bool = True
                        ) -> tuple[CLTConfig, dict[str, torch.Tensor], dict[str, Any]] | None:
    """(config, tensors, metadata) of out/checkpoint.safetensors, or None when there is none. `tensors=False`
    reads the header alone (tensors {}), as for a finished run, whose file is read for its arguments alone (an
    older one still holds 1.9 GB of weights)."""
    from safetensors import safe_open

    path = Path(out) / CHECKPOINT
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = json.loads((f.metadata() or {})[STATE_KEY])
            wanted = tensors and not meta["cursor"]["finished"]
            found = {k: f.get_tensor(k) for k in f.keys()} if wanted else {}  # noqa: SIM118 (not a dict)
        cfg = CLTConfig(**meta["config"])
    except Exception as e:
        raise CheckpointError(f"{path} is not a CLT training checkpoint this version reads ({e}); train into "
                              "another out= folder") from e
    return cfg, found, meta


def clt_block_rows(model: Any, block: Any, sources: dict[int, Source]) -> Rows:
    """One block's rows at every layer: x, y [n, n_layers, d_model] from one forward per planned batch, a row kept
    where every layer's sae_rows keeps it."""
    xs, ys, seen = [], [], 0
    hooks = [h for s in sources.values() for h in s.hooks]
    any_source = next(iter(sources.values()))
    for batch in block.batches:
        ids, real = batch_ids(batch, sae_batch_shape(max(len(w.ids) for w in batch.windows), any_source))
        values = forward_hooks(model, ids, hooks)
        first = torch.zeros_like(real)
        first[:, 0] = True
        x = torch.stack([values[s.hook][real].float() for s in sources.values()], dim=1)  # [n, n_layers, d]
        y = torch.stack([values[s.hook_out][real].float() for s in sources.values()], dim=1)
        keep = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
        for i in range(x.shape[1]):
            keep &= sae_rows(x[:, i], first[real], y[:, i])
        xs.append(x[keep])
        ys.append(y[keep])
        seen += int(real.sum())
        del values
    return Rows(torch.cat(xs), torch.cat(ys), seen)


class CLTTrainer:
    """The state of one CLT run: weights, Adam, dead-feature counters, thresholds, per-layer scales, the cursor."""

    def __init__(self, cfg: CLTConfig, device: torch.device, metadata: dict[str, Any]):
        self.cfg, self.device, self.metadata = cfg, device, metadata
        n, d, f = cfg.n_layers, cfg.d_model, cfg.d_sae
        z = dict(dtype=torch.float32, device=device)
        P = torch.nn.Parameter
        self.W_enc = P(torch.zeros(n, d, f, **z))
        self.b_enc = P(torch.zeros(n, f, **z))
        self.W_dec = [P(torch.zeros(f, n - L, d, **z)) for L in range(n)]
        self.b_dec = P(torch.zeros(n, d, **z))
        self.W_skip = P(torch.zeros(n, d, d, **z)) if cfg.skip else None  # [L, d_out, d_in]
        self.params = [self.W_enc, self.b_enc, self.b_dec, *self.W_dec] + ([self.W_skip] if cfg.skip else [])
        self.optimizer = adam(self.params, cfg.lr)
        self.since_fired = torch.zeros(n, f, dtype=torch.long, device=device)
        self.threshold = torch.zeros(n, dtype=torch.float64, device=device)  # BatchTopK's, per layer, scaled units
        self.scale_in = [0.0] * n
        self.scale_out = [0.0] * n
        self.cursor = Cursor()

    # ---- state -------------------------------------------------------------------------------------------------
    def initialise(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Per-layer scales, W_dec rows of norm 0.1 (over every layer a feature writes), W_enc[L] their layer-L
        slices transposed, b_dec the mean targets, W_skip each layer's least-squares fit (x, y: [n, layers, d])."""
        cfg = self.cfg
        n, d = cfg.n_layers, cfg.d_model
        self.scale_in = [_unit_scale(x[:, L]) for L in range(n)]
        self.scale_out = [_unit_scale(y[:, L]) for L in range(n)]
        s_in = torch.tensor(self.scale_in, dtype=torch.float64)[:, None]
        s_out = torch.tensor(self.scale_out, dtype=torch.float64)[:, None]
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for L in range(n):
                w = torch.empty(cfg.d_sae, (n - L) * d)
                torch.nn.init.kaiming_uniform_(w, generator=g)
                w = w / w.norm(dim=-1, keepdim=True) * INIT_DECODER_NORM
                self.W_dec[L].copy_(w.view(cfg.d_sae, n - L, d))
                e = w.view(cfg.d_sae, n - L, d)[:, 0]
                self.W_enc[L].copy_((e / e.norm(dim=-1, keepdim=True) * INIT_DECODER_NORM).T)
            if self.W_skip is not None:  # the fit sets every layer's b_dec too
                for L in range(n):
                    W, b = _linear_fit(x[:, L] * float(s_in[L]), y[:, L] * float(s_out[L]))
                    self.W_skip[L].copy_(W.float())
                    self.b_dec[L].copy_(b.float())
            else:
                self.b_dec.copy_((y.double() * s_out.to(y.device)[None]).mean(0).float())  # [N, n, d] * [1, n, 1]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        t = {"W_enc": self.W_enc, "b_enc": self.b_enc, "b_dec": self.b_dec, "since_fired": self.since_fired,
             "threshold": self.threshold}
        t.update({f"W_dec_{L}": w for L, w in enumerate(self.W_dec)})
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
            for name in ("W_enc", "b_enc", "b_dec") + (("W_skip",) if self.W_skip is not None else ()):
                getattr(self, name).copy_(tensors[name])
            for L, w in enumerate(self.W_dec):
                w.copy_(tensors[f"W_dec_{L}"])
        self.since_fired = tensors["since_fired"].to(self.device)
        self.threshold = tensors["threshold"].to(self.device)
        for i, p in enumerate(self.params):
            if f"adam.{i}.step" in tensors:
                self.optimizer.state[p] = {k: tensors[f"adam.{i}.{k}"].to(self.device if k != "step" else "cpu")
                                           for k in ("step", "exp_avg", "exp_avg_sq")}
        self.scale_in, self.scale_out = list(meta["scale_in"]), list(meta["scale_out"])
        self.cursor = Cursor(**meta["cursor"])

    def save_checkpoint(self, out: Path) -> None:
        """out/checkpoint.safetensors, atomically (temporary file, fsync, rename); a finished run's keeps no tensors."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "config": asdict(self.cfg), "cursor": asdict(self.cursor),
                "scale_in": self.scale_in, "scale_out": self.scale_out}
        # Finished (the CLT saved): the arguments and cursor alone, not the weights and Adam state that nothing
        # resumes from any more (1.9 GB for SmolLM2's recipe)
        tensors = {} if self.cursor.finished else self.state_tensors()
        tmp = out / (CHECKPOINT + ".tmp")
        save_file(tensors, str(tmp), metadata={STATE_KEY: json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out / CHECKPOINT)

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self, model: Any, corpus: Any, sources: dict[int, Source], out: Path, progress: Progress,
            checkpoint_every: float) -> CrossLayerTranscoder:
        cfg, cur = self.cfg, self.cursor
        bar = _progress_bar(progress, cfg.tokens, cur.tokens, "tok", "train_transcoders(clt)")
        last_save, t0, tokens0 = time.monotonic(), time.perf_counter(), cur.tokens
        autocast = _autocast(model.decoder.device, cfg.dtype)
        source = sources[0]
        try:
            while cur.tokens < cfg.tokens:
                any_block = False
                for block in plan_blocks(model.tokenizer, corpus, source):
                    any_block = True
                    if block.index < cur.block:
                        continue  # done before the resume: planned by tokenizing alone, no forward
                    with autocast:
                        rows = clt_block_rows(model, block, sources)
                    if rows.x.shape[0] == 0:
                        cur.block, cur.batch = block.index + 1, 0
                        continue
                    x, y = rows.x.to(self.device), rows.y.to(self.device)
                    if self.scale_in[0] == 0.0:
                        self.initialise(x, y)
                    s_in = torch.tensor(self.scale_in, device=self.device)[None, :, None]
                    s_out = torch.tensor(self.scale_out, device=self.device)[None, :, None]
                    if cur.batch == 0:
                        cur.seen += rows.seen
                    order = torch.randperm(x.shape[0], generator=_block_generator(cfg.seed, cur.epoch, block.index))
                    chunks = training_batches(order, cfg.batch_tokens)
                    for j in range(cur.batch, len(chunks)):
                        idx = chunks[j].to(self.device)
                        stats = self.step(x[idx] * s_in, y[idx] * s_out)
                        cur.batch, cur.tokens, cur.steps = j + 1, cur.tokens + len(idx), cur.steps + 1
                        stats.update(tokens=cur.tokens, total=cfg.tokens, step=cur.steps,
                                     tokens_per_s=(cur.tokens - tokens0) / max(time.perf_counter() - t0, 1e-9))
                        _report(bar, progress, stats, SET_POSTFIX)
                        if cur.tokens >= cfg.tokens:
                            break
                        if time.monotonic() - last_save >= checkpoint_every:
                            self.save_checkpoint(out)
                            last_save = time.monotonic()
                    if cur.tokens >= cfg.tokens:
                        break
                    cur.block, cur.batch = block.index + 1, 0
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
                sample = clt_threshold_rows(model, corpus, sources)
            s_in = torch.tensor(self.scale_in, device=self.device)[None, :, None]
            self.estimate_threshold(sample.to(self.device) * s_in)
        cur.finished = True
        clt = self.to_clt()
        clt.save(out, format="gemma-scope-2" if clt.W_skip is not None else "circuit-tracer")
        self.save_checkpoint(out)
        clt.to(getattr(model, "device", "cpu"))
        return clt

    def pre(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's h_L [B, d_sae] (times its decoder norms) and the norms [d_sae], from x [B, n, d]."""
        cfg = self.cfg
        hs, norms = [], []
        with _autocast(x.device, cfg.dtype):
            for L in range(cfg.n_layers):
                nrm = self.W_dec[L].flatten(1).norm(dim=-1)  # [d_sae]: over every layer the feature writes
                hs.append((x[:, L] @ self.W_enc[L] + self.b_enc[L]).float() * nrm)  # [B, d] -> [B, d_sae]
                norms.append(nrm)
        return hs, norms

    def decode(self, active: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], norms: list[torch.Tensor],
               x: torch.Tensor) -> torch.Tensor:
        """y_hat [B, n, d]: every layer's active features decoded into the layers they write, plus b_dec and skip."""
        cfg = self.cfg
        n, d, b = cfg.n_layers, cfg.d_model, x.shape[0]
        y_hat = self.b_dec[None].expand(b, n, d).clone()
        for L, (rows, feats, acts) in enumerate(active):
            dec = decode_sparse(rows, feats, acts / norms[L][feats], self.W_dec[L].flatten(1), b)  # [B, (n-L) d]
            y_hat[:, L:] = y_hat[:, L:] + dec.view(b, n - L, d)
        if self.W_skip is not None:
            with _autocast(x.device, cfg.dtype):
                skip = torch.einsum("bli,loi->blo", x, self.W_skip)  # [B, n, d_in] -> [B, n, d_out]
            y_hat = y_hat + skip.float()
        return y_hat

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """One optimizer step on x, y [B, n_layers, d_model] (scaled units). Returns the batch's statistics."""
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.cursor.tokens)
        dead = self.since_fired > cfg.dead_window  # [n, d_sae]
        hs, norms = self.pre(x)
        active = [self.activate(L, h) for L, h in enumerate(hs)]
        y_hat = self.decode(active, norms, x)
        per_layer = (y_hat - y).pow(2).sum(-1).mean(0)  # [n]
        mse = per_layer.sum()
        residual = y - y_hat.detach()
        aux = sum((self.aux_loss(L, hs[L], dead[L], residual[:, L:].flatten(1), norms[L])
                   for L in range(cfg.n_layers)), start=y.new_zeros(()))
        pre_act = cfg.pre_act_coefficient * pre_act_loss(hs) if cfg.pre_act_coefficient else y.new_zeros(())
        loss = mse + aux + pre_act
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, CLIP_GRAD_NORM)
        self.optimizer.step()
        with torch.no_grad():
            self.since_fired += x.shape[0]
            for L, (_, feats, _) in enumerate(active):
                self.since_fired[L, feats] = 0
            err = (y_hat - y).pow(2).sum((0, 2))  # [n]
            var = (y - y.mean(0)).pow(2).sum((0, 2))  # [n]
            ev = 1 - err / var
        l0 = [a[1].numel() / x.shape[0] for a in active]
        return {"loss": loss.item(), "mse": mse.item(), "aux": float(aux), "pre_act": pre_act.item(),
                "explained_variance": float(1 - err.sum()
                / var.sum()), "worst_explained_variance": float(ev.min()), "l0": sum(l0) / len(l0),
                "l0_total": sum(l0), "dead_fraction": float(dead.float().mean())}

    def activate(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s active entries of h [B, d_sae] as (row, feature, value), grouped by row (train.Trainer's
        activate, with one BatchTopK threshold per layer)."""
        rows, feats, values, self.threshold[layer] = active_entries(h, self.cfg.architecture, self.cfg.k,
                                                                     self.threshold[layer])
        return rows, feats, values

    def aux_loss(self, layer: int, h: torch.Tensor, dead: torch.Tensor, residual: torch.Tensor,
                 norms: torch.Tensor) -> torch.Tensor:
        """train.Trainer.aux_loss for layer `layer`: its top k_aux dead pre-activations reconstruct the residual of
        every layer they write (residual [B, (n - L) d])."""
        n_dead = int(dead.sum())
        if n_dead == 0:
            return h.new_zeros(())
        k_aux = self.cfg.d_model // 2
        scale = min(n_dead / k_aux, 1.0)
        k_aux = min(k_aux, n_dead)
        recons = dead_feature_decode(h, dead, k_aux, norms, self.W_dec[layer].flatten(1))
        return self.cfg.aux_coefficient * scale * (recons - residual).pow(2).sum(-1).mean()

    @torch.no_grad()
    def estimate_threshold(self, x: torch.Tensor) -> None:
        """Each layer's BatchTopK threshold measured on x [m, n, d] (scaled rows from across the corpus): the largest
        value below the k*m largest activations (train.Trainer.estimate_threshold)."""
        hs, _ = self.pre(x)
        for L, h in enumerate(hs):
            self.threshold[L] = batch_threshold(h, self.cfg.k)

    def lr_at(self, tokens: int) -> float:
        cfg = self.cfg
        if cfg.lr_decay == 0:
            return cfg.lr
        return cfg.lr * min(1.0, (cfg.tokens - tokens) / (cfg.lr_decay * cfg.tokens))

    # ---- the result ----------------------------------------------------------------------------------------------
    def to_clt(self) -> CrossLayerTranscoder:
        """The trained CLT in the model's units. Features keep their training scale (`n_f = |W_dec[L][f]|`, the
        norm of feature f's decoder over every layer it writes; exact for TopK, whose selection already ran on
        `h n_f`): `W_enc'[L] = W_enc[L] s_in[L] n_f`, `b_enc'[L] = b_enc[L] n_f`,
        `W_dec'[L][:, i] = W_dec[L][:, i] / (n_f s_out[L + i])`, `b_dec'[j] = b_dec[j] / s_out[j]`,
        `W_skip'[j] = W_skip[j] s_in[j] / s_out[j]`; a threshold, measured on `h n_f`, stays."""
        cfg = self.cfg
        n = cfg.n_layers
        arch = "topk" if cfg.architecture == "topk" else "jumprelu"
        meta = {"model_name": cfg.model, "training_config": asdict(cfg), "trained_on_tokens": self.cursor.tokens,
                "trained_on_architecture": cfg.architecture, "input_scales": self.scale_in,
                "output_scales": self.scale_out, "trained_by": "slmviz.train_transcoders(kind='clt')",
                **self.metadata}
        clt = CrossLayerTranscoder(n, cfg.d_model, cfg.d_sae, architecture=arch, k=cfg.k if arch == "topk" else None,
                                   input_hook=cfg.input_hook, skip=cfg.skip, name=cfg.name, metadata=meta)
        s_in = torch.tensor(self.scale_in, dtype=torch.float64)
        s_out = torch.tensor(self.scale_out, dtype=torch.float64)
        with torch.no_grad():
            for L in range(n):
                nrm = self.W_dec[L].flatten(1).norm(dim=-1).clamp(min=1e-8).double().cpu()  # [d_sae]
                clt.W_enc[L] = (self.W_enc[L].double().cpu() * s_in[L] * nrm).float()
                clt.b_enc[L] = (self.b_enc[L].double().cpu() * nrm).float()
                w = self.W_dec[L].double().cpu() / nrm[:, None, None] / s_out[L:][None, :, None]
                clt.W_dec[L].copy_(w.float())
                clt.b_dec[L] = (self.b_dec[L].double().cpu() / s_out[L]).float()
                if clt.threshold is not None:
                    clt.threshold[L] = float(self.threshold[L])
                if clt.W_skip is not None:
                    clt.W_skip[L] = (self.W_skip[L].double().cpu() * s_in[L] / s_out[L]).float()
        return clt


def pre_act_loss(hs: list[torch.Tensor]) -> torch.Tensor:
    """Σ_L mean over rows of Σ_f relu(-h_L[f]), h_L = pre-activation x decoder norm (CLTTrainer.pre): Anthropic's
    pre-activation loss (Ameisen et al. 2025, "Circuit Tracing", methods: λ_p Σ relu(-h_f) |W_dec,f|).

    Why: a feature below zero on a token gets no gradient from the reconstruction (relu, then BatchTopK or TopK), so
    nothing lifts it back. A CLT's features write many layers, and early in training a selected feature that helps
    one layer and hurts the rest is pushed below zero: without this loss SmolLM2's BatchTopK CLT went from 32
    features per token and layer to 12 within 10k tokens and ~5 by the end, however long it trained
    (docs/cross-layer-transcoders.md). This term pulls every negative pre-activation towards zero, in proportion
    to how much the feature writes, so k per token stay above zero for BatchTopK to choose from. Left out (0), the
    trainer is the plain BatchTopK/TopK one."""
    return sum((h.neg().relu().sum(-1).mean() for h in hs), start=hs[0].new_zeros(()))


def clt_threshold_rows(model: Any, corpus: Any, sources: dict[int, Source], rows: int = THRESHOLD_ROWS,
                       blocks: int = THRESHOLD_BLOCKS) -> torch.Tensor:
    """train.threshold_rows for a CLT: input rows [<= rows, n_layers, d] from the first batches of `blocks` blocks
    evenly spaced over one pass."""
    source = sources[0]
    n_blocks = sum(1 for _ in plan_blocks(model.tokenizer, corpus, source))
    chosen = {round(i * (n_blocks - 1) / max(blocks - 1, 1)) for i in range(min(blocks, n_blocks))}
    quota = -(-rows // max(len(chosen), 1))
    parts: list[torch.Tensor] = []
    for block in plan_blocks(model.tokenizer, corpus, source):
        if block.index not in chosen:
            continue
        got = 0
        for batch in block.batches:
            x = clt_block_rows(model, type(block)(block.index, (batch,)), sources).x
            parts.append(x[: quota - got])
            got += parts[-1].shape[0]
            if got >= quota:
                break
    return torch.cat(parts)[:rows]
