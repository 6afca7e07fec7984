"""A cross-layer transcoder's objective (train_transcoders(kind="clt")): one coder over every layer.

Each training row is one token at every layer at once (x, y [B, n_layers, d_model]; the row builder keeps a token
where every layer keeps it). Layer L's features encode from layer L's input hook (`blocks.L.mlp.hook_in`) and decode
into the MLP output of every layer j >= L:

    h_L = (x_L @ W_enc[L] + b_enc[L]) * |W_dec[L][f]|          (rescale_acts_by_decoder_norm: the norm of feature
                                                                f's decoder over every layer it writes)
    f_L = TopK(h_L) per row, or BatchTopK (the k*B largest over the batch; saved as JumpReLU with a threshold
          measured at the end on rows from across the corpus, one per layer)
    y_j = Σ_{L ≤ j} (f_L / |W_dec[L][f]|) W_dec[L][:, j - L] + b_dec[j] (+ x_j @ W_skip[j].T)
    loss = Σ_j mean over rows of |y_j - target_j|² + Σ_L AuxK_L (dead features of layer L reconstruct the residual
           of every layer they write) (+ the pre-activation loss, pre_act_loss)

Inputs and targets are scaled per layer to mean squared norm d_model (folded into the weights when saved); W_dec rows
start at norm 0.1 with W_enc[L] their layer-L slice transposed, b_dec at the first block's mean targets, W_skip
(skip=True) at each layer's least-squares fit.

The input hook is `mlp.hook_in`, what the MLP computes from (Gemma Scope 2's choice and slmviz's PLTs'): the norm's
per-token scale is then already divided out, so one feature's encoder reads every token on one scale, where
`hook_resid_mid`'s norm grows with depth and with the attention sink's massive rows.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from ..replacement.clt import CrossLayerTranscoder, input_hook_local
from .config import TrainConfig, autocast
from .objective import Entries, Forward, Objective
from .sparse import (
    INIT_DECODER_NORM,
    aux_loss,
    batch_threshold,
    decode_sparse,
    gather,
    kaiming_rows,
    linear_fit,
    unit_scale,
)


class CLTObjective(Objective):
    """One CLT over `pairs`, one (mlp input, mlp output) pair per layer, every layer of the model."""

    def __init__(self, cfg: TrainConfig, pairs: tuple[tuple[str, str], ...], device: torch.device):
        super().__init__(cfg, pairs, device)
        n, d, f = len(pairs), cfg.d_in, cfg.d_sae
        z = dict(dtype=torch.float32, device=device)
        P = torch.nn.Parameter
        self.W_enc = P(torch.zeros(n, d, f, **z))
        self.b_enc = P(torch.zeros(n, f, **z))
        self.W_dec = [P(torch.zeros(f, n - L, d, **z)) for L in range(n)]
        self.b_dec = P(torch.zeros(n, d, **z))
        self.W_skip = P(torch.zeros(n, d, d, **z)) if cfg.skip else None  # [L, d_out, d_in]
        self.weights = {"W_enc": self.W_enc, "b_enc": self.b_enc, "b_dec": self.b_dec,
                        **{f"W_dec_{L}": w for L, w in enumerate(self.W_dec)}}
        if self.W_skip is not None:
            self.weights["W_skip"] = self.W_skip

    def initialise(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Per-layer scales, W_dec rows of norm 0.1 (over every layer a feature writes), W_enc[L] their layer-L
        slices transposed, b_dec the mean targets, W_skip each layer's least-squares fit (x, y: [n, layers, d])."""
        cfg = self.cfg
        n, d = len(self.pairs), cfg.d_in
        self.scale_in = [unit_scale(x[:, L]) for L in range(n)]
        self.scale_out = [unit_scale(y[:, L]) for L in range(n)]
        s_in = torch.tensor(self.scale_in, dtype=torch.float64)[:, None]
        s_out = torch.tensor(self.scale_out, dtype=torch.float64)[:, None]
        g = torch.Generator().manual_seed(cfg.seed)
        with torch.no_grad():
            for L in range(n):
                w = kaiming_rows(cfg.d_sae, (n - L) * d, g).view(cfg.d_sae, n - L, d)
                self.W_dec[L].copy_(w)
                e = w[:, 0]
                self.W_enc[L].copy_((e / e.norm(dim=-1, keepdim=True) * INIT_DECODER_NORM).T)
            if self.W_skip is not None:  # the fit sets every layer's b_dec too
                for L in range(n):
                    W, b = linear_fit(x[:, L] * float(s_in[L]), y[:, L] * float(s_out[L]))
                    self.W_skip[L].copy_(W.float())
                    self.b_dec[L].copy_(b.float())
            else:
                self.b_dec.copy_((y.double() * s_out.to(y.device)[None]).mean(0).float())  # [N, n, d] * [1, n, 1]

    def pre(self, x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each layer's h_L [B, d_sae] (times its decoder norms) and the norms [d_sae], from x [B, n, d]."""
        hs, norms = [], []
        with autocast(x.device, self.cfg.dtype):
            for L in range(len(self.pairs)):
                nrm = self.W_dec[L].flatten(1).norm(dim=-1)  # [d_sae]: over every layer the feature writes
                hs.append((x[:, L] @ self.W_enc[L] + self.b_enc[L]).float() * nrm)  # [B, d] -> [B, d_sae]
                norms.append(nrm)
        return hs, norms

    def decode(self, active: list[Entries], norms: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """y_hat [B, n, d]: every layer's active features decoded into the layers they write, plus b_dec and skip."""
        n, d, b = len(self.pairs), self.cfg.d_in, x.shape[0]
        y_hat = self.b_dec[None].expand(b, n, d).clone()
        for L, (rows, feats, acts) in enumerate(active):
            values = acts / gather(norms[L], feats)
            dec = decode_sparse(rows, feats, values, self.W_dec[L].flatten(1), b)  # [B, (n-L) d]
            y_hat[:, L:] = y_hat[:, L:] + dec.view(b, n - L, d)
        if self.W_skip is not None:
            with autocast(x.device, self.cfg.dtype):
                skip = torch.einsum("bli,loi->blo", x, self.W_skip)  # [B, n, d_in] -> [B, n, d_out]
            y_hat = y_hat + skip.float()
        return y_hat

    def training_forward(self, x: torch.Tensor, y: torch.Tensor, dead: torch.Tensor) -> Forward:
        cfg = self.cfg
        hs, norms = self.pre(x)
        active = [self.activate(L, h) for L, h in enumerate(hs)]
        y_hat = self.decode(active, norms, x)
        mse = (y_hat - y).pow(2).sum(-1).mean(0).sum()  # Σ_j over layers of the mean over rows
        residual = y - y_hat.detach()
        aux = sum((aux_loss(h, dead[L], residual[:, L:].flatten(1), norms[L], self.W_dec[L].flatten(1),
                            cfg.d_in // 2, cfg.aux_coefficient) for L, h in enumerate(hs)), start=y.new_zeros(()))
        pre_act = cfg.pre_act_coefficient * pre_act_loss(hs) if cfg.pre_act_coefficient else y.new_zeros(())
        return Forward(y_hat, active, {"mse": mse, "aux": aux, "pre_act": pre_act})

    @torch.no_grad()
    def estimate_threshold(self, x: torch.Tensor) -> None:
        for L, h in enumerate(self.pre(x)[0]):
            self.threshold[L] = batch_threshold(h, self.cfg.k)

    def result(self, tokens: int, metadata: dict[str, Any]) -> CrossLayerTranscoder:
        """The trained CLT in the model's units. Features keep their training scale (`n_f = |W_dec[L][f]|`, the
        norm of feature f's decoder over every layer it writes; exact for TopK, whose selection already ran on
        `h n_f`): `W_enc'[L] = W_enc[L] s_in[L] n_f`, `b_enc'[L] = b_enc[L] n_f`,
        `W_dec'[L][:, i] = W_dec[L][:, i] / (n_f s_out[L + i])`, `b_dec'[j] = b_dec[j] / s_out[j]`,
        `W_skip'[j] = W_skip[j] s_in[j] / s_out[j]`; a threshold, measured on `h n_f`, stays."""
        cfg = self.cfg
        n = len(self.pairs)
        arch = "topk" if cfg.architecture == "topk" else "jumprelu"
        meta = {"model_name": cfg.model, "training_config": asdict(cfg), "trained_on_tokens": tokens,
                "trained_on_architecture": cfg.architecture, "input_scales": self.scale_in,
                "output_scales": self.scale_out, "trained_by": "slmviz.train_transcoders(kind='clt')", **metadata}
        clt = CrossLayerTranscoder(n, cfg.d_in, cfg.d_sae, architecture=arch, k=cfg.k if arch == "topk" else None,
                                   input_hook=input_hook_local(self.pairs[0][0]), skip=cfg.skip, name=cfg.name,
                                   metadata=meta)
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
    """Σ_L mean over rows of Σ_f relu(-h_L[f]), h_L = pre-activation x decoder norm (CLTObjective.pre): Anthropic's
    pre-activation loss (Ameisen et al. 2025, "Circuit Tracing", methods: λ_p Σ relu(-h_f) |W_dec,f|).

    Why: a feature below zero on a token gets no gradient from the reconstruction (relu, then BatchTopK or TopK), so
    nothing lifts it back. A CLT's features write many layers, and early in training a selected feature that helps
    one layer and hurts the rest is pushed below zero: without this loss SmolLM2's BatchTopK CLT kept fewer and fewer
    features per token however long it trained (docs/cross-layer-transcoders.md). This term pulls every negative
    pre-activation towards zero, in proportion to how much the feature writes, so k per token stay above zero for
    BatchTopK to choose from. Left out (0), the objective is the plain BatchTopK/TopK one."""
    return sum((h.neg().relu().sum(-1).mean() for h in hs), start=hs[0].new_zeros(()))
