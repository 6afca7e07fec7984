"""One sparse coder's objective: an SAE (it reconstructs the hook it reads), a transcoder (it predicts a later hook),
or a skip transcoder: train_sae's coder, and each layer's coder of a per-layer transcoder set.

The training forward is SAELens 6.54's TopKTrainingSAE / BatchTopKTrainingSAE (sae_lens/saes/topk_sae.py,
batchtopk_sae.py): pre-activations h = (x - b_dec) @ W_enc + b_enc (x @ W_enc + b_enc for a transcoder) are
multiplied by the decoder row norms before the top-k (`rescale_acts_by_decoder_norm`), the decoder divides them back
out, the loss is the squared error summed over d and averaged over rows, plus the AuxK loss (sparse.aux_loss). W_dec
starts with kaiming-uniform rows of norm 0.1 and W_enc = W_dec.T (drawn alike when the widths differ). BatchTopK
keeps the k*B largest activations of the whole batch and is saved as JumpReLU with a threshold measured at the end
(Objective.estimate_threshold).

Where this differs from SAELens's defaults, and why (each a documented option there too):
- inputs and targets are scaled so their mean squared norm is d ("expected_average_only_in"), and the scales are
  folded into the saved weights: a learning rate then means the same on every hook;
- b_dec starts at the mean of the first block's targets instead of 0: from 0, Adam needs thousands of steps to move
  it to the stream's mean, more than a CPU run has;
- a skip transcoder's W_skip and b_dec start at the first block's least-squares linear fit (SAELens: W_skip = 0),
  for the same reason (sparse.linear_fit).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..features.sae import SAE
from .config import TrainConfig, autocast
from .objective import Forward, Objective
from .sparse import aux_loss, batch_threshold, decode_sparse, gather, kaiming_rows, linear_fit, unit_scale


class SAEObjective(Objective):
    """One coder reading `pairs`' single (hook, hook_out); rows x, y [B, 1, d]."""

    def __init__(self, cfg: TrainConfig, pairs: tuple[tuple[str, str], ...], device: torch.device):
        super().__init__(cfg, pairs, device)
        ((self.hook, self.hook_out),) = pairs
        self.is_sae = self.hook == self.hook_out
        z = dict(dtype=torch.float32, device=device)
        P = torch.nn.Parameter
        self.W_enc = P(torch.zeros(cfg.d_in, cfg.d_sae, **z))
        self.b_enc = P(torch.zeros(cfg.d_sae, **z))
        self.W_dec = P(torch.zeros(cfg.d_sae, cfg.d_out, **z))
        self.b_dec = P(torch.zeros(cfg.d_out, **z))
        self.weights = {"W_enc": self.W_enc, "b_enc": self.b_enc, "W_dec": self.W_dec, "b_dec": self.b_dec}
        # SAELens's skip transcoder (W_skip [d_out, d_in]); last, so Adam's state indices 0-3 keep their meaning
        self.W_skip = P(torch.zeros(cfg.d_out, cfg.d_in, **z)) if cfg.skip else None
        if self.W_skip is not None:
            self.weights["W_skip"] = self.W_skip

    def initialise(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """SAELens's init, plus the scales and b_dec = mean target (module docstring), from the first block's rows."""
        cfg = self.cfg
        x, y = x[:, 0], y[:, 0]
        self.scale_in = [unit_scale(x)]
        self.scale_out = self.scale_in if self.is_sae else [unit_scale(y)]
        s_in, s_out = self.scale_in[0], self.scale_out[0]
        g = torch.Generator().manual_seed(cfg.seed)
        w = kaiming_rows(cfg.d_sae, cfg.d_out, g)
        with torch.no_grad():
            self.W_dec.copy_(w)
            self.W_enc.copy_(w.T if cfg.d_in == cfg.d_out else kaiming_rows(cfg.d_sae, cfg.d_in, g).T)
            if self.W_skip is not None:
                W_skip, b = linear_fit(x * s_in, y * s_out)
                self.W_skip.copy_(W_skip.float())
                self.b_dec.copy_(b.float())
            else:
                self.b_dec.copy_((y.double() * s_out).mean(0).float())

    def pre(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, d_sae] (times the decoder norms) and the norms [d_sae], from x [B, d_in] (training units)."""
        with autocast(x.device, self.cfg.dtype):
            x_in = x - self.b_dec if self.is_sae else x  # apply_b_dec_to_input for SAEs, not transcoders
            norms = self.W_dec.norm(dim=-1)  # [d_sae]: rescale_acts_by_decoder_norm
            return (x_in @ self.W_enc + self.b_enc).float() * norms, norms  # [B, d_in] -> [B, d_sae]

    def training_forward(self, x: torch.Tensor, y: torch.Tensor, dead: torch.Tensor) -> Forward:
        x, y = x[:, 0], y[:, 0]
        h, norms = self.pre(x)
        rows, feats, acts = self.activate(0, h)
        values = acts / gather(norms, feats)
        y_hat = decode_sparse(rows, feats, values, self.W_dec, x.shape[0]) + self.b_dec  # [B, d_out]
        if self.W_skip is not None:
            with autocast(x.device, self.cfg.dtype):
                skip = x @ self.W_skip.T  # [B, d_in] -> [B, d_out]
            y_hat = y_hat + skip.float()
        mse = (y_hat - y).pow(2).sum(-1).mean()
        aux = aux_loss(h, dead[0], y - y_hat.detach(), norms, self.W_dec, self.cfg.d_in // 2, self.cfg.aux_coefficient)
        return Forward(y_hat[:, None], [(rows, feats, acts)], {"mse": mse, "aux": aux})

    @torch.no_grad()
    def estimate_threshold(self, x: torch.Tensor) -> None:
        self.threshold[0] = batch_threshold(self.pre(x[:, 0])[0], self.cfg.k)

    def result(self, tokens: int, metadata: dict[str, Any]) -> SAE:
        """The SAE in the model's units: decoder rows folded to norm 1 (SAELens's fold_W_dec_norm, exact for TopK
        since the rows were rescaled during training) and the scales folded into the weights."""
        cfg = self.cfg
        s_in, s_out = self.scale_in[0], self.scale_out[0]
        with torch.no_grad():
            norms = self.W_dec.norm(dim=-1).clamp(min=1e-8)  # [d_sae]
            # In model units f' = f / s_out: x_hat = f' @ W_dec + b_dec / s_out, h' = (x - b_dec/s_in) @ W_enc
            # * s_in / s_out + b_enc / s_out (for an SAE s_in == s_out, so b_dec / s_in is the same vector).
            state = {"W_enc": (self.W_enc * norms).cpu() * (s_in / s_out), "b_enc": (self.b_enc * norms).cpu() / s_out,
                     "W_dec": (self.W_dec / norms[:, None]).cpu(), "b_dec": self.b_dec.cpu() / s_out}
            if self.W_skip is not None:  # y/s_out = (x s_in) @ W_skip.T / s_out
                state["W_skip"] = (self.W_skip * (s_in / s_out)).cpu()
            if cfg.architecture == "batchtopk":
                state["threshold"] = torch.full((cfg.d_sae,), float(self.threshold[0]) / s_out)
        meta = {
            "model_name": cfg.model, "training_config": asdict(cfg), "trained_on_tokens": tokens,
            "trained_on_architecture": cfg.architecture, "input_scale": s_in, "output_scale": s_out,
            "rows": "activations.sae_rows: no window's first position, no row above "
                    f"{cfg.massive_factor}x its batch's median norm",
            **metadata,
        }
        arch = "topk" if cfg.architecture == "topk" else "jumprelu"
        return SAE.from_state(state, architecture=arch, k=cfg.k, hook_name=self.hook, hook_name_out=self.hook_out,
                              apply_b_dec_to_input=self.is_sae, skip=cfg.skip, metadata=meta)
