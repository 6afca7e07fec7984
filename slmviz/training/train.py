"""`slmviz.train_sae` and `slmviz.train_transcoders`: offline, resumable training of an SAE or transcoder, a
transcoder at every layer (PLT), or a cross-layer transcoder (CLT), all by the one loop (training.loop).

    sae = slmviz.train_sae(m, hook="blocks.15.hook_resid_post", corpus="text.jsonl", d_sae=4608, k=32,
                           tokens=2_000_000, out="sae_l15")
    tc = slmviz.train_sae(m, hook="blocks.5.mlp.hook_in", hook_out="blocks.5.hook_mlp_out", ...)  # a transcoder
    ts = slmviz.train_transcoders(m, layers="all", corpus="broad", d_sae=4096, k=64, tokens=1_000_000,
                                  kind="plt", skip=True, out="runs/smollm2_plt")   # one forward feeds every layer
    clt = slmviz.train_transcoders(m, kind="clt", d_sae=1024, k=16, tokens=200_000, out="runs/smollm2_clt")

Each public function checks what only it can (a skip path needs a transcoder; a PLT set saves as JumpReLU; a CLT
covers every layer), then hands its arguments, by name, to `run_training`: the one configuration (TrainConfig), the
checkpoint in `out` (a finished run's object is loaded, an interrupted run resumed, another run's refused), and the
loop. A PLT set's coder at layer L is exactly what train_sae trains for that layer alone with the same arguments: the
same objective, the same rows and the same shuffles; what the set shares is the forward.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..corpora.named import resolve_corpus
from ..features.activations import MASSIVE_FACTOR
from ..features.sae import SAE
from ..formats.checkpoint import CHECKPOINT, CheckpointError, read_checkpoint
from ..progress import ProgressLike
from ..replacement.base import READ_HOOK, WRITE_HOOK
from ..replacement.clt import CrossLayerTranscoder
from ..replacement.transcoder_set import TranscoderSet
from .config import TrainConfig, check_same_run, fastest_dtype
from .loop import Run
from .results import load_result
from .rows import checked_corpus, corpus_fingerprint

SET_KINDS = ("plt", "clt")


def train_sae(model: Any, hook: str, corpus: Any, d_sae: int, k: int, tokens: int, out: str | os.PathLike,
              hook_out: str | None = None, architecture: str = "topk", lr: float = 1e-3, batch_tokens: int = 4096,
              seed: int = 0, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
              progress: ProgressLike = True, window: int = 128, forward_tokens: int = 1024, buffer_tokens: int = 65_536,
              dead_window: int = 500_000, aux_coefficient: float = 1.0, lr_decay: float = 0.2,
              checkpoint_every: float = 120.0, metadata: dict[str, Any] | None = None, skip: bool = False) -> SAE:
    """Train an SAE on `hook` (a transcoder predicting `hook_out`) over `corpus`, checkpointing to `out`.

    d_sae features, k active per token (TopK) or on average (BatchTopK, saved as jumprelu); `tokens` rows trained
    on (the corpus is read again as often as needed); `batch_tokens` rows per step. corpus: a list of strings, a
    .txt / .jsonl / .parquet path, or a corpus name ("broad", "mixed", ...). device: where the SAE trains (default:
    the model's device). dtype: "float32" or "bfloat16" for the matmuls of the activations' forwards and of the SAE
    step (Adam and the weights stay fp32); None picks bf16 where it measures >= BF16_SPEEDUP faster
    (`config.fastest_dtype`), or the dtype of the checkpoint being resumed. progress: a tqdm bar (True), nothing
    (False), or fn(stats) after every step (training.report). checkpoint_every: seconds between checkpoints (0:
    after every step). window / forward_tokens / buffer_tokens: tokens per window, padded tokens per forward, real
    tokens per shuffled block. dead_window: rows without firing after which a feature counts as dead (and the AuxK
    loss, weighted by aux_coefficient, revives it). lr_decay: the fraction of the tokens over which the learning
    rate decays linearly to 0.
    skip: a skip transcoder (Paulo et al. 2025, "Transcoders beat sparse autoencoders"): a learned linear term
    x @ W_skip.T (W_skip [d_out, d_in], started at the first block's least-squares fit) is added to the prediction,
    so the features spend themselves on what a linear map of the input cannot predict; saved as SAELens's
    (jumprelu_)skip_transcoder.
    Returns the trained SAE, also saved in `out` (SAELens format). A finished run in `out` is loaded, not re-run; an
    interrupted one resumes (`tokens` may change while the run is before its learning-rate decay).
    """
    hook_out = hook if hook_out is None else hook_out
    if skip and hook_out == hook:
        raise ValueError("skip=True is for transcoders (hook_out= another hook): an SAE's skip term would learn the "
                         "identity and leave its features nothing to reconstruct")
    return run_training(model, "sae", [(hook, hook_out)], **arguments_of(locals(), "model", "hook", "hook_out"))


def train_transcoders(model: Any, layers: str | Sequence[int] = "all", corpus: Any = "broad", d_sae: int = 4096,
                      k: int = 64, tokens: int = 1_000_000, out: str | os.PathLike = "transcoders", kind: str = "plt",
                      skip: bool = True, architecture: str = "batchtopk", lr: float = 1e-3, batch_tokens: int = 512,
                      seed: int = 0, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                      progress: ProgressLike = True, window: int = 128, forward_tokens: int = 1024,
                      buffer_tokens: int = 16_384, dead_window: int = 500_000, aux_coefficient: float = 1.0,
                      lr_decay: float = 0.2, checkpoint_every: float = 600.0, name: str = "",
                      metadata: dict[str, Any] | None = None, pre_act_coefficient: float = 0.0
                      ) -> TranscoderSet | CrossLayerTranscoder:
    """Train a transcoder at every layer in `layers` (kind="plt") or one cross-layer transcoder over every layer
    (kind="clt"; `k` per layer), from one forward per batch, checkpointing to `out`.

    The arguments are train_sae's (one value for every layer); `corpus="broad"` is the bundled training corpus.
    A PLT set's coder at layer L reads `blocks.L.mlp.hook_in` and predicts `blocks.L.hook_mlp_out`, exactly as
    train_sae would for that layer alone; a CLT's layer-L features read the same input and write every later MLP
    output (training.clt_objective). Returns the set (a CrossLayerTranscoder for kind="clt"), also saved in `out`;
    a finished run there is loaded, not re-run, and an interrupted one resumes (CheckpointError names what differs
    otherwise). `progress`: a tqdm bar whose postfix shows the layers' mean and worst explained variance, L0 and
    dead fraction, nothing (False), or fn(stats) after every step of every coder (training.report: `layers` holds
    each layer's figures). `name`: what the saved set is called (default "{model}-{kind}").
    `pre_act_coefficient` (CLT only): the weight of its pre-activation loss (clt_objective.pre_act_loss).

    Memory: one block's rows for every layer (buffer_tokens x n_layers x (d_in + d_out) floats), whatever the
    number of tokens trained.
    """
    if kind not in SET_KINDS:
        raise ValueError(f"kind must be one of {SET_KINDS}, got {kind!r}")
    if kind == "plt" and architecture == "topk":
        raise ValueError("a per-layer transcoder set trains as architecture='batchtopk' (saved as JumpReLU): SAELens "
                         "and circuit-tracer have no TopK transcoder format to save it in")
    if kind == "plt" and pre_act_coefficient:
        raise ValueError("pre_act_coefficient is a CLT's (kind='clt'); a per-layer set trains without it")
    if kind == "clt" and skip and architecture == "topk":
        raise ValueError("a TopK CLT with a skip path has no file format (circuit-tracer reads no skip path, Gemma "
                         "Scope 2's CLTs are JumpReLU): train architecture='batchtopk' or skip=False")
    chosen = resolve_layers(layers, model.cfg.n_layers)
    if kind == "clt" and chosen != tuple(range(model.cfg.n_layers)):
        raise ValueError(f"a CLT covers every layer (its features write all later ones): layers='all', not {layers!r}")
    hooks = [(READ_HOOK.format(L=L), WRITE_HOOK.format(L=L)) for L in chosen]
    return run_training(model, kind, hooks, name=name or f"{model.name}-{kind}",
                        **arguments_of(locals(), "model", "layers", "kind", "chosen", "hooks", "name"))


def arguments_of(scope: dict[str, Any], *consumed: str) -> dict[str, Any]:
    """A public trainer's arguments by name (its `locals()`), less those it has already turned into others: what
    run_training takes, so that no argument list is written out a second time."""
    return {name: value for name, value in scope.items() if name not in consumed}


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


def run_training(model: Any, kind: str, hooks: list[tuple[str, str]], corpus: Any, out: str | os.PathLike,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None,
                 progress: ProgressLike = True, checkpoint_every: float = 600.0, metadata: dict[str, Any] | None = None,
                 **arguments: Any) -> Any:
    """The path every public trainer takes: the configuration from its `arguments` (TrainConfig's fields, by name),
    then a finished run in `out` loaded, an interrupted one resumed, or a new one trained; a checkpoint of another
    run, or a folder that holds files but no checkpoint, is refused (CheckpointError) before anything is trained."""
    out = Path(out)
    corpus = checked_corpus(resolve_corpus(corpus, model))
    saved = read_checkpoint(out, tensors=False)
    dev = torch.device(device) if device is not None else model.decoder.device
    if dtype is None:
        dtype = saved.config["dtype"] if saved is not None else fastest_dtype(dev)
    cfg = TrainConfig.of(model, kind, hooks, corpus_fingerprint(corpus), MASSIVE_FACTOR, dtype=dtype, **arguments)
    if saved is None:
        if out.is_dir() and any(p.name != CHECKPOINT + ".tmp" for p in out.iterdir()):
            raise CheckpointError(f"{out} holds files but no {CHECKPOINT}: not a run to resume; choose another out= "
                                  "folder")
    else:
        done = max(c["cursor"]["tokens"] for c in saved.coders.values())
        check_same_run(out, TrainConfig.from_json(saved.config), cfg, done)
        if saved.finished:
            return load_result(cfg, out, model)
    run = Run(cfg, dev, metadata)
    if saved is not None:
        run.restore(read_checkpoint(out))
    return run.train(model, corpus, out, progress, checkpoint_every)
