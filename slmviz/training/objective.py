"""What differs between the coders the one training loop trains: an objective (as SAELens's training SAEs each
supply their training forward and aux loss to one SAETrainer).

An objective owns a coder's weights, its BatchTopK thresholds and its input / output scales, and says how the coder
starts (`initialise`), what it predicts and loses on a batch (`training_forward`), how its final thresholds are
measured (`estimate_threshold`) and what object it becomes (`result`). The loop (loop.Trainer) owns the rest, written
once: Adam, the learning-rate schedule, gradient clipping, the dead-feature counters, the cursor and the checkpoint.

Two objectives: sae_objective.SAEObjective (one SAE, transcoder or skip transcoder: train_sae's, and each layer of a
PLT set) and clt_objective.CLTObjective (one cross-layer transcoder over every layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..hooks import layer_of
from .config import TrainConfig
from .sparse import active_entries

Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # active (row, feature, value) triples, grouped by row


@dataclass
class Forward:
    """A training forward's output: the prediction y_hat [B, layers, d_out], each layer's active entries, and the loss
    terms by name (the loss is their sum, in this order)."""

    y_hat: torch.Tensor
    active: list[Entries]
    losses: dict[str, torch.Tensor]


class Objective:
    """The state and the maths of one kind of coder over `pairs`, the (read, write) hooks of each layer it trains on.
    Rows come as x [B, layers, d_in], y [B, layers, d_out]; `weights` lists its parameters in Adam's order."""

    def __init__(self, cfg: TrainConfig, pairs: tuple[tuple[str, str], ...], device: torch.device):
        self.cfg, self.pairs, self.device = cfg, pairs, device
        self.layers = [layer_of(read) for read, _ in pairs]
        self.threshold = torch.zeros(len(pairs), dtype=torch.float64, device=device)  # BatchTopK's, scaled units
        self.scale_in: list[float] = []  # per layer; empty until measured on the first block (initialise)
        self.scale_out: list[float] = []
        self.weights: dict[str, torch.nn.Parameter] = {}

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return list(self.weights.values())

    @property
    def initialised(self) -> bool:
        return bool(self.scale_in) and self.scale_in[0] != 0.0

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, layers, d_in] in training units: each layer's input times its scale."""
        return x * torch.tensor(self.scale_in, device=x.device)[:, None]

    def targets(self, y: torch.Tensor) -> torch.Tensor:
        return y * torch.tensor(self.scale_out, device=y.device)[:, None]

    def activate(self, layer: int, h: torch.Tensor) -> Entries:
        """Layer `layer`'s active entries of h [B, d_sae] (sparse.active_entries), its BatchTopK threshold moved."""
        rows, feats, values, self.threshold[layer] = active_entries(h, self.cfg.architecture, self.cfg.k,
                                                                     self.threshold[layer])
        return rows, feats, values

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps: the weights and the thresholds."""
        return {**self.weights, "threshold": self.threshold}

    def restore(self, tensors: dict[str, torch.Tensor], scale_in: list[float], scale_out: list[float]) -> None:
        with torch.no_grad():
            for name, w in self.weights.items():
                w.copy_(tensors[name])
        self.threshold = tensors["threshold"].to(self.device)
        self.scale_in, self.scale_out = list(scale_in), list(scale_out)

    def initialise(self, x: torch.Tensor, y: torch.Tensor) -> None:
        raise NotImplementedError

    def training_forward(self, x: torch.Tensor, y: torch.Tensor, dead: torch.Tensor) -> Forward:
        """The prediction and loss terms on x, y (training units); `dead` [layers, d_sae]: the features the AuxK loss
        revives."""
        raise NotImplementedError

    def estimate_threshold(self, x: torch.Tensor) -> None:
        """Each layer's BatchTopK threshold measured with the final weights on x (training units: rows from across
        the corpus): the largest value below the k*n largest, so that relu(h) * 1[h > threshold] keeps k per row on
        average, as the batch-wide top-k did.

        The EMA SAELens learns (rate 0.01 from 0) is what this replaces: after n steps it holds (1 - 0.99^n) of the
        value it tracks, so a CPU run of a few hundred steps saved thresholds well below it and its JumpReLU coder
        fired several times k features per token (docs/features.md)."""
        raise NotImplementedError

    def result(self, tokens: int, metadata: dict[str, Any]) -> Any:
        """The trained coder in the model's units (the scales folded into its weights)."""
        raise NotImplementedError
