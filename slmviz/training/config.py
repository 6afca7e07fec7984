"""What a training run is: one configuration for train_sae and train_transcoders of either kind, the coders it
trains, each coder's cursor, and the precision of its matmuls."""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..formats.checkpoint import CheckpointError
from ..hooks import check_names, hook_shape, layer_of
from ..model.params import BF16_SPEEDUP, bf16_bulk_speedup

KINDS = ("sae", "plt", "clt")
TRAIN_ARCHITECTURES = ("topk", "batchtopk")
# What keeps k features active, for the messages: one SAE, each coder of a set, each layer of a CLT
CODER_WORD = {"sae": "an SAE", "plt": "a coder", "clt": "a CLT layer"}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a run's weights: the public trainers' arguments, resolved (`TrainConfig.of`) and
    saved in the run's checkpoint, so a run resumes only under an equal configuration (`check_same_run`).

    `kind` says what is trained and saved: "sae" one coder (an SAE, or a transcoder when its hooks differ) saved in
    SAELens's layout; "plt" one coder per layer saved as a TranscoderSet; "clt" one coder over every layer saved as a
    CrossLayerTranscoder. `hooks` holds the (read, write) hooks of each layer trained (one pair for "sae")."""

    kind: str
    model: str
    hooks: tuple[tuple[str, str], ...]
    d_in: int
    d_out: int
    d_sae: int
    k: int
    architecture: str
    tokens: int
    lr: float
    batch_tokens: int
    seed: int
    dtype: str  # "float32" | "bfloat16": the matmuls of the forwards and of the step (weights and Adam stay fp32)
    window: int
    forward_tokens: int
    buffer_tokens: int
    dead_window: int
    aux_coefficient: float
    lr_decay: float
    corpus: str  # sha256 of the corpus (rows.corpus_fingerprint)
    massive_factor: float
    skip: bool = False
    pre_act_coefficient: float = 0.0  # a CLT's pre-activation loss (clt_objective.pre_act_loss)
    name: str = ""  # what the saved set or CLT is called: free to change on resume

    @classmethod
    def of(cls, model: Any, kind: str, hooks: list[tuple[str, str]], corpus: str, massive_factor: float,
           **arguments: Any) -> TrainConfig:
        """The configuration of a public trainer's call: its arguments by name, the model's hook widths, and the
        corpus's fingerprint; every argument checked (check_arguments), each problem a clear ValueError."""
        for pair in hooks:
            check_hooks(model, *pair)
        cfg = cls(kind=kind, model=model.name, hooks=tuple(tuple(p) for p in hooks),
                  d_in=hook_width(model, hooks[0][0]), d_out=hook_width(model, hooks[0][1]), corpus=corpus,
                  massive_factor=massive_factor,
                  **{**arguments, "dtype": dtype_name(arguments["dtype"]), "lr": float(arguments["lr"]),
                     "aux_coefficient": float(arguments["aux_coefficient"]),
                     "lr_decay": float(arguments["lr_decay"]), "skip": bool(arguments["skip"]),
                     "pre_act_coefficient": float(arguments.get("pre_act_coefficient", 0.0))})
        check_arguments(cfg)
        return cfg

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> TrainConfig:
        """From a checkpoint's header (lists back to tuples; fields added since default)."""
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{**{k: v for k, v in values.items() if k in known},
                          "hooks": tuple(tuple(p) for p in values["hooks"])})
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"a checkpoint's configuration this version cannot read ({e}); train into another "
                                  "out= folder") from e

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def coders(self) -> dict[str, tuple[tuple[str, str], ...]]:
        """The coders this run trains, by the name that prefixes their tensors in the checkpoint, each with the
        hooks it reads: "sae" or "clt" (one coder), or "L{layer}" for each layer of a PLT set."""
        if self.kind == "plt":
            return {f"L{layer_of(read)}": ((read, write),) for read, write in self.hooks}
        return {self.kind: self.hooks}


@dataclass
class Cursor:
    """Where one coder's run is: the next (pass, block, batch within the block) to train on, and how far it got."""

    epoch: int = 0
    block: int = 0
    batch: int = 0
    tokens: int = 0  # rows trained on
    steps: int = 0
    seen: int = 0  # real tokens forwarded (kept or not), this run and the ones it resumed
    finished: bool = False


def check_arguments(cfg: TrainConfig) -> None:
    """The arguments every run shares, each a clear ValueError naming it."""
    if cfg.architecture not in TRAIN_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {TRAIN_ARCHITECTURES}, got {cfg.architecture!r}")
    for name in ("d_sae", "k", "tokens", "batch_tokens", "window", "forward_tokens", "buffer_tokens"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if cfg.k > cfg.d_sae:
        raise ValueError(f"k={cfg.k} is larger than d_sae={cfg.d_sae}: {CODER_WORD[cfg.kind]} keeps k of its d_sae "
                         "features active")
    if cfg.buffer_tokens < cfg.batch_tokens:
        raise ValueError(f"buffer_tokens={cfg.buffer_tokens} must hold at least one batch "
                         f"(batch_tokens={cfg.batch_tokens})")
    if not 0 <= cfg.lr_decay <= 1:
        raise ValueError(f"lr_decay is the fraction of tokens over which the lr decays, in [0, 1]; got {cfg.lr_decay}")
    if cfg.pre_act_coefficient < 0:
        raise ValueError(f"pre_act_coefficient must be >= 0, got {cfg.pre_act_coefficient}")


def check_hooks(model: Any, hook: str, hook_out: str) -> None:
    """A hook this model lacks, or a transcoder target before its input, is a clear error here (not mid-run)."""
    check_names([hook, hook_out], model.hook_names)
    if model.hook_names.index(hook_out) < model.hook_names.index(hook):
        raise ValueError(f"hook_out {hook_out!r} runs before hook {hook!r}; a transcoder predicts a later activation "
                         "from an earlier one")
    for h in (hook, hook_out):
        if len(hook_shape(h, model.cfg, 1)) != 2:
            raise ValueError(f"hook {h!r} is not a [pos, d] activation; SAEs here read [pos, d] hooks such as "
                             "'blocks.L.hook_resid_post', 'blocks.L.mlp.hook_in' or 'blocks.L.hook_mlp_out'")


def hook_width(model: Any, hook: str) -> int:
    """d of a [pos, d] hook on this model."""
    return hook_shape(hook, model.cfg, 1)[1]


def check_same_run(out: Path, saved: TrainConfig, cfg: TrainConfig, done: int) -> None:
    """Refuse a checkpoint of another configuration, naming what differs. `name` may change (it only names the
    saved object), and so may `tokens` while every coder (`done`: the furthest one's tokens) is still before the
    learning-rate decay of both totals: up to there the schedule is the same constant, so the resumed run computes
    exactly what a run started with the new total would (a run can be shortened or extended)."""
    differ = {k: (v, getattr(cfg, k)) for k, v in asdict(saved).items() if getattr(cfg, k) != v and k != "name"}
    if set(differ) == {"tokens"} and done <= (1 - cfg.lr_decay) * min(saved.tokens, cfg.tokens):
        return
    if differ:
        what = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
        raise CheckpointError(f"{out} holds the checkpoint of another run ({what}); resume it with the same "
                              "arguments, or train into another out= folder")


def fastest_dtype(device: torch.device | str = "cpu") -> str:
    """"bfloat16" where bf16 matmuls measure >= BF16_SPEEDUP times faster than fp32 on `device`, else "float32".

    Measured at run time (`params.bf16_bulk_speedup`: one product timed once per process, the same measurement the
    app's fast (bf16) switch reads), never read off the CPU's name: the same machine kind has had CPUs where bf16
    GEMMs were several times faster (AMX) and ones where they were hundreds of times slower."""
    device = torch.device(device)
    if device.type == "cuda":
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    if device.type != "cpu":
        return "float32"
    return "bfloat16" if bf16_bulk_speedup() >= BF16_SPEEDUP else "float32"


def dtype_name(dtype: str | torch.dtype) -> str:
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", "float32": "float32", "bfloat16": "bfloat16",
             "fp32": "float32", "bf16": "bfloat16"}
    if dtype not in names:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16' (or None: measured), got {dtype!r}")
    return names[dtype]


def autocast(device: torch.device | str, dtype: str) -> contextlib.AbstractContextManager:
    """The run's matmul precision: bf16 autocast for a "bfloat16" run, nothing for "float32"."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
